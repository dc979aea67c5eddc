"""Non-causal MHLA whose nearest blocks are read exactly: the softmax kernel within a block neighbourhood.

With `exact_radius = r` (one whole number per grid axis), a query in block i weighs a key in block j by

    w_ts = m_ij · exp(q_t·k_s / √D)            if |c_a(i) − c_a(j)| ≤ r_a on every axis a   (j ∈ E(i))
    w_ts = m_ij · scale · φ(q_t)·φ(k_s)        otherwise      (the mixed key–value summaries, as in plain MHLA)

where c_a(i) is block i's coordinate along axis a of the block grid, and normalises as MHLA does:
o_t = Σ_s w_ts v_s / (Σ_s w_ts + eps). r = 0 reads a query's own block exactly; r = 1 its own block and every
block next to it (3 × 3 in 2-D, 3 × 3 × 3 in 3-D). Each row stays one normalised distribution over all keys, so
the mixing weights learn how much the summaries count against the neighbourhood, and with m_ij = 1 on E(i) and 0
elsewhere the layer is exactly the host's softmax attention cut to the neighbourhood.

The torch path builds the summaries of every block, mixes them with the mixing cut to the blocks outside E(i),
and reads each query block's neighbourhood — at most K = Π(2·r_a + 1) blocks — with the softmax kernel through
`exact_local.read_window`, which shifts the exponentials by each row's largest score (at least 0) and scales the
linear terms alike. Cost: O(N·d² + M²·d² + N·K·T·d) for T tokens per block.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from .blocks import BlockLayout, whole_number
from .exact_local import read_window
from .feature_maps import key_features


def exact_radius_axes(radius, axes: int) -> tuple[int, ...]:
    """`radius` (a whole number or one per axis, each ≥ 0) as a tuple of `axes` ints, or a ValueError."""
    values = (radius,) * axes if whole_number(radius) is not None else radius
    if not (isinstance(values, (tuple, list)) and len(values) == axes
            and all(whole_number(v) is not None and v >= 0 for v in values)):
        raise ValueError(f"exact_radius must be a whole number ≥ 0 or one per grid axis ({axes}); got {radius!r}")
    return tuple(int(v) for v in values)


@functools.lru_cache(maxsize=256)
def _tables(blocks: tuple[int, ...], radius: tuple[int, ...], device) -> tuple[torch.Tensor, ...]:
    with torch.device("cpu"):  # (also inside a layer built on the meta device)
        ids, valid, mask = _build_tables(blocks, radius)
    return ids.to(device), valid.to(device), mask.to(device)


def _build_tables(blocks: tuple[int, ...], radius: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    coords = torch.stack(torch.meshgrid(*(torch.arange(b) for b in blocks), indexing="ij"), -1).reshape(-1, len(blocks))
    offsets = torch.tensor(list(itertools.product(*(range(-r, r + 1) for r in radius))), dtype=torch.long)
    near = coords[:, None, :] + offsets[None]  # (M, K, axes)
    bounds = torch.tensor(blocks)
    valid = ((near >= 0) & (near < bounds)).all(-1)
    strides = torch.tensor([math.prod(blocks[a + 1:]) for a in range(len(blocks))])
    ids = (near.clamp(min=0).minimum(bounds - 1) * strides).sum(-1)
    rows = torch.arange(len(coords))[:, None].expand_as(ids)
    mask = torch.zeros(len(coords), len(coords), dtype=torch.bool)
    mask[rows[valid], ids[valid]] = True
    return ids, valid, mask


def neighbour_table(layout: BlockLayout, radius: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, valid), each (M, K): the flat ids of the K = Π(2·r_a + 1) blocks around each block (row-major offsets),
    and whether each lies on the block grid (ids off it are clamped and must not be read)."""
    return _tables(layout.blocks, radius, torch.device(device or "cpu"))[:2]


def exact_mask(blocks: tuple[int, ...], radius: tuple[int, ...], device=None) -> torch.Tensor:
    """(M, M) bool, for `blocks` per grid axis: E[i, j] when key block j lies in query block i's neighbourhood.
    (A cached tensor: copy it before changing it.)"""
    return _tables(tuple(blocks), tuple(radius), torch.device(device or "cpu"))[2]


