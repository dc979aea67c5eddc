"""`mhla_convert.evaluate` / `mhla-convert eval` on tiny models, offline: determinism, the output
files, gaps, the LM metrics and the passkey probe, and one clear error for each kind of bad input."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import json
import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from typer.testing import CliRunner

from mhla_convert import convert, evaluate, save_pretrained, tiny_model
from mhla_convert.cli import app
from mhla_convert.evaluate import EvalError, image_metrics
from mhla_convert.evaluate import api as eval_api
from mhla_convert.evaluate import samples as eval_samples
from mhla_convert.evaluate.lm import MARKER_TOKENS, PASSKEY_TOKENS, passkey_accuracy, passkey_prompts

LM = dict(batch_size=2, num_batches=2, data_options={"context_length": 32}, passkey_lengths=())
DIFFUSION = dict(batch_size=2, num_batches=1, timesteps=4, samples=False)


def converted(name: str, **options) -> nn.Module:
    model = tiny_model(name)
    convert(model, **options)
    return model


@pytest.fixture(scope="module")
def llama_pair():
    # chunks of 8: a 32-token context spans more than the exact window of 2 chunks (within it, MHLA is the original)
    return converted("tiny-llama", chunk_size=8), tiny_model("tiny-llama")


@pytest.fixture(scope="module")
def dit_pair():
    return converted("tiny-dit"), tiny_model("tiny-dit")


# --- the numbers ---------------------------------------------------------------------------------


def test_two_runs_give_identical_results(dit_pair):
    first = evaluate(dit_pair[0], "synthetic", dit_pair[1], **DIFFUSION)
    assert first == evaluate(dit_pair[0], "synthetic", dit_pair[1], **DIFFUSION)


def test_lm_runs_are_deterministic_too(llama_pair):
    assert evaluate(llama_pair[0], "synthetic", **LM) == evaluate(llama_pair[0], "synthetic", **LM)


def test_a_model_against_itself_has_gap_exactly_zero(dit_pair):
    result = evaluate(dit_pair[0], "synthetic", dit_pair[0], **DIFFUSION)
    assert result["model"] == result["reference"]
    assert set(result["gap_percent"].values()) == {0.0}


def test_diffusion_loss_has_four_timestep_bands_and_the_mean(dit_pair):
    metrics = evaluate(dit_pair[1], "synthetic", **DIFFUSION)["model"]
    assert list(metrics) == ["loss", "loss_t0-250", "loss_t250-500", "loss_t500-750", "loss_t750-1000"]
    bands = [v for k, v in metrics.items() if k != "loss"]  # one timestep per band at timesteps=4
    assert metrics["loss"] == pytest.approx(sum(bands) / 4)


def test_fixed_timesteps_are_the_centres_of_equal_probability_strata():
    from mhla_convert.evaluate.loss import fixed_timesteps
    from mhla_convert.evaluate.objective import training_objective
    from mhla_convert.families import adapter_for_family
    from mhla_convert.train.recipe import ObjectiveSpec

    assert fixed_timesteps(training_objective(adapter_for_family("dit")), 4).tolist() == [125, 375, 625, 875]
    logit_normal = fixed_timesteps(training_objective(adapter_for_family("sana"),
                                                      ObjectiveSpec(timestep_sampling="logit_normal")), 8)
    assert logit_normal.tolist() == sorted(set(logit_normal.tolist()))  # distinct, in order
    assert all(abs(int(a) + int(b) - 999) <= 1 for a, b in zip(logit_normal, logit_normal.flip(0)))  # symmetric
    assert 400 < int(logit_normal[3]) < 500  # bunched around the middle, unlike [125, 375, …]


@pytest.mark.parametrize("pair", ["llama_pair", "dit_pair"])
def test_converted_model_scores_differently_from_its_base(pair, request):
    model, base = request.getfixturevalue(pair)
    options = LM if pair == "llama_pair" else DIFFUSION
    result = evaluate(model, "synthetic", base, **options)
    assert math.isfinite(result["model"]["loss"]) and math.isfinite(result["reference"]["loss"])
    assert result["model"]["loss"] != result["reference"]["loss"]
    assert result["gap_percent"]["loss"] != 0


def test_eval_leaves_the_model_in_its_mode_and_untouched(dit_pair):
    model = dit_pair[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    evaluate(model, "synthetic", **DIFFUSION)
    assert model.training
    model.eval()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_lm_perplexity_is_exp_of_the_loss(llama_pair):
    metrics = evaluate(llama_pair[1], "synthetic", **LM)["model"]
    assert metrics["perplexity"] == math.exp(metrics["loss"])
    assert metrics["bits_per_token"] == pytest.approx(metrics["loss"] / math.log(2))


def test_every_family_is_scored(tmp_path):
    for name in ("tiny-sana", "tiny-pixart", "tiny-wan", "tiny-wan-i2v"):
        result = evaluate(name, "synthetic", name, **DIFFUSION)
        assert result["meta"]["family"] in name and result["gap_percent"]["loss"] == 0.0


# --- passkey retrieval ----------------------------------------------------------------------------


def test_passkey_prompts_hide_the_key_after_the_marker():
    model = tiny_model("tiny-llama")
    prompts, keys = passkey_prompts(model, 64, trials=3, seed=0)
    assert prompts.shape == (3, 64 - PASSKEY_TOKENS) and keys.shape == (3, PASSKEY_TOKENS)  # the answer fills 64
    for prompt, key in zip(prompts, keys):
        marker = prompt[-MARKER_TOKENS:]
        starts = [i for i in range(len(prompt) - MARKER_TOKENS) if torch.equal(prompt[i : i + MARKER_TOKENS], marker)]
        assert len(starts) == 1 and torch.equal(prompt[starts[0] + MARKER_TOKENS :][:PASSKEY_TOKENS], key)
    assert torch.equal(prompts, passkey_prompts(model, 64, trials=3, seed=0)[0])
    assert not torch.equal(prompts, passkey_prompts(model, 64, trials=3, seed=1)[0])


class _Retriever(nn.Module):
    """Answers a passkey prompt perfectly: copies what followed the first occurrence of its last tokens."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(vocab_size=128, max_position_embeddings=256, pad_token_id=0)

    def generate(self, ids, max_new_tokens, **_):
        rows = []
        for row in ids:
            marker = row[-MARKER_TOKENS:]
            start = next(i for i in range(len(row)) if torch.equal(row[i : i + MARKER_TOKENS], marker))
            rows.append(torch.cat([row, row[start + MARKER_TOKENS :][:max_new_tokens]]))
        return torch.stack(rows)


