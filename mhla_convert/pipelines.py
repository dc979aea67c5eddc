"""`mhla-convert MODEL --pipeline`: a complete diffusers pipeline directory around a converted
transformer, which `DiffusionPipeline.from_pretrained` loads and runs (after `import mhla_convert`).

The source must be a pipeline: a directory or hub repo with model_index.json, whose other components
(text encoders, tokenizers, VAE, scheduler, ...) are copied file for file, or a built-in tiny model,
whose family's tiny components are saved. The transformer is saved as an MHLA checkpoint in
transformer/ and model_index.json names its converted class (diffusers_models.py). The directory is
written atomically, as `save_pretrained` writes a checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torch import nn

from .families import adapter_for_config, adapter_for_family, adapter_for_model
from .locations import HUB_ERRORS, PIPELINE_SUBFOLDER, hub_unreachable
from .models import Source, tiny_models

MODEL_INDEX = "model_index.json"
NOT_COPIED = (PIPELINE_SUBFOLDER, MODEL_INDEX, "README.md")  # the base model's card does not describe the result


def check_pipeline_source(source: Source) -> None:
    """Refuse, before anything is loaded, a source `save_pipeline` cannot complete into a pipeline."""
    family = tiny_models()[source.location][0] if source.kind == "tiny" else None
    if source.kind in ("local", "hub"):
        family = adapter_for_config(source.config).name
    if family is None or adapter_for_family(family).library != "diffusers":
        raise ValueError("--pipeline writes a diffusers pipeline: give a diffusion model (a pipeline directory or "
                         "hub repo, or a tiny model), or drop --pipeline")
    if source.kind != "tiny" and (source.subfolder != PIPELINE_SUBFOLDER or MODEL_INDEX not in source.files):
        raise ValueError(f"--pipeline needs the whole pipeline to copy its other components from: {source.location} "
                         f"has no {MODEL_INDEX}; give the pipeline's directory or hub repo, or drop --pipeline")


def _source_folder(source: Source) -> Path:
    if source.kind == "local":
        return Path(source.location)
    from diffusers import DiffusionPipeline

    try:  # the files diffusers itself would load (the transformer's are already in the cache)
        return Path(DiffusionPipeline.download(source.location, revision=source.revision))
    except HUB_ERRORS as error:
        raise hub_unreachable(source.location, error) from error


def _copy_pipeline(models: dict[str, nn.Module], folder: Path, staging: Path, max_shard_size) -> None:
    from .io import save_pretrained

    for entry in folder.iterdir():
        if entry.name in (*NOT_COPIED, *models) or entry.name.startswith("."):
            continue
        if entry.is_dir():
            shutil.copytree(entry, staging / entry.name)
        else:
            shutil.copy2(entry, staging / entry.name)
    index = json.loads((folder / MODEL_INDEX).read_text())
    index.pop("_name_or_path", None)  # where diffusers loaded the source from: a local path, often
    for name, model in models.items():
        save_pretrained(model, staging / name, max_shard_size=max_shard_size)
        index[name] = [type(model).__module__, type(model).__name__]
    (staging / MODEL_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def save_pipeline(transformer, source: Source, directory, *, max_shard_size: int | str = "5GB") -> Path:
    """Save the converted `transformer` (or a pipeline's converted `experts.Experts`) with the rest of `source`'s
    pipeline to `directory`."""
    from .experts import Experts
    from .io import check_save_target, write_atomically

    check_pipeline_source(source)
    directory = check_save_target(directory)
    if source.kind == "tiny":
        from .train.components import pipeline

        pipe = pipeline(adapter_for_model(transformer).name, transformer, source.location)
        return write_atomically(directory, lambda staging: pipe.save_pretrained(staging,
                                                                                max_shard_size=max_shard_size))
    folder = _source_folder(source)
    models = transformer.models if isinstance(transformer, Experts) else {PIPELINE_SUBFOLDER: transformer}
    return write_atomically(directory, lambda staging: _copy_pipeline(models, folder, staging, max_shard_size))
