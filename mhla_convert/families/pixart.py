"""PixArt-α / Σ: the same `BasicTransformerBlock.attn1` as DiT (cross-attention `attn2` stays)."""

from __future__ import annotations

from typing import Any

import torch

from .base import register
from .diffusers_base import DiffusersAdapter


@register
class PixArtAdapter(DiffusersAdapter):
    name = "pixart"
    model_classes = ("PixArtTransformer2DModel",)
    aliases = {
        "pixart-alpha-512": "PixArt-alpha/PixArt-XL-2-512x512",
        "pixart-alpha-1024": "PixArt-alpha/PixArt-XL-2-1024-MS",
        "pixart-sigma-512": "PixArt-alpha/PixArt-Sigma-XL-2-512-MS",
        "pixart-sigma-1024": "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",
    }
    pipeline_class = "PixArtAlphaPipeline"
    max_prompt_length = 120

    def example_inputs(self, model, grid=None, batch_size=1) -> dict[str, Any]:
        caption = self._text(model, batch_size, 8, model.config.caption_channels)
        conditions = {"resolution": None, "aspect_ratio": None}  # used only by 1024px PixArt-α
        return {
            **super().example_inputs(model, grid, batch_size),
            "encoder_hidden_states": caption,
            "added_cond_kwargs": conditions,
        }

    def tiny_config(self) -> dict[str, Any]:
        return dict(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=6,
            cross_attention_dim=16, caption_channels=12, sample_size=16, patch_size=2,
        )

    def denoise(self, model, noisy, timestep, batch):
        base = getattr(model, "module", model)
        added = {"resolution": None, "aspect_ratio": None}
        if getattr(base, "use_additional_conditions", False):
            b, _, h, w = noisy.shape
            scale = 8  # VAE downsampling: the pipeline passes pixel sizes
            like = {"device": noisy.device, "dtype": noisy.dtype}
            added = {"resolution": torch.tensor([[h * scale, w * scale]], **like).expand(b, 2),
                     "aspect_ratio": torch.full((b, 1), h / w, **like)}
        return model(noisy, encoder_hidden_states=batch["prompt_embeds"],
                     encoder_attention_mask=batch["prompt_attention_mask"], timestep=timestep,
                     added_cond_kwargs=added).sample
