"""The Triton backend against the torch path (itself tested against the O(N²) reference).

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set
here before Triton is imported), on small float32 shapes, so CI covers the kernel logic; on CUDA
the same cases run compiled, plus the dtypes and head dims of the target families. Every buffer
the kernels write is poisoned with NaN first, so an element left unwritten fails.
"""

import copy
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

from mhla_convert.kernels import mhla_triton, settings  # noqa: E402
from mhla_convert.ops import (  # noqa: E402
    BlockLayout,
    mhla_attention,
    mhla_attention_reference,
)
from mhla_convert.ops.dispatch import select  # noqa: E402
from mhla_convert.ops.feature_maps import resolve_feature_map  # noqa: E402

# The interpreter must be on before anything imports triton.language (diffusers, torch._inductor, …):
# otherwise Triton's own helpers stay compiled-only. When this process was too late, the
# interpreter cases run in a fresh subprocess instead (test_interpreter_in_subprocess).


def _interpreter_works() -> bool:
    if type(mhla_triton.K._readout_kernel).__name__ != "InterpretedFunction":
        return False
    try:
        mhla_attention(*(torch.ones(1, 4, 1, 16),) * 3, torch.ones(1, 1), grid=(4,), blocks=(1,), backend="triton")
        return True
    except triton.runtime.errors.InterpreterError:
        return False


INTERPRETED = _interpreter_works()
CUDA = torch.cuda.is_available() and not INTERPRETED
interp = pytest.mark.skipif(
    not INTERPRETED, reason="kernels are compiled here, or triton was imported before TRITON_INTERPRET=1"
)
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (and no TRITON_INTERPRET)")


pytestmark = pytest.mark.usefixtures("poisoned_kernel_buffers")  # (conftest.py)


def _settings(monkeypatch, **changes):
    """The launch settings with `changes` for this test (to reach a kernel on small shapes)."""
    monkeypatch.setattr(settings, "SETTINGS", replace(settings.SETTINGS, **changes))


# the one-tile mixing kernel for M ≤ 16 (one tile of 16 rows), which the shipped settings leave to the tiled one
ONE_TILE_16 = {(16, kind): (16, 4, 2, 4) for kind in ("half", "float", "grad", "grad_float")}


# (grid, blocks, chunk_size, causal, H, H_kv, D, Dv, per-head mixing, normalize, feature map)
CASES = {
    "2d-odd-grid": ((7, 9), (2, 3), None, False, 2, 2, 16, 16, False, True, "relu"),
    "3d-odd-grid-gqa-per-head-elu-unnorm": ((5, 3, 4), (2, 2, 3), None, False, 4, 2, 16, 24, True, False, "elu"),
    "1d-gqa-shared": ((50,), (4,), None, False, 4, 1, 32, 16, False, True, "elu"),
    "causal-ragged-gqa": ((37,), None, 16, True, 4, 2, 16, 16, False, True, "relu"),
    "causal-per-head-elu-unnorm": ((45,), None, 16, True, 2, 2, 16, 32, True, False, "elu"),
    "causal-blocks": ((40,), (3,), None, True, 4, 2, 24, 20, True, True, "relu"),
    # head dims in two column parts in the forward (40 = 32 + 16, 72 = 64 + 16)
    "split-head-dims-gqa": ((5, 7), (2, 2), None, False, 2, 1, 40, 72, True, True, "relu"),
    "split-key-dim-elu-unnorm": ((6, 5), (3, 2), None, False, 2, 2, 72, 32, False, False, "elu"),
}


def _inputs(case, dtype, device, batch=2):
    grid, blocks, chunk, causal, heads, kv_heads, dim, dv, per_head, _, _ = case
    n = torch.Size(grid).numel()
    layout = BlockLayout.chunked(n, chunk) if chunk else BlockLayout.create(grid, blocks)
    m = layout.num_blocks
    q = torch.randn(batch, n, heads, dim, device=device)
    k = torch.randn(batch, n, kv_heads, dim, device=device)
    v = torch.randn(batch, n, kv_heads, dv, device=device)
    mixing = torch.rand(*((heads,) if per_head else ()), m, m, device=device) + 0.1
    if causal:
        mixing = mixing.tril()
    return [t.to(dtype).requires_grad_() for t in (q, k, v)] + [mixing.requires_grad_()]


def _run(case, tensors, backend, grad_out):
    grid, blocks, chunk, causal, *_, normalize, fmap = case
    for t in tensors:
        t.grad = None
    out = mhla_attention(*tensors, grid=grid, blocks=blocks, chunk_size=chunk, causal=causal, normalize=normalize,
                         feature_map=fmap, backend=backend)
    out.backward(grad_out)
    return [out.detach().float()] + [t.grad.float() for t in tensors]


def _assert_close(name, got, want, own, tol, times=2.0):
    """got against the float32 reference want: within tol, or, for half inputs, within `times` the torch
    path's own error `own` in that dtype (same inputs, float32 accumulation; tol is then only a floor)."""
    assert torch.isfinite(got).all(), f"{name}: non-finite (an unwritten element?)"
    err = ((got.float() - want).norm() / want.norm()).item()
    own_err = None if own is None else ((own.float() - want).norm() / want.norm()).item()
    bound = tol if own is None else max(tol, times * own_err)
    assert err < bound, f"{name}: relative error {err:.2e} ≥ {bound:.1e} (torch path in its dtype: {own_err})"


# The mixing gradient's (floor, times the torch path's own error) for half inputs. bf16: a floor, causal as
# non-causal (its errors are 1.1-2x the torch path's own). fp16: its own error alone (1-2x with the float32
# summaries' products as tf32x3; as tf32 they were 2.7-3.8x)
MIXING_BOUND = {torch.bfloat16: (4e-3, 2.0), torch.float16: (1e-5, 2.5)}


