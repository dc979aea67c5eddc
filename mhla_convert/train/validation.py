"""Held-out loss during fine-tuning, and the best model by that loss.

The held-out set is scored the same way every time, by the held-out loss `mhla-convert eval` uses
(evaluate/loss.py): its batches are fixed (the first `num_batches · batch_size` examples, in order)
and batch i draws its timesteps and noise from a generator seeded by (seed, i) alone, so two
evaluations of the same weights give the same number and the curve moves only when the model does.
Batches are spread over the processes and the sums gathered, so every process reports the same value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..evaluate.loss import batches, heldout_loss
from ..io import write_file_atomically
from .data import TensorData, build_dataset
from .recipe import Recipe

BEST_DIR, BEST_FILE = "best", "best.json"


def split_off(dataset: TensorData, fraction: float, seed: int) -> tuple[TensorData, TensorData]:
    """(train, held-out): a seeded draw of ⌈fraction · N⌉ examples is held out (at least one, and
    at least one is left to train on)."""
    n = len(dataset)
    if n < 2:
        raise ValueError(f"validation.split needs at least 2 examples; the data has {n}: use validation.path")
    held = min(max(1, math.ceil(fraction * n)), n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return dataset.subset(order[held:].sort().values), dataset.subset(order[:held].sort().values)


def heldout_dataset(recipe: Recipe, adapter, model, components: str | None) -> TensorData:
    """The held-out examples of `validation.path`, read (and cached) like the training data."""
    spec = replace(recipe.data, path=recipe.validation.path, cache_dir=None)
    return build_dataset(spec, adapter, model, seed=recipe.seed, components=components)


@dataclass
class HeldOut:
    """Scores a model on fixed held-out batches with its training objective."""

    dataset: TensorData
    objective: object
    batch_size: int
    num_batches: int
    seed: int = 0

    def batches(self) -> list[dict[str, torch.Tensor]]:
        n = min(len(self.dataset), self.num_batches * self.batch_size)
        return batches({k: v[:n] for k, v in self.dataset.columns.items()}, self.batch_size)

    def loss(self, model, *, device, dtype, rank: int = 0, world: int = 1, gather=None) -> float:
        """The weighted mean loss over the held-out batches (`gather` sums across processes)."""
        return heldout_loss(model, self.objective, self.batches(), seed=self.seed, device=device, dtype=dtype,
                            rank=rank, world=world, gather=gather)["loss"]


class SampleWriter:
    """Samples of the model at each validation, with the same conditions and seeds every time, as a
    labelled PNG row in `<out>/samples/step-N.png` (videos: their first frames)."""

    def __init__(self, adapter, model, base: str | None, spec, out: Path, seed: int):
        from ..evaluate.samples import sample_conditions

        if getattr(adapter, "sample_kind", "image") not in ("image", "video"):
            raise ValueError(f"validation.num_samples draws images or videos; {adapter.name} models make "
                             f"{adapter.sample_kind}: set validation.num_samples: 0")
        self.adapter, self.base, self.spec, self.dir, self.seed = adapter, base, spec, Path(out) / "samples", seed
        try:
            self.conditions = sample_conditions(adapter, model, spec.num_samples, spec.prompts, spec.class_labels)
        except ValueError as exc:
            raise ValueError(f"validation: {exc}") from None

    def write(self, model, step: int, device) -> np.ndarray:
        """Draw the samples, save them, and return the grid as an (H, W, 3) uint8 array."""
        from ..evaluate.samples import draw_samples, sample_grid

        was_training = model.training
        try:
            _, samples = draw_samples(self.adapter, model.eval(), self.base, self.conditions, seed=self.seed,
                                      steps=self.spec.sample_steps, device=device)
        finally:
            model.train(was_training)
        grid = sample_grid(samples, f"step {step}")
        write_file_atomically(self.dir / f"step-{step:08d}.png", grid.save)
        return np.asarray(grid)


class BestModel:
    """Tracks the lowest validation loss of a run (`<out>/best.json`, kept across resumes)."""

    def __init__(self, out: Path):
        self.file = Path(out) / BEST_FILE
        self.record = json.loads(self.file.read_text()) if self.file.is_file() else None

    def improves(self, loss: float) -> bool:
        return math.isfinite(loss) and (self.record is None or loss < self.record["loss"])

    def note(self, step: int, stage: str, loss: float, directory: Path | None) -> None:
        self.record = {"step": step, "stage": stage, "loss": loss, "model": str(directory) if directory else None}
        write_file_atomically(self.file, lambda path: path.write_text(json.dumps(self.record, indent=1)))

    def summary(self) -> str | None:
        if self.record is None:
            return None
        where = f" ({self.record['model']})" if self.record.get("model") else ""
        best = f"best validation loss {self.record['loss']:.6g}"
        return f"{best} at step {self.record['step']} ({self.record['stage']}){where}"


class StageBest:
    """The trained weights at the lowest held-out loss within one stage.

    Attention transfer fits a surrogate (each layer's output against its original's), which can move the
    model's own held-out loss up — plain linear attention on an LM does. A transfer stage that ends above
    its best goes back to the weights of that best. Registered with Accelerate's checkpointing, so a
    resumed run holds the same copy as an uninterrupted one.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.loss, self.step, self.weights = math.inf, None, None

    def offer(self, step: int, loss: float, params: list) -> None:
        if math.isfinite(loss) and loss < self.loss:
            self.loss, self.step = loss, step
            self.weights = [p.detach().to("cpu", copy=True) for p in params]

    @torch.no_grad()
    def restore(self, params: list) -> None:
        for param, weight in zip(params, self.weights, strict=True):
            param.copy_(weight)

    def state_dict(self) -> dict:
        return {"loss": self.loss, "step": self.step, "weights": self.weights}

    def load_state_dict(self, state: dict) -> None:
        self.loss, self.step, self.weights = state["loss"], state["step"], state["weights"]
