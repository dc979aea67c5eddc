"""The model card `push` uploads, in the Hub's conventions: YAML metadata huggingface_hub parses (the
host library, base model and relation, pipeline tag, license from the base's own card when it is on
this machine, tags with mhla-convert, the model-index of eval.json), install and load snippets, the
conversion table, the evaluation table, and no local paths. The libraries' own pushes of converted
models (`model.push_to_hub`, `pipe.save_pretrained(push_to_hub=True)`) upload the same card, `push`
takes --token, --revision and --create-pr, and `push --adapter` publishes a LoRA adapter in its own
repo with the model as its base. The Hub is never reached: HfApi's methods are replaced."""

from __future__ import annotations

import json
from types import SimpleNamespace

import huggingface_hub
import pytest
import yaml
from huggingface_hub import ModelCard
from typer.testing import CliRunner

import mhla_convert
from mhla_convert.cli import app
from mhla_convert.hub import model_card
from mhla_convert.models import load_model

BASE_CARD = "---\nlicense: other\nlicense_name: base-license\npipeline_tag: text-to-video\n---\n# the base\n"


def _front_matter(card: ModelCard) -> dict:
    text = str(card)
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def _converted(model, directory, ratio=0.5):
    mhla_convert.convert(model, ratio=ratio, progress=False)
    return mhla_convert.save_pretrained(model, directory)


