"""The rest of a family's pipeline around a (converted) transformer: VAE, text encoder,
tokenizer, scheduler (and for Wan image-to-video the CLIP image encoder and processor). From the
base model's hub id / directory for real models; for the built-in tiny models, tiny random
components built in-process (no downloads), seeded so that encoding and sampling see the same ones."""

from __future__ import annotations

import string

import torch
from torch import nn

from .errors import TrainError

PIPELINES = {"sana": "SanaPipeline", "wan": "WanPipeline", "dit": "DiTPipeline", "pixart": "PixArtAlphaPipeline"}
MAX_TEXT = {"sana": 300, "pixart": 120, "wan": 512}


def is_tiny(base: str | None) -> bool:
    return bool(base) and base.startswith("tiny-")


def is_i2v(model) -> bool:
    """A Wan transformer that also takes image-condition channels (in_channels = 2·z + mask)."""
    cfg = model.config
    return cfg.in_channels > cfg.out_channels


def pipeline_name(family: str, transformer: nn.Module) -> str:
    """The diffusers pipeline that feeds `transformer` as it was trained (I2V Wan: the image one)."""
    return "WanImageToVideoPipeline" if family == "wan" and is_i2v(transformer) else PIPELINES[family]


def char_tokenizer():
    """A character-level tokenizer built in-process: [PAD]=0, [UNK]=1, </s>=2, then printable ASCII."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(string.printable[:95])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="</s>")


def _tiny_text_encoder(family: str, width: int) -> nn.Module:
    vocab = 98
    if family == "sana":
        from transformers import Gemma2Config, Gemma2Model

        return Gemma2Model(Gemma2Config(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=0))
    from transformers import T5Config, T5EncoderModel, UMT5EncoderModel

    config = T5Config(vocab_size=vocab, d_model=width, d_kv=8, d_ff=2 * width, num_layers=1, num_heads=2, pad_token_id=0)
    return (UMT5EncoderModel if family == "wan" else T5EncoderModel)(config)


def _tiny_vae(family: str, latent_channels: int) -> nn.Module:
    from diffusers import AutoencoderDC, AutoencoderKL, AutoencoderKLWan

    if family == "wan":  # 8× spatial, 4× temporal (4k+1 frames)
        return AutoencoderKLWan(base_dim=8, z_dim=latent_channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                temperal_downsample=[False, True, True], latents_mean=[0.0] * latent_channels, latents_std=[1.0] * latent_channels)
    if family == "sana":  # 2× (the real DC-AE is 32×)
        return AutoencoderDC(in_channels=3, latent_channels=latent_channels, attention_head_dim=4,
                             encoder_block_types=("ResBlock", "ResBlock"), decoder_block_types=("ResBlock", "ResBlock"),
                             encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8), encoder_layers_per_block=(1, 1),
                             decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), ()), decoder_qkv_multiscales=((), ()),
                             decoder_norm_types="rms_norm", decoder_act_fns="silu", upsample_block_type="interpolate",
                             downsample_block_type="Conv", scaling_factor=0.41)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 8),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         norm_num_groups=4, layers_per_block=1)


def _tiny_image_encoder(width: int) -> dict:
    """A 2-layer CLIP vision tower at 32 px (WanImageToVideoPipeline takes its second-to-last hidden
    states, 17 tokens here) and the processor that resizes images for it."""
    import transformers
    from transformers import CLIPVisionConfig, CLIPVisionModel

    # the PIL processor is what CLIPImageProcessor falls back to (with a warning) without torchvision
    processor_cls = transformers.CLIPImageProcessorPil if hasattr(transformers, "CLIPImageProcessorPil") else transformers.CLIPImageProcessor
    config = CLIPVisionConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8)
    processor = processor_cls(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return {"image_encoder": CLIPVisionModel(config).eval(), "image_processor": processor}


def _scheduler(family: str):
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

    if family in ("sana", "wan"):
        return FlowMatchEulerDiscreteScheduler(shift=3.0)
    return DDIMScheduler()


def tiny_components(family: str, transformer: nn.Module) -> dict:
    """Tiny random VAE / text encoder / tokenizer matching `transformer`'s config (seed 0)."""
    cfg = transformer.config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        latent = cfg.out_channels if family == "wan" else cfg.in_channels  # Wan I2V takes 2·z + 4 channels
        parts = {"vae": _tiny_vae(family, latent).eval(), "scheduler": _scheduler(family)}
        if family != "dit":
            width = cfg.text_dim if family == "wan" else cfg.caption_channels
            parts.update(text_encoder=_tiny_text_encoder(family, width).eval(), tokenizer=char_tokenizer())
        if family == "wan" and is_i2v(transformer):
            parts.update(_tiny_image_encoder(cfg.image_dim))
    return parts


def pipeline(family: str, transformer: nn.Module, base: str | None, *, torch_dtype=None):
    """The family's diffusers pipeline around `transformer`; the other parts from `base`."""
    import diffusers

    name = pipeline_name(family, transformer)
    cls = getattr(diffusers, name)
    if is_tiny(base):
        return cls(transformer=transformer, **tiny_components(family, transformer))
    if not base:
        raise TrainError("this checkpoint records no base model, so its VAE and text encoder are unknown: set data.components (or pass a pipeline directory)")
    try:
        return cls.from_pretrained(base, transformer=transformer, torch_dtype=torch_dtype)
    except OSError as exc:
        raise TrainError(f"cannot load the {name} components from {base!r}: {str(exc).splitlines()[0]}") from None


def tokenizer(base: str | None):
    """An LM's tokenizer: the base model's, or the in-process character tokenizer for tiny models."""
    if is_tiny(base):
        return char_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(base)
    except OSError as exc:
        raise TrainError(f"cannot load a tokenizer from {base!r}: {str(exc).splitlines()[0]}") from None
