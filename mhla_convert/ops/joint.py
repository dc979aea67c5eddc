"""Joint text–image MHLA for MM-DiT transformers (FLUX, Qwen-Image), whose attention runs over the text tokens and
the image tokens together, concatenated text first.

The L text tokens are few and carry the prompt, so every query reads them exactly, with the softmax kernel; the N
image tokens lie on a token grid split into M blocks, read as in `mhla_attention` (summaries, and with `exact_radius`
each query block's neighbourhood exactly). The text tokens are one more block, index M, of an (M + 1, M + 1) mixing:

    image query t in block i, image key s in block j:  w_ts = m_ij · exp(q_t·k_s / √D)     if j ∈ E(i)
                                                              m_ij · scale·φ(q_t)·φ(k_s)  otherwise
    image query t in block i, text key s:              w_ts = m_iM · exp(q_t·k_s / √D)
    text query t, image key s in block j:              w_ts = m_Mj · scale·φ(q_t)·φ(k_s)
    text query t, text key s:                          w_ts = m_MM · exp(q_t·k_s / √D)

    o_t = Σ_s w_ts v_s / (Σ_s w_ts + eps)

so each row, text or image, is one normalised distribution over all L + N keys: the mixing learns how much the text,
the neighbourhood and the summaries count against each other. With `text_exact=False` the text keys are read like the
image blocks outside the region instead: through one more summary (block M), w_ts = m_iM · scale·φ(q_t)·φ(k_s) for
every query — plain MHLA over the concatenation with the text as a block of its own, the design the default is
measured against (benchmarks/fidelity.py, `--kinds joint`). Text queries read the image through the summaries
mixed by row M (one query block of their own); `text_mask` (B, L) bool drops padded text keys. Cost:
O((L + N)·d² + M²·d² + N·(K·T + L)·d + L²·d) for K neighbourhood blocks of T tokens.

`joint_attention` dispatches as op "joint" (`ops.dispatch`): the torch path here, and for inference with an exact
region on CUDA `kernels.joint_triton`, whose exact-block kernels read the text in the image rows' softmax and run
the text rows in the same launch.
Under torch.compile it is one custom op (`joint_attention_op`) whose backward runs the torch path again.
"""

from __future__ import annotations

import torch

from .blocks import BlockLayout
from .dispatch import select
from .exact_blocks import block_summaries, exact_mask, exact_radius_axes, far_reads, grouped_mixing, near_read
from .exact_local import read_window
from .feature_maps import FEATURE_MAPS, FeatureMap, resolve_feature_map
from .library import grads_by_recompute, register_attention_op
from .mhla import check_inputs, check_options


def check_joint_inputs(q, k, v, mixing, *, text: int, grid, blocks, text_mask=None) -> BlockLayout:
    """Validate shapes (as `check_inputs`, on the image tokens) and return the image tokens' block layout."""
    if not (isinstance(text, int) and 0 < text < q.shape[1]):
        raise ValueError(f"text must be the number of text tokens, in [1, {q.shape[1] - 1}]; got {text!r}")
    if not isinstance(mixing, torch.Tensor) or mixing.dim() not in (2, 3) or mixing.shape[-1] != mixing.shape[-2]:
        raise ValueError("mixing must be a square (M + 1, M + 1) or (H, M + 1, M + 1) tensor (index M: the text)")
    image = (slice(None), slice(text, None))
    layout = check_inputs(q[image], k[image], v[image], mixing[..., :-1, :-1], grid=grid, blocks=blocks, causal=False)
    if text_mask is not None and (text_mask.shape != (q.shape[0], text) or text_mask.dtype != torch.bool):
        raise ValueError(f"text_mask must be a (B, L) = {(q.shape[0], text)} bool tensor; got {text_mask.dtype} "
                         f"{tuple(text_mask.shape)}")
    return layout


