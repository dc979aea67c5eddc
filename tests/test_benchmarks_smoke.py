"""Smoke runs of the GPU benchmark scripts in their `--tiny` CPU mode: every configuration produces a row,
the numbers are consistent, and the LM benchmark's decoding loop drives the model exactly as generate() does."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def load(monkeypatch):
    """load("lm_generate") -> the benchmark script as a module."""

    def load(name):
        spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # (dataclasses look their module up)
        spec.loader.exec_module(module)
        return module

    return load


def test_lm_generate_tiny_matrix(load, tmp_path, capsys):
    lm = load("lm_generate")
    result = lm.main(["--tiny", "--out", str(tmp_path)])
    rows = result["rows"]
    keys = [(r["model"], r["variant"], r["prompt"], r["batch"]) for r in rows]
    assert sorted(keys) == sorted(itertools.product(["llama", "qwen3"], ["original", "mhla", "hybrid"], [64, 128],
                                                    [1, 8]))
    for r in rows:
        assert "error" not in r, r
        assert r["same_tokens_as_generate"] and r["max_logit_diff_vs_generate"] < 1e-5, r
        assert r["repeat_ok"] and r["compiled_while_measured"] == 0
        assert r["decode_steps"] == 7 and r["prefill_ms"] > 0 and r["decode_ms_per_step"] > 0
        assert r["decode_tok_s"] == pytest.approx(r["batch"] * 7 / r["decode_ms"] * 1e3)
        assert r["peak_gib"] is None and r["wall_over_gpu_profiler"] is None  # no GPU
        assert len(r["converted_layers"]) == {"original": 0, "mhla": 2, "hybrid": 1}[r["variant"]]
    cache = {(r["model"], r["variant"], r["prompt"], r["batch"]): r["cache_mib"] for r in rows}
    for model, batch in itertools.product(["llama", "qwen3"], [1, 8]):
        # a KV cache grows with the prompt; the MHLA state does not (its ring and summaries are fixed)
        assert cache[model, "original", 128, batch] > cache[model, "original", 64, batch]
        assert cache[model, "mhla", 128, batch] == cache[model, "mhla", 64, batch] > 0
        assert cache[model, "mhla", 64, 8] == pytest.approx(8 * cache[model, "mhla", 64, 1], rel=1e-3)

    saved = json.loads((tmp_path / "lm_generate.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["runs"][0]["command"] == f"python benchmarks/lm_generate.py --tiny --out {tmp_path}"
    table = capsys.readouterr().out.split("\n| model |")[1]
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == 24
    assert (tmp_path / "lm_generate.md").read_text().count("\n| llama |") == 12

    # a later run into the same directory replaces the rows it measures again and keeps the others
    lm.main(["--tiny", "--models", "qwen3", "--variants", "original", "--prompts", "64", "--batches", "1",
             "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "lm_generate.json").read_text())
    assert len(saved["runs"]) == 2 and len(saved["rows"]) == 24
    assert [r["run"] for r in saved["rows"] if (r["model"], r["variant"], r["prompt"], r["batch"])
            == ("qwen3", "original", 64, 1)] == [1]


def test_lm_generate_tiny_gemma3_and_qwen3_moe(load, tmp_path):
    """The families by name: Gemma 3 (sliding and global layers) and Qwen3-MoE, original and converted, each
    decoding as generate() does."""
    rows = load("lm_generate").main(["--tiny", "--models", "gemma3,qwen3-moe", "--variants", "original,mhla",
                                     "--prompts", "64", "--batches", "1", "--out", str(tmp_path)])["rows"]
    assert [(r["model"], r["variant"]) for r in rows] == [("gemma3", "original"), ("gemma3", "mhla"),
                                                          ("qwen3-moe", "original"), ("qwen3-moe", "mhla")]
    for r in rows:
        assert "error" not in r, r
        assert r["same_tokens_as_generate"] and r["max_logit_diff_vs_generate"] < 1e-5, r
    assert [len(r["converted_layers"]) for r in rows] == [0, 3, 0, 2]


def test_profiler_reading_runs(load):
    """The profiler path of the GPU run, on the CPU: no device intervals, so no GPU time."""
    assert load("lm_generate").profiled_gpu_ms(lambda: torch.ones(4).add_(1), cuda=False) is None


def test_lm_generate_compiled_step_traces_whole(load, tmp_path):
    """The decoding step of every variant traces as one graph (fullgraph=True) through the static cache: the
    benchmark's GPU path, with dynamo alone."""
    lm = load("lm_generate")
    rows = lm.main(["--tiny", "--compile", "eager", "--models", "llama", "--prompts", "64", "--batches", "2",
                    "--out", str(tmp_path)])["rows"]
    assert [r["variant"] for r in rows] == ["original", "mhla", "hybrid"]
    for r in rows:
        assert "error" not in r, r
        assert r["same_tokens_as_generate"] and r["max_logit_diff_vs_generate"] < 1e-5
        assert r["compiled_while_measured"] == 0


