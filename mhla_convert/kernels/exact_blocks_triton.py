"""The Triton backend of non-causal MHLA with an exact block neighbourhood (`ops.exact_blocks`; the torch path there is
the reference these kernels are tested against).

Forward, three launches:
1. summaries: S_j = Σ φ(k)ᵀ v and z_j = Σ φ(k) per (batch, kv head, block j), one row of D·Dv + D columns, over the
   block's tokens in token tiles (`Settings.exact_blocks_forward`; a block of Wan's 3 × 10 × 10 latent patches is
   300 tokens); skipped when every block lies in every other's neighbourhood (no query reads a summary);
2. the far mixture S̃_i = Σ_{j ∉ E(i)} m_ij S_j (and z̃), one torch GEMM with the mixing's neighbourhood entries set
   to 0 (per query head when the mixing is per head, else per kv head);
3. one fused program per (query head, query tile of block i, batch): the softmax kernel flash-style over the tokens
   of the K = Π(2·r_a + 1) blocks around block i (blocks off the block grid, blocks of weight 0 and keys of
   `key_mask` False left out), with the running row maximum starting at 0 as the shift, plus φ(q)·scale·S̃_i and
   its normaliser scaled by exp(−shift), divided and written in q's dtype. Inference may add tokens off the grid
   (`ExtraTokens`: a joint model's text), whose keys every row reads after its neighbourhood's and whose queries
   more programs of the same launch run as one more block, M, with no neighbourhood and row M of the mixture.

As in `mhla_kernels`, a block's tokens are found by index arithmetic on the grid (`mhla_kernels._rows`: every grid
seen as 3-D, block coordinates row-major): nothing is permuted or padded in memory, and the block shape's inner
sizes are compile-time constants, so those divisions are by constants. The neighbourhood is walked by offsets
from the query block's coordinates, radius per axis a compile-time constant. No (N × K·T) score matrix reaches
global memory: scores live in registers, one query tile × key tile at a time. Accumulation is float32; the
summaries and their mixture are bfloat16 for bfloat16 inputs, float32 otherwise (as in `exact_triton`).

Training: the forward also writes each row's log2-normaliser lse = shift + log2(den + eps·exp(−shift)), so that
p̂_ts = exp(q_t·k_s/√D − lse_t) is the row's probability of key s before its weight m_ij (and 1/L_t = exp(−lse_t)
for the row's whole normaliser L_t). It keeps the output o, lse (B·H·N floats) and the summaries S and S̃ (each
B·H·M·(D·Dv + D) numbers: under half the output's size at Wan's blocks of 300 tokens, 16,512 numbers per block
and head against 300 × 128 output values), where the torch path's recompute holds score tensors of B·H·M·T·K·T.
S and S̃ are kept rather than made again, which would cost a pass over k and v and the GEMM; o is the op's output,
which the layer after it usually keeps for its own backward. The backward, as flash attention's, takes three
launches and torch GEMMs between them:
4. per (query head, query tile of block i, batch): Δ = do·o per row; dq, flash-style over the same neighbourhood
   key tiles (ds = m_ij·p̂∘(do·vᵀ − Δ)) plus the linear part through φ'(q) from scale·(do·S̃_iᵀ − Δ·z̃_i)/L; and
   the exact weights' gradient partials Σ p̂∘(do·vᵀ − Δ) of the tile, one per block around i;
5. dS̃_i = scale·Σ φ(q)ᵀ do/L and dz̃_i = −scale·Σ φ(q)·Δ/L per (query head, block i, batch): the summaries
   kernel's product over φ(q) and do, its rows weighted;
6. dS_j = Σ_i m_ij dS̃_i over the blocks i whose neighbourhood leaves j out: one torch GEMM with the transposed
   far mixing (a shared mixing sums a group's query heads first);
7. per (kv head, key tile of block j, batch): dk and dv, over every query head of the group and every block i
   whose neighbourhood holds j (the blocks around j: the relation is symmetric), weighted by m_ij, plus the
   linear part φ(k)·dS_j and φ'(k)∘(v·dS_jᵀ + dz_j);
8. dmixing: the partials of 4 summed (over tiles, batch and, for a shared mixing, heads) and placed at each
   neighbour's flat id, plus ⟨dS̃_i, S_j⟩ + ⟨dz̃_i, z_j⟩ outside the neighbourhood (one torch GEMM).
No score tile reaches global memory in the backward either. Δ comes from the output as stored (in q's dtype, as
in flash attention); dS̃, dS and the mixing gradient are float32. A backward that builds a graph for a second one
(create_graph=True) runs the torch path again under `torch.func.vjp` instead (`backward_unsupported_reason`),
which autograd differentiates. The custom op's registered backward, which keeps nothing from its forward
(`mhla_attention_exact_blocks_triton_backward`), runs the forward's launches again, then these.

Importing this module registers the backend (as "triton" of the op "exact_blocks" of `ops.dispatch`).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from ..ops.blocks import BlockLayout
from ..ops.dispatch import register
from ..ops.exact_blocks import exact_mask, mhla_attention_exact_blocks_torch, neighbour_table
from . import settings
from .exact_triton import _operand, devices_reason, mix_rows, recomputed_grads, summary_rows
from .exact_triton import _rows as _row_major
from .mhla_kernels import _dphi, _phi, _rows
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
def _softmax_tile(q, kp, vp, s, kvalid, skn, svn, w, shift, den, acc, qk_scale, D: tl.constexpr, DV: tl.constexpr,
                  BD: tl.constexpr, BDV: tl.constexpr, DOT_PREC: tl.constexpr, WIDEN: tl.constexpr):
    """One key tile of the softmax read, flash-style: the keys at rows s (kvalid: real) of kp / vp, weighted by w;
    → the running (shift, den, acc) with the tile in (scores in log2 units, shift at least 0 from its start)."""
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    kt = tl.load(kp + s[None, :] * skn + d[:, None], mask=kvalid[None, :] & (d < D)[:, None], other=0.0)  # (BD, BK)
    scores = tl.dot(_operand(q, q.dtype, WIDEN), _operand(kt, kt.dtype, WIDEN), input_precision=DOT_PREC)
    scores = tl.where(kvalid[None, :], scores * qk_scale, float("-inf"))
    new = tl.maximum(shift, tl.max(scores, 1))
    alpha = tl.exp2(shift - new)
    p = tl.exp2(scores - new[:, None])
    v = tl.load(vp + s[:, None] * svn + e[None, :], mask=kvalid[:, None] & (e < DV)[None, :], other=0.0)
    pv = tl.dot(_operand(p, v.dtype, WIDEN), _operand(v, v.dtype, WIDEN), input_precision=DOT_PREC)
    return new, den * alpha + w * tl.sum(p, 1), acc * alpha[:, None] + w * pv


@triton.jit
def _blocks_forward_kernel(
    Q, K, V, KM, MIX, SF, O, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, smb, sob, son, soh, smh, sfb, sfh, sfj,
    M, GROUPS, FAR_GROUPS, qk_scale, scale, eps, L0, L1, L2, S0, S1: tl.constexpr, S2: tl.constexpr, NB0, NB1,
    NB2, T, TILES: tl.constexpr, R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, FAR: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr,
    MASKED: tl.constexpr, DOT_PREC: tl.constexpr, WIDEN: tl.constexpr, LSE, slb, slh,
    SAVE: tl.constexpr, BK: tl.constexpr, KTILES: tl.constexpr, XQ, XK, XV, XM, XW, XO, sxqb, sxqn, sxqh, sxkb,
    sxkn, sxkh, sxvb, sxvn, sxvh, sxmb, sxwh, sxob, sxon, sxoh, XL, EXTRA: tl.constexpr, XMASKED: tl.constexpr,
    XTILES: tl.constexpr,
):
    """Output rows of query tile `pid % TILES` of block i = pid // TILES (a block is TILES tiles of BT tokens), for
    query head h of batch b; each neighbour block's keys are read in KTILES tiles of BK tokens. qk_scale =
    log2(e)/√D: scores and the running maximum are in log2 units, so every exponential is an exp2. SAVE: also each
    row's log2-normaliser lse = shift + log2(den + eps·exp(−shift)), for the backward. EXTRA: also the XL extra
    tokens of XQ / XK / XV (XMASKED: the keys of XM true), read exactly in XTILES tiles of BK at weight XW[h, i];
    and programs pid ≥ M·TILES for their queries in tiles of BT, block i = M: no neighbourhood, the extra keys at
    XW[h, M] and row M of SF, written to XO."""
    h, pid, b = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    if EXTRA:
        image = pid < M * TILES
    else:
        image = True
    i, qtile = tl.minimum(pid // TILES, M), pid % TILES  # (M: the extra tokens' query block)
    hk = h // GROUPS
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    t, qvalid = _rows(i, qtile * BT + tl.arange(0, BT), L0, L1, L2, S0, S1, S2, NB1, NB2, T)
    x = (pid - M * TILES) * BT + tl.arange(0, BT)  # (an extra-token query tile's rows)
    if image:
        q = tl.load(Q + b * sqb + h * sqh + t[:, None] * sqn + d[None, :], mask=qvalid[:, None] & (d < D)[None, :],
                    other=0.0)
    else:
        q = tl.load(XQ + b * sxqb + h * sxqh + x[:, None] * sxqn + d[None, :],
                    mask=(x < XL)[:, None] & (d < D)[None, :], other=0.0)
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
        on_grid = (n0 >= 0) & (n0 < NB0) & (n1 >= 0) & (n1 < NB1) & (n2 >= 0) & (n2 < NB2) & image
        j = (n0 * NB1 + n1) * NB2 + n2
        w = tl.load(mix_row + j, mask=on_grid, other=0.0).to(tl.float32)
        # a block off the grid or of weight 0 has no keys: left out of the shift as of the sums
        if w > 0:
            for tile in range(KTILES):
                s, kvalid = _rows(j, tile * BK + tl.arange(0, BK), L0, L1, L2, S0, S1, S2, NB1, NB2, T)
                if MASKED:
                    kvalid &= tl.load(KM + b * smb + s, mask=kvalid, other=0) != 0
                shift, den, acc = _softmax_tile(q, kp, vp, s, kvalid, skn, svn, w, shift, den, acc, qk_scale, D, DV,
                                                BD, BDV, DOT_PREC, WIDEN)
    if EXTRA:  # keys every query of block i reads exactly at weight XW[h, i] (a joint model's text)
        w = tl.load(XW + h * sxwh + i).to(tl.float32)
        if w > 0:
            xkp, xvp = XK + b * sxkb + hk * sxkh, XV + b * sxvb + hk * sxvh
            for tile in range(XTILES):
                s = tile * BK + tl.arange(0, BK)
                kvalid = s < XL
                if XMASKED:
                    kvalid &= tl.load(XM + b * sxmb + s, mask=kvalid, other=0) != 0
                shift, den, acc = _softmax_tile(q, xkp, xvp, s, kvalid, sxkn, sxvn, w, shift, den, acc, qk_scale, D,
                                                DV, BD, BDV, DOT_PREC, WIDEN)

    decay = tl.exp2(-shift)  # exp(−shift) of the natural-log scores
    if FAR:  # the blocks outside the neighbourhood: the mixed summaries, row i of SF
        fq = _phi(q.to(tl.float32), PHI)  # (φ(0) of padded columns meets the zero rows of S̃ past D)
        row = SF + b * sfb + (h // FAR_GROUPS) * sfh + i.to(tl.int64) * sfj
        sf = tl.load(row + d[:, None] * DV + e[None, :], mask=(d < D)[:, None] & (e < DV)[None, :], other=0.0)
        zf = tl.load(row + D * DV + d, mask=d < D, other=0.0).to(tl.float32)
        num = tl.dot(_operand(fq, sf.dtype, WIDEN), _operand(sf, sf.dtype, WIDEN), input_precision=DOT_PREC)
        acc += num * (scale * decay)[:, None]
        den += tl.sum(fq * zf[None, :], 1) * (scale * decay)
    total = den + eps * decay
    out = acc / total[:, None]
    if image:
        tl.store(O + b * sob + h * soh + t[:, None] * son + e[None, :], out.to(O.dtype.element_ty),
                 mask=qvalid[:, None] & (e < DV)[None, :])
        if SAVE:
            tl.store(LSE + b * slb + h * slh + t, shift + tl.log2(total), mask=qvalid)
    else:
        tl.store(XO + b * sxob + h * sxoh + x[:, None] * sxon + e[None, :], out.to(XO.dtype.element_ty),
                 mask=(x < XL)[:, None] & (e < DV)[None, :])


@triton.jit
def _blocks_bwd_queries_kernel(
    Q, K, V, KM, MIX, SF, DO, O, LSE, DELTA, DQ, PART, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, smb, sdob,
    sdon, sdoh, sob, son, soh, sgb, sgn, sgh, slb, slh, spb, sph, smh, sfb, sfh, sfj, M, GROUPS, FAR_GROUPS, qk_scale,
    sm_scale, scale, L0, L1, L2, S0, S1: tl.constexpr, S2: tl.constexpr, NB0, NB1, NB2, T, TILES: tl.constexpr,
    R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, FAR: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr, MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr, WIDEN: tl.constexpr,
):
    """dq of query tile `pid % TILES` of block i = pid // TILES for query head h of batch b; the rows' Δ = do·o
    (DELTA, which the later launches read); and the exact mixing weights' gradient partials of the tile:
    PART[b, h, pid, n] = Σ p̂ ∘ (do·vᵀ − Δ) over its rows and the keys of the n-th block around i, where
    p̂ = exp(score − lse) is the unweighted probability (0 where the forward left the block or the key out)."""
    h, pid, b = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i, qtile = pid // TILES, pid % TILES
    hk = h // GROUPS
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    t, qvalid = _rows(i, qtile * BT + tl.arange(0, BT), L0, L1, L2, S0, S1, S2, NB1, NB2, T)
    q = tl.load(Q + b * sqb + h * sqh + t[:, None] * sqn + d[None, :], mask=qvalid[:, None] & (d < D)[None, :],
                other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + t[:, None] * sdon + e[None, :],
                 mask=qvalid[:, None] & (e < DV)[None, :], other=0.0)
    o = tl.load(O + b * sob + h * soh + t[:, None] * son + e[None, :], mask=qvalid[:, None] & (e < DV)[None, :],
                other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DELTA + b * slb + h * slh + t, delta, mask=qvalid)
    lse = tl.load(LSE + b * slb + h * slh + t, mask=qvalid, other=0.0)
    kp, vp = K + b * skb + hk * skh, V + b * svb + hk * svh
    part_row = PART + b * spb + h * sph + pid.to(tl.int64) * ((2 * R0 + 1) * (2 * R1 + 1) * (2 * R2 + 1))

    dq = tl.zeros((BT, BD), tl.float32)
    mix_row = MIX + h * smh + i.to(tl.int64) * M
    c0, c1, c2 = i // (NB1 * NB2), (i // NB2) % NB1, i % NB2
    W1: tl.constexpr = 2 * R1 + 1
    W2: tl.constexpr = 2 * R2 + 1
    for near in range((2 * R0 + 1) * W1 * W2):
        n0, n1, n2 = c0 + near // (W1 * W2) - R0, c1 + (near // W2) % W1 - R1, c2 + near % W2 - R2
        on_grid = (n0 >= 0) & (n0 < NB0) & (n1 >= 0) & (n1 < NB1) & (n2 >= 0) & (n2 < NB2)
        j = (n0 * NB1 + n1) * NB2 + n2
        w = tl.load(mix_row + j, mask=on_grid, other=0.0).to(tl.float32)
        part = tl.zeros((BT,), tl.float32)
        if w > 0:
            for tile in range(TILES):
                s, kvalid = _rows(j, tile * BT + tl.arange(0, BT), L0, L1, L2, S0, S1, S2, NB1, NB2, T)
                if MASKED:
                    kvalid &= tl.load(KM + b * smb + s, mask=kvalid, other=0) != 0
                kt = tl.load(kp + s[None, :] * skn + d[:, None], mask=kvalid[None, :] & (d < D)[:, None],
                             other=0.0)  # (BD, BT)
                vt = tl.load(vp + s[None, :] * svn + e[:, None], mask=kvalid[None, :] & (e < DV)[:, None],
                             other=0.0)  # (BDV, BT)
                scores = tl.dot(_operand(q, q.dtype, WIDEN), _operand(kt, kt.dtype, WIDEN), input_precision=DOT_PREC)
                p = tl.where(qvalid[:, None] & kvalid[None, :], tl.exp2(scores * qk_scale - lse[:, None]), 0.0)
                dp = tl.dot(_operand(do, do.dtype, WIDEN), _operand(vt, vt.dtype, WIDEN), input_precision=DOT_PREC)
                dpm = p * (dp - delta[:, None])
                part += tl.sum(dpm, 1)
                dq += tl.dot(_operand(dpm * w, kt.dtype, WIDEN), _operand(tl.trans(kt), kt.dtype, WIDEN),
                             input_precision=DOT_PREC)
        tl.store(part_row + near, tl.sum(part, 0))
    dq *= sm_scale

    if FAR:  # through φ(q): dφ(q) = scale·(do·S̃_iᵀ − Δ·z̃_i)/L
        qf = q.to(tl.float32)
        row = SF + b * sfb + (h // FAR_GROUPS) * sfh + i.to(tl.int64) * sfj
        sft = tl.load(row + d[None, :] * DV + e[:, None], mask=(d < D)[None, :] & (e < DV)[:, None],
                      other=0.0)  # (BDV, BD)
        zf = tl.load(row + D * DV + d, mask=d < D, other=0.0).to(tl.float32)
        dfq = tl.dot(_operand(do, sft.dtype, WIDEN), _operand(sft, sft.dtype, WIDEN), input_precision=DOT_PREC)
        dfq = (dfq - delta[:, None] * zf[None, :]) * (scale * tl.exp2(-lse))[:, None]
        dq += dfq * _dphi(qf, PHI)
    tl.store(DQ + b * sgb + h * sgh + t[:, None] * sgn + d[None, :], dq.to(DQ.dtype.element_ty),
             mask=qvalid[:, None] & (d < D)[None, :])


@triton.jit
def _blocks_bwd_summaries_kernel(
    Q, DO, LSE, DELTA, DST, sqb, sqn, sqh, sdob, sdon, sdoh, slb, slh, ssb, ssh, ssj, scale, L0, L1, L2, S0,
    S1: tl.constexpr, S2: tl.constexpr, NB1, NB2, T, TILES: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr, DOT_PREC: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """Row DST[b, h, i] = (dS̃_i, dz̃_i), the gradient of query head h's mixed summaries of block i:
    scale·Σ φ(q)ᵀ do / L and −scale·Σ φ(q)·Δ / L over the block's queries (1/L = exp2(−lse)). float32 operands
    (tf32 for half inputs): 1/L spans more than float16's range."""
    h, i, b = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    qp, dop = Q + b * sqb + h * sqh, DO + b * sdob + h * sdoh
    acc = tl.zeros((BD, BDV), tl.float32)
    z = tl.zeros((BD,), tl.float32)
    for tile in range(TILES):
        t, valid = _rows(i, tile * BT + tl.arange(0, BT), L0, L1, L2, S0, S1, S2, NB1, NB2, T)
        qmask = valid[:, None] & (d < D)[None, :]
        fq = tl.where(qmask, _phi(tl.load(qp + t[:, None] * sqn + d[None, :], mask=qmask, other=0.0).to(tl.float32),
                                  PHI), 0.0)
        do = tl.load(dop + t[:, None] * sdon + e[None, :], mask=valid[:, None] & (e < DV)[None, :], other=0.0)
        lse = tl.load(LSE + b * slb + h * slh + t, mask=valid, other=0.0)
        delta = tl.load(DELTA + b * slb + h * slh + t, mask=valid, other=0.0)
        r = tl.where(valid, scale * tl.exp2(-lse), 0.0)
        acc += tl.dot(_operand(tl.trans(fq * r[:, None]), tl.float32, WIDEN), _operand(do, tl.float32, WIDEN),
                      input_precision=DOT_PREC)
        z -= tl.sum(fq * (r * delta)[:, None], 0)
    row = DST + b * ssb + h * ssh + i.to(tl.int64) * ssj
    tl.store(row + d[:, None] * DV + e[None, :], acc, mask=(d < D)[:, None] & (e < DV)[None, :])
    tl.store(row + D * DV + d, z, mask=d < D)


