"""Where base models come from: CLI aliases, built-in tiny models, local directories, hub ids.

`load_model(spec)` accepts any of them; the family is always detected from the model's own
config (`adapter_for_config`), so a hub id or directory of a supported class needs no alias.
Diffusers pipelines keep the transformer in a `transformer/` subfolder, which is found here; another
subfolder is named with `subfolder`. A single weights file (ComfyUI / original-format checkpoints)
loads through diffusers' `from_single_file` where the family's class has it, its config from
`config` (a model or pipeline directory, or hub id) or else diffusers' guess from the weights.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .experts import index_experts, refuse_one_expert
from .families import adapter_for_config, adapter_for_family, families
from .locations import (
    HUB_ERRORS,
    HUB_ID,
    MHLA_CONFIG,
    PIPELINE_SUBFOLDER,
    SOURCE_ATTR,
    TRANSPORT_ERRORS,
    checkpoint_dir,
    hub_offline,
    hub_unreachable,
    is_companion,
    read_json,
)
from .placement import check_device, keep_fp32_modules, loader_device, loader_dtype, parse_dtype, place_model

# The weight files diffusers' `from_pretrained` reads by default (no variant), single or sharded.
DIFFUSERS_WEIGHTS = re.compile(r"diffusion_pytorch_model(-\d+-of-\d+)?\.safetensors")
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")


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
    check_device(device)
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

    kind: str  # "tiny", "converted" (an MHLA checkpoint), "local", "hub" or "single_file"
    location: str  # tiny name, directory, hub id or weights file
    subfolder: str | None = None
    revision: str | None = None
    config: dict[str, Any] | None = None  # the base model's config (not for tiny / converted)
    files: frozenset[str] = frozenset()  # the files of the model directory or hub repo (not for tiny / converted)
    config_source: str | None = None  # single_file: the directory or hub id its config came from
    hub: dict[str, Any] = field(default_factory=dict, repr=False)  # token, local_files_only, cache_dir (hub_options)
    # a pipeline's experts when it has several (Wan2.2-A14B: transformer, transformer_2): converted together
    experts: tuple[str, ...] = ()

    def describe(self) -> str:
        where = self.location + (f" (subfolder {self.subfolder})" if self.subfolder else "")
        return {
            "tiny": f"built-in tiny model {where} (random weights)",
            "converted": f"MHLA checkpoint {where}",
            "local": f"local model {where}",
            "hub": f"hub model {where}" + (f" @ {self.revision[:12]}" if self.revision else ""),
            "single_file": f"single-file checkpoint {self.location}",
        }[self.kind]


def _local_source(path: Path, subfolder: str | None = None) -> Source:
    if subfolder is not None:
        if not (path / subfolder).is_dir():
            folders = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
            raise ValueError(f"{path} has no subfolder {subfolder!r}; its folders: {', '.join(folders) or 'none'}")
        if (path / subfolder / MHLA_CONFIG).is_file():
            return Source("converted", str(path / subfolder))
    elif (checkpoint_dir(path) / MHLA_CONFIG).is_file():  # a converted model, or a pipeline holding one
        return Source("converted", str(path))
    for folder in (subfolder,) if subfolder is not None else (None, PIPELINE_SUBFOLDER):
        config = path / (folder or "") / "config.json"
        if config.is_file():
            files = frozenset(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file())
            index = path / "model_index.json"
            experts = index_experts(read_json(index)) if folder != subfolder and index.is_file() else ()
            return Source("local", str(path), folder, config=read_json(config), files=files, experts=experts)
    if subfolder is not None:
        raise ValueError(f"{path / subfolder} holds no config.json: not a model folder")
    raise ValueError(f"{path} holds no config.json (nor {PIPELINE_SUBFOLDER}/config.json): not a model directory")


def hub_options(token=None, local_files_only: bool = False, cache_dir=None) -> dict[str, Any]:
    """The hub options the libraries' loaders and huggingface_hub take alike, those set. In offline mode
    (HF_HUB_OFFLINE) files come from the local cache alone, as the libraries' own loaders take them."""
    local_files_only = local_files_only or hub_offline()
    return {k: v for k, v in (("token", token), ("local_files_only", local_files_only), ("cache_dir", cache_dir))
            if v not in (None, False)}


def _hub_files(repo_id: str, revision: str | None, hub: dict[str, Any]) -> tuple[set[str], str]:
    """A hub repo's files and the commit `revision` names: from the Hub, or with local_files_only from the
    local cache (the files downloaded of that commit)."""
    if hub.get("local_files_only"):
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo_id, revision=revision, **hub))
        return {f.relative_to(folder).as_posix() for f in folder.rglob("*") if f.is_file()}, folder.name
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo_id, revision=revision, token=hub.get("token"))
    return {s.rfilename for s in info.siblings or []}, info.sha


