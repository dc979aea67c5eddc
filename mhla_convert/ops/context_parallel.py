"""Non-causal MHLA with the token sequence split across processes (context parallelism), in two forms.

Every process holds one contiguous run of the row-major token grid, as `torch.tensor_split` of the N tokens over
the group's ranks cuts it (diffusers' context-parallel hooks cut hidden states so: `chunk` when N divides, which is
the same split), and its own q, k, v (B, n_rank, H, D). Each form returns that process's rows of the output of
`mhla_attention` over the whole sequence, forward and backward:

- **summaries** (`form="summaries"`): each process builds its tokens' share of every block summary
  (S_j = Σ φ(k)ᵀv, z_j = Σ φ(k), per key head), and one all-reduce sums them: B · H_kv · M · D · (D_v + 1) values
  travel per layer, whatever the token count. Each process then mixes them for its own query blocks and reads its
  queries out. Summaries are sums, so a block cut by the split needs nothing more; an exact region
  (`exact_radius`, `ops.exact_blocks`) also needs the keys and values of the blocks it reads exactly, so each
  process first receives those of the whole block rows (along the grid's first axis, Wan's frames) that its queries'
  neighbourhoods touch (one all-to-all: the halo). Runs the torch path (block summaries by GEMM, `ops.exact_blocks`'
  neighbourhood read).
- **ulysses** (`form="ulysses"`): one all-to-all turns sequence shards into head shards (query and key heads must
  divide by the group size), `mhla_attention` runs over the whole sequence on the local heads with any backend
  (the Triton kernels on GPUs), and a second all-to-all turns the output back.

Gradients flow through the collectives (autograd Functions over `torch.distributed`'s all_reduce and
all_to_all_single, so any backend that has them works: NCCL, gloo). q, k and v get each process's own rows'
gradients; the mixing's gradient on each process is that process's share, whose sum over the group is the whole
sequence's gradient (sum it across the group when training, as for any weight shared by context-parallel ranks).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .blocks import BlockLayout, as_axes
from .exact_blocks import block_summaries, exact_mask, exact_radius_axes, far_reads, grouped_mixing, near_read
from .feature_maps import resolve_feature_map
from .mhla import check_inputs, check_options, mhla_attention

Form = Literal["summaries", "ulysses"]
FORMS = ("summaries", "ulysses")


class _AllReduceSum(torch.autograd.Function):
    """Σ over the group; the gradient of every process's input is the sum of all output gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` along dim 0 with split sizes; its gradient is the all-to-all back."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def shard_sizes(num_tokens: int, world: int) -> list[int]:
    """Tokens per rank as `torch.tensor_split(N, world)` gives them (the first N % world ranks get one more)."""
    return [num_tokens // world + (r < num_tokens % world) for r in range(world)]


def mhla_attention_context_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mixing: torch.Tensor, *, grid, blocks, group=None,
    form: Form = "summaries", feature_map="relu", normalize: bool = True, scale: float | None = None,
    eps: float = 1e-6, exact_radius=None, backend: str = "auto",
) -> torch.Tensor:
    """`mhla_attention(...)` (non-causal) of the whole sequence, for this process's rows (module doc).

    q, k, v: (B, n, H, D), (B, n, H_kv, D), (B, n, H_kv, D_v), this rank's run of the row-major `grid` (which is the
    whole grid: prod(grid) = N); n is `shard_sizes(N, world)[rank]`. `group`: the process group (None: the default
    group). `backend` is the one `mhla_attention` runs with in the ulysses form; the summaries form is the torch path.
    Returns (B, n, H, D_v) in q's dtype."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {list(FORMS)}; got {form!r}")
    check_options(feature_map=feature_map, normalize=normalize, scale=scale, eps=eps, backend=backend)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    sizes = shard_sizes(math.prod(as_axes("grid", grid)), world)
    if q.shape[1] != sizes[rank]:
        raise ValueError(f"rank {rank} of {world} holds {q.shape[1]} tokens but the grid {grid} split over {world} "
                         f"ranks gives it {sizes[rank]}; pass the whole grid and torch.tensor_split's share of it")
    # the whole-sequence checks, on shape-only stand-ins of the whole sequence
    layout = check_inputs(*(torch.empty(t.shape[0], sum(sizes), *t.shape[2:], device="meta", dtype=t.dtype)
                            for t in (q, k, v)), mixing.to("meta"), grid=grid, blocks=blocks, causal=False)
    radius = None if exact_radius is None else exact_radius_axes(exact_radius, len(layout.grid))
    if radius is not None and not normalize:
        raise ValueError(f"exact_radius={exact_radius} needs normalize=True")
    options = dict(feature_map=feature_map, normalize=normalize, scale=scale, eps=eps, exact_radius=exact_radius)
    if form == "ulysses":
        return _ulysses(q, k, v, mixing, layout, sizes, rank, group, backend=backend, **options)
    phi = resolve_feature_map(feature_map)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _summaries(q, k, v, mixing, layout, sizes, rank, group, radius=radius, phi=phi, normalize=normalize,
                      scale=scale, eps=eps)


# --- ulysses: sequence shards ↔ head shards ------------------------------------------------------------------------
def _to_heads(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """(B, n_rank, H, D) → (B, N, H / world, D): every rank's tokens of this rank's heads."""
    world = len(sizes)
    batch, n, heads, dim = x.shape
    if heads % world:
        raise ValueError(f"the ulysses form splits heads over the {world} ranks, but {heads} heads do not divide; "
                         "use form='summaries'")
    send = x.unflatten(2, (world, heads // world)).permute(2, 1, 0, 3, 4)  # (world, n, B, h, D)
    got = _AllToAll.apply(send.flatten(0, 1), sizes, [n] * world, group)  # (N, B, h, D), ranks' tokens in order
    return got.transpose(0, 1)


def _from_heads(x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    """Inverse of `_to_heads`: (B, N, h, D) → (B, n_rank, h · world, D)."""
    world, n = len(sizes), sizes[rank]
    got = _AllToAll.apply(x.transpose(0, 1), [n] * world, sizes, group)  # (world · n, B, h, D), by source rank
    return got.unflatten(0, (world, n)).permute(2, 1, 0, 3, 4).flatten(2, 3)


def _ulysses(q, k, v, mixing, layout, sizes, rank, group, *, backend, **options):
    heads, world = q.shape[2], len(sizes)
    q, k, v = (_to_heads(t, sizes, group) for t in (q, k, v))
    if mixing.dim() == 3:  # per-head mixing: this rank's heads
        mixing = mixing.unflatten(0, (world, heads // world))[rank]
    out = mhla_attention(q, k, v, mixing, grid=layout.grid, blocks=layout.blocks, backend=backend, **options)
    return _from_heads(out, sizes, rank, group)


# --- summaries: one all-reduce of the block summaries, a halo of key/value rows for an exact region ----------------
def _rows(layout: BlockLayout, start: int, stop: int, reach: int) -> tuple[int, int]:
    """The block rows (along grid axis 0) that tokens [start, stop) lie in, widened by `reach` rows each way and cut
    to the rows that hold tokens."""
    per_row = layout.block_size[0] * math.prod(layout.grid[1:])
    last = (layout.num_tokens - 1) // per_row
    return max(0, start // per_row - reach), min(last, (stop - 1) // per_row + reach)


def _span(layout: BlockLayout, rows: tuple[int, int]) -> tuple[int, int]:
    """The tokens [a, b) of block rows rows[0] … rows[1]."""
    per_row = layout.block_size[0] * math.prod(layout.grid[1:])
    return rows[0] * per_row, min(layout.num_tokens, (rows[1] + 1) * per_row)


def _halo(kv: torch.Tensor, sizes: list[int], rank: int, spans: list[tuple[int, int]], group) -> torch.Tensor:
    """Each rank's tokens of every rank's span: (B, n_rank, X) → (B, span_rank, X), by one all-to-all."""
    starts = [sum(sizes[:r]) for r in range(len(sizes))]

    def overlap(src: int, dst: int) -> int:  # tokens of rank src inside rank dst's span
        a, b = spans[dst]
        return max(0, min(starts[src] + sizes[src], b) - max(starts[src], a))

    world = len(sizes)
    send_splits, recv_splits = [overlap(rank, j) for j in range(world)], [overlap(j, rank) for j in range(world)]
    local = kv.transpose(0, 1)  # (n, B, X)
    pieces = []
    for j in range(world):  # what rank j's span holds of ours, in token order
        a = max(starts[rank], spans[j][0]) - starts[rank]
        pieces.append(local[a: a + send_splits[j]])
    return _AllToAll.apply(torch.cat(pieces), recv_splits, send_splits, group).transpose(0, 1)


def _summaries(q, k, v, mixing, layout: BlockLayout, sizes, rank, group, *, radius, phi, normalize, scale, eps):
    batch, n, heads, _ = q.shape
    kv_heads, groups, dk, dv = k.shape[2], heads // k.shape[2], k.shape[-1], v.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    start = sum(sizes[:rank])
    reach = 0 if radius is None else radius[0]
    spans = [_span(layout, _rows(layout, sum(sizes[:r]), sum(sizes[:r + 1]), reach)) for r in range(len(sizes))]
    rows = _rows(layout, start, start + n, reach)
    a, b = spans[rank]
    # this rank's block rows as a layout of their own: same block size, block ids offset by `first`
    per_block_row = math.prod(layout.blocks[1:])
    local = BlockLayout(((b - a) // math.prod(layout.grid[1:]), *layout.grid[1:]),
                        (rows[1] - rows[0] + 1, *layout.blocks[1:]), layout.block_size)
    first, m_local, m, t = rows[0] * per_block_row, local.num_blocks, layout.num_blocks, layout.tokens_per_block

    def placed(x):  # (B, n, ·, ·) → (B, b − a, ·, ·): this rank's tokens in its span, zeros elsewhere
        return F.pad(x, (0, 0, 0, 0, start - a, b - start - n))

    kf = local.to_blocks(placed(phi(k.to(acc))))  # φ before the zeros, which must add nothing
    s, z = block_summaries(kf, local.to_blocks(placed(v.to(acc))))  # this rank's share, (B, H_kv, M_local, …)
    shares = F.pad(torch.cat([s.flatten(3), z], -1), (0, 0, first, m - first - m_local))  # (B, H_kv, M, D·Dv + D)
    total = _AllReduceSum.apply(shares, group)
    s, z = total.split([dk * dv, dk], -1)
    s = s.unflatten(-1, (dk, dv))

    mix = grouped_mixing(mixing.to(acc), kv_heads, groups)
    rows_mix = mix[..., first: first + m_local, :]  # (…, M_local, M)
    if radius is not None:
        rows_mix = rows_mix.masked_fill(exact_mask(layout.blocks, radius, q.device)[first: first + m_local], 0.0)
    qf = local.to_blocks(placed(phi(q.to(acc)) * scale)).view(batch, kv_heads, groups, m_local, t, -1)
    num, den = far_reads(qf, s, z, rows_mix)
    if radius is None:
        out = num / (den + eps) if normalize else num
    else:  # the neighbourhoods: the whole block rows of this rank's span, gathered from the ranks that hold them
        kv = _halo(torch.cat([k.flatten(2), v.flatten(2).to(k.dtype)], -1), sizes, rank, spans, group).to(acc)
        k_span, v_span = kv.split([kv_heads * dk, kv_heads * dv], -1)
        near_mix = mix[..., first: first + m_local, first: first + m_local]
        out = near_read(num, den, placed(q.to(acc)), k_span.unflatten(-1, (kv_heads, dk)),
                        local.to_blocks(v_span.unflatten(-1, (kv_heads, dv))), near_mix, local, radius, real=None,
                        eps=eps)
    out = local.from_blocks(out.reshape(batch, heads, m_local, t, dv))
    return out[:, start - a: start - a + n].to(q.dtype)
