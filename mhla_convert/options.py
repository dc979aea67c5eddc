"""The MHLA options of a conversion: the family's defaults, the caller's overrides and the
attention kind, checked and combined into one `MHLAConfig` (shared by every converted layer).

attention="mhla" (default): the family's block layout (non-causal) or chunk window (causal) with
    locality-initialised mixing.
attention="linear": plain linear attention, the baseline MHLA improves on. One block per grid axis
    (M = 1, no exact region) for non-causal families; one chunk-distance weight (window 1) for causal ones, which
    gives every earlier chunk the same weight, i.e. causal linear attention (no exact chunks). A single mixing weight
    cancels out of the normalised output, so no other option changes.
attention="local": the host's softmax attention cut to the exact region of an MHLA conversion with the same options
    (`exact_chunks` causal, `exact_radius` non-causal): mixing 1 on the region, 0 elsewhere, fixed. Not a speed-up:
    the control that tells what the summaries outside the region add (a sliding window, for an LM).
"""

from __future__ import annotations

import dataclasses
import re

from .layer import MHLAConfig
from .ops.blocks import as_axes, whole_number
from .plan import check_selection, parse_layers

ATTENTIONS = ("mhla", "linear", "local")
USER_OPTIONS = tuple(sorted({f.name for f in dataclasses.fields(MHLAConfig)} - {"blocks", "causal"}))


def parse_blocks(blocks) -> tuple[int, ...] | None:
    """'4x4', '7x3x5', (4, 4) or [4, 4] → a tuple of whole numbers ≥ 1; None (the family's default) stays."""
    if blocks is None:
        return None
    if isinstance(blocks, str):
        if not re.fullmatch(r"\d+(x\d+){0,2}", blocks.strip().lower()):
            raise ValueError(f"blocks must look like '4x4' or '7x3x5' (blocks per grid axis); got {blocks!r}")
        blocks = [int(b) for b in blocks.strip().lower().split("x")]
    return as_axes("blocks", blocks)


def check_mhla_option(name: str, value) -> None:
    """One MHLA option's own value (type, range, registry name), whatever the other options are."""
    if name not in USER_OPTIONS:
        raise ValueError(f"unknown MHLA options {[name]}; allowed: {list(USER_OPTIONS)}")
    context = {}
    if name == "exact_chunks" and whole_number(value) is not None and value > 0:  # legal on a causal layer
        context = {"causal": True, "window": value + 1}
    if name == "retrieval_heads" and value:  # legal on a causal layer
        context = {"causal": True}
    MHLAConfig(**{**context, name: value})


def check_mhla_options(mhla_options: dict, *, causal: bool | None = None, defaults: dict | None = None,
                       family: str | None = None) -> None:
    """Refuse unknown MHLAConfig fields, bad values (types, ranges, registry names) and options that contradict
    each other, without a model.

    `causal`, `defaults` and `family` are the family's (`adapter.causal`, `adapter.default_options(model)`,
    `adapter.name`) where known: the options are then checked as the conversion combines them, each given one
    over the family's default, and a conflict names the default it meets. Where the family or its defaults
    are not known yet (a recipe or the CLI before the model is), only what the given options fix is checked;
    the conversion checks the rest against the family (`resolve_config`)."""
    unknown = sorted(set(mhla_options) - set(USER_OPTIONS))
    if unknown:
        raise ValueError(f"unknown MHLA options {unknown}; allowed: {list(USER_OPTIONS)}")
    for name, value in mhla_options.items():
        check_mhla_option(name, value)
    options = {**(defaults or {}), **mhla_options}

    def said(name: str) -> str:  # the value the conversion uses, and whose it is when the caller did not set it
        whose = "" if name in mhla_options else f" ({family or 'the family'}'s default)" if name in options else \
            " (the default)"
        return f"{name}={options.get(name, getattr(MHLAConfig, name))}{whose}"

    chunks, radius = options.get("exact_chunks") or 0, options.get("exact_radius")
    if chunks and causal is False:
        raise ValueError(f"{said('exact_chunks')} is for causal models (LMs); {family or 'this model'} is not "
                         "causal and reads its nearest blocks exactly with exact_radius: drop exact_chunks")
    if radius is not None and causal:
        raise ValueError(f"{said('exact_radius')} is for non-causal models; {family or 'this model'} is causal and "
                         "reads its nearest chunks exactly with exact_chunks: drop exact_radius")
    if chunks and radius is not None:
        raise ValueError(f"{said('exact_chunks')} is for causal models and {said('exact_radius')} for non-causal "
                         "ones: set one of them")
    if (chunks or radius is not None) and not options.get("normalize", True):
        region = "exact_chunks" if chunks else "exact_radius"
        off = "exact_chunks=0" if chunks else "exact_radius=null"
        raise ValueError(f"{said(region)} needs normalize=true (the exact region and the linear summaries share "
                         f"one normaliser): set {off} or drop normalize=false")
    window_known = "window" in mhla_options or defaults is not None
    window = options.get("window", MHLAConfig.window)
    if chunks and window_known and whole_number(window) is not None and chunks >= window:
        raise ValueError(f"{said('exact_chunks')} must be < {said('window')}: the exact chunks are the nearest of "
                         f"the window's; set exact_chunks to at most {window - 1} or window to at least {chunks + 1}")
    if causal is None:  # the family's, later: checked here as either kind may be
        causal = bool(chunks or options.get("retrieval_heads"))
    if not window_known and chunks:
        options["window"] = chunks + 1
    MHLAConfig(**{**options, "causal": causal})


