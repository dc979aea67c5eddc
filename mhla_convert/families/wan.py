"""Wan2.1 (T2V and I2V): 3-D token grid (frames, height, width), QK RMSNorm across heads and 3-D
RoPE on interleaved channel pairs, both reproduced by the MHLA layer from the host's own modules.
Cross-attention (`attn2`, with the image key/values in I2V) stays softmax."""

from __future__ import annotations

from typing import Any

from .base import register
from .diffusers_base import DiffusersAdapter


@register
class WanAdapter(DiffusersAdapter):
    name = "wan"
    model_classes = ("WanTransformer3DModel",)
    aliases = {
        "wan2.1": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "wan2.1-1.3b": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        "wan2.1-14b": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
        "wan2.1-i2v-14b-480p": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
        "wan2.1-i2v-14b-720p": "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
    }
    blocks_attr = "blocks"
    # 81 frames at 480x800 -> 21x30x50 tokens; 7x3x5 = 105 blocks of 3x10x10 tokens (the paper's M).
    native_blocks = (7, 3, 5)
    qk_norm = "across_heads"  # WanAttnProcessor norms (B, N, C) before splitting heads

    def native_grid(self, model) -> tuple[int, ...]:
        return (21, 30, 50)  # the config has no sample size: the paper's 81x480x800 setting

    def example_inputs(self, model, grid=None, batch_size=1) -> dict[str, Any]:
        # The I2V processor splits off the image tokens assuming exactly 512 text tokens.
        inputs = {**super().example_inputs(model, grid, batch_size), "encoder_hidden_states": self._text(model, batch_size, 512, model.config.text_dim)}
        if model.config.image_dim is not None:
            inputs["encoder_hidden_states_image"] = self._text(model, batch_size, 4, model.config.image_dim)
        return inputs

    def tiny_configs(self) -> dict[str, dict[str, Any]]:
        t2v = dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=6, rope_max_seq_len=32,
        )
        # I2V input = noisy latents (4) + first-frame mask (4, the VAE's temporal factor) + image-condition latents (4)
        i2v = {**t2v, "in_channels": 12, "image_dim": 16, "added_kv_proj_dim": 24}
        return {"tiny-wan": t2v, "tiny-wan-i2v": i2v}

    def tiny_config(self) -> dict[str, Any]:
        return self.tiny_configs()["tiny-wan"]
