"""Where base models come from: a named subfolder, a diffusers pipeline directory, sharded weights and
single weights files all load the very model that was saved; float32 modules stay float32; what
cannot load is refused in one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mhla_convert.cli import app
from mhla_convert.families import adapter_for_model
from mhla_convert.models import load_model

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def _same_outputs(a, b, run_model):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        grid = (2, 4, 4) if type(a).__name__ == "WanTransformer3DModel" else None  # Wan's native grid is huge
        inputs = adapter_for_model(a).example_inputs(a, grid, batch_size=2)
    assert torch.equal(run_model(a, inputs), run_model(b, inputs))


def _pipeline_dir(model, root, subfolder="transformer"):
    model.save_pretrained(root / subfolder)
    (root / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    return root


def test_subfolder_and_pipeline_directory(tiny, run_model, tmp_path):
    original = tiny("tiny-wan")
    _pipeline_dir(original, tmp_path / "pipe")
    original.save_pretrained(tmp_path / "repo" / "weights" / "v2")
    _same_outputs(load_model(str(tmp_path / "pipe")), original, run_model)
    loaded = load_model(str(tmp_path / "repo"), subfolder="weights/v2")
    _same_outputs(loaded, original, run_model)
    assert loaded.mhla_source["subfolder"] == "weights/v2"
    with pytest.raises(ValueError, match="has no subfolder 'v3'; its folders: weights"):
        load_model(str(tmp_path / "repo"), subfolder="v3")
    with pytest.raises(ValueError, match="is a built-in tiny model: it has no subfolders"):
        load_model("tiny-wan", subfolder="transformer")


def test_convert_subfolder_on_the_command_line(tiny, tmp_path):
    tiny("tiny-dit").save_pretrained(tmp_path / "repo" / "dit")
    result = invoke(tmp_path / "repo", "--subfolder", "dit", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "subfolder dit" in result.output
    from mhla_convert.evaluate.models import resolve_model  # what `eval --subfolder` loads

    source = resolve_model(str(tmp_path / "repo"), role="model", device="cpu", subfolder="dit").mhla_source
    assert (source["base_model"], source["subfolder"], source["components"]) == (None, "dit", str(tmp_path / "repo"))
    result = invoke(tmp_path / "repo", "--subfolder", "nope", "--out", tmp_path / "out2")
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "has no subfolder 'nope'" in result.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_weights_load_equal(tiny, run_model, tmp_path, dtype):
    original = tiny("tiny-wan", torch_dtype=dtype)
    original.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("diffusion_pytorch_model-*.safetensors"))) > 1
    loaded = load_model(str(tmp_path / "sharded"))
    assert loaded.blocks[0].attn1.to_q.weight.dtype == dtype and loaded.scale_shift_table.dtype == torch.float32
    _same_outputs(loaded, original, run_model)


def test_single_file_loads_equal_with_fp32_modules_kept(tiny, run_model, tmp_path):
    original = tiny("tiny-wan")
    config_dir = _pipeline_dir(original, tmp_path / "pipe")
    save_file(original.state_dict(), str(tmp_path / "wan.safetensors"))
    loaded = load_model(str(tmp_path / "wan.safetensors"), config=str(config_dir))
    _same_outputs(loaded, original, run_model)
    assert loaded.mhla_source["components"] == str(config_dir)  # the VAE and text encoder come from there
    # a file in bf16 throughout: the modules Wan keeps in float32 come back in float32
    save_file({k: v.to(torch.bfloat16) for k, v in original.state_dict().items()}, str(tmp_path / "bf16.safetensors"))
    half = load_model(str(tmp_path / "bf16.safetensors"), config=str(config_dir))
    assert half.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert half.scale_shift_table.dtype == torch.float32 and half.blocks[0].scale_shift_table.dtype == torch.float32


def test_single_file_of_a_family_without_from_single_file_is_refused(tiny, tmp_path):
    model = tiny("tiny-dit")
    model.save_pretrained(tmp_path / "dit")
    save_file(model.state_dict(), str(tmp_path / "dit.safetensors"))
    result = invoke(tmp_path / "dit.safetensors", "--config", tmp_path / "dit", "--out", tmp_path / "out")
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "cannot load from a single weights file" in result.output
    result = invoke(tmp_path / "dit", "--config", tmp_path / "dit", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "--config is for single-file checkpoints" in result.output


def test_convert_keeps_fp32_modules_of_a_source_cast_whole(tiny, tmp_path):
    """A source saved after a plain .to(bf16) (its float32 modules cast too) converts with them in float32."""
    source = tiny("tiny-wan").to(torch.bfloat16)
    source.save_pretrained(tmp_path / "bf16")
    result = invoke(tmp_path / "bf16", "--ratio", 0.5, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    saved = load_file(tmp_path / "out" / "model.safetensors")
    keep = set(source._keep_in_fp32_modules)
    kept = {k: t.dtype for k, t in saved.items() if keep & set(k.split("."))}
    assert kept and set(kept.values()) == {torch.float32}
    assert saved["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16
