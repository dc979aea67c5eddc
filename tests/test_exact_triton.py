"""The Triton backend of causal MHLA with exact local chunks (`kernels.exact_triton`) against the torch path
(`ops.exact_local`, itself tested against the O(N²) reference in test_exact_local.py).

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported) on
tiny shapes; on CUDA the same cases run compiled, plus realistic LM shapes. Every buffer the kernels write is
filled with NaN first, so an element left unwritten fails.
"""

import pytest
import torch
from triton_marks import DEVICE, INTERPRETED, gpu, run

from mhla_convert.kernels import exact_triton
from mhla_convert.mixing import toeplitz_causal_mixing
from mhla_convert.ops import BlockLayout, mhla_attention
from mhla_convert.ops.dispatch import select
from mhla_convert.ops.exact_local import mhla_attention_exact_local_torch
from mhla_convert.ops.exact_op import exact_attention_op
from mhla_convert.ops.feature_maps import FEATURE_MAPS

pytestmark = pytest.mark.usefixtures("poisoned_kernel_buffers")  # (conftest.py)


# batch, tokens, heads, kv heads, D, Dv, chunk, exact chunks, per-head mixing, feature map
CASES = {
    "gqa-partial-chunk-dv": (2, 37, 4, 2, 8, 6, 8, 2, False, "relu"),
    "per-head-elu": (2, 37, 4, 2, 8, 8, 8, 2, True, "elu"),
    "one-partial-chunk": (1, 5, 2, 1, 4, 4, 8, 2, False, "relu"),
    "fewer-chunks-than-window": (1, 13, 2, 2, 8, 8, 8, 3, True, "elu"),
    "window-1": (2, 21, 2, 1, 8, 8, 4, 1, False, "elu"),
    "window-3-gqa-per-head": (1, 29, 4, 2, 8, 4, 4, 3, True, "relu"),
    "odd-dims-and-chunk": (2, 23, 6, 3, 5, 7, 7, 3, False, "elu"),
}


def _inputs(case, dtype=torch.float32, spread=1.0, seed=0):
    batch, n, heads, kv_heads, dim, dv, chunk, exact, per_head, fmap = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, heads, dim, generator=g) * spread
    k = torch.randn(batch, n, kv_heads, dim, generator=g) * spread
    v = torch.randn(batch, n, kv_heads, dv, generator=g)
    layout = BlockLayout.chunked(n, chunk)
    relative = torch.rand((heads, 5) if per_head else (5,), generator=g) + 0.05
    mixing = toeplitz_causal_mixing(relative, layout.num_blocks)
    return [t.to(device=DEVICE, dtype=dtype) for t in (q, k, v)] + [mixing.to(DEVICE)], layout


def _options(case, eps=1e-6, **kw):
    dim, exact, fmap = case[4], case[7], case[9]
    return dict(exact_chunks=exact, phi=FEATURE_MAPS[fmap], scale=dim**-0.5, eps=eps, **kw)


def _both(case, q, k, v, mixing, layout, key_mask=None):
    options = _options(case, key_mask=key_mask)
    got = exact_triton.mhla_attention_exact_triton(q, k, v, mixing, layout, **options)
    want = mhla_attention_exact_local_torch(q, k, v, mixing, layout, **options)
    assert got.dtype == q.dtype and got.shape == want.shape
    return got, want


def _rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@run
@pytest.mark.parametrize("name", CASES)
def test_matches_torch_path_fp32(name):
    (q, k, v, mixing), layout = _inputs(CASES[name])
    got, want = _both(CASES[name], q, k, v, mixing, layout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert _rel(got, want) < 1e-5


@run
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["gqa-partial-chunk-dv", "window-3-gqa-per-head"])
def test_half_precision_close_to_torch_path(name, dtype):
    """bf16: summaries and their mixture in bf16 (fp16: float32), window products in the input dtype."""
    (q, k, v, mixing), layout = _inputs(CASES[name], dtype)
    got, want = _both(CASES[name], q, k, v, mixing, layout)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    assert _rel(got, want) < 1e-2


