"""When a training run has diverged, and the one-line error that stops it.

Checked every optimizer step (cheap: one reduction per trained tensor and one small gather):
  - the loss is inf/NaN, or above LOSS_GROWTH × the largest of the stage's first LOSS_WINDOW losses;
  - a trained weight is inf/NaN, or the L2 norm of the trained weights is above WEIGHT_GROWTH × its
    norm at the start of the stage (at least WEIGHT_GROWTH × WEIGHT_FLOOR_RMS · √N for N weights,
    so a set that starts at zero may still grow).
Checked before every validation, checkpoint and the final save (one forward): the model's outputs on a
fixed probe batch, the training loss on it, are finite. Nothing is saved from a model that fails, so
every checkpoint is a last good one. The reference values travel in each checkpoint's progress.json,
so a resumed run checks against the same bounds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

WEIGHT_GROWTH = 10.0
WEIGHT_FLOOR_RMS = 0.01
LOSS_GROWTH = 100.0
LOSS_WINDOW = 3


@dataclass
class StageGuard:
    """One stage's reference values: the trained weights' norm at its start, its first losses."""

    stage: int
    weight_norm: float
    numel: int
    first_losses: list[float] = field(default_factory=list)

    @classmethod
    def from_state(cls, state: dict | None, stage: int) -> StageGuard | None:
        """The guard a checkpoint recorded, when it is this stage's and well formed."""
        try:
            guard = cls(int(state["stage"]), float(state["weight_norm"]), int(state["numel"]),
                        [float(x) for x in state["first_losses"]])
        except (KeyError, TypeError, ValueError):
            return None
        return guard if guard.stage == stage else None

    def state(self) -> dict:
        return asdict(self)

    def weight_bound(self) -> float:
        return WEIGHT_GROWTH * max(self.weight_norm, WEIGHT_FLOOR_RMS * math.sqrt(self.numel))

    def weight_problem(self, norm: float) -> str | None:
        if norm <= self.weight_bound():
            return None
        return (f"the norm of the trained weights grew from {self.weight_norm:.4g} (stage start) to {norm:.4g}, "
                f"past the {WEIGHT_GROWTH:g}× bound,")

    def loss_problem(self, loss: float) -> str | None:
        """Whether `loss` (finite) has exploded; the stage's first losses set the reference."""
        if len(self.first_losses) < LOSS_WINDOW:
            self.first_losses.append(loss)
            return None
        reference = max(self.first_losses)
        if reference <= 0 or loss <= LOSS_GROWTH * reference:
            return None
        return (f"the loss rose from {reference:.4g} (the stage's first steps) to {loss:.4g}, "
                f"past the {LOSS_GROWTH:g}× bound,")


def diverged_message(what: str, step: int, stage_name: str, kept, fixes: list[str]) -> str:
    """One line: what went wrong at which step, the last good checkpoint `kept` (or None), what to change."""
    where = f"Last good checkpoint: {kept}. " if kept else "No checkpoint was written yet. "
    fix = ", ".join(fixes[:-1]) + f" or {fixes[-1]}" if len(fixes) > 1 else fixes[0]
    return (f"{what} at step {step} ({stage_name}); stopped. {where}The model diverged: {fix}, "
            "then train again with a new --out.")
