"""Held-out examples for evaluation: what training accepts (the built-in synthetic set, precomputed
latents, image/video folders, text for LMs; encoded through the training package with the same
on-disk cache), cut to the first N examples in order and split into fixed batches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from ..families import FamilyAdapter
from ..train.data import build_dataset
from ..train.errors import TrainError
from ..train.recipe import DataSpec
from .errors import EvalError
from .models import config_value, is_language_model

TEXT_SUFFIXES = (".txt", ".json", ".jsonl", ".parquet")
KIND_HINT = ("'synthetic', a .safetensors file or folder of latents, an image/video folder with metadata.jsonl, "
             "or text (LMs)")


def _kind_of(path: Path) -> str:
    if path.is_file():
        if path.suffix == ".safetensors":
            return "latents"
        if path.suffix in TEXT_SUFFIXES:
            return "text"
    elif path.is_dir():
        if (path / "metadata.jsonl").is_file():
            return "folder"
        if any(path.glob("*.safetensors")):
            return "latents"
        if any(p.suffix in TEXT_SUFFIXES for p in path.rglob("*") if ".mhla_cache" not in p.parts):
            return "text"
    raise EvalError(f"cannot tell what data {path} holds; give {KIND_HINT}")


def data_spec(data: str | Path | DataSpec, options: dict | None = None) -> DataSpec:
    """`data` as a training DataSpec (its kind read from the path), checked before any model loads.
    "synthetic" is the set a recipe with `data.kind: synthetic` trains on (its num_samples and the
    seed decide every example, so the default is the recipe's)."""
    if isinstance(data, DataSpec):
        return data
    fields = {f.name for f in dataclasses.fields(DataSpec)} - {"kind", "path"}
    unknown = sorted(set(options or {}) - fields)
    if unknown:
        raise EvalError(f"unknown data option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(fields))}")
    if str(data) == "synthetic":
        return DataSpec(kind="synthetic", **(options or {}))
    path = Path(data).expanduser()
    if not path.exists():
        raise EvalError(f"data {path} does not exist; give {KIND_HINT}")
    return DataSpec(kind=_kind_of(path), path=str(path), **(options or {}))


def _check_kind(spec: DataSpec, adapter: FamilyAdapter) -> None:
    if spec.kind == "text" and not is_language_model(adapter):
        raise EvalError(f"{spec.path} is text, but a {adapter.name} model is scored on latents: give latents, "
                        "an image/video folder or 'synthetic'")
    if spec.kind == "folder" and is_language_model(adapter):
        raise EvalError(f"{spec.path} is an image/video folder, but a language model is scored on text: "
                        "give a text file or folder (.txt, .jsonl, .json, .parquet) or 'synthetic'")


def required_columns(adapter: FamilyAdapter, model: nn.Module) -> list[str]:
    """What the family's objective reads from a batch of this model's data: the columns of its
    built-in synthetic training set (one example of it)."""
    return list(adapter.synthetic_data(model, DataSpec(kind="synthetic", num_samples=1), seed=0))


def check_fits(columns: dict[str, torch.Tensor], adapter: FamilyAdapter, model: nn.Module, source: str) -> None:
    """The data holds what the family's objective reads, in the model's shapes."""
    required = required_columns(adapter, model)
    missing = [c for c in required if c not in columns]
    if missing:
        raise EvalError(f"{source} has {', '.join(sorted(columns))} but a {adapter.name} model is scored on "
                        f"{', '.join(required)}: missing {', '.join(missing)}; give data made for this family")
    if is_language_model(adapter):
        ids, vocab = columns["input_ids"], config_value(model, "vocab_size")
        if ids.ndim != 2 or ids.shape[1] < 2:
            raise EvalError(f"{source}: input_ids must be (examples, tokens) with at least 2 tokens; "
                            f"got {tuple(ids.shape)}")
        if int(ids.max()) >= vocab:
            raise EvalError(f"{source} holds token ids up to {int(ids.max())} but the model's vocabulary has {vocab}: "
                            "tokenize with the model's own tokenizer (data option components)")
        return
    latents = columns["latents"]
    channels = adapter.latent_channels(model)
    ndim = 5 if adapter.video else 4
    if latents.ndim != ndim or latents.shape[1] != channels:
        raise EvalError(f"{source}: latents of shape {tuple(latents.shape[1:])} do not fit this {adapter.name} model, "
                        f"which takes {channels} channels ({ndim - 1}-d per example): encode them with its own VAE")


def check_tokenizer(source: str | None) -> None:
    """A text corpus is tokenized with the tokenizer of `source` (data option components, else the base
    model): refuse one that has none before anything is scored."""
    from ..train.components import tokenizer

    fix = ("give --components (data_options={'components': ...} in Python): the directory or hub id of the "
           "model whose tokenizer it was trained with, or pretokenized input_ids (.safetensors)")
    if source is None:
        raise EvalError(f"this model has no tokenizer; it records no base model to take one from: {fix}")
    try:
        tokenizer(source)
    except (TrainError, OSError, ValueError):  # transformers: OSError, or ValueError for a folder without one
        raise EvalError(f"this model has no tokenizer; {source} holds none: {fix}") from None


def held_out(spec: DataSpec, adapter: FamilyAdapter, model: nn.Module, *, num_examples: int, seed: int,
             components: str | None) -> dict[str, torch.Tensor]:
    """The first `num_examples` examples, in order, column-wise."""
    _check_kind(spec, adapter)
    if spec.kind == "text":
        check_tokenizer(spec.components or components)
    try:
        dataset = build_dataset(spec, adapter, model, seed=seed, components=spec.components or components)
    except TrainError as error:
        raise EvalError(str(error)) from None
    columns = {k: v[:num_examples] for k, v in dataset.columns.items()}
    check_fits(columns, adapter, model, spec.path or "the synthetic data")
    return columns