def _compare(case, dtype, device, tol):
    torch.manual_seed(0)
    tensors = _inputs(case, dtype, device)
    # the reference: torch path on float32 copies of the same inputs
    ref_in = [t.detach().float().requires_grad_() for t in tensors]
    out_shape = (*tensors[0].shape[:3], tensors[2].shape[-1])
    grad_out = torch.randn(out_shape, device=device)
    want = _run(case, ref_in, "torch", grad_out)
    got = _run(case, tensors, "triton", grad_out.to(dtype))
    own = _run(case, tensors, "torch", grad_out.to(dtype)) if dtype != torch.float32 else [None] * len(got)
    for name, g, w, o in zip(("out", "dq", "dk", "dv", "dmixing"), got, want, own):
        floor, times = MIXING_BOUND.get(dtype, (tol, 2.0)) if name == "dmixing" else (tol, 2.0)
        _assert_close(name, g, w, o, min(tol, floor), times)


@interp
@pytest.mark.parametrize("name", CASES)
def test_interpreter_matches_torch(name):
    _compare(CASES[name], torch.float32, "cpu", 1e-5)


@interp
def test_interpreter_half_causal_mixing_gradient():
    """fp16 under the interpreter (its products are exact): the causal mixing gradient within 1.5x of the torch
    path's own error. That needs the query side's output at float32 precision (a chunk's ∂/∂m_ii is the
    difference of two large sums) and the mixing GEMM's float32 summaries in hi + lo parts."""
    case = CASES["causal-ragged-gqa"]
    torch.manual_seed(0)
    tensors = _inputs(case, torch.float16, "cpu")
    grad_out = torch.randn(*tensors[0].shape[:3], tensors[2].shape[-1])
    want = _run(case, [t.detach().float().requires_grad_() for t in tensors], "torch", grad_out)[-1]
    got, own = (_run(case, tensors, backend, grad_out.half())[-1] for backend in ("triton", "torch"))
    err, own_err = (((x - want).norm() / want.norm()).item() for x in (got, own))
    assert err < 1.5 * own_err, f"mixing gradient: relative error {err:.2e}, the torch path's {own_err:.2e}"


def _zero_feature_query_gradients(name, dtype, device):
    """A query whose relu features are all zero (den = 0, so 1/(den + eps) = 1/eps) in half precision: every
    gradient finite and within the bound of `_assert_close` against the float32 torch path."""
    case = CASES[name]
    torch.manual_seed(0)
    tensors = _inputs(case, dtype, device)
    with torch.no_grad():
        tensors[0][:, 5] = -tensors[0][:, 5].abs()  # relu(q) = 0 for token 5 of every head
    grad_out = torch.randn(*tensors[0].shape[:3], tensors[2].shape[-1], device=device)
    want = _run(case, [t.detach().float().requires_grad_() for t in tensors], "torch", grad_out)
    got = _run(case, tensors, "triton", grad_out.to(dtype))
    own = _run(case, tensors, "torch", grad_out.to(dtype))
    for label, g, w, o in zip(("out", "dq", "dk", "dv", "dmixing"), got, want, own):
        _assert_close(label, g, w, o, TOL[dtype])


@interp
@pytest.mark.parametrize("name", ["2d-odd-grid", "causal-ragged-gqa", "causal-blocks"])
def test_interpreter_zero_feature_query_gradients(name):
    """(fp16: do / eps rounded to fp16 overflowed, and inf · 0 made the gradients NaN)"""
    _zero_feature_query_gradients(name, torch.float16, "cpu")


@interp
def test_interpreter_split_blocks_and_reference(monkeypatch):
    """Large blocks split over programs (atomics into summaries and dS̃), checked against the
    O(N²) reference rather than the torch path."""
    monkeypatch.setattr(mhla_triton, "_programs_wanted", lambda device: 64)
    grid, blocks = (9, 40), (3, 1)
    q, k, v = torch.randn(1, 360, 2, 16), torch.randn(1, 360, 2, 16), torch.randn(1, 360, 2, 16)
    mixing = torch.rand(3, 3)
    got = mhla_attention(q, k, v, mixing, grid=grid, blocks=blocks, backend="triton")
    want = mhla_attention_reference(q, k, v, mixing, grid=grid, blocks=blocks)
    assert ((got - want).norm() / want.norm()) < 1e-5
    _compare(((9, 40), (3, 1), None, False, 2, 2, 16, 16, True, True, "relu"), torch.float32, "cpu", 1e-5)
    # shared, GQA
    _compare(((9, 40), (3, 1), None, False, 4, 2, 16, 16, False, True, "elu"), torch.float32, "cpu", 1e-5)


@interp
def test_interpreter_frozen_mixing():
    """A frozen mixing: no gradient for it (at float32 neither the partials' launch nor their sum runs), and
    dq, dk, dv as the torch path's."""
    case = CASES["1d-gqa-shared"]
    grid, blocks, *_ = case
    torch.manual_seed(0)
    *qkv, mixing = _inputs(case, torch.float32, "cpu")
    mixing = mixing.detach()
    grads = []
    for backend in ("torch", "triton"):
        out = mhla_attention(*qkv, mixing, grid=grid, blocks=blocks, feature_map="elu", backend=backend)
        grads.append(torch.autograd.grad(out.square().sum(), qkv))
    for name, got, want in zip(("dq", "dk", "dv"), grads[1], grads[0]):
        _assert_close(name, got, want, None, 1e-5)


def _compare_forward(case, dtype, device, tol):
    """Inference (no autograd: no Function, half-precision summaries for half inputs), against the
    float32 torch path (same 2x rule)."""
    torch.manual_seed(1)
    q, k, v, mixing = (t.detach() for t in _inputs(case, dtype, device))
    grid, blocks, chunk, causal, *_, normalize, fmap = case
    kw = dict(grid=grid, blocks=blocks, chunk_size=chunk, causal=causal, normalize=normalize, feature_map=fmap)
    with torch.no_grad():
        want = mhla_attention(q.float(), k.float(), v.float(), mixing, backend="torch", **kw)
        got = mhla_attention(q, k, v, mixing, backend="triton", **kw)
        own = mhla_attention(q, k, v, mixing, backend="torch", **kw).float()
    assert got.grad_fn is None, "an autograd node"
    _assert_close("out", got, want, None if dtype == torch.float32 else own, tol)