@triton.jit
def _blocks_bwd_keys_kernel(
    Q, K, V, KM, MIX, DS, DO, LSE, DELTA, DK, DV_, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, smb, sdob, sdon,
    sdoh, sgb, sgn, sgh, shb, shn, shh, slb, slh, smh, ssb, ssh, ssj, M, GROUPS: tl.constexpr, qk_scale, sm_scale,
    L0, L1, L2, S0, S1: tl.constexpr, S2: tl.constexpr, NB0, NB1, NB2, T, TILES: tl.constexpr, R0: tl.constexpr,
    R1: tl.constexpr, R2: tl.constexpr, FAR: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """dk and dv of key tile `pid % TILES` of block j = pid // TILES for kv head hk of batch b: the exact part
    from every query head of the group and every query block i whose neighbourhood holds j (the blocks around j:
    the relation is symmetric), weighted by m_ij; the linear part through the summaries' gradient dS_j (DS).
    Keys of `key_mask` False get zeros."""
    hk, pid, b = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    j, ktile = pid // TILES, pid % TILES
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    s, inside = _rows(j, ktile * BT + tl.arange(0, BT), L0, L1, L2, S0, S1, S2, NB1, NB2, T)
    kvalid = inside
    if MASKED:
        kvalid &= tl.load(KM + b * smb + s, mask=inside, other=0) != 0
    k = tl.load(K + b * skb + hk * skh + s[:, None] * skn + d[None, :], mask=kvalid[:, None] & (d < D)[None, :],
                other=0.0)
    v = tl.load(V + b * svb + hk * svh + s[:, None] * svn + e[None, :], mask=kvalid[:, None] & (e < DV)[None, :],
                other=0.0)

    dk = tl.zeros((BT, BD), tl.float32)
    dv = tl.zeros((BT, BDV), tl.float32)
    c0, c1, c2 = j // (NB1 * NB2), (j // NB2) % NB1, j % NB2
    W1: tl.constexpr = 2 * R1 + 1
    W2: tl.constexpr = 2 * R2 + 1
    for g in range(GROUPS):
        h = hk * GROUPS + g
        qp, dop = Q + b * sqb + h * sqh, DO + b * sdob + h * sdoh
        lp, dlp = LSE + b * slb + h * slh, DELTA + b * slb + h * slh
        for near in range((2 * R0 + 1) * W1 * W2):
            n0, n1, n2 = c0 + near // (W1 * W2) - R0, c1 + (near // W2) % W1 - R1, c2 + near % W2 - R2
            on_grid = (n0 >= 0) & (n0 < NB0) & (n1 >= 0) & (n1 < NB1) & (n2 >= 0) & (n2 < NB2)
            i = (n0 * NB1 + n1) * NB2 + n2
            w = tl.load(MIX + h * smh + i.to(tl.int64) * M + j, mask=on_grid, other=0.0).to(tl.float32)
            if w > 0:
                for tile in range(TILES):
                    t, qvalid = _rows(i, tile * BT + tl.arange(0, BT), L0, L1, L2, S0, S1, S2, NB1, NB2, T)
                    qt = tl.load(qp + t[None, :] * sqn + d[:, None], mask=qvalid[None, :] & (d < D)[:, None],
                                 other=0.0)  # (BD, BT)
                    do = tl.load(dop + t[:, None] * sdon + e[None, :], mask=qvalid[:, None] & (e < DV)[None, :],
                                 other=0.0)  # (BT, BDV)
                    lse = tl.load(lp + t, mask=qvalid, other=0.0)
                    delta = tl.load(dlp + t, mask=qvalid, other=0.0)
                    scores = tl.dot(_operand(k, k.dtype, WIDEN), _operand(qt, qt.dtype, WIDEN),
                                    input_precision=DOT_PREC)  # (keys, queries)
                    p = tl.where(kvalid[:, None] & qvalid[None, :], tl.exp2(scores * qk_scale - lse[None, :]), 0.0)
                    p *= w
                    dv += tl.dot(_operand(p, do.dtype, WIDEN), _operand(do, do.dtype, WIDEN), input_precision=DOT_PREC)
                    dp = tl.dot(_operand(v, v.dtype, WIDEN), _operand(tl.trans(do), do.dtype, WIDEN),
                                input_precision=DOT_PREC)
                    ds = p * (dp - delta[None, :])
                    dk += tl.dot(_operand(ds, qt.dtype, WIDEN), _operand(tl.trans(qt), qt.dtype, WIDEN),
                                 input_precision=DOT_PREC)
    dk *= sm_scale

    if FAR:  # through S_j = Σ φ(k)ᵀ v and z_j = Σ φ(k): dv = φ(k)·dS_j, dφ(k) = v·dS_jᵀ + dz_j
        kf = k.to(tl.float32)
        fk = tl.where(kvalid[:, None] & (d < D)[None, :], _phi(kf, PHI), 0.0)
        row = DS + b * ssb + hk * ssh + j.to(tl.int64) * ssj
        dsm = tl.load(row + d[:, None] * DV + e[None, :], mask=(d < D)[:, None] & (e < DV)[None, :], other=0.0)
        dz = tl.load(row + D * DV + d, mask=d < D, other=0.0)
        dv += tl.dot(_operand(fk, tl.float32, WIDEN), _operand(dsm, tl.float32, WIDEN), input_precision=DOT_PREC)
        dfk = tl.dot(_operand(v, tl.float32, WIDEN), _operand(tl.trans(dsm), tl.float32, WIDEN),
                     input_precision=DOT_PREC) + dz[None, :]
        dk += tl.where(kvalid[:, None], dfk * _dphi(kf, PHI), 0.0)
    tl.store(DK + b * sgb + hk * sgh + s[:, None] * sgn + d[None, :], dk.to(DK.dtype.element_ty),
             mask=inside[:, None] & (d < D)[None, :])
    tl.store(DV_ + b * shb + hk * shh + s[:, None] * shn + e[None, :], dv.to(DV_.dtype.element_ty),
             mask=inside[:, None] & (e < DV)[None, :])


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


class _Problem(NamedTuple):
    """What fixes the attention besides its tensors."""

    layout: BlockLayout
    radius: tuple[int, ...]  # exact_radius, one per grid axis
    phi: Callable
    scale: float
    eps: float

    @property
    def far(self) -> bool:
        """Whether some query reads a summary: unless every block lies in every other's neighbourhood."""
        return any(r < b - 1 for r, b in zip(self.radius, self.layout.blocks))

    def options(self, key_mask) -> dict:
        """The torch path's keywords."""
        return dict(exact_radius=self.radius, phi=self.phi, scale=self.scale, eps=self.eps, key_mask=key_mask)


def _summary_strides(x: torch.Tensor, per_head: bool) -> tuple[int, int, int]:
    """(batch, head, row) strides of a 4-D summary buffer: (heads, rows, B, cols) per head, (rows, B, heads, cols)
    shared (`exact_triton.summary_rows`)."""
    return (x.stride(2), x.stride(0), x.stride(1)) if per_head else (x.stride(1), x.stride(2), x.stride(0))


class ExtraTokens(NamedTuple):
    """Tokens off the grid (a joint model's text) that every query block reads exactly, each block at its own
    weight, and that query too, as one more block M: their own keys exactly, the grid's blocks through their
    summaries (inference only)."""

    q: torch.Tensor  # (B, L, H, D)
    k: torch.Tensor  # (B, L, H_kv, D)
    v: torch.Tensor  # (B, L, H_kv, Dv)
    weight: torch.Tensor  # (H, M + 1) per query head or (1, M + 1) shared, ≥ 0: block i's weight of their keys
    reader: torch.Tensor  # (H, M) or (1, M), ≥ 0: their queries' weight of each grid block's summary
    mask: torch.Tensor | None  # (B, L) bool, False for padded keys; None: every key is real
    out: torch.Tensor  # (B, L, H, Dv), unit last stride: where their queries' rows go


def _extra_arguments(extra: ExtraTokens | None, q, bk: int) -> dict:
    """The forward kernel's EXTRA arguments (q: a pointer it never reads without them)."""
    if extra is None:
        return dict(XQ=q, XK=q, XV=q, XM=q, XW=q, XO=q, sxqb=0, sxqn=0, sxqh=0, sxkb=0, sxkn=0, sxkh=0, sxvb=0,
                    sxvn=0, sxvh=0, sxmb=0, sxwh=0, sxob=0, sxon=0, sxoh=0, XL=0, EXTRA=False, XMASKED=False,
                    XTILES=0)
    xq, k, v, o = _row_major(extra.q), _row_major(extra.k), _row_major(extra.v), extra.out
    w = extra.weight.to(torch.float32).contiguous()
    m = q if extra.mask is None else _row_major(extra.mask).view(torch.uint8)
    return dict(XQ=xq, XK=k, XV=v, XM=m, XW=w, XO=o, sxqb=xq.stride(0), sxqn=xq.stride(1), sxqh=xq.stride(2),
                sxkb=k.stride(0), sxkn=k.stride(1), sxkh=k.stride(2), sxvb=v.stride(0), sxvn=v.stride(1),
                sxvh=v.stride(2), sxmb=0 if extra.mask is None else m.stride(0),
                sxwh=w.stride(0) if w.shape[0] > 1 else 0, sxob=o.stride(0), sxon=o.stride(1), sxoh=o.stride(2),
                XL=k.shape[1], EXTRA=True, XMASKED=extra.mask is not None, XTILES=_cdiv(k.shape[1], bk))


def _forward(q, k, v, mixing, p: _Problem, key_mask, save: bool = False, extra: ExtraTokens | None = None,
             out: torch.Tensor | None = None):
    """The three launches of the module doc → output (B, N, H, Dv) in q's dtype; with `save`, what the backward
    reads too: (output, lse (B, H, N) float32, summaries S, their mixture S̃), S and S̃ None when no query reads
    them, else 4-D buffers of `summary_rows` (S per kv head, S̃ per query head for a per-head mixing). `extra`:
    tokens off the grid read exactly in the same softmax, whose queries' rows the same launch writes to extra.out
    (inference only: the backward does not know them). `out`: where the output goes, (B, N, H, Dv) in q's dtype
    with unit last stride (a slice of a larger buffer, say)."""
    if save and extra is not None:
        raise ValueError("extra tokens are for inference: the backward does not read them")
    layout = p.layout
    batch, n, heads, dim = q.shape
    kv_heads, dv = k.shape[2], v.shape[-1]
    groups, m, t = heads // kv_heads, layout.num_blocks, layout.tokens_per_block
    q, k, v = _row_major(q), _row_major(k), _row_major(v)
    per_head = mixing.dim() == 3
    mix = mixing.to(torch.float32).contiguous()
    masked = key_mask is not None
    km = _row_major(key_mask).view(torch.uint8) if masked else q  # (a pointer the kernels never read when unmasked)
    half = q.dtype != torch.float32
    own = settings.SETTINGS.exact_blocks_forward[_p2(max(dim, dv))]
    bt = min(_p2(own.tokens or settings.SETTINGS.tile_tokens), _p2(t))
    bk = min(_p2(own.keys or bt), _p2(t))
    geometry, nb0 = _geometry(layout)
    tiles = _cdiv(t, bt)
    consts = dict(**geometry, TILES=tiles, D=dim, DV=dv, BT=bt, BD=_p2(dim), BDV=_p2(dv), PHI=phi_id(p.phi),
                  MASKED=masked, DOT_PREC="tf32" if half else "ieee", WIDEN=half and interpreting(),
                  num_warps=own.warps or settings.SETTINGS.warps, **({"num_stages": own.stages} if own.stages else {}))
    o = _new(batch, n, heads, dv, dtype=q.dtype, device=q.device) if out is None else out
    lse = _new(batch, heads, n, dtype=torch.float32, device=q.device) if save else o

    radius = (0,) * (3 - len(p.radius)) + tuple(p.radius)
    s = sf = None
    far = p.far or extra is not None  # (the extra tokens' queries read every block's summary)
    if far:
        cols = dim * dv + dim
        dtype = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
        s, s_strides = summary_rows(kv_heads, m, batch, cols, per_head=per_head, dtype=dtype, device=q.device)
        _blocks_summaries_kernel[(kv_heads, m, batch)](
            k, v, km, s, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), km.stride(0),
            *s_strides, **consts)
        mix_far = mix.masked_fill(exact_mask(layout.blocks, p.radius, q.device), 0.0)
        if extra is not None:  # row M: the extra tokens' queries
            mix_far = torch.cat([mix_far, extra.reader.to(torch.float32).view(*mix_far.shape[:-2], 1, m)], -2)
        rows = mix_far.shape[-2]
        sf, far_groups = mix_rows(mix_far.to(dtype), s, per_head=per_head, kv_heads=kv_heads, groups=groups)
        sf = sf.view(heads, rows, batch, cols) if per_head else sf.view(rows, batch, kv_heads, cols)
        sf_strides = _summary_strides(sf, per_head)
    else:
        sf_strides, far_groups = (0, 0, 0), 1
    xtiles = 0 if extra is None else _cdiv(extra.k.shape[1], bt)
    _blocks_forward_kernel[(heads, m * tiles + xtiles, batch)](
        q, k, v, km, mix, o if sf is None else sf, o, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), km.stride(0), o.stride(0), o.stride(1),
        o.stride(2), m * m if per_head else 0, *sf_strides, m, groups, far_groups, math.log2(math.e) * dim**-0.5,
        p.scale, p.eps, NB0=nb0, R0=radius[0], R1=radius[1], R2=radius[2], FAR=far, LSE=lse,
        slb=lse.stride(0) if save else 0, slh=lse.stride(1) if save else 0, SAVE=save, BK=bk, KTILES=_cdiv(t, bk),
        **_extra_arguments(extra, q, bk), **consts)
    if not save:
        return o
    return o, lse, s, sf


