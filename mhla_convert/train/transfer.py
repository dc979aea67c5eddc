"""Attention transfer (LoLCATs-style): each MHLA layer learns to reproduce the output of the
attention it replaced, on the same inputs, by MSE.

The originals are deep-copied before conversion (conversion moves their weights into the new
layers, so the copies must not share them). A forward hook on every converted layer runs its
teacher on the same call, records the MSE, and hands the *teacher's* output downstream, so every
layer trains on the inputs the original model produces and no gradient flows between layers.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..finite import main_output


def snapshot_attention(adapter, model: nn.Module) -> list[nn.Module]:
    """Frozen copies of every layer's self-attention, taken before `convert`."""
    teachers = [copy.deepcopy(m) for m in adapter.attention_modules(model)]
    for t in teachers:
        t.requires_grad_(False).eval()
    return teachers


class AttentionTransfer:
    """Install with `attach`, read the loss with `take_loss` after each forward, `detach` at the end."""

    def __init__(self, students: list[nn.Module], teachers: list[nn.Module]):
        self.pairs = list(zip(students, teachers))
        self.errors: list[torch.Tensor] = []
        self.handles = []

    def attach(self) -> "AttentionTransfer":
        for student, teacher in self.pairs:
            self.handles.append(student.register_forward_hook(self._hook(teacher), with_kwargs=True))
        return self

    def _hook(self, teacher: nn.Module):
        def hook(module, args, kwargs, output):
            with torch.no_grad():
                target = teacher(*args, **kwargs)
            self.errors.append(F.mse_loss(main_output(output).float(), main_output(target).float()))
            return target

        return hook

    def take_errors(self) -> list[torch.Tensor]:
        errors, self.errors = self.errors, []
        return errors

    def take_loss(self) -> torch.Tensor:
        errors = self.take_errors()
        if not errors:
            raise RuntimeError("no converted attention layer ran in the forward pass")
        return torch.stack(errors).mean()

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def to(self, device) -> "AttentionTransfer":
        for _, teacher in self.pairs:
            teacher.to(device)
        return self
