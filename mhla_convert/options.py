"""The MHLA options of a conversion: the family's defaults, the caller's overrides and the
attention kind, checked and combined into one `MHLAConfig` (shared by every converted layer).

attention="mhla" (default): the family's block layout (non-causal) or chunk window (causal) with
    locality-initialised mixing.
attention="linear": plain linear attention, the baseline MHLA improves on. One block per grid axis
    (M = 1) for non-causal families; one chunk-distance weight (window 1) for causal ones, which
    gives every earlier chunk the same weight, i.e. causal linear attention (no exact chunks). A single mixing weight
    cancels out of the normalised output, so no other option changes.
"""

from __future__ import annotations

import dataclasses

from .layer import MHLAConfig

ATTENTIONS = ("mhla", "linear")


def parse_blocks(blocks) -> tuple[int, ...] | None:
    if blocks is None or isinstance(blocks, tuple):
        return blocks
    if isinstance(blocks, str):
        try:
            return tuple(int(b) for b in blocks.lower().split("x"))
        except ValueError:
            raise ValueError(f"blocks must look like '4x4' or '7x3x5'; got {blocks!r}") from None
    return tuple(int(b) for b in blocks)


def _linear_attention(adapter, model, blocks, options: dict) -> tuple[tuple[int, ...] | None, dict]:
    """blocks and options for attention='linear', refusing explicit settings that contradict it."""
    if adapter.causal:
        for name, value in (("window", 1), ("exact_chunks", 0)):
            if options.get(name, value) != value:
                raise ValueError(f"attention='linear' is MHLA with window 1 and no exact chunks; drop "
                                 f"{name}={options[name]} or use attention='mhla'")
        return blocks, {**options, "window": 1, "exact_chunks": 0, "mixing_init": options.get("mixing_init", "uniform")}
    ones = (1,) * len(adapter.default_blocks(model))
    if blocks is not None and tuple(blocks) != ones:
        raise ValueError(
            f"attention='linear' is MHLA with one block ({'x'.join(map(str, ones))}); "
            f"drop blocks={'x'.join(map(str, blocks))} or use attention='mhla'"
        )
    return ones, {**options, "mixing_init": options.get("mixing_init", "uniform")}


def resolve_config(adapter, model, *, attention: str = "mhla", blocks=None, **mhla_options) -> MHLAConfig:
    """The MHLAConfig a conversion of `model` uses: family defaults, then `mhla_options`, then `attention`."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {list(ATTENTIONS)}; got {attention!r}")
    known = {f.name for f in dataclasses.fields(MHLAConfig)}
    unknown = sorted(set(mhla_options) - known)
    if unknown:
        raise ValueError(f"unknown MHLA options {unknown}; allowed: {sorted(known - {'blocks', 'causal'})}")
    blocks = parse_blocks(blocks)
    if adapter.causal and blocks is not None:
        raise ValueError(
            f"{adapter.name} is causal: its blocks are chunks of chunk_size tokens, so blocks= does not apply")
    if attention == "linear":
        blocks, mhla_options = _linear_attention(adapter, model, blocks, mhla_options)
    options = {**adapter.default_options(model), **mhla_options}
    if not adapter.causal:
        default = adapter.default_blocks(model)
        blocks = blocks or default
        if default is not None and len(blocks) != len(default):
            example = "x".join(map(str, default))
            raise ValueError(f"blocks must have {len(default)} axes for {adapter.name} (e.g. {example}); got {blocks}")
    return MHLAConfig(**{**options, "blocks": None if adapter.causal else blocks, "causal": adapter.causal})
