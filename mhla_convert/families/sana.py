"""SANA: its self-attention is already ReLU linear attention, so MHLA with uniform mixing, scale 1
and SANA's eps reproduces it exactly; the default locality mixing then adds token-level locality."""

from __future__ import annotations

from typing import Any

from .base import register
from .diffusers_base import DiffusersAdapter


@register
class SanaAdapter(DiffusersAdapter):
    name = "sana"
    model_classes = ("SanaTransformer2DModel",)
    aliases = {
        "sana-600m": "Efficient-Large-Model/Sana_600M_1024px_diffusers",
        "sana-1600m": "Efficient-Large-Model/Sana_1600M_1024px_diffusers",
        "sana-1600m-512": "Efficient-Large-Model/Sana_1600M_512px_diffusers",
    }
    qk_norm = "across_heads"  # SanaLinearAttnProcessor2_0 norms (B, N, C), before splitting heads
    clip_fp16 = True

    def default_options(self, model) -> dict[str, Any]:
        return {"eps": 1e-15, "scale": 1.0}  # SanaLinearAttnProcessor2_0: no 1/sqrt(d), eps 1e-15

    def example_inputs(self, model, grid=None, batch_size=1) -> dict[str, Any]:
        caption = self._text(model, batch_size, 8, model.config.caption_channels)
        return {**super().example_inputs(model, grid, batch_size), "encoder_hidden_states": caption}

    def tiny_config(self) -> dict[str, Any]:
        return dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=6,
            num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16,
            caption_channels=12, sample_size=8, patch_size=1,
        )
