"""mhla-convert: turn pretrained attention into Multi-Head Linear Attention (MHLA).

Importing the package is light: each name below loads its module on first use (PEP 562), and transformers,
diffusers and PEFT learn about the converted classes as they load the modules that look them up (registration.py).
"""

import importlib
import sys
import types
from importlib.metadata import PackageNotFoundError, version

from . import registration

try:
    __version__ = version("mhla-convert")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0"

_MIXING = ("clamp_mixing_", "initial_mixing", "locality_mixing", "relative_causal_mixing", "toeplitz_causal_mixing",
           "uniform_mixing")
_EXPORTS = {  # public name -> the module that defines it
    "ConversionReport": "convert", "convert": "convert", "evaluate": "evaluate", "push_to_hub": "hub",
    "from_pretrained": "io", "save_pretrained": "io", "MHLAConfig": "layer", "MHLAttention": "layer",
    "mhla_layers": "layer", **dict.fromkeys(_MIXING, "mixing"), "load_model": "models", "tiny_model": "models",
    "mhla_attention": "ops",
}
__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    else:  # a submodule, as `import mhla_convert.<name>` would give it
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    vars(sys.modules[__name__])[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """`mhla_convert.convert` and `mhla_convert.evaluate` stay the functions: importing the submodules of those names
    binds nothing over them."""

    def __setattr__(self, name: str, value) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
registration.install()
