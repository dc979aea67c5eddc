"""The model card `push` uploads: YAML metadata huggingface_hub parses (library, base model, pipeline
tag, license from the base's own card when it is on this machine, tags), install and load snippets,
the conversion table, the evaluation table when eval.json is there, and no local paths."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
import yaml
from huggingface_hub import ModelCard

import mhla_convert
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
    assert meta == {"library_name": "mhla-convert", "license": "other", "license_name": "base-license",
                    "pipeline_tag": "text-to-video", "tags": ["mhla", "linear-attention", "mhla-convert", "wan",
                                                              "diffusers"]}
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
    assert meta["base_model"] == "org/base" and meta["license"] == "apache-2.0"
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


def test_card_shows_the_evaluation_beside_the_checkpoint(tiny, tmp_path):
    ckpt = _converted(tiny("tiny-dit"), tmp_path / "ckpt")
    result = {"model": {"loss": 0.5}, "reference": {"loss": 0.4}, "gap_percent": {"loss": 25.0},
              "meta": {"model": str(ckpt), "data": {"kind": "synthetic"}, "num_examples": 32, "seed": 0}}
    (ckpt / "eval.json").write_text(json.dumps(result))
    text = str(model_card(ckpt, "me/dit-mhla"))
    assert "## Evaluation" in text and "| loss | 0.5000 | 0.4000 | +25.00% |" in text
    assert "32 examples" in text and str(tmp_path) not in text
