"""What travels with a converted model and what stays on this machine: an LM's companion files (tokenizer, chat
template, generation config) are copied byte for byte and used by `sample` and `finetune` in place of the base
model's; hub ids resolve through the local cache in offline mode (HF_HUB_OFFLINE), as the libraries' own loaders
resolve them; and no file a conversion writes holds a local path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from typer.testing import CliRunner

from mhla_convert import convert, from_pretrained, load_model, save_pretrained
from mhla_convert.cli import app
from mhla_convert.io import mhla_metadata
from mhla_convert.locations import SOURCE_ATTR
from mhla_convert.models import resolve
from mhla_convert.train.components import char_tokenizer
from mhla_convert.train.recipe import parse_recipe
from mhla_convert.train.sampling import sample
from mhla_convert.train.trainer import train

SHA = "0123456789abcdef0123456789abcdef01234567"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _word_tokenizer():
    """A word-level tokenizer over the tiny LMs' 128 ids, of a class other than Llama's own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, "hello": 3, "world": 4, **{f"w{i}": 5 + i for i in range(123)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _lm_files(tiny, folder: Path) -> Path:
    """A tiny Llama's folder with a word tokenizer and a generation config; tokenizer.json written compactly, as
    transformers would never write it, so a re-serialised copy differs."""
    from transformers import GenerationConfig

    tiny("tiny-llama").save_pretrained(folder)
    _word_tokenizer().save_pretrained(folder)
    GenerationConfig(max_new_tokens=7, temperature=0.6, do_sample=True, pad_token_id=0).save_pretrained(folder)
    compact = json.dumps(json.loads((folder / "tokenizer.json").read_text()), separators=(",", ":"))
    (folder / "tokenizer.json").write_text(compact)
    return folder


def _companions(folder: Path) -> dict[str, bytes]:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
             "generation_config.json")
    return {name: (folder / name).read_bytes() for name in names if (folder / name).is_file()}


def _in_hub_cache(folder: Path, cache: Path, repo_id: str) -> None:
    """`folder` as the cached snapshot of hub repo `repo_id` (its main branch) under `cache`."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / SHA)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(SHA)


def _assert_no_local_path(directory: Path, *paths: Path) -> None:
    """No file under `directory` holds any of `paths` (as given or resolved)."""
    needles = {str(p).encode() for path in paths for p in (path, path.resolve())}
    files = [f for f in directory.rglob("*") if f.is_file()]
    assert files
    for file in files:
        data = file.read_bytes()
        assert not any(needle in data for needle in needles), f"{file} holds a local path"


def _sampled(checkpoint, out: Path) -> str:
    return sample(checkpoint, "hello world", out, max_new_tokens=4, device="cpu").read_text()


# --- companion files ----------------------------------------------------------------------------------------


def test_companions_are_copied_byte_for_byte_and_sample_needs_no_base(tiny, tmp_path):
    base = _lm_files(tiny, tmp_path / "base")
    expected = _companions(base)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(expected)
    result = invoke(base, "--ratio", 0.5, "--out", tmp_path / "lm")
    assert result.exit_code == 0, result.output
    assert "with the base model's" in result.output and "tokenizer.json" in result.output
    assert _companions(tmp_path / "lm") == expected
    text = _sampled(tmp_path / "lm", tmp_path / "before.txt")
    assert text.startswith("hello world w")  # decoded by the word tokenizer
    base.rename(tmp_path / "moved")
    assert _sampled(tmp_path / "lm", tmp_path / "after.txt") == text
    save_pretrained(from_pretrained(tmp_path / "lm"), tmp_path / "again")  # a re-save carries them on
    assert _companions(tmp_path / "again") == expected


def test_a_subfolder_keeps_the_tokenizer_at_the_root_and_its_own_generation_config(tiny, tmp_path):
    from transformers import GenerationConfig

    repo = _lm_files(tiny, tmp_path / "repo")
    (repo / "llm").mkdir()
    for name in ("config.json", "model.safetensors"):
        (repo / name).rename(repo / "llm" / name)
    GenerationConfig(max_new_tokens=3, pad_token_id=0).save_pretrained(repo / "llm")  # the subfolder's own wins
    result = invoke(repo, "--subfolder", "llm", "--out", tmp_path / "lm")
    assert result.exit_code == 0, result.output
    expected = {**_companions(repo), "generation_config.json": (repo / "llm" / "generation_config.json").read_bytes()}
    assert _companions(tmp_path / "lm") == expected
    assert json.loads((tmp_path / "lm" / "mhla_config.json").read_text())["base_model_subfolder"] == "llm"
    assert _sampled(tmp_path / "lm", tmp_path / "out.txt").startswith("hello world")


def test_finetune_encodes_with_the_checkpoint_own_tokenizer(tiny, tmp_path):
    base = _lm_files(tiny, tmp_path / "base")
    assert invoke(base, "--ratio", 0.5, "--out", tmp_path / "lm").exit_code == 0
    shutil.rmtree(base)  # the recorded base is gone: only the checkpoint's copy can tokenize
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"hello world w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(60)))
    recipe = parse_recipe(f"""
