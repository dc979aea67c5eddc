"""convert() on tiny models of every diffusers family, built from configs with random weights."""

from __future__ import annotations

import copy

import pytest
import torch

from mhla_convert import convert, mhla_layers
from mhla_convert.demo import layer_reference_error
from mhla_convert.families import UnsupportedModelError, adapter_for_model
from mhla_convert.families.diffusers_base import DiffusersMHLA, fitted_blocks
from mhla_convert.ops import mhla_attention_reference

# (tiny model, a token grid whose axes the default blocks do not divide)
FAMILIES = [
    ("tiny-sana", (7, 9)),
    ("tiny-wan", (5, 6, 7)),
    ("tiny-wan-i2v", (3, 4, 5)),
    ("tiny-dit", (6, 6)),
    ("tiny-pixart", (7, 9)),
]
NAMES = [name for name, _ in FAMILIES]


def _inputs(model, grid, batch_size=2, seed=0):
    torch.manual_seed(seed)
    return adapter_for_model(model).example_inputs(model, grid, batch_size)


@pytest.mark.parametrize("name, grid", FAMILIES)
@pytest.mark.parametrize("ratio, expected", [(0.5, [1, 3, 5]), (0.67, [1, 2, 4, 5]), (1.0, [0, 1, 2, 3, 4, 5])])
def test_ratio_converts_expected_layers_and_keeps_shapes(tiny, run_model, name, grid, ratio, expected):
    model = tiny(name)
    inputs = _inputs(model, grid)
    before = run_model(model, inputs)
    report = convert(model, ratio=ratio)
    assert report.converted == expected
    assert [int(n.split(".")[1]) for n, _ in mhla_layers(model)] == expected
    after = run_model(model, inputs)
    assert after.shape == before.shape and torch.isfinite(after).all()
    assert model.mhla_plan["layers"] == expected


