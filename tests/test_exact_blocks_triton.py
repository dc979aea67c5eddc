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

from mhla_convert.kernels import exact_blocks_triton, settings
from mhla_convert.ops import BlockLayout, mhla_attention
from mhla_convert.ops.dispatch import select
from mhla_convert.ops.exact_blocks import exact_radius_axes, mhla_attention_exact_blocks_torch
from mhla_convert.ops.exact_op import exact_attention_op
from mhla_convert.ops.feature_maps import FEATURE_MAPS

pytestmark = pytest.mark.usefixtures("poisoned_kernel_buffers")  # (conftest.py)


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
    """Token tiles of 16, forward and backward: blocks of a few dozen tokens then take several tiles, in the
    summaries and the readout, as query tiles and as key tiles."""
    backward = {dim: own._replace(tokens=16) for dim, own in settings.SETTINGS.exact_blocks_backward.items()}
    monkeypatch.setattr(settings, "SETTINGS", dataclasses.replace(settings.SETTINGS, tile_tokens=16,
                                                                  exact_blocks_backward=backward))


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
@pytest.mark.parametrize("tiles", [(16, 8), (8, 32)], ids=["keys-smaller", "keys-larger"])
def test_key_tiles_of_another_size_than_query_tiles(monkeypatch, tiles):
    """The forward's key tile (`Launch.keys`) apart from its query tile: blocks of 25 tokens in query tiles of 16
    and key tiles of 8 (four, the last partial), and the reverse (one key tile covers the block), with a key_mask."""
    tokens, keys = tiles
    forward = {dim: own._replace(tokens=tokens, keys=keys)
               for dim, own in settings.SETTINGS.exact_blocks_forward.items()}
    monkeypatch.setattr(settings, "SETTINGS", dataclasses.replace(settings.SETTINGS, exact_blocks_forward=forward))
    case = (2, (10, 9), (2, 2), 2, 1, 8, 8, 1, True, "elu")
    (q, k, v, mixing), layout = _inputs(case)
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
def test_gradients_match_torch_path(name, kernels_only):
    """Training through mhla_attention(backend="triton"): the forward's kernels, then the backward's."""
    grads = []
    for tensors, out in _trained_by_backend(CASES[name]):
        out.backward(torch.linspace(-1, 1, out.numel(), device=DEVICE).view_as(out))
        grads.append([out.detach()] + [t.grad for t in tensors])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@run
def test_second_order_gradients_match_torch_path():
    """A create_graph=True backward recomputes through the torch path (the backward kernels have no backward),
    which autograd differentiates again: a second backward through it gives the torch backend's second-order
    gradients (fp32)."""
    assert exact_blocks_triton.backward_unsupported_reason(create_graph=True)
    assert exact_blocks_triton.backward_unsupported_reason(create_graph=False) is None
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


# --- the backward kernels ----------------------------------------------------------------------------------------
@pytest.fixture
def kernels_only(monkeypatch):
    """A backward that ran the torch path again instead of the backward kernels fails."""
    def refused(*args, **kwargs):
        raise AssertionError("the backward recomputed through the torch path")

    monkeypatch.setattr(exact_blocks_triton, "recomputed_grads", refused)


_GRADS = ("output", "q", "k", "v", "mixing")


def _key_mask(q, seed=1):
    """About a fifth of the keys masked at random, and the first third of the last row's."""
    key_mask = torch.rand(q.shape[:2], generator=torch.Generator().manual_seed(seed)).to(DEVICE) > 0.2
    key_mask[-1, : q.shape[1] // 3] = False
    return key_mask


def _grads(fn, tensors, layout, do, **options):
    """[output, dq, dk, dv, dmixing] of fn on fresh leaf copies of `tensors` (q, k, v, mixing)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves, layout, **options)
    out.backward(do)
    return [out.detach()] + [t.grad for t in leaves]


def _output_grad(q, v, seed=2):
    """A random output gradient (B, N, H, Dv) in q's dtype."""
    do = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(seed))
    return do.to(device=DEVICE, dtype=q.dtype)


def _both_grads(case, tensors, layout, key_mask=None, references=(None,), **kw):
    """The Triton backend's [output, dq, dk, dv, dmixing], and the torch path's for each of `references` (a dtype
    to cast the inputs to first, or None), for the same random output gradient."""
    options = _options(case, key_mask=key_mask, **kw)
    do = _output_grad(tensors[0], tensors[2])
    got = _grads(exact_blocks_triton.mhla_attention_exact_blocks_triton, tensors, layout, do, **options)
    for name, g, t in zip(_GRADS, got, (tensors[0], *tensors)):
        assert g.dtype == t.dtype and torch.isfinite(g).all(), name
    wanted = []
    for dtype in references:
        ref = tensors if dtype is None else [t.to(dtype) for t in tensors]
        wanted.append(_grads(mhla_attention_exact_blocks_torch, ref, layout, do.to(ref[0].dtype), **options))
    return got, *wanted