def joint_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mixing: torch.Tensor, *, text: int, grid, blocks,
    exact_radius=None, feature_map: FeatureMap = "relu", scale: float | None = None, eps: float = 1e-6,
    text_mask: torch.Tensor | None = None, text_exact: bool = True, backend: str = "auto",
) -> torch.Tensor:
    """Joint MHLA (module doc). q, k, v: (B, L + N, H, D) / (B, L + N, H_kv, D) / (B, L + N, H_kv, D_v), the `text`
    = L text tokens first, then the N image tokens of `grid` in row-major order; mixing (M + 1, M + 1) or
    (H, M + 1, M + 1), M = prod(blocks), index M the text; exact_radius as `mhla_attention`'s (None: the image keys
    only through summaries); text_mask (B, L) bool, False for padding; text_exact False: the text keys through
    their summary (module doc). → (B, L + N, H, D_v) in q's dtype.

    `backend` as `mhla_attention`'s (op "joint" of `ops.dispatch`): "auto" takes the Triton inference path
    (`kernels.joint_triton`) for CUDA inputs it supports when no gradient is needed, the torch path otherwise."""
    layout = check_joint_inputs(q, k, v, mixing, text=text, grid=grid, blocks=blocks, text_mask=text_mask)
    check_options(feature_map=feature_map, normalize=True, scale=scale, eps=eps, backend=backend)
    if not isinstance(text_exact, bool):
        raise ValueError(f"text_exact must be true or false; got {text_exact!r}")
    phi = resolve_feature_map(feature_map)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    radius = None if exact_radius is None else exact_radius_axes(exact_radius, len(layout.grid))
    if torch.compiler.is_compiling() and isinstance(feature_map, str):
        return joint_attention_op(q, k, v, mixing, text_mask, layout.grid, layout.blocks, layout.block_size, text,
                                  [] if radius is None else list(radius), feature_map, scale, eps, text_exact,
                                  backend)
    impl = select("joint", backend, joint_attention_torch, q, k, v, mixing, layout, text=text, exact_radius=radius,
                  phi=phi, text_mask=text_mask, text_exact=text_exact)
    return impl(q, k, v, mixing, layout, text=text, exact_radius=radius, phi=phi, scale=scale, eps=eps,
                text_mask=text_mask, text_exact=text_exact)


def text_window(x: torch.Tensor) -> torch.Tensor:
    """Text keys or values (B, L, H_kv, X) → (B, H_kv, 1, 1, L, X), a window every query block reads."""
    return x.permute(0, 2, 1, 3)[:, :, None, None]


def real_text(text_mask: torch.Tensor | None, batch: int, text: int, device) -> torch.Tensor:
    """(B, 1, 1, 1, 1, L) bool: the text keys that are not padding."""
    real = torch.ones(batch, text, dtype=torch.bool, device=device) if text_mask is None else text_mask
    return real[:, None, None, None, None]


def text_summary(kt, vt, text_mask, phi) -> tuple[torch.Tensor, torch.Tensor]:
    """The text keys as one block summary (`block_summaries`), padded keys left out: (B, H_kv, 1, D, Dv), (…, D)."""
    kf = phi(kt) if text_mask is None else phi(kt) * text_mask[:, :, None, None]
    return block_summaries(kf.permute(0, 2, 1, 3).unsqueeze(2), vt.permute(0, 2, 1, 3).unsqueeze(2))


def text_rows(qt, kt, vt, s, z, mix, real, *, phi, scale, eps) -> torch.Tensor:
    """The text queries' outputs (B, L, H, Dv): one query block of their own, row M of the grouped mixing `mix`,
    reading the summaries s, z (`block_summaries`): the image's M blocks, and the text keys exactly; or M + 1 blocks,
    the last the text's (`text_summary`), and nothing exactly."""
    batch, text, heads, _ = qt.shape
    kv_heads, groups, m = kt.shape[2], heads // kt.shape[2], mix.shape[-1] - 1
    qtf = (phi(qt) * scale).permute(0, 2, 1, 3).reshape(batch, kv_heads, groups, 1, text, -1)
    num, den = far_reads(qtf, s, z, mix[..., m:, :s.shape[2]])
    if s.shape[2] > m:
        return (num / (den + eps)).reshape(batch, heads, text, -1).transpose(1, 2)
    qtr = qt.permute(0, 2, 1, 3).reshape(batch, kv_heads, groups, 1, text, -1)
    self_text = mix[..., m:, m:, None]  # (·, ·, 1, 1, 1)
    out = read_window(num, den, qtr, text_window(kt), text_window(vt), self_text, real & (self_text > 0), eps=eps)
    return out.reshape(batch, heads, text, -1).transpose(1, 2)


