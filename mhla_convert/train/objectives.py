"""The training objectives; each family adapter picks one (`FamilyAdapter.objective`) and supplies
how its model is called on a batch.

flow matching (SANA, Wan): x_t = (1 − σ)·x0 + σ·ε, target ε − x0, σ and t from the family's
    `FlowMatchEulerDiscreteScheduler` with its flow shift;
ε-prediction (DiT, PixArt): the `DDPMScheduler` forward process, target ε; a model that also
    predicts its variance (out channels = 2 × in) is scored on the first half only;
next-token cross-entropy (LMs).
Randomness comes from a generator the trainer seeds per step, so a resumed run draws the same noise.

`Distillation` mixes an objective with matching the original (unconverted) model, the teacher:
diffusion: MSE to the teacher's prediction at the same noisy input and timestep (no labels needed);
LMs: KL(teacher ‖ student) of the next-token distributions, the mean over the (unmasked) tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from ..specs import ObjectiveSpec

# call(model, noisy latents, timesteps, batch) → the model's prediction (B, C', ...)
DenoiserCall = Callable[[nn.Module, torch.Tensor, torch.Tensor, dict], torch.Tensor]
# the context the teacher runs in (the trainer's autocast, so it computes at the training precision)
TeacherContext = Callable[[], ContextManager]


def _schedule_index(spec: ObjectiveSpec, u: torch.Tensor) -> torch.Tensor:
    """Positions u ∈ [0, 1) along the schedule → its indices."""
    return (u * spec.num_train_timesteps).long().clamp_(max=spec.num_train_timesteps - 1)


def _sample_indices(spec: ObjectiveSpec, n: int, generator: torch.Generator) -> torch.Tensor:
    if spec.timestep_sampling == "logit_normal":
        u = torch.sigmoid(torch.randn(n, generator=generator))
    else:
        u = torch.rand(n, generator=generator)
    return _schedule_index(spec, u)


class _Denoising:
    """What the diffusion objectives share: a loss from one `draw` (schedule positions, noise) and `prediction`."""

    def loss(self, model: nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        return F.mse_loss(*self.prediction(model, batch, *self.draw(batch, generator)))

    def losses(self, model: nn.Module, teacher: nn.Module, batch: dict, generator: torch.Generator,
               context: TeacherContext = contextlib.nullcontext) -> tuple[torch.Tensor, torch.Tensor]:
        """(task loss, distillation loss): the student's prediction against the objective's target and
        against the teacher's prediction for the same noisy input at the same timestep (one draw)."""
        draw = self.draw(batch, generator)
        pred, target = self.prediction(model, batch, *draw)
        with torch.no_grad(), context():
            reference, _ = self.prediction(teacher, batch, *draw)
        return F.mse_loss(pred, target), F.mse_loss(pred, reference)


@dataclass
class FlowMatching(_Denoising):
    call: DenoiserCall
    spec: ObjectiveSpec
    shift: float

    def __post_init__(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=self.spec.num_train_timesteps, shift=self.shift)
        # one sigma per training timestep (sigma = t / num_train_timesteps); no terminal 0 before set_timesteps
        self.timesteps, self.sigmas = sched.timesteps.float(), sched.sigmas[: len(sched.timesteps)].float()

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

    def draw(self, batch: dict, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(schedule indices, noise) for a training step on `batch`."""
        x0 = batch["latents"]
        idx = _sample_indices(self.spec, x0.shape[0], generator)
        return idx, torch.randn(x0.shape, generator=generator).to(x0)


@dataclass
class EpsPrediction(_Denoising):
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

    def draw(self, batch: dict, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(timesteps, noise) for a training step on `batch`."""
        x0 = batch["latents"]
        t = torch.randint(0, self.spec.num_train_timesteps, (x0.shape[0],), generator=generator)
        return t, torch.randn(x0.shape, generator=generator).to(x0)


@dataclass
class NextToken:
    def loss(self, model: nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        ids = batch["input_ids"]
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    def losses(self, model: nn.Module, teacher: nn.Module, batch: dict, generator: torch.Generator,
               context: TeacherContext = contextlib.nullcontext) -> tuple[torch.Tensor, torch.Tensor]:
        """(cross-entropy, KL(teacher ‖ student)): the KL of the next-token distributions at every
        position, the mean over the tokens whose `attention_mask` (when the batch has one) is set.
        Both models are called as `loss` calls the model."""
        ids = batch["input_ids"]
        out = model(input_ids=ids, labels=ids, use_cache=False)
        with torch.no_grad(), context():
            reference = teacher(input_ids=ids, use_cache=False).logits
        return out.loss, token_kl(reference, out.logits, batch.get("attention_mask"))


def token_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, mask: torch.Tensor | None = None):
    """KL(teacher ‖ student) per position, in float32, averaged over positions (those where `mask`
    is nonzero, when given)."""
    kl = F.kl_div(F.log_softmax(student_logits.float(), -1), F.log_softmax(teacher_logits.float(), -1),
                  log_target=True, reduction="none").sum(-1)
    if mask is None:
        return kl.mean()
    mask = mask.to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


@dataclass
class Distillation:
    """`weight` · the distillation loss + (1 − weight) · the task objective's own loss, from one
    forward of the model and one of `teacher` (frozen, in eval mode) on the same inputs and draws.
    Weight 1: the distillation loss alone (the task loss is left out, not multiplied by 0)."""

    task: object  # FlowMatching, EpsPrediction or NextToken
    teacher: nn.Module
    weight: float
    context: TeacherContext = contextlib.nullcontext

    def loss(self, model: nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor:
        task, distill = self.task.losses(model, self.teacher, batch, generator, self.context)
        return distill if self.weight == 1 else (1 - self.weight) * task + self.weight * distill
