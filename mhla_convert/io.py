"""Save and reload converted models.

A converted model's class is a subclass of its base class (`MHLAWanTransformer3DModel`,
`MHLALlamaForCausalLM`; transformers_models.py, diffusers_models.py), so the libraries' own loaders
reload it as converted: `AutoModelForCausalLM.from_pretrained` (after `import mhla_convert`, or with
`trust_remote_code=True`), and diffusers pipelines through the component entry that class leaves in
model_index.json. `from_pretrained` here is the strict loader behind all of them for diffusers and
for old checkpoints: build the base architecture from its config (parameters on the meta device, no
throwaway init), redo the saved conversion plan, then load the state dict strictly with
`assign=True`. A checkpoint directory holds:

    config.json          the converted class's config: the base model's own config (family detection,
                         `adapter.build` after `adapter.base_config`), its converted class name
                         (`_class_name`; LMs: `architectures`, `model_type` mhla_<base> and `auto_map`)
                         and the conversion record under "mhla" (= mhla_config.json)
    model*.safetensors   diffusers transformers: the weights, sharded above `max_shard_size` (+
                         model.safetensors.index.json). Diffusers' stock loader reads other names, so
                         a base class's own `from_pretrained` fails on a converted folder rather than
                         dropping MHLA.
    mhla_model*.safetensors + mhla_model.safetensors.index.json (always written)
                         LMs: the weights under a name transformers' stock classes do not read
                         (`LlamaForCausalLM.from_pretrained` fails rather than loading softmax layers
                         with random weights); the converted config class names the index as its
                         `transformers_weights`, so the Auto classes read it
    mhla_loader.py       LMs: the module `auto_map` names, which imports mhla_convert
    tokenizer*, generation_config.json, ...
                         LMs: the base model's companion files (`locations.COMPANIONS`), copied byte for byte;
                         a built-in tiny LM's character tokenizer
    mhla_config.json     family, base model (a hub id or tiny name; never a local path), the plan
                         (layers, attention kind, how the layers were chosen and, for strategy "auto",
                         every layer's sensitivity), every MHLA option, package version

Format 1 (before converted classes) had the base model's config in config.json; format 2 had LM
weights as model*.safetensors. Both still load, here and (format 2) through the Auto classes.
Writes are atomic: everything goes to a hidden sibling `.NAME.tmp-*`, `mhla_config.json` last, and
only a complete directory is moved into place. A checkpoint it replaces is swapped with it in one
step where the system can (Linux `renameat2(RENAME_EXCHANGE)`), so the target is never missing, and
removed after; elsewhere it is first renamed aside to `.NAME.old-*`. A failed save removes its staging
folder. What a killed process leaves (one writer per target is assumed) is settled by whoever reads
or saves that target next: a checkpoint renamed aside is put back when the target is missing (a kill
between the two renames of the fallback), else removed, by every reader (`from_pretrained` and the
converted classes' own, `load_model`, `read_mhla_config`, `mhla-convert sample`/`eval`/`push`,
training's checkpoint discovery); stale staging folders are removed at the next save.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import logging
import os
import shutil
import sys
import tempfile
import uuid
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from huggingface_hub import save_torch_state_dict
from safetensors import SafetensorError, safe_open
from torch import nn

from .convert import PLAN_ATTR, apply_plan
from .families import adapter_for_family
from .layer import mhla_layers
from .locations import (
    COMPANIONS,
    HUB_ERRORS,
    HUB_ID,
    MHLA_CONFIG,
    SOURCE_ATTR,
    TOKENIZER_FILES,
    checkpoint_dir,
    hub_unreachable,
    is_companion,
    one_line,
    read_json,
)
from .placement import loader_device, loader_dtype, place_model

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
# Weight file names by library: names the library's stock loader does not read (see the module doc).
WEIGHTS_PREFIX = {"diffusers": "model", "transformers": "mhla_model"}
LEGACY_PREFIX = "model"  # every family's weights before format 3
REQUIRED_KEYS = {"family": str, "plan": dict, "mhla": dict}  # in mhla_config.json, beside format_version


def _package_version() -> str:
    from . import __version__

    return __version__


def mhla_metadata(model: nn.Module) -> dict[str, Any]:
    """What mhla_config.json records for a converted model."""
    plan = getattr(model, PLAN_ATTR, None)
    if not plan:
        raise ValueError("this model is not converted: run mhla_convert.convert(model, ...) before saving it")
    adapter = adapter_for_family(plan["family"])
    source = getattr(model, SOURCE_ATTR, None) or {}
    base_class = next((c for c in type(model).__mro__ if c.__name__ in adapter.model_classes), None)
    if base_class is None:  # e.g. a converted LM's base model alone, as AutoModel loads it
        raise ValueError(f"a {type(model).__name__} is part of a converted {adapter.name} model, not a whole one: "
                         f"save the model it came from ({', '.join(adapter.model_classes)})")
    return {
        "format_version": FORMAT_VERSION,
        "mhla_convert_version": _package_version(),
        "family": adapter.name,
        "library": adapter.library,
        "model_class": base_class.__name__,
        "base_model": _recordable(source.get("base_model")),
        "base_model_revision": source.get("revision"),
        "base_model_subfolder": source.get("subfolder"),
        "base_model_name": source.get("name"),  # a local base's folder name, for a card
        "base_model_card": source.get("card"),  # and its own card's license and task
        "plan": {
            "num_layers": plan["num_layers"], "layers": plan["layers"], "attention": plan.get("attention", "mhla"),
            "strategy": plan.get("strategy"),
            "sensitivity": plan.get("sensitivity"),  # JSON keys: the layer indices as strings
        },
        "mhla": plan["mhla_config"],
        "buffer_dtypes": _unsaved_buffer_dtypes(model),
    }


def _recordable(base: str | None) -> str | None:
    """The base model as a checkpoint records it: a hub id or tiny name; not a local path, which would be published
    with it (checkpoints written before local bases went unrecorded hold one)."""
    return None if base is None or Path(base).expanduser().is_absolute() else base


def _unsaved_buffer_dtypes(model: nn.Module) -> dict[str, str]:
    """Dtypes of non-persistent buffers (e.g. RoPE tables): rebuilt from the config on reload, they
    must be cast back to what the saved model used for outputs to match bitwise."""
    saved = set(model.state_dict())
    return {name: str(b.dtype).removeprefix("torch.") for name, b in model.named_buffers() if name not in saved}


def restore_buffer_dtypes(model: nn.Module, dtypes: dict[str, str]) -> None:
    for name, dtype in dtypes.items():
        module_name, _, key = name.rpartition(".")
        module = model.get_submodule(module_name)
        if key in module._buffers:
            module._buffers[key] = module._buffers[key].to(getattr(torch, dtype))


def redo_plan(model: nn.Module, meta: dict[str, Any]) -> None:
    """Convert a freshly built base model as the saved record `meta` says."""
    apply_plan(model, {"family": meta["family"], **meta["plan"], "mhla_config": meta["mhla"]})


def write_companions(model: nn.Module, directory: Path, library: str) -> None:
    """Copy `model`'s companion files (SOURCE_ATTR: its base's tokenizer, generation config, ...) into `directory`
    byte for byte; a built-in tiny LM without them gets its character tokenizer, saved by transformers."""
    source = getattr(model, SOURCE_ATTR, None) or {}
    companions = source.get("companions") or {}
    for name, path in companions.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, directory / name)
    from .train.components import char_tokenizer, is_tiny

    if not companions and library == "transformers" and is_tiny(source.get("base_model")):
        char_tokenizer().save_pretrained(directory)


def own_companions(directory: Path) -> dict[str, str]:
    """The companion files a checkpoint folder holds (name -> path): what a save of the model loaded from it copies."""
    return {f.relative_to(directory).as_posix(): str(f) for f in sorted(directory.rglob("*"))
            if f.is_file() and is_companion(f.relative_to(directory).as_posix())}


def recorded_source(meta: dict[str, Any]) -> dict[str, Any]:
    """What the record says the model was converted from (the model's SOURCE_ATTR)."""
    return {"base_model": meta.get("base_model"), "revision": meta.get("base_model_revision"),
            "subfolder": meta.get("base_model_subfolder"), "name": meta.get("base_model_name"),
            "card": meta.get("base_model_card")}


def write_mhla_files(directory: Path, meta: dict[str, Any]) -> None:
    """The files beside config.json and the weights: the library loaders' files, then
    mhla_config.json, last, as it marks the checkpoint complete."""
    for name, text in adapter_for_family(meta["family"]).loader_files().items():
        (directory / name).write_text(text)
    (directory / MHLA_CONFIG).write_text(json.dumps(meta, indent=2))


def weights_index(prefix: str) -> str:
    return f"{prefix}.safetensors.index.json"


def index_single_file(directory: Path, prefix: str) -> None:
    """Write `prefix`.safetensors.index.json for an unsharded `prefix`.safetensors, so one fixed file name
    (the index) finds the weights sharded or not."""
    index = directory / weights_index(prefix)
    if index.is_file():
        return
    name = f"{prefix}.safetensors"
    with safe_open(directory / name, framework="pt") as f:
        keys, metadata = list(f.keys()), f.metadata() or {}
    index.write_text(json.dumps({"metadata": metadata, "weight_map": dict.fromkeys(sorted(keys), name)}, indent=2))


def rename_weights(directory: Path) -> None:
    """Give the weights transformers' `save_pretrained` wrote (model.safetensors or model-*-of-*.safetensors
    + index) the names of a converted LM's checkpoint, replacing those of an earlier save there."""
    prefix = WEIGHTS_PREFIX["transformers"]
    saved = sorted(directory.glob(f"{LEGACY_PREFIX}*.safetensors"))
    if not saved:
        return
    for old in directory.glob(f"{prefix}*.safetensors*"):
        old.unlink()
    names = {p.name: prefix + p.name[len(LEGACY_PREFIX):] for p in saved}
    legacy_index = directory / weights_index(LEGACY_PREFIX)
    if legacy_index.is_file():
        data = read_json(legacy_index)
        data["weight_map"] = {key: names[file] for key, file in data["weight_map"].items()}
        (directory / weights_index(prefix)).write_text(json.dumps(data, indent=2))
        legacy_index.unlink()
    for old, new in names.items():
        (directory / old).rename(directory / new)
    index_single_file(directory, prefix)


def _write_checkpoint(model: nn.Module, directory: Path, meta: dict[str, Any], max_shard_size) -> None:
    adapter = adapter_for_family(meta["family"])
    config = {**adapter.model_config(model), "mhla": meta}
    config.pop("_name_or_path", None)  # where the libraries loaded the base from: a local path, often
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    prefix = WEIGHTS_PREFIX[adapter.library]
    save_torch_state_dict(
        model.state_dict(), directory, filename_pattern=prefix + "{suffix}.safetensors", max_shard_size=max_shard_size
    )
    if prefix != LEGACY_PREFIX:
        index_single_file(directory, prefix)
    write_companions(model, directory, adapter.library)
    write_mhla_files(directory, meta)


def save_pretrained(model: nn.Module, directory, *, max_shard_size: int | str = "5GB") -> Path:
    """Save a converted model to `directory` atomically; an existing MHLA checkpoint there is replaced.
    An LM's companion files (its base's tokenizer, chat template, generation config, ...) are part of the
    same atomic save (`write_companions`)."""
    meta = mhla_metadata(model)
    json.dumps(meta)  # fail before writing anything if an option (a callable feature map) is not JSON
    target = check_save_target(directory)
    return write_atomically(target, lambda staging: _write_checkpoint(model, staging, meta, max_shard_size))


def write_atomically(target: Path, write) -> Path:
    """Have `write(staging)` fill a hidden sibling folder, then move it to `target` (replacing a
    folder there); on any failure, KeyboardInterrupt included, the staging folder is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(target)
    for stale in _leftovers(target, _staging_prefix(target)):  # left by a killed save of this target
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(target), dir=target.parent))
    try:
        write(staging)
        swap_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def write_file_atomically(target: Path, write) -> Path:
    """Have `write(staging)` fill a hidden sibling file with `target`'s suffix (writers pick the format from it),
    then rename it onto `target`; on any failure, KeyboardInterrupt included, the staging file is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix, dir=target.parent)
    os.close(handle)
    staging = Path(name)
    try:
        write(staging)
        os.replace(staging, target)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return target


