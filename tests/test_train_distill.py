"""Distillation from the original model (objective.distill, CPU, seconds each): the recipe refuses bad
weights and runs with no original to distil from; the loss is the KL / MSE to the original's outputs
at the same inputs and draws; weight 0 is the plain objective; runs train, save, validate on the plain
objective and resume bit-exactly."""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_train_run import TINY, _weights

import mhla_convert
from mhla_convert.models import tiny_model
from mhla_convert.train import RecipeError, parse_recipe
from mhla_convert.train.build import build_model
from mhla_convert.train.metrics import read_metrics
from mhla_convert.train.objectives import Distillation
from mhla_convert.train.recipe import ObjectiveSpec
from mhla_convert.train.trainer import Trainer, train

QUIET = dict(log=lambda *_: None)
FINETUNE = """\
model: {name: tiny-dit}
data: {kind: synthetic, num_samples: 16, batch_size: 4}
stages:
  - {name: finetune, steps: 2, train: all}
"""


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["objective.distill=1.5"], r"r.yaml \(--set objective.distill=1.5\): objective.distill: must be a finite "
                                    r"number in \[0, 1\] .*; got 1.5"),
        (["objective.distill=-0.1"], r"objective.distill: must be a finite number in \[0, 1\] .*; got -0.1"),
        (["objective.distill=.nan"], r"objective.distill: must be a finite number in \[0, 1\] .*; got nan"),
        (["objective.distill=.inf"], r"objective.distill: must be a finite number in \[0, 1\] .*; got inf"),
        (["objective.distill=half"], r"objective.distill: expected a number; got 'half'"),
        (["model={checkpoint: some/dir}", "objective.distill=0.5"],
         r"objective.distill: distillation needs the original model as teacher: use model.name \+ conversion"),
        (["stages=[{name: attention_transfer, steps: 2}]", "objective.distill=0.5"],
         r"objective.distill: applies to finetune stages and this recipe has none"),
    ],
    ids=["above-1", "negative", "nan", "inf", "text", "checkpoint", "no-finetune"],
)
def test_bad_distill_values_are_refused(overrides, expected):
    with pytest.raises(RecipeError, match=expected) as info:
        parse_recipe(FINETUNE, "r.yaml", overrides)
    assert "\n" not in str(info.value)


def test_distill_in_the_yaml_names_its_line():
    with pytest.raises(RecipeError, match=r"r.yaml:6: objective.distill: must be a finite number"):
        parse_recipe(FINETUNE + "objective:\n  distill: 2\n", "r.yaml")
    for weight in (0, 0.25, 1):
        assert parse_recipe(FINETUNE, overrides=[f"objective.distill={weight}"]).objective.distill == weight
    assert parse_recipe(FINETUNE).objective.distill == 0.0


def _pair(name: str):
    """(original, student, adapter): a tiny model and a converted deep copy of it, its weights nudged so
    that its outputs clearly differ (the tiny LM's exact chunks cover these short sequences exactly)."""
    from mhla_convert.families import adapter_for_model

    original = tiny_model(name)
    student = copy.deepcopy(original)
    mhla_convert.convert(student, **({"chunk_size": 8, "window": 4} if "llama" in name else {}))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return original.requires_grad_(False).eval(), student, adapter_for_model(original)


