"""Recurrent (token-by-token) causal MHLA for decoding, with a relative (Toeplitz) mixing.

With m_ij = r[min(i − j, W − 1)], query chunk i reads
    P_i = Σ_{δ=1}^{W-2} r[δ] S_{i−δ} + r[W−1] · Σ_{j ≤ i−W+1} S_j + r[0] · (current chunk so far),
so the state keeps the current chunk's summary, the last W−2 closed chunk summaries and one
running sum of everything older — its size never grows with the sequence:

    floats per layer = W · B · H_kv · D · (D_v + 1)        (kept in float32)

and each token costs O(W · D · D_v), whatever its position. Outputs equal the chunkwise parallel
form (`mhla_attention(..., causal=True, chunk_size=C)` with `toeplitz_causal_mixing(r, M)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import BlockLayout
from .dispatch import select
from .feature_maps import FEATURE_MAPS, FeatureMap, resolve_feature_map
from .library import grads_by_recompute, register_recompute_autograd

_STATE_TENSORS = ("cur_s", "cur_z", "recent_s", "recent_z", "far_s", "far_z")


@dataclass
class MHLAState:
    chunk_size: int
    window: int
    position: int  # tokens consumed so far
    cur_s: torch.Tensor  # (B, H_kv, D, Dv): the open chunk
    cur_z: torch.Tensor  # (B, H_kv, D)
    recent_s: torch.Tensor  # (B, H_kv, K, D, Dv), K ≤ W − 2 closed chunks, oldest first
    recent_z: torch.Tensor  # (B, H_kv, K, D)
    far_s: torch.Tensor  # (B, H_kv, D, Dv): sum of all older closed chunks
    far_z: torch.Tensor  # (B, H_kv, D)

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.cur_s, self.cur_z, self.recent_s, self.recent_z, self.far_s, self.far_z)
        )

    def map(self, fn) -> "MHLAState":
        """Apply fn to every tensor (device moves, beam reordering)."""
        tensors = {f: fn(getattr(self, f)) for f in _STATE_TENSORS}
        return MHLAState(self.chunk_size, self.window, self.position, **tensors)


def _tensors(state: MHLAState) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(state, f) for f in _STATE_TENSORS)


def _keep(window: int) -> int:
    return max(window - 2, 0)


def init_state(
    k: torch.Tensor, v: torch.Tensor, *, chunk_size: int, window: int, feature_map: FeatureMap = "relu"
) -> MHLAState:
    """State after the prefix k, v of shape (B, L, H_kv, D) / (B, L, H_kv, Dv); L may be 0."""
    batch, length, kv_heads, dim = k.shape
    acc = torch.promote_types(k.dtype, torch.float32)
    dv = v.shape[-1]
    zeros = lambda *shape: torch.zeros(*shape, dtype=acc, device=k.device)  # noqa: E731
    if length == 0:
        s, z = zeros(batch, kv_heads, 0, dim, dv), zeros(batch, kv_heads, 0, dim)
    else:
        layout = BlockLayout.chunked(length, chunk_size)
        kb = layout.to_blocks(resolve_feature_map(feature_map)(k.to(acc)))
        s, z = kb.transpose(-1, -2) @ layout.to_blocks(v.to(acc)), kb.sum(-2)
    closed = length // chunk_size
    if length % chunk_size:
        cur_s, cur_z = s[:, :, closed], z[:, :, closed]
    else:
        cur_s, cur_z = zeros(batch, kv_heads, dim, dv), zeros(batch, kv_heads, dim)
    keep = min(_keep(window), closed)
    return MHLAState(
        chunk_size, window, length, cur_s, cur_z,
        s[:, :, closed - keep : closed], z[:, :, closed - keep : closed],
        s[:, :, : closed - keep].sum(2), z[:, :, : closed - keep].sum(2),
    )


def _grouped(relative: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """(W,) → (1, 1, W); (H, W) → (H_kv, g, W)."""
    return relative.view(1, 1, -1) if relative.dim() == 1 else relative.view(kv_heads, groups, -1)


def mhla_recurrent_step(
    state: MHLAState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, relative: torch.Tensor, *,
    feature_map: FeatureMap = "relu", normalize: bool = True, scale: float | None = None, eps: float = 1e-6,
    backend: str = "auto",
) -> tuple[torch.Tensor, MHLAState]:
    """One token: q (B, 1, H, D), k (B, 1, H_kv, D), v (B, 1, H_kv, Dv), relative (W,) or (H, W)
    → output (B, 1, H, Dv) and the new state (the old one is left untouched).

    backend: "torch", "triton" (one fused kernel per token: `kernels.recurrent_triton`) or "auto"
    (Triton on CUDA when it takes the inputs, else torch). Closing a chunk is torch either way."""
    if q.shape[1] != 1 or k.shape[1] != 1 or v.shape[1] != 1:
        raise ValueError(f"a recurrent step takes one token: q, k, v must be (B, 1, H, D); got {tuple(q.shape)}")
    if relative.shape[-1] != state.window or relative.dim() not in (1, 2):
        raise ValueError(f"relative mixing must be (W,) or (H, W) with W = {state.window}; got {tuple(relative.shape)}")
    phi = resolve_feature_map(feature_map)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if torch.compiler.is_compiling() and isinstance(feature_map, str):
        out, cur_s, cur_z = recurrent_step_op(*_tensors(state), q, k, v, relative, feature_map, normalize, scale, eps,
                                              backend)
    else:
        impl = select("step", backend, step_torch, state, q, k, v, relative, phi=phi)
        out, cur_s, cur_z = impl(state, q, k, v, relative, phi=phi, normalize=normalize, scale=scale, eps=eps)
    return out, advance(state, cur_s, cur_z)


def step_torch(state: MHLAState, q, k, v, relative, *, phi, normalize: bool, scale: float, eps: float):
    """The torch step: (output (B, 1, H, Dv) in q's dtype, new open-chunk summary and z), new tensors."""
    num, den, cur_s, cur_z = step_terms(state, q, k, v, relative, phi=phi, scale=scale)
    out = num / (den + eps) if normalize else num
    return out.reshape(q.shape[0], 1, q.shape[2], -1).to(q.dtype), cur_s, cur_z


def step_terms(state: MHLAState, q, k, v, relative, *, phi, scale: float):
    """One token's unnormalised read: numerator (B, H_kv, g, 1, Dv), denominator (B, H_kv, g, 1, 1), both in
    the state's dtype, and the open chunk's new summary and z."""
    batch, _, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    acc = state.cur_s.dtype

    fk, fv = phi(k[:, 0].to(acc)), v[:, 0].to(acc)  # (B, H_kv, D), (B, H_kv, Dv)
    cur_s = state.cur_s + fk.unsqueeze(-1) * fv.unsqueeze(-2)
    cur_z = state.cur_z + fk

    r = _grouped(relative.to(acc), kv_heads, groups)  # (·, ·, W)
    n_recent = state.recent_s.shape[2]
    w_recent = r[..., 1 : n_recent + 1].flip(-1).unsqueeze(-2)  # (·, ·, 1, K): distance K … 1
    w_far, w_self = r[..., -1, None], r[..., 0, None]  # (·, ·, 1)

    def mixed(recent, far, cur):  # → (B, H_kv, g, X)
        past = (w_recent @ recent.flatten(3).unsqueeze(2)).squeeze(-2) if n_recent else 0.0
        return past + w_far * far.flatten(2).unsqueeze(2) + w_self * cur.flatten(2).unsqueeze(2)

    fq = (phi(q[:, 0].to(acc)) * scale).view(batch, kv_heads, groups, 1, dim)
    num = fq @ mixed(state.recent_s, state.far_s, cur_s).unflatten(-1, (dim, -1))
    den = fq @ mixed(state.recent_z, state.far_z, cur_z).unsqueeze(-1)
    return num, den, cur_s, cur_z


def advance(state: MHLAState, cur_s: torch.Tensor, cur_z: torch.Tensor) -> MHLAState:
    """The state after one token whose open chunk is now (cur_s, cur_z): closes the chunk when complete."""
    position = state.position + 1
    recent_s, recent_z, far_s, far_z = state.recent_s, state.recent_z, state.far_s, state.far_z
    if position % state.chunk_size == 0:  # the chunk is complete: close it
        recent_s, recent_z = torch.cat([recent_s, cur_s.unsqueeze(2)], 2), torch.cat([recent_z, cur_z.unsqueeze(2)], 2)
        if recent_s.shape[2] > _keep(state.window):
            far_s, far_z = far_s + recent_s[:, :, 0], far_z + recent_z[:, :, 0]
            recent_s, recent_z = recent_s[:, :, 1:], recent_z[:, :, 1:]
        cur_s, cur_z = torch.zeros_like(cur_s), torch.zeros_like(cur_z)
    return MHLAState(state.chunk_size, state.window, position, cur_s, cur_z, recent_s, recent_z, far_s, far_z)


# --- the step as a PyTorch custom op (see `ops.mhla.attention_op`) ---------------------------------------------------
_STEP_ARGS = ("Tensor cur_s, Tensor cur_z, Tensor recent_s, Tensor recent_z, Tensor far_s, Tensor far_z, Tensor q, "
              "Tensor k, Tensor v, Tensor relative")
_STEP_OPTIONS = "str feature_map, bool normalize, float scale, float eps, str backend"


def _run_step(cur_s, cur_z, recent_s, recent_z, far_s, far_z, q, k, v, relative, feature_map, normalize, scale, eps,
              backend, *, impl=None):
    # the step kernels read the state's tensors, the window and the closed-chunk count; its counters are unused
    state = MHLAState(0, relative.shape[-1], 0, cur_s, cur_z, recent_s, recent_z, far_s, far_z)
    phi = FEATURE_MAPS[feature_map]
    impl = impl or select("step", backend, step_torch, state, q, k, v, relative, phi=phi)
    return impl(state, q, k, v, relative, phi=phi, normalize=normalize, scale=scale, eps=eps)


@torch.library.custom_op("mhla_convert::recurrent_step", mutates_args=(),
                         schema=f"({_STEP_ARGS}, {_STEP_OPTIONS}) -> (Tensor, Tensor, Tensor)")
def recurrent_step_op(cur_s, cur_z, recent_s, recent_z, far_s, far_z, q, k, v, relative, feature_map, normalize,
                      scale, eps, backend):
    """The step on the state's six tensors (`MHLAState` order), the feature map by name and the scale resolved:
    (output (B, 1, H, Dv) in q's dtype, the open chunk's new summary and z), new contiguous tensors."""
    out = _run_step(cur_s, cur_z, recent_s, recent_z, far_s, far_z, q, k, v, relative, feature_map, normalize, scale,
                    eps, backend)
    return tuple(t.contiguous() for t in out)


@recurrent_step_op.register_fake
def _(cur_s, cur_z, recent_s, recent_z, far_s, far_z, q, k, v, *rest):
    return tuple(torch.empty(shape, dtype=t.dtype, device=t.device)
                 for shape, t in (((*q.shape[:3], v.shape[-1]), q), (cur_s.shape, cur_s), (cur_z.shape, cur_z)))


@torch.library.custom_op(
    "mhla_convert::recurrent_step_backward", mutates_args=(),
    schema=f"(Tensor grad_out, Tensor grad_s, Tensor grad_z, {_STEP_ARGS}, bool[] needs_grad, {_STEP_OPTIONS}) "
           "-> Tensor[]",
)
def recurrent_step_backward_op(grad_out, grad_s, grad_z, *args):
    """The gradients of `recurrent_step_op` with respect to its ten tensors (zeros where `needs_grad` is False),
    through the torch step, whatever backend ran forward (the step kernel has no backward)."""
    tensors, needs_grad, options = args[:10], args[10], args[11:]
    step = lambda *inputs: _run_step(*inputs, *options, impl=step_torch)  # noqa: E731
    return list(grads_by_recompute(step, tensors, (grad_out, grad_s, grad_z), needs_grad))


@recurrent_step_backward_op.register_fake
def _(grad_out, grad_s, grad_z, *args):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in args[:10]]


register_recompute_autograd(recurrent_step_op, recurrent_step_backward_op, saved=10, differentiable=10)