@interp
@pytest.mark.parametrize("name", CASES)
def test_interpreter_forward_only(name):
    _compare_forward(CASES[name], torch.float32, "cpu", 1e-5)


@interp
def test_interpreter_launch_plans_cached_per_signature(monkeypatch):
    """Launches are planned once per input signature and shared by later calls: calls of one shape that differ
    in a single option, the mixing's form or the settings table each get a plan of their own (each result is the
    torch path's), and a repeated call plans nothing."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 63, 2, 16) for _ in range(3))
    base = dict(grid=(7, 9), blocks=(2, 3), feature_map="relu", normalize=True, scale=None, eps=1e-6)
    variants = [{}, dict(scale=0.5), dict(eps=0.5), dict(normalize=False), dict(feature_map="elu"),
                dict(per_head=True), dict(tile_tokens=32)]
    plans = mhla_triton._launches_of
    plans.cache_clear()
    for i, change in enumerate(variants):
        if "tile_tokens" in change:
            _settings(monkeypatch, tile_tokens=change["tile_tokens"])
        kw = {**base, **{key: value for key, value in change.items() if key in base}}
        mixing = torch.rand(*((2,) if change.get("per_head") else ()), 6, 6)
        with torch.no_grad():
            got = mhla_attention(q, k, v, mixing, backend="triton", **kw)
            want = mhla_attention(q, k, v, mixing, backend="torch", **kw)
        _assert_close(f"out with {change}", got, want, None, 1e-5)
        assert plans.cache_info().currsize == i + 1, f"{change} found the plan of another signature"
    with torch.no_grad():
        mhla_attention(q, k, v, mixing, backend="triton", **kw)
    assert plans.cache_info().currsize == len(variants), "a repeated call was planned again"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sweep", [True, False], ids=["sweep", "tiled"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mixing_keeps_float32_weights_for_half_summaries(sweep, causal, dtype, monkeypatch):
    """Half summaries times float32 mixing weights: the product must keep the weights' precision (the
    sweep kernel splits them into hi + lo half parts), so half-exact inputs give float32-exact sums."""
    if not (INTERPRETED or CUDA) or (INTERPRETED and dtype == torch.bfloat16):
        pytest.skip("needs the interpreter or a GPU (and the interpreter's bf16 tl.dot is wrong: Triton 3.6)")
    # (M = 7: one tile of 16 rows)
    _settings(monkeypatch, mix_sweep={(16, "half"): (16, 4, 2, 4)} if sweep else {})
    launched, real_run = [], mhla_triton._run
    monkeypatch.setattr(mhla_triton, "_run", lambda fn, *a: launched.append(fn) or real_run(fn, *a))
    device = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    m, heads, dim = 7, 2, 16
    layout = BlockLayout.chunked(m * 4, 4) if causal else BlockLayout.create((m,), (m,))
    q = torch.empty(1, m * 4 if causal else m, heads, dim, device=device, dtype=dtype)
    mixing = torch.rand(heads, m, m, device=device) + 1e-3  # many more than 8 significant bits
    plan = mhla_triton._launches_for(q, q, q, mixing, layout, causal=causal, phi=resolve_feature_map("relu"),
                                     normalize=True, scale=1.0, eps=1e-6).p
    s = torch.randn(1, heads, m, plan.cols, device=device).to(dtype)
    out = torch.full((1, heads, m, plan.cols), float("nan"), device=device)
    mhla_triton._mix(plan, mixing, s, out, kind="mix_half")
    assert launched == [mhla_triton.K._mix_sweep_kernel if sweep else mhla_triton.K._mix_kernel]
    w = mixing.tril(-1) if causal else mixing
    want = w @ s.float()
    err = ((out - want).norm() / want.norm()).item()
    assert err < 2e-5, f"relative error {err:.1e}: the weights were rounded to half precision"


def _block_sums(x, y, layout):
    """float64 Σ over each block's tokens of x_n y_nᵀ (B, H, M, Dx·Dy) for (B, N, H, D) x, y."""
    onehot = torch.nn.functional.one_hot(layout.block_ids(x.device).flatten(), layout.num_blocks).double()
    return torch.einsum("bnhd,bnhe,nm->bhmde", x.double(), y.double(), onehot).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("split", [False, True], ids=["whole-blocks", "split-blocks"])
