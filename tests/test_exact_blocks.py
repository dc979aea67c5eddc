"""Non-causal MHLA with an exact block neighbourhood (`exact_radius`): the torch path and the custom op against
the O(N²) reference (masked softmax plus mixed summaries)."""

import pytest
import torch

from mhla_convert.ops import BlockLayout, mhla_attention, mhla_attention_reference
from mhla_convert.ops.exact_blocks import exact_mask, exact_radius_axes
from mhla_convert.ops.exact_op import exact_attention_op

CASES = {  # batch, grid, blocks, heads, kv heads, head dim, value dim, radius
    "1d-own-block": (1, (12,), (3,), 2, 2, 8, 8, 0),
    "2d-neighbours-gqa": (2, (6, 8), (3, 4), 4, 2, 8, 6, 1),
    "2d-odd-grid": (2, (7, 5), (3, 2), 2, 1, 5, 7, 1),  # partial last blocks: padded slots
    "2d-per-axis": (1, (8, 8), (4, 4), 2, 2, 4, 4, (0, 1)),
    "3d-video": (2, (3, 4, 6), (3, 2, 3), 3, 3, 4, 4, (1, 0, 0)),
    "radius-covers-all": (1, (4, 4), (2, 2), 2, 2, 4, 4, 3),
}


def inputs(batch, grid, blocks, heads, kv_heads, dim, dv, *, dtype=torch.float64, per_head=False, spread=1.0):
    g = torch.Generator().manual_seed(sum(grid) * heads + dim)
    n = torch.tensor(grid).prod().item()
    q = torch.randn(batch, n, heads, dim, generator=g, dtype=dtype) * spread
    k = torch.randn(batch, n, kv_heads, dim, generator=g, dtype=dtype) * spread
    v = torch.randn(batch, n, kv_heads, dv, generator=g, dtype=dtype)
    m = torch.tensor(blocks).prod().item()
    mixing = torch.rand(*((heads,) if per_head else ()), m, m, generator=g, dtype=dtype) + 0.05
    return q, k, v, mixing


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, per_head):
    batch, grid, blocks, heads, kv_heads, dim, dv, radius = CASES[case]
    q, k, v, mixing = inputs(batch, grid, blocks, heads, kv_heads, dim, dv, per_head=per_head)
    got = mhla_attention(q, k, v, mixing, grid=grid, blocks=blocks, exact_radius=radius, feature_map="elu")
    want = mhla_attention_reference(q, k, v, mixing, grid=grid, blocks=blocks, exact_radius=radius, feature_map="elu")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_region_changes_the_result():
    q, k, v, mixing = inputs(*CASES["2d-neighbours-gqa"][:-1])
    plain = mhla_attention(q, k, v, mixing, grid=(6, 8), blocks=(3, 4))
    own = mhla_attention(q, k, v, mixing, grid=(6, 8), blocks=(3, 4), exact_radius=0)
    near = mhla_attention(q, k, v, mixing, grid=(6, 8), blocks=(3, 4), exact_radius=1)
    assert (plain - own).abs().max() > 1e-2 and (own - near).abs().max() > 1e-2


def test_region_mixing_alone_is_softmax_cut_to_the_region():
    """Weight 1 on the neighbourhood and 0 elsewhere: exactly the host's softmax attention masked to it."""
    grid, blocks = (6, 8), (3, 4)
    q, k, v, _ = inputs(2, grid, blocks, 4, 2, 8, 6)
    layout = BlockLayout.create(grid, blocks)
    region = exact_mask(blocks, (1, 1)).double()
    got = mhla_attention(q, k, v, region, grid=grid, blocks=blocks, exact_radius=1)
    ids = layout.block_ids()
    allowed = region[ids][:, ids].bool()
    kk, vv = (t.repeat_interleave(2, dim=2).transpose(1, 2) for t in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=allowed)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-6, atol=1e-6)  # (eps in the normaliser)