@pytest.mark.parametrize("name, grid", FAMILIES)
def test_ratio_zero_is_bit_identical(tiny, run_model, name, grid):
    model = tiny(name)
    inputs = _inputs(model, grid)
    before = run_model(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = convert(model, ratio=0)
    assert report.converted == [] and not mhla_layers(model)
    assert torch.equal(run_model(model, inputs), before)
    assert model.state_dict().keys() == state.keys() and all(
        torch.equal(state[k], v) for k, v in model.state_dict().items()
    )


def test_explicit_layers_and_strategies(tiny):
    assert convert(tiny("tiny-dit"), layers=[4, 1, 4]).converted == [1, 4]
    assert convert(tiny("tiny-dit"), ratio=0.5, strategy="first").converted == [0, 1, 2]
    assert convert(tiny("tiny-dit"), ratio=0.5, strategy="last").converted == [3, 4, 5]


def test_pretrained_weights_move_in_and_only_mixing_is_new(tiny):
    model = tiny("tiny-wan")
    host = model.blocks[2].attn1
    modules = (host.to_q, host.to_k, host.to_v, host.to_out[0], host.norm_q, host.norm_k)
    keys = set(model.state_dict())
    convert(model, layers=[2])
    layer = model.blocks[2].attn1
    assert isinstance(layer, DiffusersMHLA)
    assert (layer.to_q, layer.to_k, layer.to_v, layer.to_out[0], layer.norm_q, layer.norm_k) == modules
    assert set(model.state_dict()) - keys == {"blocks.2.attn1.mixing"}
    assert not any(p.is_meta for p in model.parameters())
    cross = model.blocks[2].attn2
    assert type(cross).__name__ == "WanAttention"  # cross-attention untouched


@pytest.mark.parametrize("name, grid, blocks", [
    ("tiny-sana", (7, 9), "3x4"), ("tiny-pixart", (7, 9), (2, 4)), ("tiny-dit", (6, 6), (4, 4)),
    ("tiny-wan", (5, 6, 7), "2x4x3"), ("tiny-wan-i2v", (3, 4, 5), (2, 2, 2)),
])
def test_layer_matches_quadratic_reference_on_captured_grid(tiny, name, grid, blocks):
    model = tiny(name)
    convert(model, blocks=blocks)
    assert layer_reference_error(model, _inputs(model, grid), grid) < 1e-5


def test_grid_smaller_than_blocks_is_clamped_to_the_present_blocks(tiny, run_model):
    model = tiny("tiny-wan")
    convert(model, ratio=1.0)  # default 7x3x5 blocks; 5 latent frames < 7
    grid = (5, 6, 7)
    inputs = _inputs(model, grid)
    out = run_model(model, inputs)
    assert torch.isfinite(out).all()
    blocks, kept = fitted_blocks(grid, (7, 3, 5))
    assert blocks == (5, 3, 5) and kept.numel() == 75 and kept.max() < 105
    # the same attention as the full layout with the empty blocks dropped:
    _, layer = mhla_layers(model)[0]
    q = k = v = torch.randn(1, 210, 2, 12)
    full = mhla_attention_reference(q, k, v, layer.mixing[kept][:, kept], grid=grid, blocks=blocks,
                                    exact_radius=layer.config.exact_radius)
    torch.testing.assert_close(layer.attend(q, k, v, grid), full)


def test_sana_uniform_mixing_reproduces_its_linear_attention(tiny, run_model):
    model = tiny("tiny-sana")
    inputs = _inputs(model, (7, 9))
    before = run_model(model, inputs)
    convert(model, mixing_init="uniform")
    assert model.mhla_plan["mhla_config"]["eps"] == 1e-15 and model.mhla_plan["mhla_config"]["scale"] == 1.0
    assert (run_model(model, inputs) - before).abs().max() < 1e-5
    default = tiny("tiny-sana")
    assert convert(default).config["mixing_init"] == "locality"


def test_teacher_copy_runs_on_the_args_the_student_sees(tiny):
    """The fine-tuning recipe deep-copies the original attention and calls it from a forward hook."""
    model = tiny("tiny-wan")
    teacher = copy.deepcopy(model.blocks[1].attn1)
    convert(model, layers=[1])
    student = model.blocks[1].attn1
    pairs = []
    student.register_forward_hook(
        lambda m, args, kwargs, out: pairs.append((teacher(*args, **kwargs), out)), with_kwargs=True
    )
    with torch.no_grad():
        model(**_inputs(model, (2, 4, 4)))
    ((expected, got),) = pairs
    assert expected.shape == got.shape


def test_bf16_model_converts_and_runs(tiny, run_model):
    model = tiny("tiny-wan", torch_dtype=torch.bfloat16)
    convert(model, ratio=0.5)
    assert model.blocks[1].attn1.mixing.dtype == torch.float32  # kept in float32 (placement.py)
    out = run_model(model, _inputs(model, (3, 4, 5)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_report_prints_a_table(tiny):
    text = str(convert(tiny("tiny-wan"), ratio=0.67, blocks="7x3x5"))
    assert "4 of 6" in text and "softmax (kept)" in text and "7x3x5" in text and "105" in text


# --- bad input -------------------------------------------------------------------------------

def test_unsupported_architecture_names_families_and_how_to_add_one():
    with pytest.raises(UnsupportedModelError, match=r"supported families: .*wan.*FamilyAdapter"):
        convert(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_ratio_out_of_range(tiny, ratio):
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\]"):
        convert(tiny("tiny-dit"), ratio=ratio)


def test_layer_index_out_of_range(tiny):
    with pytest.raises(ValueError, match=r"out of range: the model has 6 layers"):
        convert(tiny("tiny-dit"), layers=[1, 6])


@pytest.mark.parametrize("name, blocks", [("tiny-wan", "4x4"), ("tiny-dit", (2, 2, 2)), ("tiny-sana", "4")])
def test_blocks_of_the_wrong_rank(tiny, name, blocks):
    with pytest.raises(ValueError, match="blocks must have"):
        convert(tiny(name), blocks=blocks)


def test_converting_twice_is_refused(tiny):
    model = tiny("tiny-dit")
    convert(model, ratio=0.5)
    with pytest.raises(ValueError, match="already converted"):
        convert(model)


def test_layer_called_outside_the_model_forward_says_why(tiny):
    model = tiny("tiny-dit")
    convert(model, layers=[0])
    with pytest.raises(ValueError, match="call the model, not the layer"):
        model.transformer_blocks[0].attn1(torch.randn(1, 10, 16))


@pytest.mark.parametrize("name", NAMES)
def test_an_attention_the_layer_would_not_reproduce_is_refused_before_anything_changes(tiny, name):
    """A host feature MHLA drops (here a residual connection on the last self-attention) is refused by name, and
    the layers before it, which would convert, are left as they were."""
    model = tiny(name)
    adapter = adapter_for_model(model)
    last = adapter.attention_modules(model)[-1]
    last.residual_connection = True
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match=r"\.attn1 uses a residual connection, which an MHLA layer"):
        convert(model, ratio=1.0)
    assert not mhla_layers(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(v, before[k]) for k, v in after.items())
