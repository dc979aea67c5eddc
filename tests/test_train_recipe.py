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


# --- exact chunks against the window the conversion uses ------------------------------------------

TINY_LLAMA = Path(__file__).parent.parent / "recipes" / "tiny-llama.yaml"  # options: {chunk_size: 8, window: 4}


def _resolved(recipe):
    """The MHLAConfig the recipe's conversion resolves to on its model (on the meta device: no weights)."""
    from mhla_convert.convert import check_conversion
    from mhla_convert.models import resolve, source_meta_model

    c = recipe.conversion
    return check_conversion(source_meta_model(resolve(recipe.model.name)), ratio=c.ratio, strategy=c.strategy,
                            layers=c.layers, blocks=c.blocks, attention=c.attention, **c.options)


@pytest.mark.parametrize("overrides, exact, window", [
    ([], 2, 4),  # the family's default exact chunks, under the recipe's window
    (["conversion.options.exact_chunks=2"], 2, 4),
    (["conversion.options.exact_chunks=3"], 3, 4),
    (["conversion.options.exact_chunks=0"], 0, 4),
    (["conversion.options.window=9", "conversion.options.exact_chunks=8"], 8, 9),
])
def test_exact_chunks_below_the_recipes_window_are_accepted(overrides, exact, window):
    config = _resolved(load_recipe(TINY_LLAMA, overrides))
    assert (config.exact_chunks, config.window, config.causal) == (exact, window, True)


@pytest.mark.parametrize("override, expected", [
    ("conversion.options.exact_chunks=4", "exact_chunks=4 must be < window=4: .*set exact_chunks to at most 3 or "
     "window to at least 5"),
    ("conversion.options.exact_chunks=9", "exact_chunks=9 must be < window=4"),
    ("conversion.options.exact_radius=1", "exact_radius=1 is for non-causal models; llama is causal .*drop "
     "exact_radius"),
])
def test_exact_chunks_at_or_past_the_window_are_refused_at_their_line(override, expected):
    key = override.split("=")[0]
    with pytest.raises(RecipeError, match=rf"\(--set {re.escape(override)}\): {re.escape(key)}: {expected}"):
        load_recipe(TINY_LLAMA, [override])


def test_a_window_that_leaves_no_room_for_the_default_exact_chunks_is_refused_before_loading(monkeypatch):
    from mhla_convert import models
    from mhla_convert.train import TrainError
    from mhla_convert.train.build import build_model

    recipe = load_recipe(TINY_LLAMA, ["conversion.options.window=2"])  # llama's default exact_chunks is 2
    monkeypatch.setattr(models, "load_source", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(TrainError, match=r"conversion: exact_chunks=2 \(llama's default\) must be < window=2: .*"
                                         "set exact_chunks to at most 1 or window to at least 3"):
        build_model(recipe)
    assert _resolved(load_recipe(TINY_LLAMA, ["conversion.options.window=2", "conversion.options.exact_chunks=1"]))
    recipe = load_recipe(TINY_LLAMA, ["conversion.options.normalize=false"])  # a conflict with a default, too
    with pytest.raises(ValueError, match=r"exact_chunks=2 \(llama's default\) needs normalize=true.*exact_chunks=0"):
        _resolved(recipe)


def test_exact_chunks_on_a_non_causal_family_are_refused():
    with pytest.raises(RecipeError, match=r"conversion.options.exact_chunks: exact_chunks=1 is for causal models "
                                          r"\(LMs\); dit is not causal .*exact_radius: drop exact_chunks"):
        parse_recipe(GOOD + "conversion: {options: {exact_chunks: 1}}\n", "r.yaml")
    # a family not known before the model is: the given options alone, then the family's at conversion
    text = GOOD.replace("name: tiny-dit", "name: ./some/dir") + "conversion: {options: {exact_chunks: 1}}\n"
    parse_recipe(text, "r.yaml")