def test_passkey_scores_a_perfect_retriever_1_and_skips_lengths_beyond_the_model():
    assert passkey_accuracy(_Retriever(), (64, 128, 1024), trials=4, seed=0) == {"passkey_64": 1.0, "passkey_128": 1.0}


def test_passkey_runs_on_tiny_llama(llama_pair):
    options = {**LM, "passkey_lengths": (64, 128, 10**6), "passkey_trials": 2}
    result = evaluate(llama_pair[0], "synthetic", llama_pair[1], **options)
    for side in ("model", "reference"):
        assert {k for k in result[side] if k.startswith("passkey")} == {"passkey_64", "passkey_128"}
        assert all(0.0 <= result[side][f"passkey_{n}"] <= 1.0 for n in (64, 128))
    assert result["meta"]["passkey_lengths"] == [64, 128]


# --- output ---------------------------------------------------------------------------------------


def test_eval_json_and_summary(dit_pair, tmp_path):
    out = tmp_path / "eval"
    result = evaluate(dit_pair[0], "synthetic", dit_pair[1], out_dir=out, **DIFFUSION)
    saved = json.loads((out / "eval.json").read_text())
    assert saved == result
    assert set(saved) == {"model", "reference", "gap_percent", "meta"}
    assert "loss" in saved["model"] and "loss" in saved["reference"]
    meta = saved["meta"]
    assert meta["family"] == "dit" and meta["num_examples"] == 2 and meta["seed"] == 0
    assert {"mhla_convert", "torch", "diffusers", "transformers"} <= set(meta["versions"])
    summary = (out / "summary.md").read_text()
    assert "| metric | model | reference | gap % |" in summary and "| loss |" in summary
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "summary.md"]  # no temporary files left


