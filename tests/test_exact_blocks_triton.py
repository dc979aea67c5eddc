"""The Triton backend of non-causal MHLA with an exact block neighbourhood (`kernels.exact_blocks_triton`) against the
torch path (`ops.exact_blocks`, itself tested against the O(N²) reference in test_exact_blocks.py).

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported) on
tiny shapes; on CUDA the same cases run compiled, plus a Wan-sized one. Every buffer the kernels write is filled
with NaN first, so an element left unwritten fails.
"""

import dataclasses
import math

import pytest
import torch
from triton_marks import DEVICE, INTERPRETED, gpu, run

from mhla_convert.kernels import exact_blocks_triton, mhla_triton, settings
from mhla_convert.ops import BlockLayout, mhla_attention
from mhla_convert.ops.dispatch import select
from mhla_convert.ops.exact_blocks import exact_radius_axes, mhla_attention_exact_blocks_torch
from mhla_convert.ops.exact_op import exact_attention_op
from mhla_convert.ops.feature_maps import FEATURE_MAPS


@pytest.fixture(autouse=True)
def poisoned(poisoned_kernel_buffers, monkeypatch):
    """conftest.py's NaN-filled buffers, for this module's kernels too."""
    monkeypatch.setattr(exact_blocks_triton, "_new", mhla_triton._new)


# batch, grid, blocks, heads, kv heads, D, Dv, exact radius, per-head mixing, feature map
CASES = {
    "1d-own-block-batch": (2, (12,), (3,), 2, 2, 8, 8, 0, False, "relu"),
    "1d-partial-block": (1, (13,), (4,), 2, 1, 8, 8, 1, True, "elu"),
    "1d-empty-block": (1, (5,), (4,), 2, 2, 4, 4, 1, False, "relu"),  # blocks of 2: the fourth holds no token
    "2d-gqa-dv": (1, (6, 8), (3, 4), 4, 2, 8, 6, 1, False, "elu"),
    "2d-odd-grid-per-head": (2, (7, 5), (3, 2), 2, 1, 5, 7, 1, True, "relu"),
    "2d-per-axis": (1, (8, 8), (4, 4), 2, 2, 4, 4, (0, 1), False, "relu"),
    "3d-video-per-axis": (1, (3, 4, 6), (3, 2, 3), 2, 1, 4, 4, (1, 0, 1), True, "elu"),
    "radius-covers-all": (1, (4, 4), (2, 2), 2, 2, 4, 4, 3, False, "elu"),  # no summaries launch
}


def _inputs(case, dtype=torch.float32, spread=1.0, seed=0):
    batch, grid, blocks, heads, kv_heads, dim, dv, _, per_head, _ = case
    layout = BlockLayout.create(grid, blocks)
    g = torch.Generator().manual_seed(seed)
    n, m = layout.num_tokens, layout.num_blocks
    q = torch.randn(batch, n, heads, dim, generator=g) * spread
    k = torch.randn(batch, n, kv_heads, dim, generator=g) * spread
    v = torch.randn(batch, n, kv_heads, dv, generator=g)
    mixing = torch.rand(*((heads,) if per_head else ()), m, m, generator=g) + 0.05
    return [t.to(device=DEVICE, dtype=dtype) for t in (q, k, v)] + [mixing.to(DEVICE)], layout


def _options(case, eps=1e-6, **kw):
    grid, dim, radius, fmap = case[1], case[5], case[7], case[9]
    return dict(exact_radius=exact_radius_axes(radius, len(grid)), phi=FEATURE_MAPS[fmap], scale=dim**-0.5, eps=eps,
                **kw)


def _both(case, q, k, v, mixing, layout, key_mask=None, **kw):
    options = _options(case, key_mask=key_mask, **kw)
    got = exact_blocks_triton.mhla_attention_exact_blocks_triton(q, k, v, mixing, layout, **options)
    want = mhla_attention_exact_blocks_torch(q, k, v, mixing, layout, **options)
    assert got.dtype == q.dtype and got.shape == want.shape
    return got, want


def _rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.fixture
def small_tiles(monkeypatch):
    """Token tiles of 16: blocks of a few dozen tokens then take several tiles, in the summaries and the readout,
    as query tiles and as key tiles."""
    monkeypatch.setattr(settings, "SETTINGS", dataclasses.replace(settings.SETTINGS, tile_tokens=16))


@run
@pytest.mark.parametrize("name", CASES)
def test_matches_torch_path_fp32(name):
    (q, k, v, mixing), layout = _inputs(CASES[name])
    got, want = _both(CASES[name], q, k, v, mixing, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert _rel(got, want) < 1e-5


@run
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["2d-gqa-dv", "3d-video-per-axis"])
def test_half_precision_close_to_torch_path(name, dtype):
    """bf16: summaries and their mixture in bf16 (fp16: float32), neighbourhood products in the input dtype."""
    (q, k, v, mixing), layout = _inputs(CASES[name], dtype)
    got, want = _both(CASES[name], q, k, v, mixing, layout)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    assert _rel(got, want) < 1e-2