@pytest.mark.parametrize("dtype, spread, tol", [
    (torch.float32, 1.0, 1e-5), (torch.float32, 6.0, 2e-3), (torch.bfloat16, 1.0, 3e-2),
])
def test_low_precision(dtype, spread, tol):
    """spread 6: neighbourhood scores far beyond exp's float32 range; the shift keeps them finite."""
    q, k, v, mixing = (t.to(dtype) for t in inputs(2, (6, 8), (3, 4), 4, 2, 16, 16, spread=spread))
    got = mhla_attention(q, k, v, mixing, grid=(6, 8), blocks=(3, 4), exact_radius=1)
    want = mhla_attention_reference(*(t.double() for t in (q, k, v, mixing)), grid=(6, 8), blocks=(3, 4),
                                    exact_radius=1)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", ["2d-odd-grid", "3d-video"])
def test_gradients_match_reference(case):
    batch, grid, blocks, heads, kv_heads, dim, dv, radius = CASES[case]
    tensors = inputs(batch, grid, blocks, heads, kv_heads, dim, dv, per_head=True)
    grads = []
    for fn in (mhla_attention, mhla_attention_reference):
        args = [t.clone().requires_grad_() for t in tensors]
        fn(*args, grid=grid, blocks=blocks, exact_radius=radius).square().sum().backward()
        grads.append([a.grad for a in args])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_key_mask_drops_keys():
    """Masked keys weigh nothing, in the neighbourhood and in the summaries: their values never show."""
    q, k, v, mixing = inputs(1, (12,), (3,), 2, 2, 4, 4)
    key_mask = torch.ones(1, 12, dtype=torch.bool)
    key_mask[0, [1, 6]] = False
    got = mhla_attention(q, k, v, mixing, grid=(12,), blocks=(3,), exact_radius=0, key_mask=key_mask)
    v2 = v.clone()
    v2[0, [1, 6]] = 1e3  # would show if read
    again = mhla_attention(q, k, v2, mixing, grid=(12,), blocks=(3,), exact_radius=0, key_mask=key_mask)
    torch.testing.assert_close(got, again)
    assert (got - mhla_attention(q, k, v, mixing, grid=(12,), blocks=(3,), exact_radius=0)).abs().max() > 1e-3


def test_op_opcheck_and_gradcheck():
    """The custom op torch.compile traces: schema, fake tensors, autograd through the backward op, float64
    gradcheck, and its value against the eager operator."""
    layout = BlockLayout.create((5, 4), (3, 2))

    def args(dtype):
        q, k, v, mixing = inputs(1, (5, 4), (3, 2), 4, 2, 4, 3, dtype=dtype, per_head=True)
        options = [list(layout.grid), list(layout.blocks), list(layout.block_size), False, [1, 0], "relu", 0.5,
                   1e-6, "torch"]
        return [t.requires_grad_() for t in (q, k, v, mixing)], options

    tensors, options = args(torch.float32)
    torch.library.opcheck(exact_attention_op, (*tensors, None, *options))
    tensors, options = args(torch.float64)
    out = exact_attention_op(*tensors, None, *options)
    want = mhla_attention(*tensors, grid=(5, 4), blocks=(3, 2), exact_radius=(1, 0), scale=0.5)
    torch.testing.assert_close(out, want)
    assert torch.autograd.gradcheck(lambda *t: exact_attention_op(*t, None, *options), tensors, fast_mode=True)


@pytest.mark.parametrize("radius", [-1, 1.5, "1", (1, 2, 3), True])
def test_bad_radius_is_refused(radius):
    with pytest.raises(ValueError, match="exact_radius must be"):
        exact_radius_axes(radius, 2)


def test_needs_non_causal_and_normalised():
    q, k, v, mixing = inputs(1, (12,), (3,), 2, 2, 4, 4)
    with pytest.raises(ValueError, match="needs causal=False and normalize=True"):
        mhla_attention(q, k, v, mixing, grid=(12,), blocks=(3,), exact_radius=0, normalize=False)
