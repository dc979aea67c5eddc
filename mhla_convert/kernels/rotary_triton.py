"""The Triton backend of `ops.rotary.norm_rotate_interleaved`: one launch of `mhla_kernels._norm_rotate_kernel`,
whose program per token row reads the row once, takes its RMS over all heads, scales by the norm weight and
rotates each (even, odd) channel pair, all in float32, and writes the row once. Inference only (no autograd
Function)."""

from __future__ import annotations

import torch
from torch import nn

from . import mhla_kernels as K
from . import mhla_triton as MT
from . import settings


def _table(t: torch.Tensor, batch: int, n: int, dim: int) -> tuple[int, int] | None:
    """(batch stride, token stride) of a (1 or B, N, 1, D) cos/sin table with unit last stride."""
    if t.dim() != 4 or t.shape[1:] != (n, 1, dim) or t.shape[0] not in (1, batch) or t.stride(-1) != 1:
        return None
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1)


def norm_rotate_unsupported_reason(x, cos, sin, *, head_dim, norm) -> str | None:
    if torch.is_grad_enabled() and (
        x.requires_grad or (norm is not None and any(p.requires_grad for p in norm.parameters()))
    ):
        return "inputs that need gradients (training keeps the torch path)"
    if x.dtype not in MT._DTYPES:
        return f"dtype {x.dtype}"
    reason = MT.device_reason(x)
    if reason:
        return reason
    if x.dim() != 3 or x.shape[-1] % head_dim or head_dim % 2 or x.stride(-1) != 1:
        return (
            f"x of shape {tuple(x.shape)} (kernels take (B, N, H·D) with an even D = {head_dim} and unit last stride)"
        )
    for t in (cos, sin):
        if _table(t, x.shape[0], x.shape[1], head_dim) is None:
            return f"a cos/sin table of shape {tuple(t.shape)} (kernels take (1 or B, N, 1, D))"
    if norm is not None and not (isinstance(norm, nn.RMSNorm) and tuple(norm.normalized_shape) == (x.shape[-1],)):
        return f"norm {type(norm).__name__} (kernels take an nn.RMSNorm over the last dim)"
    return None


def norm_rotate_supports(x, cos, sin, *, head_dim, norm) -> bool:
    return x.is_cuda and norm_rotate_unsupported_reason(x, cos, sin, head_dim=head_dim, norm=norm) is None


def norm_rotate_triton(x, cos, sin, *, head_dim, norm):
    reason = norm_rotate_unsupported_reason(x, cos, sin, head_dim=head_dim, norm=norm)
    if reason is not None:
        raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
    batch, n, channels = x.shape
    out = MT._new(batch, n, channels // head_dim, head_dim, device=x.device, dtype=x.dtype)
    weight = norm.weight if norm is not None and norm.weight is not None else None
    eps = (norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps) if norm is not None else 0.0
    args = (x, weight if weight is not None else x, cos, sin, out, x.stride(0), x.stride(1),
            *_table(cos, batch, n, head_dim), *_table(sin, batch, n, head_dim), n, float(eps))
    K._norm_rotate_kernel[(batch * n,)](
        *args, C=channels, D=head_dim, BP=max(16, MT.next_power_of_2(channels) // 2), NORM=norm is not None,
        AFFINE=weight is not None, num_warps=settings.SETTINGS.warps,
    )
    return out
