"""Training examples as column tensors, and their on-disk form: one safetensors file per column,
read back memory-mapped, so encoded data costs page cache (shared by every process on the machine
and dropped under pressure) rather than private memory on each rank, however large it grows.

The files are written atomically (an interrupted encode never looks complete) and with memory
bounded by one encode batch: each batch goes to a part file first, then each column is copied part
by part into its own file."""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset

from .errors import TrainError

# torch dtype -> safetensors dtype name (the file format's own names)
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
ALIGN = 64  # each column's data starts 64-byte aligned in memory, as a freshly allocated tensor would


class TensorData(Dataset):
    """Examples stored column-wise: {name: (N, …) tensor}, or the rows `indices` of such columns
    (a subset that shares the columns, memory-mapped ones included, rather than copying them)."""

    def __init__(self, columns: dict[str, torch.Tensor], indices: torch.Tensor | None = None):
        lengths = {len(v) for v in columns.values()}
        if len(lengths) != 1 or 0 in lengths or (indices is not None and not len(indices)):
            raise TrainError("the dataset is empty: add examples (or check data.path / the captions file)")
        self._columns, self.indices = columns, indices

    @property
    def columns(self) -> dict[str, torch.Tensor]:
        """The examples' columns (a subset's are gathered into memory)."""
        if self.indices is None:
            return self._columns
        return {k: v[self.indices] for k, v in self._columns.items()}

    def subset(self, indices: torch.Tensor) -> "TensorData":
        """The examples at `indices` (positions in this dataset)."""
        return TensorData(self._columns, indices if self.indices is None else self.indices[indices])

    def __len__(self) -> int:
        return len(self.indices) if self.indices is not None else len(next(iter(self._columns.values())))

    def __getitem__(self, i) -> dict[str, torch.Tensor]:
        i = self.indices[i] if self.indices is not None else i
        return {k: v[i] for k, v in self._columns.items()}


# --- the on-disk cache ---------------------------------------------------------------------------


def save_shards(batches: Iterable[dict[str, torch.Tensor]], directory: Path, meta: dict) -> None:
    """Write batches of examples ({column: (B, ...) tensor}) as one `<column>.safetensors` per
    column into `directory`, atomically (`io.write_atomically`: a hidden staging sibling, renamed when
    complete, removed on failure or by the next save after a kill). Columns of text whose length
    differs between batches ((B, L) or (B, L, C)) are zero-padded to the longest."""
    from ..io import write_atomically

    def write(staging: Path) -> None:
        (staging / "parts").mkdir()
        parts = []
        for batch in batches:
            parts.append(staging / "parts" / f"{len(parts):06d}.safetensors")
            save_file({k: v.contiguous() for k, v in batch.items()}, str(parts[-1]))
        if not parts:
            raise TrainError("the dataset is empty: add examples (or check data.path / the captions file)")
        with safe_open(parts[0], framework="pt") as first:
            names = list(first.keys())
        rows = [_write_column(name, parts, staging / f"{name}.safetensors") for name in names]
        shutil.rmtree(staging / "parts")
        (staging / "meta.json").write_text(json.dumps({**meta, "num_examples": rows[0]}, indent=1))

    write_atomically(directory, write)


def _write_column(name: str, parts: list[Path], path: Path) -> int:
    """Concatenate column `name` of the part files into one safetensors file, one part in memory at a
    time; returns the number of rows."""
    tensors = [load_file(str(p))[name] for p in parts]  # memory-mapped
    shape = list(tensors[0].shape)
    if len({t.shape[1:] for t in tensors}) > 1:
        if not 2 <= len(shape) <= 3 or len({t.shape[2:] for t in tensors}) > 1:
            raise TrainError(f"encoded column {name} has shapes {sorted({tuple(t.shape) for t in tensors})} that "
                             "differ beyond the text length")
        shape[1] = max(t.shape[1] for t in tensors)
    shape[0] = sum(len(t) for t in tensors)
    dtype = tensors[0].dtype
    nbytes = math.prod(shape) * dtype.itemsize
    header = json.dumps({name: {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [0, nbytes]}})
    header += " " * (-(8 + len(header.encode())) % ALIGN)  # the format allows trailing spaces
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header.encode())) + header.encode())
        for t in tensors:
            if t.shape[1:] != tuple(shape[1:]):
                t = torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, shape[1] - t.shape[1]))
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    return shape[0]


def load_shards(path: Path) -> dict[str, torch.Tensor]:
    """The columns of every .safetensors file of a directory (or of one file), memory-mapped. A
    column split over several files (precomputed latents in shards) is concatenated in memory."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise TrainError(f"no .safetensors files in {path}: give latents saved with safetensors (keys: latents, …)")
    parts: dict[str, list[torch.Tensor]] = {}
    for f in files:
        for key, tensor in load_file(str(f)).items():
            parts.setdefault(key, []).append(tensor)
    return {k: v[0] if len(v) == 1 else torch.cat(v) for k, v in parts.items()}
