"""Gemma 3, text only (`Gemma3ForCausalLM`): sliding-window and global layers (`config.layer_types`).

A converted layer is the Llama-style one (llama.py) with what sets Gemma 3 apart:

- **RoPE per layer type.** The decoder layer hands each attention the cos/sin of its own type (local or global
  rope theta), which the layer applies as every Llama-style host does; nothing to choose here.
- **q/k norms.** `Gemma3RMSNorm` (weight stored as w − 1) moves in as Qwen3's norms do and runs as the host's.
- **Score scale.** The host scales q·k by `query_pre_attn_scalar ** -0.5`, not head_dim ** -0.5; the layer
  multiplies q by √head_dim / √query_pre_attn_scalar after its norm and RoPE, so the exact window reads the host's
  logits and the linear summaries the same scale (ReLU is positively homogeneous). 1 for Gemma 3 1B: no op.
- **Sliding windows.** A sliding layer sees its last `sliding_window` tokens. Converted, it must not read further
  back exactly: its exact chunks span at most `exact_chunks · chunk_size` tokens, which must be ≤ the window
  (checked before anything changes). Older tokens enter through the summaries, starting from the far weight
  (docs/language-models.md, "Gemma 3").

Bidirectional attention (`use_bidirectional_attention`) and attention logit softcapping are refused: the converted
layer is causal and caps no scores.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..layer import MHLAConfig
from .base import FamilyAdapter, register
from .llama import LlamaAdapter, MHLALlamaAttention


def check_host(host: nn.Module, config: MHLAConfig) -> None:
    """Refuse a Gemma 3 attention that a converted layer with `config` would not reproduce (ValueError)."""
    where = f"Gemma 3 layer {host.layer_idx}"
    if not getattr(host, "is_causal", True):
        raise ValueError(f"{where} attends bidirectionally (use_bidirectional_attention); converted layers are "
                         "causal: convert a causal Gemma 3")
    if getattr(host, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"{where} caps its attention scores (attn_logit_softcapping="
                         f"{host.attn_logit_softcapping}), which MHLA does not: set it to null in the config")
    window, span = getattr(host, "sliding_window", None), config.exact_chunks * config.chunk_size
    if window is not None and span > window:
        raise ValueError(
            f"{where} is a sliding-window layer of {window} tokens, and exact_chunks · chunk_size = "
            f"{config.exact_chunks} · {config.chunk_size} = {span} would read further back exactly: "
            f"keep exact_chunks · chunk_size ≤ {window} (e.g. chunk_size={window // config.exact_chunks})")


class MHLAGemma3Attention(MHLALlamaAttention):
    """Causal MHLA in place of a `Gemma3Attention` (module doc): the host's projections, q/k norms and RoPE, its
    score scale, and for a sliding layer an exact span within its window."""

    def __init__(self, host: nn.Module, config: MHLAConfig):
        check_host(host, config)
        super().__init__(host, config)
        self.layer_type, self.sliding_window = host.layer_type, host.sliding_window
        self.query_scale = host.scaling * host.head_dim**0.5  # the host's q·k scale over the operator's 1/√D

    def project(self, x, rotary=None):
        q, k, v = super().project(x, rotary)
        return (q if self.query_scale == 1 else q * self.query_scale), k, v

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return f"{super().extra_repr()}, {self.layer_type}{window}"


@register
class Gemma3Adapter(LlamaAdapter):
    """Gemma 3's text model: the Llama-style adapter with its own attention class, the host checks before any
    layer changes, its aliases and tiny model."""

    name = "gemma3"
    model_classes = ("Gemma3ForCausalLM",)
    aliases = {"gemma-3-270m": "google/gemma-3-270m", "gemma-3-1b": "google/gemma-3-1b-pt"}
    attention_class = MHLAGemma3Attention
    tiny_configs = FamilyAdapter.tiny_configs  # tiny-gemma3

    def check_layers(self, model: nn.Module, indices: list[int], config: MHLAConfig) -> None:
        for i in indices:
            check_host(model.model.layers[i].self_attn, config)

    def tiny_config(self) -> dict[str, Any]:
        """Both layer types, each with its own RoPE theta; head_dim ≠ hidden / heads and query_pre_attn_scalar ≠
        head_dim, so the score scale matters; a window of 128 tokens, the LM default's exact span (2 · 64)."""
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=32, max_position_embeddings=4096,
            pad_token_id=0, sliding_window=128,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
            architectures=["Gemma3ForCausalLM"],
        ).to_dict()
