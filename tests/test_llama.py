"""The Llama-style LM family: Llama, Qwen2 (q/k/v bias), Qwen3 (per-head q/k norm), Qwen3-MoE (Qwen3's attention,
experts untouched), Mistral (sliding window) — tiny random models, no downloads."""

import copy

import pytest
import torch
from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM
from transformers.cache_utils import DynamicCache

from mhla_convert.convert import convert
from mhla_convert.families import adapter_for_config, adapter_for_family, adapter_for_model, families
from mhla_convert.families.llama import MHLALlamaAttention
from mhla_convert.families.lm_cache import MHLACacheLayer, MHLAStaticLayer
from mhla_convert.layer import MHLAConfig
from mhla_convert.mixing import toeplitz_causal_mixing
from mhla_convert.ops import DecodeState, mhla_attention_reference
from mhla_convert.ops.rotary import HalfSplitRotary
from mhla_convert.registration import CAUSAL_LMS

ADAPTER = adapter_for_family("llama")
FAMILIES = [name.removeprefix("tiny-") for name in ADAPTER.tiny_configs()]
C = 8  # chunk size in the tiny tests: a 40-token prompt spans 5 chunks


def tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return ADAPTER.build(ADAPTER.tiny_configs()[f"tiny-{family}"]).eval()