def check_writable(path) -> Path:
    """`path`, a file or directory some output will be written to, refused (ValueError) before any work when it
    cannot be: a file in the way of a directory it would make, or a folder nothing can be made in (tried with a
    temporary directory, removed at once)."""
    path = Path(path).expanduser()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing != path and not existing.is_dir():
        raise ValueError(f"cannot write {path}: {existing} is a file, not a directory")
    folder = existing if existing.is_dir() else existing.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mhla-write-check-", dir=folder))
    except OSError as error:
        raise ValueError(f"cannot write {path}: nothing can be made in {folder} ({error.strerror}); "
                         "give a path you can write to") from None
    return path


def check_save_target(directory) -> Path:
    """The resolved directory a save may write: new, empty or an MHLA checkpoint or a pipeline holding one
    (replaced). A save of it that was cut off between its two renames is recovered first."""
    target = Path(directory).expanduser().resolve()
    recover_interrupted_save(target)
    if target.exists():
        if not target.is_dir() or (any(target.iterdir()) and not (checkpoint_dir(target) / MHLA_CONFIG).is_file()):
            raise ValueError(f"{target} exists and is not an MHLA checkpoint; refusing to overwrite it")
    return target


def _staging_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _aside_prefix(target: Path) -> str:
    return f".{target.name}.old-"