def _backward(p: _Problem, do, q, k, v, mixing, key_mask, o, lse, s, sf, need_mixing: bool):
    """(dq, dk, dv, dmixing or None) from the forward's output, lse and summaries (`_forward(save=True)`): the
    query-side launch (dq, the exact weights' gradient partials, and Δ = do·o per row), dS̃ by the weighted
    summaries launch, dS = Σ_i m_ij dS̃_i by a torch GEMM, the key-side launch (dk, dv), and the far weights'
    gradient ⟨dS̃_i, S_j⟩ by a torch GEMM."""
    layout = p.layout
    batch, n, heads, dim = q.shape
    kv_heads, dv = k.shape[2], v.shape[-1]
    groups, m, t = heads // kv_heads, layout.num_blocks, layout.tokens_per_block
    q, k, v, do, o = (_row_major(x) for x in (q, k, v, do.to(q.dtype), o))
    per_head = mixing.dim() == 3
    mix = mixing.to(torch.float32).contiguous()
    masked = key_mask is not None
    km = _row_major(key_mask).view(torch.uint8) if masked else q
    half = q.dtype != torch.float32
    own = settings.SETTINGS.exact_blocks_backward[_p2(max(dim, dv))]
    bt = min(_p2(own.tokens or settings.SETTINGS.tile_tokens), _p2(t))
    tiles = _cdiv(t, bt)
    geometry, nb0 = _geometry(layout)
    radius = (0,) * (3 - len(p.radius)) + tuple(p.radius)
    near = math.prod(2 * r + 1 for r in radius)
    launch = dict(num_warps=own.warps or settings.SETTINGS.warps, **({"num_stages": own.stages} if own.stages else {}))
    consts = dict(**geometry, NB0=nb0, TILES=tiles, D=dim, DV=dv, BT=bt, BD=_p2(dim), BDV=_p2(dv), PHI=phi_id(p.phi),
                  DOT_PREC="tf32" if half else "ieee", WIDEN=half and interpreting(), **launch)
    region = dict(R0=radius[0], R1=radius[1], R2=radius[2], FAR=p.far, MASKED=masked)
    qk_scale, sm_scale = math.log2(math.e) * dim**-0.5, dim**-0.5
    cols = dim * dv + dim
    dev = q.device

    dq = _new(batch, n, heads, dim, dtype=q.dtype, device=dev)
    delta = _new(batch, heads, n, dtype=torch.float32, device=dev)
    part = _new(batch, heads, m * tiles, near, dtype=torch.float32, device=dev)
    sf_, sf_strides, far_groups = (o, (0, 0, 0), 1) if sf is None else (sf, _summary_strides(sf, per_head),
                                                                          1 if per_head else groups)
    _blocks_bwd_queries_kernel[(heads, m * tiles, batch)](
        q, k, v, km, mix, sf_, do, o, lse, delta, dq, part, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), km.stride(0), do.stride(0), do.stride(1),
        do.stride(2), o.stride(0), o.stride(1), o.stride(2), dq.stride(0), dq.stride(1), dq.stride(2),
        lse.stride(0), lse.stride(1), part.stride(0), part.stride(1), m * m if per_head else 0, *sf_strides, m,
        groups, far_groups, qk_scale, sm_scale, p.scale, **region, **consts)

    ds = dst = None
    if p.far:
        dst, dst_strides = summary_rows(heads, m, batch, cols, per_head=per_head, dtype=torch.float32, device=dev)
        _blocks_bwd_summaries_kernel[(heads, m, batch)](
            q, do, lse, delta, dst, q.stride(0), q.stride(1), q.stride(2), do.stride(0), do.stride(1), do.stride(2),
            lse.stride(0), lse.stride(1), *dst_strides, p.scale,
            **{key: consts[key] for key in (*geometry, "TILES", "D", "DV", "BT", "BD", "BDV", "PHI", "DOT_PREC",
                                            "WIDEN", "num_warps")})
        far = mix.masked_fill(exact_mask(layout.blocks, p.radius, dev), 0.0)  # m_ij for j outside E(i)
        if per_head:  # (H_kv, g·M, M)ᵀ @ (H_kv, g·M, B·cols): dS per kv head, (H_kv, M, B, cols)
            dst = dst.view(kv_heads, groups * m, batch * cols)
            ds = torch.bmm(far.view(kv_heads, groups * m, m).transpose(1, 2), dst).view(kv_heads, m, batch, cols)
        else:  # the group's query heads share the kv head's summaries: their dS̃ add up first
            dst = dst.view(m, batch, kv_heads, groups, cols).sum(3).view(m, -1)
            ds = (far.transpose(0, 1) @ dst).view(m, batch, kv_heads, cols)
    ds_strides = _summary_strides(ds, per_head) if p.far else (0, 0, 0)

    dk = _new(batch, n, kv_heads, dim, dtype=k.dtype, device=dev)
    dv_ = _new(batch, n, kv_heads, dv, dtype=v.dtype, device=dev)
    _blocks_bwd_keys_kernel[(kv_heads, m * tiles, batch)](
        q, k, v, km, mix, dq if ds is None else ds, do, lse, delta, dk, dv_, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), km.stride(0), do.stride(0),
        do.stride(1), do.stride(2), dk.stride(0), dk.stride(1), dk.stride(2), dv_.stride(0), dv_.stride(1),
        dv_.stride(2), lse.stride(0), lse.stride(1), m * m if per_head else 0, *ds_strides, m, groups, qk_scale,
        sm_scale, **region, **consts)
    if not need_mixing:
        return dq, dk, dv_, None

    # the exact weights: the partials summed per (query block, n-th block around it), placed at its flat id
    ids, valid = neighbour_table(layout, p.radius, dev)  # (M, K)
    part = part.view(batch, heads, m, tiles, near).sum((0, 3) if per_head else (0, 1, 3)) * valid
    dmix = torch.zeros_like(mix).scatter_add_(-1, ids.expand_as(part), part)
    if p.far:  # the far weights: ⟨dS̃_i, S_j⟩ summed over batch (and heads, when shared), outside E(i)
        if per_head:
            grad = torch.bmm(dst, s.float().view(kv_heads, m, batch * cols).transpose(1, 2)).view(heads, m, m)
        else:
            grad = dst @ s.float().view(m, -1).transpose(0, 1)
        dmix += grad.masked_fill(exact_mask(layout.blocks, p.radius, dev), 0.0)
    return dq, dk, dv_, dmix.to(mixing.dtype)


