"""The Triton backend of non-causal MHLA with an exact block neighbourhood (`ops.exact_blocks`; the torch path there is
the reference these kernels are tested against).

Forward, three launches:
1. summaries: S_j = Σ φ(k)ᵀ v and z_j = Σ φ(k) per (batch, kv head, block j), one row of D·Dv + D columns, over the
   block's tokens in tiles of `Settings.tile_tokens` (a block of Wan's 3 × 10 × 10 latent patches is 300 tokens);
   skipped when every block lies in every other's neighbourhood (no query reads a summary);
2. the far mixture S̃_i = Σ_{j ∉ E(i)} m_ij S_j (and z̃), one torch GEMM with the mixing's neighbourhood entries set
   to 0 (per query head when the mixing is per head, else per kv head);
3. one fused program per (query head, query tile of block i, batch): the softmax kernel flash-style over the tokens
   of the K = Π(2·r_a + 1) blocks around block i (blocks off the block grid, blocks of weight 0 and keys of
   `key_mask` False left out), with the running row maximum starting at 0 as the shift, plus φ(q)·scale·S̃_i and
   its normaliser scaled by exp(−shift), divided and written in q's dtype.

As in `mhla_kernels`, a block's tokens are found by index arithmetic on the grid (`mhla_kernels._rows`: every grid
seen as 3-D, block coordinates row-major): nothing is permuted or padded in memory, and the block shape's inner
sizes are compile-time constants, so those divisions are by constants. The neighbourhood is walked by offsets
from the query block's coordinates, radius per axis a compile-time constant. No (N × K·T) score matrix reaches
global memory: scores live in registers, one query tile × key tile at a time. Accumulation is float32; the
summaries and their mixture are bfloat16 for bfloat16 inputs, float32 otherwise (as in `exact_triton`).

Importing this module registers the backend (as "triton" of the op "exact_blocks" of `ops.dispatch`).
Training: the forward runs these kernels and the backward runs the torch path again under `torch.func.vjp`
(`mhla_attention_exact_blocks_triton_backward`), so no activation is kept between them but the inputs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..ops.blocks import BlockLayout
from ..ops.dispatch import register
from ..ops.exact_blocks import exact_mask, mhla_attention_exact_blocks_torch
from . import settings
from .exact_triton import _operand, devices_reason, mix_rows, recomputed_grads, run_recomputed, summary_rows
from .exact_triton import _rows as _row_major
from .mhla_kernels import _phi, _rows
from .mhla_triton import (
    _cdiv,
    _new,
    _p2,
    device_reason,
    head_dims_reason,
    interpreting,
    phi_id,
    qkv_reason,
)


@triton.jit
def _blocks_summaries_kernel(
    K, V, KM, S, skb, skn, skh, svb, svn, svh, smb, ssb, ssh, ssj, L0, L1, L2, S0, S1: tl.constexpr,
    S2: tl.constexpr, NB1, NB2, T, TILES: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """Row S[b, hk, j] = (Σ φ(k)ᵀ v row major, Σ φ(k)) over block j's tokens, TILES tiles of BT (masked keys
    left out)."""
    hk, j, b = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    kp, vp = K + b * skb + hk * skh, V + b * svb + hk * svh
    kv = tl.zeros((BD, BDV), tl.float32)
    z = tl.zeros((BD,), tl.float32)
    for tile in range(TILES):
        n, valid = _rows(j, tile * BT + tl.arange(0, BT), L0, L1, L2, S0, S1, S2, NB1, NB2, T)
        if MASKED:
            valid &= tl.load(KM + b * smb + n, mask=valid, other=0) != 0
        kmask = valid[:, None] & (d < D)[None, :]
        k = tl.load(kp + n[:, None] * skn + d[None, :], mask=kmask, other=0.0)
        fk = tl.where(kmask, _phi(k.to(tl.float32), PHI), 0.0)  # (φ(0) need not be 0: padded slots zeroed)
        v = tl.load(vp + n[:, None] * svn + e[None, :], mask=valid[:, None] & (e < DV)[None, :], other=0.0)
        kv += tl.dot(_operand(tl.trans(fk), v.dtype, WIDEN), _operand(v, v.dtype, WIDEN), input_precision=DOT_PREC)
        z += tl.sum(fk, 0)
    row = S + b * ssb + hk * ssh + j.to(tl.int64) * ssj
    tl.store(row + d[:, None] * DV + e[None, :], kv.to(S.dtype.element_ty), mask=(d < D)[:, None] & (e < DV)[None, :])
    tl.store(row + D * DV + d, z.to(S.dtype.element_ty), mask=d < D)


@triton.jit
def _blocks_forward_kernel(
    Q, K, V, KM, MIX, SF, O, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, smb, sob, son, soh, smh, sfb, sfh, sfj,
    M, GROUPS, FAR_GROUPS, qk_scale, scale, eps, L0, L1, L2, S0, S1: tl.constexpr, S2: tl.constexpr, NB0, NB1,
    NB2, T, TILES: tl.constexpr, R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, FAR: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr,
    MASKED: tl.constexpr, DOT_PREC: tl.constexpr, WIDEN: tl.constexpr,
):
    """Output rows of query tile `pid % TILES` of block i = pid // TILES (a block is TILES tiles of BT tokens), for
    query head h of batch b. qk_scale = log2(e)/√D: scores and the running maximum are in log2 units, so every
    exponential is an exp2."""
    h, pid, b = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i, qtile = pid // TILES, pid % TILES
    hk = h // GROUPS
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    t, qvalid = _rows(i, qtile * BT + tl.arange(0, BT), L0, L1, L2, S0, S1, S2, NB1, NB2, T)
    q = tl.load(Q + b * sqb + h * sqh + t[:, None] * sqn + d[None, :], mask=qvalid[:, None] & (d < D)[None, :],
                other=0.0)
    kp, vp = K + b * skb + hk * skh, V + b * svb + hk * svh

    shift = tl.zeros((BT,), tl.float32)  # the row's largest neighbourhood score so far, at least 0 (log2 units)
    den = tl.zeros((BT,), tl.float32)
    acc = tl.zeros((BT, BDV), tl.float32)
    mix_row = MIX + h * smh + i.to(tl.int64) * M
    c0, c1, c2 = i // (NB1 * NB2), (i // NB2) % NB1, i % NB2  # block i's coordinates
    W1: tl.constexpr = 2 * R1 + 1
    W2: tl.constexpr = 2 * R2 + 1
    for near in range((2 * R0 + 1) * W1 * W2):  # row-major offsets, as `ops.exact_blocks.neighbour_table`
        n0, n1, n2 = c0 + near // (W1 * W2) - R0, c1 + (near // W2) % W1 - R1, c2 + near % W2 - R2
        on_grid = (n0 >= 0) & (n0 < NB0) & (n1 >= 0) & (n1 < NB1) & (n2 >= 0) & (n2 < NB2)
        j = (n0 * NB1 + n1) * NB2 + n2
        w = tl.load(mix_row + j, mask=on_grid, other=0.0).to(tl.float32)
        # a block off the grid or of weight 0 has no keys: left out of the shift as of the sums
        if w > 0:
            for tile in range(TILES):
                s, kvalid = _rows(j, tile * BT + tl.arange(0, BT), L0, L1, L2, S0, S1, S2, NB1, NB2, T)
                if MASKED:
                    kvalid &= tl.load(KM + b * smb + s, mask=kvalid, other=0) != 0
                kt = tl.load(kp + s[None, :] * skn + d[:, None], mask=kvalid[None, :] & (d < D)[:, None],
                             other=0.0)  # (BD, BT)
                scores = tl.dot(_operand(q, q.dtype, WIDEN), _operand(kt, kt.dtype, WIDEN), input_precision=DOT_PREC)
                scores = tl.where(kvalid[None, :], scores * qk_scale, float("-inf"))
                new = tl.maximum(shift, tl.max(scores, 1))
                alpha = tl.exp2(shift - new)
                p = tl.exp2(scores - new[:, None])
                v = tl.load(vp + s[:, None] * svn + e[None, :], mask=kvalid[:, None] & (e < DV)[None, :], other=0.0)
                den = den * alpha + w * tl.sum(p, 1)
                pv = tl.dot(_operand(p, v.dtype, WIDEN), _operand(v, v.dtype, WIDEN), input_precision=DOT_PREC)
                acc = acc * alpha[:, None] + w * pv
                shift = new

    decay = tl.exp2(-shift)  # exp(−shift) of the natural-log scores
    if FAR:  # the blocks outside the neighbourhood: the mixed summaries, row i of SF
        fq = _phi(q.to(tl.float32), PHI)  # (φ(0) of padded columns meets the zero rows of S̃ past D)
        row = SF + b * sfb + (h // FAR_GROUPS) * sfh + i.to(tl.int64) * sfj
        sf = tl.load(row + d[:, None] * DV + e[None, :], mask=(d < D)[:, None] & (e < DV)[None, :], other=0.0)
        zf = tl.load(row + D * DV + d, mask=d < D, other=0.0).to(tl.float32)
        num = tl.dot(_operand(fq, sf.dtype, WIDEN), _operand(sf, sf.dtype, WIDEN), input_precision=DOT_PREC)
        acc += num * (scale * decay)[:, None]
        den += tl.sum(fq * zf[None, :], 1) * (scale * decay)
    out = acc / (den + eps * decay)[:, None]
    tl.store(O + b * sob + h * soh + t[:, None] * son + e[None, :], out.to(O.dtype.element_ty),
             mask=qvalid[:, None] & (e < DV)[None, :])


def unsupported_reason(q, k, v, mixing, layout: BlockLayout, *, exact_radius, phi, key_mask=None) -> str | None:
    """Why these inputs need the torch path, or None when the kernels take them."""
    reason = qkv_reason(q, k, v, phi) or device_reason(q) or devices_reason(q, k, v, mixing, key_mask)
    return reason or head_dims_reason(q, v)


def supports(q, k, v, mixing, layout, *, exact_radius, phi, key_mask=None) -> bool:
    """For backend "auto": CUDA inputs the kernels take (the interpreter is only for backend="triton")."""
    return q.is_cuda and unsupported_reason(q, k, v, mixing, layout, exact_radius=exact_radius, phi=phi,
                                            key_mask=key_mask) is None


def _geometry(layout: BlockLayout) -> tuple[dict, int]:
    """The grid → block arguments of `mhla_kernels._rows` (every grid as 3-D, leading axes of length 1), and the
    block grid's first axis."""
    pad = (1,) * (3 - len(layout.grid))
    grid, size, blocks = pad + layout.grid, pad + layout.block_size, pad + layout.blocks
    return dict(L0=grid[0], L1=grid[1], L2=grid[2], S0=size[0], S1=size[1], S2=size[2], NB1=blocks[1],
                NB2=blocks[2], T=layout.tokens_per_block), blocks[0]


