"""Held-out loss on the family's own training objective, deterministic: the one implementation behind
training's validation (`train/validation.HeldOut`) and `mhla-convert eval`.

The batches are fixed (the first examples, in order). Language models: the next-token loss,
token-weighted over every batch. Diffusion, two ways to draw the noisy inputs:
- one training draw per batch (`timesteps=None`, validation's): batch i draws its timesteps and noise
  from a generator seeded by (seed, i) alone, as a training step would;
- `timesteps=K` fixed timesteps for every batch (eval's, lower variance): one per equal-probability
  stratum of the training timestep distribution (quantiles (k + ½)/K), with noise seeded by (seed,
  batch, timestep), so a model and its reference see exactly the same noisy inputs. Besides the
  mean ("loss") the loss is then reported per timestep band ("loss_t0-250", …), since a
  conversion's error differs with the noise level.
Either way two evaluations of the same weights give the same numbers. Batches can be spread over
processes (`rank`, `world`) and the sums gathered, so every process reports the same values.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from tqdm.auto import tqdm

NUM_BANDS = 4


def batches(columns: dict[str, torch.Tensor], batch_size: int) -> list[dict[str, torch.Tensor]]:
    """The examples of `columns`, in order, as batches of `batch_size` (the last may be smaller)."""
    n = len(next(iter(columns.values())))
    return [{k: v[start : start + batch_size] for k, v in columns.items()} for start in range(0, n, batch_size)]


def fixed_timesteps(objective, num_timesteps: int) -> torch.Tensor:
    """Schedule indices at the centres of `num_timesteps` equal-probability strata."""
    return objective.indices_at((torch.arange(num_timesteps, dtype=torch.float64) + 0.5) / num_timesteps)


def band_name(timestep: float, num_train_timesteps: int) -> str:
    width = num_train_timesteps // NUM_BANDS
    band = min(int(timestep) // width, NUM_BANDS - 1)
    return f"loss_t{band * width}-{(band + 1) * width}"


def _band_order(name: str) -> tuple[int, int]:
    return (0, 0) if name == "loss" else (1, int(name.removeprefix("loss_t").split("-")[0]))


def _batch_generator(seed: int, batch: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + batch)


def _noise_generator(seed: int, batch: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + batch) * 1_009 + step)


@torch.no_grad()
def heldout_loss(model: nn.Module, objective, batch_list: list[dict], *, seed: int = 0, timesteps: int | None = None,
                 device=None, dtype=None, rank: int = 0, world: int = 1, gather=None,
                 progress: str | None = None) -> dict[str, float]:
    """{"loss": the weighted mean loss over `batch_list`, and with `timesteps` its timestep bands}.

    device, dtype: where the batches go (default: the model's first parameter's; integer columns keep
    their type). rank, world, gather: this process scores batches rank, rank + world, …; `gather` sums
    the (names, 2) float64 totals across processes. progress: a tqdm bar with this label (on stderr,
    only when it is a terminal). The model is scored in eval mode and handed back in its own mode."""
    param = next(model.parameters())
    device, dtype = device or param.device, dtype or param.dtype
    diffusion = hasattr(objective, "prediction")
    fixed = diffusion and timesteps is not None
    indices = fixed_timesteps(objective, timesteps) if fixed else []
    bands = [band_name(float(objective.timestep(i)), objective.spec.num_train_timesteps) for i in indices]
    names = sorted({"loss", *bands}, key=_band_order)
    totals = torch.zeros(len(names), 2, dtype=torch.float64, device=device)  # per name: (loss sum, weight)
    mine = [(b, batch) for b, batch in enumerate(batch_list) if b % world == rank]
    was_training = model.training
    model.eval()
    try:
        for b, batch in tqdm(mine, desc=progress, disable=True if progress is None else None, file=sys.stderr,
                             leave=False):
            batch = {k: v.to(device, dtype if v.is_floating_point() else None) for k, v in batch.items()}
            if not fixed:
                # LMs: every position but the first is predicted; diffusion: one draw per example
                count = batch["input_ids"][:, 1:].numel() if not diffusion else len(next(iter(batch.values())))
                loss = objective.loss(model, batch, _batch_generator(seed, b)).double().item()
                totals[0] += torch.tensor([loss * count, count], dtype=torch.float64, device=device)
                continue
            x0 = batch["latents"]
            for k, (index, band) in enumerate(zip(indices, bands)):
                noise = torch.randn(x0.shape, generator=_noise_generator(seed, b, k)).to(x0)
                pred, target = objective.prediction(model, batch, index.expand(x0.shape[0]), noise)
                per_example = (pred - target).square().flatten(1).mean(1).double().sum().item()
                for name in ("loss", band):
                    totals[names.index(name)] += torch.tensor([per_example, x0.shape[0]], dtype=torch.float64,
                                                              device=device)
    finally:
        model.train(was_training)
    if gather is not None:
        totals = gather(totals[None]).sum(0)
    return {name: float(totals[i, 0] / totals[i, 1]) for i, name in enumerate(names)}