def _hub_source(repo_id: str, revision: str | None, subfolder: str | None = None,
                hub: dict[str, Any] | None = None) -> Source:
    from huggingface_hub import hf_hub_download

    hub = hub or {}
    try:
        files, sha = _hub_files(repo_id, revision, hub)
        if subfolder is None and MHLA_CONFIG in files:
            return Source("converted", repo_id, revision=sha, hub=hub)
        if subfolder is not None and f"{subfolder}/config.json" not in files:
            raise ValueError(f"hub model {repo_id} has no {subfolder}/config.json: check --subfolder")
        experts = ()
        if subfolder is None and "model_index.json" in files:
            subfolder = PIPELINE_SUBFOLDER
            if f"{subfolder}/{MHLA_CONFIG}" in files:  # a pipeline holding a converted transformer
                return Source("converted", repo_id, subfolder, sha, hub=hub)
            experts = index_experts(read_json(Path(hf_hub_download(repo_id, "model_index.json", revision=sha, **hub))))
        config_file = hf_hub_download(repo_id, "config.json", subfolder=subfolder, revision=sha, **hub)
    except HUB_ERRORS as error:
        raise hub_unreachable(repo_id, error) from error
    return Source("hub", repo_id, subfolder, sha, json.loads(Path(config_file).read_text()), frozenset(files), hub=hub,
                  experts=experts)


def _single_file_source(path: Path, config: str | None, subfolder: str | None, revision: str | None,
                        hub: dict[str, Any]) -> Source:
    """A weights file: its family from `config` (a model or pipeline directory, or hub id), or
    from the hub repo diffusers' `fetch_diffusers_config` picks for the weights."""
    if path.suffix not in SINGLE_FILE_SUFFIXES:
        raise ValueError(f"{path} is a file but not a weights file ({', '.join(SINGLE_FILE_SUFFIXES)}); "
                         "give a model directory, a hub id or an alias (mhla-convert list)")
    if config is None:
        from diffusers.loaders.single_file_utils import fetch_diffusers_config, load_single_file_checkpoint

        config = fetch_diffusers_config(load_single_file_checkpoint(str(path)))["pretrained_model_name_or_path"]
    found = resolve(config, revision=revision, subfolder=subfolder, **hub)
    if found.kind not in ("local", "hub"):
        raise ValueError(f"--config {config} is {found.describe()}; give the base model's directory or hub id")
    return Source("single_file", str(path), found.subfolder, found.revision, found.config,
                  config_source=found.location, hub=hub)


def resolve(spec: str, *, revision: str | None = None, subfolder: str | None = None,
            config: str | None = None, token=None, local_files_only: bool = False, cache_dir=None) -> Source:
    """A tiny name, alias, local directory, hub id or weights file → where and what to load.
    `subfolder`: the model's folder inside a directory or hub repo; `config`: for a weights file,
    the directory or hub id of its config; `token`, `local_files_only`, `cache_dir`: for the Hub, as
    huggingface_hub and the libraries' loaders take them."""
    hub = hub_options(token, local_files_only, cache_dir)
    if spec in tiny_models():
        if subfolder is not None or config is not None:
            raise ValueError(f"{spec} is a built-in tiny model: it has no subfolders and needs no --config")
        return Source("tiny", spec)
    spec = aliases().get(spec, (None, spec))[1]
    from .io import resolve_saved

    path = resolve_saved(spec)  # a save cut off between its two renames is settled first
    if path.is_file():
        return _single_file_source(path, config, subfolder, revision, hub)
    if config is not None:
        raise ValueError("--config is for single-file checkpoints (a weights file); a directory or hub id has its own")
    if path.exists():
        return _local_source(path, subfolder)
    if spec.startswith((".", "/", "~")):
        raise ValueError(f"{spec}: no such directory")
    if not HUB_ID.match(spec):
        raise ValueError(f"{spec!r} is neither an alias (see `mhla-convert list`), a directory nor a hub id")
    return _hub_source(spec, revision, subfolder, hub)


def load_model(spec: str, torch_dtype=None, device=None, *, dtype=None, device_map=None, revision: str | None = None,
               subfolder: str | None = None, config: str | None = None, token=None, local_files_only: bool = False,
               cache_dir=None) -> nn.Module:
    """Load a base model (or an MHLA checkpoint) from a tiny name, alias, directory, hub id or
    weights file (see `resolve`), with the libraries' loader options: `dtype` (or its older name
    `torch_dtype`; "auto" or None: as stored), `device_map` naming one device (or `device`), and `revision`,
    `subfolder`, `token`, `local_files_only`, `cache_dir`, passed on to transformers' or diffusers' loader."""
    torch_dtype = loader_dtype(dtype, torch_dtype)
    device = loader_device(device, device_map)
    source = resolve(spec, revision=revision, subfolder=subfolder, config=config, token=token,
                     local_files_only=local_files_only, cache_dir=cache_dir)
    return load_source(source, torch_dtype=torch_dtype, device=device)