def test_weighted_summaries_keep_float32_token_weights(dtype, split, monkeypatch):
    """dS̃ and dz̃ by the summaries kernel (WEIGHTED, heads grouped per mixed summary): each token's φ(q) row is
    scaled by scale·W[0] and rounded to half precision once, the operand of both products; W[1] keeps float32
    precision in dz̃ (its hi and lo parts), and the sums are float32 (split: several programs per block add
    float32 partials)."""
    if not (INTERPRETED or CUDA) or (INTERPRETED and dtype == torch.bfloat16):
        pytest.skip("needs the interpreter or a GPU (and the interpreter's bf16 tl.dot is wrong: Triton 3.6)")
    monkeypatch.setattr(mhla_triton, "_programs_wanted", lambda device: 64 if split else 1)
    device = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    layout = BlockLayout.create((7, 9), (2, 3)) if not split else BlockLayout.create((9, 40), (3, 1))
    batch, heads, kv_heads, dim, dv, scale = 2, 4, 2, 16, 24, 0.3
    n, m = layout.num_tokens, layout.num_blocks
    q = torch.randn(batch, n, heads, dim, device=device).to(dtype)
    do = torch.randn(batch, n, heads, dv, device=device).to(dtype)
    kv = torch.empty(batch, n, kv_heads, dv, device=device, dtype=dtype)
    w = torch.randn(batch, heads, 2, n, device=device)
    f = mhla_triton._launches_for(q, kv[..., :dim], kv, torch.rand(m, m, device=device), layout, causal=False,
                                  phi=resolve_feature_map("relu"), normalize=True, scale=scale, eps=1e-6)
    plan = f.p
    assert f.bwd_summaries[2]["ATOMIC"] == split
    dst = mhla_triton._bwd_summaries(plan, q, do, w, f).double()
    fq = (torch.relu(q.double()) * (w[:, :, 0].double() * scale).transpose(1, 2)[..., None]).to(dtype).double()
    group = lambda x: x.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)  # noqa: E731  (query heads of one mixed summary)
    want_s = group(_block_sums(fq, do, layout))
    want_z = group(_block_sums(fq, w[:, :, 1].transpose(1, 2)[..., None], layout))
    for name, got, want in (("dz", dst[..., dim * dv:], want_z), ("dS", dst[..., : dim * dv], want_s)):
        assert torch.isfinite(got).all(), f"{name}: an unwritten element"
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-5, f"{name}: relative error {err:.1e} (a sum or W[1] rounded to half precision?)"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_training_summaries_as_hi_lo_halves(dtype, monkeypatch):
    """Training's summaries as two halves where the one-tile kernel makes the mixing gradient: hi + lo hold them
    to 16 significant bits, and the mixing gradient's partials ⟨dS̃_i, S_j⟩ (dS̃ as halves too) use both parts:
    within 1e-3 of float64 in bf16 (the rounded parts alone: ~2e-3), 1e-5 under the interpreter in fp16 (~2e-4)."""
    if not (INTERPRETED or CUDA) or (INTERPRETED and dtype == torch.bfloat16):
        pytest.skip("needs the interpreter or a GPU (and the interpreter's bf16 tl.dot is wrong: Triton 3.6)")
    _settings(monkeypatch, mix_sweep=ONE_TILE_16)
    device = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    layout = BlockLayout.create((7, 9), (2, 3))
    batch, heads, dim, dv = 2, 2, 16, 24
    k = torch.randn(batch, layout.num_tokens, heads, dim, device=device).to(dtype)
    v = torch.randn(batch, layout.num_tokens, heads, dv, device=device).to(dtype)
    mixing = torch.rand(layout.num_blocks, layout.num_blocks, device=device)
    f = mhla_triton._launches_for(k, k, v, mixing, layout, causal=False, phi=resolve_feature_map("relu"),
                                  normalize=True, scale=1.0, eps=1e-6)
    plan = f.p
    assert f.form == "hilo"
    s = mhla_triton._summaries(plan, k, v, f=f)
    fk = torch.relu(k.double())
    want = torch.cat([_block_sums(fk, v, layout), _block_sums(fk, torch.ones_like(k[..., :1]), layout)], -1)
    got = s[0].double() + s[1].double()
    assert s.shape == (2, *want.shape) and ((got - want).norm() / want.norm()) < 1e-4
    dst = torch.randn(*want.shape, device=device)
    dst_hi = dst.to(dtype)  # (dS̃ as the dS̃ launch leaves it: hi + lo halves)
    halves = torch.stack([dst_hi, (dst - dst_hi.float()).to(dtype)])
    want_grad = torch.einsum("bhic,bhjc->bhij", dst.double(), want)
    _, part = mhla_triton._mix_t(plan, mixing, halves, s, dtype, f)
    grad = part.view(heads, batch, -1, plan.m, plan.m).sum(2).transpose(0, 1).double()  # (head, batch, split)
    err = ((grad - want_grad).norm() / want_grad.norm()).item()
    assert err < (1e-3 if CUDA else 1e-5), f"mixing gradient partials: relative error {err:.1e} (lo not added?)"


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("half", [False, True], ids=["float32", "half"])
def test_mixing_gradient_partials_split_over_programs(half, causal, per_head, monkeypatch):
    """The mixing gradient's ⟨dS̃_i, S_j⟩ (`_dmix_kernel`, summed by `_sum_partials_kernel`): each group's flat run
    of (batch, head, column tile) steps is cut into splits, the last one short (ragged column tiles too), over
    float32 or half dS̃ and S, shared mixing (summed over heads) or per head over grouped key heads: against
    float64 sums of the same values, at every device fill."""
    if half and not (INTERPRETED or CUDA):
        pytest.skip("needs the interpreter or a GPU")
    dtype = (torch.bfloat16 if CUDA else torch.float16) if half else torch.float32
    device = "cuda" if CUDA else "cpu"
    batch, heads, kv_heads, dim, dv = 3, 4, 2, 16, 8
    layout = BlockLayout.chunked(37, 4) if causal else BlockLayout.create((6, 7), (3, 2))
    m = layout.num_blocks
    torch.manual_seed(0)
    q = torch.randn(batch, layout.num_tokens, heads, dim, device=device, dtype=dtype)
    k = torch.randn(batch, layout.num_tokens, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn(batch, layout.num_tokens, kv_heads, dv, device=device, dtype=dtype)
    mixing = torch.rand(*((heads,) if per_head else ()), m, m, device=device)
    mix_heads, ragged = heads if per_head else kv_heads, False
    dst = torch.randn(batch, mix_heads, m, dim * dv + dim, device=device).to(dtype)
    s = torch.randn(batch, kv_heads, m, dim * dv + dim, device=device).to(dtype)
    x = s.double().repeat_interleave(mix_heads // kv_heads, 1)
    want = torch.einsum("bhic,bhjc->hij", dst.double(), x)
    want = want.tril(-1) if causal else want
    want = want if per_head else want.sum(0)  # (shared: summed over the heads)
    for fill in (1, 8, 22, 10**4):
        monkeypatch.setattr(mhla_triton, "_programs_wanted", lambda device, fill=fill: fill)
        f = mhla_triton._launches_for(q, k, v, mixing, layout, causal=causal, phi=resolve_feature_map("relu"),
                                      normalize=True, scale=1.0, eps=1e-6)
        grid, (*_, per, splits), kw = f.dmix
        steps = batch * (1 if per_head else mix_heads) * -(-(dim * dv + dim) // kw["BK"])
        assert splits == -(-steps // per) and grid[0] == splits * (heads if per_head else 1)
        ragged |= splits * per > steps
        dmii = torch.zeros(batch, heads, m, device=device)
        got = mhla_triton._mixing_grad(f.p, dst, s, None, dmii, f).double()
        err = ((got - want).norm() / want.norm()).item()
        assert err < (1e-5 if CUDA else 1e-6), f"fill {fill}: relative error {err:.1e}"
    assert ragged


def _half_training_launches(case, monkeypatch):
    """A half-precision training step of `case` checked against the torch path (fp16 under the interpreter, whose
    bf16 tl.dot is wrong in Triton 3.6; bf16 on a GPU): (kernel, keyword arguments) of each of its launches."""
    if not (INTERPRETED or CUDA):
        pytest.skip("needs the interpreter or a GPU")
    launched, real_run = [], mhla_triton._run
    monkeypatch.setattr(
        mhla_triton,
        "_run",
        lambda fn, launch, t, *rest: launched.append((fn, launch[2])) or real_run(fn, launch, t, *rest),
    )
    dtype = torch.bfloat16 if CUDA else torch.float16
    _compare(case, dtype, "cuda" if CUDA else "cpu", TOL[dtype])
    return launched


@pytest.mark.parametrize("name", ["2d-odd-grid", "1d-gqa-shared", "3d-odd-grid-gqa-per-head-elu-unnorm",
                                  "causal-per-head-elu-unnorm", "causal-blocks"])
def test_one_tile_mixing_in_training(name, monkeypatch):
    """Training through the one-tile mixing kernel: the forward over float32 summaries, and the transposed
    mixing with the mixing gradient in the same pass (half inputs); grouped mixing heads keep the tiled kernels."""
    _settings(monkeypatch, mix_sweep=ONE_TILE_16)
    case = CASES[name]
    launched = _half_training_launches(case, monkeypatch)
    sweeps = [kw["GRAD"] for fn, kw in launched if fn is mhla_triton.K._mix_sweep_kernel]
    grouped = case[8] and case[4] != case[5]  # per-head mixing over grouped key heads: dS sums several heads
    assert False in sweeps and (True in sweeps) != grouped
    assert (mhla_triton.K._dmix_kernel in [fn for fn, _ in launched]) == grouped
    hilo = [kw.get("HILO", False) for fn, kw in launched if fn is mhla_triton.K._summaries_kernel]
    assert hilo == [not grouped] * 2  # (S and dS̃ as hi + lo halves where the one-tile kernel makes the gradient)


@pytest.mark.parametrize("name", ["causal-ragged-gqa", "causal-blocks", "3d-odd-grid-gqa-per-head-elu-unnorm",
                                  "1d-gqa-shared"])
def test_many_blocks_mixed_by_matmul_over_half_summaries(name, monkeypatch):
    """Training at many blocks (here forced on few): the summaries and dS̃ are written in half precision,
    torch.matmul mixes them, forward and transposed (per-head mixing over grouped key heads: their mixingsᵀ side by
    side), and the mixing gradient's partials are half products of them (half inputs): here within the fp16 bound
    (2.5x the torch path's own error; 1.3-2.2x at these few blocks)."""
    _settings(monkeypatch, matmul_mix_min_blocks=1)
    matmuls, real_matmul = [], mhla_triton._mix_matmul
    monkeypatch.setattr(mhla_triton, "_mix_matmul", lambda *a, **kw: matmuls.append(kw) or real_matmul(*a, **kw))
    written, real_run = [], mhla_triton._run
    monkeypatch.setattr(mhla_triton, "_run", lambda fn, launch, t: written.append((fn, t)) or real_run(fn, launch, t))
    launched = _half_training_launches(CASES[name], monkeypatch)
    kernels = {fn for fn, _ in launched}
    assert mhla_triton.K._mix_sweep_kernel not in kernels and mhla_triton.K._mix_kernel not in kernels
    assert matmuls == [{}, {"transposed": True}]
    half = torch.bfloat16 if CUDA else torch.float16
    assert {t[2].dtype for fn, t in written if fn is mhla_triton.K._summaries_kernel} == {half}  # (S and dS̃)
    assert not any(kw.get("HILO", False) for fn, kw in launched) and mhla_triton.K._dmix_kernel in kernels


def test_backward_with_create_graph_is_first_order_only(monkeypatch):
    """A backward with create_graph=True (at many blocks, here forced on few, whose mixings are torch.matmul calls
    into preallocated outputs) gives the plain backward's gradients; a second backward through them fails loudly,
    since the kernels' backward has no backward of its own, rather than returning wrong second-order gradients."""
    if not (INTERPRETED or CUDA):
        pytest.skip("needs the interpreter or a GPU")
    _settings(monkeypatch, matmul_mix_min_blocks=1)
    device, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float16)
    torch.manual_seed(0)
    tensors = _inputs(CASES["causal-ragged-gqa"], dtype, device)

    def grads(**kw):  # (of a loss not linear in the output, as a gradient penalty's is)
        out = mhla_attention(*tensors, chunk_size=16, causal=True, backend="triton")
        return torch.autograd.grad(out.float().square().sum(), tensors, **kw)

    plain, graphed = grads(), grads(create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, graphed))
    with pytest.raises(RuntimeError, match="once_differentiable"):
        graphed[0].float().sum().backward()


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="the interpreter cases run in this process")
def test_interpreter_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
        "test_interpreter_ and not subprocess",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and " passed" in summary and "skipped" not in summary, done.stdout[-3000:]


def test_head_dim_parts():
    parts = {d: mhla_triton.head_dim_parts(d) for d in (16, 20, 24, 32, 40, 48, 64, 72, 80, 96, 100, 128)}
    assert parts == {16: (16, 0), 20: (32, 0), 24: (32, 0), 32: (32, 0), 40: (32, 16), 48: (32, 16), 64: (64, 0),
                     72: (64, 16), 80: (64, 16), 96: (64, 32), 100: (128, 0), 128: (128, 0)}


def test_dispatch_falls_back_to_torch():
    from mhla_convert.ops.mhla import mhla_attention_torch

    q = torch.randn(1, 12, 2, 16)
    layout = BlockLayout.create((3, 4), (1, 2))
    relu = resolve_feature_map("relu")
    # auto never picks Triton off CUDA (the interpreter is for tests), nor for a callable φ
    assert (
        select("attention", "auto", mhla_attention_torch, q, q, q, torch.rand(2, 2), layout, causal=False, phi=relu)
        is mhla_attention_torch
    )
    reason = mhla_triton.unsupported_reason(q, q, q, torch.rand(2, 2), layout, causal=False, phi=torch.sigmoid)
    assert "callable" in reason
    with pytest.raises(ValueError, match="triton backend does not take"):
        mhla_attention(
            q, q, q, torch.rand(2, 2), grid=(3, 4), blocks=(1, 2), feature_map=torch.sigmoid, backend="triton"
        )


# CUDA: real sizes of the target families, every dtype; tolerances for the operand precision
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # half: a floor under 2x the torch path's error
FAMILY_CASES = {
    "wan-d128": ((6, 10, 12), (3, 3, 4), None, False, 4, 4, 128, 128, False, True, "relu"),
    "dit-d72": ((32, 32), (4, 4), None, False, 4, 4, 72, 72, True, True, "relu"),
    # one 128-row mixing tile
    "wan-blocks-105": ((21, 10, 10), (7, 3, 5), None, False, 2, 2, 128, 128, False, True, "relu"),
    "sana-d32-unnorm": ((33, 31), (4, 4), None, False, 6, 6, 32, 32, False, False, "relu"),
    "llm-d64-causal-gqa": ((1000,), None, 64, True, 8, 2, 64, 64, False, False, "relu"),
    "llm-d64-causal-per-head-elu": ((777,), None, 64, True, 4, 4, 64, 64, True, True, "elu"),
    # 512 chunks: training's summaries and dS̃ as hi + lo halves, mixed by torch.matmul
    "causal-512-chunks-per-head-gqa": ((8190,), None, 16, True, 4, 2, 16, 16, True, True, "elu"),
    "d64-per-head-gqa-elu": ((24, 20), (4, 4), None, False, 4, 2, 64, 64, True, True, "elu"),
}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("name", list(CASES) + list(FAMILY_CASES))
def test_cuda_matches_torch(name, dtype):
    _compare({**CASES, **FAMILY_CASES}[name], dtype, "cuda", TOL[dtype])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["2d-odd-grid", "causal-ragged-gqa", "causal-blocks"])