@run
@pytest.mark.parametrize("radius", [1, (1, 0)], ids=["r1", "r10"])
def test_several_tiles_per_block_and_head_dim_72(small_tiles, radius):
    """Blocks of 5 × 5 = 25 tokens in 16-token tiles (one of them partial, on a grid that also leaves the last
    blocks partial), head dims 72 (padded to 128 columns) and a key_mask."""
    case = (1, (10, 9), (2, 2), 2, 1, 72, 72, radius, True, "elu")
    (q, k, v, mixing), layout = _inputs(case)
    assert layout.tokens_per_block == 25
    key_mask = torch.rand(q.shape[:2], generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.2
    got, want = _both(case, q, k, v, mixing, layout, key_mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@run
def test_a_wan_sized_block():
    """Blocks of 3 × 10 × 10 = 300 tokens (Wan2.1's at 480p), five 64-token tiles each, at the default tiles;
    head dim 128."""
    case = (1, (3, 20, 10), (1, 2, 1), 1, 1, 128, 128, (0, 0, 0), False, "relu")
    (q, k, v, mixing), layout = _inputs(case, spread=0.3)
    assert layout.tokens_per_block == 300
    got, want = _both(case, q, k, v, mixing, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@run
def test_zero_weights_and_large_scores():
    """Neighbourhood and far weights of 0, against the float64 torch path; scores spread over hundreds and a large
    eps. A block of weight 0 that set the shift (it has no keys) would send every exponential of the row to 0,
    and without the shift exp overflows float32."""
    case = (1, (8, 8), (4, 4), 4, 2, 8, 8, 1, True, "relu")
    (q, k, v, mixing), layout = _inputs(case, spread=8.0)
    mixing = mixing.clone()
    mixing[0].diagonal()[::2] = 0  # own block of even blocks, head 0
    mixing[1, 5, :] = 0  # every block for block 5, head 1: the row's output is 0
    mixing[1, 6, [1, 2, 3, 5, 7, 9, 10, 11]] = 0  # block 6's whole neighbourhood but itself, head 1
    mixing[2, 9, [4, 5, 6, 8, 9, 10, 12, 13, 14]] = 0  # block 9's whole neighbourhood: summaries only, head 2
    mixing[3, :, :8] = 0  # near and far blocks of the upper half, head 3
    options = _options(case, eps=0.3)
    got = exact_blocks_triton.mhla_attention_exact_blocks_triton(q, k, v, mixing, layout, **options)
    want = mhla_attention_exact_blocks_torch(*(t.double() for t in (q, k, v, mixing)), layout, **options)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@run
def test_key_mask_and_strided_inputs():
    """Padding (keys of key_mask False weigh 0, near and far; a whole block masked in one row), and q, k, v as
    strided views."""
    case = CASES["2d-odd-grid-per-head"]
    (q, k, v, mixing), layout = _inputs(case)
    key_mask = torch.ones(q.shape[:2], dtype=torch.bool, device=DEVICE)
    key_mask[1, :11] = False
    key_mask[0, 3::4] = False
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q.is_contiguous()
    got, want = _both(case, q, k, v, mixing, layout, key_mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _trained_by_backend(case):
    """For the Triton backend, then the torch one: fresh leaf copies of the case's inputs, and the output of
    mhla_attention on them (with gradients)."""
    (q, k, v, mixing), _ = _inputs(case)
    kw = dict(grid=case[1], blocks=case[2], exact_radius=case[7], feature_map=case[9])
    for backend in ("triton", "torch"):
        tensors = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
        yield tensors, mhla_attention(*tensors, backend=backend, **kw)


@run
@pytest.mark.parametrize("name", ["2d-odd-grid-per-head", "3d-video-per-axis"])
def test_gradients_match_torch_path(name):
    """Training through mhla_attention(backend="triton"): the forward's kernels, the backward's recompute."""
    grads = []
    for tensors, out in _trained_by_backend(CASES[name]):
        out.backward(torch.linspace(-1, 1, out.numel(), device=DEVICE).view_as(out))
        grads.append([out.detach()] + [t.grad for t in tensors])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@run
def test_second_order_gradients_match_torch_path():
    """The backward recomputes through the torch path, which autograd differentiates again: a create_graph=True
    backward and a second one through it give the torch backend's second-order gradients (fp32)."""
    found = []
    for tensors, out in _trained_by_backend(CASES["1d-partial-block"]):
        first = torch.autograd.grad(out.square().sum(), tensors, create_graph=True)
        found.append(torch.autograd.grad(sum(g.square().sum() for g in first), tensors))
    for name, got, want in zip(("q", "k", "v", "mixing"), *found):
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-5, f"{name}: relative error {err:.1e}"


@run
def test_frozen_mixing_gets_no_gradient():
    case = CASES["1d-own-block-batch"]
    (q, k, v, mixing), _ = _inputs(case)
    q.requires_grad_()
    mhla_attention(q, k, v, mixing, grid=case[1], blocks=case[2], exact_radius=case[7], feature_map=case[9],
                   backend="triton").sum().backward()
    assert q.grad is not None and mixing.grad is None and k.grad is None


@run
def test_custom_op_with_triton_backend():
    """The op that torch.compile traces, with the Triton backend inside: schema, fake tensors, autograd
    registration, and gradients through the registered backward against the torch backend's."""
    case = CASES["2d-odd-grid-per-head"]
    (q, k, v, mixing), layout = _inputs(case)
    tensors = [t.requires_grad_() for t in (q, k, v, mixing)]
    key_mask = torch.ones(q.shape[:2], dtype=torch.bool, device=DEVICE)
    key_mask[0, :4] = False
    radius = list(exact_radius_axes(case[7], len(case[1])))
    options = [list(layout.grid), list(layout.blocks), list(layout.block_size), False, radius, case[9],
               case[5] ** -0.5, 1e-6]
    torch.library.opcheck(exact_attention_op, (*tensors, key_mask, *options, "triton"),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    outs = []
    for backend in ("triton", "torch"):
        out = exact_attention_op(*tensors, key_mask, *options, backend)
        outs.append((out, torch.autograd.grad(out, tensors, torch.ones_like(out))))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    for got, want in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dispatch():
    """"auto" takes the kernels for CUDA inputs only (never the interpreter); a named "triton" refuses what the
    kernels cannot take, by name."""
    case = CASES["1d-own-block-batch"]
    (q, k, v, mixing), layout = _inputs(case)
    q, k, v, mixing = (t.cpu() for t in (q, k, v, mixing))
    picked = select("exact_blocks", "auto", mhla_attention_exact_blocks_torch, q, k, v, mixing, layout,
                    exact_radius=(0,), phi=FEATURE_MAPS["relu"], key_mask=None)
    assert picked is mhla_attention_exact_blocks_torch
    picked = select("exact_blocks", "triton", mhla_attention_exact_blocks_torch, q, k, v, mixing, layout,
                    exact_radius=(0,), phi=FEATURE_MAPS["relu"], key_mask=None)
    assert picked is exact_blocks_triton.mhla_attention_exact_blocks_triton
    kw = dict(grid=case[1], blocks=case[2], exact_radius=0, backend="triton")
    with pytest.raises(ValueError, match="callable feature map"):
        mhla_attention(q, k, v, mixing, feature_map=torch.sigmoid, **kw)
    with pytest.raises(ValueError, match="dtypes torch.float64"):
        mhla_attention(q.double(), k.double(), v.double(), mixing, **kw)
    if INTERPRETED:
        wide = torch.zeros(*q.shape[:3], 160)
        with pytest.raises(ValueError, match="head dims 160/160"):
            mhla_attention(wide, wide, wide, mixing, **kw)
    else:
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            mhla_attention(q, k, v, mixing, **kw)


# --- CUDA: a realistic video shape -------------------------------------------------------------------------------
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("radius", [0, 1, (0, 1, 1)], ids=["r0", "r1", "r011"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_cuda_wan_shape_bf16(radius, per_head):
    """bf16, Wan2.1 at 480p (21 × 30 × 52 latent patches, heads of 128; 4 of them, which keeps the float64 torch
    path's neighbourhood scores to ~8 GB) in blocks of 3 × 10 × 9 tokens (the last ones partial): the kernels
    (chosen by "auto") against the torch path, and against the float64 torch path (the kernels' error is within the
    torch path's own bf16 error)."""
    torch.manual_seed(0)
    grid, blocks, heads, dim = (21, 30, 52), (7, 3, 6), 4, 128
    n = math.prod(grid)
    q, k, v = (torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    m = math.prod(blocks)
    mixing = torch.rand(*((heads,) if per_head else ()), m, m, device="cuda") + 0.05
    kw = dict(grid=grid, blocks=blocks, exact_radius=radius)
    got = mhla_attention(q, k, v, mixing, backend="auto", **kw)
    want = mhla_attention(q, k, v, mixing, backend="torch", **kw)
    exact = mhla_attention(q.double(), k.double(), v.double(), mixing.double(), backend="torch", **kw)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert _rel(got, want) < 1e-2
    assert _rel(got, exact) < 2 * _rel(want, exact) + 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_cases_with_key_mask(name, dtype):
    (q, k, v, mixing), layout = _inputs(CASES[name], dtype)
    key_mask = torch.ones(q.shape[:2], dtype=torch.bool, device=DEVICE)
    key_mask[-1, : q.shape[1] // 3] = False
    got, want = _both(CASES[name], q, k, v, mixing, layout, key_mask)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
