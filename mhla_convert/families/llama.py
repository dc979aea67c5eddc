"""Llama-style causal LMs (transformers): Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral.

`model.model.layers[i].self_attn` becomes an `MHLALlamaAttention` that keeps the host's call
signature and return value, so the decoder layer runs unchanged. The host's q/k/v/o projections
(Qwen2: with biases) and Qwen3's per-head q/k RMSNorms move in as they are, under their own names
(so PEFT's default LoRA targets, q_proj and v_proj, find them); only `mixing` is new. Qwen3-MoE's attention
is Qwen3's: its experts and router live in the MLP, which conversion leaves alone.
Decoding keeps a fixed-size recurrent state in the generation cache, dynamic or static (lm_cache.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layer import MHLAConfig, MHLAttention
from ..ops.rotary import HalfSplitRotary
from .base import FamilyAdapter, register


def _real_tokens(attention_mask, n: int) -> torch.Tensor | None:
    """(B, n) bool: which of the current n tokens are not padding; None when unknown or, in an eager
    forward, when all are real.

    The decoder layer gets the mask already expanded: 2-D (B, KV) for flash attention, or 4-D
    (B, 1, n, KV), bool (True = attend) or additive float (0 = attend). A token is real iff it may
    attend to itself. Where its own key column sits depends on the cache layer that sized the mask
    (dynamic, static, sliding window), but it is always the last column its row attends to and it
    moves one column per query row: so the real tokens are the rows whose last attended column is
    the furthest one found, for that row, over the batch. (This needs one real token per call.)

    That search reads the whole (n, KV) mask, so an eager forward does it once, at its first MHLA layer,
    keeps the answer on the mask tensor for the next ones (every layer gets the same mask) and asks the
    device once whether any token is padding: without padding the layers skip packing tokens. A traced
    forward never synchronises: each layer searches (the compiler merges the copies) and packs.
    """
    if not isinstance(attention_mask, torch.Tensor):
        return None
    if attention_mask.dim() == 2:
        return attention_mask[:, -n:].bool()
    if attention_mask.dim() != 4 or attention_mask.shape[-2] != n:
        return None
    eager = not torch.compiler.is_compiling()
    version, known = getattr(attention_mask, "_mhla_real_tokens", (None, None)) if eager else (None, None)
    if version == attention_mask._version:  # (unchanged since)
        return known
    allowed = attention_mask[:, 0]
    allowed = allowed if allowed.dtype == torch.bool else allowed == 0  # (B, n, KV)
    kv = allowed.shape[-1]
    last = torch.where(allowed.any(-1), kv - 1 - allowed.flip(-1).to(torch.uint8).argmax(-1), -1)  # (B, n)
    rows = torch.arange(n, device=last.device)
    own = (last - rows).amax() + rows
    real = (last == own) & (last >= 0)
    if eager:
        real = None if bool(real.all()) else real
        attention_mask._mhla_real_tokens = (attention_mask._version, real)
    return real


class MHLALlamaAttention(MHLAttention):
    """Causal MHLA in place of a Llama-style `self_attn`, called and returning as the host does; its
    projections and norms keep the host's names (q_proj, …, o_proj, q_norm, k_norm)."""

    host_names = {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "o_proj",
                  "norm_q": "q_norm", "norm_k": "k_norm"}

    def __init__(self, host: nn.Module, config: MHLAConfig):
        config = config.for_layer(host.layer_idx)
        head_dim = host.head_dim
        qk_norm = "per_head" if hasattr(host, "q_norm") else None
        with torch.device("meta"):  # every projection is replaced by the host's: don't allocate/init twice
            super().__init__(
                host.q_proj.in_features, host.q_proj.out_features // head_dim, head_dim=head_dim,
                num_kv_heads=host.k_proj.out_features // head_dim, qkv_bias=host.q_proj.bias is not None,
                out_bias=host.o_proj.bias is not None, out_dim=host.o_proj.out_features, qk_norm=qk_norm, config=config,
            )
        self.layer_idx = host.layer_idx
        self.to_q, self.to_k, self.to_v, self.to_out = host.q_proj, host.k_proj, host.v_proj, host.o_proj
        if qk_norm:
            self.norm_q, self.norm_k = host.q_norm, host.k_norm
        weight = host.q_proj.weight
        if config.output_norm:
            self.out_norm = nn.RMSNorm(self.head_dim, eps=1e-6, device=weight.device)
        self.new_parameters(weight.device, weight.dtype)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None,
                **kwargs):
        """Host signature; `position_ids`, `use_cache`, `cache_position` arrive in kwargs and are
        not needed: RoPE comes in `position_embeddings`, the state's position in the cache.
        transformers ≥ 5.24 passes the cache as `cache`, earlier releases as `past_key_values`."""
        past_key_values = cache if cache is not None else past_key_values
        cos, sin = position_embeddings
        q, k, v = self.project(hidden_states, HalfSplitRotary(cos, sin))
        real = _real_tokens(attention_mask, q.shape[1])  # padding: packed behind the real tokens
        if past_key_values is None:
            return self.output(self.attend_real(q, k, v, real)[0]), None
        from .lm_cache import mhla_cache_layer  # (transformers' cache classes: imported as the first cache comes)

        slot = mhla_cache_layer(past_key_values, self.layer_idx)
        if slot.has_state:
            out = slot.decode(q, k, v, real, self.mixing, self.config)
        else:  # the prompt
            out, k, v, lengths = self.attend_real(q, k, v, real)
            slot.prefill(k, v, lengths, self.config, tokens=q.shape[1], feature_map=self.phi)
        return self.output(out), None