def _leftovers(target: Path, prefix: str) -> list[Path]:
    """Hidden siblings of `target` named `prefix*`, oldest first (one that vanishes meanwhile is left out)."""
    if not target.parent.is_dir():
        return []
    found = []
    for path in target.parent.glob(glob_escape(prefix) + "*"):
        try:
            found.append((path.stat().st_mtime, path))
        except FileNotFoundError:  # settled by another reader meanwhile
            continue
    return [path for _, path in sorted(found)]


def recover_interrupted_save(target) -> None:
    """A replacing save without an atomic swap renames the old checkpoint aside, then the new one
    into place: when a kill came between the two, put the old one back (saying so); a copy left aside
    beside a present target is removed. Every reader calls this before it looks at `target`; several
    processes may race to do it."""
    target = Path(target)
    aside = _leftovers(target, _aside_prefix(target))
    if aside and not target.exists():
        restored = aside.pop()  # the newest one
        try:
            restored.rename(target)
        except OSError:
            if not target.exists():  # not another reader's restore
                raise
        else:
            logger.warning("recovered %s from %s, left there by a save that was cut off", target, restored.name)
    for old in aside:
        shutil.rmtree(old, ignore_errors=True)


def resolve_saved(path) -> Path:
    """`path` as a reader should see it: a save of it, or of the folder holding it (a pipeline around
    its transformer/), that was cut off between its two renames is settled first."""
    path = Path(path).expanduser()
    for candidate in (path, path.parent):
        if not candidate.exists() and candidate.name:
            recover_interrupted_save(candidate)
    if path.exists():
        recover_interrupted_save(path)  # a stale copy beside it
    return path