def test_card_of_a_local_base_names_it_by_folder_only(tiny, tmp_path):
    base = tmp_path / "bases" / "my-wan"
    tiny("tiny-wan").save_pretrained(base / "transformer")
    (base / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    (base / "README.md").write_text(BASE_CARD)
    ckpt = _converted(load_model(str(base)), tmp_path / "ckpt")
    card = model_card(ckpt, "me/wan-mhla")
    meta = _front_matter(card)
    assert meta == {"library_name": "diffusers", "license": "other", "license_name": "base-license",
                    "pipeline_tag": "text-to-video", "tags": ["mhla-convert", "mhla", "linear-attention", "wan"]}
    assert card.data.to_dict()["license"] == "other"  # huggingface_hub reads it back
    text = str(card)
    assert str(tmp_path) not in text and "/bases" not in text and "`my-wan`" in text
    assert "pip install mhla-convert" in text and 'mhla_convert.from_pretrained("me/wan-mhla")' in text
    assert "| converted layers | `1, 3, 5` |" in text and "## Evaluation" not in text


def test_card_of_a_hub_base_links_it_and_reads_its_cached_card(tiny, tmp_path, monkeypatch):
    snapshot = tmp_path / "cache" / "models--org--base" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    (tmp_path / "cache" / "models--org--base" / "refs").mkdir()
    (tmp_path / "cache" / "models--org--base" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    model = tiny("tiny-llama")
    model.mhla_source = {"base_model": "org/base", "revision": None, "subfolder": None}
    card = model_card(_converted(model, tmp_path / "ckpt", ratio=1.0), "me/llama-mhla")
    meta = _front_matter(card)
    assert meta["base_model"] == "org/base" and meta["base_model_relation"] == "finetune"
    assert meta["library_name"] == "transformers" and meta["license"] == "apache-2.0"
    assert meta["pipeline_tag"] == "text-generation" and "mhla" in meta["tags"]
    assert "[org/base](https://huggingface.co/org/base)" in str(card)
    assert 'AutoModelForCausalLM.from_pretrained("me/llama-mhla", trust_remote_code=True)' in str(card)


def test_card_of_a_pipeline_loads_it_with_diffusers(tiny, tmp_path):
    model = tiny("tiny-dit")
    mhla_convert.convert(model, ratio=0.5, progress=False)
    from mhla_convert.train.components import pipeline

    pipeline("dit", model, "tiny-dit").save_pretrained(tmp_path / "pipe")
    text = str(model_card(tmp_path / "pipe", "me/dit-mhla"))
    assert "import mhla_convert" in text and 'DiffusionPipeline.from_pretrained("me/dit-mhla")' in text


@pytest.mark.parametrize("name, tag", [("tiny-dit", "unconditional-image-generation"), ("tiny-sana", "text-to-image"),
                                       ("tiny-wan-i2v", "image-to-video")])
def test_card_without_base_card_tags_the_family_task(tiny, tmp_path, name, tag):
    meta = _front_matter(model_card(_converted(tiny(name), tmp_path / "ckpt"), "me/x"))
    assert meta["pipeline_tag"] == tag and "license" not in meta and "base_model" not in meta
    assert "base_model_relation" not in meta and "model-index" not in meta


def test_card_shows_the_evaluation_beside_the_checkpoint(tiny, tmp_path):
    ckpt = _converted(tiny("tiny-dit"), tmp_path / "ckpt")
    result = {"model": {"loss": 0.5}, "reference": {"loss": 0.4}, "gap_percent": {"loss": 25.0},
              "meta": {"model": str(ckpt), "data": {"kind": "synthetic"}, "num_examples": 32, "seed": 0}}
    (ckpt / "eval.json").write_text(json.dumps(result))
    card = model_card(ckpt, "me/dit-mhla")
    text = str(card)
    assert "## Evaluation" in text and "| loss | 0.5000 | 0.4000 | +25.00% |" in text
    assert "32 examples" in text and str(tmp_path) not in text
    [result] = card.data.eval_results  # the model-index huggingface_hub reads back
    assert (result.task_type, result.dataset_type, result.metric_type, result.metric_value) == (
        "unconditional-image-generation", "synthetic", "loss", 0.5)
    assert _front_matter(card)["model-index"][0]["name"] == "me/dit-mhla"


class _Hub:
    """HfApi's create_repo, create_branch and create_commit replaced: what each call would send."""

    def __init__(self, monkeypatch):
        from huggingface_hub import CommitInfo, HfApi

        self.commits, self.branches, self.repos = {}, [], []

        def commit(api, repo_id, operations, **options):
            files = {op.path_in_repo: op.path_or_fileobj for op in operations}
            self.commits[repo_id] = ({k: v if isinstance(v, bytes) else open(v, "rb").read() for k, v in files.items()},
                                     options, api.token)
            return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/{'c' * 40}", commit_message="",
                              commit_description="", oid="c" * 40,
                              pr_url=f"https://huggingface.co/{repo_id}/discussions/1" if options["create_pr"]
                              else None)

        monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: self.repos.append((repo_id, kw)) or (
            f"https://huggingface.co/{repo_id}"))
        monkeypatch.setattr(HfApi, "create_branch", lambda api, repo_id, branch, **kw: self.branches.append(
            (repo_id, branch)))
        monkeypatch.setattr(HfApi, "create_commit", commit)

    def card(self, repo_id) -> dict:
        return yaml.safe_load(self.commits[repo_id][0]["README.md"].decode().split("---\n")[1])


def test_an_lm_pushed_by_transformers_carries_the_project_card(tmp_path, monkeypatch):
    hub = _Hub(monkeypatch)
    model = mhla_convert.tiny_model("tiny-qwen3")
    mhla_convert.convert(model, progress=False)
    url = model.push_to_hub("me/qwen-mhla", private=True, token="t0k", commit_message="first")
    assert url == "https://huggingface.co/me/qwen-mhla"
    files, options, token = hub.commits["me/qwen-mhla"]
    assert {"config.json", "mhla_config.json", "mhla_loader.py", "README.md"} <= set(files) and token == "t0k"
    assert options["commit_message"] == "first" and hub.repos == [("me/qwen-mhla", {
        "private": True, "exist_ok": True, "repo_type": "model"})]
    assert hub.card("me/qwen-mhla")["library_name"] == "transformers"
    model.save_pretrained(tmp_path / "saved", push_to_hub=True, repo_id="me/qwen-2", revision="v2")
    assert "mhla-convert" in hub.card("me/qwen-2")["tags"] and hub.branches == [("me/qwen-2", "v2")]
    assert hub.commits["me/qwen-2"][1]["revision"] == "v2" and (tmp_path / "saved" / "mhla_config.json").is_file()


