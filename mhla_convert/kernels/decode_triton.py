"""The Triton backends of a causal layer's decoding state (`ops.recurrent.DecodeState`).

- The step ("decode" op): one launch per layer and token, `_decode_step_kernel`, reads the token's output and
  updates the state in place (the open chunk, a chunk close with its rollback copies, the ring of recent keys
  and values). It is the custom op `torch.ops.mhla_convert.decode_step` (`torch.library.triton_op`), so
  torch.compile sees the kernel and CUDA graphs capture it; the row positions it reads are advanced by the caller.
- The prompt ("prompt" op): `_older_sums_kernel` sums φ(k) vᵀ over each row's older tokens, reading k and v once
  in their own dtype, where torch would first copy both to float32 and permute them for a batched product; then
  `_prompt_state_kernel` sums the chunks the state keeps apart and writes every state tensor, the ring included."""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from . import mhla_kernels as K
from . import mhla_triton as MT
from . import settings

_STATE = ("cur_s", "cur_z", "recent_s", "recent_z", "far_s", "far_z", "back_recent_s", "back_recent_z", "back_far_s",
          "back_far_z", "ring_k", "ring_v", "arrivals")


def decode_unsupported_reason(state, q, k, v, relative, *, phi) -> str | None:
    """Why this step needs the torch path, or None when the kernel takes it. (The feature map is read from the
    state by name, which torch.compile traces: not from `phi`.)"""
    if state.feature_map not in MT.KERNEL_FEATURE_MAPS:
        return f"feature map {state.feature_map!r} (kernels know {', '.join(MT.KERNEL_FEATURE_MAPS)})"
    reason = MT.dtypes_reason(q, k, v) or MT.device_reason(q) or MT.head_dims_reason(q, v)
    if reason:
        return reason
    if state.cur_s.dtype != torch.float32:
        return f"a {state.cur_s.dtype} state (kernels keep float32 summaries)"
    if state.keep == 0:
        return f"a window of {state.window} (the kernel needs at least one closed summary, a window ≥ 3)"
    if not relative.is_floating_point():
        return f"relative mixing of dtype {relative.dtype}"
    if not all(getattr(state, name).is_contiguous() for name in _STATE):
        return "a state with non-contiguous tensors"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, relative)):
        return "inputs that need gradients (the kernel has no backward)"
    return None


def decode_supports(state, q, k, v, relative, *, phi) -> bool:
    return q.is_cuda and decode_unsupported_reason(state, q, k, v, relative, phi=phi) is None


def decode_step_triton(state, q, k, v, real, relative, *, normalize: bool, scale: float, eps: float) -> torch.Tensor:
    """q (B, 1, H, D), k (B, 1, H_kv, D), v (B, 1, H_kv, Dv), real (B,) bool or None → output (B, 1, H, Dv);
    `state`'s summaries and ring are updated in place, its `position` is not."""
    reason = decode_unsupported_reason(state, q, k, v, relative, phi=state.phi)
    if reason is not None:
        raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return decode_step_op(
        q, k, v, relative.contiguous(), state.position, state.position if real is None else real,
        *(getattr(state, name) for name in _STATE), state.chunk_size, state.exact_chunks,
        MT.KERNEL_FEATURE_MAPS[state.feature_map], normalize, real is not None, float(scale), float(eps),
    )


