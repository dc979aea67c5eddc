"""How transformers, diffusers and PEFT find mhla-convert's converted models, while `import mhla_convert` imports
none of them.

Each library looks converted models up through one of its modules. Once that module is imported (at once where it
already is), it is told about them through the library's own registration:

- transformers' `configuration_auto`: the converted LM model types (`mhla_<base type>`) register with `AutoConfig`,
  and their config classes (`MHLALlamaConfig`, …) take their place as transformers first uses them. The first
  converted config built imports transformers_models.py, whose converted LM and base model classes register with
  `AutoModelForCausalLM` and `AutoModel` (building them imports the base models' modeling code, which a process that
  never meets a converted LM does not pay for);
- diffusers' `pipeline_loading_utils`: diffusers_models.py joins the libraries diffusers loads pipeline components
  from (`LOADABLE_CLASSES`), so a pipeline whose model_index.json names it imports it, from a folder or the Hub;
- PEFT's `utils.constants`: a converted LM's model type gets its base type's default target modules;
- transformers' and diffusers' `modeling_utils`: the from_pretrained every model class loads through refuses an MHLA
  checkpoint for a class mhla-convert converts (`LlamaForCausalLM`, `WanTransformer3DModel`, …), saying what loads it.

A process that never imports mhla_convert loads a converted LM with `trust_remote_code=True` (the checkpoint's
`mhla_loader.py` imports transformers_models.py); diffusers imports a component library only once the process has
imported it, so a pipeline holding a converted transformer needs `import mhla_convert` first.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import sys
from typing import Callable

CONVERTED_PREFIX = "MHLA"  # a converted model's class: MHLA<base class>, a subclass of the base class
MODEL_TYPE_PREFIX = "mhla_"  # a converted LM's model type: mhla_<base model type>
# The causal LM classes the transformers families convert (families/llama.py, gemma3.py) and their model types.
CAUSAL_LMS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
              "Qwen3MoeForCausalLM": "qwen3_moe", "MistralForCausalLM": "mistral", "Gemma3ForCausalLM": "gemma3_text"}
CONVERTED_LM_MODULE = f"{__package__}.transformers_models"
DIFFUSERS_MODULE = f"{__package__}.diffusers_models"

_hooks: dict[str, list[Callable]] = {}  # module name -> what runs once it is imported


def when_imported(name: str, hook: Callable) -> None:
    """Call `hook(module)` once module `name` has been imported: now, if it has."""
    if name in sys.modules:
        hook(sys.modules[name])
        return
    _hooks.setdefault(name, []).append(hook)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds a watched module through the other finders and gives it a loader that runs its hooks after it."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader)
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # the module keeps its own loader
        self.loader.exec_module(module)
        for hook in _hooks.pop(module.__name__, ()):
            hook(module)


_FINDER = _PostImportFinder()


def install() -> None:
    """Have each library told about the converted models once it looks them up (what `import mhla_convert` does)."""
    when_imported("transformers.models.auto.configuration_auto", _register_configs)
    when_imported("diffusers.pipelines.pipeline_loading_utils", _register_diffusers_library)
    when_imported("peft.utils.constants", _register_peft_targets)
    when_imported("transformers.modeling_utils", lambda m: _guard_base_loader(m.PreTrainedModel, CONVERTED_LM_MODULE))
    when_imported("diffusers.models.modeling_utils", lambda m: _guard_base_loader(m.ModelMixin, DIFFUSERS_MODULE))


# A class mhla-convert converts -> what loads its converted checkpoints (filled by the module of its converted class)
LOADED_BY: dict[type, str] = {}


def _guard_base_loader(root: type, converted_module: str) -> None:
    """`root.from_pretrained`, which every model class of its library loads through, refuses an MHLA checkpoint for
    a class mhla-convert converts, saying so and what loads it (io.load_unless_converted); the converted classes,
    defined in `converted_module` (imported only to say what loads one), load through it as before."""
    loader = root.from_pretrained.__func__

    def loaded_by(cls: type) -> str | None:
        importlib.import_module(converted_module)
        return next((LOADED_BY[c] for c in cls.__mro__ if c in LOADED_BY), None)

    @functools.wraps(loader)
    def from_pretrained(cls, *args, **kwargs):
        if any(c.__module__ == converted_module for c in cls.__mro__):
            return loader(cls, *args, **kwargs)
        from .io import load_unless_converted

        return load_unless_converted(loader, cls, args, kwargs, loaded_by)

    root.from_pretrained = classmethod(from_pretrained)


def _register_configs(configuration_auto) -> None:
    for name, model_type in CAUSAL_LMS.items():
        configuration_auto.AutoConfig.register(MODEL_TYPE_PREFIX + model_type, _pending_config(name), exist_ok=True)


def _pending_config(base_name: str) -> type:
    """What AutoConfig's table holds for a converted LM's model type until transformers first uses it: building the
    config class imports its base config's module, which this hook cannot (it may run while another transformers
    module is being imported); the first use builds it, and it takes this one's place."""

    class PendingConfig:
        model_type = MODEL_TYPE_PREFIX + CAUSAL_LMS[base_name]

        def __new__(cls, *args, **kwargs):  # AutoConfig.for_model
            return converted_configs()[base_name](*args, **kwargs)

        @classmethod
        def from_dict(cls, *args, **kwargs):  # AutoConfig.from_pretrained
            return converted_configs()[base_name].from_dict(*args, **kwargs)

    return PendingConfig


