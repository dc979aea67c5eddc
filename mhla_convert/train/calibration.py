"""Calibration batches for `strategy: auto`: a few training examples turned into the keyword
inputs the model is called with in training (LMs: the token ids; diffusion transformers: the
noised latents at a sampled timestep and the family's conditioning). Seeded, so the layer
selection they drive is deterministic."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from .data import build_dataset
from .encode import text_files
from .errors import TrainError
from .recipe import DataSpec, ObjectiveSpec


class _Called(Exception):
    pass


class _Recorder:
    """Stands in for the model in an objective: reads through to the model, records the call, stops there."""

    def __init__(self, model):
        self._model = model
        self.call: tuple[tuple, dict] | None = None

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        self.call = (args, kwargs)
        raise _Called


def model_inputs(adapter, model, batch: dict[str, torch.Tensor], generator: torch.Generator,
                 objective: ObjectiveSpec | None = None) -> dict[str, Any]:
    """The keyword inputs the family's training objective (`adapter.objective`) calls `model` with on `batch`."""
    recorder = _Recorder(model)
    try:
        adapter.objective(objective or ObjectiveSpec()).loss(recorder, batch, generator)
    except _Called:
        pass
    if recorder.call is None:
        raise RuntimeError(f"the {adapter.name} objective did not call the model")
    args, kwargs = recorder.call
    names = list(inspect.signature(model.forward).parameters)
    inputs = {**dict(zip(names, args)), **kwargs}
    inputs.pop("labels", None)  # the LM loss: the output is scored, not the loss
    return inputs


def calibration_batches(adapter, model, spec: DataSpec, *, num_batches: int, seed: int = 0,
                        objective: ObjectiveSpec | None = None, components: str | None = None) -> list[dict[str, Any]]:
    """`num_batches` batches of `spec.batch_size` examples (a seeded draw from the data), as model inputs."""
    check_calibration_kind(adapter, spec)
    dataset = build_dataset(spec, adapter, model, seed=seed, components=components)
    num_batches = min(num_batches, len(dataset) // spec.batch_size)
    if num_batches < 1:
        raise TrainError(f"calibration needs at least data.batch_size ({spec.batch_size}) examples; "
                         f"the data has {len(dataset)}")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(dataset), generator=generator).tolist()
    weight = next(model.parameters())
    batches = []
    for b in range(num_batches):
        examples = default_collate([dataset[i] for i in order[b * spec.batch_size:(b + 1) * spec.batch_size]])
        examples = {k: v.to(weight.device, weight.dtype if v.is_floating_point() else None)
                    for k, v in examples.items()}
        batches.append(model_inputs(adapter, model, examples, generator, objective))
    return batches


def check_calibration_kind(adapter, spec: DataSpec) -> None:
    """Refuse calibration data of a kind the family is not called on (text for a diffusion model, images for an
    LM): known from the family alone, so before the model's weights load."""
    language_model = adapter.library == "transformers"
    if spec.kind == "text" and not language_model:
        raise TrainError(f"calibration data {spec.path} is text, but a {adapter.name} model is calibrated on latents: "
                         "give 'synthetic', latents (.safetensors) or an image/video folder with metadata.jsonl")
    if spec.kind == "folder" and language_model:
        raise TrainError(f"calibration data {spec.path} is an image/video folder, but a language model is calibrated "
                         "on text: give 'synthetic' or text files (.txt, .jsonl, .json, .parquet)")


def calibration_data(source: str, *, batch_size: int = 1, num_samples: int = 8) -> DataSpec:
    """A data section for `--calibration SOURCE`: "synthetic" (the family's built-in data), latents
    (a .safetensors file or a directory of them), an image/video folder (with metadata.jsonl) or text."""
    if source == "synthetic":
        return DataSpec(kind="synthetic", batch_size=batch_size, num_samples=num_samples)
    path = Path(source).expanduser()
    if not path.exists():
        raise TrainError(f"calibration data {source} does not exist: give 'synthetic', latents (.safetensors), "
                         "an image/video folder with metadata.jsonl, or text files")
    if path.suffix == ".safetensors" or (path.is_dir() and any(path.glob("*.safetensors"))):
        kind = "latents"
    elif path.is_dir() and (path / "metadata.jsonl").is_file():
        kind = "folder"
    else:
        kind = "text"
        text_files(path)  # there is text to read
    return DataSpec(kind=kind, path=str(path), batch_size=batch_size)
