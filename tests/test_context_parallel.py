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


def _wan(rank, world):
    # diffusers sets its device up as rank % torch.accelerator.device_count(), which is 0 on a machine without an
    # accelerator: one CPU "device" lets `enable_parallelism` run as on GPUs (its mesh is a CPU mesh over gloo)
    torch.accelerator.device_count = lambda: 1
    from diffusers import ContextParallelConfig

    from mhla_convert import convert
    from mhla_convert.layer import mhla_layers
    from mhla_convert.models import tiny_model

    g = torch.Generator().manual_seed(0)
    # 3 x 4 x 6 tokens: each rank holds a frame and a half, so the split cuts Wan's own-block exact region
    inputs = dict(hidden_states=torch.randn(2, 4, 3, 8, 12, generator=g), timestep=torch.tensor([10, 500]),
                  encoder_hidden_states=torch.randn(2, 8, 16, generator=g), return_dict=False)
    # all layers MHLA with either form; a hybrid whose softmax layers take diffusers' ulysses attention (its ring
    # attention needs a backend that returns the log-sum-exp, which the CPU's native backend does not)
    cases = (({"ring_degree": 2}, None), ({"ulysses_degree": 2}, None), ({"ulysses_degree": 2}, [0, 2, 4]))
    for degrees, layers in cases:
        model = tiny_model("tiny-wan")
        convert(model, layers=layers, progress=False)
        with torch.no_grad():
            for _, layer in mhla_layers(model):  # weights outside the exact region, so the summaries count
                layer.mixing.uniform_(0.2, 1.0, generator=torch.Generator().manual_seed(1))
            want = model(**inputs)[0]
            model.enable_parallelism(config=ContextParallelConfig(**degrees))
            got = model(**inputs)[0]  # (diffusers' hooks take tuples: its pipelines call the transformer so)
        assert mhla_layers(model)[0][1].context_parallel is model._parallel_config.context_parallel_config
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{degrees} layers {layers}")


def test_enable_parallelism_on_a_converted_wan(tmp_path):
    """`model.enable_parallelism(config=ContextParallelConfig(...))` on a converted tiny Wan: MHLA layers take the
    summaries exchange (ring) or the ulysses form, a hybrid's softmax layers diffusers' own; the output is the
    one-process model's."""
    run_two(_wan, tmp_path)