def test_no_reference_no_reference_key(dit_pair, tmp_path):
    evaluate(dit_pair[1], "synthetic", out_dir=tmp_path / "e", **DIFFUSION)
    assert set(json.loads((tmp_path / "e" / "eval.json").read_text())) == {"model", "meta"}


def test_a_previous_eval_is_replaced(dit_pair, tmp_path):
    (tmp_path / "eval.json").write_text("{}")
    (tmp_path / "summary.md").write_text("old")
    evaluate(dit_pair[1], "synthetic", out_dir=tmp_path, **DIFFUSION)
    assert "loss" in json.loads((tmp_path / "eval.json").read_text())["model"]


def test_latents_file_and_converted_checkpoint_directory(dit_pair, tmp_path):
    model, base = dit_pair
    save_pretrained(model, tmp_path / "ckpt")
    base.save_pretrained(tmp_path / "base")
    latents = tmp_path / "latents.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({"latents": torch.randn(5, 4, 16, 16, generator=g), "class_labels": torch.arange(5)}, str(latents))
    options = {**DIFFUSION, "batch_size": 2, "num_batches": 5}
    from_disk = evaluate(tmp_path / "ckpt", latents, tmp_path / "base", **{**options, "num_batches": 2})
    in_memory = evaluate(model, latents, base, **{**options, "num_batches": 2})
    assert from_disk["model"] == in_memory["model"] and from_disk["reference"] == in_memory["reference"]
    assert from_disk["meta"]["num_examples"] == 4
    everything = evaluate(model, latents, **options)["meta"]  # fewer examples than asked for: all of them
    assert everything["num_examples"] == 5 and everything["num_batches"] == 3
    assert from_disk["meta"]["data"] == {"kind": "latents", "path": str(latents)}


def test_synthetic_data_is_the_training_set(dit_pair):
    from mhla_convert.evaluate.data import data_spec, held_out
    from mhla_convert.families import adapter_for_family
    from mhla_convert.train.data import build_dataset
    from mhla_convert.train.recipe import DataSpec

    adapter = adapter_for_family("dit")
    trained_on = build_dataset(DataSpec(), adapter, dit_pair[1], seed=5, components=None).columns
    scored = held_out(data_spec("synthetic"), adapter, dit_pair[1], num_examples=6, seed=5, components=None)
    assert all(torch.equal(scored[k], trained_on[k][:6]) for k in trained_on)


