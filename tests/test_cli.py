"""The mhla-convert CLI end to end, offline (typer's CliRunner)."""

from __future__ import annotations

import importlib
import logging
from logging.handlers import BufferingHandler

import pytest
import torch
from typer.testing import CliRunner

from mhla_convert import from_pretrained
from mhla_convert.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def base_dir(tiny, tmp_path):
    """A tiny Wan saved the way diffusers pipelines keep it: <dir>/transformer/ beside model_index.json."""
    root = tmp_path / "wan-pipeline"
    tiny("tiny-wan").save_pretrained(root / "transformer")
    (root / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    return root


def test_convert_is_the_default_command_on_a_local_pipeline_dir(base_dir, tmp_path):
    out = tmp_path / "out"
    result = invoke(base_dir, "--ratio", 0.67, "--blocks", "2x3x3", "--out", out)
    assert result.exit_code == 0, result.output
    assert "loading local model" in result.output and "subfolder transformer" in result.output
    assert "4 of 6" in result.output and f"saved: {out}" in result.output
    model = from_pretrained(out)
    assert model.mhla_plan["layers"] == [1, 2, 4, 5] and model.mhla_plan["mhla_config"]["blocks"] == [2, 3, 3]
    assert model.mhla_source["base_model"] is None and model.mhla_source["name"] == base_dir.name  # not its path


def test_explicit_convert_command_layers_dtype_and_default_out(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("convert", "tiny-dit", "--layers", "0,3", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    model = from_pretrained(tmp_path / "tiny-dit-mhla")
    assert model.mhla_plan["layers"] == [0, 3] and model.transformer_blocks[0].attn1.to_q.weight.dtype == torch.bfloat16


def test_push_option_uploads(tiny, tmp_path, monkeypatch):
    pushed = {}
    monkeypatch.setattr(
        "mhla_convert.hub.push_to_hub",
        lambda directory, repo_id, private=None: (
            pushed.update(dir=directory, repo=repo_id, private=private) or f"https://huggingface.co/{repo_id}"
        ),
    )
    result = invoke("tiny-sana", "--ratio", 0.5, "--out", tmp_path / "s", "--push", "me/sana-mhla", "--private")
    assert result.exit_code == 0, result.output
    assert pushed == {"dir": tmp_path / "s", "repo": "me/sana-mhla", "private": True}
    assert "pushed: https://huggingface.co/me/sana-mhla" in result.output


def test_list_shows_aliases_tiny_models_and_families():
    result = invoke("list")
    assert result.exit_code == 0
    for word in (
        "wan2.1", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "sana-1600m", "dit-xl-2-256", "tiny-wan-i2v",
        "PixArtTransformer2DModel",
    ):
        assert word in result.output


def test_the_list_tables_match_the_family_adapters():
    """`list` reads catalog.py's tables (no torch); loading reads the adapters: the two say the same."""
    from mhla_convert.catalog import ALIASES, FAMILIES, TINY_MODELS
    from mhla_convert.families import families
    from mhla_convert.models import aliases, tiny_models

    stale = "mhla_convert/catalog.py does not list what the family adapters declare: update its tables"
    assert list(ALIASES.items()) == list(aliases().items()), stale
    assert FAMILIES == {name: (cls.library, cls.model_classes) for name, cls in sorted(families().items())}, stale
    tiny = tiny_models()
    assert [(name, family) for name, (family, _) in TINY_MODELS.items()] == [(n, f) for n, (f, _) in tiny.items()], \
        stale
    for name, (family, what) in TINY_MODELS.items():  # each described as the class it builds
        built = tiny[name][1].get("architectures") or FAMILIES[family][1]
        assert what.split(", ")[0] == built[0] and len(built) == 1, (name, what, built)


def test_version_is_the_installed_package_version():
    from importlib.metadata import version

    result = invoke("--version")
    assert result.exit_code == 0 and result.output == f"mhla-convert {version('mhla-convert')}\n"


def test_h_is_help_for_the_app_and_every_command():
    from typer.main import get_command

    names = list(get_command(app).commands)
    assert {"convert", "list", "push", "demo", "eval", "finetune", "sample"} <= set(names)
    for args in ([], *([name] for name in names), ["tiny-dit"]):  # tiny-dit: the default command's
        short, long = invoke(*args, "-h"), invoke(*args, "--help")
        assert short.exit_code == 0 and "Usage: " in short.output, (args, short.output)
        assert short.output == long.output


def _library_output():
    """transformers' and diffusers' logging levels and progress bars, and huggingface_hub's progress bars."""
    import diffusers.utils.logging as diffusers_logging
    import huggingface_hub.utils as hub
    import transformers.utils.logging as transformers_logging

    return {"levels": (transformers_logging.get_verbosity(), diffusers_logging.get_verbosity()),
            "bars": (transformers_logging.is_progress_bar_enabled(), diffusers_logging.is_progress_bar_enabled(),
                     not hub.are_progress_bars_disabled())}


@pytest.mark.parametrize("flag", [None, "-v", "-q"])
def test_verbosity_sets_the_step_lines_and_the_libraries_output_while_loading(tmp_path, monkeypatch, flag):
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    from mhla_convert import models

    for lib in (transformers_logging, diffusers_logging):
        monkeypatch.setattr(lib, "_tqdm_active", True)
    hub_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")
    monkeypatch.setattr(hub_tqdm, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    monkeypatch.setattr(hub_tqdm, "progress_bar_states", {"_global": True})
    before, seen, load = _library_output(), {}, models.load_source
    monkeypatch.setattr(models, "load_source", lambda *args, **kw: seen.update(_library_output()) or load(*args, **kw))
    out, step = tmp_path / "dit", "loading built-in tiny model tiny-dit (random weights)"
    result = invoke(*[flag] * bool(flag), "tiny-dit", "--out", out)
    assert result.exit_code == 0, result.output
    assert _library_output() == before  # as they were once the command ends
    if flag == "-q":
        assert seen == {"levels": (logging.ERROR, logging.ERROR), "bars": (False, False, False)}
        assert result.output == f"saved: {out}\n"
        return
    assert "6 of 6 self-attention layers" in result.output and f"saved: {out}" in result.output
    if flag == "-v":
        assert seen == {"levels": (logging.INFO, logging.INFO), "bars": (True, True, True)}
        lines = result.output.splitlines()
        assert f"{step} ..." in lines and any(line.startswith(f"{step}: done (") for line in lines)
    else:  # the libraries' progress bars would break the step lines
        assert seen == {"levels": before["levels"], "bars": (False, False, False)}
        assert result.output.startswith(f"{step} ... done (")


def test_verbose_and_quiet_together_is_one_line():
    _assert_one_line_exit_2(invoke("-v", "-q", "list"), "--verbose and --quiet")


def test_sample_passes_the_base_class_no_conversion_record(tmp_path):
    """config.json's "mhla" record is for the converted class: diffusers would warn that the base class ignores it."""
    assert invoke("tiny-dit", "--out", tmp_path / "dit").exit_code == 0
    records = BufferingHandler(capacity=10_000)
    logging.getLogger("diffusers").addHandler(records)
    try:
        result = invoke("sample", tmp_path / "dit", "--steps", 1, "--out", tmp_path / "dit.png")
    finally:
        logging.getLogger("diffusers").removeHandler(records)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "dit.png").is_file()
    assert not [r.getMessage() for r in records.buffer if "not expected and will be ignored" in r.getMessage()]


def test_the_tiny_dit_pipeline_runs_in_dit_pipeline_as_saved(tmp_path):
    """DiTPipeline reads the transformer's out_channels and guides with the null class 1000."""
    from diffusers import DiTPipeline

    result = invoke("tiny-dit", "--pipeline", "--out", tmp_path / "pipe")
    assert result.exit_code == 0, result.output
    pipe = DiTPipeline.from_pretrained(tmp_path / "pipe")
    pipe.set_progress_bar_config(disable=True)
    images = pipe(class_labels=[0, 999], num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                  output_type="pt").images
    assert images.shape == (2, 3, 32, 32) and images.isfinite().all()


def test_demo_runs():
    result = invoke("demo")
    assert result.exit_code == 0, result.output
    assert "bitwise identical" in result.output


@pytest.mark.parametrize("args, message", [
    (["tiny-dit", "--ratio", "1.5"], "ratio must be in [0, 1]"),
    (["tiny-dit", "--layers", "2,9"], "out of range"),
    (["tiny-dit", "--layers", "a,b"], "comma-separated"),
    (["tiny-wan", "--blocks", "4x4"], "blocks must have 3 axes"),
    (["tiny-dit", "--dtype", "int3"], "dtype must be one of"),
    (["wan2.1"], "pass a local directory"),  # the hub is unreachable in tests
    (["no/such-model-anywhere"], "pass a local directory"),
    (["./no-such-dir"], "no such directory"),
    (["bad name!"], "neither an alias"),
])
def test_errors_are_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    result = invoke(*args)
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_unsupported_architecture_names_the_families(tmp_path):
    from transformers import BertConfig, BertModel

    BertModel(
        BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8, vocab_size=10)
    ).save_pretrained(tmp_path / "bert")
    result = invoke(tmp_path / "bert", "--out", tmp_path / "o")
    assert result.exit_code == 2 and "unsupported model" in result.output and "supported families: dit" in result.output


def test_push_command_on_a_base_model_dir_is_a_clear_error(base_dir):
    result = invoke("push", base_dir / "transformer", "me/x")
    assert result.exit_code == 2 and "no mhla_config.json" in result.output


def _network_down(*args, **kwargs):
    """What the hub client raises with no network: its HTTP library's (httpx's) ConnectError, not an OSError."""
    from mhla_convert.locations import TRANSPORT_ERRORS

    raise importlib.import_module(TRANSPORT_ERRORS[0].__module__).ConnectError("[Errno 101] Network is unreachable")


@pytest.fixture
def hub_online(monkeypatch):
    """The hub client out of offline mode (conftest's default), for the tests that fake an unreachable Hub."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def _assert_one_line_exit_2(result, *fragments):
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.stderr


def _files(directory):
    """Every entry under `directory` (folders too, hidden ones included) with its bytes."""
    return {p.relative_to(directory): p.read_bytes() if p.is_file() else None for p in sorted(directory.rglob("*"))}


def test_converting_a_hub_id_with_the_network_down_is_one_line(tmp_path, monkeypatch, hub_online):
    from huggingface_hub import HfApi

    monkeypatch.setattr(HfApi, "model_info", _network_down)
    result = invoke("some-org/some-model", "--out", tmp_path / "x")
    _assert_one_line_exit_2(result, "'some-org/some-model'", "ConnectError", "check the network", "HF_HUB_OFFLINE=1")
    assert not (tmp_path / "x").exists()


def test_a_download_breaking_off_while_loading_is_one_line(tiny, tmp_path, monkeypatch, hub_online):
    from types import SimpleNamespace

    from huggingface_hub import HfApi

    from mhla_convert.families.diffusers_base import DiffusersAdapter

    tiny("tiny-dit").save_pretrained(tmp_path / "base")
    info = SimpleNamespace(sha="0" * 40, siblings=[SimpleNamespace(rfilename="config.json")])
    monkeypatch.setattr(HfApi, "model_info", lambda self, repo_id, **kw: info)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", lambda *a, **kw: str(tmp_path / "base" / "config.json"))
    monkeypatch.setattr(DiffusersAdapter, "load_pretrained", _network_down)
    result = invoke("some-org/some-dit", "--out", tmp_path / "x")
    _assert_one_line_exit_2(result, "'some-org/some-dit'", "ConnectError", "check the network")


def test_reloading_a_hub_checkpoint_with_the_network_down_names_the_fix(monkeypatch, hub_online):
    monkeypatch.setattr("huggingface_hub.snapshot_download", _network_down)
    with pytest.raises(OSError, match="'someone/some-mhla'.*ConnectError.*check the network"):
        from_pretrained("someone/some-mhla")


@pytest.mark.parametrize("broken", ["create_repo", "create_commit"])
def test_push_with_the_network_down_is_one_line_and_leaves_the_checkpoint(tiny, tmp_path, monkeypatch, broken):
    from huggingface_hub import HfApi

    from mhla_convert import convert, save_pretrained

    model = tiny("tiny-dit")
    convert(model, ratio=0.5)
    path = save_pretrained(model, tmp_path / "ckpt")
    before = _files(path)
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: f"https://huggingface.co/{repo_id}")
    monkeypatch.setattr(HfApi, broken, _network_down)
    result = invoke("push", path, "me/dit-mhla")
    _assert_one_line_exit_2(result, "'me/dit-mhla'", "ConnectError", "check the network", "mhla-convert push")
    assert _files(path) == before  # no README.md written before the upload reached the Hub


@pytest.fixture
def lm_dir(tiny, tmp_path):
    """A local LM directory as the Hub has them: weights, a tokenizer with a chat template, a generation config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    root = tmp_path / "lm"
    tiny("tiny-llama").save_pretrained(root)
    words = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "hello": 2, "world": 3}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(root)
    GenerationConfig(max_new_tokens=7, do_sample=True, temperature=0.6, pad_token_id=0).save_pretrained(root)
    return root


def test_convert_saves_the_lm_tokenizer_chat_template_and_generation_config(lm_dir, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    out = tmp_path / "out"
    result = invoke(lm_dir, "--ratio", 0.5, "--out", out)
    assert result.exit_code == 0, result.output
    assert "with the base model's chat_template.jinja, generation_config.json, tokenizer.json" in result.output
    source, saved = AutoTokenizer.from_pretrained(lm_dir), AutoTokenizer.from_pretrained(out)
    assert saved.chat_template == source.chat_template is not None
    assert saved("hello world")["input_ids"] == source("hello world")["input_ids"] == [2, 3]
    assert GenerationConfig.from_pretrained(out) == GenerationConfig.from_pretrained(lm_dir)
    assert from_pretrained(out).mhla_plan["layers"] == [1, 3]


def test_convert_skips_what_the_source_lacks(tiny, tmp_path):
    root = tmp_path / "lm"
    tiny("tiny-llama").save_pretrained(root)  # transformers writes a generation config, no tokenizer
    result = invoke(root, "--out", tmp_path / "local")
    assert result.exit_code == 0, result.output
    assert "with the base model's generation_config.json)" in result.output
    assert (tmp_path / "local" / "generation_config.json").is_file()
    assert not (tmp_path / "local" / "tokenizer_config.json").exists()
    result = invoke("tiny-llama", "--out", tmp_path / "tiny")
    assert result.exit_code == 0, result.output
    assert "with the base model's" not in result.output
    assert {p.name for p in (tmp_path / "tiny").iterdir()} == {
        "config.json", "mhla_model.safetensors", "mhla_model.safetensors.index.json", "mhla_config.json",
        "mhla_loader.py", "tokenizer.json", "tokenizer_config.json"}  # its built-in character tokenizer


@pytest.mark.parametrize("name", ["tiny-dit", "tiny-wan", "tiny-llama"])
def test_convert_keeps_the_source_dtype_unless_told(tiny, tmp_path, name):
    from safetensors.torch import load_file

    from mhla_convert.placement import cast_model

    source = cast_model(tiny(name), torch.bfloat16)
    source.save_pretrained(tmp_path / "bf16")
    keep = set(getattr(source, "_keep_in_fp32_modules", None) or [])
    for args, dtype in (((), torch.bfloat16), (("--dtype", "float32"), torch.float32)):
        out = tmp_path / f"out-{dtype}"
        result = invoke(tmp_path / "bf16", "--ratio", 0.5, "--out", out, *args)
        assert result.exit_code == 0, result.output
        weights = out / ("mhla_model.safetensors" if name == "tiny-llama" else "model.safetensors")
        saved = {k: t.dtype for k, t in load_file(weights).items() if k in source.state_dict()}
        expected = {k: torch.float32 if keep & set(k.split(".")) else dtype for k in saved}
        assert saved == expected
        if keep and dtype == torch.bfloat16:
            assert torch.float32 in saved.values() and torch.bfloat16 in saved.values()