def test_cuda_zero_feature_query_gradients(name, dtype):
    _zero_feature_query_gradients(name, dtype, "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["wan-d128", "causal-blocks"])
def test_cuda_unaligned_inputs(name, monkeypatch):
    """Triton specialises a kernel on its pointers' 16-byte alignment: inputs one element off alignment (views
    into a larger buffer), after aligned ones of the same shapes, must get the torch path's results."""
    case = {**CASES, **FAMILY_CASES}[name]
    _compare(case, torch.bfloat16, "cuda", TOL[torch.bfloat16])
    real_inputs = _inputs

    def unaligned(*args, **kw):
        out = []
        for t in real_inputs(*args, **kw):
            buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
            out.append(buf[1:].view(t.shape).copy_(t.detach()).requires_grad_())
        return out

    monkeypatch.setitem(globals(), "_inputs", unaligned)
    _compare(case, torch.bfloat16, "cuda", TOL[torch.bfloat16])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["dit-d72", "llm-d64-causal-gqa"])
def test_cuda_relaunches_equal_the_first_launches(name, monkeypatch):
    """A signature's second training step runs the compiled kernels its first step kept (`kernels.launch`), with
    no launch through `kernel[grid]`, and gives exactly the first step's outputs and gradients."""
    case = FAMILY_CASES[name]
    mhla_triton._launches_of.cache_clear()
    plain, real_getitem = [], triton.runtime.JITFunction.__getitem__
    monkeypatch.setattr(triton.runtime.JITFunction, "__getitem__",
                        lambda fn, grid: plain.append(fn) or real_getitem(fn, grid))
    torch.manual_seed(0)
    tensors = _inputs(case, torch.bfloat16, "cuda")
    grad_out = torch.randn(*tensors[0].shape[:3], tensors[2].shape[-1], device="cuda", dtype=torch.bfloat16)
    first = _run(case, tensors, "triton", grad_out)
    launches = len(plain)
    second = _run(case, tensors, "triton", grad_out)
    assert launches >= 6 and len(plain) == launches, "a repeated step searched for its kernels again"
    for name, a, b in zip(("out", "dq", "dk", "dv", "dmixing"), first, second):
        assert torch.equal(a, b), f"{name} differs from the first step's"