def test_text_data_for_an_lm(llama_pair, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    options = {"context_length": 16, "cache_dir": str(tmp_path / "cache")}
    result = evaluate(llama_pair[0], corpus, llama_pair[1], **{**LM, "data_options": options})
    assert result["meta"]["data"]["kind"] == "text" and result["meta"]["num_examples"] == 4
    assert math.isfinite(result["model"]["loss"])


# --- diffusion samples (compare_samples lives in evaluate/samples.py) ------------------------------


def test_samples_are_compared_for_diffusion_with_a_reference(dit_pair, tmp_path, monkeypatch):
    calls = []

    def compare_samples(model, reference, *, family, out_dir, num_samples, seed, steps, device, base):
        calls.append(dict(family=family, out_dir=out_dir, num_samples=num_samples, seed=seed, steps=steps, base=base))
        return {"psnr": 30.0, "ssim": 0.9}

    monkeypatch.setattr(eval_samples, "compare_samples", compare_samples)
    options = {**DIFFUSION, "samples": None}
    result = evaluate(dit_pair[0], "synthetic", dit_pair[1], out_dir=tmp_path / "s", num_samples=2, sample_steps=3,
                      **options)
    assert calls == [dict(family="dit", out_dir=tmp_path / "s", num_samples=2, seed=0, steps=3, base="tiny-dit")]
    assert result["comparison"] == {"sample_psnr": 30.0, "sample_ssim": 0.9}
    evaluate(dit_pair[0], "synthetic", dit_pair[1], **DIFFUSION)  # samples=False
    evaluate(dit_pair[0], "synthetic", **{**DIFFUSION, "samples": None})  # no reference, nothing to compare
    assert len(calls) == 1


def test_clip_score_through_eval_from_a_local_clip_model(tmp_path):
    from test_eval_samples import _tiny_clip

    clip, out = _tiny_clip(tmp_path / "clip"), tmp_path / "eval"
    args = ["eval", "tiny-sana", "--reference", "tiny-sana", "--data", "synthetic", "--out", out, "--device", "cpu",
            "--batch-size", 1, "--num-batches", 1, "--timesteps", 1, "--metrics", "loss,clip", "--clip-model", clip]
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    comparison = json.loads((out / "eval.json").read_text())["comparison"]
    assert set(comparison) == {"sample_psnr", "sample_ssim", "sample_clip_score", "sample_clip_score_reference"}
    assert comparison["sample_clip_score"] == comparison["sample_clip_score_reference"]
    assert "sample_clip_score" in result.output


def test_fid_through_eval_scores_the_models_samples_against_the_references(tmp_path, monkeypatch):
    """FID's wiring, with torchmetrics' FrechetInceptionDistance stood in for (the real one needs torchmetrics,
    torch-fidelity and torchvision, which the tests do not install): the local weights file, normalised float
    [0, 1] images of (N, 3, H, W), the reference's samples as the real set and the model's as the generated one,
    and the metric's value in eval.json."""
    seen = {}

    class FrechetInceptionDistance:
        def __init__(self, feature, normalize, feature_extractor_weights_path):
            seen.update(feature=feature, normalize=normalize, weights=feature_extractor_weights_path, updates=[])

        def update(self, images, real):
            seen["updates"].append((real, images.clone()))

        def compute(self):
            (_, real), (_, fake) = seen["updates"]
            return (real.mean() - fake.mean()).square() + 1.0  # (never 0: a number only this stand-in gives)

    for name in ("torchmetrics", "torchmetrics.image", "torchmetrics.image.fid", "torch_fidelity"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # (what find_spec reports of it)
        module.FrechetInceptionDistance = FrechetInceptionDistance
        monkeypatch.setitem(sys.modules, name, module)
    weights = tmp_path / "pt_inception-2015-12-05-6726825d.pth"
    weights.write_bytes(b"\0")
    model = tiny_model("tiny-sana")
    convert(model, mixing_init="uniform")  # samples unlike the reference's
    drawn, draw = {}, eval_samples.draw_samples

    def recorded(adapter, transformer, *args, **kwargs):
        pipe, samples = draw(adapter, transformer, *args, **kwargs)
        drawn["model" if transformer is model else "reference"] = samples
        return pipe, samples

    monkeypatch.setattr(eval_samples, "draw_samples", recorded)
    result = evaluate(model, "synthetic", "tiny-sana", metrics=["fid"], fid_weights=weights, num_samples=2,
                      sample_steps=2, progress=False, out_dir=tmp_path / "eval", **{**DIFFUSION, "samples": True})
    assert (seen["feature"], seen["normalize"], seen["weights"]) == (2048, True, str(weights))
    assert [real for real, _ in seen["updates"]] == [True, False]
    (_, real), (_, fake) = seen["updates"]
    assert torch.equal(real, drawn["reference"].float()) and torch.equal(fake, drawn["model"].float())
    assert real.shape == fake.shape and real.shape[:2] == (2, 3) and real.dtype == torch.float32
    assert 0 <= min(real.min(), fake.min()) and max(real.max(), fake.max()) <= 1 and not torch.equal(real, fake)
    assert result["comparison"]["sample_fid"] == pytest.approx(((real.mean() - fake.mean()).square() + 1).item())


@pytest.mark.parametrize("options, message", [
    (dict(metrics=["fid"]), "the fid metric needs local weights, nothing is downloaded: give --fid-weights"),
    (dict(metrics=["clip"]), "the clip metric needs local weights, nothing is downloaded: give --clip-model"),
    (dict(metrics=["loss", "psnr"]), "unknown metric"),
    (dict(metrics=["clip"], clip_model="/nonexistent/clip"), "neither a local directory nor a model in the local"),
    (dict(metrics=["fid"], fid_weights="inception.pth", samples=False), "drop --no-samples or the metric"),
])
def test_learned_metrics_are_refused_before_any_model_loads(options, message, monkeypatch):
    monkeypatch.setattr(eval_api, "resolve_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(EvalError, match=message) as error:
        evaluate("tiny-sana", "synthetic", "tiny-sana", **{**DIFFUSION, "samples": None, **options})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("model, options, message", [
    ("tiny-dit", dict(metrics=["clip"], clip_model="CLIP"), "dit samples are class-conditional: drop clip"),
    ("tiny-sana", dict(metrics=["fid"], fid_weights="WEIGHTS", num_samples=1), "num_samples must be at least 2"),
    ("tiny-llama", dict(metrics=["clip"], clip_model="CLIP"), "the fid and clip metrics score compared samples"),
])
def test_learned_metrics_that_cannot_run_are_refused_before_scoring(model, options, message, tmp_path, monkeypatch):
    from test_eval_samples import _tiny_clip

    monkeypatch.setattr(image_metrics, "resolve_fid_weights", lambda path: path)
    monkeypatch.setattr(eval_api, "heldout_loss", lambda *a, **k: pytest.fail("scoring began"))
    options = {k: _tiny_clip(tmp_path / "clip") if v == "CLIP" else v for k, v in options.items()}
    with pytest.raises(EvalError, match=message):
        evaluate(model, "synthetic", model, **{**DIFFUSION, "samples": None, **options})


@pytest.mark.skipif(importlib.util.find_spec("torchmetrics") is not None, reason="needs torchmetrics absent")
def test_fid_without_its_packages_is_one_line(tmp_path):
    weights = tmp_path / "pt_inception-2015-12-05-6726825d.pth"
    weights.write_bytes(b"\0")
    with pytest.raises(EvalError, match=r"FID needs torchmetrics and torch_fidelity: pip install 'torchmetrics\[image"):
        evaluate("tiny-sana", "synthetic", "tiny-sana", metrics=["fid"], fid_weights=weights,
                 **{**DIFFUSION, "samples": None})


# --- one held-out loss, a progress bar ------------------------------------------------------------


def test_validation_and_eval_score_the_same_heldout_loss(llama_pair):
    """Fine-tuning's validation and eval share one held-out loss: the same batches give the same number."""
    from mhla_convert.evaluate.objective import training_objective
    from mhla_convert.families import adapter_for_model
    from mhla_convert.train.data import TensorData
    from mhla_convert.train.recipe import DataSpec
    from mhla_convert.train.validation import HeldOut

    model = llama_pair[0]
    adapter = adapter_for_model(model)
    data = TensorData(adapter.synthetic_data(model, DataSpec(kind="synthetic", context_length=32), 0))
    held = HeldOut(data, training_objective(adapter), batch_size=2, num_batches=2, seed=0)
    validation = held.loss(model, device="cpu", dtype=torch.float32)
    assert validation == evaluate(model, "synthetic", **LM)["model"]["loss"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_scoring_shows_progress_on_a_terminal_only(dit_pair, monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    evaluate(dit_pair[1], "synthetic", **DIFFUSION)
    assert "model loss" in sys.stderr.getvalue()
    monkeypatch.setattr(sys, "stderr", _Terminal())
    evaluate(dit_pair[1], "synthetic", progress=False, **DIFFUSION)
    assert sys.stderr.getvalue() == ""


# --- lm-eval-harness ---------------------------------------------------------------------------------


def test_lm_eval_tasks_through_its_python_api(llama_pair, monkeypatch):
    seen = {}

    class HFLM:
        def __init__(self, pretrained, tokenizer, batch_size):
            seen.update(model=pretrained, batch_size=batch_size, tokenizer=tokenizer)

    def simple_evaluate(model, tasks, limit, **seeds):
        seen.update(tasks=tasks, limit=limit, seeds=seeds)
        return {"results": {"hellaswag": {"alias": "hellaswag", "acc,none": 0.25, "acc_stderr,none": 0.01}}}

    lm_eval = types.ModuleType("lm_eval")
    lm_eval.__spec__ = importlib.machinery.ModuleSpec("lm_eval", None)
    lm_eval.simple_evaluate = simple_evaluate
    models, huggingface = types.ModuleType("lm_eval.models"), types.ModuleType("lm_eval.models.huggingface")
    huggingface.HFLM = HFLM
    for name, module in (("lm_eval", lm_eval), ("lm_eval.models", models), ("lm_eval.models.huggingface", huggingface)):
        monkeypatch.setitem(sys.modules, name, module)
    metrics = evaluate(llama_pair[1], "synthetic", tasks=["hellaswag"], task_limit=10, **LM)["model"]
    assert metrics["hellaswag/acc"] == 0.25 and not any("stderr" in k or "alias" in k for k in metrics)
    assert seen["tasks"] == ["hellaswag"] and seen["limit"] == 10 and seen["model"] is llama_pair[1]
    assert set(seen["seeds"].values()) == {0}


def test_tasks_without_lm_eval_are_one_clear_error(llama_pair, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # an import of lm_eval now fails
    with pytest.raises(EvalError, match=r"pip install 'mhla-convert\[eval\]'"):
        evaluate(llama_pair[1], "synthetic", tasks=["hellaswag"], **LM)


# --- bad input: one line naming the problem and the fix, nothing overwritten ----------------------


def _other_vocabulary() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2))


def _latents(tmp_path, **columns):
    path = tmp_path / "latents.safetensors"
    save_file(columns, str(path))
    return path


@pytest.mark.parametrize("case, message", [
    ("families", "is a llama model but the reference is a dit model"),
    ("vocabulary", r"different inputs \(vocab_size 128 vs 256\)"),
    ("latent shapes", r"different inputs \(in_channels 4 vs 12\)"),
    ("text for diffusion", "is text, but a dit model is scored on latents"),
    ("folder for an lm", "is an image/video folder, but a language model is scored on text"),
    ("wrong latents", r"latents of shape \(8, 16, 16\) do not fit this dit model"),
    ("missing columns", "missing class_labels"),
    ("token ids beyond the vocabulary", "token ids up to 500 but the model's vocabulary has 128"),
    ("empty data", "the dataset is empty"),
    ("missing data", "does not exist"),
    ("unknown data", "cannot tell what data"),
    ("unknown data option", "unknown data option"),
    ("zero batches", "num_batches must be at least 1"),
    ("unknown model", "cannot load the model"),
    ("samples for an lm", "sample comparison needs a diffusion model and a reference"),
])
def test_bad_input_is_one_clear_error(case, message, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "a"}\n')
    (tmp_path / "notes.txt").write_text("some text")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "weights.bin").write_bytes(b"\0")
    labels = torch.zeros(2, dtype=torch.long)
    calls = {
        "families": lambda: evaluate("tiny-llama", "synthetic", "tiny-dit", **LM),
        "vocabulary": lambda: evaluate("tiny-llama", "synthetic", _other_vocabulary(), **LM),
        "latent shapes": lambda: evaluate("tiny-wan", "synthetic", "tiny-wan-i2v", **DIFFUSION),
        "text for diffusion": lambda: evaluate("tiny-dit", tmp_path / "notes.txt", **DIFFUSION),
        "folder for an lm": lambda: evaluate("tiny-llama", folder, **LM),
        "wrong latents": lambda: evaluate(
            "tiny-dit", _latents(tmp_path, latents=torch.zeros(2, 8, 16, 16), class_labels=labels), **DIFFUSION),
        "missing columns": lambda: evaluate(
            "tiny-dit", _latents(tmp_path, latents=torch.zeros(2, 4, 16, 16)), **DIFFUSION),
        "token ids beyond the vocabulary": lambda: evaluate(
            "tiny-llama", _latents(tmp_path, input_ids=torch.full((2, 8), 500)), **LM),
        "empty data": lambda: evaluate(
            "tiny-dit", _latents(tmp_path, latents=torch.zeros(0, 4, 16, 16), class_labels=labels[:0]), **DIFFUSION),
        "missing data": lambda: evaluate("tiny-dit", tmp_path / "nowhere", **DIFFUSION),
        "unknown data": lambda: evaluate("tiny-dit", tmp_path / "odd", **DIFFUSION),
        "unknown data option": lambda: evaluate("tiny-llama", "synthetic", **{**LM, "data_options": {"context": 8}}),
        "zero batches": lambda: evaluate("tiny-dit", "synthetic", **{**DIFFUSION, "num_batches": 0}),
        "unknown model": lambda: evaluate("./no-such-model", "synthetic", **DIFFUSION),
        "samples for an lm": lambda: evaluate("tiny-llama", "synthetic", "tiny-llama", **{**LM, "samples": True}),
    }
    with pytest.raises(EvalError, match=message) as error:
        calls[case]()
    assert "\n" not in str(error.value)


def test_a_conversion_report_given_as_the_model_is_refused_in_one_line():
    """convert() returns its report, not the model: passing that on says so, rather than trying it as a path."""
    report = convert(tiny_model("tiny-dit"), progress=False)
    with pytest.raises(EvalError, match=r"the model must be a model \(nn.Module\), a name or a path; got "
                                        r"ConversionReport \(convert\(\) changes the model in place") as error:
        evaluate(report, "synthetic", **DIFFUSION)
    assert "\n" not in str(error.value)


def test_an_output_directory_holding_other_files_is_refused_untouched(tmp_path):
    (tmp_path / "model.safetensors").write_text("keep me")
    (tmp_path / "summary.md").write_text("keep me too")
    with pytest.raises(EvalError, match="already holds model.safetensors, not a previous evaluation"):
        evaluate("tiny-dit", "synthetic", out_dir=tmp_path, **DIFFUSION)
    assert (tmp_path / "model.safetensors").read_text() == "keep me"
    assert (tmp_path / "summary.md").read_text() == "keep me too"
    assert not (tmp_path / "eval.json").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(EvalError, match="is a file"):
        evaluate("tiny-dit", "synthetic", out_dir=tmp_path / "file", **DIFFUSION)


# --- the command line ------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_scores_a_converted_checkpoint_against_its_base(llama_pair, tmp_path):
    save_pretrained(llama_pair[0], tmp_path / "ckpt")
    out = tmp_path / "eval"
    args = ["eval", tmp_path / "ckpt", "--reference", "tiny-llama", "--data", "synthetic", "--out", out,
            "--batch-size", 2, "--num-batches", 1, "--passkey-lengths", "64", "--seed", 3, "--device", "cpu"]
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "eval.json").read_text())
    assert saved["meta"]["seed"] == 3 and saved["meta"]["model"] == str(tmp_path / "ckpt")
    for word in ("metric", "gap %", "loss", "perplexity", "bits_per_token", "passkey_64", f"wrote {out / 'eval.json'}"):
        assert word in result.output
    assert saved["model"]["loss"] != saved["reference"]["loss"]


@pytest.mark.parametrize("args, message", [
    (["eval", "tiny-llama", "--reference", "tiny-dit", "--data", "synthetic"], "reference is a dit model"),
    (["eval", "tiny-llama", "--data", "nowhere/at/all"], "does not exist"),
    (["eval", "tiny-llama", "--data", "synthetic", "--passkey-lengths", "a,b"], "--passkey-lengths must be comma-"),
    (["eval", "tiny-llama", "--data", "synthetic", "--dtype", "int3"], "dtype must be one of"),
])
def test_cli_errors_are_one_line_exit_2(args, message, tmp_path):
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert message in result.output and result.output.count("\n") == 1
    assert not (tmp_path / "out").exists()
