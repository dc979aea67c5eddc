"""Training examples as tensors: the family's built-in synthetic set (`FamilyAdapter.synthetic_data`),
precomputed latents, encoded image/video folders and packed text (the last two cached to disk as
safetensors shards, shards.py), and a step-seeded batch sampler so a resumed run sees exactly the
batches it would have seen."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from . import encode
from .errors import TrainError
from .recipe import DataSpec
from .shards import TensorData, load_shards

# --- batches ---------------------------------------------------------------------------------------


class StepBatchSampler(Sampler):
    """Infinite batches for one process: micro-step m takes positions [m·G + p·b, m·G + (p+1)·b)
    of a stream of per-epoch permutations (G = b · processes). Batch m depends only on (seed, m), so
    starting at m = resume step reproduces an uninterrupted run exactly."""

    def __init__(self, size: int, batch_size: int, *, seed: int, start: int = 0, rank: int = 0, world: int = 1):
        self.size, self.batch_size, self.seed, self.start, self.rank, self.world = (
            size, batch_size, seed, start, rank, world,
        )
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {
                epoch: torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            }
        return self._perms[epoch]

    def batch(self, m: int) -> list[int]:
        first = (m * self.world + self.rank) * self.batch_size
        return [int(self._perm(pos // self.size)[pos % self.size]) for pos in range(first, first + self.batch_size)]

    def __iter__(self):
        m = self.start
        while True:
            yield self.batch(m)
            m += 1


def loader(dataset: Dataset, spec: DataSpec, *, seed: int, start: int, rank: int, world: int) -> DataLoader:
    sampler = StepBatchSampler(len(dataset), spec.batch_size, seed=seed, start=start, rank=rank, world=world)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=spec.num_workers)


def check_data_path(spec: DataSpec) -> Path | None:
    """Fail before any model loads when the data is not there."""
    if spec.kind == "synthetic":
        return None
    path = Path(spec.path).expanduser()
    if not path.exists():
        raise TrainError(f"data.path {path} does not exist: point it at your {spec.kind} data")
    return path


def build_dataset(spec: DataSpec, adapter, model, *, seed: int, components: str | None) -> TensorData:
    """The training set for a recipe's data section (encoding and caching on first use); `adapter`
    is the model's `FamilyAdapter`."""
    if spec.kind == "synthetic":
        return TensorData(adapter.synthetic_data(model, spec, seed))
    path = check_data_path(spec)
    if spec.kind == "latents":
        return TensorData(load_shards(path))
    if spec.kind == "text":
        return TensorData(encode.cached_text(spec, adapter, model, components))
    return TensorData(encode.cached_folder(spec, adapter, model, components))
