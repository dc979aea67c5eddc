"""SANA: its self-attention is already ReLU linear attention, so MHLA with uniform mixing, scale 1
and SANA's eps reproduces it exactly; the default locality mixing then adds token-level locality."""

from __future__ import annotations

from typing import Any

from .base import register
from .diffusers_base import TINY_VOCAB, DiffusersAdapter


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
    pipeline_class = "SanaPipeline"
    flow_shift = 3.0
    max_prompt_length = 300

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

    def denoise(self, model, noisy, timestep, batch):
        return model(noisy, encoder_hidden_states=batch["prompt_embeds"],
                     encoder_attention_mask=batch["prompt_attention_mask"], timestep=timestep).sample

    def tiny_vae(self, latent_channels: int):
        from diffusers import AutoencoderDC

        # 2× (the real DC-AE is 32×)
        return AutoencoderDC(in_channels=3, latent_channels=latent_channels, attention_head_dim=4,
                             encoder_block_types=("ResBlock", "ResBlock"), decoder_block_types=("ResBlock", "ResBlock"),
                             encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                             encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
                             encoder_qkv_multiscales=((), ()), decoder_qkv_multiscales=((), ()),
                             decoder_norm_types="rms_norm", decoder_act_fns="silu", upsample_block_type="interpolate",
                             downsample_block_type="Conv", scaling_factor=0.41)

    def tiny_text_encoder(self, width: int):
        from transformers import Gemma2Config, Gemma2Model

        return Gemma2Model(Gemma2Config(vocab_size=TINY_VOCAB, hidden_size=width, intermediate_size=2 * width,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                        pad_token_id=0))

    def encode_latents(self, vae, pixels):
        pixels = pixels.to(vae.device, vae.dtype)
        return vae.encode(pixels).latent * vae.config.scaling_factor
