"""How much converting one self-attention layer alone changes a model's output.

For each layer in turn: a converted copy of its attention takes its place, the calibration batches
run, the output is scored against the original model's, and the original module goes back (the
very object, so the model is exactly as before). Scores:

- causal LMs: KL(original ‖ converted) of the next-token distributions, mean over tokens
  (padding excluded when a batch has an `attention_mask`);
- diffusion transformers: the output's mean squared error relative to its mean square.

Cost: one reference forward per calibration batch, then one forward per layer and batch.
`strategy="auto"` (plan.py) keeps the highest-scoring layers as softmax.

Optionally (`fit_steps` > 0) each converted layer first takes a few Adam steps fitting its mixing
and q/k projections to the original layer's output on the calibration inputs, so the score says
how far the layer stays from its original after a short transfer rather than at initialisation.
Each step runs the model only up to that layer. The fit changes the scoring copy alone: the
conversion itself starts from the original weights.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .calibrate import check_calibration, inputs_of
from .families import adapter_for_model
from .finite import main_output
from .layer import MHLAConfig, MHLAttention
from .mixing import clamp_mixing_

FIT_LR = 1e-3
FIT_PARAMETERS = ("mixing", "to_q", "to_k", "out_norm")  # the new parameters and the q/k projections


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


def _fit(model: nn.Module, layer: nn.Module, original: nn.Module, batches, steps: int, lr: float) -> None:
    """`steps` Adam steps on `layer`'s FIT_PARAMETERS towards `original`'s output on the same inputs."""
    fitted = tuple(f"{layer.submodule_name(name)}." for name in FIT_PARAMETERS if name != "mixing")
    params = [p for name, p in layer.named_parameters()
              if (name == "mixing" or name.startswith(fitted)) and p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    for step in range(steps):
        args, kwargs = inputs_of(model, layer, batches[step % len(batches)])
        target = main_output(original(*args, **kwargs)).float()
        with torch.enable_grad():
            loss = F.mse_loss(main_output(layer(*args, **kwargs)).float(), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        optimizer.step()
        clamp_mixing_(layer)


@torch.no_grad()
def layer_sensitivity(model: nn.Module, calibration: Iterable[dict[str, Any]], config: MHLAConfig, *,
                      fit_steps: int = 0, fit_lr: float = FIT_LR, progress: bool = True) -> dict[int, float]:
    """Score every self-attention layer of an unconverted `model`: {layer index: output change}.

    `calibration`: batches of keyword inputs for `model(**batch)` (for diffusion transformers with
    a timestep, e.g. the family adapter's `example_inputs`); `config`: the MHLA options each layer is
    converted with (`options.resolve_config`); `fit_steps` / `fit_lr`: the optional short fit of each
    converted layer before it is scored. The model runs in eval mode and is left unchanged.
    """
    if not isinstance(fit_steps, int) or fit_steps < 0:
        raise ValueError(f"fit_steps must be a whole number ≥ 0 (0: no fit); got {fit_steps!r}")
    batches = check_calibration(calibration)
    adapter = adapter_for_model(model)
    if any(isinstance(m, MHLAttention) for m in adapter.attention_modules(model)):
        raise ValueError("layer_sensitivity scores the layers of an unconverted model; this one has MHLA layers")
    adapter.prepare(model)  # the token-grid hook converted diffusers layers read; outputs unchanged
    masks = [b.get("attention_mask") if adapter.causal else None for b in batches]
    training = model.training
    model.eval()
    try:
        references = [main_output(model(**batch)) for batch in batches]
        originals = adapter.attention_modules(model)
        scores = {}
        for index in tqdm(range(len(originals)), desc="layer sensitivity", disable=not progress, dynamic_ncols=True):
            parent, attr = _slot(model, originals[index])
            setattr(parent, attr, copy.deepcopy(originals[index]))  # conversion moves the copy's weights
            try:
                layer = adapter.convert_layer(model, index, config)
                if fit_steps:
                    _fit(model, layer, originals[index], batches, fit_steps, fit_lr)
                changes = [output_change(ref, main_output(model(**batch)), causal=adapter.causal, attention_mask=mask)
                           for batch, ref, mask in zip(batches, references, masks)]
            finally:
                setattr(parent, attr, originals[index])
            scores[index] = sum(changes) / len(changes)
    finally:
        model.train(training)
    if any(now is not was for now, was in zip(adapter.attention_modules(model), originals)):
        raise RuntimeError("layer_sensitivity did not put every original attention module back")
    return scores