@run
def test_zero_weights_in_the_band():
    """Chunks whose own or previous chunk weighs 0, and far weights of 0, against the float64 torch path. Scores
    spread over hundreds: a chunk of weight 0 that set the shift (it has no keys) would send every exponential
    of the row to 0."""
    case = (2, 40, 4, 2, 8, 8, 4, 2, True, "relu")
    (q, k, v, mixing), layout = _inputs(case, spread=8.0)
    m = layout.num_blocks
    mixing = mixing.clone()
    mixing[0].diagonal()[::2] = 0  # own chunk of even chunks, head 0
    mixing[1].diagonal(-1)[1::3] = 0  # previous chunk, head 1
    mixing[2, 5, 4] = mixing[2, 5, 5] = 0  # the whole window of chunk 5, head 2: far chunks only
    mixing[3, :, : m // 2] = 0  # far and near chunks of the first half, head 3
    got = exact_triton.mhla_attention_exact_triton(q, k, v, mixing, layout, **_options(case))
    want = mhla_attention_exact_local_torch(*(t.double() for t in (q, k, v, mixing)), layout, **_options(case))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@run
def test_large_scores_need_the_shift_and_the_causal_mask():
    """Window scores near ±400: exp overflows float32 without the shift, and a future key read by mistake (a
    wrong causal mask) would outweigh every allowed one; a large eps, which the shift scales as it does every
    other term. Compared at float32 against the float64 torch path."""
    case = CASES["gqa-partial-chunk-dv"]
    (q, k, v, mixing), layout = _inputs(case, spread=8.0)
    got = exact_triton.mhla_attention_exact_triton(q, k, v, mixing, layout, **_options(case, eps=0.3))
    want = mhla_attention_exact_local_torch(*(t.double() for t in (q, k, v, mixing)), layout,
                                            **_options(case, eps=0.3))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@run
def test_key_mask_and_strided_inputs():
    """Left padding (keys of key_mask False weigh 0, far and near), and q, k, v as strided views."""
    case = CASES["gqa-partial-chunk-dv"]
    (q, k, v, mixing), layout = _inputs(case)
    key_mask = torch.ones(q.shape[:2], dtype=torch.bool, device=DEVICE)
    key_mask[1, :11] = False
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q.is_contiguous()
    got, want = _both(case, q, k, v, mixing, layout, key_mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _trained_by_backend(case):
    """For the Triton backend, then the torch one: fresh leaf copies of the case's inputs, and the output of
    mhla_attention on them (with gradients)."""
    (q, k, v, mixing), _ = _inputs(case)
    kw = dict(causal=True, chunk_size=case[6], exact_chunks=case[7], feature_map=case[9])
    for backend in ("triton", "torch"):
        tensors = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
        yield tensors, mhla_attention(*tensors, backend=backend, **kw)


@run
@pytest.mark.parametrize("name", ["gqa-partial-chunk-dv", "window-3-gqa-per-head"])
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
    for tensors, out in _trained_by_backend(CASES["gqa-partial-chunk-dv"]):
        first = torch.autograd.grad(out.square().sum(), tensors, create_graph=True)
        found.append(torch.autograd.grad(sum(g.square().sum() for g in first), tensors))
    for name, got, want in zip(("q", "k", "v", "mixing"), *found):
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-5, f"{name}: relative error {err:.1e}"


@run
def test_frozen_mixing_gets_no_gradient():
    case = CASES["window-1"]
    (q, k, v, mixing), layout = _inputs(case)
    q.requires_grad_()
    mhla_attention(q, k, v, mixing, causal=True, chunk_size=case[6], exact_chunks=case[7], feature_map=case[9],
                   backend="triton").sum().backward()
    assert q.grad is not None and mixing.grad is None and k.grad is None


@run
def test_custom_op_with_triton_backend():
    """The op that torch.compile traces, with the Triton backend inside: schema, fake tensors, autograd
    registration, and gradients through the registered backward against the torch backend's."""
    case = CASES["gqa-partial-chunk-dv"]
    (q, k, v, mixing), layout = _inputs(case)
    tensors = [t.requires_grad_() for t in (q, k, v, mixing)]
    options = [list(layout.grid), list(layout.blocks), list(layout.block_size), True, [case[7]], case[9],
               case[4] ** -0.5, 1e-6]
    torch.library.opcheck(exact_attention_op, (*tensors, None, *options, "triton"),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    outs = []
    for backend in ("triton", "torch"):
        out = exact_attention_op(*tensors, None, *options, backend)
        outs.append((out, torch.autograd.grad(out, tensors, torch.ones_like(out))))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    for got, want in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dispatch():
    """"auto" takes the kernels for CUDA inputs only (never the interpreter); a named "triton" refuses what the
    kernels cannot take, by name."""
    case = CASES["window-1"]
    q, k, v, mixing = (t.cpu() for t in _inputs(case)[0])
    layout = BlockLayout.chunked(q.shape[1], case[6])
    select_args = (q, k, v, mixing, layout)
    picked = select("exact", "auto", mhla_attention_exact_local_torch, *select_args, exact_chunks=1,
                    phi=FEATURE_MAPS["relu"], key_mask=None)
    assert picked is mhla_attention_exact_local_torch
    kw = dict(causal=True, chunk_size=4, exact_chunks=1, backend="triton")
    with pytest.raises(ValueError, match="callable feature map"):
        mhla_attention(q, k, v, mixing, feature_map=torch.sigmoid, **kw)
    with pytest.raises(ValueError, match="dtypes torch.float64"):
        mhla_attention(q.double(), k.double(), v.double(), mixing, **kw)
    if not INTERPRETED:
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            mhla_attention(q, k, v, mixing, **kw)


# --- CUDA: realistic LM shapes ------------------------------------------------------------------------------------
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads, dim", [(32, 8, 64), (16, 8, 128)], ids=["llama-1b", "qwen3"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_cuda_lm_shapes_bf16(heads, kv_heads, dim, per_head):
    """bf16, 4,096 tokens in chunks of 64, L = 2, window 8: the kernels (chosen by "auto") against the torch path,
    and against the float64 torch path (the kernels' error is within the torch path's own bf16 error)."""
    torch.manual_seed(0)
    n, chunk = 4096, 64
    q, k, v = (torch.randn(1, n, h, dim, device="cuda", dtype=torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    relative = torch.rand((heads, 8) if per_head else (8,), device="cuda") + 0.05
    mixing = toeplitz_causal_mixing(relative, n // chunk)
    kw = dict(causal=True, chunk_size=chunk, exact_chunks=2)
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
