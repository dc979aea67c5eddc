"""The models to score: an nn.Module as given, or loaded from anything the converter accepts (alias,
tiny-* name, base-model directory, converted checkpoint directory, hub id); and the check that a
model and its reference take the same inputs."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..convert import ConversionReport
from ..families import FamilyAdapter, UnsupportedModelError, adapter_for_model
from ..locations import SOURCE_ATTR, components_of
from ..models import load_model
from ..placement import cast_model, parse_dtype
from .errors import EvalError

# config keys that fix what a model takes in and puts out: two models compared must agree on them
INPUT_KEYS = ("vocab_size", "in_channels", "out_channels", "patch_size", "sample_size", "caption_channels",
              "text_dim", "image_dim", "num_embeds_ada_norm")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_model(spec: nn.Module | str | Path, *, role: str, dtype=None, device=None,
                  subfolder: str | None = None) -> nn.Module:
    """`spec` as a model in eval mode. `load_model` reads a directory holding mhla_config.json as a
    converted checkpoint (`from_pretrained`) and anything else as a base model (`subfolder`: the
    model's folder in a directory or hub repo). An nn.Module is used as given: cast to `dtype` and
    moved to `device` only when those are set."""
    if not isinstance(spec, (nn.Module, str, Path)):
        hint = " (convert() changes the model in place and returns its report)"
        raise EvalError(f"the {role} must be a model (nn.Module), a name or a path; got {type(spec).__name__}"
                        + (hint if isinstance(spec, ConversionReport) else ""))
    try:
        torch_dtype = parse_dtype(dtype)
        if isinstance(spec, nn.Module):
            if torch_dtype is not None:
                cast_model(spec, torch_dtype)
            return spec.to(device) if device is not None else spec
        return load_model(str(spec), torch_dtype=torch_dtype, device=device or default_device(), subfolder=subfolder)
    except (ValueError, OSError) as error:
        raise EvalError(f"cannot load the {role} {spec}: {error}") from None


def adapter_of(model: nn.Module, role: str) -> FamilyAdapter:
    try:
        return adapter_for_model(model)
    except UnsupportedModelError as error:
        raise EvalError(f"the {role} is not a model mhla-convert knows: {error}") from None


def is_language_model(adapter: FamilyAdapter) -> bool:
    """Scored on text (next-token loss, perplexity, passkey, lm-eval tasks) rather than on latents."""
    return adapter.library == "transformers"


def describe(spec: nn.Module | str | Path) -> str:
    if not isinstance(spec, nn.Module):
        return str(spec)
    base = (getattr(spec, SOURCE_ATTR, None) or {}).get("base_model")
    return f"{type(spec).__name__} (in memory{f', from {base}' if base else ''})"


def base_model(model: nn.Module) -> str | None:
    """Where the model's VAE, text encoder and tokenizer come from: its checkpoint's own copies, or its base."""
    return components_of(model)


def config_value(model: nn.Module, key: str):
    """A config entry of a diffusers (dict) or transformers (attributes) model; lists as tuples."""
    config = model.config
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return tuple(value) if isinstance(value, list) else value


def check_comparable(model: nn.Module, reference: nn.Module, families: tuple[str, str]) -> None:
    """Scores are only comparable on the same inputs: same family, vocabulary and latent shapes."""
    if families[0] != families[1]:
        raise EvalError(f"the model is a {families[0]} model but the reference is a {families[1]} model: "
                        "compare a converted model with the base model it was converted from")
    for key in INPUT_KEYS:
        ours, theirs = config_value(model, key), config_value(reference, key)
        if ours != theirs:
            raise EvalError(f"the model and the reference take different inputs ({key} {ours} vs {theirs}): "
                            "compare a converted model with the base model it was converted from")
