"""Retrieval heads: key heads of a causal MHLA layer that keep softmax over every earlier token, in the parallel
form (against an O(N²) reference), decoding (dynamic and static caches, padding, beam search, rollback), options
and save → reload."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from mhla_convert.convert import convert
from mhla_convert.families import adapter_for_family
from mhla_convert.io import save_pretrained
from mhla_convert.layer import MHLAConfig, MHLAttention
from mhla_convert.ops.reference import mhla_attention_reference
from mhla_convert.ops.retrieval import merge_heads, retrieval_attention, split_heads
from mhla_convert.options import check_mhla_options

ADAPTER = adapter_for_family("llama")
C = 8


def naive_softmax(q, k, v, key_mask=None):
    """Causal softmax from the definition: q (B, N, Hq, D), k / v (B, N, Hk, ·)."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
    n = q.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    if key_mask is not None:
        allowed = allowed & (key_mask[:, None, None, :] | torch.eye(n, dtype=torch.bool))
    return torch.einsum("bhts,bshe->bthe", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_retrieval_attention_equals_masked_softmax(dtype, tol):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 37, h, 16, generator=g).to(dtype).requires_grad_() for h in (4, 2, 2))
    key_mask = torch.rand(3, 37, generator=g) > 0.3
    for mask in (None, key_mask):
        got, want = retrieval_attention(q, k, v, mask), naive_softmax(q, k, v, mask)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    for got_grad, want_grad in zip(grads, torch.autograd.grad(want.float().square().sum(), (q, k, v))):
        torch.testing.assert_close(got_grad, want_grad, atol=5 * tol, rtol=5 * tol)


def test_split_and_merge_are_inverse():
    x = torch.randn(2, 5, 6, 3)  # 6 query heads over 3 key heads
    linear, far = split_heads(x, (1,), 3)
    assert torch.equal(far, x[:, :, 2:4]) and torch.equal(linear, x[:, :, [0, 1, 4, 5]])
    assert torch.equal(merge_heads(linear, far, (1,), 3), x)


def layer(retrieval, **options) -> MHLAttention:
    torch.manual_seed(0)
    cfg = MHLAConfig(causal=True, chunk_size=C, window=4, exact_chunks=2, retrieval_heads=retrieval, **options)
    return MHLAttention(48, 4, num_kv_heads=2, config=cfg)


