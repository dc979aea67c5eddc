"""Training runs on tiny models (CPU, seconds each): loss falls, attention transfer closes each
layer's gap to the original, resume reproduces an uninterrupted run, mixing stays in [0, 1], LoRA
saves and merges, and bad input ends in one TrainError that says what to change."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import mhla_convert
from mhla_convert.train import TrainError, load_recipe, parse_recipe
from mhla_convert.train.metrics import read_metrics
from mhla_convert.train.trainer import Trainer, train

RECIPES = Path(__file__).parent.parent / "recipes"
QUIET = ["logging.trackers=[]"]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted((run / "model").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("path", sorted(RECIPES.glob("tiny-*.yaml")), ids=lambda p: p.stem)
def test_tiny_recipe_runs_and_loss_falls(path, tmp_path):
    out = train(load_recipe(path), tmp_path / "run", log=lambda *_: None)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["stage"] == "finetune"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.9 * first, f"finetune loss did not fall: {first:.3f} → {last:.3f}"
    model = mhla_convert.from_pretrained(out)
    assert mhla_convert.mhla_layers(model)
    if path.stem == "tiny-dit":  # the default tracker wrote its event files
        assert list((tmp_path / "run").rglob("events.out.tfevents*"))


def _layer_errors(trainer: Trainer) -> list[float]:
    from mhla_convert.train.transfer import AttentionTransfer

    built = trainer.built
    hooks = AttentionTransfer(built.students(), built.teachers).attach()
    batch = trainer._batch(trainer.dataset[list(range(8))])
    with torch.no_grad():
        trainer.objective.loss(built.model, batch, torch.Generator().manual_seed(123))
    hooks.detach()
    return [e.item() for e in hooks.take_errors()]


@pytest.mark.parametrize("family", ["dit", "llama"])
def test_attention_transfer_lowers_each_layers_error(family, tmp_path, monkeypatch):
    lr = load_recipe(RECIPES / f"tiny-{family}.yaml").stages[0].lr
    # (no exact region: it starts as the original attention, which leaves the summaries little to learn)
    region = "conversion.options.exact_chunks=0" if family == "llama" else "conversion.options.exact_radius=null"
    recipe = load_recipe(
        RECIPES / f"tiny-{family}.yaml", QUIET + [f"stages=[{{name: attention_transfer, steps: 25, lr: {lr}}}]", region]
    )
    # each layer's own error, whatever the model's loss says (a transfer stage that ends above its start on the
    # model's loss goes back to it: tests/test_train_validation.py)
    monkeypatch.setattr(Trainer, "_back_to_stage_best", lambda *args: None)
    trainer = Trainer(recipe, tmp_path / "run", log=lambda *_: None)
    before = _layer_errors(trainer)
    trainer.run()
    after = _layer_errors(trainer)
    assert len(before) == len(trainer.built.converted) > 0
    assert all(a < b for a, b in zip(after, before)), (before, after)


TINY = """\
model: {name: tiny-dit}
data: {kind: synthetic, num_samples: 16, batch_size: 4}
stages:
  - {name: attention_transfer, steps: 2, lr: 1.0e-2}
  - {name: finetune, steps: 4, train: all}
