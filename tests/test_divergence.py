"""A diverged model is never saved or reported as final, best or last good (tiny DiT runs on the CPU,
seconds each): a weight norm or a loss that explodes past its bound, or inf/NaN outputs on the fixed
probe batch, stop the run with one line naming the step, the last good checkpoint and what to change;
resume checks against the same bounds; `sample` and `eval` refuse a model with inf/NaN outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import mhla_convert
from mhla_convert.cli import app
from mhla_convert.evaluate import EvalError
from mhla_convert.train import TrainError, divergence, parse_recipe
from mhla_convert.train.trainer import Trainer, train

QUIET = {"log": lambda *_: None}
RECIPE = """\
model: {name: tiny-dit}
data: {kind: synthetic, num_samples: 16, batch_size: 4}
stages:
  - {name: attention_transfer, steps: 2, lr: 1.0e-2}
  - {name: finetune, steps: 4, train: all}
optimizer: {lr: 1.0e-3}
schedule: {name: constant, warmup_steps: 0}
checkpoint_every: 1
keep_checkpoints: 10
validation: {split: 0.25, every: 1, num_batches: 1}
logging: {trackers: []}
"""
LEAN = """\
model: {name: tiny-dit}
data: {kind: synthetic, num_samples: 8, batch_size: 4}
stages: [{name: finetune, steps: 5, train: all}]
optimizer: {lr: 1.0e-3}
checkpoint_every: 2
logging: {trackers: []}
"""


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _peak(folder: Path) -> float:
    """The largest weight magnitude in a saved model or an Accelerate checkpoint."""
    return max(v.abs().max().item() for f in folder.glob("*.safetensors") for v in load_file(str(f)).values())


def _assert_nothing_diverged_was_kept(out: Path, last_good: int) -> None:
    root = out / "checkpoints"
    assert _listing(root) == [f"step-{s:08d}" for s in range(1, last_good + 1)]
    assert all(_peak(root / name) < 100 for name in _listing(root))  # every checkpoint kept holds sane weights
    assert not (out / "model").exists()
    best = json.loads((out / "best.json").read_text())
    assert best["step"] <= last_good and _peak(out / "best") < 100


def test_an_exploding_learning_rate_stops_at_the_step_naming_the_last_good_checkpoint(tmp_path):
    """The issue's run: lr 1e6 sends the weights to ~1e6 in one step, whose loss is still finite."""
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(RECIPE)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["finetune", str(recipe), "--out", str(out), "--set", "optimizer.lr=1e6"])
    assert result.exit_code == 2
    error = result.output.strip().splitlines()[-1]
    assert error.startswith("error: the norm of the trained weights grew from "), error
    assert "past the 10× bound, at step 3 (finetune); stopped. Last good checkpoint: " in error
    assert str(out / "checkpoints" / "step-00000002") in error
    assert "lower the learning rate (optimizer.lr: 1e+06)" in error and "new --out" in error
    _assert_nothing_diverged_was_kept(out, last_good=2)

    with pytest.raises(TrainError, match=r"at step 3 \(finetune\); stopped\. Last good checkpoint: .*step-00000002"):
        train(parse_recipe(RECIPE, overrides=["optimizer.lr=1e6"]), out, **QUIET)  # a resume meets the same end


def test_outputs_that_turn_inf_on_the_last_step_stop_before_the_final_save(tmp_path, monkeypatch):
    """The last optimizer step's update is seen by no training loss: the probe batch catches it."""
    monkeypatch.setattr(divergence, "WEIGHT_GROWTH", float("inf"))  # only the probe is left to notice
    calls = {"n": 0}
    real = torch.optim.AdamW.step

    def blown_up(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 6:  # the last step: a huge, finite weight
            with torch.no_grad():
                for param in self.param_groups[0]["params"]:
                    param.mul_(1e30)
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", blown_up)
    with pytest.raises(TrainError) as error:
        train(parse_recipe(RECIPE), tmp_path / "run", **QUIET)
    message = str(error.value)
    assert message.startswith("the model's outputs on the probe batch became inf/NaN at step 6 (finetune); stopped.")
    assert "Last good checkpoint: " in message and "step-00000005" in message and "\n" not in message
    _assert_nothing_diverged_was_kept(tmp_path / "run", last_good=5)


def test_a_loss_that_explodes_past_its_bound_stops_the_run(tmp_path, monkeypatch):
    from mhla_convert.train import objectives

    calls = {"n": 0}
    real = objectives.EpsPrediction.loss

    def exploding(self, model, *args):
        loss = real(self, model, *args)
        calls["n"] += model.training  # training steps only: the reference is steps 1-3
        return loss * 1e4 if model.training and calls["n"] >= 5 else loss

    monkeypatch.setattr(objectives.EpsPrediction, "loss", exploding)
    with pytest.raises(TrainError) as error:
        train(parse_recipe(LEAN), tmp_path / "run", **QUIET)
    message = str(error.value)
    assert message.startswith("the loss rose from "), message
    assert "past the 100× bound, at step 5 (finetune); stopped. Last good checkpoint: " in message
    assert "step-00000004" in message and "\n" not in message
    assert _listing(tmp_path / "run" / "checkpoints") == ["step-00000002", "step-00000004"]


def test_a_resumed_run_checks_against_the_bounds_of_the_uninterrupted_run(tmp_path):
    recipe = parse_recipe(LEAN)
    full = Trainer(recipe, tmp_path / "full", **QUIET)
    full.run()
    assert Trainer(recipe, tmp_path / "cut", **QUIET).run(stop_after=2) is None
    progress = json.loads((tmp_path / "cut" / "checkpoints" / "step-00000002" / "progress.json").read_text())
    assert progress["guard"]["stage"] == 0 and len(progress["guard"]["first_losses"]) == 2
    resumed = Trainer(recipe, tmp_path / "cut", **QUIET)
    resumed.run()
    assert resumed.guard == full.guard and len(full.guard.first_losses) == divergence.LOSS_WINDOW
    assert resumed.guard.weight_norm > 0


@pytest.fixture
def diverged(tmp_path) -> Path:
    """A converted tiny DiT whose weights hold NaN, saved."""
    model = mhla_convert.tiny_model("tiny-dit")
    mhla_convert.convert(model, layers=[1])
    with torch.no_grad():
        model.proj_out_2.weight.view(-1)[0] = float("nan")
    return mhla_convert.save_pretrained(model, tmp_path / "diverged")


def test_sample_refuses_inf_nan_outputs_in_one_line(diverged, tmp_path):
    out = tmp_path / "x.png"
    result = CliRunner().invoke(app, ["sample", str(diverged), "--out", str(out), "--steps", "2", "--device", "cpu"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"error: {diverged} gives inf/NaN outputs") and "diverged" in result.output
    assert not out.exists()


def test_eval_refuses_inf_nan_outputs_in_one_line(diverged, tmp_path):
    options = dict(batch_size=2, num_batches=1, timesteps=2, samples=False, device="cpu")
    with pytest.raises(EvalError, match=rf"the model {diverged} gives inf/NaN outputs on the held-out data: it has "
                                        "diverged"):
        mhla_convert.evaluate(str(diverged), "synthetic", **options)
    with pytest.raises(EvalError, match=r"the reference .* gives inf/NaN outputs"):
        mhla_convert.evaluate("tiny-dit", "synthetic", str(diverged), **options)
    out = tmp_path / "eval"
    result = CliRunner().invoke(app, ["eval", str(diverged), "--data", "synthetic", "--batch-size", "2",
                                      "--num-batches", "1", "--timesteps", "2", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "diverged" in result.output, result.output
    assert not (out / "eval.json").exists()