def backward_unsupported_reason(*, create_graph: bool) -> str | None:
    """Why a backward needs the torch path run again under `torch.func.vjp` rather than the backward kernels, or
    None: the kernels have no backward of their own, so a backward that builds a graph for a second one does."""
    return "a backward that builds a graph (create_graph=True)" if create_graph else None


def _recomputed(p: _Problem, do, q, k, v, mixing, key_mask, needs_grad):
    """(dq, dk, dv, dmixing) of the torch path run again under `torch.func.vjp` (zeros where not needed)."""
    return recomputed_grads(mhla_attention_exact_blocks_torch, do, q, k, v, mixing, p.layout, needs_grad,
                            **p.options(key_mask))


class _ExactBlocksFunction(torch.autograd.Function):
    """The forward's launches, keeping the output, each row's lse and the summaries for the backward launches."""

    @staticmethod
    def forward(ctx, q, k, v, mixing, key_mask, p: _Problem):
        o, lse, s, sf = _forward(q, k, v, mixing, p, key_mask, save=True)
        ctx.problem = p
        ctx.save_for_backward(q, k, v, mixing, key_mask, o, lse, s, sf)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, mixing, key_mask, o, lse, s, sf = ctx.saved_tensors
        p, needs = ctx.problem, ctx.needs_input_grad[:4]
        if backward_unsupported_reason(create_graph=torch.is_grad_enabled()) is None:
            grads = _backward(p, do, q, k, v, mixing, key_mask, o, lse, s, sf, need_mixing=needs[3])
        else:
            grads = _recomputed(p, do, q, k, v, mixing, key_mask, needs)
        return (*(g if need else None for g, need in zip(grads, needs)), None, None)


