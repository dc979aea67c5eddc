"""Causal MHLA with exact local chunks: parallel form, decoding and the layer option against the O(N²) reference."""

import pytest
import torch

from mhla_convert.layer import MHLAConfig, MHLAttention
from mhla_convert.mixing import toeplitz_causal_mixing
from mhla_convert.ops import mhla_attention, mhla_attention_reference

SHAPES = [  # batch, tokens, heads, kv heads, head dim, chunk, exact chunks
    (1, 16, 2, 2, 8, 4, 1),
    (2, 37, 4, 2, 8, 8, 2),  # GQA, a partial last chunk
    (2, 23, 6, 3, 5, 7, 3),  # odd head dim
    (1, 5, 2, 1, 4, 8, 2),  # one partial chunk, fewer chunks than the window
]


def inputs(batch, n, heads, kv_heads, dim, chunk, dtype=torch.float64, per_head=False, spread=1.0):
    g = torch.Generator().manual_seed(n * heads + dim)
    q, k, v = (torch.randn(batch, n, h, dim, generator=g, dtype=dtype) * spread for h in (heads, kv_heads, kv_heads))
    relative = torch.rand((heads, 4) if per_head else (4,), generator=g, dtype=dtype) + 0.05
    return q, k, v, toeplitz_causal_mixing(relative, -(-n // chunk)), relative


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_head", [False, True])
def test_parallel_matches_reference(shape, per_head):
    *dims, chunk, exact = shape
    q, k, v, mixing, _ = inputs(*dims, chunk, per_head=per_head)
    got = mhla_attention(q, k, v, mixing, causal=True, chunk_size=chunk, exact_chunks=exact, backend="torch")
    want = mhla_attention_reference(q, k, v, mixing, causal=True, chunk_size=chunk, exact_chunks=exact)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_exact_chunks_change_the_result():
    q, k, v, mixing, _ = inputs(1, 24, 2, 2, 8, 4)
    plain = mhla_attention(q, k, v, mixing, causal=True, chunk_size=4)
    exact = mhla_attention(q, k, v, mixing, causal=True, chunk_size=4, exact_chunks=2)
    assert (plain - exact).abs().max() > 1e-2


@pytest.mark.parametrize("dtype, spread, tol", [
    (torch.float32, 1.0, 1e-5), (torch.float32, 6.0, 2e-3), (torch.bfloat16, 1.0, 3e-2),
])
def test_low_precision(dtype, spread, tol):
    """spread 6: window scores far beyond exp's float32 range; the shift keeps them finite."""
    q, k, v, mixing, _ = (t.to(dtype) for t in inputs(2, 40, 4, 2, 16, 8, spread=spread))
    got = mhla_attention(q, k, v, mixing, causal=True, chunk_size=8, exact_chunks=2)
    want = mhla_attention_reference(*(t.double() for t in (q, k, v, mixing)), causal=True, chunk_size=8,
                                    exact_chunks=2)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_gradients_match_reference():
    q, k, v, mixing, _ = inputs(2, 19, 4, 2, 4, 4)
    args = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
    mhla_attention(*args, causal=True, chunk_size=4, exact_chunks=2).square().sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
    mhla_attention_reference(*ref, causal=True, chunk_size=4, exact_chunks=2).square().sum().backward()
    for a, b in zip(args, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("shape", SHAPES)
def test_decoding_matches_the_parallel_form(shape):
    batch, n, heads, kv_heads, dim, chunk, exact = shape
    config = MHLAConfig(causal=True, chunk_size=chunk, window=exact + 2, exact_chunks=exact)
    layer = MHLAttention(heads * dim, heads, num_kv_heads=kv_heads, head_dim=dim, config=config).double()
    with torch.no_grad():
        layer.mixing.uniform_(0.1, 1.0)
    q, k, v = layer.project(torch.randn(batch, n, heads * dim, dtype=torch.float64))
    full = layer.attend(q, k, v)
    for prefix in sorted({1, chunk, n // 2} & set(range(1, n))):
        head, state = layer.decode(q[:, :prefix], k[:, :prefix], v[:, :prefix], None)
        tail, state = layer.decode(q[:, prefix:], k[:, prefix:], v[:, prefix:], state)
        torch.testing.assert_close(torch.cat([head, tail], 1), full, rtol=1e-10, atol=1e-12)
        assert state.position.tolist() == [n] * batch
        assert state.ring_k.shape[1] == (exact + 2) * chunk  # the window never grows with the sequence


@pytest.mark.parametrize("options, match", [
    (dict(causal=False, blocks=(2, 2), exact_chunks=1), "causal"),
    (dict(causal=True, window=2, exact_chunks=2), "window"),
    (dict(causal=True, window=4, exact_chunks=1, normalize=False), "normalised"),
])
def test_config_refuses_what_it_cannot_run(options, match):
    with pytest.raises(ValueError, match=match):
        MHLAConfig(**options)


def test_padding_is_never_read():
    """Keys marked as padding change nothing, in the parallel form and through decoding."""
    q, k, v, mixing, relative = inputs(2, 21, 4, 2, 8, 4)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[0, :6] = False  # left padding
    noise = k.clone()
    noise[0, :6] = 1e3  # whatever the padded keys hold
    # oracle: with q ≥ 0, a key of -1e4 gets exp(q·k) = 0 and φ(k) = 0, i.e. it is not there
    q = q.abs()
    want = mhla_attention_reference(q, k.masked_fill(~mask[:, :, None, None], -1e4), v, mixing, causal=True,
                                    chunk_size=4, exact_chunks=2)
    got = mhla_attention(q, noise, v, mixing, causal=True, chunk_size=4, exact_chunks=2, key_mask=mask)
    torch.testing.assert_close(got[:, 6:], want[:, 6:], rtol=1e-9, atol=1e-11)
    plain = mhla_attention(q, noise, v, mixing, causal=True, chunk_size=4, key_mask=mask)
    plain_want = mhla_attention_reference(q, k.masked_fill(~mask[:, :, None, None], -1e4), v, mixing, causal=True,
                                          chunk_size=4)
    torch.testing.assert_close(plain[:, 6:], plain_want[:, 6:], rtol=1e-9, atol=1e-11)

    config = MHLAConfig(causal=True, chunk_size=4, window=4, exact_chunks=2)
    layer = MHLAttention(32, 4, num_kv_heads=2, head_dim=8, config=config).double()
    with torch.no_grad():
        layer.mixing.copy_(relative)
    head, state = layer.decode(q[:, :10], noise[:, :10], v[:, :10], None, key_mask=mask[:, :10])
    tail, _ = layer.decode(q[:, 10:], noise[:, 10:], v[:, 10:], state)
    got = torch.cat([head, tail], 1)
    # decoding packs each row's real tokens first: the padded row gives what it gives alone
    torch.testing.assert_close(got[:1, 6:], layer.attend(q[:1, 6:], k[:1, 6:], v[:1, 6:]), rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-11)
