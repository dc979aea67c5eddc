"""Multi-Head Linear Attention: the public operator and its PyTorch implementation.

Semantics (paper §4, App. C), the contract every backend must meet:

    w_ts = mixing[b(t), b(s)] · scale · φ(q_t)·φ(k_s)       over all s   (s ≤ t when causal)
    o_t  = Σ_s w_ts v_s / (Σ_s w_ts + eps)                  (no denominator if normalize=False)

Under torch.compile the operator is one custom op, `torch.ops.mhla_convert.attention` (see
`attention_op`; with an exact local region `torch.ops.mhla_convert.exact_attention`), so a converted model
traces whole whatever backend runs inside it. Inference calls whose backend has a traceable form (the Triton
kernels, non-causal, fixed shapes) become that form instead, whose kernels inductor launches itself.

The torch path never forms w: it builds one key–value summary per block (S_b = Σ φ(k) vᵀ,
z_b = Σ φ(k)), mixes them with one GEMM (S̃_i = Σ_b m_ib S_b) and reads each query out against its
block's mixture — O(N·d² + M²·d²). The causal path is the chunkwise form: closed chunks enter
through the strictly-lower part of the mixing, the query's own chunk through a masked C×C product
weighted by the diagonal.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Literal

import torch

from .blocks import BlockLayout, as_axes
from .dispatch import available_backends, select, traced_of
from .exact_blocks import exact_radius_axes
from .exact_op import exact_attention
from .feature_maps import (
    FEATURE_MAPS,
    LEARNED_FEATURE_MAPS,
    FeatureMap,
    check_feature_map,
    drop_keys,
    resolve_feature_map,
)
from .library import backend_grads, register_attention_op

Backend = Literal["auto", "torch", "triton"]
# Names always accepted as options: a model saved for "triton" still loads where Triton is missing
# (its first call then says so); other names must be registered backends.
BACKEND_NAMES = ("auto", "torch", "triton")


def check_options(*, feature_map, normalize, scale, eps, backend) -> None:
    """Refuse operator options that would fail at the first call or give silently wrong numbers
    (a negative eps or scale flips or blows up the normaliser)."""
    check_feature_map(feature_map)
    if not isinstance(normalize, bool):
        raise ValueError(f"normalize must be true or false; got {normalize!r}")
    if scale is not None and not (_real(scale) and scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number > 0, or None for D ** -0.5; got {scale!r}")
    if not (_real(eps) and eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number > 0 (e.g. 1e-6); got {eps!r}")
    if backend not in BACKEND_NAMES and (not isinstance(backend, str) or backend not in available_backends()):
        names = ["auto", *sorted(set(BACKEND_NAMES[1:]) | set(available_backends()))]
        raise ValueError(f"backend must be one of {names}; got {backend!r}")


def _real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def check_inputs(q, k, v, mixing, *, grid, blocks, causal, chunk_size=None) -> BlockLayout:
    """Validate types and shapes (never values: no device sync) and return the block layout."""
    for name, t in (("q", q), ("k", k), ("v", v), ("mixing", mixing)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            what = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating-point torch.Tensor; got {what}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, N, H, D); got shape {tuple(t.shape)}")
    batch, n, heads, dim = q.shape
    if k.shape[:2] != (batch, n) or k.shape[3] != dim:
        raise ValueError(f"k must be (B={batch}, N={n}, H_kv, D={dim}); got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be (B={batch}, N={n}, H_kv={k.shape[2]}, D_v); got {tuple(v.shape)}")
    if heads % k.shape[2]:
        raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({k.shape[2]})")
    if not (q.device == k.device == v.device == mixing.device):
        raise ValueError(f"q, k, v and mixing must be on one device; got {q.device}, {k.device}, {v.device}, "
                         f"{mixing.device} (move them with .to(q.device))")
    if causal:
        if grid is not None and len(as_axes("grid", grid)) != 1:
            raise ValueError(f"causal attention needs a 1-D grid (N,); got grid {grid}")
        if chunk_size is not None:
            if blocks is not None:
                raise ValueError("give either blocks or chunk_size for causal attention, not both")
            layout = BlockLayout.chunked(n, chunk_size)
        else:
            layout = BlockLayout.create(grid if grid is not None else (n,), blocks)
    else:
        if chunk_size is not None:
            raise ValueError("chunk_size is only for causal attention; use blocks")
        if grid is None:
            raise ValueError("grid is required for non-causal attention: (N,), (H, W) or (T, H, W)")
        layout = BlockLayout.create(grid, blocks)
    if layout.num_tokens != n:
        raise ValueError(f"prod(grid) must equal N={n}; got grid {layout.grid} (prod {layout.num_tokens})")
    m = layout.num_blocks
    if tuple(mixing.shape) not in ((m, m), (heads, m, m)):
        raise ValueError(
            f"mixing must be (M, M) = ({m}, {m}) or (H, M, M) = ({heads}, {m}, {m}); got {tuple(mixing.shape)}"
        )
    return layout


def mhla_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mixing: torch.Tensor, *, grid=None, blocks=None,
    causal: bool = False, chunk_size: int | None = None, feature_map: FeatureMap = "relu", normalize: bool = True,
    scale: float | None = None, eps: float = 1e-6, exact_chunks: int = 0, exact_radius=None,
    key_mask: torch.Tensor | None = None, backend: Backend = "auto",
) -> torch.Tensor:
    """Multi-Head Linear Attention.

    Args:
        q, k, v: (B, N, H, D), (B, N, H_kv, D), (B, N, H_kv, D_v), projected and before φ.
            H_kv must divide H (GQA: query head h reads k/v head h // (H / H_kv)).
        mixing: non-negative (M, M), or (H, M, M) per head; row i weights the key-block
            summaries read by query block i. Only the lower triangle is read when causal.
        grid: token grid in row-major order, (N,), (H, W) or (T, H, W); prod(grid) == N.
        blocks: blocks per grid axis; M = prod(blocks). Axis length L in b blocks has block size
            ceil(L / b); the last block may be smaller.
        causal: causal attention over a 1-D grid; blocks are then chunks.
        chunk_size: causal only, instead of `blocks`: chunks of exactly this many tokens, so
            chunk boundaries stay put as the sequence grows (what decoding needs).
        feature_map: "relu", "elu" (elu + 1) or a callable, such as a layer's learned `HedgehogFeatureMap`.
        normalize: divide by Σ_s w_ts + eps; False returns the numerator alone.
        scale: multiplies φ(q)·φ(k); default D ** -0.5.
        exact_chunks: causal only: the query's own chunk and the `exact_chunks − 1` before it are read
            with the softmax kernel exp(q·k / √D) instead of φ(q)·φ(k) (`ops.exact_local`); 0 = pure MHLA.
            Always normalised.
        exact_radius: non-causal only: each query block's neighbourhood — the blocks within `exact_radius` of it
            along every grid axis (a whole number, or one per axis; 0 = its own block) — is read with the softmax
            kernel instead of φ(q)·φ(k) (`ops.exact_blocks`); None = pure MHLA. Always normalised.
        key_mask: (B, N) bool, False for padding: those keys get weight 0 (built-in feature maps).
        backend: "torch", "triton" or "auto" (fastest available for these inputs).

    Returns (B, N, H, D_v) in q's dtype; accumulation is float32 for half-precision inputs.
    """
    layout = check_inputs(q, k, v, mixing, grid=grid, blocks=blocks, causal=causal, chunk_size=chunk_size)
    if not torch.compiler.is_compiling():  # traced calls come from layers whose MHLAConfig checked these
        check_options(feature_map=feature_map, normalize=normalize, scale=scale, eps=eps, backend=backend)
    phi = resolve_feature_map(feature_map)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if key_mask is not None and (key_mask.shape != q.shape[:2] or key_mask.dtype != torch.bool):
        raise ValueError(f"key_mask must be a (B, N) = {tuple(q.shape[:2])} bool tensor; got {key_mask.dtype} "
                         f"{tuple(key_mask.shape)}")
    if exact_chunks:
        if not causal or not normalize or exact_chunks < 0:
            raise ValueError(f"exact_chunks={exact_chunks} needs causal=True, normalize=True and a count ≥ 0")
        return exact_attention(q, k, v, mixing, layout, causal=True, exact=(exact_chunks,), feature_map=feature_map,
                               phi=phi, scale=scale, eps=eps, key_mask=key_mask, backend=backend)
    if exact_radius is not None:
        if causal or not normalize:
            raise ValueError(f"exact_radius={exact_radius} needs causal=False and normalize=True "
                             "(causal layers read their nearest chunks exactly with exact_chunks)")
        radius = exact_radius_axes(exact_radius, len(layout.grid))
        return exact_attention(q, k, v, mixing, layout, causal=False, exact=radius, feature_map=feature_map, phi=phi,
                               scale=scale, eps=eps, key_mask=key_mask, backend=backend)
    if key_mask is not None and isinstance(feature_map, tuple(LEARNED_FEATURE_MAPS.values())):
        raise ValueError("key_mask with a learned feature map needs an exact region (exact_chunks / exact_radius): "
                         "plain MHLA drops padded keys the fixed maps' way")
    k = drop_keys(k, key_mask)
    if torch.compiler.is_compiling() and isinstance(feature_map, str):
        out = _traced_inference(q, k, v, mixing, layout, causal=causal, phi=phi, feature_map=feature_map,
                                normalize=normalize, scale=scale, eps=eps, backend=backend)
        if out is not None:
            return out
        return attention_op(q, k, v, mixing, layout.grid, layout.blocks, layout.block_size, causal, feature_map,
                            normalize, scale, eps, backend)
    impl = select("attention", backend, mhla_attention_torch, q, k, v, mixing, layout, causal=causal, phi=phi)
    return impl(q, k, v, mixing, layout, causal=causal, phi=phi, normalize=normalize, scale=scale, eps=eps)


def _traced_inference(q, k, v, mixing, layout, *, causal, phi, feature_map, normalize, scale, eps, backend):
    """Inside a graph torch.compile traces, an inference call whose backend has a traceable form (`dispatch.register`'s
    `traced`, e.g. the Triton kernels as a `torch.library.triton_op`, which inductor launches without the opaque op's
    host time): that form's output, or None, where the graph calls the opaque `attention_op`."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, mixing)):
        return None
    traced = traced_of(select("attention", backend, mhla_attention_torch, q, k, v, mixing, layout, causal=causal,
                              phi=phi))
    if traced is None:
        return None
    return traced(q, k, v, mixing, layout, causal=causal, feature_map=feature_map, normalize=normalize, scale=scale,
                  eps=eps)


def _grouped_mixing(mixing: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """(M, M) → (1, 1, M, M); (H, M, M) → (H_kv, g, M, M): broadcastable against grouped heads."""
    m = mixing.shape[-1]
    if mixing.dim() == 2:
        return mixing.view(1, 1, m, m)
    return mixing.view(kv_heads, groups, m, m)


def mhla_attention_torch(q, k, v, mixing, layout: BlockLayout, *, causal, phi, normalize, scale, eps):
    """The PyTorch backend: block summaries → one mixing GEMM → readout (chunkwise when causal)."""
    batch, _, heads, _ = q.shape
    kv_heads, groups, dv = k.shape[2], heads // k.shape[2], v.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    m, t = layout.num_blocks, layout.tokens_per_block

    # φ before padding: padded slots stay exactly zero, whatever φ(0) is.
    qb = layout.to_blocks(phi(q.to(acc)) * scale).view(batch, kv_heads, groups, m, t, -1)
    kb = layout.to_blocks(phi(k.to(acc))).unsqueeze(2)  # (B, H_kv, 1, M, T, D)
    vb = layout.to_blocks(v.to(acc)).unsqueeze(2)  # (B, H_kv, 1, M, T, Dv)
    mix = _grouped_mixing(mixing.to(acc), kv_heads, groups)

    s = kb.transpose(-1, -2) @ vb  # (B, H_kv, 1, M, D, Dv)
    z = kb.sum(-2)  # (B, H_kv, 1, M, D)
    if causal:
        mix, diag = mix.tril(-1), mix.diagonal(dim1=-2, dim2=-1)[..., None, None]
    s_mix = torch.matmul(mix, s.flatten(-2)).unflatten(-1, s.shape[-2:])  # (B, H_kv, g, M, D, Dv)
    num = qb @ s_mix
    if normalize:
        den = qb @ torch.matmul(mix, z).unsqueeze(-1)  # (B, H_kv, g, M, T, 1)
    if causal:
        a = (qb @ kb.transpose(-1, -2)).tril() * diag  # intra-chunk weights, (B, H_kv, g, M, T, T)
        num = num + a @ vb
        if normalize:
            den = den + a.sum(-1, keepdim=True)
    out = num / (den + eps) if normalize else num
    return layout.from_blocks(out.reshape(batch, heads, m, t, dv)).to(q.dtype)


# --- the operator as a PyTorch custom op --------------------------------------------------------------------------
# torch.compile sees one opaque node per call, with a fake (shape-only) implementation for tracing and a backward
# op; the backend is chosen inside, at run time, so no logging or kernel cache is ever traced. (Inference calls that
# a backend's traced form takes, `_traced_inference`, are the exception: their backend is chosen while tracing.)
# Eager calls keep the direct path (`mhla_attention`), which skips the dispatcher's host time; callable feature maps,
# which no op schema can carry, are traced inline.
# (SymInt: a dynamic token count stays symbolic, so one graph serves every length)
_ARGS = ("SymInt[] grid, SymInt[] blocks, SymInt[] block_size, bool causal, str feature_map, bool normalize, "
         "float scale, float eps, str backend")


def _backend(q, k, v, mixing, grid, blocks, block_size, causal, feature_map, backend):
    """(implementation, layout, φ) for the op's arguments."""
    layout = BlockLayout(tuple(grid), tuple(blocks), tuple(block_size))
    phi = FEATURE_MAPS[feature_map]
    impl = select("attention", backend, mhla_attention_torch, q, k, v, mixing, layout, causal=causal, phi=phi)
    return impl, layout, phi


@torch.library.custom_op("mhla_convert::attention", mutates_args=(),
                         schema=f"(Tensor q, Tensor k, Tensor v, Tensor mixing, {_ARGS}) -> Tensor")
def attention_op(q, k, v, mixing, grid, blocks, block_size, causal, feature_map, normalize, scale, eps, backend):
    """`mhla_attention` on checked inputs: the layout as (grid, blocks, block_size) of a `BlockLayout`, the
    feature map by name, the scale resolved. Output (B, N, H, D_v), contiguous, in q's dtype."""
    impl, layout, phi = _backend(q, k, v, mixing, grid, blocks, block_size, causal, feature_map, backend)
    return impl(q, k, v, mixing, layout, causal=causal, phi=phi, normalize=normalize, scale=scale, eps=eps).contiguous()


@torch.library.custom_op(
    "mhla_convert::attention_backward", mutates_args=(),
    schema=f"(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor mixing, bool[] needs_grad, {_ARGS}) "
           "-> (Tensor, Tensor, Tensor, Tensor)",
)
def attention_backward_op(grad, q, k, v, mixing, needs_grad, grid, blocks, block_size, causal, feature_map,
                          normalize, scale, eps, backend):
    """(dq, dk, dv, dmixing) of `attention_op`, from the inputs alone (`library.backend_grads`)."""
    impl, layout, phi = _backend(q, k, v, mixing, grid, blocks, block_size, causal, feature_map, backend)
    options = dict(causal=causal, phi=phi, normalize=normalize, scale=scale, eps=eps)
    return backend_grads(impl, grad, (q, k, v, mixing), layout, options, needs_grad)


register_attention_op(attention_op, attention_backward_op, saved=4, differentiable=4)
