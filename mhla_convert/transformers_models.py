"""Converted causal LMs as transformers models, so `AutoModelForCausalLM.from_pretrained` reloads them.

A converted LM is an instance of `MHLA<base class>` (e.g. `MHLALlamaForCausalLM`, a subclass of
`LlamaForCausalLM`) with a config of `MHLA<base config class>`, whose `model_type` is `mhla_<base
type>`. Both are registered with transformers' Auto classes once mhla_convert is imported (registration.py: the
configs as transformers' Auto classes load, the model classes here, as the first converted config is built), and so
is `MHLA<base model class>` (`MHLALlamaModel`) for `AutoModel`: the converted layers without the LM head,
read from the same checkpoint (the head's weights are left out, as transformers does for its own). The config
carries the conversion record under "mhla"; `__init__` redoes that plan on the freshly built base
architecture, so transformers' own loader fills in exactly the saved weights (any missing or
unexpected key is an error). A saved directory also holds `mhla_loader.py`, named by the config's
`auto_map`: with `trust_remote_code=True` a process that has not imported mhla_convert imports it
through that module, or is told to `pip install mhla-convert`. Without either, transformers refuses the
unknown model type: a converted LM never loads as its base model through the Auto classes. After
`import mhla_convert`, the base classes themselves (`LlamaForCausalLM`, `LlamaModel`, …) given a converted folder
say it is an MHLA checkpoint and what loads it (`registration.LOADED_BY`, filled here; io.load_unless_converted);
without it, they fail on the weights' file name (io.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .registration import CAUSAL_LMS, CONVERTED_PREFIX, LOADED_BY, MODEL_TYPE_PREFIX, converted_configs

LOADER_MODULE = "mhla_loader"

LOADER_SOURCE = '''"""Loads this MHLA-converted model through transformers' Auto classes (trust_remote_code=True):
its model and config classes are mhla-convert's."""

try:
    from mhla_convert.transformers_models import *  # noqa: F401,F403
except ModuleNotFoundError as error:
    if not (error.name or "").startswith("mhla_convert"):
        raise
    raise ImportError(
        "this model was converted to Multi-Head Linear Attention by mhla-convert, which loads it: "
        "pip install -U mhla-convert"
    ) from error
