"""A converted tiny Wan wrapped in DDP and in FSDP2 (`fully_shard`), one training step in two gloo processes: the
gradients and the updated weights equal one process's step on the whole batch."""

import copy

import pytest
import torch
import torch.distributed as dist
from two_processes import run_two


def _model():
    from mhla_convert import convert
    from mhla_convert.layer import mhla_layers
    from mhla_convert.models import tiny_model

    model = tiny_model("tiny-wan").train()
    convert(model, progress=False)
    with torch.no_grad():
        for _, layer in mhla_layers(model):  # weights outside the exact region, so the summaries take gradients
            layer.mixing.uniform_(0.2, 1.0, generator=torch.Generator().manual_seed(1))
    return model


def _batch():
    g = torch.Generator().manual_seed(0)
    return (dict(hidden_states=torch.randn(4, 4, 3, 4, 4, generator=g), timestep=torch.tensor([10, 300, 600, 900]),
                 encoder_hidden_states=torch.randn(4, 8, 16, generator=g)), torch.randn(4, 4, 3, 4, 4, generator=g))


def _step(model, inputs, target):
    loss = torch.nn.functional.mse_loss(model(**inputs).sample, target)
    loss.backward()
    grads = {n: p.grad for n, p in getattr(model, "module", model).named_parameters() if p.grad is not None}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return grads


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _wrapped(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    base = _model()
    inputs, target = _batch()
    one = copy.deepcopy(base)
    want = _step(one, inputs, target)
    assert any(".mixing" in n for n in want) and len(want) == len(list(one.parameters()))
    rows = slice(rank * 2, rank * 2 + 2)  # each process: half of the batch
    local = {k: v[rows] for k, v in inputs.items()}
    ddp = DistributedDataParallel(copy.deepcopy(base))
    fsdp = copy.deepcopy(base)
    for block in fsdp.blocks:
        fully_shard(block)
    fully_shard(fsdp)
    for name, model in (("ddp", ddp), ("fsdp2", fsdp)):
        got = _step(model, local, target[rows])
        params = dict(getattr(model, "module", model).named_parameters())
        for n, g in want.items():
            torch.testing.assert_close(_full(got[n]), g, rtol=1e-5, atol=1e-6, msg=f"{name} gradient {n}")
            torch.testing.assert_close(_full(params[n].detach()), dict(one.named_parameters())[n].detach(),
                                       rtol=1e-5, atol=1e-6, msg=f"{name} weight {n}")
    dist.barrier()


def test_ddp_and_fsdp2_step_equals_one_process(tmp_path):
    run_two(_wrapped, tmp_path)


def test_accelerate_configs_load():
    from pathlib import Path

    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    root = Path(__file__).parent.parent / "recipes" / "accelerate"
    assert load_config_from_file(str(root / "ddp.yaml")).distributed_type == DistributedType.MULTI_GPU
    fsdp = load_config_from_file(str(root / "fsdp2.yaml"))
    assert fsdp.distributed_type == DistributedType.FSDP and fsdp.fsdp_config["fsdp_version"] == 2


def _recompute_with_tables_cast_once(model) -> None:
    """A checkpointed bf16 block of `model` whose forward gets its rotary tables cast to bf16 and whose
    recomputation gets them uncast (float32): FSDP2's mixed precision on torch 2.11. Raises CheckpointError where
    the two passes save tensors of other dtypes."""
    from torch.utils.checkpoint import checkpoint

    config = model.config
    latents = torch.randn(1, config.in_channels, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope(latents)
    assert cos.dtype == torch.float32
    with torch.no_grad():  # (converted layers read their token grid from the model's forward)
        model(latents, timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 4, config.text_dim))
    block = model.blocks[0].to(torch.bfloat16)
    width = config.num_attention_heads * config.attention_head_dim
    x, text, temb = (torch.randn(*shape, dtype=torch.bfloat16) for shape in ((1, 32, width), (1, 4, width),
                                                                             (1, 6, width)))
    calls = []

    def run(x):
        tables = (cos, sin) if calls else (cos.to(torch.bfloat16), sin.to(torch.bfloat16))
        calls.append(tables[0].dtype)
        return block(x, text, temb, tables)

    checkpoint(run, x.requires_grad_(), use_reentrant=False).float().square().mean().backward()
    assert calls == [torch.bfloat16, torch.float32] and torch.isfinite(x.grad).all()


def test_checkpointed_block_recomputes_with_the_rotary_tables_uncast():
    """The converted layer saves tensors of the same dtypes whatever the tables' dtype (it rotates in float32), so
    a converted block recomputes under that cast-once pattern as it is."""
    _recompute_with_tables_cast_once(_model())


@pytest.mark.parametrize("converted", [False, True], ids=["original", "mhla"])
def test_prepared_block_recomputes_whatever_the_tables_dtype(converted):
    """diffusers' own attention (the original, a hybrid's softmax layers) rotates in the tables' dtype and fails
    under that pattern; with the Wan adapter's checkpointing preparation each block gets its tables in its hidden
    states' dtype and recomputes, and an uncast float32 forward is unchanged by it."""
    from torch.utils.checkpoint import CheckpointError

    from mhla_convert.families import adapter_for_model
    from mhla_convert.models import tiny_model

    model = _model() if converted else tiny_model("tiny-wan").train()
    if not converted:
        with pytest.raises(CheckpointError):
            _recompute_with_tables_cast_once(copy.deepcopy(model))
    config = model.config
    latents = torch.randn(1, config.in_channels, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    text = torch.randn(1, 4, config.text_dim)
    with torch.no_grad():
        before = model(latents, timestep=torch.tensor([500]), encoder_hidden_states=text).sample
    adapter_for_model(model).prepare_checkpointing(model)
    adapter_for_model(model).prepare_checkpointing(model)  # (idempotent)
    with torch.no_grad():
        assert torch.equal(model(latents, timestep=torch.tensor([500]), encoder_hidden_states=text).sample, before)
    _recompute_with_tables_cast_once(model)
    assert all(len(block._forward_pre_hooks) == 1 for block in model.blocks)
