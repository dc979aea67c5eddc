"""The training objectives; each family adapter picks one (`FamilyAdapter.objective`) and supplies
how its model is called on a batch.

flow matching (SANA, Wan): x_t = (1 − σ)·x0 + σ·ε, target ε − x0, σ and t from the family's
    `FlowMatchEulerDiscreteScheduler` with its flow shift;
ε-prediction (DiT, PixArt): the `DDPMScheduler` forward process, target ε; a model that also
    predicts its variance (out channels = 2 × in) is scored on the first half only;
next-token cross-entropy (LMs).
Randomness comes from a generator the trainer seeds per step, so a resumed run draws the same noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .recipe import ObjectiveSpec


class Objective(Protocol):
    def loss(self, model: nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor: ...


# call(model, noisy latents, timesteps, batch) → the model's prediction (B, C', ...)
DenoiserCall = Callable[[nn.Module, torch.Tensor, torch.Tensor, dict], torch.Tensor]


def _schedule_index(spec: ObjectiveSpec, u: torch.Tensor) -> torch.Tensor:
    """Positions u ∈ [0, 1) along the schedule → its indices."""
    return (u * spec.num_train_timesteps).long().clamp_(max=spec.num_train_timesteps - 1)


def _sample_indices(spec: ObjectiveSpec, n: int, generator: torch.Generator) -> torch.Tensor:
    if spec.timestep_sampling == "logit_normal":
        u = torch.sigmoid(torch.randn(n, generator=generator))
    else:
        u = torch.rand(n, generator=generator)
    return _schedule_index(spec, u)


@dataclass
class FlowMatching:
    call: DenoiserCall
    spec: ObjectiveSpec
    shift: float

    def __post_init__(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=self.spec.num_train_timesteps, shift=self.shift)
        self.timesteps, self.sigmas = sched.timesteps.float(), sched.sigmas[:-1].float()

    def indices_at(self, q: torch.Tensor) -> torch.Tensor:
        """Schedule indices at quantiles q ∈ (0, 1) of the training timestep distribution."""
        u = torch.sigmoid(torch.special.ndtri(q)) if self.spec.timestep_sampling == "logit_normal" else q
        return _schedule_index(self.spec, u)

    def timestep(self, idx: torch.Tensor) -> torch.Tensor:
        """The timestep the model sees at schedule indices `idx` (0: clean … 1000: pure noise)."""
        return self.timesteps[idx]

    def prediction(self, model: nn.Module, batch: dict, idx: torch.Tensor, noise: torch.Tensor):
        """(prediction, target) in float32 for the batch noised with `noise` at schedule indices `idx`."""
        x0 = batch["latents"]
        sigma = self.sigmas[idx].to(x0).view(-1, *[1] * (x0.ndim - 1))
        xt = (1 - sigma) * x0 + sigma * noise
        pred = self.call(model, xt, self.timesteps[idx].to(x0.device), batch)
        return pred.float(), (noise - x0).float()

    def loss(self, model: nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        x0 = batch["latents"]
        idx = _sample_indices(self.spec, x0.shape[0], generator)
        noise = torch.randn(x0.shape, generator=generator).to(x0)
        return F.mse_loss(*self.prediction(model, batch, idx, noise))


@dataclass
class EpsPrediction:
    call: DenoiserCall
    spec: ObjectiveSpec

    def __post_init__(self):
        from diffusers import DDPMScheduler

        self.scheduler = DDPMScheduler(num_train_timesteps=self.spec.num_train_timesteps)

    def indices_at(self, q: torch.Tensor) -> torch.Tensor:
        """Timesteps at quantiles q ∈ (0, 1) of the training distribution (uniform)."""
        return _schedule_index(self.spec, q)

    def timestep(self, idx: torch.Tensor) -> torch.Tensor:
        """The timestep the model sees (the DDPM schedule index itself: 0 clean … 999 pure noise)."""
        return idx

    def prediction(self, model: nn.Module, batch: dict, t: torch.Tensor, noise: torch.Tensor):
        """(predicted ε, ε) in float32 for the batch noised with `noise` at timesteps `t`."""
        x0 = batch["latents"]
        xt = self.scheduler.add_noise(x0, noise, t.to(x0.device))
        pred = self.call(model, xt, t.to(x0.device), batch)
        if pred.shape[1] == 2 * x0.shape[1]:  # learned sigma: the first half is ε
            pred = pred[:, : x0.shape[1]]
        return pred.float(), noise.float()

    def loss(self, model: nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        x0 = batch["latents"]
        t = torch.randint(0, self.spec.num_train_timesteps, (x0.shape[0],), generator=generator)
        noise = torch.randn(x0.shape, generator=generator).to(x0)
        return F.mse_loss(*self.prediction(model, batch, t, noise))


@dataclass
class NextToken:
    def loss(self, model: nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        ids = batch["input_ids"]
        return model(input_ids=ids, labels=ids, use_cache=False).loss