def meta_model(adapter, config: dict[str, Any]) -> nn.Module:
    """The model `config` describes with its parameters on the meta device (no weights read, no
    init): what options are checked against before a download or a load."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return adapter.build(config)


def source_meta_model(source: Source) -> nn.Module | None:
    """`source`'s model on the meta device, from its config alone; None for a converted checkpoint."""
    if source.kind == "converted":
        return None
    if source.kind == "tiny":
        family, config = tiny_models()[source.location]
        return meta_model(adapter_for_family(family), config)
    return meta_model(adapter_for_config(source.config), source.config)


def load_source(source: Source, torch_dtype=None, device=None) -> nn.Module:
    if source.experts:  # one model of two would be half the pipeline
        raise refuse_one_expert(source.location, source.experts)
    if source.kind == "tiny":
        return tiny_model(source.location, torch_dtype=torch_dtype, device=device)
    if source.kind == "converted":
        from .io import from_pretrained

        return from_pretrained(source.location, subfolder=source.subfolder, torch_dtype=torch_dtype, device=device,
                               revision=source.revision, **source.hub)
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
    } | source.hub
    try:
        if source.kind == "single_file":
            model = adapter.load_single_file(source.location, config=source.config_source, **kwargs)
        else:
            model = adapter.load_pretrained(source.location, **kwargs)
    except TRANSPORT_ERRORS as error:  # the download broke off; the libraries report other failures themselves
        raise hub_unreachable(source.location, error) from error
    if adapter.library == "diffusers":
        keep_fp32_modules(model)
    setattr(model, SOURCE_ATTR, _loaded_from(source, adapter.library))
    return place_model(model, None, device).eval()


def _loaded_from(source: Source, library: str) -> dict[str, Any]:
    """A loaded base model's SOURCE_ATTR: a hub base by its id; a local one by its folder in memory only, and in a
    checkpoint by its folder's name and its model card's license and task (what a card of the result carries)."""
    # a single file's other pipeline parts (VAE, text encoder) come from where its config came from
    base = source.config_source if source.kind == "single_file" else source.location
    on_hub = source.kind == "hub" or (source.kind == "single_file" and not Path(base).exists())
    found = {"base_model": base if on_hub else None, "revision": source.revision, "subfolder": source.subfolder,
             "companions": companion_files(source) if library == "transformers" else {}}
    if on_hub:
        return found
    from .hub import _base_card_data

    card = _base_card_data(base, None, source.subfolder)
    return {**found, "components": base, "name": Path(base).resolve().name,
            "card": {k: card[k] for k in ("license", "license_name", "pipeline_tag") if card.get(k)} or None}


def companion_files(source: Source) -> dict[str, str]:
    """The `COMPANIONS` of a local or hub base (name in the checkpoint -> local file, a hub repo's from the cache):
    each from the model's subfolder where it has one, else from the folder or repo root, as the source has them."""
    if source.kind not in ("local", "hub"):
        return {}
    chosen = {}
    for folder in ("", *([f"{source.subfolder}/"] if source.subfolder else [])):  # the subfolder's copy wins
        chosen.update({name[len(folder):]: name for name in sorted(source.files)
                       if name.startswith(folder) and is_companion(name[len(folder):])})
    if source.kind == "local":
        return {name: str(Path(source.location) / path) for name, path in chosen.items()}
    from huggingface_hub import hf_hub_download

    try:
        return {name: hf_hub_download(source.location, path, revision=source.revision, **source.hub)
                for name, path in chosen.items()}
    except HUB_ERRORS as error:
        raise hub_unreachable(source.location, error) from error


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
    if source.kind == "single_file":
        names = []
        if source.location.endswith(".safetensors"):
            counts.update(_local_parameter_count(Path(source.location)))
    for name in names:
        if source.kind == "local":
            counts.update(_local_parameter_count(Path(source.location) / name))
            continue
        from huggingface_hub import HfApi, hf_hub_download

        try:
            if source.hub.get("local_files_only"):  # the cached file's header
                counts.update(_local_parameter_count(Path(hf_hub_download(
                    source.location, name, revision=source.revision, **source.hub))))
                continue
            counts.update(HfApi().parse_safetensors_file_metadata(
                source.location, name, revision=source.revision, token=source.hub.get("token")).parameter_count)
        except HUB_ERRORS as error:
            raise hub_unreachable(source.location, error) from error
    floating = [(count, name) for name, count in counts.items() if name in SAFETENSORS_DTYPES]
    return SAFETENSORS_DTYPES[max(floating)[1]] if floating else None
