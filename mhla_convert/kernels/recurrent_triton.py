"""The Triton backend of `mhla_recurrent_step`: one fused launch per decoding token (`_recurrent_step_kernel`)
updates the open chunk's summary and reads out φ(q)·(Σ r·summaries) with its normaliser; closing a chunk
(once every chunk_size tokens) stays in torch (`ops.recurrent`)."""

from __future__ import annotations

import torch

from . import mhla_kernels as K
from . import mhla_triton as MT
from . import settings


def step_unsupported_reason(state, q, k, v, relative, *, phi) -> str | None:
    """Why this step needs the torch path, or None when the kernel takes it."""
    reason = MT.qkv_reason(q, k, v, phi)
    if reason:
        return reason
    if state.cur_s.dtype != torch.float32:
        return f"a {state.cur_s.dtype} state (kernels keep float32 summaries)"
    if not relative.is_floating_point():
        return f"relative mixing of dtype {relative.dtype}"
    return MT.device_reason(q) or MT.head_dims_reason(q, v)


def step_supports(state, q, k, v, relative, *, phi) -> bool:
    return q.is_cuda and step_unsupported_reason(state, q, k, v, relative, phi=phi) is None


def _rows(x, dims: int):
    """x with a unit stride in its last dim, and its strides over the leading `dims` dims."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x, [x.stride(i) for i in range(dims)]


def mhla_recurrent_step_triton(state, q, k, v, relative, *, phi, normalize, scale, eps):
    """(output (B, 1, H, Dv) in q's dtype, new open-chunk summary (B, H_kv, D, Dv), its z (B, H_kv, D)),
    both float32 and new tensors (the state passed in is left untouched)."""
    reason = step_unsupported_reason(state, q, k, v, relative, phi=phi)
    if reason is not None:
        raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
    batch, _, heads, dim = q.shape
    kv_heads, dv = k.shape[2], v.shape[-1]
    groups = heads // kv_heads
    q, (sqb, _, sqh) = _rows(q, 3)
    k, (skb, _, skh) = _rows(k, 3)
    v, (svb, _, svh) = _rows(v, 3)
    cur_s, (cs_b, cs_h, cs_d) = _rows(state.cur_s, 3)
    cur_z, (cz_b, cz_h) = _rows(state.cur_z, 2)
    rec_s, (rs_b, rs_h, rs_k, rs_d) = _rows(state.recent_s, 4)
    rec_z, (rz_b, rz_h, rz_k) = _rows(state.recent_z, 3)
    far_s, (fs_b, fs_h, fs_d) = _rows(state.far_s, 3)
    far_z, (fz_b, fz_h) = _rows(state.far_z, 2)
    if rec_s.shape[2] == 0:  # nothing closed yet: no pointer to an empty buffer (the kernel reads none)
        rec_s, rec_z, rs_b, rs_h, rs_k, rs_d, rz_b, rz_h, rz_k = far_s, far_z, 0, 0, 0, 0, 0, 0, 0
    relative = relative.contiguous()
    window = relative.shape[-1]

    out = MT._new(batch, 1, heads, dv, device=q.device, dtype=q.dtype)
    new_s = MT._new(batch, kv_heads, dim, dv, device=q.device, dtype=torch.float32)
    new_z = MT._new(batch, kv_heads, dim, device=q.device, dtype=torch.float32)
    cfg = settings.SETTINGS
    bg = min(MT.next_power_of_2(groups), cfg.step_max_group)
    bd = MT.next_power_of_2(dim)
    be = min(MT.next_power_of_2(dv), max(4, cfg.step_elements // (bg * bd)))
    grid = (batch * kv_heads, MT._cdiv(groups, bg), MT._cdiv(dv, be))
    args = (
        q, k, v, relative, cur_s, cur_z, rec_s, rec_z, far_s, far_z, out, new_s, new_z, sqb, sqh, skb, skh, svb, svh,
        cs_b, cs_h, cs_d, cz_b, cz_h, rs_b, rs_h, rs_k, rs_d, rz_b, rz_h, rz_k, fs_b, fs_h, fs_d, fz_b, fz_h, kv_heads,
        groups, window if relative.dim() == 2 else 0, window, float(scale), float(eps), dim, dv,
    )
    K._recurrent_step_kernel[grid](
        *args, NREC=state.recent_s.shape[2], BG=bg, BD=bd, BE=be, PHI=MT.phi_id(phi), NORMALIZE=normalize,
        num_warps=cfg.warps,
    )
    return out, new_s, new_z
