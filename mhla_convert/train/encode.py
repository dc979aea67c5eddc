"""Encode once, reuse after: image/video folders (Hugging Face `imagefolder` / `videofolder`
layout: files plus `metadata.jsonl` with `file_name` and a caption or label column) go through the
family's own VAE and text encoder (its pipeline's `encode_prompt`; for Wan image-to-video also the
first frame's condition latents and CLIP image embeddings); text corpora are tokenized and
packed to the context length. Results land in `cache_dir/<key>/`, one safetensors file per column
written batch by batch and read back memory-mapped (shards.py); the key hashes everything that
changes the tensors, so a second run with the same data skips encoding."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..locations import one_line
from ..ops.blocks import whole_number
from .components import pipeline, tokenizer
from .errors import TrainError
from .recipe import DataSpec
from .shards import load_shards, save_shards

VIDEO_SUFFIXES = {".mp4", ".webm", ".mov", ".avi", ".mkv", ".gif"}
CACHE_LAYOUT = "column-files"  # in the key: caches of another layout are encoded afresh


def _cache_key(spec: DataSpec, task: str, components: str | None, files: list[Path]) -> str:
    h = hashlib.sha256()
    fields = {k: getattr(spec, k) for k in ("kind", "height", "width", "num_frames", "caption_column", "label_column",
                                            "max_text_length", "text_column", "text_format", "context_length")}
    h.update(json.dumps([task, components, __version__, CACHE_LAYOUT, fields], sort_keys=True, default=str).encode())
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
    save_shards(build(), target, {"source": str(spec.path)})
    columns = load_shards(target)
    print(f"encoded {len(next(iter(columns.values())))} examples into {target}")
    return columns


# --- image / video folders -----------------------------------------------------------------------


def _metadata_lines(root: Path) -> list[tuple[int, dict]]:
    """(line number, row) of every example in root/metadata.jsonl; a malformed line or a file_name of
    no file is refused naming the line."""
    meta = root / "metadata.jsonl"
    if not meta.is_file():
        raise TrainError(
            f'{root} has no metadata.jsonl: add one line per file, e.g. {{"file_name": "a.png", "text": "a caption"}}'
        )
    rows = []
    for number, line in enumerate(meta.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrainError(f'{meta}:{number}: not valid JSON ({exc.msg}); each line is one object like '
                             '{"file_name": "a.png", "text": "a caption"}') from None
        if not isinstance(row, dict) or not isinstance(row.get("file_name"), str) or not (
                root / row["file_name"]).is_file():
            raise TrainError(f"{meta}:{number}: every line needs a file_name of an existing file; got {row}")
        rows.append((number, row))
    if not rows:
        raise TrainError(f"{meta} is empty: the dataset needs at least one example")
    return rows


def _metadata(root: Path) -> list[dict]:
    return [row for _, row in _metadata_lines(root)]


def _check_conditions(root: Path, rows: list[tuple[int, dict]], adapter, transformer, spec: DataSpec) -> None:
    """Each line's condition: a class label within the model's classes (class-conditional families),
    else a caption."""
    meta = root / "metadata.jsonl"
    classes = getattr(adapter, "num_classes", lambda model: None)(transformer)
    for number, row in rows:
        if classes is None:
            if spec.caption_column not in row:
                raise TrainError(f'{meta}:{number}: needs a caption under "{spec.caption_column}" '
                                 "(or set data.caption_column)")
            continue
        label = row.get(spec.label_column)
        value = int(label) if isinstance(label, str) and label.isdigit() else whole_number(label)
        if value is None or not 0 <= value < classes:
            raise TrainError(f'{meta}:{number}: "{spec.label_column}" must be a class label 0 … {classes - 1} '
                             f"(the model has {classes} classes); got {label!r}")


def _check_readable(root: Path, rows: list[tuple[int, dict]], video: bool) -> None:
    """Decode every file once before encoding starts, so a damaged one fails naming its line, not mid-encode."""
    import imageio.v2 as imageio

    for number, row in rows:
        path = root / row["file_name"]
        try:
            if video:
                with imageio.get_reader(path) as reader:
                    reader.get_data(0)
            else:
                imageio.imread(path)
        except Exception as exc:  # each image plugin raises its own error type for a damaged file
            raise TrainError(f"{root / 'metadata.jsonl'}:{number}: cannot read {path} "
                             f"({type(exc).__name__}: {one_line(exc)}); replace or remove the file") from None


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


@torch.no_grad()
def encode_folder(spec: DataSpec, adapter, transformer, components: str | None) -> Iterator[dict[str, torch.Tensor]]:
    """Every file of the folder through the family's VAE (`FamilyAdapter.encode_latents`), with its
    conditioning (`encode_conditions`: text embeddings, class labels, ...): one batch of columns
    per `encode_batch_size` files, float32 on the CPU."""
    root = Path(spec.path)
    rows = _metadata(root)
    pipe = pipeline(adapter.name, transformer, components)
    adapter.check_folder_spec(spec)
    adapter.check_pixel_size(pipe, transformer, {"data.height": spec.height, "data.width": spec.width})
    for start in range(0, len(rows), spec.encode_batch_size):
        chunk = rows[start : start + spec.encode_batch_size]
        pixels = torch.stack([_read(root / r["file_name"], spec, video=adapter.video) for r in chunk])
        columns = {"latents": adapter.encode_latents(pipe.vae, pixels)}
        columns.update(adapter.encode_conditions(pipe, transformer, chunk, pixels, columns["latents"], spec))
        yield {k: (v.float() if v.is_floating_point() else v).cpu() for k, v in columns.items()}


def cached_folder(spec: DataSpec, adapter, transformer, components: str | None) -> dict[str, torch.Tensor]:
    root = Path(spec.path)
    rows = _metadata_lines(root)
    _check_conditions(root, rows, adapter, transformer, spec)
    files = [root / "metadata.jsonl", *(root / r["file_name"] for _, r in rows)]
    key = _cache_key(spec, adapter.cache_name(transformer), components, files)

    def build():
        _check_readable(root, rows, adapter.video)
        return encode_folder(spec, adapter, transformer, components)

    return _cached(spec, key, build)


# --- text corpora --------------------------------------------------------------------------------


def text_files(path: Path) -> list[Path]:
    """The text file `path`, or those in the folder `path`; refused (TrainError) when there is no text."""
    files = [path] if path.is_file() else sorted(
        p
        for p in path.rglob("*")
        if p.suffix in (".json", ".jsonl", ".txt", ".parquet") and ".mhla_cache" not in p.parts
    )
    if not files:
        raise TrainError(f"{path} holds no .jsonl / .json / .txt / .parquet files")
    if not any(f.stat().st_size for f in files):
        raise TrainError(f"{path} holds no text: its {'files are' if len(files) > 1 else 'file is'} empty; "
                         "give a corpus with text in it")
    return files


@contextmanager
def _datasets_quiet():
    """datasets without its progress bars and its own logging of a file it cannot parse (the error is ours)."""
    from datasets.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity(logging.CRITICAL)
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def _bad_json_line(files: list[Path]) -> str | None:
    """`file:line: problem` for the first line of a .jsonl file that is not valid JSON, if there is one."""
    for file in (f for f in files if f.suffix == ".jsonl"):
        with file.open(encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                try:
                    if line.strip():
                        json.loads(line)
                except json.JSONDecodeError as exc:
                    return f"{file}:{number}: not valid JSON ({exc.msg})"
    return None


def pack_text(spec: DataSpec, model, components: str | None) -> dict[str, torch.Tensor]:
    import datasets

    files = text_files(Path(spec.path))
    fmt = spec.text_format
    if fmt == "auto":
        fmt = {".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet"}[files[0].suffix]
    try:
        with _datasets_quiet():
            ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except datasets.exceptions.DatasetGenerationError as exc:
        problem = _bad_json_line(files) or one_line(exc.__cause__ or exc)
        raise TrainError(f"cannot read {spec.path} as {fmt}: {problem}; fix or remove it") from None
    if spec.text_column not in ds.column_names:
        raise TrainError(
            f"data.text_column {spec.text_column!r} is not in {spec.path}; columns: {', '.join(ds.column_names)}"
        )
    tok = tokenizer(components)
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
    stream: list[int] = []
    for text in ds[spec.text_column]:
        stream.extend(tok(text, add_special_tokens=False)["input_ids"] + [eos])
    n = len(stream) // spec.context_length
    if n == 0:
        raise TrainError(
            f"{spec.path} has {len(stream)} tokens, fewer than one context of {spec.context_length}: "
            "add text or lower data.context_length"
        )
    if max(stream) >= model.config.vocab_size:
        raise TrainError(
            f"the tokenizer of {components!r} produces ids ≥ the model's vocab_size {model.config.vocab_size}: "
            "set data.components to the model's own tokenizer"
        )
    return {"input_ids": torch.tensor(stream[: n * spec.context_length]).view(n, spec.context_length)}


def cached_text(spec: DataSpec, adapter, model, components: str | None) -> dict[str, torch.Tensor]:
    files = text_files(Path(spec.path))
    key = _cache_key(spec, adapter.cache_name(model), components, files)
    return _cached(spec, key, lambda: [pack_text(spec, model, components)])