def _record_launches(monkeypatch) -> list:
    """(kernel, keyword arguments) of every launch of the attention operator from here on."""
    launched, real_run = [], mhla_triton._run
    monkeypatch.setattr(
        mhla_triton, "_run", lambda fn, launch, t: launched.append((fn, launch[2])) or real_run(fn, launch, t)
    )
    return launched


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["wan-d128", "llm-d64-causal-gqa"])
def test_cuda_chained_launches(name, monkeypatch):
    """On Hopper and later every launch of the operator is a programmatic dependent launch: each kernel waits
    for the previous one's writes before touching memory, so the results are the torch path's (the poisoned
    buffers catch a read that came too early)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    launched = _record_launches(monkeypatch)
    _compare(FAMILY_CASES[name], torch.bfloat16, "cuda", TOL[torch.bfloat16])
    assert len(launched) >= 6 and all(kw.get("launch_pdl") and kw.get("PDL") for _, kw in launched)


# blocks of 128 tokens over fewer programs than fill the GPU: each block's tiles are split over programs, so
# the training summaries and dS̃ stay float32 (their partials are added), not hi + lo halves
SPLIT_CASES = {
    "split-blocks-80": ((10, 32, 32), (5, 4, 4), None, False, 2, 2, 128, 128, False, True, "relu"),
    "split-blocks-48": ((6, 32, 32), (3, 4, 4), None, False, 2, 2, 128, 128, False, True, "relu"),
}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["wan-blocks-105", "wan-d128", *SPLIT_CASES])
def test_cuda_one_tile_gradient_launch_settings(name, monkeypatch):
    """The shipped one-tile mixing gradient settings (`mix_sweep`) fit the GPU for both operand forms, at one
    tile of 128 and of 64 rows: hi + lo halves, and float32 where blocks are split over programs (twice the
    shared memory per tile), and give the torch path's results."""
    monkeypatch.setattr(mhla_triton, "_programs_wanted", lambda device: 4 * 132)  # (split as on an H100 or H200)
    launched = _record_launches(monkeypatch)
    _compare({**FAMILY_CASES, **SPLIT_CASES}[name], torch.bfloat16, "cuda", TOL[torch.bfloat16])
    grads = [kw for fn, kw in launched if fn is mhla_triton.K._mix_sweep_kernel and kw["GRAD"]]
    assert len(grads) == 1 and grads[0].get("HILO", False) == (name not in SPLIT_CASES)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mix", ["triton", "matmul"])
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("name", list(CASES) + list(FAMILY_CASES))
def test_cuda_forward_only(name, dtype, mix, monkeypatch):
    """Both mixing paths of inference: the Triton GEMM and, for half inputs, torch.matmul."""
    _settings(monkeypatch, matmul_mix_min_blocks=0 if mix == "matmul" else 10**9)
    used, summaries = [], []
    real_mix, real_summaries = mhla_triton._mix_matmul, mhla_triton._summaries
    monkeypatch.setattr(mhla_triton, "_mix_matmul", lambda *a: used.append(1) or real_mix(*a))
    monkeypatch.setattr(mhla_triton, "_summaries", lambda *a: summaries.append(real_summaries(*a)) or summaries[-1])
    _compare_forward({**CASES, **FAMILY_CASES}[name], dtype, "cuda", TOL[dtype])
    # half summaries unless the launch was split over programs (float32 partials), and only those go through matmul
    half = summaries[0].dtype == dtype != torch.float32
    assert half or dtype == torch.float32 or name != "wan-d128"  # (a case whose summaries launch is not split)
    assert bool(used) == (mix == "matmul" and half)


