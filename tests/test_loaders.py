"""Converted models through the libraries' own loaders: transformers' Auto classes, diffusers
pipelines; outputs identical after each round trip, or a loud error naming mhla-convert."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from mhla_convert import convert, from_pretrained, mhla_layers, save_pretrained
from mhla_convert.families import adapter_for_model
from mhla_convert.io import FORMAT_VERSION, mhla_metadata
from mhla_convert.locations import MHLA_CONFIG
from mhla_convert.train.components import pipeline

ROOT = Path(__file__).resolve().parents[1]
LMS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
GRIDS = {"tiny-sana": (7, 9), "tiny-dit": (6, 6), "tiny-wan": (3, 4, 5), "tiny-pixart": (7, 9)}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _sample(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def _lm(tiny, name="tiny-llama"):
    model = tiny(name)
    convert(model, ratio=0.5)
    return model, torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", LMS)
def test_auto_model_reloads_a_converted_lm_and_its_own_save(tiny, tmp_path, name):
    model, ids = _lm(tiny, name)
    expected = _logits(model, ids)
    loaded = AutoModelForCausalLM.from_pretrained(save_pretrained(model, tmp_path / "ckpt"))
    assert type(loaded) is type(model) and type(model).__name__ == "MHLA" + type(tiny(name)).__name__
    assert loaded.mhla_plan["layers"] == model.mhla_plan["layers"]
    assert torch.equal(_logits(loaded, ids), expected)
    loaded.save_pretrained(tmp_path / "resaved")  # transformers' save of the reloaded model
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "resaved"), ids), expected)
    assert torch.equal(_logits(from_pretrained(tmp_path / "resaved"), ids), expected)


def test_transformers_sharded_save_replaces_an_earlier_save_and_reloads(tiny, tmp_path):
    model, ids = _lm(tiny)
    expected = _logits(model, ids)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors"))
    assert len(shards) > 1 and all(name.startswith("mhla_model-") for name in shards)
    model.save_pretrained(tmp_path / "ckpt")  # one file now: the shards go
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors*")) == [
        "mhla_model.safetensors", "mhla_model.safetensors.index.json"]
    for load in (AutoModelForCausalLM.from_pretrained, from_pretrained):
        assert torch.equal(_logits(load(tmp_path / "ckpt"), ids), expected)


def test_the_base_class_refuses_a_converted_lm(tiny, tmp_path):
    """transformers' stock classes, after `import mhla_convert`, say what the folder is and what loads it, rather
    than miss its weights or (format 2, weights under transformers' own name) load softmax layers."""
    model, _ = _lm(tiny)
    path = save_pretrained(model, tmp_path / "ckpt")
    base = type(tiny("tiny-llama"))
    with pytest.raises(OSError, match=r"ckpt is an MHLA checkpoint \(converted by mhla-convert\), which "
                                      "LlamaForCausalLM's own loader would not load as converted: load it with "
                                      "AutoModelForCausalLM.from_pretrained or MHLALlamaForCausalLM.from_pretrained"):
        base.from_pretrained(path)
    with pytest.raises(OSError, match="which LlamaModel's own loader .* AutoModel.from_pretrained or MHLALlamaModel"):
        type(tiny("tiny-llama").model).from_pretrained(path)
    (path / "mhla_model.safetensors").rename(path / "model.safetensors")  # format 2's name
    with pytest.raises(OSError, match="is an MHLA checkpoint"):
        base.from_pretrained(path)
    base_path = tmp_path / "base"
    tiny("tiny-llama").save_pretrained(base_path)
    assert type(base.from_pretrained(base_path)) is base  # a base model loads as ever


def test_a_base_diffusers_class_refuses_a_converted_transformer(tiny, tmp_path):
    model = tiny("tiny-dit")
    convert(model, ratio=0.5)
    pipeline("dit", model, "tiny-dit").save_pretrained(tmp_path / "pipe")
    base = diffusers.DiTTransformer2DModel
    for args in (dict(subfolder="transformer"), {}):
        with pytest.raises(OSError, match=r"pipe is an MHLA checkpoint .*which DiTTransformer2DModel's own loader "
                                          r"would not load as converted: load it with "
                                          r"MHLADiTTransformer2DModel.from_pretrained or its pipeline's"):
            base.from_pretrained(tmp_path / "pipe", **args)
    assert type(type(model).from_pretrained(tmp_path / "pipe", subfolder="transformer")) is type(model)


def test_a_base_class_refuses_a_converted_lm_on_the_hub(tiny, tmp_path):
    """On the Hub, once transformers' loader has missed its weights (offline here: the repo in the hub cache)."""
    model, _ = _lm(tiny)
    model.save_pretrained(tmp_path / "saved")
    snapshot = tmp_path / "cache" / "models--me--lm-mhla" / "snapshots" / ("0" * 40)
    shutil.copytree(tmp_path / "saved", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    with pytest.raises(OSError, match="me/lm-mhla is an MHLA checkpoint"):
        type(tiny("tiny-llama")).from_pretrained("me/lm-mhla", cache_dir=tmp_path / "cache", local_files_only=True)
    with pytest.raises(OSError) as error:  # another repo: transformers' own error
        type(tiny("tiny-llama")).from_pretrained("me/elsewhere", cache_dir=tmp_path / "cache", local_files_only=True)
    assert "MHLA" not in str(error.value)


def test_lm_checkpoints_of_format_2_keep_loading(tiny, tmp_path):
    """Format 2 saved LM weights as transformers' own model.safetensors."""
    model, ids = _lm(tiny)
    expected = _logits(model, ids)
    path = save_pretrained(model, tmp_path / "ckpt")
    (path / "mhla_model.safetensors").rename(path / "model.safetensors")
    (path / "mhla_model.safetensors.index.json").unlink()
    for name in ("config.json", MHLA_CONFIG):
        data = json.loads((path / name).read_text())
        (data["mhla"] if name == "config.json" else data)["format_version"] = 2
        (path / name).write_text(json.dumps(data))
    for load in (AutoModelForCausalLM.from_pretrained, from_pretrained):
        assert torch.equal(_logits(load(path), ids), expected)


def test_transformers_save_of_tied_embeddings_reloads_through_mhla_convert(tmp_path):
    """transformers stores a tied lm_head only as the embedding; the strict loader restores the tie."""
    from mhla_convert.families import adapter_for_family

    adapter = adapter_for_family("llama")
    torch.manual_seed(0)
    model = adapter.build({**adapter.tiny_configs()["tiny-qwen2"], "tie_word_embeddings": True}).eval()
    convert(model, ratio=0.5)
    model.save_pretrained(tmp_path / "tied")
    ids = torch.randint(0, 128, (2, 24))
    for loaded in (from_pretrained(tmp_path / "tied"), AutoModelForCausalLM.from_pretrained(tmp_path / "tied")):
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_auto_model_refuses_weights_that_do_not_match_the_plan(tiny, tmp_path):
    model, _ = _lm(tiny)
    path = save_pretrained(model, tmp_path / "ckpt")
    weights = load_file(path / "mhla_model.safetensors")
    dropped = next(k for k in weights if k.endswith("mixing"))
    save_file({k: v for k, v in weights.items() if k != dropped}, path / "mhla_model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match its MHLA plan.*mixing"):
        AutoModelForCausalLM.from_pretrained(path)


def _run_python(code: str, tmp_path: Path, *, block_mhla: bool) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that never imports mhla_convert itself; with `block_mhla` it
    cannot import it at all, as where mhla-convert is not installed."""
    block = textwrap.dedent("""
        import importlib.abc, sys

        class NotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "mhla_convert":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NotInstalled())
    """) if block_mhla else ""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    return subprocess.run([sys.executable, "-c", block + textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_without_mhla_convert_the_stock_loaders_fail_loudly(tiny, tmp_path):
    model, _ = _lm(tiny)
    lm = save_pretrained(model, tmp_path / "lm")
    dit = tiny("tiny-dit")
    convert(dit, ratio=0.5)
    pipe = tmp_path / "pipe"
    pipeline("dit", dit, "tiny-dit").save_pretrained(pipe)
    result = _run_python(f"""
        import json, diffusers, transformers

        def error(load):
            try:
                load()
            except Exception as e:
                return f"{{type(e).__name__}}: {{e}}"
            return "loaded"

        auto = transformers.AutoModelForCausalLM.from_pretrained
        errors = {{
            "untrusted": error(lambda: auto({str(lm)!r})),
            "trusted": error(lambda: auto({str(lm)!r}, trust_remote_code=True)),
            "lm base class": error(lambda: transformers.LlamaForCausalLM.from_pretrained({str(lm)!r})),
            "pipeline": error(lambda: diffusers.DiffusionPipeline.from_pretrained({str(pipe)!r})),
            "family pipeline": error(lambda: diffusers.DiTPipeline.from_pretrained({str(pipe)!r})),
            "base class": error(lambda: diffusers.DiTTransformer2DModel.from_pretrained({str(pipe)!r},
                                                                                      subfolder="transformer")),
        }}
        print("ERRORS", json.dumps(errors))
    """, tmp_path, block_mhla=True)
    assert result.returncode == 0 and "ERRORS" in result.stdout, result.stdout + result.stderr
    lines = json.loads(result.stdout.split("ERRORS", 1)[1])
    assert "trust_remote_code=True" in lines["untrusted"]  # transformers' refusal; trusting leads on to:
    assert lines["trusted"].startswith("ImportError") and "pip install -U mhla-convert" in lines["trusted"]
    for key in ("pipeline", "family pipeline"):
        assert "import mhla_convert.diffusers_models" in lines[key], lines[key]
    assert "no file named diffusion_pytorch_model" in lines["base class"]  # rather than softmax attention
    assert "no file named model.safetensors" in lines["lm base class"]  # rather than random q/k/v/o


def test_trust_remote_code_loads_a_converted_lm_in_a_process_that_did_not_import_mhla_convert(tiny, tmp_path):
    model, ids = _lm(tiny, "tiny-qwen3")
    path = save_pretrained(model, tmp_path / "lm")
    torch.save({"ids": ids, "logits": _logits(model, ids)}, tmp_path / "expected.pt")
    result = _run_python(f"""
        import sys, torch, transformers

        expected = torch.load({str(tmp_path / "expected.pt")!r})
        model = transformers.AutoModelForCausalLM.from_pretrained({str(path)!r}, trust_remote_code=True)
        with torch.no_grad():
            same = torch.equal(model(expected["ids"]).logits, expected["logits"])
        print(type(model).__name__, "mhla_convert" in sys.modules, same)
    """, tmp_path, block_mhla=False)
    assert result.stdout.split() == ["MHLAQwen3ForCausalLM", "True", "True"], result.stdout + result.stderr


def test_importing_mhla_convert_is_all_diffusers_needs_in_a_fresh_process(tiny, tmp_path):
    """Diffusers loads a component library only once it is imported: `import mhla_convert` must do it."""
    dit = tiny("tiny-dit")
    convert(dit, ratio=0.5)
    pipeline("dit", dit, "tiny-dit").save_pretrained(tmp_path / "pipe")
    result = _run_python(f"""
        import mhla_convert, diffusers
        pipe = diffusers.DiffusionPipeline.from_pretrained({str(tmp_path / "pipe")!r})
        print(type(pipe.transformer).__name__, len(mhla_convert.mhla_layers(pipe.transformer)))
    """, tmp_path, block_mhla=False)
    expected = [type(dit).__name__, str(len(mhla_layers(dit)))]
    assert result.stdout.split() == expected, result.stdout + result.stderr


def _images(adapter, pipe, name):
    return adapter.generate(pipe, name, generator=torch.Generator().manual_seed(0), steps=2, output_type="np",
                            prompt="a red cube")


@pytest.mark.parametrize("name", ["tiny-sana", "tiny-dit", "tiny-wan"])
def test_a_saved_pipeline_reloads_its_converted_transformer(tiny, tmp_path, name):
    model = tiny(name)
    convert(model, ratio=0.5)
    adapter = adapter_for_model(model)
    pipe = pipeline(adapter.name, model, name)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(tmp_path / "pipe")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["transformer"] == ["mhla_convert.diffusers_models", type(model).__name__]
    torch.manual_seed(0)
    inputs = adapter.example_inputs(model, GRIDS[name], 2)
    expected = _sample(model, inputs)
    family_pipeline = getattr(diffusers, adapter.pipeline_class)
    loaded = {
        "DiffusionPipeline": diffusers.DiffusionPipeline.from_pretrained(tmp_path / "pipe").transformer,
        adapter.pipeline_class: family_pipeline.from_pretrained(tmp_path / "pipe").transformer,
        "class": type(model).from_pretrained(tmp_path / "pipe", subfolder="transformer"),
    }
    for how, transformer in loaded.items():
        assert type(transformer) is type(model), how
        assert torch.equal(_sample(transformer, inputs), expected), how
    if name != "tiny-wan":  # a video pipeline run is slow on CPU; its transformer is checked above
        reloaded = diffusers.DiffusionPipeline.from_pretrained(tmp_path / "pipe")
        reloaded.set_progress_bar_config(disable=True)
        assert np.array_equal(_images(adapter, reloaded, name), _images(adapter, pipe, name))


def test_converted_transformer_refuses_loader_options_it_would_ignore(tiny, tmp_path):
    model = tiny("tiny-dit")
    convert(model, ratio=0.5)
    path = save_pretrained(model, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="variant='fp16'"):
        type(model).from_pretrained(path, variant="fp16")
    with pytest.raises(ValueError, match="one device"):
        type(model).from_pretrained(path, device_map="auto")
    with pytest.raises(ValueError, match="variant='fp16'"):
        model.save_pretrained(tmp_path / "other", variant="fp16")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-wan"])
def test_checkpoints_of_format_1_keep_loading(tiny, run_model, tmp_path, name):
    """Format 1 kept the base model's own config in config.json and no loader files: written here as
    that version's save_pretrained wrote it."""
    model = tiny(name)
    adapter = adapter_for_model(model)
    base_config = adapter.model_config(model)
    convert(model, ratio=0.5)
    old = tmp_path / "old"
    save_pretrained(model, old)
    (old / "config.json").write_text(json.dumps(base_config, indent=2, sort_keys=True))
    (old / "mhla_loader.py").unlink(missing_ok=True)
    meta = {**mhla_metadata(model), "format_version": 1}
    (old / MHLA_CONFIG).write_text(json.dumps(meta, indent=2))
    assert "MHLA" not in (old / "config.json").read_text()
    torch.manual_seed(0)
    inputs = adapter.example_inputs(model, GRIDS.get(name, (16,)), 2)
    reloaded = from_pretrained(old)
    assert type(reloaded) is type(model)
    assert torch.equal(run_model(reloaded, inputs), run_model(model, inputs))
    save_pretrained(reloaded, tmp_path / "new")  # re-saving writes the current format
    assert json.loads((tmp_path / "new" / MHLA_CONFIG).read_text())["format_version"] == FORMAT_VERSION


def test_cli_writes_a_pipeline_from_a_pipeline_directory(tiny, tmp_path):
    from typer.testing import CliRunner

    from mhla_convert.cli import app

    source = tmp_path / "source"
    pipe = pipeline("sana", tiny("tiny-sana"), "tiny-sana")
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(source)
    result = CliRunner().invoke(app, [str(source), "--pipeline", "--ratio", "0.5", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in source.iterdir())
    for part in ("vae", "text_encoder", "tokenizer", "scheduler"):  # copied file for file
        for file in (source / part).iterdir():
            assert (out / part / file.name).read_bytes() == file.read_bytes()
    loaded = diffusers.DiffusionPipeline.from_pretrained(out)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded).__name__ == "SanaPipeline" and loaded.transformer.mhla_plan["layers"] == [1, 3, 5]
    converted = from_pretrained(out)  # mhla-convert's loader finds the transformer in a pipeline directory
    torch.manual_seed(0)
    inputs = adapter_for_model(converted).example_inputs(converted, GRIDS["tiny-sana"], 2)
    assert torch.equal(_sample(loaded.transformer, inputs), _sample(converted, inputs))
    adapter = adapter_for_model(converted)
    assert _images(adapter, loaded, "tiny-sana").shape[-1] == 3  # the whole pipeline runs


def test_cli_pipeline_needs_a_pipeline_source(tiny, tmp_path):
    from typer.testing import CliRunner

    from mhla_convert.cli import app

    tiny("tiny-dit").save_pretrained(tmp_path / "bare")  # a transformer folder, no model_index.json
    for source in (str(tmp_path / "bare"), "tiny-llama"):
        result = CliRunner().invoke(app, [source, "--pipeline", "--out", str(tmp_path / "out")])
        assert result.exit_code == 2 and "--pipeline" in result.output, result.output
    assert not (tmp_path / "out").exists()


def _serve_as_hub_repo(monkeypatch, repo: Path, cache: Path) -> None:
    """diffusers' hub download, served from the local folder `repo` (file listing, model_index.json, then
    `snapshot_download` with diffusers' own allow and ignore patterns) into `cache`."""
    from types import SimpleNamespace

    from diffusers.pipelines import pipeline_utils
    from huggingface_hub.utils import filter_repo_objects

    files = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())

    def fetch(names):
        for name in names:
            (cache / name).parent.mkdir(parents=True, exist_ok=True)
            (cache / name).write_bytes((repo / name).read_bytes())

    def hf_hub_download(repo_id, filename, **kwargs):
        fetch([filename])
        return str(cache / filename)

    def snapshot_download(repo_id, *, allow_patterns=None, ignore_patterns=None, **kwargs):
        fetch(filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        return str(cache)

    monkeypatch.setattr(pipeline_utils, "_resolve_revision", lambda *args, **kwargs: "main")
    monkeypatch.setattr(pipeline_utils, "model_info", lambda *args, **kwargs: SimpleNamespace(
        siblings=[SimpleNamespace(rfilename=name) for name in files]))
    monkeypatch.setattr(pipeline_utils, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(pipeline_utils, "snapshot_download", snapshot_download)


def test_a_pipeline_on_the_hub_loads_by_repo_id(tiny, tmp_path, monkeypatch):
    """What diffusers downloads of a pushed pipeline (its allow patterns) is enough to load it converted."""
    model = tiny("tiny-dit")
    convert(model, ratio=0.5)
    pipe = pipeline("dit", model, "tiny-dit")
    pipe.save_pretrained(tmp_path / "repo")
    _serve_as_hub_repo(monkeypatch, tmp_path / "repo", tmp_path / "cache")
    torch.manual_seed(0)
    inputs = adapter_for_model(model).example_inputs(model, GRIDS["tiny-dit"], 2)
    for loader in (diffusers.DiffusionPipeline, diffusers.DiTPipeline):
        loaded = loader.from_pretrained("me/dit-mhla").transformer
        assert type(loaded) is type(model)
        assert torch.equal(_sample(loaded, inputs), _sample(model, inputs))


def test_an_lm_on_the_hub_loads_by_repo_id(tiny, tmp_path):
    """transformers' hub path (a repo in the hub cache, offline) finds the converted weights by their index."""
    model, ids = _lm(tiny)
    model.save_pretrained(tmp_path / "saved", max_shard_size="100KB")
    snapshot = tmp_path / "cache" / "models--me--lm-mhla" / "snapshots" / ("0" * 40)
    shutil.copytree(tmp_path / "saved", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    loaded = AutoModelForCausalLM.from_pretrained("me/lm-mhla", cache_dir=tmp_path / "cache", local_files_only=True)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


# --- one numeric policy in a lower precision -------------------------------------------------------------


def _dtypes(model) -> dict[str, torch.dtype]:
    return {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_both_lm_loaders_agree_in_a_lower_precision(tiny, tmp_path, name, dtype):
    """mhla-convert's loader and transformers' give one model: mixing and RoPE inv_freq kept in float32."""
    model, ids = _lm(tiny, name)
    path = save_pretrained(model, tmp_path / "ckpt")
    ours, theirs = from_pretrained(path, torch_dtype=dtype), AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    assert _dtypes(ours) == _dtypes(theirs)
    kept = {k for k, v in _dtypes(ours).items() if v == torch.float32}
    assert kept == {k for k in kept if k.endswith(("mixing", "inv_freq"))} and any(k.endswith("mixing") for k in kept)
    assert torch.equal(_logits(ours, ids), _logits(theirs, ids))


def test_an_unconverted_plan_in_bf16_is_its_base_model(tiny, tmp_path):
    """A checkpoint of no converted layers is its base model, loaded in bf16 by either library: no gap in eval."""
    from mhla_convert import evaluate
    from mhla_convert.models import load_model

    tiny("tiny-llama").save_pretrained(tmp_path / "base")
    model = load_model(str(tmp_path / "base"))
    convert(model, layers=[])
    path = save_pretrained(model, tmp_path / "ckpt")
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    base = load_model(str(tmp_path / "base"), torch_dtype=torch.bfloat16)
    assert torch.equal(_logits(from_pretrained(path, torch_dtype=torch.bfloat16), ids), _logits(base, ids))
    result = evaluate(path, "synthetic", reference=tmp_path / "base", dtype="bf16", batch_size=2, num_batches=1,
                      passkey_lengths=())
    assert result["model"]["loss"] == result["reference"]["loss"]


def test_a_converted_transformer_loads_alike_in_bf16(tiny, tmp_path):
    """Diffusers' loaders of a converted transformer are mhla-convert's: one model, mixing kept in float32."""
    model = tiny("tiny-dit")
    convert(model, ratio=0.5)
    pipeline("dit", model, "tiny-dit").save_pretrained(tmp_path / "pipe")
    loaded = {
        "mhla_convert": from_pretrained(tmp_path / "pipe", torch_dtype=torch.bfloat16),
        "class": type(model).from_pretrained(tmp_path / "pipe", subfolder="transformer", torch_dtype=torch.bfloat16),
        "pipeline": diffusers.DiffusionPipeline.from_pretrained(tmp_path / "pipe", torch_dtype=torch.bfloat16)
        .transformer,
    }
    torch.manual_seed(0)
    inputs = adapter_for_model(model).example_inputs(model, GRIDS["tiny-dit"], 2)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    expected = _sample(loaded["mhla_convert"], inputs)
    for how, transformer in loaded.items():
        kept = {k for k, v in _dtypes(transformer).items() if v == torch.float32}
        assert kept and all(k.endswith("mixing") for k in kept), how
        assert torch.equal(_sample(transformer, inputs), expected), how


# --- AutoModel: a converted LM's layers without its head ------------------------------------------------


@pytest.mark.parametrize("name", LMS)
def test_auto_model_loads_a_converted_lm_without_its_head(tiny, tmp_path, name):
    from transformers import AutoModel

    model, ids = _lm(tiny, name)
    path = save_pretrained(model, tmp_path / "ckpt")
    bare = AutoModel.from_pretrained(path)
    assert type(bare).__name__ == "MHLA" + type(tiny(name).model).__name__
    assert isinstance(bare, type(tiny(name).model)) and bare.mhla_plan["layers"] == model.mhla_plan["layers"]
    assert [n for n, _ in mhla_layers(bare)] == [n.removeprefix("model.") for n, _ in mhla_layers(model)]
    with torch.no_grad():
        assert torch.equal(bare(ids).last_hidden_state, model.model(ids).last_hidden_state)
        half, whole = AutoModel.from_pretrained(path, dtype=torch.bfloat16), from_pretrained(path, dtype="bf16")
        assert torch.equal(half(ids).last_hidden_state, whole.model(ids).last_hidden_state)
    with pytest.raises(ValueError, match="does not save on its own: load the checkpoint with AutoModelForCausalLM"):
        bare.save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match="part of a converted llama model, not a whole one"):
        save_pretrained(bare, tmp_path / "bare")


def test_auto_classes_load_in_a_fresh_process_whatever_the_import_order(tiny, tmp_path):
    """The Auto classes imported before mhla_convert still see its registrations; without importing it,
    trust_remote_code=True reaches both through the checkpoint's auto_map."""
    from transformers import AutoModel

    model, ids = _lm(tiny)
    path = save_pretrained(model, tmp_path / "lm")
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
    torch.save({"ids": ids, "logits": _logits(model, ids), "hidden": hidden}, tmp_path / "expected.pt")
    check = f"""
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            lm = AutoModelForCausalLM.from_pretrained({str(path)!r}, **options)
            bare = AutoModel.from_pretrained({str(path)!r}, **options)
            print(type(lm).__name__, type(bare).__name__, "mhla_convert" in sys.modules,
                  torch.equal(lm(expected["ids"]).logits, expected["logits"]),
                  torch.equal(bare(expected["ids"]).last_hidden_state, expected["hidden"]))
    """
    imported_after = _run_python("""
        import sys, torch
        from transformers import AutoModel, AutoModelForCausalLM
        import mhla_convert
        options = {}
    """ + check, tmp_path, block_mhla=False)
    trusted = _run_python("""
        import sys, torch
        from transformers import AutoModel, AutoModelForCausalLM
        options = {"trust_remote_code": True}
    """ + check, tmp_path, block_mhla=False)
    want = ["MHLALlamaForCausalLM", "MHLALlamaModel", "True", "True", "True"]
    for result in (imported_after, trusted):
        assert result.stdout.split() == want, result.stdout + result.stderr
    assert isinstance(AutoModel.from_pretrained(path), type(tiny("tiny-llama").model))
