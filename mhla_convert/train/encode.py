"""Encode once, reuse after: image/video folders (Hugging Face `imagefolder` / `videofolder`
layout: files plus `metadata.jsonl` with `file_name` and a caption or label column) go through the
family's own VAE and text encoder (its pipeline's `encode_prompt`; for Wan image-to-video also the
first frame's condition latents and CLIP image embeddings); text corpora are tokenized and
packed to the context length. Results land in `cache_dir/<key>/` as safetensors shards; the key
hashes everything that changes the tensors, so a second run with the same data skips encoding."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from .components import MAX_TEXT, is_i2v, pipeline, tokenizer
from .data import WAN_TEXT_TOKENS, i2v_condition, load_shards, save_shards
from .errors import TrainError
from .recipe import DataSpec

VIDEO_SUFFIXES = {".mp4", ".webm", ".mov", ".avi", ".mkv", ".gif"}


def _cache_key(spec: DataSpec, family: str, components: str | None, files: list[Path]) -> str:
    h = hashlib.sha256()
    fields = {k: getattr(spec, k) for k in ("kind", "height", "width", "num_frames", "caption_column", "label_column",
                                            "max_text_length", "text_column", "text_format", "context_length")}
    h.update(json.dumps([family, components, __version__, fields], sort_keys=True, default=str).encode())
    for f in files:
        stat = f.stat()
        h.update(f"{f}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _cached(spec: DataSpec, key: str, build) -> dict[str, torch.Tensor]:
    root = Path(spec.cache_dir).expanduser() if spec.cache_dir else Path(spec.path).expanduser() / ".mhla_cache"
    if Path(spec.path).is_file() and not spec.cache_dir:
        root = Path(spec.path).parent / ".mhla_cache"
    target = root / key
    if (target / "meta.json").exists():
        print(f"reusing encoded data in {target}")
        return load_shards(target)
    columns = build()
    save_shards(columns, target, {"source": str(spec.path)})
    print(f"encoded {len(next(iter(columns.values())))} examples into {target}")
    return columns


# --- image / video folders -----------------------------------------------------------------------


def _metadata(root: Path) -> list[dict]:
    meta = root / "metadata.jsonl"
    if not meta.is_file():
        raise TrainError(f"{root} has no metadata.jsonl: add one line per file, e.g. {{\"file_name\": \"a.png\", \"text\": \"a caption\"}}")
    rows = [json.loads(line) for line in meta.read_text().splitlines() if line.strip()]
    if not rows:
        raise TrainError(f"{meta} is empty: the dataset needs at least one example")
    for row in rows:
        if "file_name" not in row or not (root / row["file_name"]).is_file():
            raise TrainError(f"{meta}: every line needs a file_name of an existing file; got {row}")
    return rows


def _resize(frame: np.ndarray, height: int, width: int) -> torch.Tensor:
    """HWC uint8 → CHW in [-1, 1], resized to cover then centre-cropped."""
    from PIL import Image

    img = Image.fromarray(frame).convert("RGB")
    scale = max(height / img.height, width / img.width)
    img = img.resize((max(width, round(img.width * scale)), max(height, round(img.height * scale))), Image.BICUBIC)
    left, top = (img.width - width) // 2, (img.height - height) // 2
    img = img.crop((left, top, left + width, top + height))
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 127.5 - 1.0


def _read(path: Path, spec: DataSpec, video: bool) -> torch.Tensor:
    import imageio.v2 as imageio

    if not video:
        return _resize(np.asarray(imageio.imread(path)), spec.height, spec.width)
    frames = [_resize(f, spec.height, spec.width) for _, f in zip(range(spec.num_frames), imageio.get_reader(path))]
    frames += frames[-1:] * (spec.num_frames - len(frames))  # short clips repeat their last frame
    return torch.stack(frames, dim=1)  # C, F, H, W


def _vae_encode(family: str, vae, pixels: torch.Tensor) -> torch.Tensor:
    pixels = pixels.to(vae.device, vae.dtype)
    if family == "wan":
        z = vae.encode(pixels).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
        return (z - mean) * inv_std
    if family == "sana":
        return vae.encode(pixels).latent * vae.config.scaling_factor
    return vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor


def _encode_text(family: str, pipe, captions: list[str], max_length: int) -> dict[str, torch.Tensor]:
    if family == "wan":
        embeds, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=max_length, device=pipe.device)
        return {"prompt_embeds": embeds}
    embeds, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=max_length, device=pipe.device)
    return {"prompt_embeds": embeds, "prompt_attention_mask": mask}


@torch.no_grad()
def encode_folder(spec: DataSpec, family: str, transformer, components: str | None) -> dict[str, torch.Tensor]:
    root = Path(spec.path)
    rows = _metadata(root)
    pipe = pipeline(family, transformer, components)
    if family == "wan" and (spec.num_frames - 1) % 4:
        raise TrainError(f"data.num_frames must be 4k+1 for Wan's VAE (e.g. 17, 33, 81); got {spec.num_frames}")
    i2v = family == "wan" and is_i2v(transformer)
    # the I2V attention splits image from text tokens at exactly 512, so I2V text is always that long
    max_length = WAN_TEXT_TOKENS if i2v else min(spec.max_text_length, MAX_TEXT.get(family, spec.max_text_length))
    out: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(rows), spec.encode_batch_size):
        chunk = rows[start : start + spec.encode_batch_size]
        pixels = torch.stack([_read(root / r["file_name"], spec, video=family == "wan") for r in chunk])
        columns = {"latents": _vae_encode(family, pipe.vae, pixels)}
        if i2v:
            columns.update(image_condition(pipe, pixels, columns["latents"]))
        if family == "dit":
            if any(spec.label_column not in r for r in chunk):
                raise TrainError(f"DiT needs a class label per image: add \"{spec.label_column}\" to every metadata.jsonl line (or set data.label_column)")
            columns["class_labels"] = torch.tensor([int(r[spec.label_column]) for r in chunk])
        else:
            if any(spec.caption_column not in r for r in chunk):
                raise TrainError(f"every metadata.jsonl line needs a caption under \"{spec.caption_column}\" (or set data.caption_column)")
            columns.update(_encode_text(family, pipe, [str(r[spec.caption_column]) for r in chunk], max_length))
        for k, v in columns.items():
            out.setdefault(k, []).append((v.float() if v.is_floating_point() else v).cpu())
    return {k: _pad_cat(v) for k, v in out.items()}


def _to_image(frame: torch.Tensor):
    """CHW in [-1, 1] → the RGB picture it was read from."""
    from PIL import Image

    return Image.fromarray(((frame.float() + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).cpu().numpy())


def image_condition(pipe, pixels: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
    """What WanImageToVideoPipeline derives from a video's first frame: `prepare_latents`' condition
    (mask ⊕ the normalised VAE latents of the first frame followed by zero frames; the VAE sees the
    padded clip, as in sampling) and `encode_image`'s CLIP embeddings of the frame as a picture."""
    padded = torch.cat([pixels[:, :, :1], torch.zeros_like(pixels[:, :, 1:])], dim=2)
    first = _vae_encode("wan", pipe.vae, padded).to(latents)
    columns = i2v_condition(latents, pipe.vae_scale_factor_temporal, first)
    if pipe.transformer.config.image_dim is not None:  # Wan2.1 I2V; later I2V models take no image tokens
        columns["image_embeds"] = pipe.encode_image([_to_image(f) for f in pixels[:, :, 0]], pipe.device)
    return columns