optimizer: {lr: 1.0e-3}
schedule: {name: cosine, warmup_steps: 1}
gradient_accumulation: 2
checkpoint_every: 2
logging: {trackers: []}
"""


def test_resume_equals_uninterrupted_run(tmp_path):
    recipe = parse_recipe(TINY)
    train(recipe, tmp_path / "full", log=lambda *_: None)
    assert train(recipe, tmp_path / "cut", stop_after=5, log=lambda *_: None) is None  # "killed" after step 5
    assert [p.name for p in sorted((tmp_path / "cut" / "checkpoints").iterdir())] == ["step-00000002", "step-00000004"]
    train(recipe, tmp_path / "cut", log=lambda *_: None)  # resumes from step 4
    full, resumed = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    assert full.keys() == resumed.keys()
    for k in full:
        torch.testing.assert_close(resumed[k], full[k], rtol=0, atol=0, msg=k)
    steps = [r["step"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 7))


def test_mixing_stays_in_unit_interval(tmp_path, monkeypatch):
    from mhla_convert.train import divergence

    monkeypatch.setattr(divergence, "WEIGHT_GROWTH", float("inf"))  # lr 5 drives the weights far, on purpose
    recipe = parse_recipe(
        TINY, overrides=["optimizer.lr=5.0", "optimizer.grad_clip=null", "stages.1.train=mhla", "checkpoint_every=0"]
    )
    out = train(recipe, tmp_path / "run", log=lambda *_: None)
    mixing = [layer.mixing for _, layer in mhla_convert.mhla_layers(mhla_convert.from_pretrained(out))]
    assert mixing and all(bool(((m >= 0) & (m <= 1)).all()) for m in mixing)
    assert any(bool(((m == 0) | (m == 1)).any()) for m in mixing)  # the clamp was needed


def test_lora_saves_an_adapter_or_merges(tmp_path):
    lora = ["stages.1.train=lora", "stages.1.lr=1.0e-2", "checkpoint_every=0"]
    merged = train(parse_recipe(TINY, overrides=lora), tmp_path / "merged", log=lambda *_: None)
    kept = train(
        parse_recipe(TINY, overrides=lora + ["stages.1.lora={merge: false, r: 4, alpha: 8}"]),
        tmp_path / "kept",
        log=lambda *_: None,
    )
    assert not any("lora" in k for k in _weights(tmp_path / "merged")) and not any(
        "lora" in k for k in _weights(tmp_path / "kept")
    )
    adapter = load_file(str(tmp_path / "kept" / "adapter" / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "kept" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and adapter
    # the adapter really changed the weights: base + (alpha/r)·B·A differs from base
    key_a = next(k for k in adapter if k.endswith("lora_A.weight"))
    a, b = adapter[key_a], adapter[key_a.replace("lora_A", "lora_B")]
    assert (b @ a).abs().max() > 0
    assert mhla_convert.from_pretrained(merged) is not None and mhla_convert.from_pretrained(kept) is not None
    base, merged_w = _weights(tmp_path / "kept"), _weights(tmp_path / "merged")
    changed = [k for k in base if not torch.equal(base[k], merged_w[k])]
    assert changed and all(any(f".{name}" in k for name in ("to_q", "to_k", "to_v", "to_out")) for k in changed)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    from mhla_convert.train import objectives

    calls = {"n": 0}
    real = objectives.EpsPrediction.loss

    def poisoned(self, model, *args):
        calls["n"] += model.training  # training steps only (not the probe batch nor validation)
        loss = real(self, model, *args)
        return loss * float("nan") if calls["n"] > 10 else loss  # 2 micro-steps a step: step 6 goes bad

    monkeypatch.setattr(objectives.EpsPrediction, "loss", poisoned)
    with pytest.raises(
        TrainError, match=r"loss became nan at step 6 \(finetune\); stopped\. Last good checkpoint: .*step-00000004"
    ):
        train(parse_recipe(TINY), tmp_path / "run", log=lambda *_: None)
    assert (tmp_path / "run" / "checkpoints" / "step-00000004" / "progress.json").exists()
    assert not (tmp_path / "run" / "model").exists()


def test_bad_input_is_one_clear_error(tmp_path):
    with pytest.raises(TrainError, match=r"recipe is for family 'wan' but tiny-dit is a 'dit' model"):
        train(parse_recipe(TINY, overrides=["model.family=wan"]), tmp_path / "a")
    with pytest.raises(TrainError, match=r"data.path .*nowhere does not exist"):
        train(parse_recipe(TINY, overrides=[f"data={{kind: latents, path: {tmp_path}/nowhere}}"]), tmp_path / "b")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainError, match=r"no .safetensors files"):
        train(parse_recipe(TINY, overrides=[f"data={{kind: latents, path: {tmp_path}/empty}}"]), tmp_path / "c")
    run = tmp_path / "d"
    train(parse_recipe(TINY, overrides=["stages=[{name: finetune, steps: 2}]"]), run, log=lambda *_: None)
    progress = run / "checkpoints" / "step-00000002" / "progress.json"
    progress.write_text(json.dumps({**json.loads(progress.read_text()), "version": "0.0.1"}))
    with pytest.raises(TrainError, match=r"written by mhla-convert 0.0.1"):
        train(parse_recipe(TINY), run)
    assert (run / "model").exists()  # nothing already trained was touched


def test_cli_prints_one_line(tmp_path):
    import typer
    from typer.testing import CliRunner

    from mhla_convert.train.commands import register

    app = typer.Typer()
    register(app)
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.replace("steps: 4", "stesp: 4"))
    result = CliRunner().invoke(app, ["finetune", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "stages[1].stesp: unknown key" in result.output


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state whose precision cannot change once set."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_fp16_on_cpu_is_refused_before_the_model_loads(tmp_path, monkeypatch, fresh_accelerate_state):
    from mhla_convert.train import trainer

    def no_build(*_, **__):
        raise AssertionError("the model was built")

    monkeypatch.setattr(trainer, "build_model", no_build)
    with pytest.raises(TrainError, match=r'precision: fp16 cannot run on this cpu device .*set precision: "no"'):
        Trainer(parse_recipe(TINY, overrides=["precision=fp16"]), tmp_path / "run")
    assert not (tmp_path / "run" / "recipe.yaml").exists()


@pytest.mark.parametrize("mode", ["mhla", "attention", "all", "lora"])
def test_fixed_mixing_stays_frozen_in_every_mode(mode):
    from mhla_convert.train.build import build_model
    from mhla_convert.train.lora import add_lora
    from mhla_convert.train.params import select_trainable

    recipe = parse_recipe(TINY, overrides=["conversion={options: {learnable_mixing: false}}", "stages.1.train=lora"])
    built = build_model(recipe, teachers=False)
    if mode == "lora":
        add_lora(built.model, recipe.stages[1].lora)
    params = select_trainable(built.model, mode, built.adapter)
    layers = [layer for _, layer in mhla_convert.mhla_layers(built.model)]
    assert layers and params
    assert not any(layer.mixing.requires_grad for layer in layers)
    assert not any(p is layer.mixing for p in params for layer in layers)


def test_inf_weights_stop_the_run_before_anything_is_saved(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = torch.optim.AdamW.step

    def poisoned(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 6:  # the last optimizer step: the loss of that step was still finite
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    with pytest.raises(
        TrainError,
        match=r"the trained weights became inf/NaN at step 6 \(finetune\); stopped\. Last good checkpoint: .*step-0+4",
    ):
        train(parse_recipe(TINY), tmp_path / "run", log=lambda *_: None)
    assert calls["n"] == 6
    assert not (tmp_path / "run" / "checkpoints" / "step-00000006").exists()
    assert not (tmp_path / "run" / "model").exists()


def test_resume_refuses_a_shorter_or_different_recipe(tmp_path):
    run = tmp_path / "run"
    assert train(parse_recipe(TINY), run, stop_after=4, log=lambda *_: None) is None  # checkpoints at 2 and 4
    with pytest.raises(TrainError, match=r"step-0+4 is at step 4, beyond this recipe's 3 steps: lengthen the stages"):
        train(parse_recipe(TINY, overrides=["stages.1.steps=1"]), run, log=lambda *_: None)
    with pytest.raises(
        TrainError, match=r"another recipe \(optimizer.lr: 0.001 -> 0.002; seed: 0 -> 1\): resume with the same recipe"
    ):
        train(parse_recipe(TINY, overrides=["optimizer.lr=2e-3", "seed=1"]), run, log=lambda *_: None)
    with pytest.raises(TrainError, match=r"stages\[2\].name: \(absent\) -> finetune"):
        train(parse_recipe(TINY, overrides=["stages=[{name: attention_transfer, steps: 2, lr: 1.0e-2}, "
                                            "{name: finetune, steps: 4, train: all}, {name: finetune, steps: 1}]"]),
              run, log=lambda *_: None)
    assert not (run / "model").exists()
    longer = ["stages.1.steps=5", "checkpoint_every=3", "keep_checkpoints=1", "logging.every=2"]
    assert train(parse_recipe(TINY, overrides=longer), run, log=lambda *_: None) == run / "model"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000007"]


def test_gradient_checkpointing_prepares_the_family(tmp_path, monkeypatch):
    """A Wan recipe with gradient checkpointing runs, and its blocks get their rotary tables in their hidden states'
    dtype (WanAdapter.prepare_checkpointing: what FSDP2's mixed precision needs when blocks are recomputed)."""
    prepared = []
    from mhla_convert.families.wan import WanAdapter

    original = WanAdapter.prepare_checkpointing
    monkeypatch.setattr(WanAdapter, "prepare_checkpointing",
                        lambda self, model: (prepared.append(model), original(self, model)))
    recipe = parse_recipe((RECIPES / "tiny-wan.yaml").read_text(),
                          overrides=[*QUIET, "gradient_checkpointing=true", "stages=[{name: finetune, steps: 2}]"])
    train(recipe, tmp_path / "run", log=lambda *_: None)
    assert len(prepared) == 1 and all(len(b._forward_pre_hooks) == 1 for b in prepared[0].blocks)
