"""Wan2.1 and Wan2.2 (T2V, I2V, TI2V): 3-D token grid (frames, height, width), QK RMSNorm across heads and 3-D
RoPE on interleaved channel pairs, both reproduced by the MHLA layer from the host's own modules.
Cross-attention (`attn2`, with the image key/values in Wan2.1 I2V) stays softmax. Wan2.2-TI2V-5B denoises the
48-channel latents of the Wan2.2 VAE (16× spatial, patchified); the A14B pipelines hold two experts of the
Wan2.1-14B shape, converted together (experts.py).

Training and sampling: flow matching on video latents (frames 4k+1 → (k+1) latent frames) through
WanPipeline; an image-to-video model (I2V: more input channels than output channels) also takes the
first frame's condition latents and CLIP image embeddings, as WanImageToVideoPipeline feeds it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..ops.rotary import InterleavedRotary
from .base import register
from .diffusers_base import DiffusersAdapter, given, tiny_t5_config

WAN_TEXT_TOKENS = 512  # WanAttnProcessor: image tokens = all context tokens − 512
IMAGE_TOKENS = 4  # synthetic CLIP image embeddings per example (CLIP ViT-H/14 at 224 px gives 257)
TINY_VIDEO = dict(height=64, width=64, num_frames=5)  # what tiny models sample by default
WAN22_LATENT_CHANNELS = 48  # the Wan2.2 VAE's z_dim: 4x16x16 compression (2x2 patches inside the VAE)


def is_i2v(model: nn.Module) -> bool:
    """A Wan transformer that also takes image-condition channels (in_channels = 2·z + mask)."""
    cfg = model.config
    return cfg.in_channels > cfg.out_channels


def first_frame_mask(mask_channels: int, frames: int, height: int, width: int) -> torch.Tensor:
    """WanImageToVideoPipeline's mask in latent space: the first latent frame is the given image."""
    mask = torch.zeros(mask_channels, frames, height, width)
    mask[:, 0] = 1
    return mask


