"""PixArt-α / Σ: the same `BasicTransformerBlock.attn1` as DiT (cross-attention `attn2` stays)."""

from __future__ import annotations

from typing import Any

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

    def example_inputs(self, model, grid=None, batch_size=1) -> dict[str, Any]:
        caption = self._text(model, batch_size, 8, model.config.caption_channels)
        conditions = {"resolution": None, "aspect_ratio": None}  # used only by 1024px PixArt-α
        return {**super().example_inputs(model, grid, batch_size), "encoder_hidden_states": caption, "added_cond_kwargs": conditions}

    def tiny_config(self) -> dict[str, Any]:
        return dict(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=6,
            cross_attention_dim=16, caption_channels=12, sample_size=16, patch_size=2,
        )