RENAME_EXCHANGE, AT_FDCWD = 2, -100  # linux/fs.h, fcntl.h
NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}


@functools.cache
def _renameat2():
    """glibc's renameat2 (2.28+), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def exchange(a: Path, b: Path) -> bool:
    """Swap the two existing paths `a` and `b` in one atomic step; False (nothing moved) where the
    system or its file system cannot."""
    function = _renameat2()
    if function is None:
        return False
    if function(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def swap_into_place(staging: Path, target: Path) -> None:
    """Move the complete folder `staging` to `target`. A folder already there is swapped with it
    atomically where the system can (so `target` is never missing), else renamed aside first
    (`recover_interrupted_save` puts it back after a kill between the two renames); then removed."""
    if not target.exists():
        staging.rename(target)
        return
    if exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # now the old folder; a kill first leaves it to the next sweep
        return
    old = target.with_name(f"{_aside_prefix(target)}{uuid.uuid4().hex[:8]}")
    target.rename(old)
    try:
        staging.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def load_unless_converted(loader, cls: type, args: tuple, kwargs: dict[str, Any], how) -> Any:
    """`loader(cls, *args, **kwargs)`, a library's `from_pretrained` (registration.py puts this in front of it),
    unless it is given an MHLA checkpoint and `how(cls)` says what loads it (`cls` is a class mhla-convert converts):
    then an error saying so, rather than a failure on weights it does not find or a layout it would read as softmax
    attention. A local folder is checked first, a hub repo once the loader has failed."""
    location = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    if not isinstance(location, (str, os.PathLike)):
        return loader(cls, *args, **kwargs)
    subfolder = kwargs.get("subfolder") or ""
    local = resolve_saved(location)
    if local.is_dir() and (checkpoint_dir(local / subfolder) / MHLA_CONFIG).is_file() and (way := how(cls)):
        raise _converted_checkpoint(cls, location, way)
    try:
        return loader(cls, *args, **kwargs)
    except OSError as error:
        if local.exists() or not (way := how(cls)) or not _hub_holds_mhla(str(location), subfolder, kwargs):
            raise
        raise _converted_checkpoint(cls, location, way) from error


def _converted_checkpoint(cls: type, location, how: str) -> OSError:
    return OSError(f"{location} is an MHLA checkpoint (converted by mhla-convert), which {cls.__name__}'s own "
                   f"loader would not load as converted: load it with {how} (after `import mhla_convert`), or "
                   "mhla_convert.from_pretrained")


def _hub_holds_mhla(repo_id: str, subfolder: str, options: dict[str, Any]) -> bool:
    """Whether hub repo `repo_id` holds an MHLA checkpoint (in `subfolder`), as far as it can be reached."""
    if not HUB_ID.match(repo_id):
        return False
    from huggingface_hub import hf_hub_download

    hub = {k: options[k] for k in ("revision", "token", "cache_dir", "local_files_only") if options.get(k)}
    try:
        hf_hub_download(repo_id, MHLA_CONFIG, subfolder=subfolder or None, **hub)
    except (*HUB_ERRORS, ValueError):
        return False
    return True


def read_mhla_config(directory) -> dict[str, Any]:
    """The conversion record: mhla_config.json, or the copy in config.json where only that came along
    (diffusers downloads a pipeline component's weights and config.json alone)."""
    path = checkpoint_dir(resolve_saved(directory)) / MHLA_CONFIG
    if path.is_file():
        meta = read_json(path)
    else:
        config = path.with_name("config.json")
        meta = read_json(config).get("mhla") if config.is_file() else None
        if not isinstance(meta, dict):
            raise ValueError(
                f"{directory} has no {MHLA_CONFIG}, so it is not an MHLA checkpoint "
                f"(a base model? convert it first: `mhla-convert {directory}`)"
            )
        path = config
    if meta.get("format_version") not in READABLE_FORMATS:
        raise ValueError(
            f"{path} has format_version {meta.get('format_version')}; this mhla-convert reads "
            f"{', '.join(map(str, READABLE_FORMATS))} (a newer mhla-convert wrote it? pip install -U mhla-convert)"
        )
    missing = [key for key, kind in REQUIRED_KEYS.items() if not isinstance(meta.get(key), kind)]
    plan, mhla = meta.get("plan"), meta.get("mhla")
    missing += [f"plan.{key}" for key in ("num_layers", "layers") if isinstance(plan, dict) and key not in plan]
    missing += [f"mhla.{key}" for key in ("blocks", "causal") if isinstance(mhla, dict) and key not in mhla]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)} (or holds the wrong type there): the file is damaged; "
                         "restore it, or save the model again with save_pretrained")
    try:
        adapter_for_family(meta["family"])
    except ValueError as error:
        raise ValueError(f"{path}: {one_line(error)}") from None
    return meta


