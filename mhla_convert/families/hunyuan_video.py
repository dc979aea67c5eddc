"""HunyuanVideo (`HunyuanVideoTransformer3DModel`): an MM-DiT over video, the FLUX.1 design (flux.py) on a 3-D token
grid. Its dual-stream blocks (`transformer_blocks.i.attn`, separate text projections) and single-stream blocks
(`single_transformer_blocks.i.attn`, one projection, no output projection) both attend over the video tokens and the
prompt's Llama tokens together; both kinds convert, dual-stream first. The token refiner (`context_embedder`), which
attends over the text alone, stays softmax.

A converted layer is flux.py's `JointMHLA` called as the host (`HunyuanVideoAttnProcessor2_0`): video tokens in MHLA
blocks on the (frames, height, width) latent token grid after patching, every text token read exactly by every query
(`ops.joint`). The host's per-head q/k RMSNorms, the 3-D RoPE on the video tokens only, and the text's attention
mask (padded text keys dropped) are kept; the host concatenates the text last, the operator takes it first.

Training and sampling: flow matching (shift 7) on the video VAE's latents with the embedded guidance of the
guidance-distilled model; HunyuanVideoPipeline samples (Llama prompt tokens + CLIP pooled embedding).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import register
from .diffusers_base import TINY_VOCAB, DiffusersAdapter, TokenGrid, given
from .flux import FluxAdapter, JointMHLA, check_processor, tiny_clip_text
from .wan import TINY_VIDEO

GUIDANCE = 6.0  # HunyuanVideoPipeline's default embedded guidance (the model sees it × 1000)
TINY_TEMPLATE = {"template": "{}", "crop_start": 0}  # the tiny Llama reads the bare prompt, no system template


def prompt_template(pipe) -> dict[str, Any] | None:
    """The Llama prompt template for `pipe`'s text encoder: the pipeline's own (None: its default), or for the tiny
    character-level one the bare prompt (the default template's 95 cropped tokens are far more characters, so the
    prompt would be cut off)."""
    return TINY_TEMPLATE if pipe.text_encoder.config.vocab_size == TINY_VOCAB else None


class HunyuanVideoJointMHLA(JointMHLA):
    """`JointMHLA` called as HunyuanVideo's attention in both block kinds: (video, text, attention_mask=,
    image_rotary_emb=) → (video, text) outputs, the text through `to_add_out` in dual-stream blocks and unprojected in
    single-stream ones (whose projections, q/k norms included, are shared by text and video)."""

    def rotate(self, q, k, image_rotary_emb, text: int):
        """The host's RoPE on the video tokens (after the `text` first ones) only (diffusers' `apply_rotary_emb`)."""
        from diffusers.models.embeddings import apply_rotary_emb

        return tuple(torch.cat([t[:, :text], apply_rotary_emb(t[:, text:], image_rotary_emb, sequence_dim=1)], 1)
                     for t in (q, k))

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                **kwargs):
        if encoder_hidden_states is None or kwargs:
            raise ValueError("a HunyuanVideo joint MHLA layer takes the video and the text tokens "
                             "(encoder_hidden_states) and no further attention kwargs")
        video, text = hidden_states.shape[1], encoder_hidden_states.shape[1]
        text_mask = self.text_mask(attention_mask, video, text)
        if getattr(self, "to_add_out", None) is not None:  # dual-stream: (video, text) outputs
            return self.joint_forward(hidden_states, encoder_hidden_states, image_rotary_emb, text_mask)
        out = self.joint_forward(torch.cat([encoder_hidden_states, hidden_states], 1), None, image_rotary_emb,
                                 text_mask)
        return out[:, text:], out[:, :text]

    @staticmethod
    def text_mask(attention_mask, video: int, text: int) -> torch.Tensor | None:
        """The text's (B, L) key mask out of the model's (B, 1, 1, N + L) bool mask (video tokens first, all kept)."""
        if attention_mask is None:
            return None
        if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1:] != (
                1, 1, video + text):
            raise ValueError(f"a HunyuanVideo joint MHLA layer takes the model's (B, 1, 1, {video + text}) bool key "
                             f"mask; got {attention_mask.dtype} {tuple(attention_mask.shape)} (call the model, not "
                             "the layer)")
        return attention_mask[:, 0, 0, video:]


@register
class HunyuanVideoAdapter(FluxAdapter):
    name = "hunyuanvideo"
    model_classes = ("HunyuanVideoTransformer3DModel",)
    aliases = {"hunyuanvideo": "hunyuanvideo-community/HunyuanVideo"}
    # 129 frames at 720x1280 -> 33x45x80 = 118,800 tokens; 11x5x5 = 275 blocks of 3x9x16 tokens (M² ≤ N)
    native_blocks = (11, 5, 5)
    exact_radius = 0  # its own block of 432 tokens, as Wan's: the 26 neighbours' would add 11,232 per query
    layer_class = HunyuanVideoJointMHLA
    pipeline_class = "HunyuanVideoPipeline"
    flow_shift = 7.0  # the scheduler shift of HunyuanVideo's pipeline
    video = True
    sample_kind = "video"
    max_prompt_length = 256

    def patch_size(self, model) -> tuple[int, ...]:
        cfg = model.config
        return (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)

    def native_grid(self, model) -> tuple[int, ...]:
        return (33, 45, 80)  # the config has no sample size: 129 frames at 720x1280 (4x/8x VAE, 1x2x2 patches)

    def token_grid(self, model) -> TokenGrid:
        return TokenGrid(self.patch_size(model))  # from the latents' shape, as the other diffusers families

    def check_host(self, host, where: str) -> None:
        from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

        check_processor(host, where, HunyuanVideoAttnProcessor2_0)

    def example_inputs(self, model, grid=None, batch_size=1) -> dict[str, Any]:
        """Video latents, 8 text tokens (every other example with the last 3 padded), pooled text, guidance."""
        cfg = model.config
        inputs = DiffusersAdapter.example_inputs(self, model, grid, batch_size)
        text = 8
        lengths = torch.tensor([text - 3 * (i % 2) for i in range(batch_size)], device=model.device)
        inputs.update(
            timestep=torch.rand(batch_size, device=model.device) * 1000,
            encoder_hidden_states=self._text(model, batch_size, text, cfg.text_embed_dim),
            encoder_attention_mask=(torch.arange(text, device=model.device) < lengths[:, None]).long(),
            pooled_projections=self._text(model, batch_size, 1, cfg.pooled_projection_dim)[:, 0],
        )
        if cfg.guidance_embeds:
            inputs["guidance"] = torch.full((batch_size,), GUIDANCE * 1000, device=model.device, dtype=model.dtype)
        return inputs

    def tiny_config(self) -> dict[str, Any]:
        return dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                    num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
                    text_embed_dim=16, pooled_projection_dim=12, rope_axes_dim=(2, 2, 4), guidance_embeds=True)

    # --- training --------------------------------------------------------------------------
    def denoise(self, model, noisy, timestep, batch):
        """(B, C, F, H, W) latents and the padded prompt with its mask, as HunyuanVideoPipeline feeds them."""
        b = noisy.shape[0]
        guidance = (torch.full((b,), GUIDANCE * 1000, device=noisy.device, dtype=noisy.dtype)
                    if model.config.guidance_embeds else None)
        return model(hidden_states=noisy, timestep=timestep, encoder_hidden_states=batch["prompt_embeds"],
                     encoder_attention_mask=batch["prompt_attention_mask"], guidance=guidance,
                     pooled_projections=batch["pooled_prompt_embeds"]).sample

    def latent_channels(self, model) -> int:
        return model.config.out_channels

    def text_width(self, model) -> int:
        return model.config.text_embed_dim

    def synthetic_conditions(self, model, latents, cond, num_conditions, generator) -> dict[str, torch.Tensor]:
        """FLUX's columns plus the prompt's mask: condition c keeps its first 4 + c % 5 tokens, the rest padding."""
        columns = super().synthetic_conditions(model, latents, cond, num_conditions, generator)
        tokens = columns["prompt_embeds"].shape[1]
        mask = torch.arange(tokens) < (4 + cond % 5)[:, None]
        return {**columns, "prompt_attention_mask": mask.long()}

    # --- pipeline components ---------------------------------------------------------------
    def tiny_components(self, transformer) -> dict[str, Any]:
        """The base's tiny parts (its text encoder a 3-layer Llama: the pipeline reads the hidden states two layers
        before the last) plus a tiny CLIP text encoder for the pooled embedding as `text_encoder_2`."""
        clip, tokenizer = tiny_clip_text(transformer.config.pooled_projection_dim)
        return {**DiffusersAdapter.tiny_components(self, transformer), "text_encoder_2": clip,
                "tokenizer_2": tokenizer}

    def tiny_text_encoder(self, width: int) -> nn.Module:
        from transformers import LlamaConfig, LlamaModel

        return LlamaModel(LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=width, intermediate_size=2 * width,
                                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2))

    def tiny_vae(self, latent_channels: int):
        from diffusers import AutoencoderKLHunyuanVideo

        # 8x spatial, 4x temporal (4k+1 frames), as HunyuanVideo's
        return AutoencoderKLHunyuanVideo(latent_channels=latent_channels, block_out_channels=(8, 8, 8, 8),
                                         layers_per_block=1, norm_num_groups=4)

    def tiny_scheduler(self):
        return DiffusersAdapter.tiny_scheduler(self)  # a fixed shift, not FLUX's resolution-dependent one

    # --- encoding video folders ------------------------------------------------------------
    def encode_latents(self, vae, pixels):
        return DiffusersAdapter.encode_latents(self, vae, pixels)  # the pipeline decodes latents / scaling_factor

    def encode_text(self, pipe, captions, max_length):
        template = given(prompt_template=prompt_template(pipe))
        embeds, pooled, mask = pipe.encode_prompt(captions, device=pipe.device, max_sequence_length=max_length,
                                                  **template)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "prompt_attention_mask": mask}

    # --- sampling --------------------------------------------------------------------------
    def pipeline_inputs(self, pipe, base, *, prompt, guidance_scale=None, height=None, width=None, num_frames=None,
                        **inputs) -> dict[str, Any]:
        """Text to video; tiny models at TINY_VIDEO's size with 32 prompt tokens and no prompt template."""
        from ..train.components import is_tiny

        tiny = dict(**TINY_VIDEO, max_sequence_length=32) if is_tiny(base) else {}
        return {"prompt": prompt, **tiny, **given(prompt_template=prompt_template(pipe)),
                **given(height=height, width=width, num_frames=num_frames, guidance_scale=guidance_scale)}