def mhla_attention_exact_blocks_triton(q, k, v, mixing, layout: BlockLayout, *, exact_radius, phi, scale, eps,
                                       key_mask=None):
    """The Triton backend (same contract as `ops.exact_blocks.mhla_attention_exact_blocks_torch`)."""
    reason = unsupported_reason(q, k, v, mixing, layout, exact_radius=exact_radius, phi=phi, key_mask=key_mask)
    if reason is not None:
        raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
    p = _Problem(layout, tuple(exact_radius), phi, scale, eps)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, mixing)):
        return _ExactBlocksFunction.apply(q, k, v, mixing, key_mask, p)
    return _forward(q, k, v, mixing, p, key_mask)


def forward_with_extra_tokens(q, k, v, mixing, layout: BlockLayout, extra: ExtraTokens, *, out: torch.Tensor,
                              exact_radius, phi, scale, eps) -> None:
    """Inference forward of the grid's queries, written to `out` (`_forward`'s), and of the `extra` tokens' queries,
    written to extra.out, in one launch (`joint_triton`'s image and text). Inputs must be ones `unsupported_reason`
    passes."""
    _forward(q, k, v, mixing, _Problem(layout, tuple(exact_radius), phi, scale, eps), None, extra=extra, out=out)


def mhla_attention_exact_blocks_triton_backward(do, q, k, v, mixing, layout: BlockLayout, *, exact_radius, phi, scale,
                                                eps, needs_grad, key_mask=None):
    """(dq, dk, dv, dmixing) from the inputs alone (the backward of the custom op `ops.exact_op`, which keeps
    nothing from its forward): the forward's launches again, saving what the backward launches read, then those;
    dmixing is zeros unless needs_grad[3]. Inputs the kernels do not take run the torch path again under
    `torch.func.vjp`."""
    p = _Problem(layout, tuple(exact_radius), phi, scale, eps)
    if (unsupported_reason(q, k, v, mixing, layout, exact_radius=exact_radius, phi=phi, key_mask=key_mask)
            or backward_unsupported_reason(create_graph=False)):
        return _recomputed(p, do, q, k, v, mixing, key_mask, needs_grad)
    o, lse, s, sf = _forward(q, k, v, mixing, p, key_mask, save=True)
    dq, dk, dv, dmix = _backward(p, do, q, k, v, mixing, key_mask, o, lse, s, sf, need_mixing=needs_grad[3])
    return dq, dk, dv, torch.zeros_like(mixing) if dmix is None else dmix


register("exact_blocks", "triton", mhla_attention_exact_blocks_triton, supports,
         mhla_attention_exact_blocks_triton_backward)
