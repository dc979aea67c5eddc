"""The rest of a family's pipeline around a (converted) transformer: VAE, text encoder,
tokenizer, scheduler (and for Wan image-to-video the CLIP image encoder and processor). From the
base model's hub id / directory for real models; for the built-in tiny models, the family's tiny
random components (`FamilyAdapter.tiny_components`) built in-process (no downloads), seeded so that
encoding and sampling see the same ones."""

from __future__ import annotations

import string

from torch import nn

from .errors import TrainError


def is_tiny(base: str | None) -> bool:
    return bool(base) and base.startswith("tiny-")


def char_tokenizer():
    """A character-level tokenizer built in-process: [PAD]=0, [UNK]=1, </s>=2, then printable ASCII."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(string.printable[:95])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="</s>")


def pipeline(family: str, transformer: nn.Module, base: str | None, *, torch_dtype=None):
    """The family's diffusers pipeline around `transformer` (`FamilyAdapter.pipeline_name`); the
    other parts from `base`, or the family's `tiny_components` for built-in tiny models."""
    import diffusers

    from ..families import adapter_for_family

    adapter = adapter_for_family(family)
    name = adapter.pipeline_name(transformer)
    cls = getattr(diffusers, name)
    if is_tiny(base):
        return cls(transformer=transformer, **adapter.tiny_components(transformer))
    if not base:
        raise TrainError(
            "this checkpoint records no base model, so its VAE and text encoder are unknown: "
            "set data.components (or pass a pipeline directory)"
        )
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
