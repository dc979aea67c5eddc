"""The MHLAttention layer: standalone use, GQA, RoPE, decode, config round trip."""

import pytest
import torch

from mhla_convert import MHLAConfig, MHLAttention
from mhla_convert.mixing import toeplitz_causal_mixing
from mhla_convert.ops import mhla_attention_reference


def test_non_causal_layer_matches_reference_on_odd_grid():
    torch.manual_seed(0)
    layer = MHLAttention(
        32, 4, num_kv_heads=2, config=MHLAConfig(blocks=(2, 3), per_head_mixing=True, output_norm=True)
    )
    assert layer.mixing.shape == (4, 6, 6)
    x = torch.randn(2, 7 * 9, 32)
    q, k, v = layer.project(x)
    expected = layer.output(mhla_attention_reference(q, k, v, layer.mixing, grid=(7, 9), blocks=(2, 3)))
    torch.testing.assert_close(layer(x, grid=(7, 9)), expected, rtol=1e-5, atol=1e-5)


def test_rotary_is_applied_before_feature_map_or_ignored():
    torch.manual_seed(0)
    calls = []

    def rotary(q, k):
        calls.append(q.shape)
        return q.flip(-1), k.flip(-1)

    x = torch.randn(1, 12, 32)
    with_rope = MHLAttention(32, 4, config=MHLAConfig(blocks=(2,)))
    no_rope = MHLAttention(32, 4, config=MHLAConfig(blocks=(2,), rope="none"))
    no_rope.load_state_dict(with_rope.state_dict())
    a, b = with_rope(x, grid=(12,), rotary=rotary), no_rope(x, grid=(12,), rotary=rotary)
    assert calls == [(1, 12, 4, 8)]
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("qk_norm", ["across_heads", "per_head"])
def test_qk_norm_shapes(qk_norm):
    layer = MHLAttention(32, 4, num_kv_heads=2, qkv_bias=True, qk_norm=qk_norm, config=MHLAConfig(blocks=(3,)))
    assert layer(torch.randn(2, 10, 32), grid=(10,)).shape == (2, 10, 32)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_causal_layer_decodes_like_its_parallel_form(backend):
    """Prefill then token-by-token decode equals the parallel form; "triton" runs both the operator
    and the recurrent step through the kernels (float32: exact dots)."""
    torch.manual_seed(0)
    device = "cuda" if backend == "triton" else "cpu"
    config = MHLAConfig(causal=True, chunk_size=4, window=3, per_head_mixing=True, backend=backend)
    layer = MHLAttention(32, 4, num_kv_heads=2, config=config).to(device)
    with torch.no_grad():
        layer.mixing.uniform_(0.1, 1.0)
    x = torch.randn(2, 23, 32, device=device)
    q, k, v = layer.project(x)
    ref = mhla_attention_reference(q, k, v, toeplitz_causal_mixing(layer.mixing, 6), causal=True, chunk_size=4)
    torch.testing.assert_close(layer(x), layer.output(ref), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # decoding is inference: the kernel step has no backward
        first, state = layer.decode(q[:, :10], k[:, :10], v[:, :10], None)
        rest, state = layer.decode(q[:, 10:], k[:, 10:], v[:, 10:], state)
    torch.testing.assert_close(layer.output(torch.cat([first, rest], 1)), layer(x), rtol=1e-5, atol=1e-5)
    assert state.position.tolist() == [23, 23]


def test_frozen_mixing_and_config_round_trip():
    cfg = MHLAConfig(blocks=(7, 3, 5), learnable_mixing=False, mixing_init=0.5, normalize=False)
    assert MHLAConfig.from_dict(cfg.to_dict()) == cfg
    assert not MHLAttention(64, 4, config=cfg).mixing.requires_grad
    with pytest.raises(ValueError, match="unknown MHLA options"):
        MHLAConfig.from_dict({"blocks": [2], "blokcs": [2]})
    with pytest.raises(ValueError, match="blocks is required"):
        MHLAttention(32, 4, config=MHLAConfig())
    with pytest.raises(ValueError, match="needs the token grid"):
        MHLAttention(32, 4, config=MHLAConfig(blocks=(2,)))(torch.randn(1, 4, 32))


def test_layer_trains_mixing():
    torch.manual_seed(0)
    layer = MHLAttention(16, 2, config=MHLAConfig(blocks=(2, 2)))
    layer(torch.randn(1, 16, 16), grid=(4, 4)).square().mean().backward()
    assert layer.mixing.grad is not None and layer.mixing.grad.abs().sum() > 0
