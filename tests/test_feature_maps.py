"""Learned feature maps (Hedgehog): the map itself, the operators with it against the O(N²) reference, and the
converted models that own one (decoding, save/reload, attention transfer)."""

import pytest
import torch

from mhla_convert import convert, from_pretrained, save_pretrained
from mhla_convert.families import adapter_for_model
from mhla_convert.mixing import initial_mixing, toeplitz_causal_mixing
from mhla_convert.ops import mhla_attention, mhla_attention_reference
from mhla_convert.ops.feature_maps import HedgehogFeatureMap
from mhla_convert.train.params import select_trainable


def hedgehog(kv_heads, dim, dtype=torch.float64, seed=0):
    phi = HedgehogFeatureMap(kv_heads, dim, dtype=dtype)
    with torch.no_grad():  # away from the init, so a wrong head grouping shows
        phi.weight.add_(torch.randn(phi.weight.shape, generator=torch.Generator().manual_seed(seed), dtype=dtype))
    return phi


def inputs(batch, n, heads, kv_heads, dim, dtype=torch.float64):
    g = torch.Generator().manual_seed(n + heads + dim)
    return [torch.randn(batch, n, h, dim, generator=g, dtype=dtype) for h in (heads, kv_heads, kv_heads)]


def test_features_are_two_distributions_per_head_and_query_heads_share_their_key_head():
    phi = hedgehog(2, 6)
    q, k, _ = inputs(3, 5, 4, 2, 6)
    fq, fk = phi(q), phi(k)
    assert fq.shape == (3, 5, 4, 12) and fk.shape == (3, 5, 2, 12) and phi.features == 12
    assert (fq >= 0).all()
    torch.testing.assert_close(fq.unflatten(-1, (2, 6)).sum(-1), torch.ones(3, 5, 4, 2, dtype=fq.dtype))
    for head in range(4):  # query heads 0, 1 read key head 0's W; 2, 3 key head 1's
        z = q[:, :, head] @ phi.weight[head // 2]
        torch.testing.assert_close(fq[:, :, head], torch.cat([z.softmax(-1), (-z).softmax(-1)], -1))
    assert phi(q[:, 0]).shape == (3, 4, 12)  # one token, as decoding calls it


def test_init_is_orthogonal_and_the_same_in_every_layer():
    a, b = HedgehogFeatureMap(3, 8), HedgehogFeatureMap(3, 8)
    assert torch.equal(a.weight, b.weight)
    torch.testing.assert_close(a.weight[1].T @ a.weight[1], torch.eye(8), atol=1e-6, rtol=0)


CASES = [  # batch, tokens, heads, kv heads, head dim, chunk, exact chunks
    (1, 16, 2, 2, 8, 4, 2),
    (2, 37, 4, 2, 6, 8, 2),  # GQA, a partial last chunk
    (2, 23, 3, 1, 5, 7, 0),  # odd head dim, no exact region
]


@pytest.mark.parametrize("case", CASES)
def test_causal_matches_reference_with_gradients(case):
    *dims, chunk, exact = case
    q, k, v = inputs(*dims)
    mixing = toeplitz_causal_mixing(torch.tensor([1.0, 0.7, 0.5, 0.3], dtype=q.dtype), -(-q.shape[1] // chunk))
    phi = hedgehog(k.shape[2], q.shape[-1])
    kw = dict(causal=True, chunk_size=chunk, exact_chunks=exact, feature_map=phi)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = mhla_attention(*leaves, mixing, backend="torch", **kw)
    got.square().sum().backward()
    grads = [t.grad for t in (*leaves, phi.weight)]
    phi.weight.grad = None
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = mhla_attention_reference(*ref, mixing, **kw)
    want.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, [t.grad for t in (*ref, phi.weight)]):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("exact_radius", [None, 1])
def test_grid_matches_reference(exact_radius):
    q, k, v = inputs(2, 35, 4, 2, 8)
    phi = hedgehog(2, 8)
    kw = dict(grid=(5, 7), blocks=(2, 3), exact_radius=exact_radius, feature_map=phi)
    got = mhla_attention(q, k, v, initial_mixing("locality", (2, 3)).double(), **kw)
    want = mhla_attention_reference(q, k, v, initial_mixing("locality", (2, 3)).double(), **kw)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_bf16_stays_close_to_float64():
    """The same (bf16-rounded) inputs and weights, computed in bf16 and in float64."""
    q, k, v = (t.bfloat16() for t in inputs(2, 40, 4, 2, 16))
    mixing = toeplitz_causal_mixing(torch.tensor([1.0, 0.6, 0.4, 0.2]), 5).bfloat16()
    phi = hedgehog(2, 16, torch.bfloat16)
    phi64 = HedgehogFeatureMap(2, 16, dtype=torch.float64)
    phi64.weight.data.copy_(phi.weight)
    kw = dict(causal=True, chunk_size=8, exact_chunks=2)
    got = mhla_attention(q, k, v, mixing, feature_map=phi, **kw)
    want = mhla_attention_reference(*(t.double() for t in (q, k, v, mixing)), feature_map=phi64, **kw)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


def test_padded_keys_count_for_nothing():
    q, k, v = inputs(2, 24, 4, 2, 8)
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, 5:9] = False
    other_k, other_v = k.clone(), v.clone()
    other_k[1, 5:9], other_v[1, 5:9] = 50.0, -50.0
    mixing = toeplitz_causal_mixing(torch.tensor([1.0, 0.6, 0.4, 0.2], dtype=q.dtype), 6)
    kw = dict(causal=True, chunk_size=4, exact_chunks=2, feature_map=hedgehog(2, 8), key_mask=mask)
    torch.testing.assert_close(mhla_attention(q, k, v, mixing, **kw), mhla_attention(q, other_k, other_v, mixing,
                               **kw), rtol=1e-12, atol=1e-12)


def test_operators_refuse_the_name_and_plain_padding():
    q, k, v = inputs(1, 8, 2, 2, 4)
    mixing = toeplitz_causal_mixing(torch.ones(4, dtype=q.dtype), 2)
    with pytest.raises(ValueError, match="'hedgehog' has weights"):
        mhla_attention(q, k, v, mixing, causal=True, chunk_size=4, feature_map="hedgehog")
    with pytest.raises(ValueError, match="key_mask with a learned feature map needs an exact region"):
        mhla_attention(q, k, v, mixing, causal=True, chunk_size=4, feature_map=hedgehog(2, 4),
                       key_mask=torch.ones(1, 8, dtype=torch.bool))


def _lm(tiny):
    model = tiny("tiny-llama").eval()
    convert(model, ratio=1.0, chunk_size=8, feature_map="hedgehog", progress=False)
    return model


def test_converted_lm_decodes_as_its_parallel_form(tiny):
    model = _lm(tiny)
    prompt = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(0))
    for cache in ("dynamic", "static"):
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, return_dict_in_generate=True, output_logits=True,
                             cache_implementation=cache)
        with torch.no_grad():
            parallel = model(out.sequences).logits[:, prompt.shape[1] - 1 : -1]
        torch.testing.assert_close(torch.stack(out.logits, 1), parallel, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-dit"])
def test_save_reload_is_bitwise(tiny, run_model, tmp_path, name):
    model = tiny(name).eval()
    options = {"chunk_size": 8} if name == "tiny-llama" else {"exact_radius": 1}
    convert(model, ratio=1.0, feature_map="hedgehog", progress=False, **options)
    layers = [m for m in model.modules() if isinstance(m, HedgehogFeatureMap)]
    assert layers and all(m.weight.dtype == torch.float32 for m in layers)
    reloaded = from_pretrained(save_pretrained(model, tmp_path / "ckpt"))
    torch.manual_seed(0)
    batch = adapter_for_model(model).example_inputs(model, None if name == "tiny-llama" else (4, 4), 2)
    assert torch.equal(run_model(reloaded, batch), run_model(model, batch))


def test_attention_transfer_trains_the_feature_map(tiny):
    model = _lm(tiny)
    trainable = {id(p) for p in select_trainable(model, "mhla", adapter_for_model(model))}
    maps = [m.weight for m in model.modules() if isinstance(m, HedgehogFeatureMap)]
    assert maps and all(id(w) in trainable for w in maps)


def test_command_line_converts_with_it_and_refuses_a_typo(tmp_path):
    from typer.testing import CliRunner

    from mhla_convert.cli import app

    out = tmp_path / "lm"
    result = CliRunner().invoke(app, ["tiny-llama", "--feature-map", "hedgehog", "--out", str(out)])
    assert result.exit_code == 0, result.output
    model = from_pretrained(out)
    assert model.mhla_plan["mhla_config"]["feature_map"] == "hedgehog"
    assert any(isinstance(m, HedgehogFeatureMap) for m in model.modules())
    result = CliRunner().invoke(app, ["tiny-llama", "--feature-map", "hedgehgo", "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "feature_map must be one of ['elu', 'hedgehog', 'relu']" in result.output
