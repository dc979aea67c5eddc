"""Fitting the weight of what lies outside the exact region to calibration data, layer by layer, at conversion.

A layer with an exact region (`exact_chunks`, `exact_radius`) starts with weight 1 on the region and `far` ·
locality outside it (`mixing.region_mixing`). far = 0 is exactly the host's attention cut to the region; whether
the summaries outside add information or noise depends on how well φ(q)·φ(k) tracks the host's softmax there,
which only data tells. So, given calibration batches, each layer in turn (the ones before it already converted and
fitted, so it sees the inputs it will get) tries every far weight in `CANDIDATES` on the inputs its original gets
and keeps the one whose output is closest to the original's (mean squared error). 0 is a candidate, so no layer
starts further from its original than the cut attention does on that data.

Retrieval heads (`convert(retrieval_share=...)`, ops.retrieval) are chosen on the same data, before any layer
changes: `retrieval_scores` measures how sharply each key head of the original retrieves tokens beyond the exact
region.

Also what conversion and layer scoring (sensitivity.py) share about calibration batches: checking them
(`check_calibration`) and the inputs a layer gets on one (`inputs_of`).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from .finite import main_output
from .layer import MHLAConfig, MHLAttention
from .ops.retrieval import far_retrieval
from .plan import AUTO_NEEDS_CALIBRATION

CANDIDATES = (0.0, *(2.0**e for e in range(-6, 7)))  # 0, 1/64 … 64 (above 1 the region's weight drops below 1)
EMPTY_CALIBRATION = "calibration is empty: give at least one batch of model inputs (a dict for model(**batch))"


def fits_far_weight(config, attention: str) -> bool:
    """Whether a conversion with this resolved `MHLAConfig` and attention kind fits far weights to calibration data."""
    return attention == "mhla" and (bool(config.exact_chunks) or config.exact_radius is not None)


@torch.no_grad()
def fit_far_weight(layer: MHLAttention, calls: list[tuple[tuple, dict]], targets: list[torch.Tensor]) -> float:
    """Set `layer`'s mixing to its region init with the far weight (of `CANDIDATES`) whose outputs on `calls`
    ((args, kwargs) of the layer) are closest to `targets`; returns that weight."""
    best, best_error = 0.0, float("inf")
    for far in CANDIDATES:
        layer.mixing.copy_(layer._initial_mixing(far).to(layer.mixing))
        error = sum(float((main_output(layer(*a, **kw)).float() - t.float()).pow(2).mean()) for (a, kw), t in
                    zip(calls, targets))
        if error < best_error:
            best, best_error = far, error
    layer.mixing.copy_(layer._initial_mixing(best).to(layer.mixing))
    return best


@torch.no_grad()
def original_calls(model: nn.Module, original: nn.Module, batches: list[dict]):
    """The (args, kwargs) the not yet converted attention `original` gets when `model` runs each batch (each forward
    stops there), and its outputs on them; in eval mode."""
    training = model.training
    model.eval()
    try:
        calls = []
        for i, batch in enumerate(batches):
            try:
                calls.append(inputs_of(model, original, batch))
            except Exception as exc:  # noqa: BLE001 - whatever the model raises, named in one line
                first = (str(exc).strip().splitlines() or [""])[0]
                raise ValueError(f"calibration batch {i} does not run through the model ({type(exc).__name__}: "
                                 f"{first}); each batch must be the keyword inputs of model(**batch)") from None
        return calls, [main_output(original(*args, **kwargs)) for args, kwargs in calls]
    finally:
        model.train(training)


class _Projected(Exception):
    pass


@torch.no_grad()
def retrieval_scores(model: nn.Module, adapter, indices: list[int], config: MHLAConfig,
                     batches: list[dict]) -> dict[int, torch.Tensor]:
    """{layer: `far_retrieval` per key head} of the original's layers `indices` on `batches` (ops.retrieval),
    sliding-window layers left out: each layer's q and k come from an MHLA layer built over the original (the host's
    projections, norms and RoPE), which leaves the model as it is."""
    build = getattr(adapter, "attention_class", None)
    if build is None or not config.causal:
        raise ValueError(f"retrieval heads are for causal LMs; {adapter.name} has none: drop retrieval_share")
    probe_config = config.replace(retrieval_heads=())
    scores = {}
    for i in indices:
        original = adapter.attention_modules(model)[i]
        if getattr(original, "sliding_window", None):  # (Gemma 3's local layers: nothing far to retrieve)
            continue
        probe = build(original, probe_config)
        total = 0
        for args, kwargs in original_calls(model, original, batches)[0]:
            seen = {}

            def capture(q, k, v, *rest, **options):
                seen["qk"] = q, k
                raise _Projected

            probe.attend = capture  # (an instance attribute: this probe's operator only)
            try:
                probe(*args, **kwargs)
            except _Projected:
                pass
            total = total + far_retrieval(*seen["qk"], config.chunk_size, config.exact_chunks)
        scores[i] = (total / len(batches)).cpu()
    if not scores:
        raise ValueError("every converted layer is a sliding-window layer, which reads nothing far back: "
                         "retrieval heads need global layers; drop retrieval_share")
    return scores


def check_calibration(calibration: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    if calibration is None:
        raise ValueError(AUTO_NEEDS_CALIBRATION)
    batches = list(calibration)
    if not batches:
        raise ValueError(EMPTY_CALIBRATION)
    bad = [i for i, b in enumerate(batches) if not isinstance(b, dict)]
    if bad:
        raise ValueError(f"calibration batches {bad} are not dicts: each batch is the keyword inputs of model(**batch)")
    return batches


class _Reached(Exception):
    pass


def inputs_of(model: nn.Module, layer: nn.Module, batch: dict[str, Any]) -> tuple[tuple, dict]:
    """The args and kwargs `layer` gets when `model` runs `batch`; the forward stops there."""
    seen = {}

    def hook(module, args, kwargs):
        seen["call"] = args, kwargs
        raise _Reached

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(**batch)
    except _Reached:
        pass
    finally:
        handle.remove()
    args, kwargs = seen["call"]
    # a generation cache belongs to the forward that made it; the fit calls the layers outside it
    # (transformers ≥ 5.24 passes it as `cache`, earlier releases as `past_key_values`)
    return args, {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
