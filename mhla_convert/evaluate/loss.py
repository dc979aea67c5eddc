"""Held-out loss on the family's own training objective, deterministic and low-variance.

Language models: the next-token loss, token-weighted over every batch.
Diffusion: every batch is scored at the same fixed timesteps, one per equal-probability stratum of
the training timestep distribution (quantiles (k + ½)/K), with noise drawn from a generator seeded
by (seed, batch, timestep) alone, so two runs, and a model and its reference, see exactly the same
noisy inputs. Besides the mean ("loss") the loss is reported per timestep band ("loss_t0-250", …),
since a conversion's error differs with the noise level.
"""

from __future__ import annotations

import torch
from torch import nn

NUM_BANDS = 4


def to_model(batch: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The batch on the model's device, floating tensors in its dtype (as training feeds it)."""
    param = next(model.parameters())
    return {k: v.to(param.device, param.dtype if v.is_floating_point() else None) for k, v in batch.items()}


def _noise_generator(seed: int, batch: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + batch) * 1_009 + step)


def next_token_loss(model: nn.Module, objective, batches: list[dict]) -> dict[str, float]:
    total = tokens = 0.0
    for batch in batches:
        batch = to_model(batch, model)
        ids = batch["input_ids"]
        n = ids.shape[0] * (ids.shape[1] - 1)  # every position but the first is predicted
        total += float(objective.loss(model, batch, torch.Generator())) * n
        tokens += n
    return {"loss": total / tokens}


def fixed_timesteps(objective, num_timesteps: int) -> torch.Tensor:
    """Schedule indices at the centres of `num_timesteps` equal-probability strata."""
    return objective.indices_at((torch.arange(num_timesteps, dtype=torch.float64) + 0.5) / num_timesteps)


def band_name(timestep: float, num_train_timesteps: int) -> str:
    width = num_train_timesteps // NUM_BANDS
    band = min(int(timestep) // width, NUM_BANDS - 1)
    return f"loss_t{band * width}-{(band + 1) * width}"


def diffusion_loss(model: nn.Module, objective, batches: list[dict], *, seed: int,
                   num_timesteps: int) -> dict[str, float]:
    indices = fixed_timesteps(objective, num_timesteps)
    bands = [band_name(float(objective.timestep(i)), objective.spec.num_train_timesteps) for i in indices]
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for b, batch in enumerate(batches):
        batch = to_model(batch, model)
        x0 = batch["latents"]
        for k, (index, band) in enumerate(zip(indices, bands)):
            noise = torch.randn(x0.shape, generator=_noise_generator(seed, b, k)).to(x0)
            pred, target = objective.prediction(model, batch, index.expand(x0.shape[0]), noise)
            per_example = (pred - target).square().flatten(1).mean(1).double().sum().item()
            for name in ("loss", band):
                sums[name] = sums.get(name, 0.0) + per_example
                counts[name] = counts.get(name, 0) + x0.shape[0]
    return {name: sums[name] / counts[name] for name in sorted(sums, key=_band_order)}


def _band_order(name: str) -> tuple[int, int]:
    return (0, 0) if name == "loss" else (1, int(name.removeprefix("loss_t").split("-")[0]))


def heldout_loss(model: nn.Module, objective, batches: list[dict], *, language_model: bool, seed: int,
                 num_timesteps: int) -> dict[str, float]:
    if language_model:
        return next_token_loss(model, objective, batches)
    return diffusion_loss(model, objective, batches, seed=seed, num_timesteps=num_timesteps)
