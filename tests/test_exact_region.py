"""Converting with an exact region: the region init (the host's attention cut to the region), `attention: local`,
far weights fitted to calibration data, and save → reload with these options."""

import pytest
import torch

from mhla_convert import convert, from_pretrained, mhla_layers, save_pretrained
from mhla_convert.calibrate import CANDIDATES
from mhla_convert.families import adapter_for_model
from mhla_convert.mixing import region_mixing
from mhla_convert.ops.exact_blocks import exact_mask

GRIDS = {"tiny-dit": (8, 8), "tiny-pixart": (7, 9), "tiny-wan": (5, 6, 7), "tiny-llama": (40,)}


def _batches(model, name, count=2, batch_size=2):
    torch.manual_seed(0)
    return [adapter_for_model(model).example_inputs(model, GRIDS[name], batch_size) for _ in range(count)]


def _gap(model, original_out, batches, run_model):
    return sum(float((run_model(model, b) - o).pow(2).mean()) for b, o in zip(batches, original_out))


def test_region_mixing_weights_the_region_1_and_the_rest_far_times_locality():
    shape = torch.tensor([[0.5, 0.3, 0.2], [0.25, 0.5, 0.25], [0.1, 0.3, 0.6]])
    region = torch.tensor([[True, True, False], [True, True, True], [False, True, True]])
    m = region_mixing(shape, region, 0.5)
    torch.testing.assert_close(m[0], torch.tensor([1.0, 1.0, 0.5 * 0.2 / 0.5]))
    torch.testing.assert_close(region_mixing(shape, region, 4.0)[0], torch.tensor([1 / 1.6, 1 / 1.6, 1.0]))
    assert (region_mixing(shape, region, 64.0) <= 1).all()  # far > 1: the row is scaled back into [0, 1]
    relative = region_mixing(torch.tensor([4.0, 3.0, 2.0, 1.0]), torch.tensor([True, True, False, False]), 0.5)
    torch.testing.assert_close(relative, torch.tensor([1.0, 1.0, 0.25, 0.125]))


@pytest.mark.parametrize("name", ["tiny-dit", "tiny-llama"])
def test_far_init_0_is_the_local_control(tiny, run_model, name):
    """At far_init 0 an MHLA conversion is the `attention: local` control: the host's softmax cut to the region."""
    mhla, local = tiny(name), tiny(name)
    convert(mhla)
    convert(local, attention="local")
    batches = _batches(mhla, name)
    for batch in batches:
        torch.testing.assert_close(run_model(mhla, batch), run_model(local, batch), rtol=1e-5, atol=1e-5)
    _, layer = mhla_layers(local)[0]
    assert not layer.mixing.requires_grad and layer.has_region
    if name == "tiny-dit":
        assert torch.equal(layer.mixing, exact_mask(layer.config.blocks, (1, 1)).float())


def test_local_attention_refuses_a_conversion_without_region(tiny):
    with pytest.raises(ValueError, match="attention='local' keeps only the exact region"):
        convert(tiny("tiny-dit"), attention="local", exact_radius=None)
    with pytest.raises(ValueError, match="drop far_init=0.5"):
        convert(tiny("tiny-dit"), attention="local", far_init=0.5)


@pytest.mark.parametrize("name, options", [("tiny-dit", {}), ("tiny-wan", {"blocks": "2x2x2"}),
                                           ("tiny-llama", {"chunk_size": 8, "window": 4})])
def test_calibrated_far_weights_never_start_further_than_truncation(tiny, run_model, name, options):
    """Each layer's far weight is a candidate whose outputs are closest to its original's on the calibration
    batches; 0 (the cut) is one of them, so the model starts no further from its original than the cut."""
    original = tiny(name)
    batches = _batches(original, name)
    target = [run_model(original, b) for b in batches]
    cut, fitted = tiny(name), tiny(name)
    convert(cut, **options)
    report = convert(fitted, calibration=batches, progress=False, **options)
    assert all(layer.far_weight in CANDIDATES for layer in report.layers)
    assert "far weight" in str(report) and "far weight" not in str(convert(tiny(name), **options))
    assert any(layer.far_weight > 0 for layer in report.layers)  # (random weights: the summaries help)
    assert _gap(fitted, target, batches, run_model) <= _gap(cut, target, batches, run_model)


@pytest.mark.parametrize("name, options", [
    ("tiny-dit", {"exact_radius": (1, 0)}), ("tiny-pixart", {"exact_radius": 0, "far_init": 0.25}),
    ("tiny-wan", {"blocks": "2x2x2", "exact_radius": (0, 1, 1)}), ("tiny-llama", {"attention": "local"}),
])
def test_save_reload_is_bitwise_with_exact_regions(tiny, run_model, tmp_path, name, options):
    model = tiny(name)
    convert(model, calibration=_batches(model, name, 1) if "far_init" not in options and "attention" not in options
            else None, progress=False, **options)
    reloaded = from_pretrained(save_pretrained(model, tmp_path / "ckpt"))
    assert reloaded.mhla_plan["mhla_config"] == model.mhla_plan["mhla_config"]
    for batch in _batches(model, name, 1, batch_size=2):
        assert torch.equal(run_model(reloaded, batch), run_model(model, batch))


def test_cli_exact_radius_and_calibration(tmp_path):
    from typer.testing import CliRunner

    from mhla_convert.cli import app

    out = tmp_path / "dit"
    result = CliRunner().invoke(app, ["tiny-dit", "--exact-radius", "1x0", "--calibration", "synthetic",
                                      "--calibration-batches", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert from_pretrained(out).mhla_plan["mhla_config"]["exact_radius"] == [1, 0]
