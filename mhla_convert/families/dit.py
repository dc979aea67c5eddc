"""DiT (class-conditional): `BasicTransformerBlock.attn1`, plain SDPA attention; everything it
needs is in DiffusersAdapter. Note diffusers' DiT unpatchify assumes a square token grid."""

from __future__ import annotations

from typing import Any

import torch

from .base import register
from .diffusers_base import DiffusersAdapter


@register
class DiTAdapter(DiffusersAdapter):
    name = "dit"
    model_classes = ("DiTTransformer2DModel",)
    aliases = {"dit-xl-2-256": "facebook/DiT-XL-2-256", "dit-xl-2-512": "facebook/DiT-XL-2-512"}

    def example_inputs(self, model, grid=None, batch_size=1) -> dict[str, Any]:
        inputs = super().example_inputs(model, grid, batch_size)
        labels = torch.randint(0, model.config.num_embeds_ada_norm, (batch_size,), device=inputs["timestep"].device)
        return {**inputs, "class_labels": labels}

    def tiny_config(self) -> dict[str, Any]:
        return dict(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=6,
            sample_size=16, patch_size=2, num_embeds_ada_norm=10,
        )