model: {{checkpoint: {tmp_path / "lm"}}}
data: {{kind: text, path: {corpus}, context_length: 16, batch_size: 2}}
stages: [{{name: finetune, steps: 1}}]
logging: {{trackers: []}}
""")
    trained = train(recipe, tmp_path / "run", log=lambda *_: None)
    assert _companions(trained) == _companions(tmp_path / "lm")
    assert _sampled(trained, tmp_path / "out.txt").startswith("hello world")


def test_a_tiny_lm_saves_its_character_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    result = invoke("tiny-llama", "--ratio", 0.5, "--out", tmp_path / "tiny")
    assert result.exit_code == 0, result.output
    saved = AutoTokenizer.from_pretrained(tmp_path / "tiny")
    assert saved("a cat!")["input_ids"] == char_tokenizer()("a cat!")["input_ids"]
    assert _sampled(tmp_path / "tiny", tmp_path / "out.txt").startswith("hello world")


# --- no local paths ------------------------------------------------------------------------------------------


def test_no_file_a_conversion_writes_holds_a_local_path(tiny, tmp_path):
    from mhla_convert.train.components import pipeline

    _lm_files(tiny, tmp_path / "lm-base")
    pipeline("dit", tiny("tiny-dit"), "tiny-dit").save_pretrained(tmp_path / "dit-pipe")
    runs = {"lm": [tmp_path / "lm-base", "--ratio", 0.5], "dit": [tmp_path / "dit-pipe", "--ratio", 0.5],
            "pipe": [tmp_path / "dit-pipe", "--pipeline"]}
    for name, args in runs.items():
        result = invoke(*args, "--out", tmp_path / name)
        assert result.exit_code == 0, result.output
        _assert_no_local_path(tmp_path / name, tmp_path)
        meta = json.loads((tmp_path / name / ("transformer" if name == "pipe" else "") / "mhla_config.json")
                          .read_text())
        assert meta["base_model"] is None
    assert (tmp_path / "pipe" / "vae").is_dir()  # a pipeline's other parts still come along
    # from the pipeline's own parts (a tiny DiT has fewer classes than DiTPipeline's unguided null class, 1000)
    sample(tmp_path / "pipe", None, tmp_path / "dit.png", steps=2, guidance_scale=1.0, device="cpu")


def test_a_checkpoint_that_recorded_a_local_path_drops_it_when_saved_again(tiny, tmp_path):
    model = tiny("tiny-dit")
    convert(model, ratio=0.5)
    setattr(model, SOURCE_ATTR, {"base_model": str(tmp_path / "old-base"), "revision": None, "subfolder": None})
    assert mhla_metadata(model)["base_model"] is None


# --- hub ids through the local cache, offline ---------------------------------------------------------------


OFFLINE_CLI = """
import json, sys
from typer.testing import CliRunner
from mhla_convert.cli import app
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(app, args)
    print(result.output)
    if result.exit_code:
        sys.exit(f"{args} failed: {result.output}")
"""


def test_hub_ids_convert_sample_and_evaluate_from_the_offline_cache(tiny, tmp_path):
    """A fresh process with HF_HUB_OFFLINE=1 and HF_HUB_CACHE: base models convert by their ids, a converted one
    samples by its id, eval takes a hub reference; each works only if nothing asks the Hub."""
    cache = tmp_path / "cache"
    _in_hub_cache(_lm_files(tiny, tmp_path / "llama"), cache, "org/llama")
    tiny("tiny-dit").save_pretrained(tmp_path / "dit")
    _in_hub_cache(tmp_path / "dit", cache, "org/dit")
    converted = tiny("tiny-llama")
    convert(converted, ratio=0.5)
    _word_tokenizer().save_pretrained(save_pretrained(converted, tmp_path / "lm-mhla"))
    _in_hub_cache(tmp_path / "lm-mhla", cache, "me/lm-mhla")
    commands = [
        ["org/llama", "--ratio", "0.5", "--out", str(tmp_path / "lm")],
        ["org/dit", "--ratio", "0.5", "--out", str(tmp_path / "dit-mhla")],
        ["sample", "me/lm-mhla", "--prompt", "hello world", "--max-new-tokens", "3", "--device", "cpu",
         "--out", str(tmp_path / "out.txt")],
        ["eval", str(tmp_path / "lm"), "--reference", "org/llama", "--data", "synthetic", "--batch-size", "1",
         "--num-batches", "1", "--passkey-lengths", "", "--device", "cpu", "--out", str(tmp_path / "eval")],
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", OFFLINE_CLI, json.dumps(commands)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    meta = json.loads((tmp_path / "lm" / "mhla_config.json").read_text())
    assert (meta["base_model"], meta["base_model_revision"]) == ("org/llama", SHA)
    assert _companions(tmp_path / "lm") == _companions(tmp_path / "llama")
    assert json.loads((tmp_path / "dit-mhla" / "mhla_config.json").read_text())["base_model"] == "org/dit"
    assert (tmp_path / "out.txt").read_text().startswith("hello world")
    for out in ("lm", "dit-mhla"):
        _assert_no_local_path(tmp_path / out, tmp_path)


def test_python_loaders_resolve_hub_ids_through_the_offline_cache(tiny, run_model, tmp_path, monkeypatch):
    """With HF_HUB_OFFLINE alone (no local_files_only): as transformers' and diffusers' loaders do."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    _in_hub_cache(_lm_files(tiny, tmp_path / "llama"), cache, "org/llama")
    converted = tiny("tiny-llama")
    convert(converted, ratio=0.5)
    _in_hub_cache(save_pretrained(converted, tmp_path / "lm-mhla"), cache, "me/lm-mhla")
    base = load_model("org/llama")
    assert base.mhla_source["base_model"] == "org/llama" and base.mhla_source["revision"] == SHA
    ids = {"input_ids": base.config.vocab_size - 1 - torch.arange(12)[None]}
    assert torch.equal(run_model(from_pretrained("me/lm-mhla"), ids), run_model(converted, ids))
    assert torch.equal(run_model(load_model("me/lm-mhla"), ids), run_model(converted, ids))


def test_an_uncached_hub_id_offline_says_it_is_not_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(OSError) as error:
        resolve("me/not-downloaded")
    message = str(error.value)
    assert "'me/not-downloaded' is not in the local Hugging Face cache" in message
    assert "HF_HUB_OFFLINE is set" in message and "set HF_HUB_OFFLINE=1" not in message
