"""strategy="auto": layers ranked by how much converting each alone changes the output."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from typer.testing import CliRunner

import mhla_convert
from mhla_convert.families import adapter_for_model
from mhla_convert.options import resolve_config
from mhla_convert.sensitivity import layer_sensitivity

CONVERT = importlib.import_module("mhla_convert.convert")  # the module (the package's `convert` is the function)
LM_OPTIONS = {"chunk_size": 8}  # several chunks in a 40-token calibration sequence


def lm_calibration(num_batches=2):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 128, (2, 40), generator=g)} for _ in range(num_batches)]


def dit_calibration(model, num_batches=2):
    torch.manual_seed(0)
    return [adapter_for_model(model).example_inputs(model, batch_size=2) for _ in range(num_batches)]


@torch.no_grad()
def sharp_llama(tiny, layer=2):
    """tiny-llama whose layer `layer` attends sharply and writes strongly: converting it hurts most."""
    model = tiny("tiny-llama").eval()
    attn = model.model.layers[layer].self_attn
    attn.q_proj.weight.mul_(20), attn.k_proj.weight.mul_(20), attn.o_proj.weight.mul_(10)
    return model


@torch.no_grad()
def sharp_dit(tiny, layer=3):
    model = tiny("tiny-dit").eval()
    attn = model.transformer_blocks[layer].attn1
    attn.to_q.weight.mul_(20), attn.to_k.weight.mul_(20), attn.to_out[0].weight.mul_(10)
    return model


def auto(model, ratio, calibration, **options):
    return mhla_convert.convert(model, ratio=ratio, strategy="auto", calibration=calibration, progress=False, **options)


def outputs(model, batches):
    with torch.no_grad():
        out = [model(**b) for b in batches]
    return [o.logits if hasattr(o, "logits") else o.sample for o in out]


def test_decisive_lm_layer_is_ranked_first_and_kept(tiny):
    model = sharp_llama(tiny)
    report = auto(model, 0.75, lm_calibration(), **LM_OPTIONS)
    assert sorted(report.sensitivity) == [0, 1, 2, 3]
    assert max(report.sensitivity, key=report.sensitivity.get) == 2
    assert report.converted == [0, 1, 3]
    assert report.strategy == "auto"
    table = str(report)
    assert "sensitivity" in table.splitlines()[1] and "softmax (kept)" in table


def test_decisive_diffusion_layer_is_ranked_first_and_kept(tiny):
    model = sharp_dit(tiny)
    report = auto(model, 0.75, dit_calibration(model))
    assert max(report.sensitivity, key=report.sensitivity.get) == 3
    assert 3 not in report.converted and len(report.converted) == round(0.75 * 6)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-dit"])
def test_scoring_leaves_the_model_unchanged(tiny, name):
    model = sharp_llama(tiny) if name == "tiny-llama" else sharp_dit(tiny)
    batches = lm_calibration() if name == "tiny-llama" else dit_calibration(model)
    adapter = adapter_for_model(model)
    adapter.prepare(model)  # installs the token-grid hook once; it does not change outputs
    before, modules = outputs(model, batches), list(adapter.attention_modules(model))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = resolve_config(adapter, model, **(LM_OPTIONS if adapter.causal else {}))
    scores = layer_sensitivity(model, batches, config, progress=False)
    assert len(scores) == len(modules)
    assert all(now is was for now, was in zip(adapter.attention_modules(model), modules))
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, batches), before))
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    assert not getattr(model, "mhla_plan", None)


def test_scores_are_deterministic(tiny):
    first = auto(sharp_llama(tiny), 0.5, lm_calibration(), **LM_OPTIONS)
    second = auto(sharp_llama(tiny), 0.5, lm_calibration(), **LM_OPTIONS)
    assert first.sensitivity == second.sensitivity and first.converted == second.converted


def test_auto_needs_calibration_data(tiny):
    with pytest.raises(ValueError, match="needs calibration data"):
        mhla_convert.convert(tiny("tiny-llama"), ratio=0.5, strategy="auto")
    with pytest.raises(ValueError, match="calibration is empty"):
        mhla_convert.convert(tiny("tiny-llama"), ratio=0.5, strategy="auto", calibration=iter([]))
    with pytest.raises(ValueError, match="ranks layers for strategy 'auto'"):
        mhla_convert.convert(tiny("tiny-llama"), ratio=0.5, exact_chunks=0, calibration=lm_calibration())


def test_saved_checkpoint_records_the_scores_and_reload_does_not_rescore(tiny, tmp_path, monkeypatch):
    model = sharp_llama(tiny)
    batches = lm_calibration()
    report = auto(model, 0.75, batches, **LM_OPTIONS)
    mhla_convert.save_pretrained(model, tmp_path / "ckpt")
    plan = json.loads((tmp_path / "ckpt" / "mhla_config.json").read_text())["plan"]
    assert plan["strategy"] == "auto" and plan["layers"] == [0, 1, 3]
    assert {int(i): s for i, s in plan["sensitivity"].items()} == report.sensitivity

    monkeypatch.setattr(CONVERT, "layer_sensitivity", lambda *a, **k: pytest.fail("a reload must not score again"))
    reloaded = mhla_convert.from_pretrained(tmp_path / "ckpt")
    assert reloaded.mhla_plan["strategy"] == "auto" and reloaded.mhla_plan["sensitivity"] == report.sensitivity
    assert reloaded.mhla_plan["layers"] == [0, 1, 3]
    assert all(torch.equal(a, b) for a, b in zip(outputs(reloaded, batches), outputs(model, batches)))


def test_checkpoints_without_strategy_or_scores_still_load(tiny, tmp_path):
    model = tiny("tiny-llama")
    mhla_convert.convert(model, ratio=0.5)
    mhla_convert.save_pretrained(model, tmp_path / "old")
    path = tmp_path / "old" / "mhla_config.json"
    meta = json.loads(path.read_text())
    meta["plan"] = {"num_layers": meta["plan"]["num_layers"], "layers": meta["plan"]["layers"]}
    path.write_text(json.dumps(meta))
    reloaded = mhla_convert.from_pretrained(tmp_path / "old")
    assert reloaded.mhla_plan["layers"] == model.mhla_plan["layers"]
    assert reloaded.mhla_plan["strategy"] is None and reloaded.mhla_plan["sensitivity"] is None
    ids = lm_calibration(1)
    assert torch.equal(outputs(reloaded, ids)[0], outputs(model, ids)[0])


def test_cli_auto_with_synthetic_calibration(tmp_path):
    from mhla_convert.cli import app

    runner = CliRunner()
    out = tmp_path / "llama-auto"
    result = runner.invoke(app, ["tiny-llama", "--ratio", "0.5", "--strategy", "auto", "--calibration", "synthetic",
                                 "--calibration-batches", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "sensitivity" in result.output
    plan = json.loads((out / "mhla_config.json").read_text())["plan"]
    assert plan["strategy"] == "auto" and len(plan["sensitivity"]) == 4 and len(plan["layers"]) == 2
    missing = runner.invoke(app, ["tiny-llama", "--strategy", "auto", "--out", str(tmp_path / "x")])
    assert missing.exit_code == 2 and "needs calibration data" in missing.output


def test_recipe_auto_draws_calibration_from_its_data_and_rebuilds_reuse_the_plan(monkeypatch):
    from mhla_convert.train import parse_recipe
    from mhla_convert.train.build import build_model

    recipe = parse_recipe(
        "model: {name: tiny-llama}\n"
        "conversion: {ratio: 0.5, strategy: auto, calibration_batches: 2, options: {chunk_size: 8}}\n"
        "data: {kind: synthetic, num_samples: 8, batch_size: 2, context_length: 16}\n"
        "stages: [{name: finetune, steps: 1}]\n", "r.yaml")
    built = build_model(recipe, teachers=False)
    assert sorted(built.report.sensitivity) == [0, 1, 2, 3] and len(built.converted) == 2
    assert built.model.mhla_plan["strategy"] == "auto"

    monkeypatch.setattr(CONVERT, "layer_sensitivity", lambda *a, **k: pytest.fail("rebuilds must reuse the plan"))
    rebuilt = build_model(recipe, teachers=False, plan=built.model.mhla_plan)
    assert rebuilt.converted == built.converted and rebuilt.model.mhla_plan["sensitivity"] == built.report.sensitivity


@pytest.mark.parametrize("others", [[[0, 2]], [[0, 2], [1, 2]]], ids=["agree", "differ"])
def test_recipe_auto_stops_every_process_when_their_choices_differ(others, monkeypatch):
    """Each process scores the layers on its own device: a run whose processes chose different layers stops on
    every process with the choices and the recipe line that fixes them (else each would train another model)."""
    import accelerate.utils
    from accelerate import PartialState

    from mhla_convert.train import TrainError, parse_recipe
    from mhla_convert.train.build import build_model

    recipe = parse_recipe(
        "model: {name: tiny-llama}\n"
        "conversion: {ratio: 0.5, strategy: auto, calibration_batches: 1, options: {chunk_size: 8}}\n"
        "data: {kind: synthetic, num_samples: 4, batch_size: 2, context_length: 16}\n"
        "stages: [{name: finetune, steps: 1}]\n", "r.yaml")
    gathered = []
    monkeypatch.setitem(PartialState()._shared_state, "num_processes", 1 + len(others))  # (this process: the main)
    monkeypatch.setattr(accelerate.utils, "gather_object",
                        lambda mine: gathered.append(mine) or [mine[0], *[[*o] for o in others]])
    monkeypatch.setattr(CONVERT, "layer_sensitivity", lambda *a, **k: {0: 0.1, 1: 0.9, 2: 0.2, 3: 0.8})
    if others[-1] == [0, 2]:
        assert build_model(recipe, teachers=False).converted == [0, 2]
    else:
        with pytest.raises(TrainError, match=r"process 0: \[0, 2\]; process 1: \[0, 2\]; process 2: \[1, 2\].*"
                                             r"conversion.layers: \[0, 2\]"):
            build_model(recipe, teachers=False)
    assert gathered == [[[0, 2]]]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-dit"])
def test_a_short_fit_before_scoring_brings_layers_closer_and_leaves_the_model_alone(tiny, name):
    model = sharp_llama(tiny) if name == "tiny-llama" else sharp_dit(tiny)
    batches = lm_calibration() if name == "tiny-llama" else dit_calibration(model)
    adapter = adapter_for_model(model)
    adapter.prepare(model)
    config = resolve_config(adapter, model, **(LM_OPTIONS if adapter.causal else {}))
    before = outputs(model, batches)
    plain = layer_sensitivity(model, batches, config, progress=False)
    fitted = layer_sensitivity(model, batches, config, fit_steps=10, fit_lr=1e-2, progress=False)
    assert sum(fitted.values()) < sum(plain.values())
    assert all(torch.equal(a, b) for a, b in zip(outputs(model, batches), before))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="fit_steps only"):
        mhla_convert.convert(model, ratio=0.5, fit_steps=2)


def test_a_converted_model_is_not_scored(tiny):
    model = tiny("tiny-llama")
    mhla_convert.convert(model, ratio=0.5)
    adapter = adapter_for_model(model)
    with pytest.raises(ValueError, match="unconverted model"):
        layer_sensitivity(model, lm_calibration(1), resolve_config(adapter, model), progress=False)
