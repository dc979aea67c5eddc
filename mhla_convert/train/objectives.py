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


def _sample_indices(spec: ObjectiveSpec, n: int, generator: torch.Generator) -> torch.Tensor:
    if spec.timestep_sampling == "logit_normal":
        u = torch.sigmoid(torch.randn(n, generator=generator))
    else:
        u = torch.rand(n, generator=generator)
    return (u * spec.num_train_timesteps).long().clamp_(max=spec.num_train_timesteps - 1)


@dataclass
class FlowMatching:
    call: DenoiserCall
    spec: ObjectiveSpec
    shift: float

    def __post_init__(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=self.spec.num_train_timesteps, shift=self.shift)
        self.timesteps, self.sigmas = sched.timesteps.float(), sched.sigmas[:-1].float()

    def loss(self, model: nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        x0 = batch["latents"]
        idx = _sample_indices(self.spec, x0.shape[0], generator)
        noise = torch.randn(x0.shape, generator=generator).to(x0)
        sigma = self.sigmas[idx].to(x0).view(-1, *[1] * (x0.ndim - 1))
        xt = (1 - sigma) * x0 + sigma * noise
        pred = self.call(model, xt, self.timesteps[idx].to(x0.device), batch)
        return F.mse_loss(pred.float(), (noise - x0).float())


@dataclass
class EpsPrediction:
    call: DenoiserCall
    spec: ObjectiveSpec

    def __post_init__(self):
        from diffusers import DDPMScheduler

        self.scheduler = DDPMScheduler(num_train_timesteps=self.spec.num_train_timesteps)

    def loss(self, model: nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        x0 = batch["latents"]
        t = torch.randint(0, self.spec.num_train_timesteps, (x0.shape[0],), generator=generator)
        noise = torch.randn(x0.shape, generator=generator).to(x0)
        xt = self.scheduler.add_noise(x0, noise, t.to(x0.device))
        pred = self.call(model, xt, t.to(x0.device), batch)
        if pred.shape[1] == 2 * x0.shape[1]:  # learned sigma: the first half is ε
            pred = pred[:, : x0.shape[1]]
        return F.mse_loss(pred.float(), noise.float())


@dataclass
class NextToken:
    def loss(self, model: nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        ids = batch["input_ids"]
        return model(input_ids=ids, labels=ids, use_cache=False).loss