@triton_op("mhla_convert::decode_step", mutates_args=_STATE)
def decode_step_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, relative: torch.Tensor, position: torch.Tensor,
    real: torch.Tensor, cur_s: torch.Tensor, cur_z: torch.Tensor, recent_s: torch.Tensor, recent_z: torch.Tensor,
    far_s: torch.Tensor, far_z: torch.Tensor, back_recent_s: torch.Tensor, back_recent_z: torch.Tensor,
    back_far_s: torch.Tensor, back_far_z: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor,
    arrivals: torch.Tensor, chunk_size: int, exact_chunks: int, feature_map: int, normalize: bool, has_real: bool,
    scale: float, eps: float,
) -> torch.Tensor:
    """The kernel on a `DecodeState`'s tensors (`_STATE` order; contiguous, float32 summaries), the feature map by
    kernel id; `real` is read only with `has_real`. Returns the output (B, 1, H, Dv) in q's dtype."""
    batch, _, heads, dim = q.shape
    kv_heads, dv = k.shape[2], v.shape[-1]
    groups = heads // kv_heads
    bg, bd, bdv = MT.next_power_of_2(groups), MT.next_power_of_2(dim), MT.next_power_of_2(dv)
    warps, elements, columns = settings.SETTINGS.decode_launches[MT._p2(max(dim, dv))]
    bdv = min(bdv, columns)
    bk = max(1, min(bd, elements // (bg * bdv)))  # (query heads, D slice, Dv) products per summary
    bt = max(1, min(64, elements // (bg * max(bd, bdv))))  # window tokens per pass
    splits = MT._cdiv(dv, bdv)
    out = MT._new(batch, 1, heads, dv, device=q.device, dtype=q.dtype)
    wrap_triton(K._decode_step_kernel)[(batch * kv_heads, splits)](
        q, k, v, relative, position, real, cur_s, cur_z, recent_s, recent_z, far_s, far_z, back_recent_s,
        back_recent_z, back_far_s, back_far_z, ring_k, ring_v, arrivals, out, q.stride(0), q.stride(2), k.stride(0),
        k.stride(2), v.stride(0), v.stride(2), kv_heads, groups, relative.shape[-1] if relative.dim() == 2 else 0,
        ring_k.shape[1], scale, eps, W=relative.shape[-1], D=dim, DV=dv, NREC=recent_s.shape[2], C=chunk_size,
        L=exact_chunks, BG=bg, BD=bd, BDV=bdv, SPLITS=splits, BK=bk, BT=bt, PHI=feature_map, NORMALIZE=normalize,
        HAS_REAL=has_real, num_warps=warps,
    )
    return out


def prompt_supports(state, k, v, lengths) -> bool:
    return k.is_cuda and prompt_unsupported_reason(state, k, v, lengths) is None


def prompt_unsupported_reason(state, k, v, lengths) -> str | None:
    if state.feature_map not in MT.KERNEL_FEATURE_MAPS:
        return f"feature map {state.feature_map!r} (kernels know {', '.join(MT.KERNEL_FEATURE_MAPS)})"
    if state.cur_s.dtype != torch.float32:
        return f"a {state.cur_s.dtype} state (kernels keep float32 summaries)"
    if not all(t.is_contiguous() for t in state.tensors()):
        return "a state with non-contiguous tensors"
    return MT.dtypes_reason(k, k, v) or MT.device_reason(k) or MT.head_dims_reason(k, v)


def prompt_triton(state, k, v, lengths) -> None:
    """`DecodeState.prefill_torch` in two kernels and a sum: `_older_sums_kernel` sums each row's tokens before the
    chunks the state keeps apart (split over programs), then `_prompt_state_kernel` sums those chunks and writes every
    state tensor in place, the ring included: a handful of launches where the torch form makes about 45, each of
    them host time at a prompt's every converted layer."""
    reason = prompt_unsupported_reason(state, k, v, lengths)
    if reason is not None:
        raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
    batch, n, kv_heads, dim = k.shape
    dv = v.shape[-1]
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    lengths = lengths.to(torch.int64).contiguous()
    split = settings.SETTINGS.prompt_split_tokens
    parts = MT._cdiv(n, split)
    ps = MT._new(parts, batch * kv_heads, dim, dv, device=k.device, dtype=torch.float32)
    pz = MT._new(parts, batch * kv_heads, dim, device=k.device, dtype=torch.float32)
    kw = dict(D=dim, DV=dv, C=state.chunk_size, KEEP=state.keep, BD=MT._p2(dim), BDV=MT._p2(dv),
              PHI=MT.KERNEL_FEATURE_MAPS[state.feature_map], num_warps=settings.SETTINGS.warps,
              # (the interpreter's half-precision products are not exact: it takes the float32 ones)
              HALF_DOT=k.dtype != torch.float32 and state.feature_map == "relu" and not MT.interpreting())
    strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    K._older_sums_kernel[(batch * kv_heads, parts)](k, v, lengths, ps, pz, *strides, kv_heads, SPLIT=split, BT=64,
                                                    **kw)
    state_tensors = (state.position, state.cur_s, state.cur_z, state.recent_s, state.recent_z, state.far_s,
                     state.far_z, state.back_recent_s, state.back_recent_z, state.back_far_s, state.back_far_z,
                     state.back_valid, state.ring_k, state.ring_v)
    K._prompt_state_kernel[(batch * kv_heads, state.keep + 3)](
        k, v, lengths, ps.sum(0), pz.sum(0), *state_tensors, *strides, n, kv_heads, R=state.slots,
        BC=MT._p2(state.chunk_size), BR=64, **kw)
