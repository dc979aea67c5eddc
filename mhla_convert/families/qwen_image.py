"""Qwen-Image (`QwenImageTransformer2DModel`): an MM-DiT whose every block is dual-stream — text and image tokens with
their own projections and q/k RMSNorms, attending jointly, text first (`transformer_blocks.i.attn`).

A converted layer is FLUX's joint MHLA layer (`flux.JointMHLA`, `ops.joint`) with Qwen-Image's own RoPE: the
QwenEmbedRope tables, one for the image tokens and one for the text, applied to each stream as the host's processor
does (diffusers' `apply_rotary_emb_qwen`), and the prompt's padding mask (`encoder_hidden_states_mask`), whose padded
text keys no query reads. The token grid comes from the model's `img_shapes`: one (1, H, W) image per sample, as
QwenImagePipeline passes it (the edit models' reference images are refused).

Training and sampling: flow matching on the packed 2×2-patch latents of its video VAE, as QwenImagePipeline packs
them; the text is Qwen2.5-VL's last hidden state with its padding mask; QwenImagePipeline samples.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layer import MHLAConfig
from .base import register
from .diffusers_base import TINY_VOCAB, DiffusersAdapter, TokenGrid, given
from .flux import JointMHLA, check_processor, replace_joint_attention


class QwenTokenGrid(TokenGrid):
    """The image token grid of each call, read off `img_shapes` (per sample, a list of (frames, rows, columns))."""

    def read(self, args, kwargs) -> tuple[int, int]:
        shapes = kwargs.get("img_shapes", args[4] if len(args) > 4 else None)
        if shapes is None:
            raise ValueError("a Qwen-Image model with MHLA layers reads its token grid from img_shapes: pass "
                             "img_shapes, as QwenImagePipeline does")
        images = {tuple(tuple(s) for s in (sample if isinstance(sample, list) else [sample])) for sample in shapes}
        if len(images) != 1 or len(first := next(iter(images))) != 1 or first[0][0] != 1:
            raise ValueError(f"MHLA layers need img_shapes of one (1, H, W) image, the same for every sample, as "
                             f"QwenImagePipeline passes; got {shapes} (the edit models' reference images are not "
                             "supported)")
        return tuple(int(n) for n in first[0][1:])


class QwenJointMHLA(JointMHLA):
    """`JointMHLA` called as Qwen-Image's attention: (hidden_states, encoder_hidden_states, encoder_hidden_states_mask=,
    image_rotary_emb=(image freqs, text freqs)) → (image, text) outputs."""

    def forward(self, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None, attention_mask=None,
                image_rotary_emb=None, **kwargs):
        if encoder_hidden_states is None:
            raise ValueError("a Qwen-Image MHLA layer needs encoder_hidden_states (the text stream), as its host")
        if attention_mask is not None or kwargs:
            raise ValueError("a Qwen-Image MHLA layer takes the text's encoder_hidden_states_mask only, no "
                             "attention_mask or further attention kwargs")
        self.current_grid(hidden_states.shape[1])  # img_shapes must describe the image tokens
        mask = None if encoder_hidden_states_mask is None else encoder_hidden_states_mask.to(torch.bool)
        return self.joint_forward(hidden_states, encoder_hidden_states, image_rotary_emb, mask)

    def rotate(self, q, k, image_rotary_emb, text: int):
        """QwenDoubleStreamAttnProcessor2_0's RoPE: the image table on the image tokens, the text table on the text."""
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        image_freqs, text_freqs = image_rotary_emb

        def rotated(x):
            return torch.cat([apply_rotary_emb_qwen(x[:, :text], text_freqs, use_real=False),
                              apply_rotary_emb_qwen(x[:, text:], image_freqs, use_real=False)], 1)

        return rotated(q), rotated(k)


