"""The real encode path on tiny in-process components (VAE, text encoder, tokenizer: no
downloads): image and video folders and text corpora are encoded once, cached as safetensors
shards, and reused by the next run."""

import json
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from PIL import Image

import mhla_convert
from mhla_convert.families.wan import image_condition
from mhla_convert.train import TrainError, encode, parse_recipe
from mhla_convert.train.components import pipeline
from mhla_convert.train.data import load_shards
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


@pytest.mark.parametrize(
    "family, video, size, blocks",
    [("dit", False, 32, "null"), ("sana", False, 16, "null"), ("wan", True, 64, "1x2x2"),
     ("hunyuanvideo", True, 64, "1x2x2"), ("qwen-image", False, 32, "null")],
)
def test_folder_is_encoded_once_and_reused(family, video, size, blocks, tmp_path, monkeypatch):
    root = _folder(tmp_path / "data", video)
    recipe = _recipe(
        family, f"{{kind: folder, path: {root}, height: {size}, width: {size}, num_frames: 5, batch_size: 2}}", blocks
    )
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
    corpus.write_text(
        "".join(
            json.dumps({"text": f"line {i}: the quick brown fox jumps over the lazy dog"}) + "\n" for i in range(20)
        )
    )
    recipe = _recipe("llama", f"{{kind: text, path: {corpus}, context_length: 32, batch_size: 2}}")
    train(recipe, tmp_path / "run1", **QUIET)
    monkeypatch.setattr(encode, "pack_text", lambda *a: (_ for _ in ()).throw(AssertionError("packed again")))
    train(recipe, tmp_path / "run2", **QUIET)
    assert list((tmp_path / ".mhla_cache").glob("*/input_ids.safetensors"))


def test_empty_or_broken_folders_are_refused(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "metadata.jsonl").write_text("")
    with pytest.raises(TrainError, match="metadata.jsonl is empty"):
        train(_recipe("dit", f"{{kind: folder, path: {root}}}"), tmp_path / "run", **QUIET)
    (root / "metadata.jsonl").write_text(json.dumps({"file_name": "missing.png", "label": 1}) + "\n")
    with pytest.raises(TrainError, match="needs a file_name of an existing file"):
        train(_recipe("dit", f"{{kind: folder, path: {root}}}"), tmp_path / "run", **QUIET)


def test_i2v_video_folder_is_encoded_once_and_reused(tmp_path, monkeypatch):
    """Wan I2V: latents, 512-token text, the first-frame condition and CLIP image embeddings, cached."""
    root = _folder(tmp_path / "data", video=True, n=3)
    recipe = _recipe(
        "wan-i2v", f"{{kind: folder, path: {root}, height: 64, width: 64, num_frames: 5, batch_size: 2}}", "1x2x2"
    )
    train(recipe, tmp_path / "run1", **QUIET)
    (cache,) = [m.parent for m in (root / ".mhla_cache").glob("*/meta.json")]
    columns = load_shards(cache)
    assert columns["latents"].shape == (3, 4, 2, 8, 8) and columns["condition"].shape == (3, 8, 2, 8, 8)
    assert columns["prompt_embeds"].shape[1] == 512 and columns["image_embeds"].shape == (3, 17, 16)
    mask = columns["condition"][:, :4]
    assert (mask[:, :, 0] == 1).all() and (mask[:, :, 1:] == 0).all()
    monkeypatch.setattr(encode, "encode_folder", lambda *a: (_ for _ in ()).throw(AssertionError("encoded again")))
    assert (train(recipe, tmp_path / "run2", **QUIET) / "mhla_config.json").exists()


def test_i2v_condition_matches_the_pipeline():
    """The cached condition is what WanImageToVideoPipeline.prepare_latents builds from the first
    frame (mask layout, zero-frame padding, the VAE's latents_mean/std), and the image embeddings are
    its encode_image of that frame."""
    model = mhla_convert.tiny_model("tiny-wan-i2v")
    pipe = pipeline("wan", model, "tiny-wan-i2v")
    pipe.vae.register_to_config(latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[0.5, 2.0, 1.0, 1.5])
    frames = torch.randint(0, 256, (2, 3, 5, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    pixels = frames.float() / 127.5 - 1  # as encode._read gives them
    latents = torch.randn(2, 4, 2, 4, 4)
    with torch.no_grad():
        ours = image_condition(pipe, pixels, latents)
        # prepare_latents takes one image (repeated over its batch): compare example by example
        for i in range(2):
            _, reference = pipe.prepare_latents(pixels[i : i + 1, :, 0], 1, 4, 32, 32, 5, torch.float32, "cpu")
            torch.testing.assert_close(ours["condition"][i : i + 1], reference, atol=1e-5, rtol=1e-5)
        embeds = pipe.encode_image([Image.fromarray(f.permute(1, 2, 0).numpy()) for f in frames[:, :, 0]], "cpu")
    assert ours["condition"][:, 4:].abs().sum() > 0
    torch.testing.assert_close(ours["image_embeds"], embeds)