def load_state_dict(directory: Path, library: str) -> dict[str, torch.Tensor]:
    """All tensors of a (sharded) safetensors checkpoint of a `library` model (its weight names, or
    those of format 2), with the tied duplicates that saving dropped restored from the metadata
    (`save_torch_state_dict` records them as name -> kept).

    Each tensor is copied into its own allocation as it is read (peak memory: one tensor over the
    state dict). safetensors hands out views into the file buffer at offsets that are not 64-byte
    aligned, and CPU matmuls on such storage take other code paths: the reloaded model's outputs
    would differ in the last bits from the model that was saved."""
    prefix = next((p for p in (WEIGHTS_PREFIX[library], LEGACY_PREFIX)
                   if any((directory / name).is_file() for name in (f"{p}.safetensors", weights_index(p)))),
                  WEIGHTS_PREFIX[library])
    index = directory / weights_index(prefix)
    if index.is_file():
        data = read_json(index)
        if not isinstance(data.get("weight_map"), dict):
            raise ValueError(f"{index} has no weight_map: the file is damaged; save or download the checkpoint again")
        files, metadata = sorted(set(data["weight_map"].values())), data.get("metadata") or {}
    else:
        files, metadata = [f"{prefix}.safetensors"], None
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            with safe_open(directory / name, framework="pt") as f:
                metadata = metadata if metadata is not None else f.metadata() or {}
                state.update({key: f.get_tensor(key).clone() for key in f.keys()})
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{directory / name} cannot be read ({one_line(error)}): the weights are missing, "
                             "truncated or damaged; save or download the checkpoint again") from None
    for alias, kept in (metadata or {}).items():
        if kept in state and alias not in state:
            state[alias] = state[kept]
    return state


