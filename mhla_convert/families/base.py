"""The family-adapter contract and its registry (modelled on PEFT's tuner injection: find the
target modules, create the replacement, swap it in). Adding a model family is one new file in
this package that subclasses `FamilyAdapter` and decorates it with `@register`."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, ClassVar

import torch
from torch import nn

from ..layer import MHLAConfig
from ..specs import DataSpec, Objective, ObjectiveSpec

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
    """The adapter of `model`'s class or, for a converted model (a subclass), of its base class."""
    for klass in type(model).__mro__:
        for cls in families().values():
            if klass.__name__ in cls.model_classes:
                return cls()
    raise _unsupported(f"class {type(model).__name__}")


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
    """Everything mhla-convert knows about one model family: where its self-attention lives, how to
    swap it for MHLA, how to build its models, and how to train and sample it.

    A new family is one file in this package: a subclass decorated with `@register`. It sets the
    class attributes `name`, `library` and `model_classes` (optional: `aliases`, `causal`, `joint_text`) and
    overrides (diffusers transformers get most of these from `DiffusersAdapter`):

    required, to convert and save: `attention_modules`, `default_blocks`, `convert_layer`,
    `example_inputs`, `build`, `load_pretrained`, `model_config`, `tiny_config` (or `tiny_configs`);
    required, to train: `objective`, `synthetic_data` (DiffusersAdapter: `denoise`, the call its objective makes);
    required, to sample: `sample` (and set `sample_kind`);
    required for diffusion pipelines (image / video folders, sampling): `pipeline_name`, `tiny_components`,
    `encode_latents`, `encode_conditions`;
    required, to reload through the library's own loaders: `mark_converted`, `base_config`;
    optional: `native_grid`, `default_options`, `check_layers`, `prepare`, `tiny_configs` (variants),
    `load_single_file`, `check_folder_spec`, `cache_name`, `takes_first_frame`, `pipeline_tag`, `loader_files`.

    A required hook left out raises NotImplementedError naming the family and the hook.
    """

    name: ClassVar[str]
    library: ClassVar[str]  # "diffusers" or "transformers"
    model_classes: ClassVar[tuple[str, ...]]  # class names this adapter converts
    aliases: ClassVar[dict[str, str]] = {}  # CLI alias -> hub id
    causal: ClassVar[bool] = False
    joint_text: ClassVar[bool] = False  # MM-DiT: text tokens attend with the image's (option text_exact applies)
    sample_kind: ClassVar[str] = "image"  # what `sample` returns: "image", "video" or "text"

    def _missing(self, hook: str) -> NotImplementedError:
        return NotImplementedError(f"family {self.name!r} does not implement FamilyAdapter.{hook} "
                                   "(see mhla_convert/families/base.py)")

    # --- what to convert -------------------------------------------------------------------
    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """The self-attention module of every layer, in layer order (converted or not)."""
        raise self._missing("attention_modules")

    def default_blocks(self, model: nn.Module) -> tuple[int, ...] | None:
        """Blocks per grid axis at the family's native resolution (M² ≤ N); None for causal."""
        raise self._missing("default_blocks")

    def native_grid(self, model: nn.Module) -> tuple[int, ...] | None:
        """The token grid the defaults were chosen for (reported; conversion works at any grid)."""
        return None

    def default_options(self, model: nn.Module) -> dict[str, Any]:
        """Family defaults for MHLAConfig fields (e.g. SANA's eps and scale)."""
        return {}

    def check_layers(self, model: nn.Module, indices: list[int], config: MHLAConfig) -> None:
        """Refuse (ValueError) layers among `indices` that `config` would not convert faithfully (a sliding window
        shorter than the exact span): run before any layer changes."""

    # --- how to convert --------------------------------------------------------------------
    def prepare(self, model: nn.Module) -> None:
        """Install whatever the converted layers need from the host's forward (grid hooks);
        idempotent."""

    def prepare_checkpointing(self, model: nn.Module) -> None:
        """Called once gradient checkpointing is on for training: whatever makes a block's recomputation save what its
        forward saved (the default: nothing)."""

    def convert_layer(self, model: nn.Module, index: int, config: MHLAConfig) -> nn.Module:
        """Replace layer `index`'s self-attention in place, moving its pretrained weights into
        the new module, and return the new module."""
        raise self._missing("convert_layer")

    def example_inputs(self, model: nn.Module, grid: tuple[int, ...] | None = None,
                       batch_size: int = 1) -> dict[str, Any]:
        """Random keyword inputs for `model(**inputs)` on a token `grid` (diffusers) or of
        `grid[0]` tokens (LMs): what the demo, tests and smoke checks feed a model."""
        raise self._missing("example_inputs")

    # --- reloading through the model's own library -------------------------------------------
    def mark_converted(self, model: nn.Module) -> None:
        """Give a just-converted model its converted class (`CONVERTED_PREFIX` + its class name, a
        subclass), which the library's own loaders reload as converted (transformers_models.py,
        diffusers_models.py)."""
        raise self._missing("mark_converted")

    def base_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """A saved converted model's config with the converted class's marks removed: the base
        model's config, what `build` takes. A base config comes back unchanged."""
        raise self._missing("base_config")

    def loader_files(self) -> dict[str, str]:
        """Files (name -> text) a saved checkpoint carries for its library's loaders."""
        return {}

    # --- building models -------------------------------------------------------------------
    def tiny_config(self) -> dict[str, Any]:
        """A config for a tiny random-weight model of this family (tests, demo, offline use)."""
        raise self._missing("tiny_config")

    def tiny_configs(self) -> dict[str, dict[str, Any]]:
        """Every built-in tiny model of this family by name; a family with variants (Wan T2V and
        I2V) overrides this, the rest get `tiny-<family>` from `tiny_config()`."""
        return {f"tiny-{self.name}": self.tiny_config()}

    def build(self, config: dict[str, Any]) -> nn.Module:
        """A randomly initialised base model from a config dict."""
        raise self._missing("build")

    def load_pretrained(self, path_or_id: str, **kwargs) -> nn.Module:
        """The pretrained base model from a local directory or hub id."""
        raise self._missing("load_pretrained")

    def load_single_file(self, path: str, *, config: str, **kwargs) -> nn.Module:
        """The pretrained base model from one weights file, its config from `config` (a directory
        or hub id, `subfolder` in kwargs); diffusers families with `from_single_file` override this."""
        raise UnsupportedModelError(
            f"{self.name} models ({', '.join(self.model_classes)}) cannot load from a single weights file "
            "(diffusers' from_single_file does not support them): give the model's directory or hub id")

    def model_config(self, model: nn.Module) -> dict[str, Any]:
        """The base model's own config as a JSON-able dict (what `build` takes back)."""
        raise self._missing("model_config")

    # --- training --------------------------------------------------------------------------
    def objective(self, spec: ObjectiveSpec) -> Objective:
        """The family's training objective (train/objectives.py: `FlowMatching`, `EpsPrediction`,
        `NextToken`), built from the recipe's objective section."""
        raise self._missing("objective")

    def synthetic_data(self, model: nn.Module, spec: DataSpec, seed: int) -> dict[str, torch.Tensor]:
        """The built-in synthetic training set as columns {name: (N, ...) tensor}: structured random
        data with the model's own shapes, so that training on it can lower the loss."""
        raise self._missing("synthetic_data")

    def cache_name(self, model: nn.Module) -> str:
        """What the encoded-data cache key calls this model's task (variants that encode the same
        files into different tensors return different names)."""
        return self.name

    # --- image / video folders (diffusion) -------------------------------------------------
    def pipeline_name(self, transformer: nn.Module) -> str:
        """The diffusers pipeline class that feeds `transformer` as it was trained."""
        raise self._missing("pipeline_name")

    def tiny_components(self, transformer: nn.Module) -> dict[str, Any]:
        """Tiny random pipeline components (VAE, text encoder, tokenizer, scheduler, ...) matching
        `transformer`'s config, built in-process with fixed seeds (no downloads)."""
        raise self._missing("tiny_components")

    def check_folder_spec(self, spec: DataSpec) -> None:
        """Refuse folder settings the family's VAE cannot take (raise TrainError)."""

    def encode_latents(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] (B, C, [F,] H, W) → the latents the transformer is trained on."""
        raise self._missing("encode_latents")

    def encode_conditions(self, pipe, transformer: nn.Module, rows: list[dict], pixels: torch.Tensor,
                          latents: torch.Tensor, spec: DataSpec) -> dict[str, torch.Tensor]:
        """The conditioning columns of one encode batch (text embeddings, class labels, ...) from
        the metadata `rows`, the batch's pixels and latents."""
        raise self._missing("encode_conditions")

    # --- sampling --------------------------------------------------------------------------
    def pipeline_tag(self, config: dict[str, Any]) -> str:
        """The Hub's task tag for a model of this family with `config` (its card's `pipeline_tag`)."""
        return {"text": "text-generation", "video": "text-to-video"}.get(self.sample_kind, "text-to-image")

    def takes_first_frame(self, model: nn.Module) -> bool:
        """Whether `sample` needs a first frame (image-to-video models)."""
        return False

    def sample(self, model: nn.Module, base: str | None, prompt: str, *, device: str, seed: int = 0,
               steps: int = 20, guidance_scale: float | None = None, class_label: int = 0,
               height: int | None = None, width: int | None = None, num_frames: int | None = None,
               max_new_tokens: int = 32, image=None):
        """One sample from a converted model: a PIL image, a list of (H, W, 3) frames in [0, 1] or
        the generated text, as `sample_kind` says. `base` names the model the other pipeline parts
        (VAE, text encoder, tokenizer) come from."""
        raise self._missing("sample")
