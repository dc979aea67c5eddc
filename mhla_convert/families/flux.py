"""FLUX.1 (`FluxTransformer2DModel`): an MM-DiT whose attention runs over the prompt's text tokens and the image
tokens together — in the dual-stream blocks (`transformer_blocks.i.attn`, separate text projections, text first) and
in the single-stream blocks (`single_transformer_blocks.i.attn`, one projection over the concatenated tokens, no
output projection). Both kinds convert; layer indices count the dual-stream blocks first.

A converted layer reads the text tokens exactly and the image tokens as MHLA blocks on the latent token grid
(`ops.joint`): the host's q/k RMSNorms (per head, the text's own in dual-stream blocks), the text-first concat and
the host's RoPE over both (diffusers' own `apply_rotary_emb`) are kept exactly. The token grid comes from the
model's `img_ids`, which FluxPipeline lays out row-major over the packed 2×2-patch latents.

Training and sampling: flow matching on the VAE latents, packed and unpacked as FluxPipeline does, with the guidance
embedding of the guidance-distilled FLUX.1-dev; FluxPipeline samples (CLIP pooled + T5 prompt embeddings).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from ..layer import MHLAConfig
from ..ops.joint import joint_attention
from .base import UnsupportedModelError, register
from .diffusers_base import GRID_ATTR, TINY_VOCAB, DiffusersAdapter, DiffusersMHLA, TokenGrid, fitted_blocks, given

GUIDANCE = 3.5  # FluxPipeline's default guidance, which the guidance-distilled model is trained to embed
TEXT_PROJECTIONS = ("add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k", "to_add_out")


class FluxTokenGrid(TokenGrid):
    """The image token grid of each call, read off `img_ids` (one (row, column) id per packed token, row-major)."""

    def read(self, args, kwargs) -> tuple[int, int]:
        ids = kwargs.get("img_ids", args[4] if len(args) > 4 else None)
        if ids is None:
            raise ValueError("a FLUX model with MHLA layers reads its token grid from img_ids: pass img_ids, "
                             "as FluxPipeline does")
        ids = ids.detach().to("cpu")
        ids = ids[0] if ids.dim() == 3 else ids
        h, w = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
        n = torch.arange(len(ids))
        if h * w != len(ids) or not (torch.equal(ids[:, 1].long(), n // w) and torch.equal(ids[:, 2].long(), n % w)):
            raise ValueError(f"MHLA layers need img_ids of one row-major token grid (FluxPipeline's "
                             f"_prepare_latent_image_ids); got {len(ids)} ids spanning {h}x{w} (reference images, "
                             "as in FLUX Kontext, are not supported)")
        return h, w


def check_processor(host: nn.Module, where: str, processor: type, hint: str = "") -> None:
    """Refuse a joint host attention (named `where`) whose processor is not `processor`, the one its MHLA layer
    reproduces."""
    if type(host.processor) is not processor:
        raise UnsupportedModelError(f"{where} uses {type(host.processor).__name__}; an MHLA layer reproduces "
                                    f"{processor.__name__} only{hint}")


def replace_joint_attention(adapter: DiffusersAdapter, model, block: nn.Module, where: str, layer_class, config):
    """`block.attn` (named `where`) checked by the adapter and replaced by `layer_class.from_joint_host`, reading the
    model's token grid."""
    adapter.check_host(block.attn, where)
    layer = layer_class.from_joint_host(block.attn, config)
    adapter.prepare(model)
    layer.token_grid = getattr(model, GRID_ATTR)
    block.attn = layer
    return layer


