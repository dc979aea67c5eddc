"""Training examples as column tensors, and their on-disk form: safetensors shards written
atomically, so an interrupted encode never looks complete."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset

from .errors import TrainError

SHARD_SIZE = 256  # examples per safetensors shard


class TensorData(Dataset):
    """Examples stored column-wise: {name: (N, …) tensor}."""

    def __init__(self, columns: dict[str, torch.Tensor]):
        lengths = {len(v) for v in columns.values()}
        if len(lengths) != 1 or 0 in lengths:
            raise TrainError("the dataset is empty: add examples (or check data.path / the captions file)")
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.columns.items()}


# --- the on-disk cache ---------------------------------------------------------------------------


def save_shards(columns: dict[str, torch.Tensor], directory: Path, meta: dict) -> None:
    """Write shards into a temp dir and rename, so an interrupted encode never looks complete."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(exist_ok=True)
    n = len(next(iter(columns.values())))
    for s, start in enumerate(range(0, n, SHARD_SIZE)):
        shard = {k: v[start : start + SHARD_SIZE].contiguous() for k, v in columns.items()}
        save_file(shard, str(tmp / f"shard-{s:05d}.safetensors"))
    (tmp / "meta.json").write_text(json.dumps({**meta, "num_examples": n}, indent=1))
    tmp.rename(directory)


def load_shards(path: Path) -> dict[str, torch.Tensor]:
    """Every .safetensors file of a directory (or one file), concatenated."""
    shards = [load_file(str(p)) for p in ([path] if path.is_file() else sorted(path.glob("*.safetensors")))]
    if not shards:
        raise TrainError(f"no .safetensors files in {path}: give latents saved with safetensors (keys: latents, …)")
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}
