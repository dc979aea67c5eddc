"""Converted diffusers transformers as diffusers models, so pipelines reload them converted.

A converted transformer is an instance of `MHLA<base class>` (e.g. `MHLAWanTransformer3DModel`, a
subclass of `WanTransformer3DModel`) defined here. A pipeline holding one records it in
model_index.json as ["mhla_convert.diffusers_models", "MHLAWanTransformer3DModel"], and
`DiffusionPipeline.from_pretrained`, the family's pipeline class and the class's own
`from_pretrained(dir, subfolder="transformer")` all load it through this class: mhla-convert's strict
loader (`io.from_pretrained`). Diffusers imports this module itself once mhla_convert is imported (which lists it
among the libraries diffusers loads components from: registration.py); without `import mhla_convert` such a pipeline
fails to load, naming this module. The weights are saved as model*.safetensors, which diffusers' stock loader does
not read: the base class's own `from_pretrained` on a converted folder fails rather than silently rebuilding softmax
attention, and after `import mhla_convert` it says the folder is an MHLA checkpoint and what loads it
(`registration.LOADED_BY`, filled here; io.load_unless_converted).

Saved pipelines name this module and these classes: they must keep their names.
"""

from __future__ import annotations

import functools
from typing import Any

import diffusers
from diffusers import ModelMixin  # noqa: F401  diffusers looks a component library's base classes up in it
from diffusers.utils import PushToHubMixin

from .families import adapter_for_config, families
from .registration import CONVERTED_PREFIX, LOADED_BY

# Options diffusers' loaders pass that leave the loaded model as it is.
NEUTRAL_OPTIONS = {"low_cpu_mem_usage", "disable_mmap", "offload_state_dict"}


class ConvertedModel:
    """What a converted diffusers transformer class adds to its base class (placed first among the bases)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *, subfolder: str | None = None,
                        revision: str | None = None, dtype=None, torch_dtype=None, device_map=None,
                        token: str | bool | None = None, local_files_only: bool | None = None, cache_dir=None,
                        **options):
        """The converted transformer saved in a directory or hub repo (`subfolder` of a pipeline),
        through mhla-convert's strict loader, with diffusers' names for its options (`dtype` or `torch_dtype`,
        `device_map` naming one device, the hub's `token`, `local_files_only`, `cache_dir`). Options that would
        change the model (variants, quantization, offloading) are refused rather than ignored."""
        from .io import from_pretrained

        unsupported = {k: v for k, v in options.items()
                       if k not in NEUTRAL_OPTIONS and v not in (None, False) and not (k == "use_safetensors" and v)}
        if unsupported:
            raise ValueError(f"{cls.__name__}.from_pretrained (mhla-convert) does not support "
                             f"{', '.join(f'{k}={v!r}' for k, v in unsupported.items())}")
        model = from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, revision=revision, dtype=dtype,
                                torch_dtype=torch_dtype, device_map=device_map, token=token,
                                local_files_only=bool(local_files_only), cache_dir=cache_dir)
        if not isinstance(model, cls):
            raise ValueError(f"{pretrained_model_name_or_path} holds a {type(model).__name__}, not a {cls.__name__}")
        return model

    @classmethod
    def from_config(cls, config, **kwargs):
        """A converted model with random weights from a converted model's config (its "mhla" record)."""
        from .io import redo_plan

        config = dict(config)
        meta = config.get("mhla")
        if not meta:
            raise ValueError(f"this config has no 'mhla' conversion record, so {cls.__name__} cannot be built "
                             "from it; load the checkpoint with mhla_convert.from_pretrained")
        adapter = adapter_for_config({"_class_name": _base(cls).__name__})
        model = adapter.build(adapter.base_config(config))
        redo_plan(model, meta)
        return model

    def save_pretrained(self, save_directory, *, safe_serialization: bool = True, variant: str | None = None,
                        max_shard_size: int | str = "10GB", push_to_hub: bool = False, is_main_process: bool = True,
                        **options: Any) -> None:
        """Save atomically as `mhla_convert.save_pretrained` does (what `pipe.save_pretrained` calls
        for this component); with `push_to_hub`, then uploaded by `mhla_convert.push_to_hub` with the
        project's model card (diffusers' hub options: repo_id, commit_message, private, token, create_pr)."""
        from .hub import HUB_OPTIONS

        hub = {k: options.pop(k) for k in HUB_OPTIONS if k in options} if push_to_hub else {}
        refused = {k: v for k, v in dict(variant=variant, **options).items() if v}
        if not safe_serialization:
            refused["safe_serialization"] = False
        if refused:
            raise ValueError(f"a converted transformer saves as mhla-convert's safetensors checkpoint only; "
                             f"{type(self).__name__}.save_pretrained does not support "
                             f"{', '.join(f'{k}={v!r}' for k, v in refused.items())}")
        if is_main_process:
            from .hub import push_to_hub as push
            from .io import save_pretrained

            saved = save_pretrained(self, save_directory, max_shard_size=max_shard_size)
            if push_to_hub:
                push(saved, hub.pop("repo_id", saved.name), **hub)


def _converted(base: type) -> type:
    name = CONVERTED_PREFIX + base.__name__
    return type(name, (ConvertedModel, base), {"__module__": __name__, "__qualname__": name})


CONVERTED = {  # base class name -> converted class
    name: _converted(getattr(diffusers, name))
    for adapter in families().values() if adapter.library == "diffusers" for name in adapter.model_classes
}
globals().update({cls.__name__: cls for cls in CONVERTED.values()})
LOADED_BY.update({  # a base class given a converted transformer says what loads it
    getattr(diffusers, name): f"{cls.__name__}.from_pretrained or its pipeline's from_pretrained"
    for name, cls in CONVERTED.items()
})
__all__ = sorted(cls.__name__ for cls in CONVERTED.values())


def _base(cls: type) -> type:
    return next(c for c in cls.__mro__ if c.__name__ in CONVERTED)


def converted_class(cls: type) -> type:
    """The converted class of a diffusers transformer class (itself if already converted)."""
    return CONVERTED[_base(cls).__name__]


def _upload_with_card(upload):
    """diffusers' upload (the end of `push_to_hub`, and of `pipe.save_pretrained(push_to_hub=True)`) of a
    converted transformer or a pipeline holding one, through `mhla_convert.push_to_hub` with the project's
    model card; anything else, or into a `subfolder` of a repo (no card there), uploads as diffusers does."""

    @functools.wraps(upload)
    def _upload_folder(self, working_dir, repo_id, token=None, commit_message=None, create_pr=False, subfolder=None):
        parts = [self, *(getattr(self, "components", None) or {}).values()]
        if subfolder or not any(isinstance(part, ConvertedModel) for part in parts):
            return upload(self, working_dir, repo_id, token=token, commit_message=commit_message,
                          create_pr=create_pr, subfolder=subfolder)
        from .hub import push_to_hub

        return push_to_hub(working_dir, repo_id, token=token, commit_message=commit_message, create_pr=create_pr)

    return _upload_folder


PushToHubMixin._upload_folder = _upload_with_card(PushToHubMixin._upload_folder)