class JointMHLA(DiffusersMHLA):
    """MHLA in place of a joint text–image attention (`FluxAttention`), called as the host: dual-stream
    (hidden_states, encoder_hidden_states, image_rotary_emb=) → (image, text) outputs; single-stream (the text-first
    concatenation, image_rotary_emb=) → one output. `mixing` is (M + 1, M + 1): index M is the text (`ops.joint`)."""

    @classmethod
    def from_joint_host(cls, host: nn.Module, config: MHLAConfig) -> "JointMHLA":
        """`from_host` (per-head q/k norms), plus the host's text-stream projections and norms where it has them."""
        layer = cls.from_host(host, config, qk_norm="per_head")
        for name in TEXT_PROJECTIONS if host.added_kv_proj_dim is not None else ():
            setattr(layer, name, getattr(host, name))
        return layer

    def _initial_mixing(self, far_init: float | None = None) -> torch.Tensor:
        """The image blocks' init (`MHLAttention._initial_mixing`), then the text: every image query reads it exactly
        at weight 1, as its own exact region; the text queries read it at 1 and the image summaries at the far weight
        (1 without an exact region), so far = 0 starts as the host's attention cut to region and text."""
        image = super()._initial_mixing(far_init)
        far = (self.config.far_init if far_init is None else far_init) if self.has_region else 1.0
        m = image.shape[-1]
        joint = image.new_ones(*image.shape[:-2], m + 1, m + 1)
        joint[..., :m, :m] = image
        joint[..., m, :m] = far
        return joint / joint.amax(-1, keepdim=True)

    def attend_joint(self, q, k, v, grid: tuple[int, ...], text: int, text_mask=None) -> torch.Tensor:
        """`ops.joint.joint_attention` of the text-first (B, L + N, H, D) q, k, v (`text_mask`: (B, L) bool, False
        for padded text); a grid axis shorter than its block count is clamped (`fitted_blocks`), the text block
        kept."""
        if self.context_parallel is not None:
            raise ValueError("joint text-image MHLA layers do not run under context parallelism")
        blocks, kept = fitted_blocks(tuple(grid), self.config.blocks)
        mixing = self.mixing
        if kept is not None:
            kept = torch.cat([kept, torch.tensor([self.mixing.shape[-1] - 1])]).to(mixing.device)
            mixing = mixing[..., kept, :][..., kept]
        cfg = self.config
        return joint_attention(q, k, v, mixing, text=text, grid=grid, blocks=blocks, exact_radius=cfg.exact_radius,
                               feature_map=self.phi, scale=cfg.scale, eps=cfg.eps, text_mask=text_mask,
                               text_exact=cfg.text_exact, backend=cfg.backend)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                **kwargs):
        if attention_mask is not None or kwargs:
            raise ValueError("a joint MHLA layer takes no attention mask or further attention kwargs (IP-Adapter)")
        return self.joint_forward(hidden_states, encoder_hidden_states, image_rotary_emb)

    def rotate(self, q, k, image_rotary_emb, text: int):
        """The host's RoPE on the text-first q, k (FLUX: one table over both, diffusers' `apply_rotary_emb`)."""
        from diffusers.models.embeddings import apply_rotary_emb

        return (apply_rotary_emb(q, image_rotary_emb, sequence_dim=1),
                apply_rotary_emb(k, image_rotary_emb, sequence_dim=1))

    def joint_forward(self, hidden_states, encoder_hidden_states, image_rotary_emb, text_mask=None):
        """The host's projections, q/k norms, text-first concat and RoPE (`rotate`), then `attend_joint`: the image
        output (through `to_out`) and with text the text output (through `to_add_out`)."""
        q, k, v = self.project(hidden_states)  # per-head RMSNorm on q, k, as FluxAttnProcessor
        if encoder_hidden_states is not None:
            eq, ek, ev = (p(encoder_hidden_states).unflatten(-1, (-1, self.head_dim))
                          for p in (self.add_q_proj, self.add_k_proj, self.add_v_proj))
            eq, ek = self.norm_added_q(eq), self.norm_added_k(ek)
            q, k, v = torch.cat([eq, q], 1), torch.cat([ek, k], 1), torch.cat([ev, v], 1)
        grid = self.token_grid.grid if self.token_grid is not None else None
        text = q.shape[1] - math.prod(grid) if grid is not None else 0
        if text < 1:
            raise ValueError(f"joint MHLA layer got {q.shape[1]} tokens but the model's last forward captured image "
                             f"grid {grid}, leaving no text tokens; call the model, not the layer")
        if image_rotary_emb is not None and self.config.rope == "before_feature_map":
            q, k = self.rotate(q, k, image_rotary_emb, text)
        out = self.out_norm(self.attend_joint(q, k, v, grid, text, text_mask)).flatten(-2)
        if encoder_hidden_states is None:
            return self.to_out(out)  # single-stream: no output projection (Identity)
        text_out, image_out = out.split([text, out.shape[1] - text], 1)
        return self.to_out(image_out.contiguous()), self.to_add_out(text_out.contiguous())