def test_lm_generate_records_a_failing_variant(load, tmp_path, monkeypatch):
    lm = load("lm_generate")
    build = lm.variant_model

    def variant_model(name, variant, *args):
        if variant == "hybrid":
            raise RuntimeError("conversion failed here")
        return build(name, variant, *args)

    monkeypatch.setattr(lm, "variant_model", variant_model)
    rows = lm.main(["--tiny", "--models", "llama", "--variants", "original,hybrid", "--prompts", "64",
                    "--batches", "1,2", "--out", str(tmp_path)])["rows"]
    failed = "RuntimeError: conversion failed here"
    assert [r.get("error") for r in rows] == [None, None, failed, failed]
    assert "conversion failed here" in (tmp_path / "lm_generate.md").read_text()


@pytest.mark.parametrize("argv", [["--tiny", "--variants", "mhla,sliding"], ["--tiny", "--prompts", "x"],
                                  ["--tiny", "--new-tokens", "1"], ["--tiny", "--mhla-option", "window"]])
def test_lm_generate_bad_arguments(load, argv, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        load("lm_generate").main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
@pytest.mark.parametrize("script", ["lm_generate", "wan_forward"])
def test_benchmarks_need_a_gpu_without_tiny(load, script, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        load(script).main(["--out", str(tmp_path)] if script == "lm_generate" else [])
    assert exit_.value.code == 2 and "--tiny" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--mode", "reduce-overhead"], ["--tiny", "--compile", "--mode", "reduce-overhead"]])
def test_wan_forward_mode_needs_compile_on_the_gpu(load, args, capsys):
    with pytest.raises(SystemExit) as exit_:
        load("wan_forward").main(args)
    assert exit_.value.code == 2 and "--mode needs --compile" in capsys.readouterr().err


def _table(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| variant")]


def test_wan_forward_tiny_compiled(load):
    """Wan: original, all layers (with and without the exact region) and the 2/3 hybrid, eager and compiled
    (fullgraph, traced by aot_eager)."""
    rows = _table(load("wan_forward").main(["--tiny", "--model", "wan", "--compile"]))
    assert [r[0].split(" ")[0] for r in rows] == ["original", "all", "all", "2"]
    assert "own block exact" in rows[1][0] and "no exact region" in rows[2][0]
    for name, eager, speedup, compiled, compiled_speedup, gain in rows:
        assert float(eager.removesuffix(" ms")) > 0 and float(compiled.removesuffix(" ms")) > 0
        assert gain.endswith("x") and speedup.endswith("x") and compiled_speedup.endswith("x")
    assert rows[0][2] == rows[0][4] == "1.00x"


def test_wan_forward_tiny_wan22_ti2v(load, capsys):
    """The Wan2.2-TI2V-5B shape's smoke run: 48 latent channels, the same variants; its 720p is its only size."""
    text = load("wan_forward").main(["--tiny", "--model", "wan2.2-ti2v"])
    assert "48 channels" in text and [r[0].split(" ")[0] for r in _table(text)] == ["original", "all", "all", "2"]
    with pytest.raises(SystemExit) as exit_:
        load("wan_forward").main(["--tiny", "--model", "wan2.2-ti2v", "--resolution", "720p"])
    assert exit_.value.code == 2 and "121x704x1280" in capsys.readouterr().err


def test_wan_forward_tiny_dit_compiled(load):
    """DiT: original and converted, eager and compiled, in alternating rounds."""
    rows = _table(load("wan_forward").main(["--tiny", "--model", "dit", "--compile"]))
    assert [r[0].split(" ")[0] for r in rows] == ["original", "MHLA"]
    assert all(float(r[3].removesuffix(" ms")) > 0 for r in rows) and rows[0][4] == "1.00x"


def test_wan_forward_tiny_flux_regional(load):
    """FLUX, whose forward reads img_ids on the host, compiles block by block: each model eager, then compiled."""
    text = load("wan_forward").main(["--tiny", "--model", "flux", "--compile", "--regional", "--repeats", "1"])
    rows = _table(text)
    assert "compile_repeated_blocks(fullgraph=True)" in text and len(rows) == 4
    assert all(float(r[1].removesuffix(" ms")) > 0 and float(r[3].removesuffix(" ms")) > 0 for r in rows)


@pytest.mark.parametrize("args", [["--tiny", "--regional"], ["--tiny", "--model", "dit", "--compile", "--regional"],
                                  ["--tiny", "--repeats", "0"]])
def test_wan_forward_refuses_regional_and_repeats_it_cannot_run(load, args, capsys):
    with pytest.raises(SystemExit) as exit_:
        load("wan_forward").main(args)
    assert exit_.value.code == 2 and ("--regional needs" in (err := capsys.readouterr().err) or "--repeats" in err)


def test_wan_forward_tiny_hunyuanvideo(load):
    """HunyuanVideo: original and every joint attention converted, over a 3x4x4 video token grid."""
    rows = _table(load("wan_forward").main(["--tiny", "--model", "hunyuanvideo"]))
    assert [r[0].split(",")[0] for r in rows] == ["original", "joint MHLA"] and "48 video + 8 text" in rows[0][0]
    assert all(float(r[1].removesuffix(" ms")) > 0 for r in rows) and rows[0][2] == "1.00x"


def test_wan_forward_tiny_qwen_image(load):
    """Qwen-Image: original and every joint attention converted, over an 8x8 image token grid."""
    rows = _table(load("wan_forward").main(["--tiny", "--model", "qwen-image"]))
    assert [r[0].split(",")[0] for r in rows] == ["original", "joint MHLA"] and "8x8 + 8 text" in rows[0][0]
    assert all(float(r[1].removesuffix(" ms")) > 0 for r in rows) and rows[0][2] == "1.00x"


def test_wan_forward_tiny_kernel_profile(load, capsys):
    """--kernels: every variant in each mode gets its total and its N busiest kernels (CPU ops with --tiny)."""
    load("wan_forward").main(["--tiny", "--model", "dit", "--compile", "--kernels", "2"])
    out = capsys.readouterr().out
    sections = [part.strip() for part in out.split("\n\n") if "of kernel time per forward" in part]
    heads = [part.splitlines()[0] for part in sections]  # "<variant>, <mode>: <ms> ms of kernel time per forward"
    assert [head.split(": ")[0].split(", ")[-1] for head in heads] == ["eager", "eager", "compiled", "compiled"]
    assert all(float(head.split(": ")[1].split(" ms")[0]) > 0 for head in heads)
    assert all(len(_table(part)) == 1 + 2 for part in sections)  # (its header row, then the 2 kernels)


@pytest.mark.parametrize("args, message", [
    (["--tiny", "--kernels", "-1"], "--kernels must be a count ≥ 0; got -1"),
    (["--model", "wan-layer", "--kernels", "3"], "without --compile, --kernels"),
])
def test_wan_forward_bad_kernel_counts(load, args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        load("wan_forward").main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_wan_forward_tiny_sana_records_a_compile_failure(load, monkeypatch):
    """SANA at two sizes, alternating rounds; a model that fails to compile is reported in its row, and the
    eager numbers stay."""
    wf = load("wan_forward")

    def broken(model, setup):
        def call(*args, **kwargs):
            raise RuntimeError("graph break | somewhere")
        return call

    monkeypatch.setattr(wf, "_compiled", broken)
    rows = _table(wf.main(["--tiny", "--model", "sana", "--compile"]))
    assert [r[0].split(" ")[:2] for r in rows] == [["1024", "px"]] * 2 + [["4096", "px"]] * 2
    for row in rows:
        assert float(row[1].removesuffix(" ms")) > 0
        assert row[3] == "failed: RuntimeError: graph break / somewhere" and row[4:] == ["-", "-"]


def test_fidelity_quick_runs_every_variant_and_writes_the_summary(load, tmp_path):
    """The fidelity benchmark's CPU smoke run: both miniatures, every variant, and the summary the docs read."""
    load("fidelity").main(["--quick", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "fidelity_summary.json").read_text())
    assert summary["dit"]["tokens"] >= 256
    lm, dit = summary["lm"]["variants"], summary["dit"]["variants"]
    assert {"full", "window", "linear", "softmax", "full-distill", "full-no-exact", "hybrid-auto", "full-hedgehog",
            "full-hedgehog-distill"} <= set(lm)
    assert {"full", "local", "linear", "softmax", "full-distill", "full-own-block", "full-no-exact"} <= set(dit)
    for row in (*lm.values(), *dit.values()):
        assert {"step0", "truncation", "transfer", "final"} <= set(row) and isinstance(row["final"], float)
    assert lm["full"]["truncation"] == lm["window"]["step0"] and dit["full"]["truncation"] == dit["local"]["step0"]
    assert lm["full-hedgehog"]["truncation"] == lm["window"]["step0"]  # (the same exact region, another φ)
    for size in ("half", "quarter"):  # finer chunks: each beside its own window
        assert lm[f"full-{size}"]["truncation"] == lm[f"local-{size}"]["step0"] != lm["window"]["step0"]
    for name in ("full-retrieval", "full-hedgehog-distill-retrieval"):  # beside the window with the same heads
        assert lm[name]["truncation"] == lm["local-retrieval"]["step0"] != lm["window"]["step0"]
    for name in ("full-retrieval-auto", "full-hedgehog-distill-retrieval-auto"):
        assert lm[name]["truncation"] == lm["local-retrieval-auto"]["step0"] != lm["window"]["step0"]
        chosen = json.loads((tmp_path / f"lm-{name}.json").read_text())["retrieval_heads"]  # recorded per layer
        assert chosen and all(heads for heads in chosen.values()), chosen
    assert lm["softmax"]["transfer"] is None and lm["linear"]["truncation"] is None
    assert set(summary["lm"]["recall"]) >= {"original", "window", "full"}
    levels = summary["dit"]["by_noise_level"]
    assert set(levels["full"]) == {"50", "150", "300", "450", "700", "900"} and levels["original"]["50"] == 0
    assert (tmp_path / "fidelity.md").read_text().count("| variant |") >= 3


def test_parallel_quick_runs_every_form_and_the_fsdp_step(tmp_path):
    """parallel.py's CPU smoke run (gloo, tiny Wan, world sizes 1 and 2, in processes of its own): every form's
    forward, the bytes it sends, and the FSDP2 step, in the JSON the docs read."""
    out = tmp_path / "parallel.json"
    command = [sys.executable, str(BENCHMARKS / "parallel.py"), "--quick", "--out", str(out),
               "--fsdp-variants", "mhla,hybrid,original"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert set(saved["wan_720p_mhla_ms"]) == set(saved["wan_720p_original_ms"]) == {"1", "2"}
    forms = saved["wan_720p_by_form"]["2"]
    assert set(forms) == {"original/ulysses", "mhla/ulysses", "mhla/ring"}
    assert all(row["ms"] > 0 and row["bytes_per_layer"] > 0 for row in forms.values())
    for key in ("fsdp_wan14b", "fsdp_wan14b_hybrid", "fsdp_wan14b_original"):
        assert saved[key]["ok"] is True and saved[key]["step_s"] > 0


def test_exact_blocks_tiles_sweeps_the_settings_in_use(load):
    """The launch sweep's candidates are distinct and hold the forward's settings in use (with the tiles they
    default to), so each run compares them; without CUDA it stops in one line."""
    tiles = load("exact_blocks_tiles")
    from mhla_convert.kernels import settings

    found = tiles.candidates()
    assert len(set(found)) == len(found)
    own = settings.SETTINGS.exact_blocks_forward[tiles.DIM]
    tokens = own.tokens or settings.SETTINGS.tile_tokens
    assert own._replace(tokens=tokens, keys=own.keys or tokens) in found
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            tiles.main([])


def test_fidelity_digits_from_the_copy_a_run_kept(load, tmp_path, monkeypatch):
    """Without scikit-learn the digits come from --out/digits.safetensors, or a one-line error says what to do."""
    fid = load("fidelity")
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # (import fails, as on a machine without it)
    copy = tmp_path / fid.DIGITS
    with pytest.raises(SystemExit, match="need scikit-learn"):
        fid.digits(False, 16, 0, copy)
    save_file({"images": torch.arange(3 * 64.0).view(3, 1, 8, 8) % 17, "labels": torch.tensor([4, 0, 9])}, str(copy))
    images, labels = fid.digits(False, 16, 0, copy)
    assert images.shape == (3, 1, 16, 16) and images.min() >= -1 and images.max() <= 1 and labels.tolist() == [4, 0, 9]


def test_fidelity_quick_joint_miniature(load, tmp_path):
    """`--kinds joint`: the MM-DiT miniature (text tokens carrying the class beside the image tokens, the pooled
    embedding the same for every class) through every variant, each region-sharing one beside its truncation and the
    others without one; --width and --batch-size size it."""
    load("fidelity").main(["--quick", "--kinds", "joint", "--width", "32", "--batch-size", "8", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "fidelity_summary.json").read_text())["joint"]
    variants = summary["variants"]
    assert summary["tokens"] == 64 and {"full", "local", "linear", "softmax", "full-distill", "full-own-block",
                                        "full-no-exact", "hybrid-auto", "full-text-summary",
                                        "linear-text-summary"} == set(variants)
    assert (variants["full"]["truncation"] == variants["full-distill"]["truncation"]
            == variants["full-text-summary"]["truncation"] == variants["local"]["step0"])
    assert variants["full-no-exact"]["truncation"] is variants["full-own-block"]["truncation"] is None
    assert all(isinstance(row["final"], float) for row in variants.values())
    train = load_file(str(tmp_path / "joint" / "data" / "train.safetensors"))
    assert (train["pooled_prompt_embeds"] == train["pooled_prompt_embeds"][:1]).all()
    assert len(train["prompt_embeds"].flatten(1).unique(dim=0)) > 1
    config = json.loads((tmp_path / "joint" / "base" / "best" / "config.json").read_text())
    assert config["attention_head_dim"] == 8


@pytest.mark.parametrize("kind", ["lm", "dit"])
def test_fidelity_seed_holds_out_another_tenth(load, tmp_path, kind):
    """--seed makes another miniature: the held-out rows change, and the same seed writes the same data."""
    fidelity = load("fidelity")

    def held_out(seed: int, name: str) -> torch.Tensor:
        directory = tmp_path / name
        directory.mkdir()
        if kind == "lm":
            fidelity.lm_data(directory, 64, 2_000, seed=seed)
        else:
            fidelity.dit_data(directory, True, 8, seed=seed)
        return load_file(str(directory / "heldout.safetensors"))["input_ids" if kind == "lm" else "latents"]

    first, again, other = held_out(0, "a"), held_out(0, "b"), held_out(3, "c")
    assert torch.equal(first, again) and not torch.equal(first[: len(other)], other[: len(first)])


def test_frontier_quick_fills_a_row_per_ratio(load, tmp_path):
    """The speed-quality frontier's CPU smoke run: a row per ratio with every column (both miniatures' gaps,
    Wan and LM speed-ups) filled, in frontier.json and frontier.md; a later run of one part keeps the others."""
    frontier = load("frontier")
    frontier.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "frontier.json").read_text())
    assert [row["ratio"] for row in saved["frontier"]] == [0.25, 0.5, 0.75, 1.0]
    keys = [f"{part}:{key}" for _, part, key in frontier.columns(saved)]
    assert len(keys) == 8 and not frontier.errors(saved)
    for row in saved["frontier"]:
        assert all(isinstance(row[key], float) for key in keys), row
        assert set(row["layers"]) == {"DiT", "LM", "Wan", "Llama"}
    for kind in ("lm", "dit"):  # strategy auto, 4 layers: 1, 2, 3, 4 of them
        ratios = saved["quality"][kind]["ratios"]
        assert [len(ratios[str(r)]["converted_layers"]) for r in frontier.RATIOS] == [1, 2, 3, 4]
        assert all(v["conversion"]["strategy"] == "auto" and v["step0"] is not None and v["transfer"] is not None
                   for v in ratios.values())
    command = f"python benchmarks/frontier.py --quick --out {tmp_path}"
    assert {part: env["command"] for part, env in saved["runs"].items()} == dict.fromkeys(["quality", "wan", "lm"],
                                                                                         command)
    assert all(env["gpu"] == "cpu" and env["dtype"] and env["torch"] and env["date"] for env in saved["runs"].values())
    table = [line for line in (tmp_path / "frontier.md").read_text().splitlines() if line.startswith("| ")]
    assert len(table) == 5 and all(len(line.split("|")) == 12 for line in table)
    assert "—" not in "".join(table[1:])
    assert [line.split(" | ")[:2] for line in table[1:]] == [
        [f"| {ratio}", f"DiT {n}/4, LM {n}/4, Wan {wan}/3, Llama {llama}/2"]
        for ratio, n, wan, llama in ((0.25, 1, 1, 0), (0.5, 2, 2, 1), (0.75, 3, 2, 2), (1.0, 4, 3, 2))]

    frontier.main(["--quick", "--parts", "wan", "--out", str(tmp_path)])
    again = json.loads((tmp_path / "frontier.json").read_text())
    assert again["quality"] == saved["quality"] and again["lm"] == saved["lm"]
    assert again["runs"]["wan"]["command"].endswith("--parts wan --out " + str(tmp_path))


def test_frontier_quick_joint_miniature_and_flux(load, tmp_path):
    """The joint families' frontier: the joint miniature's gaps beside FLUX's speed-ups, a row per ratio; ratios that
    convert as many layers train once and report the same numbers."""
    frontier = load("frontier")
    frontier.main(["--quick", "--kinds", "joint", "--parts", "quality,flux", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "frontier.json").read_text())
    assert [name for name, _, _ in frontier.columns(saved)] == ["Joint gap", "FLUX 1024²", "FLUX 2048²"]
    assert not frontier.errors(saved) and set(saved["runs"]) == {"quality", "flux"}
    for row in saved["frontier"]:
        assert all(isinstance(row[key], float) for key in ("quality:joint", "flux:1024²", "flux:2048²")), row
        assert set(row["layers"]) == {"Joint", "FLUX"}
    ratios = saved["quality"]["joint"]["ratios"]  # 1 dual- and 3 single-stream blocks: 1, 2, 3, 4 of them
    assert [len(ratios[str(r)]["converted_layers"]) for r in frontier.RATIOS] == [1, 2, 3, 4]
    assert [saved["flux"]["1024²"]["ratios"][str(r)]["converted_layers"] for r in frontier.RATIOS] == [1, 2, 2, 3]


def test_frontier_quick_family_speed_parts(load, tmp_path):
    """Qwen-Image, HunyuanVideo and Wan2.2 timed by ratio: a column each, every row filled, the layers each
    converts; without the quality part the table still names the miniatures they pair with."""
    frontier = load("frontier")
    frontier.main(["--quick", "--parts", "qwen-image,hunyuanvideo,wan2.2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "frontier.json").read_text())
    assert [name for name, _, _ in frontier.columns(saved)] == [
        "DiT gap", "Joint gap", "Qwen-Image 1328²", "HunyuanVideo 720p×129", "Wan2.2 720p"]
    assert not frontier.errors(saved) and set(saved["runs"]) == {"qwen-image", "hunyuanvideo", "wan2.2"}
    for row in saved["frontier"]:
        assert all(isinstance(row[key], float) for key in ("qwen-image:1328²", "hunyuanvideo:720p×129",
                                                           "wan2.2:720p")), row
        assert set(row["layers"]) == {"Qwen-Image", "HunyuanVideo", "Wan2.2"}
    layers = {part: [saved[part][shape]["ratios"][str(r)]["converted_layers"] for r in frontier.RATIOS]
              for part, shape in (("qwen-image", "1328²"), ("hunyuanvideo", "720p×129"), ("wan2.2", "720p"))}
    assert layers == {"qwen-image": [0, 1, 2, 2], "hunyuanvideo": [1, 2, 2, 3], "wan2.2": [1, 2, 2, 3]}


def test_frontier_trains_ratios_of_equal_layers_once(load, tmp_path, monkeypatch):
    """3 layers: ratios 0.5 and 0.75 both convert 2 of them, so one training serves both rows."""
    frontier = load("frontier")
    fid = frontier.fidelity
    trained = []
    curve = [{"step": 0, "stage": "finetune", "validation_loss": 1.0}]
    monkeypatch.setattr(fid, "write_data", lambda *a: None)
    monkeypatch.setattr(fid, "train_base", lambda *a: curve)
    monkeypatch.setattr(fid, "train_variant", lambda kind, name, *a: trained.append(name) or {
        "curve": curve, "converted_layers": [0] * {"auto-25": 1, "auto-50": 2, "auto-100": 3}[name],
        "sensitivity": None, "conversion": {}, "seconds": 0.0})
    args = fid.settle_training(argparse.Namespace(
        quick=False, kinds="joint", width=64, layers=3, batch_size=None, lm_heads="4/2", transfer_steps=0,
        finetune_steps=1, eval_every=1, base_steps=1, jobs=1, out=tmp_path))
    result = frontier.quality(args, lambda _: None)["joint"]
    assert trained == ["auto-25", "auto-50", "auto-100"] and result["layers"] == 3
    assert [len(result["ratios"][str(r)]["converted_layers"]) for r in frontier.RATIOS] == [1, 2, 2, 3]


@pytest.mark.parametrize("argv, message", [(["--quick", "--parts", "speed,sound"], "--parts"),
                                           (["--parts", "wan"], "need a CUDA GPU")])
def test_frontier_bad_arguments(load, argv, message, tmp_path, capsys):
    if "--quick" not in argv and torch.cuda.is_available():
        pytest.skip("checks the error without a GPU")
    with pytest.raises(SystemExit) as exit_:
        load("frontier").main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_frontier_records_a_failing_part_and_runs_the_others(load, tmp_path, monkeypatch):
    frontier = load("frontier")

    def broken(args, save):
        raise RuntimeError("out of memory | here")

    monkeypatch.setattr(frontier, "wan_speed", broken)
    with pytest.raises(SystemExit, match="failed: wan"):
        frontier.main(["--quick", "--parts", "speed", "--new-tokens", "3", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "frontier.json").read_text())
    assert saved["runs"]["wan"]["error"] == "RuntimeError: out of memory | here" and saved["wan"] is None
    assert all(isinstance(row["lm:decode:128"], float) for row in saved["frontier"])
    assert "wan: " in (text := (tmp_path / "frontier.md").read_text()) and "FAILED: RuntimeError" in text


def test_wan_forward_tiny_flux(load):
    """FLUX's smoke run: the original and the joint-MHLA conversion at two sizes."""
    rows = _table(load("wan_forward").main(["--tiny", "--model", "flux"]))
    assert [r[0].split(" ")[1] for r in rows] == ["original,", "joint", "original,", "joint"]
