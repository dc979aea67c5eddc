"""Which layers a hybrid conversion turns into MHLA."""

from __future__ import annotations

from .ops.blocks import whole_number

STRATEGIES = ("spread", "first", "last", "auto")

AUTO_NEEDS_CALIBRATION = (
    "strategy 'auto' ranks the layers by how much converting each one changes the model's output, so it needs "
    "calibration data: pass calibration=[model input dicts, ...] (CLI: --calibration synthetic or a data path; "
    "recipes: conversion.calibration_batches), or pick strategy spread, first or last"
)


def check_selection(ratio: float, strategy: str) -> None:
    """Refuse a ratio outside [0, 1] or an unknown strategy (before any expensive step)."""
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1] (the fraction of layers to convert); got {ratio!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}; got {strategy!r}")


def parse_layers(layers) -> list[int] | str | None:
    """Layer indices as a list of whole numbers ≥ 0 (1.7 is refused, never read as 1); a layer type's name
    ("sliding_attention") stays, for `layers_of_type` once the model is known; None stays."""
    if layers is None or (isinstance(layers, str) and layers.isidentifier()):
        return layers
    iterable = hasattr(layers, "__iter__") and not isinstance(layers, (str, bytes, dict))
    out = [whole_number(i) for i in layers] if iterable else [None]
    if None in out or any(i < 0 for i in out):
        raise ValueError(f"layers must be a list of layer indices (whole numbers ≥ 0) like [1, 4, 7], or a layer "
                         f"type of the model's config.layer_types like 'sliding_attention'; got {layers!r}")
    return out


def layers_of_type(model, layer_type: str) -> list[int]:
    """The indices of `model`'s layers whose `config.layer_types` entry is `layer_type` (Gemma 3's
    "sliding_attention" and "full_attention"); `convert(model, layers="sliding_attention")` converts one kind."""
    types = list(getattr(model.config, "layer_types", None) or [])
    if not types:
        raise ValueError(f"layers={layer_type!r} names a layer type, but this model's config has no layer_types: "
                         "give layer indices like [1, 4, 7]")
    if layer_type not in types:
        raise ValueError(f"no layer of type {layer_type!r}: this model's layer types are {sorted(set(types))}")
    return [i for i, kind in enumerate(types) if kind == layer_type]


def plan_layers(num_layers: int, *, ratio: float = 1.0, strategy: str = "spread", layers=None,
                sensitivity: dict[int, float] | None = None) -> list[int]:
    """Sorted indices of the layers to convert.

    `spread` converts k = round(ratio·L) layers and keeps softmax at floor(j·L/(L−k)),
    j = 0 … L−k−1 — for 30 layers at ratio 2/3 that keeps 0, 3, …, 27 (the published Wan hybrid).
    `first` / `last` convert the first / last k; `auto` converts the k layers with the lowest
    `sensitivity` (see sensitivity.py; ties go to the lower index); an explicit `layers` list wins over all.
    """
    if layers is not None:
        chosen = sorted(set(parse_layers(layers)))
        bad = [i for i in chosen if i >= num_layers]
        if bad:
            raise ValueError(
                f"layer indices {bad} out of range: the model has {num_layers} layers (0 … {num_layers - 1})"
            )
        return chosen
    check_selection(ratio, strategy)
    k = round(ratio * num_layers)
    if strategy == "auto":
        if sensitivity is None:
            raise ValueError(AUTO_NEEDS_CALIBRATION)
        missing = sorted(set(range(num_layers)) - set(sensitivity))
        if missing:
            raise ValueError(f"sensitivity has no score for layers {missing}; score every layer (layer_sensitivity)")
        return sorted(sorted(range(num_layers), key=lambda i: (sensitivity[i], i))[:k])
    if strategy == "first":
        return list(range(k))
    if strategy == "last":
        return list(range(num_layers - k, num_layers))
    keep = {j * num_layers // (num_layers - k) for j in range(num_layers - k)}
    return [i for i in range(num_layers) if i not in keep]
