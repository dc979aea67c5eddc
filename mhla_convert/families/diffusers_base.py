"""What the diffusers families share: the drop-in MHLA attention module, the token-grid capture,
and an adapter base that only needs to be told where self-attention lives.

Why a drop-in module rather than a new processor: the converted layer must be an `MHLAttention`
(so `mhla_layers`, `clamp_mixing_` and training find `mixing`) and accept the host attention's
exact call, so the host block runs unchanged and a deep copy of the original attention (the
distillation teacher) can be called with the very args/kwargs a forward hook sees.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from ..layer import MHLAConfig, MHLAttention
from ..ops import mhla_attention
from ..ops.context_parallel import mhla_attention_context_parallel
from ..registration import CONVERTED_PREFIX
from .base import FamilyAdapter, UnsupportedModelError

GRID_ATTR = "_mhla_token_grid"  # the model's TokenGrid, shared by all its converted layers
TINY_VOCAB = 98  # the tiny text encoders' vocabulary: train/components.py's character tokenizer


class TokenGrid:
    """A forward pre-hook on the model that records the post-patch token grid of each call.

    Diffusers transformers compute the grid inside forward and never pass it to attention, so it
    is read off the model input (B, C, [F,] H, W) and the patch size — never assumed square. Families whose
    inputs are packed tokens override `read`.
    """

    def __init__(self, patch_size: tuple[int, ...] = ()):
        self.patch_size = patch_size
        self.grid: tuple[int, ...] | None = None
        self.context_parallel = None

    def read(self, args, kwargs) -> tuple[int, ...]:
        """The post-patch token grid of the call with these forward arguments."""
        x = args[0] if args else kwargs["hidden_states"]
        return tuple(size // p for size, p in zip(x.shape[-len(self.patch_size):], self.patch_size))

    def __call__(self, module, args, kwargs) -> None:
        self.grid = self.read(args, kwargs)
        # Under the model's `enable_parallelism(config=ContextParallelConfig(...))` (or `from_pretrained(...,
        # parallel_config=)`), diffusers' hooks cut the tokens across ranks after this hook: its set-up config, which
        # the layers then run `ops.context_parallel` with (`context_parallel_form`).
        parallel = getattr(module, "_parallel_config", None)
        self.context_parallel = getattr(parallel, "context_parallel_config", None)


def fitted_blocks(grid: tuple[int, ...], blocks: tuple[int, ...]) -> tuple[tuple[int, ...], torch.Tensor | None]:
    """Blocks clamped to a grid smaller than the layout, and which of the M blocks remain.

    An axis of L < b tokens in b blocks has one token per block and b - L empty blocks; empty
    blocks add nothing, so this is the same attention as the full layout with those blocks dropped
    from the mixing matrix. Returns (blocks, None) when nothing needs clamping.
    """
    fitted = tuple(min(g, b) for g, b in zip(grid, blocks))
    if fitted == tuple(blocks):
        return fitted, None
    coords = torch.meshgrid(*(torch.arange(f) for f in fitted), indexing="ij")
    strides = [math.prod(blocks[a + 1:]) for a in range(len(blocks))]
    return fitted, sum(c.reshape(-1) * s for c, s in zip(coords, strides))


class DiffusersMHLA(MHLAttention):
    """MHLA in place of a diffusers self-attention (`Attention` or `WanAttention`).

    Called exactly like the host: (hidden_states, encoder_hidden_states=None, attention_mask=None,
    rotary_emb=None, **kwargs) → (B, N, C). The host's to_q/to_k/to_v/to_out and norm_q/norm_k are
    the same module objects, so state-dict keys are the host's plus `mixing`.
    """

    token_grid: TokenGrid | None = None
    clip_fp16: bool = False  # SANA's processor clips fp16 outputs to the finite range
    rotary: Callable | None = None  # the family's rotary from the host's `rotary_emb` (DiffusersAdapter.rotary)

    @classmethod
    def from_host(cls, host: nn.Module, config: MHLAConfig, *, qk_norm: str | None, clip_fp16: bool = False,
                  rotary: Callable | None = None) -> "DiffusersMHLA":
        """Move `host`'s projections and norms into a new layer; only `mixing` (and an optional
        output norm) are new. Built on the meta device first so no throwaway weights are initialised."""
        has_norm = getattr(host, "norm_q", None) is not None
        out = getattr(host, "to_out", None)  # None: a pre-only attention (FLUX's single-stream blocks)
        with torch.device("meta"):
            layer = cls(
                host.to_q.in_features, host.heads, head_dim=host.to_q.out_features // host.heads,
                qkv_bias=host.to_q.bias is not None, out_bias=out is None or out[0].bias is not None,
                out_dim=None if out is None else out[0].out_features, qk_norm=qk_norm if has_norm else None,
                config=config,
            )
        layer.to_q, layer.to_k, layer.to_v = host.to_q, host.to_k, host.to_v
        # same children, same keys (to_out.0.weight)
        layer.to_out = nn.Identity() if out is None else nn.Sequential(*out)
        if has_norm:
            layer.norm_q, layer.norm_k = host.norm_q, host.norm_k
        weight = host.to_q.weight
        layer.new_parameters(weight.device, weight.dtype)  # mixing in float32 whatever the model's (placement.py)
        for module in layer.out_norm.modules():  # a new output norm: identity at init
            module.to_empty(device=weight.device, recurse=False)
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        layer.out_norm.to(weight.dtype)
        layer.clip_fp16, layer.rotary = clip_fp16, rotary
        return layer

    @property
    def context_parallel(self):
        """diffusers' ContextParallelConfig of the model's last forward, if any (`TokenGrid`)."""
        return self.token_grid.context_parallel if self.token_grid is not None else None

    def current_grid(self, num_tokens: int) -> tuple[int, ...]:
        grid = self.token_grid.grid if self.token_grid is not None else None
        # (under context parallelism the layer sees one rank's tokens, which the operator checks against the grid)
        if grid is None or (self.context_parallel is None and math.prod(grid) != num_tokens):
            raise ValueError(
                f"MHLA layer got {num_tokens} tokens but the model's last forward captured grid {grid}; "
                "converted layers read the token grid from the model's forward, so call the model, not the layer"
            )
        return grid

    def attend(self, q, k, v, grid=None) -> torch.Tensor:
        """As MHLAttention.attend; a grid axis shorter than its block count is clamped (see `fitted_blocks`); under
        context parallelism, this rank's rows of the whole sequence's attention."""
        cp = self.context_parallel
        if cp is None and (grid is None or self.config.blocks is None or len(grid) != len(self.config.blocks)):
            return super().attend(q, k, v, grid)
        blocks, kept = fitted_blocks(tuple(grid), self.config.blocks)
        if kept is None and cp is None:
            return super().attend(q, k, v, grid)
        if kept is not None:
            kept = kept.to(self.mixing.device)
        mixing = self.mixing if kept is None else self.mixing[..., kept, :][..., kept]
        options = dict(grid=grid, blocks=blocks, backend=self.config.backend, **self._op_options())
        if cp is None:
            return mhla_attention(q, k, v, mixing, **options)
        form, group = context_parallel_form(cp)
        return mhla_attention_context_parallel(q, k, v, mixing, group=group, form=form, **options)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None, **kwargs):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("an MHLA self-attention layer takes neither encoder_hidden_states nor an attention mask")
        if rotary_emb is not None and self.rotary is None:
            raise ValueError("this MHLA layer got rotary_emb but its family adapter declares no rotary "
                             "(set DiffusersAdapter.rotary)")
        q, k, v = self.project(hidden_states, None if rotary_emb is None else self.rotary(*rotary_emb))
        out = self.output(self.attend(q, k, v, self.current_grid(hidden_states.shape[1])))
        if self.clip_fp16 and out.dtype == torch.float16:
            out = out.clip(-65504, 65504)
        return out


def context_parallel_form(config) -> tuple[str, Any]:
    """(form, process group) of `ops.context_parallel` for diffusers' set-up ContextParallelConfig: with only
    `ulysses_degree` > 1 the ulysses form over its mesh, as the model's softmax layers use; with `ring_degree` > 1
    (alone or with ulysses) the summaries exchange over the whole mesh, which diffusers splits the tokens over."""
    if config.ring_degree == 1:
        return "ulysses", config._ulysses_mesh.get_group()
    return "summaries", config._flattened_mesh.get_group()


class DiffusersAdapter(FamilyAdapter):
    """A diffusers transformer whose blocks keep self-attention at `<blocks_attr>[i].attn1`.

    Training and sampling: a text-conditioned image model with a KL VAE, a T5 text encoder and
    ε-prediction (DDPM) by default. A family overrides `denoise` (required) and what differs:
    `flow_shift` (flow matching), `video`, `pipeline_class`, `max_prompt_length`, `latent_channels`,
    `text_width`, `synthetic_conditions`, `tiny_vae`, `tiny_text_encoder`, `tiny_extra_components`, `prompt_length`,
    `encode_latents`, `encode_text`, `encode_conditions`, `num_classes` (class-conditional models),
    `pipeline_inputs` (the sampling call's condition and sizes).
    """

    library = "diffusers"
    blocks_attr: ClassVar[str] = "transformer_blocks"
    native_blocks: ClassVar[tuple[int, ...]] = (4, 4)
    # the blocks within this many of a query's own (per axis) read exactly with the softmax kernel
    # (MHLAConfig.exact_radius; None: off), chosen per family with the fidelity benchmark (docs/benchmarks.md)
    exact_radius: ClassVar[int | tuple[int, ...] | None] = 1
    qk_norm: ClassVar[str] = "per_head"  # how the host's processor applies norm_q/norm_k, if it has them
    clip_fp16: ClassVar[bool] = False
    # rotary(*rotary_emb) → the layer's `rotary` callable, for hosts whose attention takes `rotary_emb`
    rotary: ClassVar[Callable | None] = None
    pipeline_class: ClassVar[str]  # the diffusers pipeline around the transformer
    flow_shift: ClassVar[float | None] = None  # flow matching with this scheduler shift; None: ε-prediction
    video: ClassVar[bool] = False  # latents (C, F, H, W) rather than (C, H, W)
    max_prompt_length: ClassVar[int] = 300  # the pipeline's longest prompt, in tokens

    @property
    def model_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.model_classes[0])

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [block.attn1 for block in getattr(model, self.blocks_attr)]

    def default_blocks(self, model: nn.Module) -> tuple[int, ...]:
        return self.native_blocks

    def default_options(self, model: nn.Module) -> dict[str, Any]:
        return {} if self.exact_radius is None else {"exact_radius": self.exact_radius}

    def patch_size(self, model: nn.Module) -> tuple[int, ...]:
        p = model.config.patch_size
        return tuple(p) if isinstance(p, (tuple, list)) else (p, p)

    def native_grid(self, model: nn.Module) -> tuple[int, ...] | None:
        size = model.config.sample_size
        return tuple(size // p for p in self.patch_size(model))

    def token_grid(self, model: nn.Module) -> TokenGrid:
        """The forward pre-hook that records the model's token grid (`TokenGrid`)."""
        return TokenGrid(self.patch_size(model))

    def prepare(self, model: nn.Module) -> None:
        if getattr(model, GRID_ATTR, None) is None:
            grid = self.token_grid(model)
            model.register_forward_pre_hook(grid, with_kwargs=True)
            setattr(model, GRID_ATTR, grid)

    def check_host(self, host: nn.Module, where: str) -> None:
        """Refuse attention features the MHLA layer would silently drop."""
        unsupported = {
            "cross-attention": getattr(host, "is_cross_attention", False)
            or getattr(host, "only_cross_attention", False),
            "added key/value projections": getattr(host, "add_k_proj", None) is not None,
            "a group norm": getattr(host, "group_norm", None) is not None,
            "a spatial norm": getattr(host, "spatial_norm", None) is not None,
            "a residual connection": getattr(host, "residual_connection", False),
            "output rescaling": getattr(host, "rescale_output_factor", 1.0) != 1.0,
        }
        found = [name for name, present in unsupported.items() if present]
        if found:
            raise UnsupportedModelError(f"{where} uses {', '.join(found)}, which an MHLA layer does not reproduce")

    def check_layers(self, model: nn.Module, indices: list[int], config: MHLAConfig) -> None:
        """Every chosen host attention passes `check_host` before any layer changes, so a refusal leaves the whole
        model as it was (`convert_layer` checks its own host again when called alone)."""
        hosts = self.attention_modules(model)
        names = {id(module): name for name, module in model.named_modules()}
        for i in indices:
            self.check_host(hosts[i], names[id(hosts[i])])

    def convert_layer(self, model: nn.Module, index: int, config: MHLAConfig) -> nn.Module:
        block = getattr(model, self.blocks_attr)[index]
        self.check_host(block.attn1, f"{self.blocks_attr}.{index}.attn1")
        layer = DiffusersMHLA.from_host(block.attn1, config, qk_norm=self.qk_norm, clip_fp16=self.clip_fp16,
                                        rotary=self.rotary)
        self.prepare(model)
        layer.token_grid = getattr(model, GRID_ATTR)
        block.attn1 = layer
        return layer

    def example_inputs(
        self, model: nn.Module, grid: tuple[int, ...] | None = None, batch_size: int = 1
    ) -> dict[str, Any]:
        """Latents for `grid` (default: the model's native grid) and a timestep; families add their conditioning."""
        grid = grid or self.native_grid(model)
        sizes = [g * p for g, p in zip(grid, self.patch_size(model))]
        latents = torch.randn(batch_size, model.config.in_channels, *sizes, device=model.device, dtype=model.dtype)
        return {"hidden_states": latents, "timestep": torch.randint(0, 1000, (batch_size,), device=model.device)}

    def _text(self, model: nn.Module, batch_size: int, length: int, width: int) -> torch.Tensor:
        # model.dtype skips the keep-in-fp32 modules (Wan's modulation table comes first)
        return torch.randn(batch_size, length, width, device=model.device, dtype=model.dtype)

    def build(self, config: dict[str, Any]) -> nn.Module:
        return self.model_class.from_config(config)

    def load_pretrained(self, path_or_id: str, **kwargs) -> nn.Module:
        return self.model_class.from_pretrained(path_or_id, **kwargs)

    def load_single_file(self, path: str, *, config: str, **kwargs) -> nn.Module:
        """diffusers' `from_single_file` (original-format weights are converted by diffusers itself)."""
        if not hasattr(self.model_class, "from_single_file"):
            return super().load_single_file(path, config=config, **kwargs)
        if "revision" in kwargs:  # the revision is the config's: the weights are a local file
            kwargs["config_revision"] = kwargs.pop("revision")
        return self.model_class.from_single_file(path, config=config, **kwargs)

    def model_config(self, model: nn.Module) -> dict[str, Any]:
        return json.loads(model.to_json_string())

    # --- reloading through diffusers (diffusers_models.py) ----------------------------------
    def mark_converted(self, model: nn.Module) -> None:
        from ..diffusers_models import converted_class

        model.__class__ = converted_class(type(model))

    def base_config(self, config: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in config.items() if k != "mhla"}
        out["_class_name"] = out["_class_name"].removeprefix(CONVERTED_PREFIX)
        return out

    # --- training --------------------------------------------------------------------------
    def denoise(self, model: nn.Module, noisy: torch.Tensor, timestep: torch.Tensor, batch: dict) -> torch.Tensor:
        """The transformer's prediction for noisy latents at `timestep`, conditioned on `batch`."""
        raise self._missing("denoise")

    def objective(self, spec):
        from ..train.objectives import EpsPrediction, FlowMatching

        if self.flow_shift is None:
            return EpsPrediction(self.denoise, spec)
        return FlowMatching(self.denoise, spec, spec.flow_shift or self.flow_shift)

    def latent_channels(self, model: nn.Module) -> int:
        """Channels of the VAE latents the transformer denoises."""
        return model.config.in_channels

    def text_width(self, model: nn.Module) -> int | None:
        """Width of the text embeddings the transformer takes; None for a model without text."""
        return model.config.caption_channels

    def _latent_shape(self, model: nn.Module, spec) -> tuple[int, ...]:
        size = model.config.get("sample_size") or 8  # Wan's config has none
        hw = tuple(spec.latent_size) if spec.latent_size else (size, size)
        return (spec.latent_frames, *hw) if self.video else hw

    def synthetic_data(self, model: nn.Module, spec, seed: int) -> dict[str, torch.Tensor]:
        """Smooth latents that depend on one of 8 conditions (so conditioning is learnable), plus the
        conditions themselves (`synthetic_conditions`)."""
        g = torch.Generator().manual_seed(seed)
        n = spec.num_samples
        shape = (self.latent_channels(model), *self._latent_shape(model, spec))
        num_conditions = 8
        cond = torch.randint(0, num_conditions, (n,), generator=g)
        low = torch.randn(num_conditions, shape[0], *(max(1, s // 4) for s in shape[1:]), generator=g)
        mode = "trilinear" if self.video else "bilinear"
        patterns = torch.nn.functional.interpolate(low, size=shape[1:], mode=mode, align_corners=False)
        latents = patterns[cond] + 0.1 * torch.randn(n, *shape, generator=g)
        return {"latents": latents, **self.synthetic_conditions(model, latents, cond, num_conditions, g)}

    def synthetic_conditions(self, model: nn.Module, latents: torch.Tensor, cond: torch.Tensor, num_conditions: int,
                             generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The condition columns of synthetic data: one random 8-token prompt embedding per condition."""
        tokens = 8
        table = torch.randn(num_conditions, tokens, self.text_width(model), generator=generator)
        return {"prompt_embeds": table[cond], "prompt_attention_mask": torch.ones(len(cond), tokens, dtype=torch.long)}

    # --- pipeline components ---------------------------------------------------------------
    def pipeline_name(self, transformer: nn.Module) -> str:
        return self.pipeline_class

    def tiny_components(self, transformer: nn.Module) -> dict[str, Any]:
        from ..train.components import char_tokenizer

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            parts = {"vae": self.tiny_vae(self.latent_channels(transformer)).eval(), "scheduler": self.tiny_scheduler()}
            width = self.text_width(transformer)
            if width is not None:
                parts.update(text_encoder=self.tiny_text_encoder(width).eval(), tokenizer=char_tokenizer())
            parts.update(self.tiny_extra_components(transformer))
        return parts

    def tiny_vae(self, latent_channels: int) -> nn.Module:
        from diffusers import AutoencoderKL

        return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 8),
                             down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             norm_num_groups=4, layers_per_block=1)

    def tiny_text_encoder(self, width: int) -> nn.Module:
        from transformers import T5EncoderModel

        return T5EncoderModel(tiny_t5_config(width))

    def tiny_scheduler(self):
        from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

        return DDIMScheduler() if self.flow_shift is None else FlowMatchEulerDiscreteScheduler(shift=self.flow_shift)

    def tiny_extra_components(self, transformer: nn.Module) -> dict[str, Any]:
        """Further tiny parts some variants need (built after the others, under the same seed)."""
        return {}

    def tiny_pipelines(self) -> dict[str, dict[str, Any]]:
        """Built-in tiny pipelines of two experts (`experts.tiny_pipeline`): name -> {"experts": the tiny model each
        expert is, of its own seed; "boundary_ratio": where denoising passes from the first to the second}."""
        return {}

    # --- encoding image / video folders ----------------------------------------------------
    def encode_latents(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        pixels = pixels.to(vae.device, vae.dtype)
        return vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor

    def encode_text(self, pipe, captions: list[str], max_length: int) -> dict[str, torch.Tensor]:
        """The pipeline's own `encode_prompt` of `captions` (embeddings and attention mask)."""
        embeds, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False,
                                                max_sequence_length=max_length, device=pipe.device)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    def prompt_length(self, transformer: nn.Module, spec) -> int:
        return min(spec.max_text_length, self.max_prompt_length)

    def encode_conditions(self, pipe, transformer, rows, pixels, latents, spec) -> dict[str, torch.Tensor]:
        from ..train.errors import TrainError

        if any(spec.caption_column not in r for r in rows):
            raise TrainError(f"every metadata.jsonl line needs a caption under \"{spec.caption_column}\" "
                             "(or set data.caption_column)")
        captions = [str(r[spec.caption_column]) for r in rows]
        return self.encode_text(pipe, captions, self.prompt_length(transformer, spec))

    # --- sampling --------------------------------------------------------------------------
    def num_classes(self, model: nn.Module) -> int | None:
        """The classes of a class-conditional model (sampled from a class label rather than a
        prompt); None for a text-conditional one."""
        return None

    def sampling_pipeline(self, model: nn.Module, base: str | None, *, device) -> Any:
        """The family's pipeline around `model` on `device`, its progress bar off."""
        from ..train.components import pipeline

        pipe = pipeline(self.name, model, base).to(device)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def pipeline_inputs(self, pipe, base: str | None, *, prompt: str, class_label: int = 0,
                        guidance_scale: float | None = None, height: int | None = None, width: int | None = None,
                        num_frames: int | None = None, image=None) -> dict[str, Any]:
        """The pipeline call's condition and sizes: text to image; tiny models at their own size (the
        pipelines default to their real resolutions, and want multiples of 32)."""
        from ..train.components import is_tiny

        if is_tiny(base):
            native = -(-pipe.transformer.config.sample_size * pipe.vae_scale_factor // 32) * 32
            height, width = height or native, width or native
        return {"prompt": prompt, "use_resolution_binning": not is_tiny(base),
                **given(height=height, width=width, guidance_scale=guidance_scale)}

    def generate(self, pipe, base: str | None, *, generator: torch.Generator, steps: int = 20,
                 output_type: str = "pil", **inputs):
        """One sample from the family's pipeline `pipe` (`pipeline_inputs` takes `inputs`): an image,
        or for video models its frames, in `output_type` ("pil" or "np": floats in [0, 1])."""
        out = pipe(num_inference_steps=steps, generator=generator, output_type=output_type,
                   **self.pipeline_inputs(pipe, base, **inputs))
        return out.frames[0] if self.video else out.images[0]

    def check_pixel_size(self, pipe, model: nn.Module, sizes: dict[str, int | None]) -> None:
        """Refuse (TrainError) picture sides, {name: pixels}, that the pipeline's VAE and `model`'s patches cannot
        tile: each a multiple of the VAE's spatial factor times the patch size along it."""
        from ..train.errors import TrainError

        vae = (getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None)
               or 2 ** (len(pipe.vae.config.block_out_channels) - 1))  # DiTPipeline keeps no factor
        patches = self.patch_size(model)[-2:]
        for (name, pixels), patch in zip(sizes.items(), patches):
            factor = vae * patch
            if pixels is not None and pixels % factor:
                raise TrainError(f"{name} {pixels} must be a multiple of {factor} (the VAE's factor {vae} × the patch "
                                 f"size {patch}): e.g. {max(factor, pixels // factor * factor)}")

    def sample(self, model, base, prompt, *, device, seed=0, steps=20, max_new_tokens=32, **inputs):
        """An image (PIL), or a video's (F, H, W, 3) frames in [0, 1]."""
        pipe = self.sampling_pipeline(model, base, device=device)
        self.check_pixel_size(pipe, model, {"--height": inputs.get("height"), "--width": inputs.get("width")})
        generator = torch.Generator(device).manual_seed(seed)
        return self.generate(pipe, base, generator=generator, steps=steps, output_type="np" if self.video else "pil",
                             prompt=prompt, **inputs)


def given(**options) -> dict[str, Any]:
    """The options that are set (not None): what a pipeline call passes on, leaving it its defaults."""
    return {k: v for k, v in options.items() if v is not None}


def tiny_t5_config(width: int):
    """A one-layer T5 encoder config over the 98-character tokenizer (`char_tokenizer`)."""
    from transformers import T5Config

    return T5Config(vocab_size=TINY_VOCAB, d_model=width, d_kv=8, d_ff=2 * width, num_layers=1, num_heads=2,
                    pad_token_id=0)