HUB = {
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
}


@register
class LlamaAdapter(FamilyAdapter):
    name = "llama"
    library = "transformers"
    model_classes = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                     "MistralForCausalLM")
    aliases = HUB
    causal = True
    sample_kind = "text"
    attention_class: type[MHLALlamaAttention] = MHLALlamaAttention  # what replaces each converted `self_attn`

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [layer.self_attn for layer in model.model.layers]

    def default_blocks(self, model: nn.Module) -> None:
        return None

    def default_options(self, model: nn.Module) -> dict[str, Any]:
        # chunk 64 as the paper's LM; window 8: distinct weights for the last ~450 tokens, one shared
        # weight beyond, and a state of 8 chunk summaries; the nearest 2 chunks read exactly with the
        # softmax kernel, which the fidelity benchmark shows a converted LM needs (docs/language-models.md).
        return {"chunk_size": 64, "window": 8, "exact_chunks": 2, "feature_map": "relu", "normalize": True,
                "mixing_init": "locality"}

    def example_inputs(self, model: nn.Module, grid: tuple[int, ...] | None = None,
                       batch_size: int = 1) -> dict[str, Any]:
        """Random token ids: `grid[0]` tokens (default 64) per sequence."""
        length = grid[0] if grid else 64
        return {"input_ids": torch.randint(0, model.config.vocab_size, (batch_size, length), device=model.device)}

    def convert_layer(self, model: nn.Module, index: int, config: MHLAConfig) -> nn.Module:
        layer = model.model.layers[index]
        layer.self_attn = self.attention_class(layer.self_attn, config)
        return layer.self_attn

    def tiny_config(self) -> dict[str, Any]:
        return self.tiny_configs()["tiny-llama"]

    def tiny_configs(self) -> dict[str, dict[str, Any]]:
        """One tiny model per class, each exercising what sets it apart: GQA everywhere, Qwen2's
        q/k/v biases, Qwen3's q/k norms with head_dim ≠ hidden / heads, Qwen3-MoE's experts (and one dense
        layer), Mistral's sliding window."""
        from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

        common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)
        configs = {
            "tiny-llama": LlamaConfig(**common, architectures=["LlamaForCausalLM"]),
            "tiny-qwen2": Qwen2Config(**common, architectures=["Qwen2ForCausalLM"]),
            "tiny-qwen3": Qwen3Config(**common, head_dim=24, architectures=["Qwen3ForCausalLM"]),
            "tiny-qwen3-moe": Qwen3MoeConfig(**common, head_dim=24, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, mlp_only_layers=[3],
                                             architectures=["Qwen3MoeForCausalLM"]),
            "tiny-mistral": MistralConfig(**common, sliding_window=16, architectures=["MistralForCausalLM"]),
        }
        return {name: config.to_dict() for name, config in configs.items()}

    def build(self, config: dict[str, Any]) -> nn.Module:
        from transformers import AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        hf_config = CONFIG_MAPPING[config["model_type"]].from_dict(config)
        return AutoModelForCausalLM.from_config(hf_config)

    def load_pretrained(self, path_or_id: str, **kwargs) -> nn.Module:
        from transformers import AutoModelForCausalLM

        if "torch_dtype" in kwargs:  # the adapters' common name; transformers 5 calls it `dtype`
            kwargs["dtype"] = kwargs.pop("torch_dtype")
        return AutoModelForCausalLM.from_pretrained(path_or_id, **kwargs)

    def model_config(self, model: nn.Module) -> dict[str, Any]:
        # `architectures` is what adapter_for_config detects the family from; a model built from a
        # config (not from_pretrained) lacks it.
        return {**model.config.to_dict(), "architectures": [type(model).__name__]}

    # --- reloading through transformers (transformers_models.py) --------------------------
    def mark_converted(self, model: nn.Module) -> None:
        from ..transformers_models import mark_converted

        mark_converted(model)

    def base_config(self, config: dict[str, Any]) -> dict[str, Any]:
        from ..transformers_models import base_config

        return base_config(config)

    def loader_files(self) -> dict[str, str]:
        from ..transformers_models import loader_files

        return loader_files()

    # --- training and sampling -------------------------------------------------------------
    def objective(self, spec):
        from ..train.objectives import NextToken

        return NextToken()

    def synthetic_data(self, model: nn.Module, spec, seed: int) -> dict[str, torch.Tensor]:
        """Token sequences following arithmetic patterns: start + step · position (mod vocab)."""
        g = torch.Generator().manual_seed(seed)
        n, vocab, length = spec.num_samples, model.config.vocab_size, spec.context_length
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        return {"input_ids": (start + step * torch.arange(length)) % vocab}

    def sample(self, model, base, prompt, *, device, max_new_tokens=32, **options) -> str:
        """Greedy `generate` from the prompt with the base model's tokenizer."""
        from ..train.components import tokenizer

        tok = tokenizer(base)
        ids = tok(prompt, return_tensors="pt").to(device)
        generated = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        return tok.decode(generated[0], skip_special_tokens=True)
