"""Triton kernels for MHLA (the math is `ops.mhla`'s docstring; `ops.mhla.mhla_attention_torch`
is the naive reference each kernel is tested against), the decoding state's step and prompt, and the q/k
norm + rotary op. Their launches are in `mhla_triton`, `decode_triton` and `rotary_triton`.

Summaries live in one row per (batch, head, block) of COLS = D·Dv + D columns (float32; the input's
half precision in inference): S_b row major, then z_b. That makes the mixing one plain GEMM over M for
numerator and normaliser alike.

Grid → block mapping is index arithmetic (`_rows`): every grid is seen as 3-D (T, H, W) with
leading axes of length 1, block m covers the box of per-axis size s_a = ceil(L_a / b_a) at block
coordinates (m // (b1·b2), m // b2 % b1, m % b2), slots past the grid are masked. Nothing is
permuted or padded in memory. A causal chunk is one block of a 1-D grid and fits one tile.

Head dims and COLS are compile-time constants: a run-time D of 72 (not a multiple of 16) hides
from Triton that the `d < D` masks are constant over runs of 8, and every load turns scalar. So is
the block shape's S1, S2 (one compile per block shape: a resolution bucket, or an LM's chunk): `_rows`
divides every row index of every tile by them, and with run-time divisors each of those divisions is a
software integer division, a large share of the readout's and the summaries' instructions.

Two workarounds for Triton 3.6 miscompiles on sm_90 (hence the pinned `triton` extra in pyproject.toml):
`_summaries_kernel` weights φ rather than the loaded v tile, and `_mix_sweep_kernel` loads X again for its
tf32 product (see there).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _chained(PDL: tl.constexpr):
    """Programmatic dependent launch (Hopper): let the next launch's programs take SMs as this launch's
    last programs drain, then wait for the previous launch's writes. First in every kernel, before any
    global memory access, so a launch is safe after anything; a no-op when PDL is off."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _rows(m, j, L0, L1, L2, S0, S1, S2, NB1, NB2, T):
    """Token index (int64) and validity of in-block slots j of block m."""
    c0 = (m // (NB1 * NB2)) * S0 + j // (S1 * S2)
    c1 = ((m // NB2) % NB1) * S1 + (j // S2) % S1
    c2 = (m % NB2) * S2 + j % S2
    valid = (j < T) & (c0 < L0) & (c1 < L1) & (c2 < L2)
    return ((c0 * L1 + c1) * L2 + c2).to(tl.int64), valid


@triton.jit
def _phi(x, PHI: tl.constexpr):
    if PHI == 0:
        return tl.maximum(x, 0.0)
    else:  # elu + 1
        return tl.where(x > 0, x + 1.0, tl.exp(x))


@triton.jit
def _dphi(x, PHI: tl.constexpr):
    if PHI == 0:
        return (x > 0).to(tl.float32)
    else:
        return tl.where(x > 0, 1.0, tl.exp(x))


@triton.jit
def _load_rows(base, n, valid, stride_n, d, dmask):
    """(BT, BD) tile of token rows n of q, k, v, o or do (each read once per launch: evicted first from
    L2, which then keeps the summaries that the next launch reads); zero where masked."""
    mask = valid[:, None] & dmask[None, :]
    return tl.load(base + n[:, None] * stride_n + d[None, :], mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _load_phi(base, n, valid, stride_n, d, dmask, PHI: tl.constexpr):
    """φ of a row tile (float32), zeroed at masked slots (φ(0) need not be 0), and the raw tile for φ'."""
    x = _load_rows(base, n, valid, stride_n, d, dmask).to(tl.float32)
    return tl.where(valid[:, None] & dmask[None, :], _phi(x, PHI), 0.0), x


@triton.jit
def _summaries_kernel(
    K, V, S, W, skb, skn: tl.constexpr, skh: tl.constexpr, svb, svn: tl.constexpr, svh: tl.constexpr, HS, M,
    COLS: tl.constexpr, L0, L1, L2, S0, S1: tl.constexpr, S2: tl.constexpr, NB1, NB2, T, D: tl.constexpr,
    DV: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr, ATOMIC: tl.constexpr,
    DOT_PREC: tl.constexpr, TILES_PER_PROG: tl.constexpr, BDH: tl.constexpr = 0, BDVH: tl.constexpr = 0,
    GROUP: tl.constexpr = 1, WEIGHTED: tl.constexpr = False, scale=1.0, PDL: tl.constexpr = False,
    HILO: tl.constexpr = False, LO=0,
):
    """S[b, s, m] = Σ φ(k)ᵀ v and z = Σ φ(k) over block m's tokens (a share of its tiles when split), for
    the GROUP heads s·GROUP … of k and v.

    WEIGHTED is the backward's dS̃_i = Σ (scale φ(q))ᵀ dnum, dz̃_i = Σ scale φ(q) dden (K = q, V = do, GROUP =
    query heads per mixed summary): with dnum = do / (den + eps) and dden = −(do·o) / (den + eps), each token's
    φ row is scaled by scale·W[b, h, 0, n] = scale / (den + eps) (from `_bwd_query_kernel`) and rounded to the
    input's precision once, the operand of both products: dS̃'s with do, and dz̃'s with W[b, h, 1, n] = −do·o
    in two columns, its hi and lo half parts (in place of the forward's ones). Rounding those rows is the
    error dS̃ has anyway, and in dz̃ it adds nothing measurable to dk's and dmixing's errors (checked against a
    float64 emulation); a float32 sum of the unrounded rows would need a cross-warp reduction per tile. The
    weight goes on φ, already in registers, and not on the loaded v tile: rescaling that tile before its
    product makes Triton 3.6 read shared memory out of range (bf16, sm_90).

    z is a tile product with ones, like S, not a column sum: that avoids a cross-warp reduction per tile.
    BDH / BDVH > 0 split a head dim that is not a power of two into BD + BDH columns (72 = 64 + 16 instead
    of 128): four smaller accumulators in place of one mostly padded one (see `head_dim_parts`). HILO:
    float32 sums stored as two halves, the rounded sum at S and its remainder LO elements on (`_put`)."""
    _chained(PDL)
    bh, m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, hs = (bh // HS).to(tl.int64), bh % HS
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    dm, em = d < D, e < DV
    nt = L0 * L1 * L2
    s_ll = tl.zeros((BD, BDV), tl.float32)
    z_l = tl.zeros((BD, 16), tl.float32)  # 16 equal columns: the smallest tile product
    if BDVH:
        eh = BDV + tl.arange(0, BDVH)
        ehm = eh < DV
        s_lh = tl.zeros((BD, BDVH), tl.float32)
    if BDH:
        dh = BD + tl.arange(0, BDH)
        dhm = dh < D
        s_hl = tl.zeros((BDH, BDV), tl.float32)
        z_h = tl.zeros((BDH, 16), tl.float32)
        if BDVH:
            s_hh = tl.zeros((BDH, BDVH), tl.float32)
    for it in range(GROUP * TILES_PER_PROG):  # (one loop over heads and tiles: Triton pipelines the innermost)
        h = hs * GROUP + it // TILES_PER_PROG
        kp, vp = K + b * skb + h * skh, V + b * svb + h * svh
        t = split * TILES_PER_PROG + it % TILES_PER_PROG  # tiles past the block are all-masked (j ≥ T)
        n, valid = _rows(m, t * BT + tl.arange(0, BT), L0, L1, L2, S0, S1, S2, NB1, NB2, T)
        vv = _load_rows(vp, n, valid, svn, e, em)
        dt = vv.dtype
        fk, _ = _load_phi(kp, n, valid, skn, d, dm, PHI)
        if WEIGHTED:
            wp = W + (b * HS * GROUP + h) * 2 * nt
            wq = tl.load(wp + n, mask=valid, other=0.0) * scale
            fk = fk * wq[:, None]
            wz = tl.load(wp + nt + n, mask=valid, other=0.0)
            wz_hi = wz.to(dt)
            col = tl.arange(0, 16)[None, :]  # (BT, 16): W[1]'s hi part in column 0, its lo part in column 1
            wz_lo = (wz - wz_hi.to(tl.float32))[:, None]
            zr = tl.where(col == 0, wz_hi[:, None], tl.where(col == 1, wz_lo, 0.0)).to(dt)
        else:
            zr = tl.full((BT, 16), 1.0, dt)  # (z's right operand: ones, or W[1]'s parts)
        fk = tl.trans(fk.to(dt))
        s_ll += tl.dot(fk, vv, input_precision=DOT_PREC)
        z_l += tl.dot(fk, zr, input_precision=DOT_PREC)
        if BDVH:
            vh = _load_rows(vp, n, valid, svn, eh, ehm)
            s_lh += tl.dot(fk, vh, input_precision=DOT_PREC)
        if BDH:
            fkh, _ = _load_phi(kp, n, valid, skn, dh, dhm, PHI)
            if WEIGHTED:
                fkh = fkh * wq[:, None]
            fkh = tl.trans(fkh.to(dt))
            s_hl += tl.dot(fkh, vv, input_precision=DOT_PREC)
            z_h += tl.dot(fkh, zr, input_precision=DOT_PREC)
            if BDVH:
                s_hh += tl.dot(fkh, vh, input_precision=DOT_PREC)
    # z: the 16 equal columns' one, or (WEIGHTED) the sum of W[1]'s hi and lo columns
    z_l = tl.sum(z_l, 1) if WEIGHTED else tl.max(z_l, 1)
    if BDH:
        z_h = tl.sum(z_h, 1) if WEIGHTED else tl.max(z_h, 1)
    out = S + (bh * M + m).to(tl.int64) * COLS
    _put(out + d[:, None] * DV + e[None, :], s_ll, dm[:, None] & em[None, :], ATOMIC, HILO, LO)
    _put(out + D * DV + d, z_l, dm, ATOMIC, HILO, LO)
    if BDVH:
        _put(out + d[:, None] * DV + eh[None, :], s_lh, dm[:, None] & ehm[None, :], ATOMIC, HILO, LO)
    if BDH:
        _put(out + dh[:, None] * DV + e[None, :], s_hl, dhm[:, None] & em[None, :], ATOMIC, HILO, LO)
        _put(out + D * DV + dh, z_h, dhm, ATOMIC, HILO, LO)
        if BDVH:
            _put(out + dh[:, None] * DV + eh[None, :], s_hh, dhm[:, None] & ehm[None, :], ATOMIC, HILO, LO)


@triton.jit
def _put(ptr, value, mask, ATOMIC: tl.constexpr, HILO: tl.constexpr, LO):
    """Store (cast to the buffer's dtype), or add float32 partials when a block is split over programs.
    HILO (half buffer): also the rounding's remainder, LO elements on, so hi + lo keeps 16 significant
    bits (bf16) of the float32 value, and a reader that wants only the rounded value reads half the bytes."""
    if ATOMIC:
        tl.atomic_add(ptr, value, mask=mask)
    else:
        hi = value.to(ptr.dtype.element_ty)
        tl.store(ptr, hi, mask=mask)
        if HILO:
            tl.store(ptr + LO, (value - hi.to(tl.float32)).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mix_dot(a, x, acc, DOT_PREC: tl.constexpr):
    """acc + a @ x for float32 mixing weights a. Half x stays half: a goes in two half-precision parts
    (hi + lo), so the product keeps a's float32 precision on the half-precision tensor cores, and x
    is not widened to float32 (which doubles its shared-memory tiles)."""
    if x.dtype == tl.float32:
        acc = tl.dot(a, x, acc, input_precision=DOT_PREC)
    else:
        a_hi = a.to(x.dtype)
        acc = tl.dot((a - a_hi.to(tl.float32)).to(x.dtype), x, tl.dot(a_hi, x, acc))
    return acc


@triton.jit
def _mix_kernel(
    A, X, OUT, COLS: tl.constexpr, H_OUT, GX, a_sh, a_si, a_sk, x_sb, x_sh, o_sb, o_sh, M: tl.constexpr,
    R: tl.constexpr, MASK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """OUT[b, o] = Σ_{r<R} A_p @ X[b, p // GX] with p = o·R + r, over M × COLS column tiles. A float32 X
    with a half OUT goes in hi + lo half parts, three half-precision products in all (lo · lo is below
    both's precision): a (K × COLS) row-major float32 tile is no tf32 tensor-core operand on Hopper (whose
    tf32 operands must be K-contiguous), and its product ran at float32 FMA speed, several times slower.

    Forward: A = mixing, X = summaries. Backward: A = mixingᵀ (strides swapped), X = dS̃, and R
    sums the query heads that share a key head. MASK 1 keeps A[i, k] for k < i, 2 for k > i (the
    strict causal triangle, as stored or transposed)."""
    _chained(PDL)
    bo, pi, pc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, o = (bo // H_OUT).to(tl.int64), bo % H_OUT
    i = pi * BM + tl.arange(0, BM)
    c = pc * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for r in range(R):
        p = o * R + r
        ap = A + p * a_sh
        xp = X + b * x_sb + (p // GX) * x_sh
        for k0 in range(0, M, BK):
            # (loop bounds stay kernel arguments: the interpreter takes no program-id bounds)
            live = True
            if MASK == 1:
                live = k0 < pi * BM + BM - 1
            if MASK == 2:
                live = k0 + BK - 1 > pi * BM
            if live:
                kk = k0 + tl.arange(0, BK)
                amask = (i < M)[:, None] & (kk < M)[None, :]
                if MASK == 1:
                    amask = amask & (kk[None, :] < i[:, None])
                if MASK == 2:
                    amask = amask & (kk[None, :] > i[:, None])
                a = tl.load(ap + i[:, None] * a_si + kk[None, :] * a_sk, mask=amask, other=0.0).to(tl.float32)
                x = tl.load(
                    xp + kk[:, None] * COLS + c[None, :], mask=(kk < M)[:, None] & (c < COLS)[None, :], other=0.0
                )
                if X.dtype.element_ty == tl.float32 and OUT.dtype.element_ty != tl.float32:
                    x_hi = x.to(OUT.dtype.element_ty)
                    acc = tl.dot(a.to(x_hi.dtype), (x - x_hi.to(tl.float32)).to(x_hi.dtype), acc)
                    x = x_hi
                acc = _mix_dot(a, x, acc, DOT_PREC)
    out = OUT + b * o_sb + o * o_sh + i[:, None] * COLS + c[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=(i < M)[:, None] & (c < COLS)[None, :])


@triton.jit
def _mix_sweep_kernel(
    A, X, OUT, S, PART, COLS: tl.constexpr, H_OUT, GX, a_sh, a_si, a_sk, x_sb, x_sh, o_sb, o_sh, M: tl.constexpr,
    MASK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, COL_TILES: tl.constexpr, DOT_PREC: tl.constexpr,
    GRAD: tl.constexpr, PDL: tl.constexpr = False, HILO: tl.constexpr = False, LO=0,
):
    """OUT[b, o] = A_o @ X[b, o // GX] when all M ≤ BM blocks fit one tile (`_mix_kernel` with R = 1):
    A_o is loaded once and the program sweeps COL_TILES column tiles, so each summary column is read
    once and nothing is re-read per row tile. A float32 X is rounded to OUT's precision first (the sum
    is rounded to it anyway, and as a tf32 operand of a column-major tile it would load 4 bytes at a
    time). GRAD (backward: X = dS̃, S the summaries of the same heads, float32 or HILO):
    also the mixing gradient's ⟨X_i, S_j⟩ over the swept columns, into PART per program, in the same
    pass over dS̃; HILO: dS̃ and S as two halves each (`_put`, LO elements apart), the gradient as three
    half products (lo · lo is below both's precision), every operand straight from its load."""
    _chained(PDL)
    bo, pc = tl.program_id(0), tl.program_id(1)
    b, o = (bo // H_OUT).to(tl.int64), bo % H_OUT
    i = tl.arange(0, BM)
    amask = (i < M)[:, None] & (i < M)[None, :]
    if MASK == 1:
        amask = amask & (i[None, :] < i[:, None])
    if MASK == 2:
        amask = amask & (i[None, :] > i[:, None])
    a = tl.load(A + o * a_sh + i[:, None] * a_si + i[None, :] * a_sk, mask=amask, other=0.0).to(tl.float32)
    xp = X + b * x_sb + (o // GX) * x_sh
    op = OUT + b * o_sb + o * o_sh
    if GRAD:
        g = tl.zeros((BM, BM), tl.float32)
    for t in range(COL_TILES):
        c = (pc * COL_TILES + t) * BN + tl.arange(0, BN)
        mask = (i < M)[:, None] & (c < COLS)[None, :]
        x = tl.load(xp + i[:, None] * COLS + c[None, :], mask=mask, other=0.0)
        xm = x
        if X.dtype.element_ty == tl.float32:
            xm = x.to(OUT.dtype.element_ty)
        acc = _mix_dot(a, xm, tl.zeros((BM, BN), tl.float32), DOT_PREC)
        tl.store(op + i[:, None] * COLS + c[None, :], acc.to(OUT.dtype.element_ty), mask=mask)
        if GRAD:
            sp = S + b * o_sb + o * o_sh + i[:, None] * COLS + c[None, :]
            if HILO:  # (xm is dS̃'s hi part, as loaded)
                s_hi = tl.load(sp, mask=mask, other=0.0)
                g = tl.dot(xm, tl.trans(s_hi), g)
                g = tl.dot(xm, tl.trans(tl.load(sp + LO, mask=mask, other=0.0)), g)
                g = tl.dot(tl.load(xp + i[:, None] * COLS + c[None, :] + LO, mask=mask, other=0.0), tl.trans(s_hi), g)
            else:  # (X loaded again for its tf32 product: Triton 3.6 on sm_90 mis-pipelines one load used both
                # in registers and as a tf32 operand, and the sums come out wrong from 2 stages on)
                x = tl.load(xp + i[:, None] * COLS + c[None, :], mask=mask, other=0.0, cache_modifier=".cg")
                g = tl.dot(x, tl.trans(tl.load(sp, mask=mask, other=0.0)), g, input_precision=DOT_PREC)
    if GRAD:
        if MASK:  # the strict causal triangle (mixing weights on or above the diagonal are not used)
            g = tl.where(i[None, :] < i[:, None], g, 0.0)
        row = (o * (tl.num_programs(0) // H_OUT) + b) * tl.num_programs(1) + pc  # (head, batch, split) order
        part = PART + row.to(tl.int64) * M * M + i[:, None] * M + i[None, :]
        tl.store(part, g, mask=(i < M)[:, None] & (i < M)[None, :])


@triton.jit
def _readout_kernel(
    Q, K, V, ST, MIX, O, sqb, sqn: tl.constexpr, sqh: tl.constexpr, skb, skn: tl.constexpr, skh: tl.constexpr, svb,
    svn: tl.constexpr, svh: tl.constexpr, sob, son: tl.constexpr, soh: tl.constexpr, H, HKV_GROUP, HMIX_GROUP, HMIX, M,
    COLS: tl.constexpr, MIX_SH, scale, eps, L0, L1, L2, S0, S1: tl.constexpr, S2: tl.constexpr, NB1, NB2, T,
    D: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr,
    NORMALIZE: tl.constexpr, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, TILES_PER_PROG: tl.constexpr,
    BDH: tl.constexpr = 0, BDVH: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """o = φ(q)·S̃_i / (φ(q)·z̃_i + eps) for token tiles of block i (S̃_i loaded once); causal
    adds the query's own chunk, weighted by m_ii, as a masked tile product. BDH / BDVH: head dims
    in two column parts, as in `_summaries_kernel` (non-causal only)."""
    _chained(PDL)
    bh, m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = (bh // H).to(tl.int64), bh % H
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    dm, em = d < D, e < DV
    sp = ST + ((b * HMIX + h // HMIX_GROUP) * M + m) * COLS
    st = tl.load(sp + d[:, None] * DV + e[None, :], mask=dm[:, None] & em[None, :], other=0.0)
    dt = st.dtype
    if NORMALIZE:  # z̃ as 16 equal columns: φ(q)·z̃ is then a tile product, like the numerator
        zt = tl.broadcast_to(tl.load(sp + D * DV + d, mask=dm, other=0.0)[:, None], (BD, 16))
    if BDVH:
        eh = BDV + tl.arange(0, BDVH)
        ehm = eh < DV
        st_lh = tl.load(sp + d[:, None] * DV + eh[None, :], mask=dm[:, None] & ehm[None, :], other=0.0)
    if BDH:
        dh = BD + tl.arange(0, BDH)
        dhm = dh < D
        st_hl = tl.load(sp + dh[:, None] * DV + e[None, :], mask=dhm[:, None] & em[None, :], other=0.0)
        if NORMALIZE:
            zt_h = tl.broadcast_to(tl.load(sp + D * DV + dh, mask=dhm, other=0.0)[:, None], (BDH, 16))
        if BDVH:
            st_hh = tl.load(sp + dh[:, None] * DV + eh[None, :], mask=dhm[:, None] & ehm[None, :], other=0.0)
    qp, op = Q + b * sqb + h * sqh, O + b * sob + h * soh
    for t in range(TILES_PER_PROG):
        j = (split * TILES_PER_PROG + t) * BT + tl.arange(0, BT)
        n, valid = _rows(m, j, L0, L1, L2, S0, S1, S2, NB1, NB2, T)
        fq, _ = _load_phi(qp, n, valid, sqn, d, dm, PHI)
        fq = fq * scale
        num = tl.dot(fq.to(dt), st, input_precision=DOT_PREC)
        if NORMALIZE:
            den = tl.dot(fq.to(dt), zt, input_precision=DOT_PREC)
        if BDVH:
            num_h = tl.dot(fq.to(dt), st_lh, input_precision=DOT_PREC)
        if BDH:
            fq_h, _ = _load_phi(qp, n, valid, sqn, dh, dhm, PHI)
            fq_h = fq_h * scale
            num += tl.dot(fq_h.to(dt), st_hl, input_precision=DOT_PREC)
            if NORMALIZE:
                den += tl.dot(fq_h.to(dt), zt_h, input_precision=DOT_PREC)
            if BDVH:
                num_h += tl.dot(fq_h.to(dt), st_hh, input_precision=DOT_PREC)
        if CAUSAL:
            mii = tl.load(MIX + h * MIX_SH + m * M + m).to(tl.float32)
            hk = h // HKV_GROUP
            fk, _ = _load_phi(K + b * skb + hk * skh, n, valid, skn, d, dm, PHI)
            vv = _load_rows(V + b * svb + hk * svh, n, valid, svn, e, em)
            a = tl.dot(fq.to(vv.dtype), tl.trans(fk.to(vv.dtype)), input_precision=DOT_PREC)
            a = tl.where(j[:, None] >= j[None, :], a, 0.0) * mii
            num += tl.dot(a.to(vv.dtype), vv, input_precision=DOT_PREC)
            if NORMALIZE:
                den += tl.sum(a, 1)[:, None]
        if NORMALIZE:
            den = tl.max(den, 1)  # (the 16 columns are equal)
            num = num / (den + eps)[:, None]
        tl.store(op + n[:, None] * son + e[None, :], num.to(O.dtype.element_ty), mask=valid[:, None] & em[None, :])
        if BDVH:
            if NORMALIZE:
                num_h = num_h / (den + eps)[:, None]
            tl.store(
                op + n[:, None] * son + eh[None, :], num_h.to(O.dtype.element_ty), mask=valid[:, None] & ehm[None, :]
            )


@triton.jit
def _bwd_query_kernel(
    Q, K, V, O, DO, ST, MIX, DQ, W, sqb, sqn: tl.constexpr, sqh: tl.constexpr, skb, skn: tl.constexpr,
    skh: tl.constexpr, svb, svn: tl.constexpr, svh: tl.constexpr, sob, son: tl.constexpr, soh: tl.constexpr, sdb,
    sdn: tl.constexpr, sdh: tl.constexpr, H, HKV_GROUP, HMIX_GROUP, HMIX, M, COLS: tl.constexpr, MIX_SH, scale, eps, L0,
    L1, L2, S0, S1: tl.constexpr, S2: tl.constexpr, NB1, NB2, T, D: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr, NORMALIZE: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr, TILES_PER_PROG: tl.constexpr, RECOMPUTE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """dq for token tiles of block i of query head h (S̃_i loaded once), and per token W[b, h, 0, n] =
    1/(den + eps), W[b, h, 1, n] = −do·o, from which the summaries kernel (WEIGHTED) makes dS̃ and dz̃ and
    the key side its own-chunk terms. With o = num / (den + eps): dnum = do / (den + eps), dden = −(do·o) / (den + eps),
    dφ(q) = S̃_i dnum + z̃_i dden; causal adds the own-chunk terms through dA = m_ii (dnum vᵀ + dden).
    Unnormalised: W = (1, 0). No accumulator across tiles, so nothing limits the programs per SM but
    the tiles (the dS̃ accumulator in here held one program per SM at 255 registers).
    RECOMPUTE (causal, normalised, half inputs): o at float32 precision instead of the stored half one. The
    own-chunk part of ∂/∂m_ii is Σ A ⊙ (dnum vᵀ + dden), two large terms that cancel (a first chunk's o does
    not depend on m_ii at all), so do·o must be the same sum the key side's A makes, not its rounding."""
    _chained(PDL)
    bh, m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = (bh // H).to(tl.int64), bh % H
    hk = h // HKV_GROUP
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    dm, em = d < D, e < DV
    sp = ST + ((b * HMIX + h // HMIX_GROUP) * M + m) * COLS
    st = tl.load(sp + d[:, None] * DV + e[None, :], mask=dm[:, None] & em[None, :], other=0.0)
    dt = st.dtype
    if NORMALIZE:
        zt = tl.load(sp + D * DV + d, mask=dm, other=0.0).to(tl.float32)
    if CAUSAL:
        mii = tl.load(MIX + h * MIX_SH + m * M + m).to(tl.float32)
    nt = L0 * L1 * L2
    wp = W + (b * H + h) * 2 * nt
    for t in range(TILES_PER_PROG):
        j = (split * TILES_PER_PROG + t) * BT + tl.arange(0, BT)
        n, valid = _rows(m, j, L0, L1, L2, S0, S1, S2, NB1, NB2, T)
        fq, qx = _load_phi(Q + b * sqb + h * sqh, n, valid, sqn, d, dm, PHI)
        fq = fq * scale
        do = _load_rows(DO + b * sdb + h * sdh, n, valid, sdn, e, em).to(tl.float32)
        if CAUSAL:
            fk, _ = _load_phi(K + b * skb + hk * skh, n, valid, skn, d, dm, PHI)
            vv = _load_rows(V + b * svb + hk * svh, n, valid, svn, e, em)
            tri = j[:, None] >= j[None, :]
        if NORMALIZE:
            den = tl.sum(fq * zt[None, :], 1)
            if CAUSAL:
                a = tl.dot(fq.to(dt), tl.trans(fk.to(dt)), input_precision=DOT_PREC)
                if RECOMPUTE:  # a as the key side makes it, from φ(q)·scale in hi + lo parts
                    fq_lo = (fq - fq.to(dt).to(tl.float32)).to(dt)
                    a += tl.dot(fq_lo, tl.trans(fk.to(dt)), input_precision=DOT_PREC)
                a = tl.where(tri, a, 0.0) * mii
                den += tl.sum(a, 1)
            rinv = 1.0 / (den + eps)
            if RECOMPUTE:
                num = tl.dot(fq.to(dt), st, tl.dot(fq_lo, st, input_precision=DOT_PREC), input_precision=DOT_PREC)
                a_hi = a.to(dt)
                num = tl.dot(a_hi, vv, num, input_precision=DOT_PREC)
                num = tl.dot((a - a_hi.to(tl.float32)).to(dt), vv, num, input_precision=DOT_PREC)
                o = num * rinv[:, None]
            else:
                o = _load_rows(O + b * sob + h * soh, n, valid, son, e, em).to(tl.float32)
            ndo = -tl.sum(do * o, 1)
        else:
            rinv = tl.full((BT,), 1.0, tl.float32)
            ndo = tl.zeros((BT,), tl.float32)
        # dφ(q)·(den + eps) first, the factor last: do (exact in its dtype) is the products' operand, where
        # do / (den + eps) rounded to fp16 overflows for a query with all-zero features (den = 0), and inf · 0
        # made its gradient (and, causal, every gradient) NaN
        dfq = tl.dot(do.to(dt), tl.trans(st), input_precision=DOT_PREC)
        if NORMALIZE:
            dfq += ndo[:, None] * zt[None, :]
        if CAUSAL:
            g = tl.dot(do.to(dt), tl.trans(vv.to(dt)), input_precision=DOT_PREC)
            if NORMALIZE:
                g += ndo[:, None]
            da = tl.where(tri, g, 0.0) * mii
            dfq += tl.dot(da.to(dt), fk.to(dt), input_precision=DOT_PREC)
        dq = dfq * (rinv * scale)[:, None] * _dphi(qx, PHI)
        tl.store(DQ + b * sqb + h * sqh + n[:, None] * sqn + d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=valid[:, None] & dm[None, :])
        tl.store(wp + n, rinv, mask=valid)
        tl.store(wp + nt + n, ndo, mask=valid)


@triton.jit
def _bwd_key_kernel(
    Q, K, V, DO, MIX, DS, W, DK, DVV, DMII, sqb, sqn: tl.constexpr, sqh: tl.constexpr, skb, skn: tl.constexpr,
    skh: tl.constexpr, svb, svn: tl.constexpr, svh: tl.constexpr, sdb, sdn: tl.constexpr, sdh: tl.constexpr, H, HKV, M,
    COLS: tl.constexpr, MIX_SH, scale, L0, L1, L2, S0, S1: tl.constexpr, S2: tl.constexpr, NB1, NB2, T, D: tl.constexpr,
    DV: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr, NORMALIZE: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, HKV_GROUP: tl.constexpr, TILES_PER_PROG: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """dk, dv of token tiles of block b from dS_b = Σ_i m_ib dS̃_i (loaded once): dφ(k) = v dS_bᵀ + dz_b,
    dv = φ(k) dS_b; causal adds the own-chunk terms (summed over the query heads of this key head, with
    dnum and dden from the query side's W) and writes each head's ∂/∂m_ii = Σ A ⊙ (dnum vᵀ + dden) over
    the chunk (a causal chunk is one tile)."""
    _chained(PDL)
    bh, m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, hk = (bh // HKV).to(tl.int64), bh % HKV
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    dm, em = d < D, e < DV
    dsp = DS + (bh * M + m).to(tl.int64) * COLS
    ds = tl.load(dsp + d[:, None] * DV + e[None, :], mask=dm[:, None] & em[None, :], other=0.0)
    dt = ds.dtype  # (the inputs' dtype)
    if NORMALIZE:
        dz = tl.load(dsp + D * DV + d, mask=dm, other=0.0).to(tl.float32)
    nt = L0 * L1 * L2
    for t in range(TILES_PER_PROG):
        j = (split * TILES_PER_PROG + t) * BT + tl.arange(0, BT)
        n, valid = _rows(m, j, L0, L1, L2, S0, S1, S2, NB1, NB2, T)
        rmask = valid[:, None] & em[None, :]
        fk, kx = _load_phi(K + b * skb + hk * skh, n, valid, skn, d, dm, PHI)
        vv = _load_rows(V + b * svb + hk * svh, n, valid, svn, e, em)
        dfk = tl.dot(vv, tl.trans(ds), input_precision=DOT_PREC)
        if NORMALIZE:
            dfk += dz[None, :]
        dv = tl.dot(fk.to(dt), ds, input_precision=DOT_PREC)
        if CAUSAL:
            tri = j[:, None] >= j[None, :]
            for r in range(HKV_GROUP):
                h = hk * HKV_GROUP + r
                mii = tl.load(MIX + h * MIX_SH + m * M + m).to(tl.float32)
                fq, _ = _load_phi(Q + b * sqb + h * sqh, n, valid, sqn, d, dm, PHI)
                fq = fq * scale
                wp = W + (b * H + h) * 2 * nt
                do = _load_rows(DO + b * sdb + h * sdh, n, valid, sdn, e, em).to(tl.float32)
                rinv = tl.load(wp + n, mask=valid, other=0.0)
                a = tl.dot(fq.to(dt), tl.trans(fk.to(dt)), input_precision=DOT_PREC)
                if K.dtype.element_ty != tl.float32:  # half inputs: add the part that rounding φ(q)·scale to them
                    # dropped, so ∂/∂m_ii sums the float32 products the torch path does
                    a += tl.dot((fq - fq.to(dt).to(tl.float32)).to(dt), tl.trans(fk.to(dt)), input_precision=DOT_PREC)
                # the query rows' factor 1/(den + eps) goes on A (A / (den + eps) ≤ 1 / m_ii) and on φ(q), not on
                # do: do / (den + eps) rounded to fp16 overflows where den = 0 (see `_bwd_query_kernel`)
                a = tl.where(tri, a, 0.0) * rinv[:, None]
                g = tl.dot(do.to(dt), tl.trans(vv), input_precision=DOT_PREC)  # (do is exact in its dtype)
                if NORMALIZE:  # + (den + eps)·dden = −do·o
                    g += tl.load(wp + nt + n, mask=valid, other=0.0)[:, None]
                g = tl.where(tri, g, 0.0)
                dfk += mii * tl.dot(tl.trans(g.to(dt)), (fq * rinv[:, None]).to(dt), input_precision=DOT_PREC)
                dv += mii * tl.dot(tl.trans(a.to(dt)), do.to(dt), input_precision=DOT_PREC)
                tl.store(DMII + (b * H + h) * M + m, tl.sum(tl.sum(a * g, 1), 0))
        dk = dfk * _dphi(kx, PHI)
        tl.store(DK + b * skb + hk * skh + n[:, None] * skn + d[None, :], dk.to(DK.dtype.element_ty),
                 mask=valid[:, None] & dm[None, :])
        tl.store(DVV + b * svb + hk * svh + n[:, None] * svn + e[None, :], dv.to(DVV.dtype.element_ty), mask=rmask)


@triton.jit
def _dmix_kernel(
    DST, S, PART, HMIX, GX, NB, M, COLS: tl.constexpr, STEPS: tl.constexpr, SPLIT, PER_HEAD: tl.constexpr,
    STRICT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """PART[(g, split), i, j] = ⟨dS̃_i, S_j⟩ (numerator and normaliser) over one split of a group's column
    steps, summed by `_sum_partials_kernel`. A group (g) is one mixing head's (batch, column tile) steps
    (PER_HEAD), else every (batch, mixing head, column tile) step: the splits cut that flat sequence into
    STEPS-long runs, so the launch's programs fill the device evenly whatever the heads and columns. Float32
    dS̃ and S: products at DOT_PREC; half ones: half-precision products."""
    _chained(PDL)
    pid, pi, pj = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    sp, g = pid % SPLIT, pid // SPLIT
    i = pi * BM + tl.arange(0, BM)
    jj = pj * BN + tl.arange(0, BN)
    col_tiles: tl.constexpr = (COLS + BK - 1) // BK
    total = NB * col_tiles if PER_HEAD else NB * HMIX * col_tiles
    acc = tl.zeros((BM, BN), tl.float32)
    live = True
    if STRICT:  # tiles on or above the diagonal get no gradient through the summaries
        live = pj * BN < pi * BM + BM - 1
    if live:
        for step in range(0, STEPS):
            t = sp * STEPS + step
            if PER_HEAD:
                b, p = t // col_tiles, g
            else:
                b, p = t // (HMIX * col_tiles), (t // col_tiles) % HMIX
            c = (t % col_tiles) * BK + tl.arange(0, BK)
            cm = (c < COLS) & (t < total)
            ap = DST + (b * HMIX + p).to(tl.int64) * M * COLS
            xp = S + (b * (HMIX // GX) + p // GX).to(tl.int64) * M * COLS
            a = tl.load(ap + i[:, None] * COLS + c[None, :], mask=(i < M)[:, None] & cm[None, :], other=0.0)
            x = tl.load(xp + jj[None, :] * COLS + c[:, None], mask=(jj < M)[None, :] & cm[:, None], other=0.0)
            if a.dtype == tl.float32:
                acc = tl.dot(a, x, acc, input_precision=DOT_PREC)
            else:
                acc = tl.dot(a, x, acc)
    if STRICT:
        acc = tl.where(jj[None, :] < i[:, None], acc, 0.0)
    tl.store(
        PART + pid.to(tl.int64) * M * M + i[:, None] * M + jj[None, :], acc, mask=(i < M)[:, None] & (jj < M)[None, :]
    )


@triton.jit
def _sum_partials_kernel(
    PART, OUT, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False
):
    """OUT[g, c] = Σ_r PART[g, r, c]: the mixing gradient's partials, summed in a fixed order (bit-reproducible,
    unlike atomics, and faster than torch's reductions over these leading dims)."""
    _chained(PDL)
    g, pc = tl.program_id(0), tl.program_id(1)
    c = pc * BC + tl.arange(0, BC)
    base = PART + g.to(tl.int64) * R * C
    acc = tl.zeros((BC,), tl.float32)
    for r0 in range(0, R, BR):
        r = r0 + tl.arange(0, BR)
        acc += tl.sum(
            tl.load(base + r[:, None] * C + c[None, :], mask=(r < R)[:, None] & (c < C)[None, :], other=0.0), 0
        )
    tl.store(OUT + g.to(tl.int64) * C + c, acc, mask=c < C)


@triton.jit
def _norm_rotate_kernel(X, W, COS, SIN, OUT, sxb, sxn, scb, scn, ssb, ssn, N, eps,
                        C: tl.constexpr, D: tl.constexpr, BP: tl.constexpr, NORM: tl.constexpr, AFFINE: tl.constexpr):
    """Row (b, n): y = x·rsqrt(mean(x²) + eps)·w, then out[2i] = y[2i]·c − y[2i+1]·s and
    out[2i+1] = y[2i]·s + y[2i+1]·c with c = cos[2i], s = sin[2i+1] of the pair's head column."""
    row = tl.program_id(0)
    b, n = (row // N).to(tl.int64), (row % N).to(tl.int64)
    c = tl.arange(0, 2 * BP)
    x = tl.load(X + b * sxb + n * sxn + c, mask=c < C, other=0.0).to(tl.float32)
    if NORM:
        x = x * tl.rsqrt(tl.sum(x * x, 0) / C + eps)
    if AFFINE:
        x = x * tl.load(W + c, mask=c < C, other=0.0).to(tl.float32)
    xe, xo = tl.split(tl.reshape(x, (BP, 2)))
    p = tl.arange(0, BP)
    pm = p < C // 2
    hc = (2 * p) % D  # the pair's even column within its head
    cs = tl.load(COS + b * scb + n * scn + hc, mask=pm, other=0.0).to(tl.float32)
    sn = tl.load(SIN + b * ssb + n * ssn + hc + 1, mask=pm, other=0.0).to(tl.float32)
    out = tl.reshape(tl.join(xe * cs - xo * sn, xe * sn + xo * cs), (2 * BP,))
    tl.store(OUT + (b * N + n) * C + c, out.to(OUT.dtype.element_ty), mask=c < C)


@triton.jit
def _norm_rotate_half_kernel(X, W, COS, SIN, OUT, sxb, sxn, scb, scn, ssb, ssn, N, eps, H: tl.constexpr,
                             D: tl.constexpr, BH: tl.constexpr, BD2: tl.constexpr, NORM: tl.constexpr):
    """Row (b, n) of H heads: per head y = x·rsqrt(mean(x²) + eps)·w over its D channels (NORM), then the
    half-split rotation: out[j] = y[j]·cos[j] − y[j + D/2]·sin[j], out[j + D/2] = y[j + D/2]·cos[j + D/2] +
    y[j]·sin[j + D/2] (transformers' `apply_rotary_pos_emb`), in float32, rounded once."""
    row = tl.program_id(0)
    b, n = (row // N).to(tl.int64), (row % N).to(tl.int64)
    h, j = tl.arange(0, BH), tl.arange(0, BD2)
    jm = j < D // 2
    mask = (h < H)[:, None] & jm[None, :]
    off = h[:, None] * D + j[None, :]
    x1 = tl.load(X + b * sxb + n * sxn + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + b * sxb + n * sxn + off + D // 2, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
        x1 = x1 * r * tl.load(W + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        x2 = x2 * r * tl.load(W + j + D // 2, mask=jm, other=0.0).to(tl.float32)[None, :]
    cp, sp = COS + b * scb + n * scn + j, SIN + b * ssb + n * ssn + j
    c1, c2 = tl.load(cp, mask=jm, other=0.0).to(tl.float32), tl.load(cp + D // 2, mask=jm, other=0.0).to(tl.float32)
    s1, s2 = tl.load(sp, mask=jm, other=0.0).to(tl.float32), tl.load(sp + D // 2, mask=jm, other=0.0).to(tl.float32)
    out = OUT + (b * N + n) * (H * D) + off
    tl.store(out, (x1 * c1[None, :] - x2 * s1[None, :]).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out + D // 2, (x2 * c2[None, :] + x1 * s2[None, :]).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _decode_step_kernel(
    Q, K, V, R, POS, REAL, CUR_S, CUR_Z, REC_S, REC_Z, FAR_S, FAR_Z, BREC_S, BREC_Z, BFAR_S, BFAR_Z, RING_K, RING_V,
    ARRIVALS, O, sqb, sqh, skb, skh, svb, svh, HKV, G, R_SH, SLOTS, scale, eps, W: tl.constexpr, D: tl.constexpr,
    DV: tl.constexpr, NREC: tl.constexpr, C: tl.constexpr, L: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
    BDV: tl.constexpr, SPLITS: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PHI: tl.constexpr,
    NORMALIZE: tl.constexpr, HAS_REAL: tl.constexpr,
):
    """One decoding token of one causal layer's `DecodeState` (`ops.recurrent`) for batch row b and key head hk, all
    of it in place: the readout of the open chunk, the NREC closed ones, the far sum and (L > 0) the exact window,
    then the state's update, closing the chunk when the token completes it. The row's position and whether its
    token is real (REAL; all are without HAS_REAL) are read here and advanced by the caller.

    SPLITS programs share a (row, key head), each owning BDV of the Dv value columns: its slices of the (D, Dv)
    summaries, of the output and of the ring's values, which it reads and then updates with no second launch (a
    close first copies the summaries to the rollback copies, BREC and BFAR, then, after a barrier, shifts the
    recent ones from those copies). Every program reads all of the key sums z (the normaliser) and the ring's keys
    (the window's scores); the one that arrives last at ARRIVALS[row] (an atomic count, left at 0) updates them,
    when every other has read them."""
    bh, split = tl.program_id(0), tl.program_id(1)
    b, hk = (bh // HKV).to(tl.int64), bh % HKV
    row = b * HKV + hk
    pos = tl.load(POS + b)
    if HAS_REAL:
        adv = tl.load(REAL + b) != 0
    else:
        adv = pos >= 0
    close = adv & ((pos + 1) % C == 0)
    g = tl.arange(0, BG)
    gm = g < G
    h = hk * G + g
    rp = R + h * R_SH  # (BG,) each query head's relative mixing
    e = split * BDV + tl.arange(0, BDV)
    em = e < DV
    vx = tl.load(V + b * svb + hk * svh + e, mask=em, other=0.0).to(tl.float32)
    d = tl.arange(0, BD)
    dm = d < D

    # the exact window (L > 0): the ring's tokens of the open chunk and the L − 1 before it, then the token itself;
    # an online softmax whose running max starts at 0 (the shift is at least 0)
    top = tl.zeros((BG,), tl.float32)
    wacc = tl.zeros((BG, BDV), tl.float32)
    wsum = tl.zeros((BG,), tl.float32)
    if L > 0:
        qx = tl.load(Q + b * sqb + h[:, None] * sqh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        qx = qx.to(tl.float32) * (D ** -0.5)
        start = tl.maximum(pos // C - L + 1, 0) * C
        for t0 in range(0, L * C, BT):
            p = start + t0 + tl.arange(0, BT)
            valid = p < pos
            slot = (b * SLOTS + p % SLOTS) * HKV + hk
            kt = tl.load(RING_K + slot[:, None] * D + d[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
            w = tl.load(rp[:, None] + (pos // C - p // C)[None, :], mask=gm[:, None] & valid[None, :], other=0.0)
            w = w.to(tl.float32)
            allowed = valid[None, :] & (w > 0)
            s = tl.where(allowed, tl.sum(qx[:, None, :] * kt.to(tl.float32)[None, :, :], 2), float("-inf"))
            new_top = tl.maximum(top, tl.max(s, 1))
            a = tl.where(allowed, tl.exp(s - new_top[:, None]) * w, 0.0)
            vt = tl.load(RING_V + slot[:, None] * DV + e[None, :], mask=valid[:, None] & em[None, :], other=0.0)
            alpha = tl.exp(top - new_top)
            wacc = wacc * alpha[:, None] + tl.sum(a[:, :, None] * vt.to(tl.float32)[None, :, :], 1)
            wsum = wsum * alpha + tl.sum(a, 1)
            top = new_top
        kx = tl.load(K + b * skb + hk * skh + d, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(rp, mask=gm, other=0.0).to(tl.float32)
        s = tl.where(w > 0, tl.sum(qx * kx[None, :], 1), float("-inf"))
        new_top = tl.maximum(top, s)
        a = tl.where(w > 0, tl.exp(s - new_top) * w, 0.0)
        alpha = tl.exp(top - new_top)
        wacc = wacc * alpha[:, None] + a[:, None] * vx[None, :]
        wsum = wsum * alpha + a
        top = new_top

    # the summaries, by (BK, BDV) tiles: readout, then the update of this program's columns
    num = tl.zeros((BG, BDV), tl.float32)
    den = tl.zeros((BG,), tl.float32)
    for d0 in tl.static_range(0, BD, BK):
        dk = d0 + tl.arange(0, BK)
        dkm = dk < D
        tile = dkm[:, None] & em[None, :]
        fq = tl.load(Q + b * sqb + h[:, None] * sqh + dk[None, :], mask=gm[:, None] & dkm[None, :], other=0.0)
        fq = tl.where(gm[:, None] & dkm[None, :], _phi(fq.to(tl.float32), PHI), 0.0) * scale
        fq = fq.to(tl.float32)  # (BG, BK) (torch.compile passes the Python float `scale` as a float64)
        fk = tl.where(dkm, _phi(tl.load(K + b * skb + hk * skh + dk, mask=dkm, other=0.0).to(tl.float32), PHI), 0.0)
        at = dk[:, None] * DV + e[None, :]  # a tile of one (D, Dv) summary
        cs = tl.load(CUR_S + row * D * DV + at, mask=tile, other=0.0) + fk[:, None] * vx[None, :]
        cz = tl.load(CUR_Z + row * D + dk, mask=dkm, other=0.0) + fk
        fs = tl.load(FAR_S + row * D * DV + at, mask=tile, other=0.0)
        # the summaries mixed per query head first, so the φ(q) product reduces once per tile
        mixed = tl.zeros((BG, BK, BDV), tl.float32)
        mixed_z = tl.zeros((BG, BK), tl.float32)
        if L == 0:
            mixed, mixed_z = _decode_mix(mixed, mixed_z, cs, cz, tl.load(rp, mask=gm, other=0.0))
        if W - 1 >= L:
            mixed, mixed_z = _decode_mix(mixed, mixed_z, fs, tl.load(FAR_Z + row * D + dk, mask=dkm, other=0.0),
                                         tl.load(rp + W - 1, mask=gm, other=0.0))
        for i in tl.static_range(NREC):
            if NREC - i >= L:  # distance NREC − i: read exactly in the window when nearer
                at_i = (row * NREC + i) * D * DV + at
                mixed, mixed_z = _decode_mix(mixed, mixed_z, tl.load(REC_S + at_i, mask=tile, other=0.0),
                                             tl.load(REC_Z + (row * NREC + i) * D + dk, mask=dkm, other=0.0),
                                             tl.load(rp + NREC - i, mask=gm, other=0.0))
        num += tl.sum(fq[:, :, None] * mixed, 1)
        den += tl.sum(fq * mixed_z, 1)
        tl.store(CUR_S + row * D * DV + at, tl.where(close, 0.0, cs), mask=tile)
        _decode_close(FAR_S, REC_S, BFAR_S, BREC_S, row, at, D * DV, fs, cs, tile & close, NREC)

    if L > 0:  # the window's softmax weights and the summaries' linear ones, normalised together
        decay = tl.exp(-top)
        out = (num * decay[:, None] + wacc) / (den * decay + wsum + eps * decay)[:, None]
    elif NORMALIZE:
        out = num / (den + eps)[:, None]
    else:
        out = num
    tl.store(O + (row * G + g[:, None]) * DV + e[None, :], out.to(O.dtype.element_ty), mask=gm[:, None] & em[None, :])
    # the token joins the ring (after the window read: its slot held a token older than the window)
    slot = (b * SLOTS + pos % SLOTS) * HKV + hk
    tl.store(RING_V + slot * DV + e, tl.load(V + b * svb + hk * svh + e, mask=em, other=0.0), mask=em & adv)

    # the key sums and the ring's keys, by the last program of the row to arrive
    if SPLITS > 1:
        tl.debug_barrier()  # every thread of this program has read them
        last = tl.atomic_add(ARRIVALS + row, 1, sem="acq_rel") == SPLITS - 1
        tl.store(ARRIVALS + row, 0, mask=last)
    else:
        last = pos == pos
    zm = dm & last
    fk = tl.where(dm, _phi(tl.load(K + b * skb + hk * skh + d, mask=dm, other=0.0).to(tl.float32), PHI), 0.0)
    cz = tl.load(CUR_Z + row * D + d, mask=zm, other=0.0) + fk
    tl.store(CUR_Z + row * D + d, tl.where(close, 0.0, cz), mask=zm)
    _decode_close(FAR_Z, REC_Z, BFAR_Z, BREC_Z, row, d, D, tl.load(FAR_Z + row * D + d, mask=zm, other=0.0), cz,
                  zm & close, NREC)
    tl.store(RING_K + slot * D + d, tl.load(K + b * skb + hk * skh + d, mask=dm, other=0.0), mask=zm & adv)


@triton.jit
def _decode_close(FAR, REC, BFAR, BREC, row, at, size, far, cur, shut, NREC: tl.constexpr):
    """A chunk close (where `shut`) of one part of a row's summaries, at offsets `at` within each of `size`
    elements (a tile of the (D, Dv) ones, or the z ones), given the far and open chunk's values: the rollback
    copies, then (after a barrier) far += oldest recent, the recent ones shifted, the open chunk last."""
    tl.store(BFAR + row * size + at, far, mask=shut)
    for i in tl.static_range(NREC):
        at_i = (row * NREC + i) * size + at
        tl.store(BREC + at_i, tl.load(REC + at_i, mask=shut, other=0.0), mask=shut)
    tl.debug_barrier()
    if NREC == 0:
        tl.store(FAR + row * size + at, far + cur, mask=shut)
    else:
        tl.store(FAR + row * size + at, far + tl.load(BREC + row * NREC * size + at, mask=shut, other=0.0),
                 mask=shut)
        for i in tl.static_range(1, NREC):
            at_i = (row * NREC + i) * size + at
            tl.store(REC + at_i - size, tl.load(BREC + at_i, mask=shut, other=0.0), mask=shut)
        tl.store(REC + (row * NREC + NREC - 1) * size + at, cur, mask=shut)


@triton.jit
def _decode_mix(mixed, mixed_z, s, z, w):
    """One summary's share of the decoding readout's per-head mixture: mixed += w·S, mixed_z += w·z."""
    w = w.to(tl.float32)
    return mixed + w[:, None, None] * s[None, :, :], mixed_z + w[:, None] * z[None, :]


@triton.jit
def _older_sums_kernel(K, V, LEN, PS, PZ, skb, skn, skh, svb, svn, svh, HKV,
                       D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, KEEP: tl.constexpr, SPLIT: tl.constexpr,
                       BT: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, PHI: tl.constexpr,
                       HALF_DOT: tl.constexpr):
    """A prompt's sums Σ φ(k_t) v_tᵀ and Σ φ(k_t) over the tokens of row b and key head hk older than the KEEP + 2
    chunks that its decoding state keeps apart (t < (LEN[b] // C − KEEP − 1)·C), split over programs by SPLIT
    tokens: program (b·HKV + hk, p) writes the float32 partials of its tokens to PS[p, b·HKV + hk] (D, Dv) and
    PZ[p, b·HKV + hk] (D,). Every product is exact and summed in float32: with HALF_DOT (half inputs, φ = relu,
    which keeps them representable) on tensor cores in the inputs' dtype, else in float32 without tf32."""
    bh, p = tl.program_id(0), tl.program_id(1)
    b, hk = (bh // HKV).to(tl.int64), bh % HKV
    end = (tl.load(LEN + b) // C - KEEP - 1) * C
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    dm, em = d < D, e < DV
    acc = tl.zeros((BD, BDV), tl.float32)
    accz = tl.zeros((BD,), tl.float32)
    for t0 in range(0, SPLIT, BT):
        n = p * SPLIT + t0 + tl.arange(0, BT)
        acc, accz = _sum_rows(K + b * skb + hk * skh, V + b * svb + hk * svh, n, n < end, skn, svn, d, dm, e, em,
                              acc, accz, PHI, HALF_DOT)
    part = p * tl.num_programs(0) + bh
    tl.store(PS + (part * D + d[:, None]) * DV + e[None, :], acc, mask=dm[:, None] & em[None, :])
    tl.store(PZ + part * D + d, accz, mask=dm)


@triton.jit
def _sum_rows(kp, vp, n, valid, skn, svn, d, dm, e, em, acc, accz, PHI: tl.constexpr, HALF_DOT: tl.constexpr):
    """acc + Σ φ(k_n) v_nᵀ, accz + Σ φ(k_n) over the valid token rows n (exact products, float32 sums)."""
    fk, _ = _load_phi(kp, n, valid, skn, d, dm, PHI)
    vt = _load_rows(vp, n, valid, svn, e, em)
    if HALF_DOT:
        acc += tl.dot(tl.trans(fk.to(vt.dtype)), vt)
    else:
        acc += tl.dot(tl.trans(fk), vt.to(tl.float32), input_precision="ieee")
    return acc, accz + tl.sum(fk, 0)


@triton.jit
def _prompt_state_kernel(
    K, V, LEN, OLD_S, OLD_Z, POS, CUR_S, CUR_Z, REC_S, REC_Z, FAR_S, FAR_Z, BREC_S, BREC_Z, BFAR_S, BFAR_Z, BVALID,
    RING_K, RING_V, skb, skn, skh, svb, svn, svh, N, HKV, D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
    KEEP: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    PHI: tl.constexpr, HALF_DOT: tl.constexpr,
):
    """A `DecodeState` started afresh from a prompt (`DecodeState.prefill_torch`), for row b and key head hk of
    program (b·HKV + hk, j). Programs j < KEEP + 2 sum chunk j of the KEEP + 2 chunks before and at the row's open
    one (of LEN[b] tokens, chunks of C; their first token may be < 0: no tokens there) and write it where the state
    keeps it: chunk 0 onto the older chunks' sums OLD (far; OLD itself is the far sums before the last close),
    chunks 0 … KEEP − 1 as the recent sums before the last close, 1 … KEEP as the recent ones, KEEP + 1 as the open
    chunk. Program KEEP + 2 fills the ring with the row's last R tokens' keys and values (token t in slot t mod R;
    slots before the first token hold token 0). Every summary tensor is contiguous (B, HKV, [KEEP,] D[, Dv])."""
    bh, j = tl.program_id(0), tl.program_id(1)
    b, hk = (bh // HKV).to(tl.int64), bh % HKV
    length = tl.load(LEN + b)
    kp, vp = K + b * skb + hk * skh, V + b * svb + hk * svh
    d, e = tl.arange(0, BD), tl.arange(0, BDV)
    dm, em = d < D, e < DV
    if j < KEEP + 2:
        first = (length // C - KEEP - 1) * C + j * C
        acc = tl.zeros((BD, BDV), tl.float32)
        accz = tl.zeros((BD,), tl.float32)
        for t0 in range(0, C, BC):
            n = first + t0 + tl.arange(0, BC)
            valid = (t0 + tl.arange(0, BC) < C) & (n >= 0) & (n < length)
            acc, accz = _sum_rows(kp, vp, n, valid, skn, svn, d, dm, e, em, acc, accz, PHI, HALF_DOT)
        sm, so = dm[:, None] & em[None, :], d[:, None] * DV + e[None, :]
        if j == 0:
            old_s = tl.load(OLD_S + bh * D * DV + so, mask=sm)
            old_z = tl.load(OLD_Z + bh * D + d, mask=dm)
            tl.store(BFAR_S + bh * D * DV + so, old_s, mask=sm)
            tl.store(BFAR_Z + bh * D + d, old_z, mask=dm)
            tl.store(FAR_S + bh * D * DV + so, old_s + acc, mask=sm)
            tl.store(FAR_Z + bh * D + d, old_z + accz, mask=dm)
            if hk == 0:
                tl.store(POS + b, length)
                tl.store(BVALID + b, length >= C)
        if j < KEEP:
            tl.store(BREC_S + (bh * KEEP + j) * D * DV + so, acc, mask=sm)
            tl.store(BREC_Z + (bh * KEEP + j) * D + d, accz, mask=dm)
        if (j >= 1) & (j <= KEEP):
            tl.store(REC_S + (bh * KEEP + j - 1) * D * DV + so, acc, mask=sm)
            tl.store(REC_Z + (bh * KEEP + j - 1) * D + d, accz, mask=dm)
        if j == KEEP + 1:
            tl.store(CUR_S + bh * D * DV + so, acc, mask=sm)
            tl.store(CUR_Z + bh * D + d, accz, mask=dm)
    else:
        oldest = length - R
        for r0 in range(0, R, BR):
            r = r0 + tl.arange(0, BR)
            slot = ((r - oldest) % R + R) % R  # (Python's modulo: Triton's keeps the dividend's sign)
            n = tl.minimum(tl.maximum(oldest + slot, 0), N - 1).to(tl.int64)
            live = r < R
            at = (b * R + r) * HKV + hk
            tl.store(RING_K + at[:, None] * D + d[None, :],
                     tl.load(kp + n[:, None] * skn + d[None, :], mask=live[:, None] & dm[None, :]),
                     mask=live[:, None] & dm[None, :])
            tl.store(RING_V + at[:, None] * DV + e[None, :],
                     tl.load(vp + n[:, None] * svn + e[None, :], mask=live[:, None] & em[None, :]),
                     mask=live[:, None] & em[None, :])
