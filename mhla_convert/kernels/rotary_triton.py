"""The Triton backends of `ops.rotary`'s q/k norm + rotary ops, one launch each, whose program per token row
reads the row once, norms it, rotates it in float32 and writes it once. Inference only (no autograd Function).

- `norm_rotate_interleaved` (Wan): `mhla_kernels._norm_rotate_kernel`, the RMS over all heads and each (even,
  odd) channel pair rotated;
- `norm_rotate_half` (Llama-style LMs): `mhla_kernels._norm_rotate_half_kernel`, the RMS per head (Qwen3's q/k
  norms, or none) and the half-split rotation of transformers' `apply_rotary_pos_emb`."""

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


def _rows_reason(x, *, head_dim, norm) -> str | None:
    """Why the kernels do not take x (B, N, H·D) and the norm's parameters, or None."""
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
    return None


def norm_rotate_unsupported_reason(x, cos, sin, *, head_dim, norm) -> str | None:
    reason = _rows_reason(x, head_dim=head_dim, norm=norm)
    if reason:
        return reason
    for t in (cos, sin):
        if _table(t, x.shape[0], x.shape[1], head_dim) is None:
            return f"a cos/sin table of shape {tuple(t.shape)} (kernels take (1 or B, N, 1, D))"
    if norm is not None and not (isinstance(norm, nn.RMSNorm) and tuple(norm.normalized_shape) == (x.shape[-1],)):
        return f"norm {type(norm).__name__} (kernels take an nn.RMSNorm over the last dim)"
    return None


def norm_rotate_supports(x, cos, sin, *, head_dim, norm) -> bool:
    return x.is_cuda and norm_rotate_unsupported_reason(x, cos, sin, head_dim=head_dim, norm=norm) is None


def _output(reason: str | None, x, head_dim: int) -> torch.Tensor:
    """The kernels' output (B, N, H, D) for x (B, N, H·D), or the one-line refusal of inputs they do not take."""
    if reason is not None:
        raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
    batch, n, channels = x.shape
    return MT._new(batch, n, channels // head_dim, head_dim, device=x.device, dtype=x.dtype)


def norm_rotate_triton(x, cos, sin, *, head_dim, norm):
    out = _output(norm_rotate_unsupported_reason(x, cos, sin, head_dim=head_dim, norm=norm), x, head_dim)
    batch, n, channels = x.shape
    weight = norm.weight if norm is not None and norm.weight is not None else None
    eps = (norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps) if norm is not None else 0.0
    args = (x, weight if weight is not None else x, cos, sin, out, x.stride(0), x.stride(1),
            *_table(cos, batch, n, head_dim), *_table(sin, batch, n, head_dim), n, float(eps))
    K._norm_rotate_kernel[(batch * n,)](
        *args, C=channels, D=head_dim, BP=max(16, MT.next_power_of_2(channels) // 2), NORM=norm is not None,
        AFFINE=weight is not None, num_warps=settings.SETTINGS.warps,
    )
    return out


# per-head RMSNorms whose forward is x·rsqrt(mean(x²) + eps)·weight over the last dim (transformers' own classes,
# by name: their modules are not importable from one place), with the attribute holding their eps
_HEAD_NORMS = {"RMSNorm": "eps", "LlamaRMSNorm": "variance_epsilon", "Qwen2RMSNorm": "variance_epsilon",
               "Qwen3RMSNorm": "variance_epsilon", "Qwen3MoeRMSNorm": "variance_epsilon",
               "MistralRMSNorm": "variance_epsilon"}


def _head_norm_eps(norm, x) -> float:
    eps = getattr(norm, _HEAD_NORMS[type(norm).__name__])
    return float(eps if eps is not None else torch.finfo(x.dtype).eps)


def norm_rotate_half_unsupported_reason(x, cos, sin, *, head_dim, norm) -> str | None:
    reason = _rows_reason(x, head_dim=head_dim, norm=norm)
    if reason:
        return reason
    batch, n = x.shape[:2]
    for t in (cos, sin):
        if t.dim() != 3 or t.shape[1:] != (n, head_dim) or t.shape[0] not in (1, batch) or t.stride(-1) != 1:
            return f"a cos/sin table of shape {tuple(t.shape)} (kernels take (1 or B, N, D))"
    if norm is not None:
        weight = getattr(norm, "weight", None)
        if type(norm).__name__ not in _HEAD_NORMS or weight is None or tuple(weight.shape) != (head_dim,):
            return f"norm {type(norm).__name__} (kernels take an RMSNorm over each head's {head_dim} channels)"
    return None


def norm_rotate_half_supports(x, cos, sin, *, head_dim, norm) -> bool:
    return x.is_cuda and norm_rotate_half_unsupported_reason(x, cos, sin, head_dim=head_dim, norm=norm) is None


def norm_rotate_half_triton(x, cos, sin, *, head_dim, norm):
    out = _output(norm_rotate_half_unsupported_reason(x, cos, sin, head_dim=head_dim, norm=norm), x, head_dim)
    batch, n, heads = out.shape[:3]
    strides = [(0 if t.shape[0] == 1 else t.stride(0), t.stride(1)) for t in (cos, sin)]
    K._norm_rotate_half_kernel[(batch * n,)](
        x, x if norm is None else norm.weight, cos, sin, out, x.stride(0), x.stride(1), *strides[0], *strides[1], n,
        0.0 if norm is None else _head_norm_eps(norm, x), H=heads, D=head_dim, BH=MT.next_power_of_2(heads),
        BD2=MT.next_power_of_2(head_dim // 2), NORM=norm is not None, num_warps=settings.SETTINGS.warps,
    )
    return out