@register
class FluxAdapter(DiffusersAdapter):
    name = "flux"
    model_classes = ("FluxTransformer2DModel",)
    aliases = {"flux.1-dev": "black-forest-labs/FLUX.1-dev"}
    # 1024² → 64×64 packed tokens; 8×8 blocks of 8×8 tokens: M² = N
    native_blocks = (8, 8)
    exact_radius = 1  # the own block and its 8 neighbours: 576 of 4096 image tokens at 1024², plus the text
    pipeline_class = "FluxPipeline"
    joint_text = True
    flow_shift = 3.0
    max_prompt_length = 512
    layer_class: ClassVar[type[JointMHLA]] = JointMHLA  # what replaces each joint attention

    def attention_modules(self, model) -> list[nn.Module]:
        return [block.attn for block in (*model.transformer_blocks, *model.single_transformer_blocks)]

    def patch_size(self, model) -> tuple[int, ...]:
        return (2, 2)  # FluxPipeline packs 2x2 latent patches into one token (the config's patch_size is 1)

    def native_grid(self, model) -> tuple[int, ...]:
        return (64, 64)  # the config has no sample size: 1024² through the 8× VAE and 2×2 packing

    def token_grid(self, model) -> TokenGrid:
        return FluxTokenGrid()

    def check_host(self, host, where: str) -> None:
        from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

        check_processor(host, where, FluxAttnProcessor, " (unload IP-Adapters first)")

    def convert_layer(self, model, index: int, config: MHLAConfig) -> nn.Module:
        dual = len(model.transformer_blocks)
        block = model.transformer_blocks[index] if index < dual else model.single_transformer_blocks[index - dual]
        where = f"transformer_blocks.{index}.attn" if index < dual else f"single_transformer_blocks.{index - dual}.attn"
        return replace_joint_attention(self, model, block, where, self.layer_class, config)

    def example_inputs(self, model, grid=None, batch_size=1) -> dict[str, Any]:
        from diffusers import FluxPipeline

        cfg, (h, w) = model.config, grid or self.native_grid(model)
        device, dtype = model.device, model.dtype
        text = 8
        inputs = {
            "hidden_states": torch.randn(batch_size, h * w, cfg.in_channels, device=device, dtype=dtype),
            "encoder_hidden_states": self._text(model, batch_size, text, cfg.joint_attention_dim),
            "pooled_projections": torch.randn(batch_size, cfg.pooled_projection_dim, device=device, dtype=dtype),
            "timestep": torch.rand(batch_size, device=device, dtype=dtype),
            "img_ids": FluxPipeline._prepare_latent_image_ids(batch_size, h, w, device, dtype),
            "txt_ids": torch.zeros(text, 3, device=device, dtype=dtype),
        }
        if cfg.guidance_embeds:
            inputs["guidance"] = torch.full((batch_size,), GUIDANCE, device=device, dtype=dtype)
        return inputs

    def tiny_config(self) -> dict[str, Any]:
        return dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=8,
                    num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=12, guidance_embeds=True,
                    axes_dims_rope=(2, 2, 4))

    # --- training --------------------------------------------------------------------------
    def denoise(self, model, noisy, timestep, batch):
        """(B, C, H, W) latents packed into 2×2 patches, as FluxPipeline feeds them, and the prediction unpacked."""
        from diffusers import FluxPipeline

        b, c, h, w = noisy.shape
        text = batch["prompt_embeds"]
        guidance = torch.full((b,), GUIDANCE, device=noisy.device) if model.config.guidance_embeds else None
        out = model(
            hidden_states=FluxPipeline._pack_latents(noisy, b, c, h, w), timestep=timestep / 1000, guidance=guidance,
            pooled_projections=batch["pooled_prompt_embeds"], encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=noisy.device, dtype=noisy.dtype),
            img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, noisy.device, noisy.dtype),
        ).sample
        return FluxPipeline._unpack_latents(out, h, w, 1)

    def latent_channels(self, model) -> int:
        return model.config.in_channels // 4  # 2×2 packing

    def text_width(self, model) -> int:
        return model.config.joint_attention_dim

    def synthetic_conditions(self, model, latents, cond, num_conditions, generator) -> dict[str, torch.Tensor]:
        columns = super().synthetic_conditions(model, latents, cond, num_conditions, generator)
        pooled = torch.randn(num_conditions, model.config.pooled_projection_dim, generator=generator)
        return {"prompt_embeds": columns["prompt_embeds"], "pooled_prompt_embeds": pooled[cond]}

    # --- pipeline components ---------------------------------------------------------------
    def tiny_components(self, transformer) -> dict[str, Any]:
        """The base's tiny parts with its T5 as FLUX's `text_encoder_2`, plus a tiny CLIP text encoder (the pooled
        embedding) with a 77-token character tokenizer."""
        parts = super().tiny_components(transformer)
        parts["text_encoder_2"], parts["tokenizer_2"] = parts.pop("text_encoder"), parts.pop("tokenizer")
        clip, tokenizer = tiny_clip_text(transformer.config.pooled_projection_dim)
        return {**parts, "text_encoder": clip, "tokenizer": tokenizer}

    def tiny_vae(self, latent_channels: int):
        vae = super().tiny_vae(latent_channels)
        vae.register_to_config(shift_factor=0.0)  # FluxPipeline decodes latents / scaling_factor + shift_factor
        return vae

    def tiny_scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        # FLUX.1-dev's: the shift grows with the image's token count (FluxPipeline passes mu)
        return FlowMatchEulerDiscreteScheduler(shift=self.flow_shift, use_dynamic_shifting=True, base_shift=0.5,
                                               max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)

    # --- encoding image folders ------------------------------------------------------------
    def encode_latents(self, vae, pixels):
        pixels = pixels.to(vae.device, vae.dtype)
        return (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor

    def encode_text(self, pipe, captions, max_length):
        embeds, pooled, _ = pipe.encode_prompt(captions, device=pipe.device, max_sequence_length=max_length)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    # --- sampling --------------------------------------------------------------------------
    def pipeline_inputs(self, pipe, base, *, prompt, guidance_scale=None, height=None, width=None,
                        **inputs) -> dict[str, Any]:
        """Text to image; tiny models at 32×32 pixels (8×8 tokens) with 32 prompt tokens."""
        from ..train.components import is_tiny

        tiny = dict(height=32, width=32, max_sequence_length=32) if is_tiny(base) else {}
        return {"prompt": prompt, **tiny, **given(height=height, width=width, guidance_scale=guidance_scale)}


def tiny_clip_text(width: int) -> tuple[nn.Module, Any]:
    """A tiny CLIP text encoder for the pooled prompt embedding (`width` wide, its own seed) and its 77-token
    character tokenizer."""
    from transformers import CLIPTextConfig, CLIPTextModel

    from ..train.components import char_tokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        clip = CLIPTextModel(CLIPTextConfig(vocab_size=TINY_VOCAB, hidden_size=width, intermediate_size=2 * width,
                                            num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
                                            pad_token_id=0, eos_token_id=2))
    tokenizer = char_tokenizer()
    tokenizer.model_max_length = 77
    return clip.eval(), tokenizer
