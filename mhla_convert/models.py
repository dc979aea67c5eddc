"""Where base models come from: CLI aliases, built-in tiny models, local directories, hub ids.

`load_model(spec)` accepts any of them; the family is always detected from the model's own
config (`adapter_for_config`), so a hub id or directory of a supported class needs no alias.
Diffusers pipelines keep the transformer in a `transformer/` subfolder, which is found here.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .families import adapter_for_config, adapter_for_family, families
from .locations import (
    HUB_ERRORS,
    HUB_ID,
    MHLA_CONFIG,
    PIPELINE_SUBFOLDER,
    SOURCE_ATTR,
    TRANSPORT_ERRORS,
    checkpoint_dir,
    hub_unreachable,
)
from .placement import parse_dtype, place_model

# The weight files diffusers' `from_pretrained` reads by default (no variant), single or sharded.
DIFFUSERS_WEIGHTS = re.compile(r"diffusion_pytorch_model(-\d+-of-\d+)?\.safetensors")
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def aliases() -> dict[str, tuple[str, str]]:
    """alias -> (family, hub id), as each adapter declares them."""
    return {alias: (name, hub_id) for name, cls in sorted(families().items()) for alias, hub_id in cls.aliases.items()}


def tiny_models() -> dict[str, tuple[str, dict[str, Any]]]:
    """tiny model name -> (family, config): random-weight models for offline use, demo and tests."""
    out = {}
    for name, cls in sorted(families().items()):
        try:
            out.update({tiny: (name, config) for tiny, config in cls().tiny_configs().items()})
        except NotImplementedError:
            continue
    return out


def tiny_model(name: str, *, seed: int = 0, torch_dtype=None, device=None) -> nn.Module:
    """A built-in tiny model with reproducible random weights (the global RNG is left untouched)."""
    models = tiny_models()
    if name not in models:
        raise ValueError(f"unknown tiny model {name!r}; built-in: {', '.join(models)}")
    family, config = models[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = adapter_for_family(family).build(config)
    setattr(model, SOURCE_ATTR, {"base_model": name, "revision": None, "subfolder": None})
    return place_model(model, torch_dtype, device).eval()


@dataclass
class Source:
    """What a model spec resolved to."""

    kind: str  # "tiny", "converted" (an MHLA checkpoint), "local" or "hub"
    location: str  # tiny name, directory or hub id
    subfolder: str | None = None
    revision: str | None = None
    config: dict[str, Any] | None = None  # the base model's config (not for tiny / converted)
    files: frozenset[str] = frozenset()  # the files of the model directory or hub repo (not for tiny / converted)

    def describe(self) -> str:
        where = self.location + (f" (subfolder {self.subfolder})" if self.subfolder else "")
        return {
            "tiny": f"built-in tiny model {where} (random weights)",
            "converted": f"MHLA checkpoint {where}",
            "local": f"local model {where}",
            "hub": f"hub model {where}" + (f" @ {self.revision[:12]}" if self.revision else ""),
        }[self.kind]


def _local_source(path: Path) -> Source:
    if (checkpoint_dir(path) / MHLA_CONFIG).is_file():  # a converted model, or a pipeline holding one
        return Source("converted", str(path))
    for subfolder in (None, PIPELINE_SUBFOLDER):
        config = path / (subfolder or "") / "config.json"
        if config.is_file():
            files = frozenset(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file())
            return Source("local", str(path), subfolder, config=json.loads(config.read_text()), files=files)
    raise ValueError(f"{path} holds no config.json (nor {PIPELINE_SUBFOLDER}/config.json): not a model directory")


def _hub_source(repo_id: str, revision: str | None) -> Source:
    from huggingface_hub import HfApi, hf_hub_download

    try:
        info = HfApi().model_info(repo_id, revision=revision)
        files = {s.rfilename for s in info.siblings or []}
        if MHLA_CONFIG in files:
            return Source("converted", repo_id, revision=info.sha)
        subfolder = PIPELINE_SUBFOLDER if "model_index.json" in files else None
        if subfolder and f"{subfolder}/{MHLA_CONFIG}" in files:  # a pipeline holding a converted transformer
            return Source("converted", repo_id, subfolder, info.sha)
        config_file = hf_hub_download(repo_id, "config.json", subfolder=subfolder, revision=info.sha)
    except HUB_ERRORS as error:
        raise hub_unreachable(repo_id, error) from error
    return Source("hub", repo_id, subfolder, info.sha, json.loads(Path(config_file).read_text()), frozenset(files))


def resolve(spec: str, *, revision: str | None = None) -> Source:
    """A tiny name, alias, local directory or hub id → where and what to load."""
    if spec in tiny_models():
        return Source("tiny", spec)
    spec = aliases().get(spec, (None, spec))[1]
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{spec} is a file; give a model directory, a hub id or an alias (mhla-convert list)")
        return _local_source(path)
    if spec.startswith((".", "/", "~")):
        raise ValueError(f"{spec}: no such directory")
    if not HUB_ID.match(spec):
        raise ValueError(f"{spec!r} is neither an alias (see `mhla-convert list`), a directory nor a hub id")
    return _hub_source(spec, revision)


def load_model(spec: str, torch_dtype=None, device=None, *, revision: str | None = None) -> nn.Module:
    """Load a base model (or an MHLA checkpoint) from a tiny name, alias, directory or hub id."""
    return load_source(resolve(spec, revision=revision), torch_dtype=torch_dtype, device=device)


def load_source(source: Source, torch_dtype=None, device=None) -> nn.Module:
    if source.kind == "tiny":
        return tiny_model(source.location, torch_dtype=torch_dtype, device=device)
    if source.kind == "converted":
        from .io import from_pretrained

        return from_pretrained(source.location, subfolder=source.subfolder, torch_dtype=torch_dtype, device=device,
                               revision=source.revision)
    adapter = adapter_for_config(source.config)
    # transformers keeps the stored dtype by itself (dtype="auto"); diffusers loads float32 unless told
    dtype = parse_dtype(torch_dtype) or (stored_dtype(source) if adapter.library == "diffusers" else None)
    kwargs = {
        k: v
        for k, v in (
            ("subfolder", source.subfolder),
            ("revision", source.revision),
            ("torch_dtype", dtype),
        )
        if v is not None
    }
    try:
        model = adapter.load_pretrained(source.location, **kwargs)
    except TRANSPORT_ERRORS as error:  # the download broke off; the libraries report other failures themselves
        raise hub_unreachable(source.location, error) from error
    setattr(
        model, SOURCE_ATTR, {"base_model": source.location, "revision": source.revision, "subfolder": source.subfolder}
    )
    return place_model(model, None, device).eval()


def _local_parameter_count(path: Path) -> dict[str, int]:
    """Elements per safetensors dtype name in a local file, from its header alone."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    counts: Counter[str] = Counter()
    for name, info in header.items():
        if name != "__metadata__":
            counts[info["dtype"]] += math.prod(info["shape"])
    return counts