@functools.cache
def converted_configs() -> dict[str, type]:
    """Base causal LM class name -> the config class of its converted LMs, a subclass of the base config class
    (defined as transformers_models.py's, which exports them); registered with AutoConfig."""
    import transformers
    from transformers import AutoConfig

    configs = {name: _converted_config(getattr(transformers, name).config_class) for name in CAUSAL_LMS}
    for config in configs.values():
        AutoConfig.register(config.model_type, config, exist_ok=True)
    return configs


def _converted_config(base: type) -> type:
    name = CONVERTED_PREFIX + base.__name__

    def __init__(self, *args, **kwargs):
        importlib.import_module(CONVERTED_LM_MODULE)  # the model classes register with the Auto classes
        super(config, self).__init__(*args, **kwargs)

    config = type(name, (base,), {
        "__module__": CONVERTED_LM_MODULE, "__qualname__": name, "__init__": __init__,
        "model_type": MODEL_TYPE_PREFIX + base.model_type,
        "register_for_auto_class": classmethod(lambda cls, auto_class="AutoConfig": None),
        "transformers_weights": property(_weights_file),
    })
    return config


def _weights_file(config) -> str | None:
    """The weights file transformers' loader reads for this config (its `transformers_weights`): the index of
    the name only converted classes read, or for a checkpoint saved before that name, transformers' own."""
    from .io import WEIGHTS_PREFIX, weights_index

    record = getattr(config, "mhla", None) or {}
    return weights_index(WEIGHTS_PREFIX["transformers"]) if record.get("format_version", 0) >= 3 else None


def _register_diffusers_library(loading_utils) -> None:
    # Diffusers downloads and imports a pipeline's component only from a library it lists as loadable (or from a
    # `<component>/<library>.py` file, which needs trust_remote_code): diffusers_models.py's classes load and save
    # as diffusers models do.
    loading_utils.LOADABLE_CLASSES.setdefault(DIFFUSERS_MODULE, {"ModelMixin": ["save_pretrained", "from_pretrained"]})


def _register_peft_targets(constants) -> None:
    """PEFT picks default target modules by `model_type` from its tables: a converted LM keeps its host's
    module names, so it gets its host's entries (LoRA: q_proj, v_proj)."""
    tables = [t for name, t in vars(constants).items() if name.startswith("TRANSFORMERS_MODELS_TO_")
              and name.endswith("_MAPPING") and isinstance(t, dict)]
    for host in CAUSAL_LMS.values():
        for table in tables:
            if host in table:
                table.setdefault(MODEL_TYPE_PREFIX + host, table[host])