@pytest.mark.parametrize("options", [{}, {"feature_map": "hedgehog", "per_head_mixing": True}])
def test_layer_equals_reference_per_head_kind(options):
    """Retrieval heads equal the causal softmax; the other heads equal the MHLA reference on their own heads with
    the layer's mixing and feature map, which are sized for them alone."""
    m = layer((1,), **options)
    linear_heads = 2 if options.get("per_head_mixing") else None
    assert m.linear_kv_heads == 1 and (linear_heads is None or m.mixing.shape[0] == linear_heads)
    q, k, v = (torch.randn(2, 29, h, 12) for h in (4, 2, 2))
    out = m.attend(q, k, v)
    torch.testing.assert_close(out[:, :, 2:], naive_softmax(q[:, :, 2:], k[:, :, 1:], v[:, :, 1:]))
    from mhla_convert.mixing import toeplitz_causal_mixing

    mixing = toeplitz_causal_mixing(m.mixing, -(-29 // C)).detach()
    want = mhla_attention_reference(q[:, :, :2], k[:, :, :1], v[:, :, :1], mixing, causal=True, chunk_size=C,
                                    exact_chunks=2, feature_map=m.phi)
    torch.testing.assert_close(out[:, :, :2], want, atol=1e-5, rtol=1e-4)
    out.square().sum().backward()
    assert m.mixing.grad is not None and m.mixing.grad.abs().sum() > 0


def test_options_are_checked():
    with pytest.raises(ValueError, match="distinct key-head indices"):
        MHLAConfig(causal=True, retrieval_heads=[0, 0])
    with pytest.raises(ValueError, match="for causal models"):
        MHLAConfig(retrieval_heads=[0])
    with pytest.raises(ValueError, match="some, not all"):
        layer((0, 1))
    with pytest.raises(ValueError, match="some, not all"):
        layer((2,))
    check_mhla_options({"retrieval_heads": [1]})
    with pytest.raises(ValueError, match="for causal models"):
        check_mhla_options({"retrieval_heads": [1]}, causal=False)
    assert MHLAConfig.from_dict(MHLAConfig(causal=True, retrieval_heads=[3, 1]).to_dict()).retrieval_heads == (1, 3)


def converted(family="llama", seed=0, **options):
    torch.manual_seed(seed)
    model = ADAPTER.build(ADAPTER.tiny_configs()[f"tiny-{family}"]).eval()
    convert(model, ratio=1.0, chunk_size=C, retrieval_heads=[1], **options)
    return model


def generate(model, prompt, mask=None, new=12, **kw):
    mask = torch.ones_like(prompt) if mask is None else mask
    return model.generate(prompt, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          return_dict_in_generate=True, output_logits=True, **kw)


def ids(batch=2, length=27, seed=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("options", [{}, {"feature_map": "hedgehog"}])
def test_cached_generation_equals_no_cache(options):
    model = converted("qwen3", **options)
    prompt = ids()
    uncached = generate(model, prompt, use_cache=False)
    assert_same(generate(model, prompt), uncached)
    assert_same(generate(model, prompt, cache_implementation="static"), uncached)
    assert_same(generate(model, prompt, num_beams=2), generate(model, prompt, num_beams=2, use_cache=False))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_left_padded_batch_equals_rows_alone(cache):
    model = converted()
    rows = [ids(1, n, seed=n)[0] for n in (21, 30, 13)]
    length = max(len(r) for r in rows)
    prompt = torch.stack([torch.cat([torch.zeros(length - len(r), dtype=torch.long), r]) for r in rows])
    mask = (torch.arange(length) >= torch.tensor([length - len(r) for r in rows])[:, None]).long()
    batch = generate(model, prompt, mask=mask, new=8, cache_implementation=cache)
    for i, row in enumerate(rows):
        alone = generate(model, row[None], new=8, cache_implementation=cache)
        assert torch.equal(batch.sequences[i, length:], alone.sequences[0, len(row):])
        torch.testing.assert_close(torch.stack(batch.logits)[:, i], torch.stack(alone.logits)[:, 0],
                                   atol=1e-5, rtol=1e-4)


def test_dynamic_buffers_grow_past_the_prompt():
    model = converted()
    prompt = ids(length=5)  # the buffers start at 64 tokens: 70 new tokens make them grow
    assert_same(generate(model, prompt, new=70), generate(model, prompt, new=70, use_cache=False))


def test_sliding_window_cache_refused_by_name():
    model = converted("mistral")
    with pytest.raises(ValueError, match="retrieval heads read every earlier token"):
        generate(model, ids(), cache_implementation="static")


def test_save_reload_gives_identical_outputs(tmp_path):
    model = converted(feature_map="hedgehog")
    prompt = ids()
    with torch.no_grad():
        expected = model(prompt).logits
        loaded = AutoModelForCausalLM.from_pretrained(save_pretrained(model, tmp_path / "ckpt")).eval()
        assert loaded.model.layers[0].self_attn.config.retrieval_heads == (1,)
        assert torch.equal(loaded(prompt).logits, expected)


def test_command_line_option(tmp_path):
    from typer.testing import CliRunner

    from mhla_convert import from_pretrained
    from mhla_convert.cli import app

    result = CliRunner().invoke(app, ["convert", "tiny-llama", "--retrieval-heads", "1", "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert from_pretrained(tmp_path / "m").mhla_plan["mhla_config"]["retrieval_heads"] == [1]
    result = CliRunner().invoke(app, ["convert", "tiny-dit", "--retrieval-heads", "0", "--out", str(tmp_path / "d")])
    assert result.exit_code != 0 and "is for causal models" in result.output


def test_far_retrieval_equals_its_definition():
    from mhla_convert.ops import retrieval

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 300, 4, 8, generator=g), torch.randn(2, 300, 2, 8, generator=g)
    got = retrieval.far_retrieval(q, k, chunk_size=16, exact_chunks=2)  # 300 queries: two row blocks of 256
    scores = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(2, 2)) / 8**0.5
    t = torch.arange(300)
    p = scores.masked_fill(t[:, None] < t, float("-inf")).softmax(-1)
    far = ((t[:, None] // 16 - t // 16) >= 2) & (t > 0)
    peak = torch.where(far, p, 0).max(-1).values  # (B, H, N): the largest weight on one far key
    want = peak.pow(2).mean((0, 2)).view(2, 2).max(-1).values
    torch.testing.assert_close(got, want)


def test_far_retrieval_prefers_one_sharp_read_to_diffuse_and_sink_attention():
    """Key head 0 attends the first token (a sink) or spreads evenly; key head 1 reads one far token sharply."""
    from mhla_convert.ops.retrieval import far_retrieval

    n, dim = 64, 4
    q, k = torch.zeros(1, n, 2, dim), torch.zeros(1, n, 2, dim)
    k[0, 0, 0, 0] = 50.0  # head 0: every query sends its weight to token 0
    q[0, :, 0, 0] = 1.0
    k[0, 5, 1, 1] = 50.0  # head 1: every query reads token 5
    q[0, :, 1, 1] = 1.0
    score = far_retrieval(q, k, chunk_size=8, exact_chunks=2)
    assert score[1] > 0.5 > 0.01 > score[0]


def test_choose_retrieval_heads_ranks_across_layers_and_keeps_mhla_in_each():
    from mhla_convert.ops.retrieval import choose_retrieval_heads

    scores = {0: torch.tensor([0.9, 0.8]), 2: torch.tensor([0.1, 0.7]), 5: torch.tensor([0.2, 0.3])}
    assert choose_retrieval_heads(scores, 0.5) == {0: (0,), 2: (1,), 5: (1,)}  # not both of layer 0's
    assert choose_retrieval_heads(scores, 0.01) == {0: (0,)}  # at least one head


def test_per_layer_heads_are_kept_per_layer():
    cfg = MHLAConfig(causal=True, retrieval_heads={"3": [1, 0], 1: [], 2: [0]})
    assert cfg.retrieval_heads == {2: (0,), 3: (0, 1)} and cfg.for_layer(3).retrieval_heads == (0, 1)
    assert cfg.for_layer(0).retrieval_heads == () and MHLAConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="keyed by layer index"):
        MHLAConfig(causal=True, retrieval_heads={"x": [0]})
    with pytest.raises(ValueError, match="config.for_layer"):
        MHLAttention(48, 4, num_kv_heads=2, config=cfg)


def _calibration(n=2):
    return [{"input_ids": ids(2, 40, seed=10 + i)} for i in range(n)]


def test_retrieval_share_keeps_the_heads_that_retrieve_most_sharply(tmp_path):
    from mhla_convert.calibrate import retrieval_scores
    from mhla_convert.families.llama import MHLALlamaAttention
    from mhla_convert.ops.retrieval import choose_retrieval_heads

    torch.manual_seed(0)
    model = ADAPTER.build(ADAPTER.tiny_configs()["tiny-llama"]).eval()
    prompt = ids()
    with torch.no_grad():
        before = model(prompt).logits
    config = MHLAConfig(causal=True, chunk_size=C, window=4, exact_chunks=2)
    scores = retrieval_scores(model, ADAPTER, [0, 1, 2, 3], config, _calibration())
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, before)  # scoring changes nothing
    convert(model, ratio=1.0, chunk_size=C, window=4, retrieval_share=0.25, calibration=_calibration())
    expected = choose_retrieval_heads(scores, 0.25)
    assert sum(map(len, expected.values())) == 2
    assert model.mhla_plan["mhla_config"]["retrieval_heads"] == {str(i): list(h) for i, h in expected.items()}
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer.self_attn, MHLALlamaAttention)
        assert layer.self_attn.config.retrieval_heads == expected.get(i, ())
    with torch.no_grad():
        expected_logits = model(prompt).logits
        loaded = AutoModelForCausalLM.from_pretrained(save_pretrained(model, tmp_path / "ckpt")).eval()
        assert torch.equal(loaded(prompt).logits, expected_logits)
    assert_same(generate(model, prompt, cache_implementation="static"), generate(model, prompt, use_cache=False))


@pytest.mark.parametrize("family, options, message", [
    ("llama", {"retrieval_share": 0.25}, "give calibration batches"),
    ("llama", {"retrieval_share": 1.0, "calibration": "data"}, r"in \[0, 1\)"),
    ("llama", {"retrieval_share": 0.25, "retrieval_heads": [0], "calibration": "data"}, "drop retrieval_heads"),
    ("llama", {"retrieval_heads": {7: [0]}}, "not converted"),
    ("dit", {"retrieval_share": 0.25, "calibration": "data"}, "for causal models"),
])
def test_retrieval_options_refused_in_one_line(family, options, message):
    adapter = adapter_for_family(family)
    model = adapter.build(adapter.tiny_config())
    if options.get("calibration") == "data":
        options = {**options, "calibration": _calibration(1)}
    with pytest.raises(ValueError, match=message):
        convert(model, ratio=1.0, **options)


def test_recipe_and_command_line_choose_heads(tmp_path):
    from typer.testing import CliRunner

    from mhla_convert import from_pretrained
    from mhla_convert.cli import app
    from mhla_convert.train import parse_recipe
    from mhla_convert.train.build import build_model

    recipe = parse_recipe(
        "model: {name: tiny-llama}\n"
        "conversion: {retrieval_share: 0.25, calibration_batches: 1, options: {chunk_size: 8, window: 4}}\n"
        "data: {kind: synthetic, num_samples: 4, batch_size: 2, context_length: 32}\n"
        "stages: [{name: finetune, steps: 1}]\n", "r.yaml")
    heads = build_model(recipe, teachers=False).model.mhla_plan["mhla_config"]["retrieval_heads"]
    assert sum(map(len, heads.values())) == 2
    result = CliRunner().invoke(app, ["convert", "tiny-llama", "--retrieval-share", "0.25", "--calibration",
                                      "synthetic", "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    heads = from_pretrained(tmp_path / "m").mhla_plan["mhla_config"]["retrieval_heads"]
    assert isinstance(heads, dict) and sum(map(len, heads.values())) == 2


def test_retrieval_share_skips_sliding_window_layers():
    """Gemma 3's local layers read nothing beyond their window: their heads are never chosen."""
    adapter = adapter_for_family("gemma3")
    torch.manual_seed(0)
    model = adapter.build(adapter.tiny_config()).eval()
    convert(model, ratio=1.0, chunk_size=4, retrieval_share=0.5, calibration=_calibration(1))
    heads = model.mhla_plan["mhla_config"]["retrieval_heads"]
    assert heads and set(heads) <= {"2", "3"}  # layers 0 and 1 slide
    with pytest.raises(ValueError, match="sliding-window layer"):
        convert(adapter.build(adapter.tiny_config()), layers=[0, 1], chunk_size=4, retrieval_share=0.5,
                calibration=_calibration(1))
