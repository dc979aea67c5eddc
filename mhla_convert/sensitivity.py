"""How much converting one self-attention layer alone changes a model's output.

For each layer in turn: a converted copy of its attention takes its place, the calibration batches
run, the output is scored against the original model's, and the original module goes back (the
very object, so the model is exactly as before). Scores:

- causal LMs: KL(original ‖ converted) of the next-token distributions, mean over tokens
  (padding excluded when a batch has an `attention_mask`);
- diffusion transformers: the output's mean squared error relative to its mean square.

Cost: one reference forward per calibration batch, then one forward per layer and batch.
`strategy="auto"` (plan.py) keeps the highest-scoring layers as softmax.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .families import adapter_for_model
from .layer import MHLAConfig
from .plan import AUTO_NEEDS_CALIBRATION

EMPTY_CALIBRATION = "calibration is empty: give at least one batch of model inputs (a dict for model(**batch))"


def _main_output(output) -> torch.Tensor:
    """The tensor a model call is judged by: an LM's logits, a diffusion transformer's sample."""
    for name in ("logits", "sample"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)):
        return output[0]
    return output


def output_change(reference: torch.Tensor, output: torch.Tensor, *, causal: bool, attention_mask=None) -> float:
    """The score of `output` against `reference` (see the module docstring)."""
    reference, output = reference.float(), output.float()
    if causal:
        kl = F.kl_div(output.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none").sum(-1)
        if attention_mask is None:
            return float(kl.mean())
        mask = attention_mask.to(kl)
        return float((kl * mask).sum() / mask.sum().clamp_min(1))
    return float((output - reference).pow(2).mean() / reference.pow(2).mean().clamp_min(1e-30))


def _slot(model: nn.Module, module: nn.Module) -> tuple[nn.Module, str]:
    """The parent module and attribute name that hold `module`."""
    for name, candidate in model.named_modules():
        if candidate is module:
            parent, _, attr = name.rpartition(".")
            return model.get_submodule(parent), attr
    raise ValueError(f"{type(module).__name__} is not a submodule of the model")


def _batches(calibration: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    if calibration is None:
        raise ValueError(AUTO_NEEDS_CALIBRATION)
    batches = list(calibration)
    if not batches:
        raise ValueError(EMPTY_CALIBRATION)
    bad = [i for i, b in enumerate(batches) if not isinstance(b, dict)]
    if bad:
        raise ValueError(f"calibration batches {bad} are not dicts: each batch is the keyword inputs of model(**batch)")
    return batches


@torch.no_grad()
def layer_sensitivity(model: nn.Module, calibration: Iterable[dict[str, Any]], config: MHLAConfig, *,
                      progress: bool = True) -> dict[int, float]:
    """Score every self-attention layer of an unconverted `model`: {layer index: output change}.

    `calibration`: batches of keyword inputs for `model(**batch)` (for diffusion transformers with
    a timestep, e.g. the family adapter's `example_inputs`); `config`: the MHLA options each layer is
    converted with (`options.resolve_config`). The model runs in eval mode and is left unchanged.
    """
    batches = _batches(calibration)
    adapter = adapter_for_model(model)
    adapter.prepare(model)  # the token-grid hook converted diffusers layers read; outputs unchanged
    masks = [b.get("attention_mask") if adapter.causal else None for b in batches]
    training = model.training
    model.eval()
    try:
        references = [_main_output(model(**batch)) for batch in batches]
        originals = adapter.attention_modules(model)
        scores = {}
        for index in tqdm(range(len(originals)), desc="layer sensitivity", disable=not progress, dynamic_ncols=True):
            parent, attr = _slot(model, originals[index])
            setattr(parent, attr, copy.deepcopy(originals[index]))  # conversion moves the copy's weights
            try:
                adapter.convert_layer(model, index, config)
                changes = [output_change(ref, _main_output(model(**batch)), causal=adapter.causal, attention_mask=mask)
                           for batch, ref, mask in zip(batches, references, masks)]
            finally:
                setattr(parent, attr, originals[index])
            scores[index] = sum(changes) / len(changes)
    finally:
        model.train(training)
    if any(now is not was for now, was in zip(adapter.attention_modules(model), originals)):
        raise RuntimeError("layer_sensitivity did not put every original attention module back")
    return scores