# batch, grid, blocks, heads, kv heads, D, Dv, exact radius, per-head mixing, feature map (as CASES; small enough for
# the interpreter's backward)
GRAD_CASES = {
    "1d-r0-batch-gqa-shared": (2, (12,), (3,), 2, 1, 8, 8, 0, False, "relu"),
    "1d-partial-block-batch-gqa-per-head": (2, (13,), (4,), 2, 1, 8, 8, 1, True, "elu"),
    "1d-empty-block": (1, (5,), (4,), 2, 2, 4, 4, 1, False, "relu"),  # blocks of 2: the fourth holds no token
    "2d-odd-grid-gqa-shared-dv": (1, (5, 7), (2, 3), 2, 1, 6, 5, 1, False, "elu"),
    "2d-per-axis-per-head": (1, (7, 6), (3, 2), 2, 2, 4, 6, (1, 0), True, "relu"),
    "3d-r1": (1, (5, 4, 2), (3, 2, 1), 1, 1, 4, 4, 1, False, "elu"),  # 27 offsets, most off the grid; far on axis 0
    "3d-per-axis-gqa-per-head": (1, (2, 4, 6), (2, 2, 3), 2, 1, 4, 4, (1, 0, 1), True, "elu"),
    "radius-covers-all": (1, (4, 5), (2, 2), 2, 1, 4, 4, (1, 2), True, "elu"),  # no summaries, no dS̃
}


@run
@pytest.mark.parametrize("masked", [False, True], ids=["", "key-mask"])
@pytest.mark.parametrize("name", GRAD_CASES)
def test_backward_matches_torch_path_fp32(name, masked, kernels_only):
    """Gradients of q, k, v and the mixing from the backward kernels against the torch path's autograd."""
    case = GRAD_CASES[name]
    (q, k, v, mixing), layout = _inputs(case)
    far = any(r < b - 1 for r, b in zip(_options(case)["exact_radius"], layout.blocks))
    assert far == (name != "radius-covers-all")  # (every other case has a far part: summaries and dS̃)
    got, want = _both_grads(case, (q, k, v, mixing), layout, _key_mask(q) if masked else None)
    for what, g, w in zip(_GRADS, got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
        assert _rel(g, w) < 1e-5, what


@run
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["2d-odd-grid-gqa-shared-dv", "3d-per-axis-gqa-per-head"])
def test_backward_half_precision(name, dtype, kernels_only):
    """Half inputs: the gradients close to the torch path's on the same inputs, and against the float64 torch path
    within a few roundings of the dtype. (The torch path's own mixing gradient rounds nothing: it takes the half
    inputs into float32 throughout; the kernels' products take half operands, bf16 summaries for bf16 inputs, and
    Δ = do·o from the output as stored.)"""
    case = GRAD_CASES[name]
    (q, k, v, mixing), layout = _inputs(case, dtype)
    got, want, exact = _both_grads(case, (q, k, v, mixing), layout, _key_mask(q), references=(None, torch.float64))
    for what, g, w, x in zip(_GRADS, got, want, exact):
        assert _rel(g, w) < 2e-2, what
        assert _rel(g, x) < max(4 * _rel(w, x), 3 * torch.finfo(dtype).eps), what


