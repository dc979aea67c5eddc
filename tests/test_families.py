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


PIPELINES = [(family, name) for family, cls in sorted(families().items()) if cls.library == "diffusers"
             for name in cls().tiny_pipelines()]


def _expert_inputs(model, timesteps: tuple[int, ...]) -> list[dict]:
    adapter = adapter_for_model(model)
    batches = []
    for seed, t in enumerate(timesteps):
        batch = _inputs(adapter, model, seed)
        batches.append({**batch, "timestep": torch.full_like(batch["timestep"], t)})
    return batches


@pytest.mark.parametrize("family, name", PIPELINES, ids=[name for _, name in PIPELINES])
def test_pipeline_of_experts_converts_together_reloads_samples_and_refuses_one_expert(family, name, run_model,
                                                                                         tmp_path):
    """Two experts (high / low noise): one plan over both, both saved and reloaded bitwise, both sampled."""
    from diffusers import DiffusionPipeline

    from mhla_convert.cli import app
    from mhla_convert.experts import EXPERTS, tiny_pipeline
    from mhla_convert.train import TrainError

    pipe = tiny_pipeline(name)
    pipe.save_pretrained(tmp_path / "base")  # the unconverted pipeline, as a hub pipeline folder holds it
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    calibration = _expert_inputs(pipe.transformer, (999, 1, int(boundary), int(boundary) - 1))
    with pytest.raises(ValueError, match="no calibration example falls in transformer_2's noise range"):
        mhla_convert.convert(pipe, ratio=0.5, strategy="auto", calibration=calibration[:1], progress=False)
    assert not mhla_convert.mhla_layers(pipe.transformer)  # refused before any change
    report = mhla_convert.convert(pipe, ratio=0.5, strategy="auto", calibration=calibration, progress=False)
    experts = {expert: getattr(pipe, expert) for expert in EXPERTS}
    plans = [model.mhla_plan for model in experts.values()]
    assert plans[0] == plans[1] and plans[0]["strategy"] == "auto" and plans[0]["layers"] == report.converted
    assert len(report.converted) == 3 and sorted(report.sensitivity) == list(range(6))
    inputs = _expert_inputs(pipe.transformer, (999,))[0]
    with torch.no_grad():
        for model in experts.values():
            for _, layer in mhla_convert.mhla_layers(model):
                layer.mixing.mul_(torch.rand_like(layer.mixing))
    before = {expert: run_model(model, inputs) for expert, model in experts.items()}
    assert not torch.equal(*before.values())  # two experts, not one twice
    pipe.save_pretrained(tmp_path / "pipe")
    reloaded = DiffusionPipeline.from_pretrained(tmp_path / "pipe")
    called = dict.fromkeys(EXPERTS, 0)
    for expert in EXPERTS:
        model = getattr(reloaded, expert)
        assert model.mhla_plan == experts[expert].mhla_plan
        assert torch.equal(run_model(model, inputs), before[expert])
        model.register_forward_pre_hook(lambda *_, e=expert: called.__setitem__(e, called[e] + 1))
    frames = reloaded("a red cube", height=64, width=64, num_frames=5, num_inference_steps=4, output_type="np",
                      generator=torch.Generator().manual_seed(0)).frames[0]
    assert frames.shape == (5, 64, 64, 3) and all(called.values())  # both experts denoised

    runner = CliRunner()
    refused = runner.invoke(app, [str(tmp_path / "base"), "--out", str(tmp_path / "one")])
    assert refused.exit_code == 2 and "transformer_2" in refused.output and "--pipeline" in refused.output
    args = [str(tmp_path / "base"), "--pipeline", "--ratio", "0.5", "--out", str(tmp_path / "cli")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = DiffusionPipeline.from_pretrained(tmp_path / "cli")
    assert saved.transformer.mhla_plan["layers"] == saved.transformer_2.mhla_plan["layers"] == [1, 3, 5]
    video = tmp_path / "cli.mp4"
    args = ["sample", str(tmp_path / "cli"), "--out", str(video), "--steps", "2", "--height", "64", "--width", "64",
            "--num-frames", "5"]
    result = runner.invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    assert imageio.get_reader(video).count_frames() == 5
    with pytest.raises(TrainError, match="model.checkpoint DIR/transformer"):  # the trainer trains one transformer
        train(parse_recipe(_recipe(family, str(tmp_path / "base"))), tmp_path / "run", log=lambda *_: None)
