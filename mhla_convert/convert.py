"""`convert(model, ...)`: swap a pretrained model's self-attention for MHLA, in place."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from torch import nn
from tqdm.auto import tqdm

from .calibrate import check_calibration, fit_far_weight, fits_far_weight, original_calls, retrieval_scores
from .families import adapter_for_model
from .layer import MHLAConfig
from .ops.blocks import whole_number
from .ops.retrieval import choose_retrieval_heads
from .options import check_options, parse_blocks, resolve_config
from .plan import AUTO_NEEDS_CALIBRATION, layers_of_type, plan_layers
from .sensitivity import layer_sensitivity

__all__ = ["ConversionReport", "LayerReport", "PLAN_ATTR", "apply_plan", "check_conversion", "convert", "parse_blocks"]

PLAN_ATTR = "mhla_plan"  # set on a converted model: everything save/reload needs to redo it
UNUSED_CALIBRATION = ("calibration data ranks layers for strategy 'auto' (without a layers list), fits the weight "
                      "outside an exact region and chooses retrieval heads (retrieval_share); this conversion does "
                      "none of these: drop it or use strategy='auto'")


@dataclass
class LayerReport:
    index: int
    blocks: tuple[int, ...] | None
    grid: tuple[int, ...] | None
    params_added: int
    far_weight: float | None = None  # fitted to calibration data (calibrate.py)


@dataclass
class ConversionReport:
    family: str
    num_layers: int
    converted: list[int]
    layers: list[LayerReport] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    attention: str = "mhla"
    strategy: str | None = None  # how the layers were chosen; "explicit" for a layers list
    sensitivity: dict[int, float] | None = None  # strategy "auto": every layer's score (sensitivity.py)

    @property
    def params_added(self) -> int:
        return sum(layer.params_added for layer in self.layers)

    def __str__(self) -> str:
        scored = self.sensitivity is not None
        fitted = any(layer.far_weight is not None for layer in self.layers)
        header = ("layer", "attention", "blocks", "M", "native grid", "params added")
        rows = [(*header, *(("far weight",) if fitted else ()), *(("sensitivity",) if scored else ()))]
        by_index = {layer.index: layer for layer in self.layers}
        kind = "MHLA" if self.attention == "mhla" else self.attention
        for i in range(self.num_layers):
            score = (f"{self.sensitivity[i]:.4g}",) if scored else ()
            layer = by_index.get(i)
            if layer is None:
                rows.append((str(i), "softmax (kept)", "", "", "", "", *(("",) if fitted else ()), *score))
                continue
            blocks = "x".join(map(str, layer.blocks)) if layer.blocks else f"chunk {self.config.get('chunk_size')}"
            m = str(math.prod(layer.blocks)) if layer.blocks else "-"
            grid = "x".join(map(str, layer.grid)) if layer.grid else "any"
            far = (f"{layer.far_weight:g}",) if fitted else ()
            rows.append((str(i), kind, blocks, m, grid, f"{layer.params_added:,}", *far, *score))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        head = (f"{self.family}: {len(self.converted)} of {self.num_layers} self-attention layers -> {kind}, "
                f"{self.params_added:,} parameters added")
        return "\n".join([head, *lines])


def convert(model: nn.Module, *, ratio: float = 1.0, strategy: str = "spread", layers=None, blocks=None,
            attention: str = "mhla", calibration: Iterable[dict[str, Any]] | None = None, fit_steps: int = 0,
            retrieval_share: float = 0.0, progress: bool = True, **mhla_options) -> ConversionReport:
    """Convert `model`'s self-attention layers to MHLA in place and return a report.

    ratio / strategy / layers choose the layers (see `plan.plan_layers`); strategy "auto" scores
    every layer on `calibration` (batches of keyword inputs for `model(**batch)`, see
    `sensitivity.layer_sensitivity`: `fit_steps` > 0 fits each scored layer briefly first, `progress`
    shows a progress bar) and converts the least
    sensitive ones; with an exact region (`exact_chunks`, `exact_radius`) the batches also fit each layer's weight
    outside it (`calibrate.py`). `retrieval_share` > 0 keeps that share of the converted layers' key heads softmax
    (retrieval heads, ops.retrieval): those whose original attention retrieves single tokens beyond the exact region
    most sharply on `calibration`. attention "linear" is plain linear attention (M = 1, see `options`); blocks
    overrides the family's default block layout ("4x4", (7, 3, 5)); other keywords are `MHLAConfig`
    fields. Only the new MHLA parameters are initialised; pretrained weights move into the new layers.
    A diffusers pipeline converts every transformer it holds (Wan2.2-A14B's two experts) with one plan
    (experts.py) and returns an `experts.PipelineReport`.
    """
    if not isinstance(model, nn.Module) and hasattr(model, "components"):  # a diffusers pipeline
        from .experts import convert_pipeline

        if retrieval_share:
            raise ValueError("retrieval_share is for causal models (LMs): drop it")

        return convert_pipeline(model, ratio=ratio, strategy=strategy, layers=layers, blocks=blocks,
                                attention=attention, calibration=calibration, fit_steps=fit_steps, progress=progress,
                                **mhla_options)
    config = check_conversion(model, ratio=ratio, strategy=strategy, layers=layers, blocks=blocks,
                              attention=attention, **mhla_options)
    if isinstance(layers, str):  # a layer type's name
        layers = layers_of_type(model, layers)
    adapter = adapter_for_model(model)
    num_layers = len(adapter.attention_modules(model))
    auto = layers is None and strategy == "auto"
    fit_far = fits_far_weight(config, attention)
    check_retrieval_share(retrieval_share, config, calibration)
    if auto and calibration is None:
        raise ValueError(AUTO_NEEDS_CALIBRATION)
    if not (auto or fit_far or retrieval_share) and calibration is not None:
        raise ValueError(UNUSED_CALIBRATION)
    if whole_number(fit_steps) is None or fit_steps < 0:
        raise ValueError(f"fit_steps must be a whole number ≥ 0; got {fit_steps!r}")
    if not auto and fit_steps:
        raise ValueError("fit_steps only fits layers while strategy 'auto' scores them; drop it or use strategy='auto'")
    sensitivity = None
    if auto:
        sensitivity = layer_sensitivity(model, calibration, config, fit_steps=fit_steps, progress=progress)
    indices = plan_layers(num_layers, ratio=ratio, strategy=strategy, layers=layers, sensitivity=sensitivity)
    if retrieval_share and indices:
        scores = retrieval_scores(model, adapter, indices, config, check_calibration(calibration))
        config = config.replace(retrieval_heads=choose_retrieval_heads(scores, retrieval_share))
    per_layer = config.retrieval_heads if isinstance(config.retrieval_heads, dict) else {}
    if set(per_layer) - set(indices):
        raise ValueError(f"retrieval_heads names layers {sorted(set(per_layer) - set(indices))}, which are not "
                         f"converted (converted: {indices}); name converted layers only")

    chosen_by = "explicit" if layers is not None else strategy
    report = ConversionReport(adapter.name, num_layers, indices, config=config.to_dict(), attention=attention,
                              strategy=chosen_by, sensitivity=sensitivity)
    if indices:
        adapter.prepare(model)  # (the token-grid hook the fitted layers read: it adds nothing to the state)
    batches = check_calibration(calibration) if fit_far and calibration is not None else None
    for i in tqdm(indices, desc="fitting far weights", disable=not (progress and batches), dynamic_ncols=True):
        if batches:  # (the first layer's calls also check the batches, before any layer changes)
            calls, targets = original_calls(model, adapter.attention_modules(model)[i], batches)
        new = adapter.convert_layer(model, i, config)
        added = sum(p.numel() for n, p in new.named_parameters() if n == "mixing" or n.startswith("out_norm"))
        far = fit_far_weight(new, calls, targets) if batches else None
        report.layers.append(LayerReport(i, config.blocks, adapter.native_grid(model), added, far))
    setattr(model, PLAN_ATTR, {
        "family": adapter.name, "num_layers": num_layers, "layers": indices, "mhla_config": config.to_dict(),
        "attention": attention, "strategy": chosen_by, "sensitivity": sensitivity,
    })
    adapter.mark_converted(model)  # its library's loaders now reload it converted (io.py)
    return report


def check_retrieval_share(share, config: MHLAConfig, calibration) -> None:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ValueError(f"retrieval_share must be a number in [0, 1) (the share of key heads kept softmax); "
                         f"got {share!r}")
    if share and not config.causal:
        raise ValueError("retrieval_share is for causal models (LMs): drop it")
    if share and config.retrieval_heads:
        raise ValueError("retrieval_share chooses the retrieval heads: drop retrieval_heads, or retrieval_share")
    if share and calibration is None:
        raise ValueError("retrieval_share chooses heads on calibration data: give calibration batches")


def check_conversion(model: nn.Module, *, ratio: float = 1.0, strategy: str = "spread", layers=None, blocks=None,
                     attention: str = "mhla", **mhla_options) -> MHLAConfig:
    """Check every option of `convert(model, ...)` against the model's family and config, changing
    nothing: the resolved MHLAConfig, or a ValueError naming the option and the fix. A model built on
    the meta device from its config is enough, so this runs before any weights load."""
    check_options(ratio=ratio, strategy=strategy, layers=layers, blocks=blocks, attention=attention, **mhla_options)
    adapter = adapter_for_model(model)
    if (getattr(model, PLAN_ATTR, None) or {}).get("layers"):  # a plan of no layers is the original
        raise ValueError("this model is already converted; load the original to convert it again")
    num_layers = len(adapter.attention_modules(model))
    if isinstance(layers, str):  # a layer type's name
        layers = layers_of_type(model, layers)
    if layers is not None:
        plan_layers(num_layers, layers=layers)
    config = resolve_config(adapter, model, attention=attention, blocks=blocks, **mhla_options)
    auto = layers is None and strategy == "auto"  # (which layers `auto` keeps is known once it has tried each)
    chosen = range(num_layers) if auto else plan_layers(num_layers, ratio=ratio, strategy=strategy, layers=layers)
    adapter.check_layers(model, list(chosen), config)
    return config


def apply_plan(model: nn.Module, plan: dict[str, Any]) -> ConversionReport:
    """Redo a saved conversion (`model.mhla_plan`) on a freshly built base model: the saved layer
    list, never a new selection. Plans saved before strategy / sensitivity / attention were
    recorded load with those unknown (None) and attention "mhla"."""
    options = dict(plan["mhla_config"])
    blocks = options.pop("blocks")
    options.pop("causal")
    attention = plan.get("attention") or "mhla"
    blocks = None if blocks is None else tuple(blocks)
    report = convert(model, layers=plan["layers"], blocks=blocks, attention=attention, **options)
    sensitivity = plan.get("sensitivity")  # from JSON: layer indices as strings
    sensitivity = None if sensitivity is None else {int(i): float(s) for i, s in sensitivity.items()}
    report.strategy, report.sensitivity = plan.get("strategy"), sensitivity
    getattr(model, PLAN_ATTR).update(strategy=report.strategy, sensitivity=sensitivity)
    return report