def host_named_keys(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with the keys of converted layers that keep their host's submodule names
    (`MHLAttention.host_names`) saved under the MHLA names (`...self_attn.to_q.weight`, as
    checkpoints written before the layers kept the host's names have them) renamed to the host's."""
    renames = {f"{name}.{old}.": f"{name}.{new}." for name, layer in mhla_layers(model)
               for old, new in layer.host_names.items()}
    if not renames:
        return state
    out = {}
    for key, value in state.items():
        prefix = next((p for p in renames if key.startswith(p)), None)
        out[key if prefix is None else renames[prefix] + key[len(prefix):]] = value
    return out



def _with_tied(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` plus the parameters `model` ties to a saved one (transformers' `save_pretrained` stores
    a tied lm_head only as the embedding)."""
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()  # a model built under init_empty_weights has its ties undone
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        kept = first.setdefault(id(param), name)
        if kept != name and name not in state and kept in state:
            state[name] = state[kept]
    return state


def local_checkpoint(dir_or_hub_id, revision: str | None = None, subfolder: str | None = None,
                     hub: dict[str, Any] | None = None) -> Path:
    """The folder of the checkpoint in a directory or hub repo (through the local cache in offline mode, as
    huggingface_hub resolves it): the given subfolder, or a pipeline's transformer/."""
    path = resolve_saved(dir_or_hub_id)
    if path.is_dir():
        return path / subfolder if subfolder else checkpoint_dir(path)
    if path.exists() or "/" not in str(dir_or_hub_id) or not HUB_ID.match(str(dir_or_hub_id)):
        raise ValueError(f"{dir_or_hub_id} is not a directory (nor a hub id like owner/name)")
    from huggingface_hub import snapshot_download

    folder = f"{subfolder}/" if subfolder else ""
    try:
        snapshot = Path(snapshot_download(
            str(dir_or_hub_id), revision=revision,
            allow_patterns=[f"{folder}{pattern}" for pattern in ("*.json", "*.safetensors", "*.md", *COMPANIONS)],
            **(hub or {}),
        ))
    except HUB_ERRORS as error:
        raise hub_unreachable(str(dir_or_hub_id), error) from error
    return snapshot / subfolder if subfolder else checkpoint_dir(snapshot)


def _own_components(dir_or_hub_id, directory: Path) -> str | None:
    """Where a loaded checkpoint's tokenizer or pipeline parts come from when it holds them: an LM's own folder with
    its tokenizer; the pipeline around a transformer (a hub pipeline by its id, whose parts diffusers fetches)."""
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        return str(directory)
    if (directory.parent / "model_index.json").is_file():
        return str(directory.parent) if resolve_saved(dir_or_hub_id).is_dir() else str(dir_or_hub_id)
    return None


def from_pretrained(dir_or_hub_id, *, subfolder: str | None = None, dtype=None, torch_dtype=None, device=None,
                    device_map=None, revision: str | None = None, token: str | bool | None = None,
                    local_files_only: bool = False, cache_dir=None) -> nn.Module:
    """Rebuild exactly the converted model saved by `save_pretrained` (a directory or hub id; for a
    pipeline directory its transformer/, or the given `subfolder`).

    The libraries' loader options: `dtype` ("bf16", torch.bfloat16; "auto" or None: as saved; `torch_dtype` is
    its older name), `device_map` (one device: "cuda", 0 or {"": "cuda"}; the same as `device`), and for a hub
    id `revision`, `token`, `local_files_only` and `cache_dir`, as huggingface_hub takes them."""
    torch_dtype = loader_dtype(dtype, torch_dtype)
    device = loader_device(device, device_map)
    hub = {k: v for k, v in (("token", token), ("local_files_only", local_files_only), ("cache_dir", cache_dir))
           if v not in (None, False)}
    directory = local_checkpoint(dir_or_hub_id, revision, subfolder, hub)
    meta = read_mhla_config(directory)
    with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (RoPE tables) real
        try:
            adapter = adapter_for_family(meta["family"])
            model = adapter.build(adapter.base_config(read_json(directory / "config.json")))
            redo_plan(model, meta)
        except ValueError as error:  # a family, plan or option the file should not hold
            raise ValueError(f"{directory / MHLA_CONFIG}: {one_line(error)}") from None
    try:
        state = host_named_keys(model, load_state_dict(directory, adapter.library))
        model.load_state_dict(_with_tied(model, state), strict=True, assign=True)
    except RuntimeError as error:  # missing or unexpected keys, wrong shapes
        raise ValueError(f"checkpoint {directory} does not match its plan: {error}") from None
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()  # assign=True gives tied names separate Parameters over one storage
    if torch_dtype is None:  # as saved: outputs match bitwise (as the converted classes' own loaders do)
        restore_buffer_dtypes(model, meta.get("buffer_dtypes", {}))
    from .train.components import is_tiny

    source = recorded_source(meta)  # a built-in tiny model's parts are built in-process, as it was
    own = None if is_tiny(source["base_model"]) else _own_components(dir_or_hub_id, directory)
    setattr(model, SOURCE_ATTR, {**source, "components": own, "companions": own_companions(directory)})
    return place_model(model, torch_dtype, device).eval()  # in another dtype: placement.py's policy
