"""The contract every registered family meets, on each of its built-in tiny models (variants
included): convert and run, save and reload bitwise, one step of each training stage on the
built-in synthetic data, and a sample. A new family passes by adding its adapter file."""

from __future__ import annotations

import json

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
import typer
from PIL import Image
from typer.testing import CliRunner

import mhla_convert
from mhla_convert.families import adapter_for_family, adapter_for_model, families
from mhla_convert.models import load_model
from mhla_convert.train import parse_recipe
from mhla_convert.train.commands import register
from mhla_convert.train.trainer import train

TINY = [(family, name) for family, cls in sorted(families().items()) for name in cls().tiny_configs()]
IDS = [name for _, name in TINY]


def _grid(adapter, model) -> tuple[int, ...]:
    """A small token grid (diffusers: at most 6 per axis, so uneven blocks happen) or 70 tokens
    (LMs: past the first 64-token chunk)."""
    native = adapter.native_grid(model)
    return (70,) if native is None else tuple(min(g, 6) for g in native)


def _inputs(adapter, model, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return adapter.example_inputs(model, _grid(adapter, model), 2)


@pytest.mark.parametrize("family, name", TINY, ids=IDS)
def test_convert_forward_save_and_reload_bitwise(family, name, tiny, run_model, tmp_path):
    model = tiny(name)
    adapter = adapter_for_family(family)
    assert type(adapter_for_model(model)) is type(adapter)
    report = mhla_convert.convert(model, ratio=0.67)
    assert report.converted and [n for n, _ in mhla_convert.mhla_layers(model)]
    with torch.no_grad():  # trained-looking mixing, so reload is not just re-initialisation
        for _, layer in mhla_convert.mhla_layers(model):
            layer.mixing.mul_(torch.rand_like(layer.mixing))
    inputs = _inputs(adapter, model)
    before = run_model(model, inputs)
    assert torch.isfinite(before).all()
    path = mhla_convert.save_pretrained(model, tmp_path / "ckpt")
    meta = json.loads((path / "mhla_config.json").read_text())
    assert meta["family"] == family and meta["base_model"] == name
    assert meta["plan"]["layers"] == model.mhla_plan["layers"] == report.converted
    assert meta["mhla_convert_version"] == mhla_convert.__version__ and "blocks" in meta["mhla"]
    reloaded = mhla_convert.from_pretrained(path)
    assert torch.equal(run_model(reloaded, inputs), before)
    assert reloaded.mhla_plan == model.mhla_plan
    assert load_model(str(path)).mhla_plan == model.mhla_plan  # load_model recognises checkpoints too


def _recipe(family: str, name: str) -> str:
    return f"""
model: {{name: {name}, family: {family}}}
conversion: {{ratio: 0.5}}
data: {{kind: synthetic, num_samples: 4, batch_size: 2, latent_frames: 2, context_length: 16}}
stages:
  - {{name: attention_transfer, steps: 1, lr: 1.0e-3}}
  - {{name: finetune, steps: 1, train: all}}
logging: {{trackers: []}}
"""


def _cli():
    app = typer.Typer()
    register(app)
    return app


@pytest.mark.parametrize("family, name", TINY, ids=IDS)
def test_train_each_stage_then_sample(family, name, tmp_path):
    adapter = adapter_for_family(family)
    run = train(parse_recipe(_recipe(family, name)), tmp_path / "run", log=lambda *_: None)
    trained = mhla_convert.from_pretrained(run)
    assert mhla_convert.mhla_layers(trained)
    suffix = {"image": ".png", "video": ".mp4", "text": ".txt"}[adapter.sample_kind]
    out = tmp_path / f"sample{suffix}"
    condition = ["--class-label", "3"] if family == "dit" else ["--prompt", "a red cube"]  # DiT draws a class
    args = ["sample", str(run), *condition, "--out", str(out), "--steps", "1", "--max-new-tokens", "3"]
    if adapter.takes_first_frame(trained):
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(tmp_path / "f.png")
        args += ["--image", str(tmp_path / "f.png")]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    if adapter.sample_kind == "image":
        assert Image.open(out).size[0] >= 16
    elif adapter.sample_kind == "video":
        assert imageio.get_reader(out).count_frames() == 5
    else:
        assert out.read_text().startswith("a red cube")