@pytest.mark.gpu
@gpu
def test_cuda_inputs_on_several_devices_refused():
    """The backend itself refuses inputs on another device by name (not by a pointer error from Triton), also
    after a call with the same shapes on one device."""
    q, k, v, mixing = _inputs(CASES["2d-odd-grid"], torch.float32, "cuda")
    def call(m):
        return mhla_triton.mhla_attention_triton(q, k, v, m, BlockLayout.create((7, 9), (2, 3)), causal=False,
                                                 phi=resolve_feature_map("relu"), normalize=True, scale=0.25, eps=1e-6)
    call(mixing)
    with pytest.raises(ValueError, match="several devices"):
        call(mixing.detach().cpu())


@pytest.mark.gpu
@gpu
def test_cuda_auto_uses_triton():
    q = torch.randn(1, 12, 2, 16, device="cuda", dtype=torch.bfloat16)
    layout = BlockLayout.create((3, 4), (1, 2))
    pick = lambda mixing: select("attention", "auto", None, q, q, q, mixing, layout, causal=False,  # noqa: E731
                                 phi=resolve_feature_map("relu"))
    assert pick(torch.rand(2, 2, device="cuda")) is mhla_triton.mhla_attention_triton
    assert pick(torch.rand(2, 2)) is None  # (mixing on the CPU: the torch path, which names the device mismatch)


# --- the q/k norm + interleaved rotary op (Wan) ----------------------------------------------------
from mhla_convert.ops.rotary import norm_rotate_interleaved  # noqa: E402

# (batch, tokens, heads, head dim, cos/sin batch, norm: "affine" | "plain" | None)
ROTARY_CASES = {
    "odd-rows-affine": (2, 7, 3, 12, 1, "affine"),
    "per-batch-table-plain": (2, 5, 2, 8, 2, "plain"),
    "no-norm": (1, 9, 4, 16, 1, None),
    "wan-shape": (1, 300, 12, 128, 1, "affine"),
}


def _rotary_inputs(case, dtype, device):
    batch, n, heads, dim, table_batch, norm = case
    x = torch.randn(batch, n, heads * dim, device=device, dtype=dtype) * 3
    # diffusers' Wan repeats each angle over its pair; distinct columns here check which ones are read
    angles = torch.rand(table_batch, n, 1, dim, device=device) * 6.3
    cos, sin = torch.cos(angles), torch.sin(angles)
    module = None
    if norm is not None:
        module = torch.nn.RMSNorm(heads * dim, eps=1e-6, elementwise_affine=norm == "affine").to(device, dtype)
        if norm == "affine":
            torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    return x, cos, sin, module