def test_diffusers_pushes_of_a_converted_model_and_pipeline_carry_the_project_card(tmp_path, monkeypatch):
    import diffusers.pipelines.pipeline_utils
    import diffusers.utils.hub_utils

    from mhla_convert.train.components import pipeline

    hub = _Hub(monkeypatch)
    for module in (diffusers.pipelines.pipeline_utils, diffusers.utils.hub_utils):  # diffusers' own create_repo
        monkeypatch.setattr(module, "create_repo", lambda repo_id, **kw: SimpleNamespace(repo_id=repo_id))
    model = mhla_convert.tiny_model("tiny-dit")
    mhla_convert.convert(model, ratio=0.5, progress=False)
    model.push_to_hub("me/dit-mhla", create_pr=True)
    files, options, _ = hub.commits["me/dit-mhla"]
    assert options["create_pr"] and "mhla_config.json" in files
    assert hub.card("me/dit-mhla")["library_name"] == "diffusers" and b"| converted layers |" in files["README.md"]
    pipe = pipeline("dit", model, "tiny-dit")
    pipe.save_pretrained(str(tmp_path / "pipe"), push_to_hub=True, repo_id="me/dit-pipe")
    files = hub.commits["me/dit-pipe"][0]
    assert "model_index.json" in files and "transformer/mhla_config.json" in files
    assert b'DiffusionPipeline.from_pretrained("me/dit-pipe")' in files["README.md"]
    assert "mhla-convert" in hub.card("me/dit-pipe")["tags"]


def test_push_command_takes_token_revision_and_pull_requests(tmp_path, monkeypatch):
    hub = _Hub(monkeypatch)
    ckpt = _converted(mhla_convert.tiny_model("tiny-dit"), tmp_path / "ckpt")
    result = CliRunner().invoke(app, ["push", str(ckpt), "me/dit", "--token", "t0k", "--revision", "dev",
                                      "--create-pr"])
    assert result.exit_code == 0, result.output
    assert "pushed: https://huggingface.co/me/dit/discussions/1" in result.output
    _, options, token = hub.commits["me/dit"]
    assert token == "t0k" and options["revision"] == "dev" and options["create_pr"]
    assert hub.branches == [("me/dit", "dev")]


def test_push_publishes_an_adapter_in_its_own_repo_on_the_model(tmp_path, monkeypatch):
    from mhla_convert.train.lora import add_lora, save_adapter
    from mhla_convert.train.recipe import LoraSpec

    hub = _Hub(monkeypatch)
    model = mhla_convert.tiny_model("tiny-qwen3")
    mhla_convert.convert(model, progress=False)
    ckpt = mhla_convert.save_pretrained(model, tmp_path / "model")
    add_lora(model, LoraSpec(r=2))
    save_adapter(model, tmp_path / "adapter", base=str(ckpt))
    result = CliRunner().invoke(app, ["push", str(ckpt), "me/qwen", "--adapter", str(tmp_path / "adapter")])
    assert result.exit_code == 0, result.output
    files = hub.commits["me/qwen-lora"][0]
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} == set(files)
    config = json.loads(files["adapter_config.json"])
    assert config["base_model_name_or_path"] == "me/qwen" and config["revision"] == "c" * 40  # the model's commit
    card = hub.card("me/qwen-lora")
    assert (card["library_name"], card["base_model"], card["base_model_relation"]) == ("peft", "me/qwen", "adapter")
    assert card["mhla_base_fingerprint"] and str(tmp_path) not in files["README.md"].decode()

    other = _converted(mhla_convert.tiny_model("tiny-qwen3"), tmp_path / "other", ratio=1.0)
    result = CliRunner().invoke(app, ["push", str(other), "me/other", "--adapter", str(tmp_path / "adapter")])
    assert result.exit_code == 2 and "was saved for" in result.stderr and "--force" in result.stderr
    assert "me/other" not in hub.commits
    result = CliRunner().invoke(app, ["push", str(other), "me/other", "--adapter", str(tmp_path / "adapter"),
                                      "--force"])
    assert result.exit_code == 0 and "me/other-lora" in hub.commits