def mhla_attention_exact_blocks_torch(q, k, v, mixing, layout: BlockLayout, *, exact_radius: tuple[int, ...], phi,
                                      scale, eps, key_mask=None):
    """Non-causal MHLA with each query block's neighbourhood read by the softmax kernel (module doc);
    `key_mask` (B, N) bool marks real keys (False: padding, weight 0)."""
    batch, _, heads, _ = q.shape
    kv_heads, groups, dv = k.shape[2], heads // k.shape[2], v.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    m, t = layout.num_blocks, layout.tokens_per_block
    mix = grouped_mixing(mixing.to(acc), kv_heads, groups)

    # blocks outside the neighbourhood: mixed key–value summaries, as in plain MHLA
    qf = layout.to_blocks(phi(q.to(acc)) * scale).view(batch, kv_heads, groups, m, t, -1)
    kf = layout.to_blocks(key_features(phi, k.to(acc), key_mask))  # (B, H_kv, M, T, D)
    vb = layout.to_blocks(v.to(acc))  # (B, H_kv, M, T, Dv)
    far = mix.masked_fill(exact_mask(layout.blocks, exact_radius, q.device), 0.0)
    num, den = far_reads(qf, *block_summaries(kf, vb), far)
    real = None if key_mask is None else key_mask[:, :, None, None].to(acc)
    out = near_read(num, den, q.to(acc), k.to(acc), vb, mix, layout, exact_radius, real=real, eps=eps)
    return layout.from_blocks(out.reshape(batch, heads, m, t, dv)).to(q.dtype)


def grouped_mixing(mix: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """(M, M') → (1, 1, M, M'); (H, M, M') → (H_kv, g, M, M'): broadcastable against grouped heads."""
    return mix.view(1, 1, *mix.shape) if mix.dim() == 2 else mix.view(kv_heads, groups, *mix.shape[-2:])


def block_summaries(kf: torch.Tensor, vb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """φ(k) and v by block, (B, H_kv, M, T, D) and (B, H_kv, M, T, Dv) → each block's S = Σ φ(k)ᵀv
    (B, H_kv, M, D, Dv) and z = Σ φ(k) (B, H_kv, M, D)."""
    return kf.transpose(-1, -2) @ vb, kf.sum(-2)


def far_reads(qf, s, z, mix) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear part of each query's read: qf (B, H_kv, g, M', T, D) = φ(q)·scale by block, against the summaries
    s, z (`block_summaries`, M blocks) mixed by `mix` (grouped, (…, M', M)) → numerator (B, H_kv, g, M', T, Dv) and
    denominator (B, H_kv, g, M', T, 1)."""
    s, z = s.unsqueeze(2), z.unsqueeze(2)
    num = qf @ torch.matmul(mix, s.flatten(-2)).unflatten(-1, s.shape[-2:])
    return num, qf @ torch.matmul(mix, z).unsqueeze(-1)


def near_read(num, den, q, k, vb, mix, layout: BlockLayout, exact_radius: tuple[int, ...], *, real, eps, extra=None):
    """`read_window` over each query block's neighbourhood in `layout`: q (B, N, H, D) and k (B, N, H_kv, D) unblocked,
    vb (B, H_kv, M, T, Dv) by block, `mix` grouped (…, M, M), `real` (B or 1, N, 1, 1) 1 for real keys (None: all
    are), num and den as `far_reads` gives them → (B, H_kv, g, M, T, Dv). `extra`: (keys (B, H_kv, 1, 1, L, D),
    values (…, L, Dv), weights (…, M, 1, L), allowed (…, M, 1, L)), L further keys every query block reads exactly in
    the same window (a joint model's text tokens, `ops.joint`)."""
    batch, _, heads, _ = q.shape
    kv_heads, groups = k.shape[2], heads // k.shape[2]
    m, t = layout.num_blocks, layout.tokens_per_block
    ids, valid = neighbour_table(layout, exact_radius, q.device)  # (M, K)

    def near(x):  # (B, ·, M, T, X) → (B, ·, 1, M, K·T, X)
        return x[:, :, ids].flatten(3, 4).unsqueeze(2)

    weights = (mix.gather(-1, ids.expand(*mix.shape[:2], m, -1)) * valid).repeat_interleave(t, -1).unsqueeze(-2)
    if real is None:  # slots off the grid are padding
        real = torch.ones(1, layout.num_tokens, 1, 1, dtype=q.dtype, device=q.device)
    allowed = (near(layout.to_blocks(real)).squeeze(-1).unsqueeze(-2) > 0) & (weights > 0)  # (·, ·, ·, M, 1, K·T)
    qr = layout.to_blocks(q).view(batch, kv_heads, groups, m, t, -1)
    keys, values = near(layout.to_blocks(k)), near(vb)
    if extra is not None:
        ek, ev, ew, ea = extra
        keys = torch.cat([keys, ek.expand(*keys.shape[:-2], *ek.shape[-2:])], -2)
        values = torch.cat([values, ev.expand(*values.shape[:-2], *ev.shape[-2:])], -2)
        weights = torch.cat([weights, ew.expand(*weights.shape[:-1], ew.shape[-1])], -1)
        lead = torch.broadcast_shapes(allowed.shape[:-1], ea.shape[:-1])
        allowed = torch.cat([allowed.expand(*lead, -1), ea.expand(*lead, -1)], -1)
    return read_window(num, den, qr, keys, values, weights, allowed, eps=eps)