def check_options(*, ratio=1.0, strategy="spread", layers=None, blocks=None, attention="mhla", **mhla_options) -> None:
    """Every check of conversion options that needs no model: run before anything loads."""
    if layers is None:
        check_selection(ratio, strategy)
    parse_layers(layers)
    parse_blocks(blocks)
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {list(ATTENTIONS)}; got {attention!r}")
    check_mhla_options(mhla_options)


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
    if options.get("exact_radius") is not None:
        raise ValueError(f"attention='linear' reads nothing exactly; drop exact_radius={options['exact_radius']} or "
                         "use attention='mhla'")
    return ones, {**options, "exact_radius": None, "mixing_init": options.get("mixing_init", "uniform")}


def _local_attention(adapter, options: dict) -> dict:
    """options for attention='local': the region's weights alone, fixed."""
    region = options.get("exact_chunks") if adapter.causal else options.get("exact_radius")
    if not region and region != 0:
        name = "exact_chunks" if adapter.causal else "exact_radius"
        raise ValueError(f"attention='local' keeps only the exact region, and {adapter.name} has none: set {name}")
    for name, value in (("far_init", 0.0), ("learnable_mixing", False)):
        if options.get(name, value) != value:
            raise ValueError(f"attention='local' is fixed mixing of the exact region alone; drop "
                             f"{name}={options[name]} or use attention='mhla'")
    return {**options, "far_init": 0.0, "learnable_mixing": False}


def resolve_config(adapter, model, *, attention: str = "mhla", blocks=None, **mhla_options) -> MHLAConfig:
    """The MHLAConfig a conversion of `model` uses: family defaults, then `mhla_options`, then `attention`."""
    check_options(blocks=blocks, attention=attention, **mhla_options)
    blocks = parse_blocks(blocks)
    if adapter.causal and blocks is not None:
        raise ValueError(
            f"{adapter.name} is causal: its blocks are chunks of chunk_size tokens, so blocks= does not apply")
    if attention == "linear":
        blocks, mhla_options = _linear_attention(adapter, model, blocks, mhla_options)
    defaults = adapter.default_options(model)
    check_mhla_options(mhla_options, causal=adapter.causal, defaults=defaults, family=adapter.name)
    options = {**defaults, **mhla_options}
    if not options.get("text_exact", True) and not adapter.joint_text:
        raise ValueError(f"text_exact=False is for joint text-image models (FLUX.1, Qwen-Image, HunyuanVideo), not "
                         f"{adapter.name}; drop it")
    if attention == "local":
        options = _local_attention(adapter, options)
    if not adapter.causal:
        default = adapter.default_blocks(model)
        blocks = blocks or default
        if default is not None and len(blocks) != len(default):
            example = "x".join(map(str, default))
            raise ValueError(f"blocks must have {len(default)} axes for {adapter.name} (e.g. {example}); got {blocks}")
        _check_fits_grid(adapter, model, blocks)
    return MHLAConfig(**{**options, "blocks": None if adapter.causal else blocks, "causal": adapter.causal})


def _check_fits_grid(adapter, model, blocks: tuple[int, ...]) -> None:
    """A block needs at least one token per axis of the family's native token grid."""
    grid = adapter.native_grid(model)
    if grid is None or len(grid) != len(blocks) or all(b <= g for b, g in zip(blocks, grid)):
        return
    largest = "x".join(map(str, grid))
    raise ValueError(
        f"blocks {'x'.join(map(str, blocks))} do not fit {adapter.name}'s token grid {largest}: "
        f"at most one block per token along each axis, so at most {largest}"
    )