def i2v_condition(latents: torch.Tensor, mask_channels: int,
                  first: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The I2V condition for (N, z, F, H, W) video latents: mask ⊕ latents of (first frame, zeros…).
    Wan's VAE is causal, so the first latent frame encodes the first pixel frame alone; without the
    encoded condition (`first`), synthetic data uses the video's own first latent frame."""
    n, _, f, h, w = latents.shape
    cond = torch.zeros_like(latents) if first is None else first
    if first is None:
        cond[:, :, 0] = latents[:, :, 0]
    mask = first_frame_mask(mask_channels, f, h, w).expand(n, -1, -1, -1, -1)
    return {"condition": torch.cat([mask.to(latents), cond], dim=1)}


def vae_latents(vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Wan's VAE latents of (B, 3, F, H, W) pixels, normalised by the VAE's latents_mean / std."""
    pixels = pixels.to(vae.device, vae.dtype)
    z = vae.encode(pixels).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
    return (z - mean) * inv_std


def _to_image(frame: torch.Tensor):
    """CHW in [-1, 1] → the RGB picture it was read from."""
    from PIL import Image

    return Image.fromarray(((frame.float() + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).cpu().numpy())


def image_condition(pipe, pixels: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
    """What WanImageToVideoPipeline derives from a video's first frame: `prepare_latents`' condition
    (mask ⊕ the normalised VAE latents of the first frame followed by zero frames; the VAE sees the
    padded clip, as in sampling) and `encode_image`'s CLIP embeddings of the frame as a picture."""
    padded = torch.cat([pixels[:, :, :1], torch.zeros_like(pixels[:, :, 1:])], dim=2)
    first = vae_latents(pipe.vae, padded).to(latents)
    columns = i2v_condition(latents, pipe.vae_scale_factor_temporal, first)
    if pipe.transformer.config.image_dim is not None:  # Wan2.1 I2V; later I2V models take no image tokens
        columns["image_embeds"] = pipe.encode_image([_to_image(f) for f in pixels[:, :, 0]], pipe.device)
    return columns


def tiny_image_encoder(width: int) -> dict:
    """A 2-layer CLIP vision tower at 32 px (WanImageToVideoPipeline takes its second-to-last hidden
    states, 17 tokens here) and the processor that resizes images for it."""
    import transformers
    from transformers import CLIPVisionConfig, CLIPVisionModel

    # the PIL processor is what CLIPImageProcessor falls back to (with a warning) without torchvision
    processor_cls = (transformers.CLIPImageProcessorPil if hasattr(transformers, "CLIPImageProcessorPil")
                     else transformers.CLIPImageProcessor)
    config = CLIPVisionConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                              num_attention_heads=2, image_size=32, patch_size=8)
    processor = processor_cls(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return {"image_encoder": CLIPVisionModel(config).eval(), "image_processor": processor}


def _rotary_in_input_dtype(block, args, kwargs):
    """A Wan block's forward pre-hook: (hidden_states, encoder_hidden_states, temb, rotary_emb) with the rotary
    tables cast to the hidden states' dtype (`WanAdapter.prepare_checkpointing`)."""
    args = list(args)
    hidden = args[0] if args else kwargs["hidden_states"]
    if "rotary_emb" in kwargs:
        kwargs["rotary_emb"] = tuple(t.to(hidden.dtype) for t in kwargs["rotary_emb"])
    elif len(args) > 3 and args[3] is not None:
        args[3] = tuple(t.to(hidden.dtype) for t in args[3])
    return tuple(args), kwargs


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
        "wan2.2-ti2v-5b": "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        "wan2.2-t2v-a14b": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",  # two experts: convert with --pipeline
        "wan2.2-i2v-a14b": "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
    }
    blocks_attr = "blocks"
    # 81 frames at 480x800 -> 21x30x50 tokens; 7x3x5 = 105 blocks of 3x10x10 tokens (the paper's M).
    native_blocks = (7, 3, 5)
    exact_radius = 0  # its own block of 3x10x10 tokens at 480p: the neighbours' 27 would cost a quarter of SDPA
    qk_norm = "across_heads"  # WanAttnProcessor norms (B, N, C) before splitting heads
    rotary = InterleavedRotary  # the host's (cos, sin) RoPE tables on interleaved channel pairs
    pipeline_class = "WanPipeline"
    flow_shift = 3.0
    video = True
    max_prompt_length = 512
    sample_kind = "video"

    def prepare_checkpointing(self, model) -> None:
        """Every block gets its rotary tables in its hidden states' dtype. FSDP2's mixed precision casts a block's
        inputs to bf16 in its forward but (torch 2.11) not when checkpointing recomputes the block: the float32 tables
        then reach the recomputation, every product with them is saved in another dtype and checkpointing refuses
        (CheckpointError), in diffusers' own attention (the original's, a hybrid's softmax layers) as in MHLA's.
        Where nothing casts, the tables already have that dtype, or keep float32 beside float32 hidden states."""
        for block in model.blocks:
            if not getattr(block, "_mhla_rotary_in_input_dtype", False):
                block.register_forward_pre_hook(_rotary_in_input_dtype, with_kwargs=True)
                block._mhla_rotary_in_input_dtype = True

    def native_grid(self, model) -> tuple[int, ...]:
        # the config has no sample size: Wan2.2-TI2V-5B's 121 frames at 704x1280, else the paper's 81x480x800
        return (31, 22, 40) if model.config.out_channels == WAN22_LATENT_CHANNELS else (21, 30, 50)

    def example_inputs(self, model, grid=None, batch_size=1) -> dict[str, Any]:
        # The I2V processor splits off the image tokens assuming exactly 512 text tokens.
        inputs = super().example_inputs(model, grid, batch_size)  # drawn before the text: a seed gives the same inputs
        inputs["encoder_hidden_states"] = self._text(model, batch_size, WAN_TEXT_TOKENS, model.config.text_dim)
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
        # Wan2.2-TI2V-5B's shape: the Wan2.2 VAE's 48 latent channels in and out
        ti2v = {**t2v, "in_channels": WAN22_LATENT_CHANNELS, "out_channels": WAN22_LATENT_CHANNELS}
        return {"tiny-wan": t2v, "tiny-wan-i2v": i2v, "tiny-wan2.2-ti2v": ti2v}

    def tiny_config(self) -> dict[str, Any]:
        return self.tiny_configs()["tiny-wan"]

    def tiny_pipelines(self) -> dict[str, dict[str, Any]]:
        return {"tiny-wan2.2-a14b": {"experts": "tiny-wan", "boundary_ratio": 0.875}}  # Wan2.2-T2V-A14B's boundary

    # --- training --------------------------------------------------------------------------
    def denoise(self, model, noisy, timestep, batch):
        """T2V: the noisy latents. I2V (as WanImageToVideoPipeline): the noisy latents ⊕ the condition
        (4 first-frame mask channels ⊕ the VAE latents of the first frame padded with zero frames), and
        the CLIP image embeddings when the model has an image projection."""
        extra = {}
        if "condition" in batch:
            noisy = torch.cat([noisy, batch["condition"]], dim=1)
        if "image_embeds" in batch:
            extra["encoder_hidden_states_image"] = batch["image_embeds"]
        return model(noisy, timestep=timestep, encoder_hidden_states=batch["prompt_embeds"], **extra).sample

    def latent_channels(self, model) -> int:
        return model.config.out_channels  # I2V takes 2·z + 4 channels

    def text_width(self, model) -> int:
        return model.config.text_dim

    def synthetic_conditions(self, model, latents, cond, num_conditions, generator) -> dict[str, torch.Tensor]:
        cfg, columns, tokens = model.config, {}, 8
        if is_i2v(model):
            columns.update(i2v_condition(latents, cfg.in_channels - 2 * cfg.out_channels))
            tokens = WAN_TEXT_TOKENS  # the I2V attention splits image from text tokens by this count
            if cfg.image_dim is not None:  # Wan2.1 I2V; later I2V models take no image tokens
                embeds = torch.randn(num_conditions, IMAGE_TOKENS, cfg.image_dim, generator=generator)
                columns["image_embeds"] = embeds[cond]
        table = torch.randn(num_conditions, tokens, cfg.text_dim, generator=generator)
        columns["prompt_embeds"] = table[cond]
        return columns

    def cache_name(self, model) -> str:
        return "wan-i2v" if is_i2v(model) else self.name  # same folder, different tensors

    # --- pipeline components ---------------------------------------------------------------
    def pipeline_name(self, transformer) -> str:
        return "WanImageToVideoPipeline" if is_i2v(transformer) else self.pipeline_class

    def tiny_vae(self, latent_channels: int):
        from diffusers import AutoencoderKLWan

        # 8× spatial, 4× temporal (4k+1 frames); the Wan2.2 VAE's form (48 channels): residual blocks on 2x2 pixel
        # patches, 16× spatial
        wan22 = dict(is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16)
        return AutoencoderKLWan(base_dim=8, z_dim=latent_channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                temperal_downsample=[False, True, True], latents_mean=[0.0] * latent_channels,
                                latents_std=[1.0] * latent_channels,
                                **(wan22 if latent_channels == WAN22_LATENT_CHANNELS else {}))

    def tiny_text_encoder(self, width: int):
        from transformers import UMT5EncoderModel

        return UMT5EncoderModel(tiny_t5_config(width))

    def tiny_extra_components(self, transformer) -> dict[str, Any]:
        if transformer.config.out_channels == WAN22_LATENT_CHANNELS:  # TI2V: a timestep per token, as its pipeline
            return {"expand_timesteps": True}
        image_dim = transformer.config.image_dim
        return tiny_image_encoder(image_dim) if is_i2v(transformer) and image_dim is not None else {}

    # --- encoding video folders ------------------------------------------------------------
    def check_folder_spec(self, spec) -> None:
        from ..train.errors import TrainError

        if (spec.num_frames - 1) % 4:
            raise TrainError(f"data.num_frames must be 4k+1 for Wan's VAE (e.g. 17, 33, 81); got {spec.num_frames}")

    def encode_latents(self, vae, pixels):
        return vae_latents(vae, pixels)

    def encode_text(self, pipe, captions, max_length):
        embeds, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=max_length,
                                       device=pipe.device)
        return {"prompt_embeds": embeds}

    def prompt_length(self, transformer, spec) -> int:
        # the I2V attention splits image from text tokens at exactly 512, so I2V text is always that long
        return WAN_TEXT_TOKENS if is_i2v(transformer) else super().prompt_length(transformer, spec)

    def encode_conditions(self, pipe, transformer, rows, pixels, latents, spec) -> dict[str, torch.Tensor]:
        columns = image_condition(pipe, pixels, latents) if is_i2v(transformer) else {}
        return {**columns, **super().encode_conditions(pipe, transformer, rows, pixels, latents, spec)}

    # --- sampling --------------------------------------------------------------------------
    def pipeline_tag(self, config) -> str:
        return "image-to-video" if config["in_channels"] > config["out_channels"] else "text-to-video"

    def takes_first_frame(self, model) -> bool:
        return is_i2v(model)

    def pipeline_inputs(self, pipe, base, *, prompt, guidance_scale=None, height=None, width=None, num_frames=None,
                        image=None, **inputs) -> dict[str, Any]:
        """A video from the prompt (T2V), or from the prompt and the first frame `image` (I2V); tiny
        models at TINY_VIDEO's size."""
        from ..train.components import is_tiny

        return {"prompt": prompt, **(TINY_VIDEO if is_tiny(base) else {}),
                **given(height=height, width=width, num_frames=num_frames, image=image, guidance_scale=guidance_scale)}
