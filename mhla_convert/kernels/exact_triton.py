"""The Triton backend of causal MHLA with exact local chunks (`ops.exact_local`; the torch path there is the
reference these kernels are tested against).

Forward, three launches:
1. summaries: S_j = Σ φ(k)ᵀ v and z_j = Σ φ(k) per (batch, kv head, chunk j), one row of D·Dv + D columns, for
   the chunks some query reads as far (j < M − L);
2. the far mixture S̃_i = Σ_{j ≤ i−L} m_ij S_j (and z̃), one torch GEMM over those rows (per query head when the
   mixing is per head, else per kv head), for the chunks i ≥ L that have far chunks;
3. one fused program per (query head, chunk i, batch): the window's softmax kernel flash-style over chunks
   i − L + 1 … i (causal within chunk i; chunks of zero weight and keys of `key_mask` False left out), with the
   running row maximum starting at 0 as the shift, plus φ(q)·scale·S̃_i and its normaliser scaled by exp(−shift),
   divided and written in q's dtype.

No (N × window) score matrix reaches global memory: the window's scores live in registers, one C × C tile at a
time. Accumulation is float32; the summaries and their mixture are bfloat16 for bfloat16 inputs (a matmul
operand, as in the linear backend's inference; half the bytes of a float32 row), float32 otherwise (float16's
range would not hold a mixture over thousands of chunks).

Importing this module registers the backend (as "triton" of the op "exact" of `ops.dispatch`).
Training: the forward runs these kernels and the backward runs the torch path again under `torch.func.vjp`
(`mhla_attention_exact_triton_backward`), so no activation is kept between them but the inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.blocks import BlockLayout
from ..ops.dispatch import register
from ..ops.exact_local import mhla_attention_exact_local_torch
from ..ops.library import grads_by_recompute
from . import settings
from .mhla_kernels import _phi
from .mhla_triton import (
    _new,
    _p2,
    device_reason,
    head_dims_reason,
    interpreting,
    phi_id,
    qkv_reason,
)


@triton.jit
def _operand(x, dtype: tl.constexpr, WIDEN: tl.constexpr):
    """x rounded to the product's operand dtype; WIDEN: then back to float32, for the interpreter, whose tile
    products read bfloat16 operands wrongly (the same products, in float32 arithmetic)."""
    x = x.to(dtype)
    return x.to(tl.float32) if WIDEN else x


@triton.jit
def _exact_summaries_kernel(
    K, V, KM, S, skb, skn, skh, svb, svn, svh, smb, ssb, ssh, ssj, N, C,
    D: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr,
    MASKED: tl.constexpr, DOT_PREC: tl.constexpr, WIDEN: tl.constexpr,
):
    """Row S[b, hk, j] = (Σ φ(k)ᵀ v row major, Σ φ(k)) over chunk j's tokens (masked keys left out).
    (Base pointers in 64-bit scalars, offsets within a tile in 32 bits: fewer registers than 64-bit tiles.)"""
    hk, j, b = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    r, d, e = tl.arange(0, BC), tl.arange(0, BD), tl.arange(0, BDV)
    first = (j * C).to(tl.int64)
    valid = (r < C) & (j * C + r < N)
    if MASKED:
        valid &= tl.load(KM + b * smb + first + r, mask=valid, other=0) != 0
    kmask = valid[:, None] & (d < D)[None, :]
    k = tl.load(K + b * skb + hk * skh + first * skn + r[:, None] * skn + d[None, :], mask=kmask, other=0.0)
    fk = tl.where(kmask, _phi(k.to(tl.float32), PHI), 0.0)
    v = tl.load(V + b * svb + hk * svh + first * svn + r[:, None] * svn + e[None, :],
                mask=valid[:, None] & (e < DV)[None, :], other=0.0)
    kv = tl.dot(_operand(tl.trans(fk), v.dtype, WIDEN), _operand(v, v.dtype, WIDEN), input_precision=DOT_PREC)
    row = S + b * ssb + hk * ssh + j.to(tl.int64) * ssj
    tl.store(row + d[:, None] * DV + e[None, :], kv.to(S.dtype.element_ty), mask=(d < D)[:, None] & (e < DV)[None, :])
    tl.store(row + D * DV + d, tl.sum(fk, 0).to(S.dtype.element_ty), mask=d < D)


@triton.jit
def _exact_forward_kernel(
    Q, K, V, KM, MIX, SF, O, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, smb, sob, son, soh, smh, sfb, sfh, sfj,
    N, M, C, GROUPS, FAR_GROUPS, qk_scale, scale, eps, L: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr,
    MASKED: tl.constexpr, DOT_PREC: tl.constexpr, WIDEN: tl.constexpr,
):
    """Output rows of chunk i for query head h of batch b. qk_scale = log2(e)/√D: scores and the running
    maximum are in log2 units, so every exponential is an exp2."""
    h, i, b = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    hk = h // GROUPS
    r, d, e = tl.arange(0, BC), tl.arange(0, BD), tl.arange(0, BDV)
    t = i * C + r
    rows = (i * C).to(tl.int64)  # the chunk's first token (base pointers in 64 bits, tile offsets in 32)
    qmask = ((r < C) & (t < N))[:, None] & (d < D)[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows * sqn + r[:, None] * sqn + d[None, :], mask=qmask, other=0.0)

    shift = tl.zeros((BC,), tl.float32)  # the row's largest window score so far, at least 0 (log2 units)
    den = tl.zeros((BC,), tl.float32)
    acc = tl.zeros((BC, BDV), tl.float32)
    mix_row = MIX + h * smh + i.to(tl.int64) * M
    for delta in range(L):  # chunks i − L + 1 … i; those before chunk 0 have no keys
        j = i - L + 1 + delta
        w = tl.load(mix_row + j, mask=j >= 0, other=0.0).to(tl.float32)
        s = j * C + r
        keys = (j * C).to(tl.int64)
        # a chunk of weight 0 (and one before chunk 0) has no keys: left out of the shift as of the sums
        kvalid = (r < C) & (s >= 0) & (s < tl.where(w > 0, N, 0))
        if MASKED:
            kvalid &= tl.load(KM + b * smb + keys + r, mask=kvalid, other=0) != 0
        kt = tl.load(K + b * skb + hk * skh + keys * skn + r[None, :] * skn + d[:, None],
                     mask=kvalid[None, :] & (d < D)[:, None], other=0.0)  # (BD, BC)
        scores = tl.dot(_operand(q, q.dtype, WIDEN), _operand(kt, kt.dtype, WIDEN), input_precision=DOT_PREC)
        scores *= qk_scale
        allowed = kvalid[None, :] & (s[None, :] <= t[:, None])
        scores = tl.where(allowed, scores, float("-inf"))
        new = tl.maximum(shift, tl.max(scores, 1))
        alpha = tl.exp2(shift - new)
        p = tl.exp2(scores - new[:, None])
        v = tl.load(V + b * svb + hk * svh + keys * svn + r[:, None] * svn + e[None, :],
                    mask=kvalid[:, None] & (e < DV)[None, :], other=0.0)
        den = den * alpha + w * tl.sum(p, 1)
        pv = tl.dot(_operand(p, v.dtype, WIDEN), _operand(v, v.dtype, WIDEN), input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + w * pv
        shift = new

    decay = tl.exp2(-shift)  # exp(−shift) of the natural-log scores
    if i >= L:  # far chunks j ≤ i − L: the mixed summaries, row i − L of SF
        fq = _phi(q.to(tl.float32), PHI)  # (φ(0) of padded columns meets the zero rows of S̃ past D)
        row = SF + b * sfb + (h // FAR_GROUPS) * sfh + (i - L).to(tl.int64) * sfj
        sf = tl.load(row + d[:, None] * DV + e[None, :], mask=(d < D)[:, None] & (e < DV)[None, :], other=0.0)
        zf = tl.load(row + D * DV + d, mask=d < D, other=0.0).to(tl.float32)
        num = tl.dot(_operand(fq, sf.dtype, WIDEN), _operand(sf, sf.dtype, WIDEN), input_precision=DOT_PREC)
        acc += num * (scale * decay)[:, None]
        den += tl.sum(fq * zf[None, :], 1) * (scale * decay)
    out = acc / (den + eps * decay)[:, None]
    omask = ((r < C) & (t < N))[:, None] & (e < DV)[None, :]
    tl.store(O + b * sob + h * soh + rows * son + r[:, None] * son + e[None, :], out.to(O.dtype.element_ty),
             mask=omask)


def unsupported_reason(q, k, v, mixing, layout: BlockLayout, *, exact_chunks: int, phi, key_mask=None) -> str | None:
    """Why these inputs need the torch path, or None when the kernels take them."""
    reason = qkv_reason(q, k, v, phi) or device_reason(q) or devices_reason(q, k, v, mixing, key_mask)
    reason = reason or head_dims_reason(q, v)
    if reason:
        return reason
    if layout.tokens_per_block > settings.SETTINGS.max_chunk:
        return f"chunks of {layout.tokens_per_block} tokens > {settings.SETTINGS.max_chunk}"
    return None


def supports(q, k, v, mixing, layout, *, exact_chunks, phi, key_mask=None) -> bool:
    """For backend "auto": CUDA inputs the kernels take (the interpreter is only for backend="triton")."""
    return q.is_cuda and unsupported_reason(q, k, v, mixing, layout, exact_chunks=exact_chunks, phi=phi,
                                            key_mask=key_mask) is None


def devices_reason(*tensors) -> str | None:
    """Why tensors on several devices cannot go to the kernels (named here, not as a pointer error of Triton's)."""
    devices = {t.device for t in tensors if t is not None}
    return f"tensors on several devices ({', '.join(sorted(map(str, devices)))})" if len(devices) > 1 else None


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def summary_rows(kv_heads: int, rows: int, batch: int, cols: int, *, per_head: bool, dtype, device):
    """A buffer of `rows` summaries (of `cols` numbers) per (batch, kv head), laid out so that mixing them is one
    GEMM — (rows, B·H_kv·cols) for a shared mixing, (H_kv, rows, B·cols) per head — and its (batch, kv head, row)
    strides."""
    shape = (kv_heads, rows, batch, cols) if per_head else (rows, batch, kv_heads, cols)
    s = _new(*shape, dtype=dtype, device=device)
    return s, ((cols, rows * batch * cols, batch * cols) if per_head else (kv_heads * cols, cols, s.stride(0)))


def mix_rows(far: torch.Tensor, s: torch.Tensor, *, per_head: bool, kv_heads: int, groups: int):
    """(the mixture far @ s of `summary_rows`' buffer, query heads per row of it): per query head (H, rows', B, cols)
    for a per-head mixing (H, rows', rows), else per kv head."""
    rows = far.shape[-1]
    if per_head:  # (H_kv, g·rows', rows) @ (H_kv, rows, B·cols)
        return torch.bmm(far.view(kv_heads, groups * far.shape[-2], rows), s.view(kv_heads, rows, -1)), 1
    return far @ s.view(rows, -1), groups


class _RecomputedBackward(torch.autograd.Function):
    """A forward of Triton launches whose gradients come from running the torch path again (`run_recomputed`)."""

    @staticmethod
    def forward(ctx, q, k, v, mixing, key_mask, forward, backward):
        ctx.backward_fn = backward
        ctx.save_for_backward(q, k, v, mixing, key_mask)
        return forward(q, k, v, mixing, key_mask)

    @staticmethod
    def backward(ctx, do):
        q, k, v, mixing, key_mask = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        grads = ctx.backward_fn(do, q, k, v, mixing, key_mask, needs)
        return (*(g if need else None for g, need in zip(grads, needs)), None, None, None)


def run_recomputed(forward, backward, q, k, v, mixing, key_mask):
    """forward(q, k, v, mixing, key_mask) → output; under autograd its gradients are
    backward(do, q, k, v, mixing, key_mask, needs_grad) → (dq, dk, dv, dmixing), and nothing but the inputs is kept."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, mixing)):
        return _RecomputedBackward.apply(q, k, v, mixing, key_mask, forward, backward)
    return forward(q, k, v, mixing, key_mask)


def recomputed_grads(torch_impl, do, q, k, v, mixing, layout: BlockLayout, needs_grad, **options):
    """(dq, dk, dv, dmixing) of torch_impl(q, k, v, mixing, layout, **options), by running it again under
    `torch.func.vjp` (zeros where `needs_grad` is False)."""
    def torch_path(q, k, v, mixing):
        return (torch_impl(q, k, v, mixing, layout, **options),)

    return grads_by_recompute(torch_path, (q, k, v, mixing), (do,), needs_grad)


def _forward(q, k, v, mixing, layout: BlockLayout, exact_chunks: int, phi, scale: float, eps: float, key_mask):
    """The three launches of the module doc → output (B, N, H, Dv) in q's dtype."""
    batch, n, heads, dim = q.shape
    kv_heads, dv = k.shape[2], v.shape[-1]
    groups, m, c, chunks = heads // kv_heads, layout.num_blocks, layout.tokens_per_block, exact_chunks
    q, k, v = _rows(q), _rows(k), _rows(v)
    per_head = mixing.dim() == 3
    mix = mixing.to(torch.float32).contiguous()
    masked = key_mask is not None
    km = _rows(key_mask).view(torch.uint8) if masked else q  # (a pointer the kernels never read when unmasked)
    half = q.dtype != torch.float32
    warps, stages = settings.SETTINGS.exact_launches[_p2(max(dim, dv))]
    consts = dict(D=dim, DV=dv, BC=_p2(c), BD=_p2(dim), BDV=_p2(dv), PHI=phi_id(phi), MASKED=masked,
                  DOT_PREC="tf32" if half else "ieee", WIDEN=half and interpreting(), num_warps=warps,
                  num_stages=stages)
    o = _new(batch, n, heads, dv, dtype=q.dtype, device=q.device)

    far_rows = m - chunks  # chunks that some query reads as far, and queries' chunks that read far ones
    if far_rows > 0:
        dtype = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
        s, sf_strides = summary_rows(kv_heads, far_rows, batch, dim * dv + dim, per_head=per_head, dtype=dtype,
                                     device=q.device)
        _exact_summaries_kernel[(kv_heads, far_rows, batch)](
            k, v, km, s, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), km.stride(0),
            *sf_strides, n, c, **consts)
        far = mix[..., chunks:, :far_rows].tril().to(dtype)  # m_{i, j} for i − L ≥ j, row i − L
        sf, far_groups = mix_rows(far, s, per_head=per_head, kv_heads=kv_heads, groups=groups)
        del s
    else:
        sf, sf_strides, far_groups = o, (0, 0, 0), 1
    _exact_forward_kernel[(heads, m, batch)](
        q, k, v, km, mix, sf, o, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), km.stride(0), o.stride(0), o.stride(1), o.stride(2),
        m * m if per_head else 0, *sf_strides, n, m, c, groups, far_groups, 1.4426950408889634 * dim**-0.5,
        scale, eps, L=chunks, **consts)
    return o