def test_lm_distillation_is_the_token_kl_to_the_original():
    original, student, adapter = _pair("tiny-llama")
    vocab = original.config.vocab_size
    ids = torch.randint(0, vocab, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # padding at the end of the second sequence
    task = adapter.objective(ObjectiveSpec())

    def kl(batch_mask):
        with torch.no_grad():
            p = F.log_softmax(original(input_ids=ids).logits.double(), -1)
            q = F.log_softmax(student(input_ids=ids).logits.double(), -1)
        per_token = (p.exp() * (p - q)).sum(-1)  # KL(original ‖ student) at every position
        return per_token.mean() if batch_mask is None else per_token[batch_mask.bool()].mean()

    pure = Distillation(task, original, 1.0)
    for batch in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}):
        got = pure.loss(student, batch, torch.Generator())
        torch.testing.assert_close(got.double(), kl(batch.get("attention_mask")), rtol=1e-5, atol=1e-7)
    assert not torch.isclose(kl(mask), kl(None))  # the mask changed which tokens count
    # the original distils to itself with zero loss
    assert pure.loss(original, {"input_ids": ids}, torch.Generator()).abs() < 1e-6
    # weight 0 is the plain cross-entropy; a weight in between, the mixture of the two
    batch = {"input_ids": ids}
    plain = task.loss(student, batch, torch.Generator())
    assert torch.equal(Distillation(task, original, 0.0).loss(student, batch, torch.Generator()), plain)
    mixed = Distillation(task, original, 0.25).loss(student, batch, torch.Generator())
    torch.testing.assert_close(mixed.double(), 0.75 * plain.double() + 0.25 * kl(None), rtol=1e-5, atol=1e-7)


def test_diffusion_distillation_is_the_mse_to_the_originals_prediction():
    from diffusers import DDPMScheduler

    original, student, adapter = _pair("tiny-dit")
    task = adapter.objective(ObjectiveSpec())
    c, size = original.config.in_channels, original.config.sample_size
    batch = {"latents": torch.randn(3, c, size, size, generator=torch.Generator().manual_seed(1)),
             "class_labels": torch.tensor([0, 1, 2])}
    # by hand: the objective's own draws from the step generator, both models at the same noisy input
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, 1000, (3,), generator=g)
    noise = torch.randn(batch["latents"].shape, generator=g)
    xt = DDPMScheduler(num_train_timesteps=1000).add_noise(batch["latents"], noise, t)
    with torch.no_grad():
        reference = original(xt, timestep=t, class_labels=batch["class_labels"]).sample[:, :c]
        pred = student(xt, timestep=t, class_labels=batch["class_labels"]).sample[:, :c]
    expected = F.mse_loss(pred, reference)
    got = Distillation(task, original, 1.0).loss(student, batch, torch.Generator().manual_seed(7))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    # no labels needed: the target is the original's prediction, not the noise
    assert not torch.isclose(expected, F.mse_loss(pred, noise))
    plain = task.loss(student, batch, torch.Generator().manual_seed(7))
    torch.testing.assert_close(plain, F.mse_loss(pred, noise), rtol=1e-6, atol=0)
    assert torch.equal(Distillation(task, original, 0.0).loss(student, batch, torch.Generator().manual_seed(7)), plain)


def test_flow_matching_distils_at_the_same_noisy_input():
    original, student, adapter = _pair("tiny-sana")
    task = adapter.objective(ObjectiveSpec())
    batch = {k: v[:2] for k, v in adapter.synthetic_data(original, parse_recipe(
        FINETUNE.replace("tiny-dit", "tiny-sana")).data, seed=0).items()}
    idx, noise = task.draw(batch, torch.Generator().manual_seed(3))
    with torch.no_grad():
        pred, _ = task.prediction(student, batch, idx, noise)
        reference, _ = task.prediction(original, batch, idx, noise)
    got = Distillation(task, original, 1.0).loss(student, batch, torch.Generator().manual_seed(3))
    torch.testing.assert_close(got, F.mse_loss(pred, reference), rtol=1e-6, atol=0)


def test_flow_matching_noises_at_every_schedule_index():
    """Each index has the sigma of its timestep, the last (the least noise) included."""
    original, _, adapter = _pair("tiny-sana")
    task = adapter.objective(ObjectiveSpec())
    assert len(task.sigmas) == len(task.timesteps) == ObjectiveSpec().num_train_timesteps
    torch.testing.assert_close(task.sigmas * len(task.timesteps), task.timesteps)
    batch = {k: v[:2] for k, v in adapter.synthetic_data(original, parse_recipe(
        FINETUNE.replace("tiny-dit", "tiny-sana")).data, seed=0).items()}
    with torch.no_grad():
        pred, _ = task.prediction(original, batch, torch.tensor([0, len(task.timesteps) - 1]),
                                  torch.randn_like(batch["latents"]))
    assert torch.isfinite(pred).all()


