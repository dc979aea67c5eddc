"""Recipe schema: every shipped recipe validates; malformed ones are refused with the key, the
allowed values and the line."""

import re
from pathlib import Path

import pytest

from mhla_convert.train import RecipeError, load_recipe, parse_recipe

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
GOOD = """\
model:
  name: tiny-dit
data:
  kind: synthetic
stages:
  - name: finetune
    steps: 3
"""


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.stages and recipe.total_steps > 0


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    for required in (
        "sana-600m-mhla.yaml", "sana-1600m-mhla.yaml", "wan2.1-1.3b-mhla.yaml", "wan2.1-1.3b-mhla-h67.yaml",
        "dit-xl-2-256-mhla.yaml", "llama-3.2-1b-mhla.yaml", "tiny-dit.yaml", "tiny-wan.yaml", "tiny-llama.yaml",
    ):
        assert required in names


@pytest.mark.parametrize(
    "text, expected",
    [
        (GOOD + "optimiser: {lr: 1}\n", r"r.yaml:8: optimiser: unknown key; allowed keys here: model, data, stages"),
        (
            GOOD.replace("kind: synthetic", "kind: imagefolder"),
            r"r.yaml:4: data.kind: expected one of 'synthetic', 'folder', 'latents', 'text'; got 'imagefolder'",
        ),
        (
            GOOD.replace("steps: 3", "steps: 3\n    trian: all"),
            r"r.yaml:8: stages\[0\].trian: unknown key; allowed keys here: name, steps, lr, train, lora",
        ),
        (GOOD.replace("steps: 3", "steps: many"), r"r.yaml:7: stages\[0\].steps: expected an integer; got 'many'"),
        (
            GOOD.replace("name: finetune", "name: distill"),
            r"stages\[0\].name: expected one of 'attention_transfer', 'finetune'",
        ),
        (GOOD + "precision: fp8\n", r"r.yaml:8: precision: expected one of 'no', 'bf16', 'fp16'"),
        (
            GOOD + "conversion: {options: {mixing_inti: uniform}}\n",
            r"r.yaml:8: conversion.options.mixing_inti: unknown MHLA option; allowed: .*mixing_init",
        ),
        (
            GOOD.replace("  name: tiny-dit", "  checkpoint: x\n  name: tiny-dit"),
            r"r.yaml:1: model: give exactly one of model.name",
        ),
        (GOOD.replace("kind: synthetic", "kind: folder"), r"data.path: data.kind 'folder' needs data.path"),
        (GOOD + "logging: {trackers: [tensorbord]}\n", r"logging.trackers\[0\]: unknown tracker 'tensorbord'"),
        (
            GOOD.replace("name: finetune", "name: attention_transfer").replace("steps: 3", "steps: 3\n    train: all"),
            r"attention_transfer trains the MHLA layers only",
        ),
        ("model: [1, 2\n", r"r.yaml:\d+: not valid YAML"),
        ("model: {name: tiny-dit}\n", r"r.yaml:1: recipe: missing required key\(s\): data, stages"),
    ],
    ids=lambda v: None if "\n" in v else v[:40],
)
def test_malformed_recipes_are_refused(text, expected):
    with pytest.raises(RecipeError, match=expected):
        parse_recipe(text, "r.yaml")


def test_overrides_are_validated_too():
    recipe = parse_recipe(GOOD, "r.yaml", ["optimizer.lr=3e-4", "stages.0.steps=7", "data.batch_size=2"])
    assert recipe.optimizer.lr == 3e-4 and recipe.stages[0].steps == 7 and recipe.data.batch_size == 2
    with pytest.raises(RecipeError, match=r"--set optimizer.lrr=1.*optimizer.lrr: unknown key"):
        parse_recipe(GOOD, "r.yaml", ["optimizer.lrr=1"])
    with pytest.raises(RecipeError, match=r"stages is a list of 1; use an index 0 … 0"):
        parse_recipe(GOOD, "r.yaml", ["stages.3.steps=1"])


def test_lora_stage_must_be_last():
    text = GOOD.replace("    steps: 3\n", "    steps: 3\n    train: lora\n  - name: finetune\n    steps: 2\n")
    with pytest.raises(RecipeError, match="LoRA stage must be the last"):
        parse_recipe(text, "r.yaml")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optimizer.grad_clip=-1", r"optimizer.grad_clip: must be a finite number > 0 .*or null .*got -1.0"),
        ("optimizer.grad_clip=0", r"optimizer.grad_clip: must be a finite number > 0"),
        ("optimizer.grad_clip=.nan", r"optimizer.grad_clip: must be a finite number > 0"),
        ("optimizer.lr=0", r"optimizer.lr: must be a finite number > 0"),
        ("optimizer.lr=-1e-4", r"optimizer.lr: must be a finite number > 0"),
        ("optimizer.lr=.inf", r"optimizer.lr: must be a finite number > 0"),
        ("stages.0.lr=-1e-3", r"stages\[0\].lr: must be a finite number > 0"),
        ("stages.0.lr=.nan", r"stages\[0\].lr: must be a finite number > 0"),
        ("optimizer.betas=[0.9, 1.0]", r"optimizer.betas\[1\]: must be in \[0, 1\)"),
        ("optimizer.betas=[-0.1, 0.999]", r"optimizer.betas\[0\]: must be in \[0, 1\)"),
        ("optimizer.betas=[0.9]", r"optimizer.betas: give two numbers"),
        ("optimizer.eps=0", r"optimizer.eps: must be a finite number > 0"),
        ("optimizer.weight_decay=-0.01", r"optimizer.weight_decay: must be a finite number ≥ 0"),
        ("optimizer.weight_decay=.nan", r"optimizer.weight_decay: must be a finite number ≥ 0"),
        ("schedule.warmup_steps=-1", r"schedule.warmup_steps: must be ≥ 0"),
        ("objective.flow_shift=0", r"objective.flow_shift: must be a finite number > 0"),
        ("objective.flow_shift=-3", r"objective.flow_shift: must be a finite number > 0"),
    ],
)
def test_optimizer_values_that_would_train_wrong_are_refused(override, expected):
    with pytest.raises(RecipeError, match=rf"--set {re.escape(override)}\): {expected}"):
        parse_recipe(GOOD, "r.yaml", [override])


@pytest.mark.parametrize(
    "override",
    ["optimizer.grad_clip=null", "optimizer.weight_decay=0", "objective.flow_shift=null", "optimizer.betas=[0.0, 0.5]"],
)
def test_optimizer_edge_values_are_accepted(override):
    parse_recipe(GOOD, "r.yaml", [override])
