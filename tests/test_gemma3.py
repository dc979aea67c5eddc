"""Gemma 3 (text): sliding-window and global layers, each convertible alone; the host's score scale, q/k norms
and per-type RoPE; a sliding layer's exact span within its window; decoding and reloading — tiny random models."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM
from transformers.cache_utils import StaticCache
from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

import mhla_convert
from mhla_convert.convert import convert
from mhla_convert.families import adapter_for_family, adapter_for_model
from mhla_convert.families.gemma3 import MHLAGemma3Attention
from mhla_convert.families.lm_cache import MHLAStaticLayer, MHLAStaticSlidingLayer
from mhla_convert.mixing import toeplitz_causal_mixing
from mhla_convert.ops import mhla_attention_reference
from mhla_convert.ops.rotary import HalfSplitRotary
from mhla_convert.plan import layers_of_type

ADAPTER = adapter_for_family("gemma3")
C = 8  # chunk size: a 40-token prompt spans 5 chunks
SLIDING, FULL = "sliding_attention", "full_attention"


def tiny(**changes) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    return ADAPTER.build({**ADAPTER.tiny_config(), **changes}).eval()


def ids(batch=2, length=40, seed=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(model, prompt, new=20, **kw):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, return_dict_in_generate=True, output_logits=True, **kw)


def test_tiny_model_has_both_kinds_and_the_family():
    model = tiny()
    assert type(model) is Gemma3ForCausalLM and type(adapter_for_model(model)) is type(ADAPTER)
    assert layers_of_type(model, SLIDING) == [0, 1] and layers_of_type(model, FULL) == [2, 3]
    assert model.config.query_pre_attn_scalar != model.config.head_dim  # the score scale is not 1/√D
    with pytest.raises(ValueError, match="layer types are"):
        layers_of_type(model, "chunked_attention")


def test_a_layer_type_by_name_on_the_command_line_and_in_recipes(tmp_path):
    from typer.testing import CliRunner

    from mhla_convert.cli import app
    from mhla_convert.train.recipe import parse_recipe

    out = tmp_path / "global"
    result = CliRunner().invoke(app, ["tiny-gemma3", "--layers", FULL, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert mhla_convert.from_pretrained(out).mhla_plan["layers"] == [2, 3]
    recipe = parse_recipe(f"model: {{name: tiny-gemma3}}\nconversion: {{layers: {SLIDING}}}\n"
                          "data: {kind: synthetic}\nstages: [{name: finetune, steps: 1}]\n")
    assert recipe.conversion.layers == SLIDING
    with pytest.raises(ValueError, match="config has no layer_types: give layer indices"):
        convert(mhla_convert.tiny_model("tiny-dit"), layers=SLIDING)
    with pytest.raises(ValueError, match="layers must be a list of layer indices"):
        convert(tiny(), layers="sliding attention")


@pytest.mark.parametrize("index", [0, 2], ids=[SLIDING, FULL])
def test_layer_equals_reference_with_the_hosts_scale_norms_and_rope(index):
    model = tiny()
    host = model.model.layers[index].self_attn
    teacher = copy.deepcopy(host)
    convert(model, layers=[index], chunk_size=C)
    attn = model.model.layers[index].self_attn
    assert isinstance(attn, MHLAGemma3Attention) and attn.layer_type == host.layer_type
    assert (attn.to_q, attn.norm_q, attn.norm_k) == (host.q_proj, host.q_norm, host.k_norm)
    x = torch.randn(2, 37, 64)
    pos = torch.arange(37)[None].expand(2, -1)
    cos, sin = model.model.rotary_emb(x, pos, teacher.layer_type)  # this layer type's own RoPE theta
    out, weights = attn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
    assert weights is None

    # q is the host's (projection, Gemma's RMSNorm, RoPE) times √D / √query_pre_attn_scalar
    hq = teacher.q_norm(teacher.q_proj(x).view(2, 37, -1, 24)).transpose(1, 2)
    hk = teacher.k_norm(teacher.k_proj(x).view(2, 37, -1, 24)).transpose(1, 2)
    hq, hk = apply_rotary_pos_emb(hq, hk, cos, sin)
    q, k, v = attn.project(x, HalfSplitRotary(cos, sin))
    torch.testing.assert_close(q, hq.transpose(1, 2) * (24 / 32) ** 0.5)
    torch.testing.assert_close(k, hk.transpose(1, 2))
    ref = attn.output(mhla_attention_reference(
        q, k, v, toeplitz_causal_mixing(attn.mixing, -(-37 // C)), causal=True, chunk_size=C, exact_chunks=2))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_sliding_layer_reads_exactly_within_its_window():
    """exact_chunks · chunk_size = sliding_window: at the last token of each chunk the exact chunks span the host's
    window, so the exact region alone (`attention="local"`) gives the host's sliding attention there; and no
    exact read reaches further back anywhere."""
    window = 2 * C
    model = tiny(sliding_window=window)
    model.config._attn_implementation = "eager"
    host = copy.deepcopy(model.model.layers[0].self_attn)
    convert(model, layers=[0], attention="local", chunk_size=C, exact_chunks=2, window=4)
    attn = model.model.layers[0].self_attn
    n = 6 * C
    x = torch.randn(1, n, 64)
    pos = torch.arange(n)[None]
    rope = model.model.rotary_emb(x, pos, SLIDING)
    distance = pos[0, :, None] - pos[0, None, :]
    mask = torch.where((distance >= 0) & (distance < window), 0.0, float("-inf"))[None, None]
    expected, _ = host(x, rope, mask)
    out, _ = attn(x, rope, None)
    ends = torch.arange(C - 1, n, C)  # where the exact span is the whole window
    torch.testing.assert_close(out[:, ends], expected[:, ends], atol=1e-5, rtol=1e-4)

    changed = x.clone()
    changed[:, : n - window] += 1  # nothing the last token's window holds: no output of it may change
    assert torch.equal(attn(changed, rope, None)[0][:, -1], out[:, -1])


def test_an_exact_span_past_the_window_is_refused_before_anything_changes():
    model = tiny(sliding_window=2 * C)
    with pytest.raises(ValueError, match=r"sliding-window layer of 16 tokens.*exact_chunks · chunk_size ≤ 16"):
        convert(model, ratio=1.0, chunk_size=C, exact_chunks=3)
    assert not mhla_convert.mhla_layers(model) and not hasattr(model, "mhla_plan")
    with pytest.raises(ValueError, match="sliding-window layer"):  # auto tries every layer
        convert(model, ratio=0.5, strategy="auto", calibration=[{"input_ids": ids()}], chunk_size=C, exact_chunks=3)
    report = convert(model, layers=layers_of_type(model, FULL), chunk_size=C, exact_chunks=3)  # global layers: any
    assert report.converted == [2, 3]


def test_bidirectional_gemma_is_refused():
    model = tiny(use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="bidirectionally"):
        convert(model, ratio=1.0, chunk_size=C)


@pytest.mark.parametrize("kind", [SLIDING, FULL, None], ids=["sliding", "full", "all"])
def test_each_kind_converts_alone_and_decodes(kind):
    """Greedy generate() with a static cache equals the dynamic cache and no cache at all; the converted slots
    replace the host's (sliding or not) and the softmax layers keep theirs."""
    model = tiny()
    report = convert(model, layers=kind, ratio=1.0, chunk_size=C)  # a layer type by name
    assert report.converted == ([0, 1, 2, 3] if kind is None else layers_of_type(tiny(), kind))
    prompt = ids()
    dynamic = generate(model, prompt)
    static = generate(model, prompt, cache_implementation="static")
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=1e-5, rtol=1e-4)
    assert torch.equal(dynamic.sequences, generate(model, prompt, use_cache=False).sequences)
    cache = static.past_key_values
    assert isinstance(cache, StaticCache)
    for i, slot in enumerate(cache.layers):
        kind_of_slot = MHLAStaticSlidingLayer if model.config.layer_types[i] == SLIDING else MHLAStaticLayer
        assert isinstance(slot, kind_of_slot) == (i in report.converted)


def test_reloads_through_transformers_bitwise(tmp_path):
    model = tiny()
    convert(model, ratio=0.5, chunk_size=C)
    with torch.no_grad():
        for _, layer in mhla_convert.mhla_layers(model):
            layer.mixing.mul_(torch.rand_like(layer.mixing))
    x = ids()
    before = model(x).logits
    model.save_pretrained(tmp_path / "lm")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "lm").eval()
    assert isinstance(reloaded, Gemma3ForCausalLM) and reloaded.mhla_plan["layers"] == model.mhla_plan["layers"]
    assert torch.equal(reloaded(x).logits, before)
