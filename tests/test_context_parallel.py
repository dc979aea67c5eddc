"""Context-parallel MHLA (`ops.context_parallel`) in two gloo processes against the one-process operator, forward
and backward: the summaries exchange (with the halo an exact region needs) and the ulysses form."""

import pytest
import torch
import torch.distributed as dist
from two_processes import run_two

from mhla_convert.ops import mhla_attention
from mhla_convert.ops.context_parallel import mhla_attention_context_parallel, shard_sizes

# (grid, blocks, heads, kv heads, batch, options): token runs that cut blocks (36 of 3 x 4 x 6 tokens is a frame and
# a half), GQA, batch 2, exact regions of radius 0 and 1, per-head mixing, elu (φ(0) = 1), an odd token count
CASES = [
    ((3, 4, 6), (3, 2, 2), 4, 2, 2, {}),
    ((3, 4, 6), (3, 2, 2), 4, 2, 2, {"exact_radius": 0}),
    ((3, 4, 6), (3, 2, 3), 2, 2, 1, {"exact_radius": 1, "feature_map": "elu"}),
    ((6, 2, 2), (6, 1, 2), 4, 4, 1, {"exact_radius": (1, 0, 0), "per_head": True}),
    ((5, 3), (5, 3), 2, 2, 2, {"exact_radius": 1}),
    ((15,), (5,), 2, 1, 1, {"normalize": False}),
]


def _inputs(grid, blocks, heads, kv_heads, batch, per_head=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, m = torch.Size(grid).numel(), torch.Size(blocks).numel()
    q = torch.randn(batch, n, heads, 8, generator=g, dtype=torch.float64)
    k = torch.randn(batch, n, kv_heads, 8, generator=g, dtype=torch.float64)
    v = torch.randn(batch, n, kv_heads, 6, generator=g, dtype=torch.float64)
    mixing = torch.rand(*((heads,) if per_head else ()), m, m, generator=g, dtype=torch.float64)
    return q, k, v, mixing, torch.randn(batch, n, heads, 6, generator=g, dtype=torch.float64)


def _compare(rank, world, form):
    for grid, blocks, heads, kv_heads, batch, options in CASES:
        if form == "ulysses" and kv_heads % world:
            continue  # (heads are what it splits: refused below)
        options = dict(options)
        q, k, v, mixing, weight = _inputs(grid, blocks, heads, kv_heads, batch, options.pop("per_head", False))
        leaves = [t.requires_grad_() for t in (q, k, v, mixing)]
        want = mhla_attention(q, k, v, mixing, grid=grid, blocks=blocks, backend="torch", **options)
        want_grads = torch.autograd.grad((want * weight).sum(), leaves)
        start = sum(shard_sizes(q.shape[1], world)[:rank])
        rows = slice(start, start + shard_sizes(q.shape[1], world)[rank])
        local = [t[:, rows].detach().requires_grad_() for t in (q, k, v)]
        mix = mixing.detach().requires_grad_()
        got = mhla_attention_context_parallel(*local, mix, grid=grid, blocks=blocks, form=form, backend="torch",
                                              **options)
        (got * weight[:, rows]).sum().backward()
        case = f"{form} {grid} {blocks} {options}"
        torch.testing.assert_close(got, want[:, rows], rtol=1e-10, atol=1e-10, msg=case)
        for t, g in zip(local, want_grads):
            torch.testing.assert_close(t.grad, g[:, rows], rtol=1e-9, atol=1e-9, msg=case)
        dist.all_reduce(mix.grad)  # each rank holds its queries' share of the mixing gradient
        torch.testing.assert_close(mix.grad, want_grads[3], rtol=1e-9, atol=1e-9, msg=case)


@pytest.mark.parametrize("form", ["summaries", "ulysses"])
def test_context_parallel_equals_one_process(tmp_path, form):
    run_two(_compare, tmp_path, form)


def _refusals(rank, world):
    q, k, v, mixing, _ = _inputs((4, 4), (2, 2), 3, 3, 1)
    with pytest.raises(ValueError, match="3 heads do not divide"):
        mhla_attention_context_parallel(q[:, :8], k[:, :8], v[:, :8], mixing, grid=(4, 4), blocks=(2, 2),
                                        form="ulysses")
    with pytest.raises(ValueError, match="holds 10 tokens but the grid"):
        mhla_attention_context_parallel(q[:, :10], k[:, :10], v[:, :10], mixing, grid=(4, 4), blocks=(2, 2))
    with pytest.raises(ValueError, match="form must be one of"):
        mhla_attention_context_parallel(q[:, :8], k[:, :8], v[:, :8], mixing, grid=(4, 4), blocks=(2, 2), form="ring")


def test_context_parallel_refuses_in_one_line(tmp_path):
    run_two(_refusals, tmp_path)
