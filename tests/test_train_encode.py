"""The real encode path on tiny in-process components (VAE, text encoder, tokenizer: no
downloads): image and video folders and text corpora are encoded once, cached as safetensors
shards, and reused by the next run."""

import json
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest

from mhla_convert.train import TrainError, encode, parse_recipe
from mhla_convert.train.trainer import train

QUIET = dict(log=lambda *_: None)


def _folder(root: Path, video: bool, n: int = 4) -> Path:
    root.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        if video:
            name = f"clip{i}.mp4"
            imageio.mimwrite(root / name, [rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in range(5)], fps=8)
        else:
            name = f"img{i}.png"
            imageio.imwrite(root / name, rng.integers(0, 255, (40, 48, 3), dtype=np.uint8))
        rows.append({"file_name": name, "text": f"a picture of thing {i}", "label": i % 3})
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _recipe(family: str, data: str, blocks: str = "null"):
    return parse_recipe(f"""
model: {{name: tiny-{family}}}
conversion: {{blocks: {blocks}}}
data: {data}
stages: [{{name: finetune, steps: 2}}]
logging: {{trackers: []}}
""")


@pytest.mark.parametrize("family, video, size, blocks", [("dit", False, 32, "null"), ("sana", False, 16, "null"), ("wan", True, 64, "1x2x2")])
def test_folder_is_encoded_once_and_reused(family, video, size, blocks, tmp_path, monkeypatch):
    root = _folder(tmp_path / "data", video)
    recipe = _recipe(family, f"{{kind: folder, path: {root}, height: {size}, width: {size}, num_frames: 5, batch_size: 2}}", blocks)
    train(recipe, tmp_path / "run1", **QUIET)
    caches = list((root / ".mhla_cache").glob("*/meta.json"))
    assert len(caches) == 1 and json.loads(caches[0].read_text())["num_examples"] == 4

    def no_encoding(*args, **kwargs):
        raise AssertionError("the second run encoded again instead of reusing the cache")

    monkeypatch.setattr(encode, "encode_folder", no_encoding)
    assert (train(recipe, tmp_path / "run2", **QUIET) / "mhla_config.json").exists()
    # the cache doubles as precomputed latents
    latents = _recipe(family, f"{{kind: latents, path: {caches[0].parent}, batch_size: 2}}", blocks)
    assert train(latents, tmp_path / "run3", **QUIET) is not None


def test_text_corpus_is_packed_and_cached(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i}: the quick brown fox jumps over the lazy dog"}) + "\n" for i in range(20)))
    recipe = _recipe("llama", f"{{kind: text, path: {corpus}, context_length: 32, batch_size: 2}}")
    train(recipe, tmp_path / "run1", **QUIET)
    monkeypatch.setattr(encode, "pack_text", lambda *a: (_ for _ in ()).throw(AssertionError("packed again")))
    train(recipe, tmp_path / "run2", **QUIET)
    assert list((tmp_path / ".mhla_cache").glob("*/shard-00000.safetensors"))


def test_empty_or_broken_folders_are_refused(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "metadata.jsonl").write_text("")
    with pytest.raises(TrainError, match="metadata.jsonl is empty"):
        train(_recipe("dit", f"{{kind: folder, path: {root}}}"), tmp_path / "run", **QUIET)
    (root / "metadata.jsonl").write_text(json.dumps({"file_name": "missing.png", "label": 1}) + "\n")
    with pytest.raises(TrainError, match="needs a file_name of an existing file"):
        train(_recipe("dit", f"{{kind: folder, path: {root}}}"), tmp_path / "run", **QUIET)