'''


def conversion_record(config) -> dict:
    """The config's `mhla` record, which a converted LM is rebuilt from; one line naming the fix if it has none."""
    meta = getattr(config, "mhla", None)
    if not meta:
        raise ValueError(f"this {type(config).__name__} has no 'mhla' conversion record, so the converted "
                         "model cannot be rebuilt from it; load the checkpoint with mhla_convert.from_pretrained")
    return meta


class ConvertedCausalLM:
    """What a converted LM class adds to its base class (placed first among the bases)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        meta = conversion_record(config)
        from .io import recorded_source, redo_plan
        from .locations import SOURCE_ATTR

        redo_plan(self, meta)
        setattr(self, SOURCE_ATTR, recorded_source(meta))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' loader, made strict: a weight the plan does not expect, or one it lacks, is an
        error rather than a warning over a partly random model."""
        return _strict_load(super().from_pretrained, args, kwargs)

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        """transformers' save with the current conversion record, plus the loader module and
        mhla_config.json (`mhla_convert.save_pretrained` is the atomic equivalent); with `push_to_hub`, then
        uploaded by `mhla_convert.push_to_hub` with the project's model card (transformers' hub options:
        repo_id, commit_message, private, token, revision, create_pr, …)."""
        from .hub import HUB_OPTIONS
        from .io import mhla_metadata, rename_weights, write_mhla_files

        hub = {k: kwargs.pop(k) for k in HUB_OPTIONS if k in kwargs} if push_to_hub else {}

        if kwargs.get("variant"):
            raise ValueError("a converted LM saves without weight variants; drop variant= (or save with "
                             "mhla_convert.save_pretrained)")
        meta = mhla_metadata(self)
        self.config.mhla = meta
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            rename_weights(Path(save_directory))
            write_mhla_files(Path(save_directory), meta)
            if push_to_hub:
                from .hub import push_to_hub as push

                push(save_directory, hub.pop("repo_id", Path(save_directory).name), **hub)

    def push_to_hub(self, repo_id: str, **options):
        """transformers' `push_to_hub` (options: commit_message, commit_description, private, token, revision,
        create_pr, max_shard_size, tags): saved with the MHLA files and uploaded by `mhla_convert.push_to_hub`
        with the project's model card. Returns the repo's (or pull request's) URL."""
        from .hub import push_saved

        shard = {"max_shard_size": options.pop("max_shard_size")} if "max_shard_size" in options else {}
        return push_saved(lambda folder: self.save_pretrained(folder, **shard), repo_id, **options)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """Kept out of transformers' remote-code bookkeeping, which would copy this package's source
        into every save: a saved converted model carries `mhla_loader.py` instead."""


class ConvertedBaseModel:
    """What the base model class of a converted LM (`MHLALlamaModel`: its layers without the LM head, what
    `AutoModel` loads) adds to its base class: the saved plan's layers converted at build. It loads only;
    the whole model (`AutoModelForCausalLM`, `mhla_convert.from_pretrained`) is what saves and trains."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        meta = conversion_record(config)
        from .convert import PLAN_ATTR
        from .families import adapter_for_family
        from .io import recorded_source
        from .layer import MHLAConfig
        from .locations import SOURCE_ATTR

        mhla = MHLAConfig.from_dict(meta["mhla"])  # as resolved at conversion: every option is recorded
        attention = adapter_for_family(meta["family"]).attention_class
        for index in meta["plan"]["layers"]:  # the whole model's convert_layer, on its base model's layers
            self.layers[index].self_attn = attention(self.layers[index].self_attn, mhla)
        setattr(self, PLAN_ATTR, {"family": meta["family"], **meta["plan"], "mhla_config": meta["mhla"]})
        setattr(self, SOURCE_ATTR, recorded_source(meta))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' loader, made strict as the whole model's is; the LM head's weights alone are left out."""
        return _strict_load(super().from_pretrained, args, kwargs, skipped=HEAD, inside=True)

    def save_pretrained(self, *args, **kwargs):
        raise ValueError(f"a {type(self).__name__} (a converted LM's layers without its head, as AutoModel loads "
                         "them) does not save on its own: load the checkpoint with AutoModelForCausalLM or "
                         "mhla_convert.from_pretrained to save it")

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """Kept out of transformers' remote-code bookkeeping (see ConvertedCausalLM)."""


HEAD = "lm_head."  # the weights of a converted LM that its base model class leaves out


def _strict_load(load, args, kwargs, *, skipped: str | None = None, inside: bool = False):
    """`load(*args, **kwargs)` (a transformers `from_pretrained`) with every missing, unexpected or mismatched
    weight an error, except unexpected ones starting with `skipped`; a save cut off between its two renames is
    settled first, and without a dtype asked for, buffers get their saved dtypes back (`inside`: the model is the
    base model inside the saved one, whose names lack its prefix)."""
    from .io import resolve_saved, restore_buffer_dtypes

    if args and isinstance(args[0], (str, os.PathLike)):
        resolve_saved(args[0])
    want_info = kwargs.pop("output_loading_info", False)
    model, info = load(*args, output_loading_info=True, **kwargs)
    if skipped:
        info = {**info, "unexpected_keys": {k for k in info.get("unexpected_keys") or () if not k.startswith(skipped)}}
    wrong = {k: sorted(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
    if wrong:
        raise ValueError(f"{args[0] if args else 'the checkpoint'} does not match its MHLA plan: {wrong}")
    if kwargs.get("dtype", kwargs.get("torch_dtype")) in (None, "auto"):  # as saved: outputs match bitwise
        prefix = f"{model.base_model_prefix}." if inside else ""
        restore_buffer_dtypes(model, {name.removeprefix(prefix): dtype for name, dtype
                                      in model.config.mhla.get("buffer_dtypes", {}).items()})
    return (model, info) if want_info else model


def _converted(base_model: type) -> tuple[type, type, type]:
    """The converted config, LM and base model (AutoModel) classes of a causal LM class."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    config = converted_configs()[base_model.__name__]
    model_name = CONVERTED_PREFIX + base_model.__name__
    model = type(model_name, (ConvertedCausalLM, base_model), {
        "__module__": __name__, "__qualname__": model_name, "config_class": config,
    })
    bare_base = getattr(transformers, MODEL_MAPPING_NAMES[base_model.config_class.model_type])
    bare_name = CONVERTED_PREFIX + bare_base.__name__
    bare = type(bare_name, (ConvertedBaseModel, bare_base), {
        "__module__": __name__, "__qualname__": bare_name, "config_class": config,
    })
    return config, model, bare


def _register() -> dict[str, tuple[type, type]]:
    import transformers

    classes = {}
    for name in CAUSAL_LMS:
        config, model, bare = _converted(getattr(transformers, name))
        classes[name] = config, model
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModelForCausalLM.register(config, model, exist_ok=True)
        AutoModel.register(config, bare, exist_ok=True)
        BASE_MODELS[name] = bare
        _loaded_by(model, "AutoModelForCausalLM.from_pretrained")
        _loaded_by(bare, "AutoModel.from_pretrained")
        globals().update({cls.__name__: cls for cls in (config, model, bare)})
    return classes


def _loaded_by(converted: type, auto: str) -> None:
    """The converted class's base class, given a converted checkpoint, names `auto` and `converted`."""
    base = next(c for c in converted.__mro__ if c.__name__ == converted.__name__.removeprefix(CONVERTED_PREFIX))
    LOADED_BY[base] = f"{auto} or {converted.__name__}.from_pretrained"


BASE_MODELS: dict[str, type] = {}  # base class name -> converted base model class (AutoModel)
CONVERTED = _register()  # base class name -> (config class, model class)
__all__ = sorted([cls.__name__ for pair in CONVERTED.values() for cls in pair]
                 + [cls.__name__ for cls in BASE_MODELS.values()])


def mark_converted(model: nn.Module) -> None:
    """Give a converted LM (and its config) the converted classes, and the config its `auto_map`."""
    base = next(c for c in type(model).__mro__ if c.__name__ in CONVERTED)
    config, converted = CONVERTED[base.__name__]
    model.__class__, model.config.__class__ = converted, config
    model.config.auto_map = {"AutoConfig": f"{LOADER_MODULE}.{config.__name__}",
                             "AutoModelForCausalLM": f"{LOADER_MODULE}.{converted.__name__}",
                             "AutoModel": f"{LOADER_MODULE}.{BASE_MODELS[base.__name__].__name__}"}


def base_config(config: dict[str, Any]) -> dict[str, Any]:
    """A converted LM's saved config as its base model's config (a base config comes back unchanged)."""
    out = {k: v for k, v in config.items() if k not in ("mhla", "auto_map")}
    out["model_type"] = out["model_type"].removeprefix(MODEL_TYPE_PREFIX)
    if out.get("architectures"):
        out["architectures"] = [name.removeprefix(CONVERTED_PREFIX) for name in out["architectures"]]
    return out


def loader_files() -> dict[str, str]:
    return {f"{LOADER_MODULE}.py": LOADER_SOURCE}
