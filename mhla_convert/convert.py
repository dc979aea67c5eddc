"""`convert(model, ...)`: swap a pretrained model's self-attention for MHLA, in place."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .families import adapter_for_model
from .layer import MHLAConfig
from .plan import plan_layers

PLAN_ATTR = "mhla_plan"  # set on a converted model: everything save/reload needs to redo it


@dataclass
class LayerReport:
    index: int
    blocks: tuple[int, ...] | None
    grid: tuple[int, ...] | None
    params_added: int


@dataclass
class ConversionReport:
    family: str
    num_layers: int
    converted: list[int]
    layers: list[LayerReport] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def params_added(self) -> int:
        return sum(layer.params_added for layer in self.layers)

    def __str__(self) -> str:
        rows = [("layer", "attention", "blocks", "M", "native grid", "params added")]
        by_index = {layer.index: layer for layer in self.layers}
        for i in range(self.num_layers):
            layer = by_index.get(i)
            if layer is None:
                rows.append((str(i), "softmax (kept)", "", "", "", ""))
                continue
            blocks = "x".join(map(str, layer.blocks)) if layer.blocks else f"chunk {self.config.get('chunk_size')}"
            m = str(math.prod(layer.blocks)) if layer.blocks else "-"
            grid = "x".join(map(str, layer.grid)) if layer.grid else "any"
            rows.append((str(i), "MHLA", blocks, m, grid, f"{layer.params_added:,}"))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        head = f"{self.family}: {len(self.converted)} of {self.num_layers} self-attention layers -> MHLA, {self.params_added:,} parameters added"
        return "\n".join([head, *lines])


def parse_blocks(blocks) -> tuple[int, ...] | None:
    if blocks is None or isinstance(blocks, tuple):
        return blocks
    if isinstance(blocks, str):
        try:
            return tuple(int(b) for b in blocks.lower().split("x"))
        except ValueError:
            raise ValueError(f"blocks must look like '4x4' or '7x3x5'; got {blocks!r}") from None
    return tuple(int(b) for b in blocks)


def convert(model: nn.Module, *, ratio: float = 1.0, strategy: str = "spread", layers=None, blocks=None, **mhla_options) -> ConversionReport:
    """Convert `model`'s self-attention layers to MHLA in place and return a report.

    ratio / strategy / layers choose the layers (see `plan.plan_layers`); blocks overrides the
    family's default block layout ("4x4", (7, 3, 5)); other keywords are `MHLAConfig` fields.
    Only the new MHLA parameters are initialised; pretrained weights move into the new layers.
    """
    adapter = adapter_for_model(model)
    if (getattr(model, PLAN_ATTR, None) or {}).get("layers"):  # a plan of no layers is the original
        raise ValueError("this model is already converted; load the original to convert it again")
    attention = adapter.attention_modules(model)
    indices = plan_layers(len(attention), ratio=ratio, strategy=strategy, layers=layers)
    options = {**adapter.default_options(model), **mhla_options}
    known = {f.name for f in dataclasses.fields(MHLAConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown MHLA options {unknown}; allowed: {sorted(known - {'blocks', 'causal'})}")
    blocks = parse_blocks(blocks)
    if adapter.causal and blocks is not None:
        raise ValueError(f"{adapter.name} is causal: its blocks are chunks of chunk_size tokens, so blocks= does not apply")
    if not adapter.causal:
        default = adapter.default_blocks(model)
        blocks = blocks or default
        if default is not None and len(blocks) != len(default):
            raise ValueError(f"blocks must have {len(default)} axes for {adapter.name} (e.g. {'x'.join(map(str, default))}); got {blocks}")
    config = MHLAConfig(**{**options, "blocks": None if adapter.causal else blocks, "causal": adapter.causal})

    report = ConversionReport(adapter.name, len(attention), indices, config=config.to_dict())
    if indices:
        adapter.prepare(model)
    for i in indices:
        new = adapter.convert_layer(model, i, config)
        added = sum(p.numel() for n, p in new.named_parameters() if n == "mixing" or n.startswith("out_norm"))
        report.layers.append(LayerReport(i, config.blocks, adapter.native_grid(model), added))
    setattr(model, PLAN_ATTR, {"family": adapter.name, "num_layers": len(attention), "layers": indices, "mhla_config": config.to_dict()})
    return report


def apply_plan(model: nn.Module, plan: dict[str, Any]) -> ConversionReport:
    """Redo a saved conversion (`model.mhla_plan`) on a freshly built base model."""
    options = dict(plan["mhla_config"])
    blocks = options.pop("blocks")
    options.pop("causal")
    return convert(model, layers=plan["layers"], blocks=None if blocks is None else tuple(blocks), **options)