def _forward(q, k, v, mixing, layout: BlockLayout, exact_radius: tuple[int, ...], phi, scale: float, eps: float,
             key_mask):
    """The three launches of the module doc → output (B, N, H, Dv) in q's dtype."""
    batch, n, heads, dim = q.shape
    kv_heads, dv = k.shape[2], v.shape[-1]
    groups, m, t = heads // kv_heads, layout.num_blocks, layout.tokens_per_block
    q, k, v = _row_major(q), _row_major(k), _row_major(v)
    per_head = mixing.dim() == 3
    mix = mixing.to(torch.float32).contiguous()
    masked = key_mask is not None
    km = _row_major(key_mask).view(torch.uint8) if masked else q  # (a pointer the kernels never read when unmasked)
    half = q.dtype != torch.float32
    warps, stages = settings.SETTINGS.exact_launches[_p2(max(dim, dv))]
    bt = min(_p2(settings.SETTINGS.tile_tokens), _p2(t))
    geometry, nb0 = _geometry(layout)
    tiles = _cdiv(t, bt)
    consts = dict(**geometry, TILES=tiles, D=dim, DV=dv, BT=bt, BD=_p2(dim), BDV=_p2(dv), PHI=phi_id(phi),
                  MASKED=masked, DOT_PREC="tf32" if half else "ieee", WIDEN=half and interpreting(), num_warps=warps,
                  num_stages=stages)
    o = _new(batch, n, heads, dv, dtype=q.dtype, device=q.device)

    radius = (0,) * (3 - len(exact_radius)) + tuple(exact_radius)
    # some query reads a summary unless every block lies in every other's neighbourhood
    far = any(r < b - 1 for r, b in zip(exact_radius, layout.blocks))
    if far:
        dtype = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
        s, sf_strides = summary_rows(kv_heads, m, batch, dim * dv + dim, per_head=per_head, dtype=dtype,
                                     device=q.device)
        _blocks_summaries_kernel[(kv_heads, m, batch)](
            k, v, km, s, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), km.stride(0),
            *sf_strides, **consts)
        mix_far = mix.masked_fill(exact_mask(layout.blocks, exact_radius, q.device), 0.0).to(dtype)
        sf, far_groups = mix_rows(mix_far, s, per_head=per_head, kv_heads=kv_heads, groups=groups)
        del s
    else:
        sf, sf_strides, far_groups = o, (0, 0, 0), 1
    _blocks_forward_kernel[(heads, m * tiles, batch)](
        q, k, v, km, mix, sf, o, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), km.stride(0), o.stride(0), o.stride(1), o.stride(2),
        m * m if per_head else 0, *sf_strides, m, groups, far_groups, math.log2(math.e) * dim**-0.5,
        scale, eps, NB0=nb0, R0=radius[0], R1=radius[1], R2=radius[2], FAR=far, **consts)
    return o