def stored_dtype(source: Source) -> torch.dtype | None:
    """The floating dtype holding most of a diffusers source's weights, read from the safetensors
    headers (over the Hub: the headers only, not the weights); None when it has no such files."""
    folder = f"{source.subfolder}/" if source.subfolder else ""
    names = [f for f in source.files if f.startswith(folder) and DIFFUSERS_WEIGHTS.fullmatch(f[len(folder):])]
    counts: Counter[str] = Counter()
    for name in names:
        if source.kind == "local":
            counts.update(_local_parameter_count(Path(source.location) / name))
            continue
        from huggingface_hub import HfApi

        try:
            counts.update(HfApi().parse_safetensors_file_metadata(
                source.location, name, revision=source.revision).parameter_count)
        except HUB_ERRORS as error:
            raise hub_unreachable(source.location, error) from error
    floating = [(count, name) for name, count in counts.items() if name in SAFETENSORS_DTYPES]
    return SAFETENSORS_DTYPES[max(floating)[1]] if floating else None


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
GENERATION_CONFIG = "generation_config.json"


def save_companions(source: Source, directory) -> list[str]:
    """Save a transformers source's tokenizer (with its chat template) and generation config into
    `directory` beside a converted model, through transformers' own loaders and writers, so the
    checkpoint is usable on its own. What the source lacks is skipped. Returns what was saved."""
    if source.kind not in ("local", "hub") or adapter_for_config(source.config).library != "transformers":
        return []
    from transformers import AutoTokenizer, GenerationConfig

    saved = []
    try:
        if any(name in source.files for name in TOKENIZER_FILES):
            AutoTokenizer.from_pretrained(source.location, revision=source.revision).save_pretrained(directory)
            saved.append("tokenizer")
        if GENERATION_CONFIG in source.files:
            GenerationConfig.from_pretrained(source.location, revision=source.revision).save_pretrained(directory)
            saved.append("generation config")
    except TRANSPORT_ERRORS as error:
        raise hub_unreachable(source.location, error) from error
    return saved