@register
class QwenImageAdapter(DiffusersAdapter):
    name = "qwen-image"
    model_classes = ("QwenImageTransformer2DModel",)
    aliases = {"qwen-image": "Qwen/Qwen-Image"}
    # 1328² → 83×83 packed tokens; 8×8 blocks of about 10×10 tokens, as FLUX.1's at 1024²
    native_blocks = (8, 8)
    exact_radius = 1  # the own block and its 8 neighbours, plus the text
    pipeline_class = "QwenImagePipeline"
    joint_text = True
    # the shift QwenImagePipeline's exponential dynamic shifting gives 1328² (exp(mu), mu ≈ 0.83)
    flow_shift = 2.3
    max_prompt_length = 512  # QwenImagePipeline's default max_sequence_length

    def attention_modules(self, model) -> list[nn.Module]:
        return [block.attn for block in model.transformer_blocks]

    def native_grid(self, model) -> tuple[int, ...]:
        return (83, 83)  # Qwen-Image's 1:1 resolution, 1328², through the 8× VAE and 2×2 packing

    def token_grid(self, model) -> TokenGrid:
        return QwenTokenGrid()

    def check_host(self, host, where: str) -> None:
        from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

        check_processor(host, where, QwenDoubleStreamAttnProcessor2_0)

    def convert_layer(self, model, index: int, config: MHLAConfig) -> nn.Module:
        return replace_joint_attention(self, model, model.transformer_blocks[index], f"transformer_blocks.{index}.attn",
                                       QwenJointMHLA, config)

    def example_inputs(self, model, grid=None, batch_size=1) -> dict[str, Any]:
        """Packed latents, a prompt of 8 tokens whose later samples are padded (1, 2, … tokens masked)."""
        cfg, (h, w) = model.config, grid or self.native_grid(model)
        text = 8
        mask = torch.arange(text, device=model.device) < text - torch.arange(batch_size, device=model.device)[:, None]
        return {
            "hidden_states": torch.randn(batch_size, h * w, cfg.in_channels, device=model.device, dtype=model.dtype),
            "encoder_hidden_states": self._text(model, batch_size, text, cfg.joint_attention_dim),
            "encoder_hidden_states_mask": mask,
            "timestep": torch.rand(batch_size, device=model.device, dtype=model.dtype),
            "img_shapes": [[(1, h, w)]] * batch_size,
        }

    def tiny_config(self) -> dict[str, Any]:
        return dict(patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=8,
                    num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4))

    # --- training --------------------------------------------------------------------------
    def denoise(self, model, noisy, timestep, batch):
        """(B, C, H, W) latents packed into 2×2 patches, as QwenImagePipeline feeds them, and the prediction
        unpacked."""
        from diffusers import QwenImagePipeline

        b, c, h, w = noisy.shape
        out = model(
            hidden_states=QwenImagePipeline._pack_latents(noisy, b, c, h, w), timestep=timestep / 1000,
            encoder_hidden_states=batch["prompt_embeds"], encoder_hidden_states_mask=batch["prompt_attention_mask"],
            img_shapes=[[(1, h // 2, w // 2)]] * b,
        ).sample
        return QwenImagePipeline._unpack_latents(out, h, w, 1)[:, :, 0]

    def latent_channels(self, model) -> int:
        return model.config.in_channels // 4  # 2×2 packing

    def text_width(self, model) -> int:
        return model.config.joint_attention_dim

    # --- pipeline components ---------------------------------------------------------------
    def tiny_text_encoder(self, width: int) -> nn.Module:
        """A one-layer Qwen2.5-VL (a tiny vision tower too, unused by text-to-image) over the character tokenizer."""
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        text = dict(vocab_size=TINY_VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]})
        vision = dict(depth=1, hidden_size=width, intermediate_size=2 * width, num_heads=2, out_hidden_size=width,
                      patch_size=2, spatial_merge_size=1, temporal_patch_size=1, fullatt_block_indexes=[0])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, bos_token_id=None, eos_token_id=2)
        return Qwen2_5_VLForConditionalGeneration(config)

    def tiny_vae(self, latent_channels: int):
        from diffusers import AutoencoderKLQwenImage

        # 4× spatial (QwenImagePipeline's vae_scale_factor: 2 ** len(temperal_downsample))
        return AutoencoderKLQwenImage(base_dim=8, z_dim=latent_channels, dim_mult=[1, 2], num_res_blocks=1,
                                      temperal_downsample=[False, True], latents_mean=[0.0] * latent_channels,
                                      latents_std=[1.0] * latent_channels)

    def tiny_scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        # Qwen-Image's: the shift grows with the image's token count (QwenImagePipeline passes mu); without its
        # shift_terminal (0.02), which divides by zero at one sampling step
        return FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                               base_image_seq_len=256, max_image_seq_len=8192,
                                               time_shift_type="exponential")

    # --- encoding image folders ------------------------------------------------------------
    def encode_latents(self, vae, pixels):
        """One-frame latents of the video VAE, normalised by its latents_mean / latents_std as QwenImagePipeline
        un-normalises them before decoding."""
        latents = vae.encode(pixels.to(vae.device, vae.dtype)[:, :, None]).latent_dist.mode()[:, :, 0]
        mean, std = (torch.tensor(vae.config[k], device=latents.device, dtype=latents.dtype).view(1, -1, 1, 1)
                     for k in ("latents_mean", "latents_std"))
        return (latents - mean) / std

    def encode_text(self, pipe, captions, max_length):
        embeds, mask = pipe.encode_prompt(captions, device=pipe.device, max_sequence_length=max_length)
        if mask is None:  # QwenImagePipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    # --- sampling --------------------------------------------------------------------------
    def pipeline_inputs(self, pipe, base, *, prompt, guidance_scale=None, height=None, width=None,
                        **inputs) -> dict[str, Any]:
        """Text to image; `guidance_scale` is Qwen-Image's true classifier-free guidance (`true_cfg_scale`, with the
        empty negative prompt; none by default); tiny models at 32×32 pixels (4×4 tokens) with 32 prompt tokens."""
        from ..train.components import is_tiny

        tiny = dict(height=32, width=32, max_sequence_length=32) if is_tiny(base) else {}
        guidance = ({"true_cfg_scale": 1.0} if guidance_scale is None
                    else {"true_cfg_scale": guidance_scale, "negative_prompt": " "})
        return {"prompt": prompt, **tiny, **guidance, **given(height=height, width=width)}