def mhla_attention_exact_triton(q, k, v, mixing, layout: BlockLayout, *, exact_chunks, phi, scale, eps,
                                key_mask=None):
    """The Triton backend (same contract as `ops.exact_local.mhla_attention_exact_local_torch`)."""
    reason = unsupported_reason(q, k, v, mixing, layout, exact_chunks=exact_chunks, phi=phi, key_mask=key_mask)
    if reason is not None:
        raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
    options = dict(exact_chunks=exact_chunks, phi=phi, scale=scale, eps=eps)

    def backward(do, q, k, v, mixing, key_mask, needs):
        return mhla_attention_exact_triton_backward(do, q, k, v, mixing, layout, needs_grad=needs, key_mask=key_mask,
                                                    **options)

    def forward(q, k, v, mixing, key_mask):
        return _forward(q, k, v, mixing, layout, exact_chunks, phi, scale, eps, key_mask)

    return run_recomputed(forward, backward, q, k, v, mixing, key_mask)


def mhla_attention_exact_triton_backward(do, q, k, v, mixing, layout: BlockLayout, *, exact_chunks, phi, scale, eps,
                                         needs_grad, key_mask=None):
    """(dq, dk, dv, dmixing) from the inputs alone: the torch path again under `torch.func.vjp` (zeros where
    `needs_grad` is False)."""
    return recomputed_grads(mhla_attention_exact_local_torch, do, q, k, v, mixing, layout, needs_grad,
                            exact_chunks=exact_chunks, phi=phi, scale=scale, eps=eps, key_mask=key_mask)


register("exact", "triton", mhla_attention_exact_triton, supports, mhla_attention_exact_triton_backward)