def _assert_rotary_close(op, x, cos, sin, dim, norm, tol):
    """The kernel against the host's ops in float32 (the norm's float32 copy), within tol, or for half inputs within
    twice the host's ops' own error in that dtype."""
    with torch.no_grad():
        norm32 = None if norm is None else copy.deepcopy(norm).float()
        want = op(x.float(), cos.float(), sin.float(), head_dim=dim, norm=norm32, backend="torch")
        got = op(x, cos, sin, head_dim=dim, norm=norm, backend="triton")
        own = op(x, cos, sin, head_dim=dim, norm=norm, backend="torch").float()
    assert got.shape == want.shape == (*x.shape[:2], x.shape[2] // dim, dim) and torch.isfinite(got).all()
    err = ((got.float() - want).norm() / want.norm()).item()
    bound = tol if x.dtype == torch.float32 else max(tol, 2 * ((own - want).norm() / want.norm()).item())
    assert err < bound, f"relative error {err:.2e} ≥ {bound:.1e}"


def _compare_rotary(case, dtype, device, tol):
    torch.manual_seed(2)
    x, cos, sin, norm = _rotary_inputs(case, dtype, device)
    _assert_rotary_close(norm_rotate_interleaved, x, cos, sin, case[3], norm, tol)


# --- the q/k norm + half-split rotary op (Llama-style LMs) ------------------------------------------
from mhla_convert.ops.rotary import norm_rotate_half  # noqa: E402

# (batch, tokens, heads, head dim, cos/sin batch, norm per head: "qwen3" | "torch" | None)
HALF_ROTARY_CASES = {
    "odd-heads-qwen3-norm": (2, 7, 3, 16, 1, "qwen3"),
    "per-batch-table-torch-norm": (2, 5, 2, 8, 2, "torch"),
    "odd-half-dim-no-norm": (1, 9, 5, 12, 1, None),
    "llama-shape": (1, 300, 32, 64, 1, None),
    "qwen3-shape": (2, 100, 16, 128, 1, "qwen3"),
}


def _half_rotary_inputs(case, dtype, device):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    batch, n, heads, dim, table_batch, norm = case
    x = torch.randn(batch, n, heads * dim, device=device, dtype=dtype) * 3
    # transformers repeats each angle over both halves; distinct columns here check which ones are read
    angles = torch.rand(table_batch, n, dim, device=device) * 6.3
    module = {"qwen3": lambda: Qwen3RMSNorm(dim, eps=1e-6), "torch": lambda: torch.nn.RMSNorm(dim, eps=1e-5),
              None: lambda: None}[norm]()
    if module is not None:
        module = module.to(device, dtype)
        torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    return x, torch.cos(angles).to(dtype), torch.sin(angles).to(dtype), module


def _compare_half_rotary(case, dtype, device, tol):
    torch.manual_seed(3)
    x, cos, sin, norm = _half_rotary_inputs(case, dtype, device)
    _assert_rotary_close(norm_rotate_half, x, cos, sin, case[3], norm, tol)


# both forms' cases: (form, case name); the "-shape" cases are a model's full size, for the GPU only
ROTARY_FORMS = {"interleaved": (_compare_rotary, ROTARY_CASES), "half": (_compare_half_rotary, HALF_ROTARY_CASES)}
ALL_ROTARY_CASES = [(form, name) for form, (_, cases) in ROTARY_FORMS.items() for name in cases]


@interp
@pytest.mark.parametrize("form,name", [case for case in ALL_ROTARY_CASES if not case[1].endswith("-shape")])
def test_interpreter_norm_rotate_matches_torch(form, name):
    compare, cases = ROTARY_FORMS[form]
    compare(cases[name], torch.float32, "cpu", 1e-6)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("form,name", ALL_ROTARY_CASES)
def test_cuda_norm_rotate_matches_torch(form, name, dtype):
    compare, cases = ROTARY_FORMS[form]
    compare(cases[name], dtype, "cuda", TOL[dtype])


def test_norm_rotate_half_keeps_torch_where_the_kernel_does_not_apply():
    """Gradients, and norms that are not an RMSNorm per head, keep the host's ops: auto picks torch, triton says
    why."""
    device = "cuda" if CUDA else "cpu"
    x, cos, sin, norm = _half_rotary_inputs(HALF_ROTARY_CASES["odd-heads-qwen3-norm"], torch.float32, device)
    want = norm_rotate_half(x, cos, sin, head_dim=16, norm=norm, backend="torch")
    with pytest.raises(ValueError, match="need gradients"):
        norm_rotate_half(x, cos, sin, head_dim=16, norm=norm, backend="triton")
    layer_norm = torch.nn.LayerNorm(16, device=device)
    with torch.no_grad():
        torch.testing.assert_close(norm_rotate_half(x, cos, sin, head_dim=16, norm=norm), want)
        out = norm_rotate_half(x, cos, sin, head_dim=16, norm=layer_norm)
        torch.testing.assert_close(out, norm_rotate_half(x, cos, sin, head_dim=16, norm=layer_norm, backend="torch"))
        with pytest.raises(ValueError, match="RMSNorm over each head"):
            norm_rotate_half(x, cos, sin, head_dim=16, norm=layer_norm, backend="triton")
    with pytest.raises(ValueError, match="head_dim must be even and divide"):
        norm_rotate_half(x, cos, sin, head_dim=10, norm=norm)


def test_norm_rotate_needs_no_gradients_for_the_kernel():
    """Training keeps the torch path (the kernel has no backward): auto picks torch, triton says why."""
    x, cos, sin, norm = _rotary_inputs(ROTARY_CASES["odd-rows-affine"], torch.float32, "cpu")
    x.requires_grad_()
    out = norm_rotate_interleaved(x, cos, sin, head_dim=12, norm=norm)
    out.sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    with pytest.raises(ValueError, match="need gradients"):
        norm_rotate_interleaved(x, cos, sin, head_dim=12, norm=norm, backend="triton")
    with pytest.raises(ValueError, match="head_dim must be even and divide"):
        norm_rotate_interleaved(x, cos, sin, head_dim=10, norm=norm)


@pytest.mark.gpu
@gpu
def test_cuda_wan_layer_fused_rotary_matches_torch():
    """A converted tiny Wan on CUDA: the layers' fused norm + rotary (auto) against the torch path."""
    pytest.importorskip("diffusers", reason="diffusers is not installed")
    from mhla_convert.convert import convert
    from mhla_convert.families import adapter_for_model
    from mhla_convert.layer import mhla_layers
    from mhla_convert.models import tiny_model

    torch.manual_seed(3)
    model = tiny_model("tiny-wan").cuda()
    convert(model)
    inputs = adapter_for_model(model).example_inputs(model, (3, 4, 6))
    outs = {}
    for backend in ("torch", "auto"):
        for _, layer in mhla_layers(model):
            layer.config.backend = backend
        with torch.no_grad():
            outs[backend] = model(**inputs).sample
    err = ((outs["auto"] - outs["torch"]).norm() / outs["torch"].norm()).item()
    assert err < 1e-5, err