def _pad_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along the batch, padding text lengths that differ between encode batches."""
    if parts[0].ndim >= 2 and len({p.shape[1] for p in parts}) > 1 and parts[0].ndim <= 3:
        length = max(p.shape[1] for p in parts)
        parts = [torch.nn.functional.pad(p, (0, 0) * (p.ndim - 2) + (0, length - p.shape[1])) for p in parts]
    return torch.cat(parts)


def cached_folder(spec: DataSpec, family: str, transformer, components: str | None) -> dict[str, torch.Tensor]:
    root = Path(spec.path)
    files = [root / "metadata.jsonl", *(root / r["file_name"] for r in _metadata(root))]
    task = "wan-i2v" if family == "wan" and is_i2v(transformer) else family  # same folder, different tensors
    key = _cache_key(spec, task, components, files)
    return _cached(spec, key, lambda: encode_folder(spec, family, transformer, components))


# --- text corpora --------------------------------------------------------------------------------


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl", ".txt", ".parquet") and ".mhla_cache" not in p.parts)
    if not files:
        raise TrainError(f"{path} holds no .jsonl / .json / .txt / .parquet files")
    return files


def pack_text(spec: DataSpec, model, components: str | None) -> dict[str, torch.Tensor]:
    import datasets

    files = _text_files(Path(spec.path))
    fmt = spec.text_format
    if fmt == "auto":
        fmt = {".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet"}[files[0].suffix]
    ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    if spec.text_column not in ds.column_names:
        raise TrainError(f"data.text_column {spec.text_column!r} is not in {spec.path}; columns: {', '.join(ds.column_names)}")
    tok = tokenizer(components)
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
    stream: list[int] = []
    for text in ds[spec.text_column]:
        stream.extend(tok(text, add_special_tokens=False)["input_ids"] + [eos])
    n = len(stream) // spec.context_length
    if n == 0:
        raise TrainError(f"{spec.path} has {len(stream)} tokens, fewer than one context of {spec.context_length}: add text or lower data.context_length")
    if max(stream) >= model.config.vocab_size:
        raise TrainError(f"the tokenizer of {components!r} produces ids ≥ the model's vocab_size {model.config.vocab_size}: set data.components to the model's own tokenizer")
    return {"input_ids": torch.tensor(stream[: n * spec.context_length]).view(n, spec.context_length)}


def cached_text(spec: DataSpec, model, components: str | None) -> dict[str, torch.Tensor]:
    files = _text_files(Path(spec.path))
    return _cached(spec, _cache_key(spec, "llama", components, files), lambda: pack_text(spec, model, components))
