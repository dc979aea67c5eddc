"""Training examples as tensors: a built-in synthetic set per family, precomputed latents, encoded
image/video folders and packed text (the last two cached to disk as safetensors shards), and a
step-seeded batch sampler so a resumed run sees exactly the batches it would have seen."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset, Sampler

from .components import is_i2v
from .errors import TrainError
from .recipe import DataSpec

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
        save_file({k: v[start : start + SHARD_SIZE].contiguous() for k, v in columns.items()}, str(tmp / f"shard-{s:05d}.safetensors"))
    (tmp / "meta.json").write_text(json.dumps({**meta, "num_examples": n}, indent=1))
    tmp.rename(directory)


def load_shards(path: Path) -> dict[str, torch.Tensor]:
    """Every .safetensors file of a directory (or one file), concatenated."""
    shards = [load_file(str(p)) for p in ([path] if path.is_file() else sorted(path.glob("*.safetensors")))]
    if not shards:
        raise TrainError(f"no .safetensors files in {path}: give latents saved with safetensors (keys: latents, …)")
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


# --- synthetic ------------------------------------------------------------------------------------


def _latent_shape(model, spec: DataSpec, video: bool) -> tuple[int, ...]:
    size = model.config.get("sample_size") or 8  # Wan's config has none
    hw = tuple(spec.latent_size) if spec.latent_size else (size, size)
    return (spec.latent_frames, *hw) if video else hw


def synthetic(family: str, model, spec: DataSpec, seed: int) -> TensorData:
    """Structured random data with the model's own shapes: smooth latents that depend on the
    condition (so conditioning is learnable), or token sequences following arithmetic patterns."""
    g = torch.Generator().manual_seed(seed)
    n, cfg = spec.num_samples, model.config
    if family == "llama":
        vocab, length = cfg.vocab_size, spec.context_length
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        return TensorData({"input_ids": (start + step * torch.arange(length)) % vocab})
    video = family == "wan"
    channels = cfg.out_channels if video else cfg.in_channels  # Wan I2V takes more channels than it predicts
    shape = (channels, *_latent_shape(model, spec, video))
    num_conditions = 8
    cond = torch.randint(0, num_conditions, (n,), generator=g)
    low = torch.randn(num_conditions, shape[0], *(max(1, s // 4) for s in shape[1:]), generator=g)
    mode = "trilinear" if video else "bilinear"
    patterns = torch.nn.functional.interpolate(low, size=shape[1:], mode=mode, align_corners=False)
    latents = patterns[cond] + 0.1 * torch.randn(n, *shape, generator=g)
    columns = {"latents": latents}
    if family == "dit":
        classes = cfg.get("num_embeds_ada_norm") or 1000
        columns["class_labels"] = cond % classes
    else:
        dim = cfg.text_dim if family == "wan" else cfg.caption_channels
        tokens = 8
        if video and is_i2v(model):
            columns.update(i2v_condition(latents, cfg.in_channels - 2 * channels))
            tokens = WAN_TEXT_TOKENS  # the I2V attention splits image from text tokens by this count
            columns["image_embeds"] = torch.randn(num_conditions, IMAGE_TOKENS, cfg.image_dim, generator=g)[cond]
        table = torch.randn(num_conditions, tokens, dim, generator=g)
        columns["prompt_embeds"] = table[cond]
        if family != "wan":
            columns["prompt_attention_mask"] = torch.ones(n, tokens, dtype=torch.long)
    return TensorData(columns)


# --- Wan image-to-video ------------------------------------------------------------------------------

WAN_TEXT_TOKENS = 512  # WanAttnProcessor: image tokens = all context tokens − 512
IMAGE_TOKENS = 4  # synthetic CLIP image embeddings per example (CLIP ViT-H/14 at 224 px gives 257)


def first_frame_mask(mask_channels: int, frames: int, height: int, width: int) -> torch.Tensor:
    """WanImageToVideoPipeline's mask in latent space: the first latent frame is the given image."""
    mask = torch.zeros(mask_channels, frames, height, width)
    mask[:, 0] = 1
    return mask


def i2v_condition(latents: torch.Tensor, mask_channels: int, first: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The I2V condition for (N, z, F, H, W) video latents: mask ⊕ latents of (first frame, zeros…).
    Wan's VAE is causal, so the first latent frame encodes the first pixel frame alone; without the
    encoded condition (`first`), synthetic data uses the video's own first latent frame."""
    n, _, f, h, w = latents.shape
    cond = torch.zeros_like(latents) if first is None else first
    if first is None:
        cond[:, :, 0] = latents[:, :, 0]
    mask = first_frame_mask(mask_channels, f, h, w).expand(n, -1, -1, -1, -1)
    return {"condition": torch.cat([mask.to(latents), cond], dim=1)}


# --- batches ---------------------------------------------------------------------------------------


class StepBatchSampler(Sampler):
    """Infinite batches for one process: micro-step m takes positions [m·G + p·b, m·G + (p+1)·b)
    of a stream of per-epoch permutations (G = b · processes). Batch m depends only on (seed, m), so
    starting at m = resume step reproduces an uninterrupted run exactly."""

    def __init__(self, size: int, batch_size: int, *, seed: int, start: int = 0, rank: int = 0, world: int = 1):
        self.size, self.batch_size, self.seed, self.start, self.rank, self.world = size, batch_size, seed, start, rank, world
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))}
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


def build_dataset(spec: DataSpec, family: str, model, *, seed: int, components: str | None) -> TensorData:
    """The training set for a recipe's data section (encoding and caching on first use)."""
    if spec.kind == "synthetic":
        return synthetic(family, model, spec, seed)
    path = check_data_path(spec)
    if spec.kind == "latents":
        return TensorData(load_shards(path))
    from . import encode

    if spec.kind == "text":
        return TensorData(encode.cached_text(spec, model, components))
    return TensorData(encode.cached_folder(spec, family, model, components))