def mhla_attention_exact_blocks_triton(q, k, v, mixing, layout: BlockLayout, *, exact_radius, phi, scale, eps,
                                       key_mask=None):
    """The Triton backend (same contract as `ops.exact_blocks.mhla_attention_exact_blocks_torch`)."""
    reason = unsupported_reason(q, k, v, mixing, layout, exact_radius=exact_radius, phi=phi, key_mask=key_mask)
    if reason is not None:
        raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
    options = dict(exact_radius=tuple(exact_radius), phi=phi, scale=scale, eps=eps)

    def backward(do, q, k, v, mixing, key_mask, needs):
        return mhla_attention_exact_blocks_triton_backward(do, q, k, v, mixing, layout, needs_grad=needs,
                                                           key_mask=key_mask, **options)

    def forward(q, k, v, mixing, key_mask):
        return _forward(q, k, v, mixing, layout, options["exact_radius"], phi, scale, eps, key_mask)

    return run_recomputed(forward, backward, q, k, v, mixing, key_mask)


def mhla_attention_exact_blocks_triton_backward(do, q, k, v, mixing, layout: BlockLayout, *, exact_radius, phi, scale,
                                                eps, needs_grad, key_mask=None):
    """(dq, dk, dv, dmixing) from the inputs alone: the torch path again under `torch.func.vjp` (zeros where
    `needs_grad` is False)."""
    return recomputed_grads(mhla_attention_exact_blocks_torch, do, q, k, v, mixing, layout, needs_grad,
                            exact_radius=tuple(exact_radius), phi=phi, scale=scale, eps=eps, key_mask=key_mask)


register("exact_blocks", "triton", mhla_attention_exact_blocks_triton, supports,
         mhla_attention_exact_blocks_triton_backward)
