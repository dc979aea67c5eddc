"""The MHLA operator against its explicit O(N²) definition, and its error messages."""

import math

import pytest
import torch

from mhla_convert.layer import MHLAConfig
from mhla_convert.mixing import toeplitz_causal_mixing
from mhla_convert.ops import BlockLayout, DecodeState, mhla_attention, mhla_attention_reference, mhla_weights_reference

# (grid, blocks): divisible and not, 1-D / 2-D / 3-D, a block count equal to its axis
LAYOUTS = [
    ((16,), (4,)), ((13,), (4,)), ((4, 4), (2, 2)), ((7, 9), (2, 4)), ((5, 3, 4), (2, 3, 2)), ((3, 5, 7), (3, 2, 3)),
]


def _inputs(grid, blocks, *, batch=2, heads=4, kv_heads=2, dim=8, dv=6, per_head=False, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, m = math.prod(grid), math.prod(blocks)
    q = torch.randn(batch, n, heads, dim, generator=g)
    k = torch.randn(batch, n, kv_heads, dim, generator=g)
    v = torch.randn(batch, n, kv_heads, dv, generator=g)
    mixing = torch.rand((heads, m, m) if per_head else (m, m), generator=g)
    return [t.to(dtype) for t in (q, k, v)] + [mixing]


@pytest.mark.parametrize("grid,blocks", LAYOUTS)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("per_head", [False, True])
def test_matches_reference_fp32(grid, blocks, normalize, per_head):
    q, k, v, mix = _inputs(grid, blocks, per_head=per_head)
    kw = dict(grid=grid, blocks=blocks, normalize=normalize)
    out = mhla_attention(q, k, v, mix, backend="torch", **kw)
    torch.testing.assert_close(out, mhla_attention_reference(q, k, v, mix, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,blocks", [(16, 4), (13, 4), (29, 5), (7, 7)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("per_head", [False, True])
def test_causal_matches_reference_fp32(n, blocks, normalize, per_head):
    q, k, v, mix = _inputs((n,), (blocks,), per_head=per_head)
    kw = dict(grid=(n,), blocks=(blocks,), causal=True, normalize=normalize)
    out = mhla_attention(q, k, v, mix, backend="torch", **kw)
    torch.testing.assert_close(out, mhla_attention_reference(q, k, v, mix, **kw), rtol=1e-5, atol=1e-5)


def test_causal_chunk_size_keeps_boundaries_fixed():
    """With chunk_size the first t outputs do not depend on how many tokens follow."""
    q, k, v, _ = _inputs((30,), (1,))
    rel = torch.rand(3)
    full = mhla_attention(q, k, v, toeplitz_causal_mixing(rel, 4), causal=True, chunk_size=8)
    part = mhla_attention(q[:, :19], k[:, :19], v[:, :19], toeplitz_causal_mixing(rel, 3), causal=True, chunk_size=8)
    torch.testing.assert_close(full[:, :19], part)
    ref = mhla_attention_reference(q, k, v, toeplitz_causal_mixing(rel, 4), causal=True, chunk_size=8)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "grid,blocks,causal", [((7, 9), (2, 4), False), ((5, 3, 4), (2, 3, 2), False), ((29,), (5,), True)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32_reference(grid, blocks, causal, dtype):
    q, k, v, mix = _inputs(grid, blocks, dtype=dtype, per_head=True)
    kw = dict(grid=grid, blocks=blocks, causal=causal)
    out = mhla_attention(q, k, v, mix, **kw)
    assert out.dtype == dtype
    ref = mhla_attention_reference(q.float(), k.float(), v.float(), mix, **kw)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("feature_map", ["elu", lambda x: torch.nn.functional.softplus(x)])
def test_other_feature_maps_on_padded_grid(feature_map):
    """φ(0) ≠ 0 for these, so padded slots must be zeroed after φ, not before."""
    q, k, v, mix = _inputs((7, 9), (2, 4))
    kw = dict(grid=(7, 9), blocks=(2, 4), feature_map=feature_map)
    torch.testing.assert_close(
        mhla_attention(q, k, v, mix, **kw), mhla_attention_reference(q, k, v, mix, **kw), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "grid,blocks,causal", [((5, 3), (2, 2), False), ((3, 2, 3), (2, 1, 2), False), ((11,), (3,), True)]
)
@pytest.mark.parametrize("normalize", [True, False])
def test_gradcheck(grid, blocks, causal, normalize):
    q, k, v, mix = _inputs(grid, blocks, batch=1, heads=2, kv_heads=1, dim=3, dv=2, per_head=True, dtype=torch.float64)
    mix = mix.double()
    # keep φ(q), φ(k) away from ReLU's kink so finite differences are valid
    q, k = q.abs() + 0.1, k.abs() + 0.1
    inputs = [t.requires_grad_() for t in (q, k, v, mix)]
    fn = lambda q, k, v, m: mhla_attention(q, k, v, m, grid=grid, blocks=blocks, causal=causal, normalize=normalize)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("causal", [False, True])
def test_single_block_is_plain_linear_attention(causal):
    q, k, v, _ = _inputs((24,), (1,))
    out = mhla_attention(q, k, v, torch.ones(1, 1), grid=(24,), blocks=(1,), causal=causal, scale=1.0, eps=1e-6)
    fq, fk = torch.relu(q), torch.relu(k).repeat_interleave(2, dim=2)
    vv = v.repeat_interleave(2, dim=2)
    if causal:  # prefix sums, token by token
        kv = torch.einsum("bshd,bshe->bshde", fk, vv).cumsum(1)
        num, den = torch.einsum("bthd,bthde->bthe", fq, kv), torch.einsum("bthd,bthd->bth", fq, fk.cumsum(1))
    else:
        num, den = (
            torch.einsum("bthd,bhde->bthe", fq, torch.einsum("bshd,bshe->bhde", fk, vv)),
            torch.einsum("bthd,bhd->bth", fq, fk.sum(1)),
        )
    torch.testing.assert_close(out, num / (den.unsqueeze(-1) + 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 2, 3, 6])
@pytest.mark.parametrize("prefix", [0, 5, 8, 21])
def test_recurrent_steps_equal_parallel_causal(window, prefix):
    q, k, v, _ = _inputs((37,), (1,), dtype=torch.float64)
    rel = torch.rand(4, window, dtype=torch.float64)
    chunk = 4
    parallel = mhla_attention(
        q, k, v, toeplitz_causal_mixing(rel, math.ceil(37 / chunk)), causal=True, chunk_size=chunk
    )
    state = DecodeState(2, 2, 8, 6, chunk_size=chunk, window=window, feature_map="relu", dtype=k.dtype,
                        device=k.device)
    if prefix:  # (else the new state, at position 0)
        state.prefill(k[:, :prefix], v[:, :prefix], torch.full((2,), prefix))
    out = state.steps(q[:, prefix:], k[:, prefix:], v[:, prefix:], None, rel,
                      MHLAConfig(causal=True, chunk_size=chunk, window=window))
    torch.testing.assert_close(out, parallel[:, prefix:])
    assert state.position.tolist() == [37, 37]


def test_attention_rank_exceeds_head_dim():
    """§4.3: global linear attention has rank ≤ d; MHLA's rank grows with M."""
    dim, n = 4, 64
    q, k, _, _ = _inputs((8, 8), (1, 1), batch=1, heads=1, kv_heads=1, dim=dim)
    q, k = q.double(), k.double()
    glob = mhla_weights_reference(q, k, torch.ones(1, 1, dtype=torch.float64), grid=(8, 8), blocks=(1, 1))[0, 0]
    mix = torch.rand(16, 16, dtype=torch.float64) + 0.1
    mhla = mhla_weights_reference(q, k, mix, grid=(8, 8), blocks=(4, 4))[0, 0]
    assert glob.shape == mhla.shape == (n, n)
    assert torch.linalg.matrix_rank(glob) <= dim
    assert torch.linalg.matrix_rank(mhla) > dim


def test_block_layout_roundtrip_and_ids():
    layout = BlockLayout.create((5, 3, 4), (2, 3, 2))
    assert layout.block_size == (3, 1, 2) and layout.num_blocks == 12
    x = torch.randn(2, 60, 3, 4)
    torch.testing.assert_close(layout.from_blocks(layout.to_blocks(x)), x)
    ids = layout.block_ids()
    blocks = layout.to_blocks(ids.view(1, 60, 1, 1).float() + 1)[0, 0, :, :, 0]  # 0 where padded
    for b in range(12):
        real = blocks[b][blocks[b] > 0]
        assert torch.all(real == b + 1)


BAD = [
    (dict(q=(2, 12, 4)), "q must be (B, N, H, D)"), (dict(grid=(3, 5)), "prod(grid) must equal N=12"),
    (dict(blocks=(2,)), "blocks must have one entry per grid axis"),
    (dict(blocks=(2, 5)), "blocks[1] must be in [1, 4]"),
    (dict(mixing=(3, 3)), "mixing must be (M, M) = (4, 4) or (H, M, M) = (4, 4, 4)"),
    (dict(mixing=(2, 4, 4)), "mixing must be (M, M)"), (dict(causal=True), "causal attention needs a 1-D grid"),
    (dict(k=(2, 12, 3, 8), v=(2, 12, 3, 8)), "q heads (4) must be a multiple of k/v heads (3)"),
    (dict(k=(2, 11, 2, 8)), "k must be (B=2, N=12, H_kv, D=8)"),
    (dict(v=(2, 12, 1, 8)), "v must be (B=2, N=12, H_kv=2, D_v)"), (dict(grid=None), "grid is required"),
    (dict(feature_map="gelu"), "feature_map must be one of"),
]


def test_inputs_on_several_devices_named():
    q = torch.rand(2, 12, 4, 8)
    with pytest.raises(ValueError, match="q, k, v and mixing must be on one device; got cpu, cpu, cpu, meta"):
        mhla_attention(q, q, q, torch.rand(4, 4, device="meta"), grid=(3, 4), blocks=(2, 2))


@pytest.mark.parametrize("change,message", BAD)
def test_bad_input_names_the_argument(change, message):
    shapes = dict(q=(2, 12, 4, 8), k=(2, 12, 2, 8), v=(2, 12, 2, 8), mixing=(4, 4))
    kw = dict(grid=(3, 4), blocks=(2, 2))
    for name in list(change):
        if name in shapes:
            shapes[name] = change.pop(name)
    kw.update(change)
    tensors = {name: torch.rand(shape) for name, shape in shapes.items()}
    with pytest.raises(
        ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    ):
        mhla_attention(tensors["q"], tensors["k"], tensors["v"], tensors["mixing"], **kw)
