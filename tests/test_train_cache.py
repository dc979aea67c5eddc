"""The encoded-data cache on disk: written batch by batch into one safetensors file per column and
read back memory-mapped, so private memory stays flat however large the data grows; training on the
mapped data gives bitwise the model training on the same data in memory gives."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import mhla_convert
from mhla_convert.train import data, parse_recipe
from mhla_convert.train.shards import TensorData, load_shards, save_shards
from mhla_convert.train.trainer import train


def _private_mb() -> float:
    """This process's anonymous resident memory (not file-backed pages such as mapped files), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakMemory:
    """The highest private memory seen while the block runs (sampled every millisecond), above its start."""

    def __enter__(self):
        self.start = self.peak = _private_mb()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.is_set():
            self.peak = max(self.peak, _private_mb())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _private_mb())
        self.growth = self.peak - self.start


def _batches(num_batches: int, text_lengths=(8,)):
    """1 MiB of latents per batch (64 examples of 4×32×32 float32), with text of varying length."""
    g = torch.Generator().manual_seed(0)
    for b in range(num_batches):
        length = text_lengths[b % len(text_lengths)]
        yield {"latents": torch.randn(64, 4, 32, 32, generator=g), "prompt_embeds": torch.randn(64, length, 6),
               "prompt_attention_mask": torch.ones(64, length, dtype=torch.long), "labels": torch.arange(64) + b}


def _mapped_files() -> dict[int, str]:
    """Start address -> path of every file mapping of this process."""
    out = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out[(start, end)] = fields[5]
    return out


def test_columns_are_written_padded_and_read_back_memory_mapped(tmp_path):
    batches = list(_batches(3, text_lengths=(5, 8, 3)))
    save_shards(iter(batches), tmp_path / "cache", {"source": "test"})
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "labels.safetensors", "latents.safetensors", "meta.json", "prompt_attention_mask.safetensors",
        "prompt_embeds.safetensors"]
    columns = load_shards(tmp_path / "cache")
    pad = lambda t, n: torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, n - t.shape[1]))  # noqa: E731
    for name, column in columns.items():
        expected = torch.cat([pad(b[name], 8) if b[name].ndim > 1 and name != "latents" else b[name] for b in batches])
        assert column.dtype == expected.dtype and torch.equal(column, expected), name
        # the same tensors as safetensors' own reader gives, and each column's data 64-byte aligned
        assert torch.equal(load_file(str(tmp_path / "cache" / f"{name}.safetensors"))[name], expected)
        assert column.data_ptr() % 64 == 0
        mapping = [path for (start, end), path in _mapped_files().items() if start <= column.data_ptr() < end]
        assert mapping == [str(tmp_path / "cache" / f"{name}.safetensors")], name


def _write_and_read(root: Path, num_batches: int) -> float:
    """Private memory growth while `num_batches` MiB are encoded, cached, loaded and all read once."""
    with PeakMemory() as peak:
        save_shards(_batches(num_batches), root, {})
        dataset = TensorData(load_shards(root))
        train_part = dataset.subset(torch.arange(0, len(dataset), 2))
        total = sum(float(train_part[i]["latents"][0, 0, 0]) for i in range(len(train_part)))
    assert total == total  # every example was read
    return peak.growth


def test_private_memory_stays_flat_as_the_data_grows(tmp_path):
    _write_and_read(tmp_path / "warmup", 2)  # first-use allocations (thread, safetensors) out of the way
    small, large = _write_and_read(tmp_path / "small", 4), _write_and_read(tmp_path / "large", 64)
    assert large < 16, f"caching and reading 64 MiB grew private memory by {large:.1f} MiB"
    assert large < small + 8, (small, large)


def test_training_on_mapped_data_equals_training_in_memory(tmp_path, monkeypatch):
    columns = mhla_convert.families.adapter_for_family("dit").synthetic_data(
        mhla_convert.tiny_model("tiny-dit"), parse_recipe(RECIPE.format(path="x")).data, seed=1)
    save_file(columns, str(tmp_path / "latents.safetensors"))
    recipe = parse_recipe(RECIPE.format(path=tmp_path / "latents.safetensors"))
    mapped = train(recipe, tmp_path / "mapped", log=lambda *_: None)
    real = data.load_shards
    monkeypatch.setattr(data, "load_shards", lambda p: {k: v.clone() for k, v in real(p).items()})
    in_memory = train(recipe, tmp_path / "memory", log=lambda *_: None)
    a, b = load_file(str(mapped / "model.safetensors")), load_file(str(in_memory / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


RECIPE = """\
model: {{name: tiny-dit}}
data: {{kind: latents, path: {path}, batch_size: 4}}
stages: [{{name: finetune, steps: 4, train: all}}]
validation: {{split: 0.25, num_batches: 2}}
checkpoint_every: 0
logging: {{trackers: []}}
"""