def ids(batch=2, length=40, seed=1):
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, prompt, new=20, **kw):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_move_in_and_shapes_stay(family):
    model = tiny(family)
    hosts = [layer.self_attn for layer in model.model.layers]
    x = ids()
    logits = model(x).logits
    before = sum(p.numel() for p in model.parameters())
    report = convert(model, ratio=1.0, chunk_size=C)
    for host, layer in zip(hosts, model.model.layers):
        new = layer.self_attn
        assert isinstance(new, MHLALlamaAttention) and new.layer_idx == host.layer_idx
        assert (new.to_q, new.to_k, new.to_v, new.to_out) == (host.q_proj, host.k_proj, host.v_proj, host.o_proj)
        assert (new.to_q.bias is not None) == (family == "qwen2")
        if family.startswith("qwen3"):
            assert (new.norm_q, new.norm_k) == (host.q_norm, host.k_norm)
        assert not any(p.is_meta for p in new.parameters())
    assert sum(p.numel() for p in model.parameters()) == before + report.params_added == before + 4 * 8
    assert model(x).logits.shape == logits.shape


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_equals_explicit_reference_and_host_projection(family):
    model = tiny(family)
    teacher = copy.deepcopy(model.model.layers[1].self_attn)
    convert(model, layers=[1], chunk_size=C)
    attn = model.model.layers[1].self_attn
    x = torch.randn(2, 37, 64)
    pos = torch.arange(37)[None].expand(2, -1)
    cos, sin = model.model.rotary_emb(x, pos)
    kwargs = dict(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos,
                  past_key_values=None, use_cache=False)
    out, weights = attn(**kwargs)
    t_out, _ = teacher(**kwargs)  # the teacher takes the same call
    assert weights is None and out.shape == t_out.shape

    q, k, v = attn.project(x, lambda q, k: HalfSplitRotary(cos, sin)(q, k))
    ref = attn.output(mhla_attention_reference(
        q, k, v, toeplitz_causal_mixing(attn.mixing, -(-37 // C)), causal=True, chunk_size=C,
        exact_chunks=attn.config.exact_chunks))
    assert attn.config.exact_chunks == 2  # the LM default: the nearest chunks read exactly
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)

    # q and k are the host's, after its own RoPE (its (B, H, N, D) layout)
    host_rope = __import__(type(teacher).__module__, fromlist=["x"]).apply_rotary_pos_emb
    hq = teacher.q_proj(x).view(2, 37, -1, teacher.head_dim)
    hk = teacher.k_proj(x).view(2, 37, -1, teacher.head_dim)
    if family.startswith("qwen3"):
        hq, hk = teacher.q_norm(hq), teacher.k_norm(hk)
    hq, hk = host_rope(hq.transpose(1, 2), hk.transpose(1, 2), cos, sin)
    torch.testing.assert_close(q, hq.transpose(1, 2))
    torch.testing.assert_close(k, hk.transpose(1, 2))


@pytest.mark.parametrize("ratio, expected", [(0.0, []), (0.5, [1, 3]), (1.0, [0, 1, 2, 3])])
def test_ratios(ratio, expected):
    model = tiny("llama")
    x = ids()
    logits = model(x).logits
    report = convert(model, ratio=ratio, chunk_size=C)
    assert report.converted == expected
    assert [isinstance(layer.self_attn, MHLALlamaAttention) for layer in model.model.layers] == [
        i in expected for i in range(4)
    ]
    if not expected:
        assert torch.equal(model(x).logits, logits)


def test_explicit_layers():
    model = tiny("qwen3")
    assert convert(model, layers=[0, 2], chunk_size=C).converted == [0, 2]
    assert model(ids()).logits.shape == (2, 40, 128)


@pytest.mark.parametrize(
    "family, ratio",
    [("llama", 1.0), ("llama", 0.5), ("qwen2", 0.5), ("qwen3", 1.0), ("qwen3-moe", 0.5), ("mistral", 0.5)],
)
def test_generate_with_cache_equals_without(family, ratio):
    model = tiny(family)
    convert(model, ratio=ratio, chunk_size=C)
    prompt = ids()
    cached = greedy(model, prompt, return_dict_in_generate=True)
    assert torch.equal(cached.sequences, greedy(model, prompt, use_cache=False))
    cache = cached.past_key_values
    converted = [isinstance(layer.self_attn, MHLALlamaAttention) for layer in model.model.layers]
    assert [isinstance(slot, MHLACacheLayer) for slot in cache.layers] == converted
    assert cache.get_seq_length() == 59 and all(slot.get_seq_length() == 59 for slot in cache.layers)


def test_beam_search_reorders_the_state():
    model = tiny("llama")
    convert(model, ratio=0.5, chunk_size=C)
    prompt = ids()
    beams = greedy(model, prompt, new=12, num_beams=3)
    assert torch.equal(beams, greedy(model, prompt, new=12, num_beams=3, use_cache=False))


def test_far_longer_than_the_window_and_cached_steps_match_parallel():
    """80 chunks = 10x the window: the relative mixing covers any length, and decoding token by
    token from a prefill gives the parallel form's logits."""
    model = tiny("llama")
    convert(model, ratio=1.0, chunk_size=C, window=8)
    x = ids(batch=1, length=80 * C)
    full = model(x).logits
    assert torch.isfinite(full).all()
    cache = DynamicCache(config=model.config)
    steps = [model(x[:, :600], past_key_values=cache, use_cache=True).logits]
    for t in range(600, x.shape[1]):
        steps.append(model(x[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == x.shape[1]


def test_bf16_model_runs_and_generates():
    model = tiny("qwen3")
    convert(model, ratio=0.5, chunk_size=C)
    model.to(torch.bfloat16)
    prompt = ids()
    logits = model(prompt).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert greedy(model, prompt, new=5).shape == (2, 45)


def test_left_padding_adds_nothing():
    """A row left-padded by whole chunks gives its real tokens the same logits as unpadded."""
    model = tiny("llama")
    convert(model, ratio=1.0, chunk_size=C)
    x = ids(batch=1, length=24)
    alone = model(x).logits
    padded = torch.cat([torch.full((1, 2 * C), 7), x], 1)  # not the pad id: its embedding is not zero
    batch = torch.cat([padded, ids(batch=1, length=40, seed=2)])
    mask = torch.ones_like(batch)
    mask[0, : 2 * C] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model(batch, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(out[0, 2 * C :], alone[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[1], model(batch[1:]).logits[0], atol=1e-5, rtol=1e-4)


def test_cache_refuses_what_a_state_cannot_do():
    model = tiny("llama")
    convert(model, layers=[0], chunk_size=C)
    cache = DynamicCache(config=model.config)
    model(ids(), past_key_values=cache, use_cache=True)
    slot = cache.layers[0]
    assert isinstance(slot, MHLACacheLayer) and cache.is_croppable
    with pytest.raises(RuntimeError, match="recurrent state"):
        cache.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16), 0)
    with pytest.raises(ValueError, match="at most"):  # 40 tokens = 5 closed chunks; 3 chunks back is too far
        cache.crop(-3 * C)
    cache.reset()
    assert cache.get_seq_length() == 0


def test_state_size_formula():
    """A decoding state's summaries are W·B·H_kv·D·(D_v + 1) float32 values, whatever the length: the open chunk,
    W − 2 recent chunks and one running sum of older ones (ops/recurrent.py's docstring)."""
    k, v = torch.randn(2, 300, 8, 16), torch.randn(2, 300, 8, 16)
    state = DecodeState.from_prompt(k, v, torch.full((2,), 300), MHLAConfig(causal=True, chunk_size=C, window=8))
    summaries = (state.cur_s, state.cur_z, state.recent_s, state.recent_z, state.far_s, state.far_z)
    assert sum(t.nbytes for t in summaries) == 8 * 2 * 8 * 16 * 17 * 4


def test_adapter_builds_and_detects():
    expected = {
        "llama": LlamaForCausalLM,
        "qwen2": Qwen2ForCausalLM,
        "qwen3": Qwen3ForCausalLM,
        "qwen3-moe": Qwen3MoeForCausalLM,
        "mistral": MistralForCausalLM,
    }
    assert ADAPTER.tiny_config() == ADAPTER.tiny_configs()["tiny-llama"]
    for family in FAMILIES:
        model = tiny(family)
        assert type(model) is expected[family] and model.config.num_key_value_heads == 2
        config = adapter_for_model(model).model_config(model)
        assert isinstance(adapter_for_config(config), type(ADAPTER))
        rebuilt = ADAPTER.build(config)
        assert type(rebuilt) is type(model) and ADAPTER.model_config(rebuilt) == config
    assert ADAPTER.aliases["llama-3.2-1b"] == "meta-llama/Llama-3.2-1B"
    assert ADAPTER.default_options(model)["chunk_size"] == 64


def test_generate_left_padded_batch():
    model = tiny("qwen2")
    convert(model, ratio=0.5, chunk_size=C)
    prompt = ids()
    mask = torch.ones_like(prompt)
    mask[0, :13] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, **kw), model.generate(prompt, use_cache=False, **kw))


def test_trains_mixing_and_host_weights():
    model = tiny("qwen3").train()
    convert(model, ratio=0.5, chunk_size=C)
    x = ids()
    model(x, labels=x).loss.backward()
    attn = model.model.layers[1].self_attn
    assert attn.mixing.grad is not None and attn.to_q.weight.grad is not None and attn.norm_q.weight.grad is not None


def test_qwen3_moe_converts_attention_only_and_decodes_on_a_static_cache():
    """Experts and router stay the same modules with the same weights; static-cache decoding equals dynamic."""
    model = tiny("qwen3-moe")
    mlps = [layer.mlp for layer in model.model.layers]
    weights = {name: p.clone() for name, p in model.named_parameters() if ".mlp." in name}
    assert type(mlps[0]).__name__ == "Qwen3MoeSparseMoeBlock" and type(mlps[3]).__name__ == "Qwen3MoeMLP"
    convert(model, ratio=1.0, chunk_size=C)
    assert [layer.mlp for layer in model.model.layers] == mlps
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters() if ".mlp." in name)
    prompt = ids()
    kw = dict(return_dict_in_generate=True, output_logits=True, min_new_tokens=20)
    dynamic, static = greedy(model, prompt, **kw), greedy(model, prompt, cache_implementation="static", **kw)
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=1e-5, rtol=1e-4)
    assert all(isinstance(slot, MHLAStaticLayer) for slot in static.past_key_values.layers)


def test_transformers_families_are_the_registered_converted_lms():
    """Every class a transformers family converts has converted classes for the Auto loaders, and no other."""
    converted = {name for cls in families().values() if cls.library == "transformers" for name in cls.model_classes}
    assert converted == set(CAUSAL_LMS)
