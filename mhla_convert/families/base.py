"""The family-adapter contract and its registry (modelled on PEFT's tuner injection: find the
target modules, create the replacement, swap it in). Adding a model family is one new file in
this package that subclasses `FamilyAdapter` and decorates it with `@register`."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, ClassVar

from torch import nn

from ..layer import MHLAConfig

_REGISTRY: dict[str, type["FamilyAdapter"]] = {}


class UnsupportedModelError(ValueError):
    pass


def register(cls: type["FamilyAdapter"]) -> type["FamilyAdapter"]:
    _REGISTRY[cls.name] = cls
    return cls


def _load_all() -> None:
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name != "base":
            importlib.import_module(f"{__package__}.{info.name}")


def families() -> dict[str, type["FamilyAdapter"]]:
    _load_all()
    return dict(_REGISTRY)


def _unsupported(what: str) -> UnsupportedModelError:
    supported = ", ".join(f"{name} ({', '.join(cls.model_classes)})" for name, cls in sorted(families().items()))
    return UnsupportedModelError(
        f"unsupported model {what}; supported families: {supported}. "
        "To add one, write a FamilyAdapter subclass in mhla_convert/families/ (see base.py)."
    )


def adapter_for_model(model: nn.Module) -> "FamilyAdapter":
    name = type(model).__name__
    for cls in families().values():
        if name in cls.model_classes:
            return cls()
    raise _unsupported(f"class {name}")


def adapter_for_family(family: str) -> "FamilyAdapter":
    try:
        return families()[family]()
    except KeyError:
        raise _unsupported(f"family {family!r}") from None


def adapter_for_config(config: dict[str, Any]) -> "FamilyAdapter":
    """Detect the family from a saved config (diffusers `_class_name`, transformers `architectures`)."""
    names = [config.get("_class_name"), *(config.get("architectures") or [])]
    for cls in families().values():
        if any(n in cls.model_classes for n in names if n):
            return cls()
    raise _unsupported(f"with config class {names[0] or (names[1:] or ['?'])[0]}")


class FamilyAdapter:
    """Where one family keeps its self-attention and how to swap it for MHLA.

    Subclasses set the class attributes and implement the methods that raise here.
    """

    name: ClassVar[str]
    library: ClassVar[str]  # "diffusers" or "transformers"
    model_classes: ClassVar[tuple[str, ...]]  # class names this adapter converts
    aliases: ClassVar[dict[str, str]] = {}  # CLI alias -> hub id
    causal: ClassVar[bool] = False

    # --- what to convert -------------------------------------------------------------------
    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """The self-attention module of every layer, in layer order (converted or not)."""
        raise NotImplementedError

    def default_blocks(self, model: nn.Module) -> tuple[int, ...] | None:
        """Blocks per grid axis at the family's native resolution (M² ≤ N); None for causal."""
        raise NotImplementedError

    def native_grid(self, model: nn.Module) -> tuple[int, ...] | None:
        """The token grid the defaults were chosen for (reported; conversion works at any grid)."""
        return None

    def default_options(self, model: nn.Module) -> dict[str, Any]:
        """Family defaults for MHLAConfig fields (e.g. SANA's eps and scale)."""
        return {}

    # --- how to convert --------------------------------------------------------------------
    def prepare(self, model: nn.Module) -> None:
        """Install whatever the converted layers need from the host's forward (grid hooks);
        idempotent."""

    def convert_layer(self, model: nn.Module, index: int, config: MHLAConfig) -> nn.Module:
        """Replace layer `index`'s self-attention in place, moving its pretrained weights into
        the new module, and return the new module."""
        raise NotImplementedError

    def example_inputs(self, model: nn.Module, grid: tuple[int, ...] | None = None, batch_size: int = 1) -> dict[str, Any]:
        """Random keyword inputs for `model(**inputs)` on a token `grid` (diffusers) or of
        `grid[0]` tokens (LMs): what the demo, tests and smoke checks feed a model."""
        raise NotImplementedError

    # --- building models -------------------------------------------------------------------
    def tiny_config(self) -> dict[str, Any]:
        """A config for a tiny random-weight model of this family (tests, demo, offline use)."""
        raise NotImplementedError

    def tiny_configs(self) -> dict[str, dict[str, Any]]:
        """Every built-in tiny model of this family by name; a family with variants (Wan T2V and
        I2V) overrides this, the rest get `tiny-<family>` from `tiny_config()`."""
        return {f"tiny-{self.name}": self.tiny_config()}

    def build(self, config: dict[str, Any]) -> nn.Module:
        """A randomly initialised base model from a config dict."""
        raise NotImplementedError

    def load_pretrained(self, path_or_id: str, **kwargs) -> nn.Module:
        """The pretrained base model from a local directory or hub id."""
        raise NotImplementedError

    def model_config(self, model: nn.Module) -> dict[str, Any]:
        """The base model's own config as a JSON-able dict (what `build` takes back)."""
        raise NotImplementedError
