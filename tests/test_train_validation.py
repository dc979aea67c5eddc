"""Validation during fine-tuning: held-out rows in metrics.jsonl and TensorBoard, a deterministic
held-out loss, the best model kept by it, and recipe errors for a malformed validation section."""

import json
from pathlib import Path

import pytest
import torch

import mhla_convert
from mhla_convert.train import RecipeError, load_recipe
from mhla_convert.train.metrics import read_metrics
from mhla_convert.train.trainer import Trainer
from mhla_convert.train.validation import HeldOut, split_off

RECIPES = Path(__file__).parent.parent / "recipes"
SHORT = ["stages=[{name: attention_transfer, steps: 2}, {name: finetune, steps: 4, train: all}]",
         "data.num_samples=24", "data.batch_size=4"]


def _recipe(*overrides, trackers="[]"):
    return load_recipe(RECIPES / "tiny-llama.yaml", [*SHORT, f"logging.trackers={trackers}", *overrides])


def test_validation_rows_in_metrics_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = _recipe("validation={split: 0.25, every: 2}", trackers="[tensorboard]")
    Trainer(recipe, tmp_path / "run", log=lambda *_: None).run()
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "validation_loss" in r]
    assert [(r["step"], r["stage"]) for r in rows] == [
        (0, "attention_transfer"), (2, "attention_transfer"), (4, "finetune"), (6, "finetune")]
    assert all(torch.isfinite(torch.tensor(r["validation_loss"])) for r in rows)
    events = EventAccumulator(str(next((tmp_path / "run").rglob("events.out.tfevents*")).parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"validation/loss", "attention_transfer/loss", "finetune/loss"} <= tags
    assert [e.step for e in events.Scalars("validation/loss")] == [0, 2, 4, 6]


def test_heldout_loss_is_deterministic_and_split_is_disjoint(tmp_path):
    trainer = Trainer(_recipe("validation={split: 0.25}"), tmp_path / "run", log=lambda *_: None)
    held = trainer.heldout
    assert len(held.dataset) == 6 and len(trainer.dataset) == 18
    rows = lambda d: {tuple(x.tolist()) for x in d.columns["input_ids"]}  # noqa: E731
    assert not rows(held.dataset) & rows(trainer.dataset)
    model = trainer.built.model
    first = held.loss(model, device="cpu", dtype=torch.float32)
    assert first == held.loss(model, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        next(model.parameters()).add_(0.1)
    assert held.loss(model, device="cpu", dtype=torch.float32) != first


def test_best_model_is_the_lowest_validation_loss(tmp_path, monkeypatch):
    scripted = iter([5.0, 3.0, 4.0, 2.5, 2.7])  # steps 0, 2, 4, 6 … : the best is step 6
    monkeypatch.setattr(HeldOut, "loss", lambda self, model, **kw: next(scripted))
    logs = []
    Trainer(_recipe("validation={split: 0.25, every: 2}"), tmp_path / "run", log=logs.append).run()
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert (best["step"], best["stage"], best["loss"]) == (6, "finetune", 2.5)
    assert any("best validation loss 2.5 at step 6" in line for line in logs)
    assert mhla_convert.mhla_layers(mhla_convert.from_pretrained(tmp_path / "run" / "best"))


def test_split_off_keeps_one_example_each_side():
    from mhla_convert.train.data import TensorData

    data = TensorData({"x": torch.arange(3)[:, None]})
    train, held = split_off(data, 0.99, seed=0)
    assert (len(train), len(held)) == (1, 2)


@pytest.mark.parametrize("section, problem", [
    ("{every: 2}", "exactly one of validation.split"),
    ("{split: 0.1, path: x}", "exactly one of validation.split"),
    ("{split: 1.5}", "validation.split: must be in (0, 1)"),
    ("{path: held.safetensors}", "synthetic data has no held-out files"),
    ("{split: 0.1, every: -1}", "validation.every: must be ≥ 0"),
    ("{split: 0.1, num_batches: 0}", "validation.num_batches: must be ≥ 1"),
    ("{split: 0.1, evry: 3}", "unknown key"),
])
def test_bad_validation_section(section, problem):
    with pytest.raises(RecipeError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        _recipe(f"validation={section}")


def test_validation_samples_in_run_dir_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = load_recipe(RECIPES / "tiny-dit.yaml", [
        "stages=[{name: attention_transfer, steps: 1}, {name: finetune, steps: 1, train: all}]",
        "logging.trackers=[tensorboard]",
        "validation={split: 0.25, num_samples: 2, class_labels: [1, 3], sample_steps: 1}"])
    Trainer(recipe, tmp_path / "run", log=lambda *_: None).run()
    written = sorted(p.name for p in (tmp_path / "run" / "samples").glob("*.png"))
    assert written == ["step-00000000.png", "step-00000001.png", "step-00000002.png"]
    events = EventAccumulator(str(next((tmp_path / "run").rglob("events.out.tfevents*")).parent),
                              size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("validation/samples")] == [0, 1, 2]


def test_validation_samples_refused_for_language_models():
    with pytest.raises(Exception, match="validation.num_samples"):
        Trainer(_recipe("validation={split: 0.25, num_samples: 2}"), "/nonexistent/run", log=lambda *_: None)


def _transfer_run(tmp_path, monkeypatch, losses, name="run", stop_after=None, start=0):
    """A transfer-only run validated every 2 steps whose held-out losses follow `losses` by step; returns the
    trainer and the trained weights seen at each validation."""
    seen = {}

    def scripted(self, model, **kw):
        step = start + len(seen) * 2
        seen[step] = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        return losses[step]

    monkeypatch.setattr(HeldOut, "loss", scripted)
    recipe = _recipe("stages=[{name: attention_transfer, steps: 6, lr: 0.01}]", "validation={split: 0.25, every: 2}",
                     "checkpoint_every=2")
    trainer = Trainer(recipe, tmp_path / name, log=lambda *_: None)
    trainer.run(stop_after=stop_after)
    return trainer, seen


def test_transfer_that_ends_above_its_best_goes_back_to_it(tmp_path, monkeypatch):
    trainer, seen = _transfer_run(tmp_path, monkeypatch, {0: 5.0, 2: 3.0, 4: 4.0, 6: 4.5})
    final = [p.detach() for p in trainer.model.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(final, seen[2]))
    assert not all(torch.equal(a, b) for a, b in zip(seen[6], seen[2]))  # the run did move past step 2
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert last["step"] == 6 and last["validation_loss"] == 3.0 and last["restored_step"] == 2


def test_transfer_that_ends_at_its_best_keeps_its_weights(tmp_path, monkeypatch):
    trainer, seen = _transfer_run(tmp_path, monkeypatch, {0: 5.0, 2: 3.0, 4: 2.0, 6: 1.0})
    final = [p.detach() for p in trainer.model.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(final, seen[6]))
    assert "restored_step" not in read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]


def test_stage_best_survives_a_resume(tmp_path, monkeypatch):
    losses = {0: 5.0, 2: 3.0, 4: 4.0, 6: 4.5}
    whole, _ = _transfer_run(tmp_path, monkeypatch, losses, "whole")
    _transfer_run(tmp_path, monkeypatch, losses, "cut", stop_after=4)  # "killed" after the step-4 checkpoint
    resumed, _ = _transfer_run(tmp_path, monkeypatch, losses, "cut", start=6)  # resumes at step 4
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("losses, restored", [((5.0, 6.0), True), ((5.0, 4.0), False)], ids=["worse", "better"])
def test_transfer_without_validation_is_judged_on_training_batches(tmp_path, monkeypatch, losses, restored):
    """No validation section: a transfer stage that ends above its start on the first training batches goes back
    to its start (a `transfer_check_loss` row), one that ends below keeps its weights."""
    seen = []

    def scripted(self, model, **kw):
        assert len(self.dataset) >= self.batch_size  # the training data, not a held-out set
        seen.append([p.detach().clone() for p in model.parameters() if p.requires_grad])
        return losses[len(seen) - 1]

    monkeypatch.setattr(HeldOut, "loss", scripted)
    recipe = _recipe("stages=[{name: attention_transfer, steps: 4, lr: 0.01}]")
    trainer = Trainer(recipe, tmp_path / "run", log=lambda *_: None)
    trainer.run()
    final = [p.detach() for p in trainer.model.parameters() if p.requires_grad]
    assert len(seen) == 2 and not all(torch.equal(a, b) for a, b in zip(seen[0], seen[1]))  # the stage trained
    assert all(torch.equal(a, b) for a, b in zip(final, seen[0 if restored else 1]))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert ("transfer_check_loss" in rows[-1]) == restored and not any("validation_loss" in r for r in rows)