def test_the_teacher_is_a_frozen_copy_of_the_unconverted_model():
    recipe = parse_recipe(FINETUNE, overrides=["objective.distill=0.5"])
    built = build_model(recipe)
    teacher = built.original
    assert teacher is not None and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())
    assert not mhla_convert.mhla_layers(teacher) and mhla_convert.mhla_layers(built.model)
    shared = {p.data_ptr() for p in built.model.parameters()} & {p.data_ptr() for p in teacher.parameters()}
    assert not shared
    base = tiny_model("tiny-dit")
    for (name, p), q in zip(base.named_parameters(), teacher.parameters()):
        assert torch.equal(p, q), name
    # a rebuild (FSDP between stages, the gathered final model) copies nothing
    assert build_model(recipe, teachers=False).original is None


@pytest.mark.parametrize("name", ["tiny-dit", "tiny-llama"])
def test_a_distilled_run_trains_saves_and_validates_on_the_plain_objective(name, tmp_path):
    base = FINETUNE.replace("tiny-dit", name) + "validation: {split: 0.25}\nlogging: {trackers: []}\n"
    plain_trainer = Trainer(parse_recipe(base), tmp_path / "plain", **QUIET)
    # distill 0 (the default): no teacher, the finetune stages minimise the plain objective
    assert plain_trainer.built.original is None and plain_trainer.step_objective is plain_trainer.objective
    plain = plain_trainer.run()
    trainer = Trainer(parse_recipe(base, overrides=["objective.distill=0.5"]), tmp_path / "distil", **QUIET)
    assert isinstance(trainer.step_objective, Distillation) and trainer.step_objective.weight == 0.5
    out = trainer.run()
    assert out == tmp_path / "distil" / "model"
    assert mhla_convert.mhla_layers(mhla_convert.from_pretrained(out))
    rows = read_metrics(tmp_path / "distil" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    # step 0 scores the same converted model: with and without distillation, the same plain held-out loss
    held = {run: [r["validation_loss"] for r in read_metrics(tmp_path / run / "metrics.jsonl")
                  if "validation_loss" in r] for run in ("plain", "distil")}
    assert held["plain"][0] == held["distil"][0]
    # the teacher is never saved: the same tensors as a plain run, in the model and in the checkpoint
    assert _weights(tmp_path / "distil").keys() == _weights(plain.parent).keys()
    saved = sorted(p.name for p in (tmp_path / "distil" / "checkpoints" / "step-00000002").iterdir())
    assert saved == sorted(p.name for p in (tmp_path / "plain" / "checkpoints" / "step-00000002").iterdir())
    # the teacher stayed frozen, in eval mode, on the training device
    teacher = trainer.built.original
    assert not teacher.training and all(p.device == trainer.accelerator.device for p in teacher.parameters())
    for (key, p), q in zip(tiny_model(name).named_parameters(), teacher.parameters()):
        assert not q.requires_grad and torch.equal(p, q), key
    distilled, trained = _weights(tmp_path / "distil"), _weights(tmp_path / "plain")
    assert any(not torch.equal(distilled[k], trained[k]) for k in trained)  # distillation changed the training


def test_a_distilled_run_resumes_exactly(tmp_path):
    recipe = parse_recipe(TINY, overrides=["objective.distill=0.5"])
    train(recipe, tmp_path / "full", **QUIET)
    assert train(recipe, tmp_path / "cut", stop_after=5, **QUIET) is None  # "killed" after step 5
    train(recipe, tmp_path / "cut", **QUIET)  # resumes from step 4, in the distilled finetune stage
    full, resumed = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    assert full.keys() == resumed.keys()
    for k in full:
        torch.testing.assert_close(resumed[k], full[k], rtol=0, atol=0, msg=k)