def joint_attention_torch(q, k, v, mixing, layout: BlockLayout, *, text: int, exact_radius, phi, scale, eps,
                          text_mask=None, text_exact: bool = True) -> torch.Tensor:
    """The torch path of `joint_attention` (checked inputs, `exact_radius` one per grid axis or None)."""
    batch, _, heads, _ = q.shape
    kv_heads, groups, dv = k.shape[2], heads // k.shape[2], v.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    m, t = layout.num_blocks, layout.tokens_per_block
    mix = grouped_mixing(mixing.to(acc), kv_heads, groups)  # (·, ·, M + 1, M + 1)
    dtype, (q, k, v) = q.dtype, (t.to(acc) for t in (q, k, v))
    qt, kt, vt, qi, ki, vi = q[:, :text], k[:, :text], v[:, :text], q[:, text:], k[:, text:], v[:, text:]
    kw, vw = text_window(kt), text_window(vt)
    real = real_text(text_mask, batch, text, q.device)

    # image keys (and the text's, when it is not read exactly): block summaries; the image queries' reads of them,
    # then of their neighbourhood and the text
    s, z = block_summaries(layout.to_blocks(phi(ki)), vb := layout.to_blocks(vi))
    if not text_exact:
        st, zt = text_summary(kt, vt, text_mask, phi)
        s, z = torch.cat([s, st], 2), torch.cat([z, zt], 2)
    image_mix, far = mix[..., :m, :m], mix[..., :m, :s.shape[2]]
    if exact_radius is not None:
        region = exact_mask(layout.blocks, exact_radius, q.device)
        far = far.masked_fill(torch.nn.functional.pad(region, (0, s.shape[2] - m)), 0.0)
    qf = layout.to_blocks(phi(qi) * scale).view(batch, kv_heads, groups, m, t, -1)
    num, den = far_reads(qf, s, z, far)
    to_text = mix[..., :m, m:, None].expand(*mix.shape[:-2], m, 1, text)  # (·, ·, M, 1, L)
    extra = (kw, vw, to_text, real & (to_text > 0)) if text_exact else None
    if exact_radius is not None:
        image_out = near_read(num, den, qi, ki, vb, image_mix, layout, exact_radius, real=None, eps=eps, extra=extra)
    elif text_exact:
        qr = layout.to_blocks(qi).view(batch, kv_heads, groups, m, t, -1)
        image_out = read_window(num, den, qr, *extra, eps=eps)
    else:
        image_out = num / (den + eps)
    image_out = layout.from_blocks(image_out.reshape(batch, heads, m, t, dv))  # (B, N, H, Dv)
    text_out = text_rows(qt, kt, vt, s, z, mix, real, phi=phi, scale=scale, eps=eps)
    return torch.cat([text_out, image_out], 1).to(dtype)


# --- as one PyTorch custom op under torch.compile (as `ops.exact_op`) -----------------------------------------------
_ARGS = ("SymInt[] grid, SymInt[] blocks, SymInt[] block_size, int text, int[] exact, str feature_map, float scale, "
         "float eps, bool text_exact, str backend")


def _options(text_mask, grid, blocks, block_size, text, exact, feature_map, scale, eps,
             text_exact) -> tuple[BlockLayout, dict]:
    """The op's arguments as (layout, the implementations' keywords); `exact` empty: no exact region."""
    layout = BlockLayout(tuple(grid), tuple(blocks), tuple(block_size))
    return layout, dict(text=text, exact_radius=tuple(exact) or None, phi=FEATURE_MAPS[feature_map], scale=scale,
                        eps=eps, text_mask=text_mask, text_exact=text_exact)


@torch.library.custom_op("mhla_convert::joint_attention", mutates_args=(),
                         schema=f"(Tensor q, Tensor k, Tensor v, Tensor mixing, Tensor? text_mask, {_ARGS}) -> Tensor")
def joint_attention_op(q, k, v, mixing, text_mask, grid, blocks, block_size, text, exact, feature_map, scale, eps,
                       text_exact, backend):
    """`joint_attention` on checked inputs: the layout as (grid, blocks, block_size) of a `BlockLayout`, the feature
    map by name. Output (B, L + N, H, D_v), contiguous, in q's dtype."""
    layout, options = _options(text_mask, grid, blocks, block_size, text, exact, feature_map, scale, eps, text_exact)
    impl = select("joint", backend, joint_attention_torch, q, k, v, mixing, layout, text=text,
                  exact_radius=options["exact_radius"], phi=options["phi"], text_mask=text_mask, text_exact=text_exact)
    return impl(q, k, v, mixing, layout, **options).contiguous()


@torch.library.custom_op(
    "mhla_convert::joint_attention_backward", mutates_args=(),
    schema=f"(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor mixing, Tensor? text_mask, bool[] needs_grad, {_ARGS}) "
           "-> (Tensor, Tensor, Tensor, Tensor)",
)
def joint_attention_backward_op(grad, q, k, v, mixing, text_mask, needs_grad, grid, blocks, block_size, text, exact,
                                feature_map, scale, eps, text_exact, backend):
    """(dq, dk, dv, dmixing) of `joint_attention_op`: the torch path again under `torch.func.vjp` (the Triton path
    is for inference only)."""
    layout, options = _options(text_mask, grid, blocks, block_size, text, exact, feature_map, scale, eps, text_exact)
    return grads_by_recompute(lambda *xs: (joint_attention_torch(*xs, layout, **options),), (q, k, v, mixing),
                              (grad,), needs_grad)


register_attention_op(joint_attention_op, joint_attention_backward_op, saved=5, differentiable=4)