@run
@pytest.mark.parametrize("radius", [1, (1, 0)], ids=["r1", "r10"])
def test_backward_several_tiles_per_block_and_head_dim_72(small_tiles, kernels_only, radius):
    """Blocks of 5 × 5 = 25 tokens in 16-token tiles (query tiles and key tiles, one of them partial), the last
    blocks partial, head dims 72 (padded to 128 columns), GQA, a per-head mixing and a key_mask."""
    case = (1, (10, 9), (2, 2), 2, 1, 72, 72, radius, True, "elu")
    (q, k, v, mixing), layout = _inputs(case)
    got, want = _both_grads(case, (q, k, v, mixing), layout, _key_mask(q))
    for what, g, w in zip(_GRADS, got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@run
def test_backward_zero_and_negative_weights_large_scores(kernels_only):
    """Neighbourhood weights of 0 and below (blocks the forward leaves out: their weights get no gradient), a
    row of all zeros, scores spread over hundreds and a large eps, against the float64 torch path: the saved
    log-normaliser must carry the shift."""
    case = (1, (6, 6), (3, 3), 3, 1, 8, 8, 1, True, "relu")  # 3 × 3 blocks of 4 tokens
    (q, k, v, mixing), layout = _inputs(case, spread=8.0)
    mixing = mixing.clone()
    mixing[0].diagonal()[::2] = 0  # own block of even blocks, head 0
    mixing[0, 1, 2] = -0.5  # a neighbour below 0: left out, as one of weight 0
    mixing[1, 4, :] = 0  # every block for block 4, head 1: the rows' output is 0
    mixing[1, 0, [1, 3, 4]] = 0  # block 0's whole neighbourhood but itself, head 1
    mixing[2, 8, [4, 5, 7, 8]] = 0  # block 8's whole neighbourhood: summaries only, head 2
    got, want = _both_grads(case, (q, k, v, mixing), layout, eps=0.3, references=(torch.float64,))
    for what, g, w in zip(_GRADS, got, want):
        assert _rel(g, w) < 1e-4, what
    assert got[4][0, 1, 2] == 0 and got[4][1, 4].abs().sum() == 0


@run
def test_backward_a_wan_sized_block(kernels_only):
    """Blocks of 3 × 10 × 10 = 300 tokens at the default backward tiles (ten 32-token tiles for head dim 128)."""
    case = (1, (3, 20, 10), (1, 2, 1), 1, 1, 128, 128, (0, 0, 0), False, "relu")
    (q, k, v, mixing), layout = _inputs(case, spread=0.3)
    got, want = _both_grads(case, (q, k, v, mixing), layout)
    for what, g, w in zip(_GRADS, got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@run
@pytest.mark.parametrize("name", ["2d-per-axis-per-head", "2d-odd-grid-gqa-shared-dv"])
def test_registered_backward_matches_autograd(name, kernels_only):
    """The registered backward (the custom op's, from the inputs alone) gives the eager autograd path's gradients
    exactly: the same launches, the forward's output, lse and summaries made again. dmixing is zeros when not
    asked for."""
    case = GRAD_CASES[name]
    (q, k, v, mixing), layout = _inputs(case)
    key_mask = _key_mask(q)
    options = _options(case, key_mask=key_mask)
    do = _output_grad(q, v)
    eager = _grads(exact_blocks_triton.mhla_attention_exact_blocks_triton, (q, k, v, mixing), layout, do, **options)
    registered = exact_blocks_triton.mhla_attention_exact_blocks_triton_backward(
        do, q, k, v, mixing, layout, needs_grad=[True, True, True, False], **options)
    for what, g, w in zip(_GRADS[1:4], registered, eager[1:4]):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
    assert (registered[3] == 0).all() and registered[3].shape == mixing.shape
    dmix = exact_blocks_triton.mhla_attention_exact_blocks_triton_backward(
        do, q, k, v, mixing, layout, needs_grad=[False, False, False, True], **options)[3]
    torch.testing.assert_close(dmix, eager[4], rtol=0, atol=0)


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


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("radius", [1, (0, 1, 1)], ids=["r1", "r011"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_cuda_backward_wan_shape_bf16(radius, per_head, kernels_only):
    """bf16 training at a slice of Wan2.1's 480p latent (9 × 30 × 52 patches, heads of 128) in blocks of
    3 × 10 × 9 tokens (the last ones partial): the backward kernels' gradients against the torch path's on the same
    inputs and against the float64 torch path, within a few bf16 roundings (2 heads keep the float64 torch path's
    saved score tensors to a few GB)."""
    torch.manual_seed(0)
    grid, blocks, heads, dim = (9, 30, 52), (3, 3, 6), 2, 128
    n, m = math.prod(grid), math.prod(blocks)
    q, k, v = (torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mixing = torch.rand(*((heads,) if per_head else ()), m, m, device="cuda") + 0.05
    do = torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16)
    kw = dict(grid=grid, blocks=blocks, exact_radius=radius)
    found = []
    for backend, dtype in (("auto", None), ("torch", None), ("torch", torch.float64)):
        leaves = [(t if dtype is None else t.to(dtype)).detach().requires_grad_() for t in (q, k, v, mixing)]
        out = mhla_attention(*leaves, backend=backend, **kw)
        out.backward(do.to(out.dtype))
        found.append([out.detach()] + [t.grad for t in leaves])
        del out, leaves
    for what, got, want, exact in zip(_GRADS, *found):
        assert torch.isfinite(got).all(), what
        assert _rel(got, want) < 2e-2, what
        assert _rel(got, exact) < max(4 * _rel(want, exact), 3 * torch.finfo(torch.bfloat16).eps), what
