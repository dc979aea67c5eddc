"""What a family adapter and training share: the recipe sections a family reads (`DataSpec`, `ObjectiveSpec`) and
the `Objective` a family picks. Below both `families` and `train`, so neither imports the other for them; the
recipe (train/recipe.py) holds them as its `data` and `objective` sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass
class DataSpec:
    """Where training examples come from; every kind ends as cached tensors (see train/data.py)."""

    kind: Literal["synthetic", "folder", "latents", "text"] = "synthetic"
    path: str | None = None
    batch_size: int = 1  # per process
    num_workers: int = 0
    num_samples: int = 64  # synthetic
    latent_size: list[int] | None = None  # synthetic: latent (H, W); default: the model's sample size
    latent_frames: int = 2  # synthetic video latents
    height: int = 256  # folder: pixels
    width: int = 256
    num_frames: int = 17  # folder videos
    caption_column: str = "text"
    label_column: str = "label"
    max_text_length: int = 300
    encode_batch_size: int = 4
    cache_dir: str | None = None  # default: <path>/.mhla_cache
    components: str | None = None  # VAE / text encoder source; default: the base model
    text_column: str = "text"
    text_format: Literal["auto", "json", "text", "parquet"] = "auto"
    context_length: int = 128


@dataclass
class ObjectiveSpec:
    flow_shift: float | None = None  # SANA / Wan; default: the family's (3.0)
    num_train_timesteps: int = 1000
    timestep_sampling: Literal["uniform", "logit_normal"] = "uniform"
    # finetune stages: loss = (1 − distill) · the task loss + distill · the loss of matching the original
    # (unconverted) model's outputs (train/objectives.py: Distillation); 0: the plain objective, 1: pure distillation
    distill: float = 0.0


class Objective(Protocol):
    def loss(self, model: nn.Module, batch: dict, generator: torch.Generator) -> torch.Tensor: ...
