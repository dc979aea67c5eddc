"""The fused decoding step of an LM layer (`kernels.decode_triton`) against its torch reference
(`DecodeState.step_torch`, itself tested against the parallel form in test_lm_cache.py).

Two states start from the same prompt and take the same tokens, one through each path: the outputs and every
state tensor must agree after each token, across chunk closes, with rows at different positions and padding
tokens, and after a rollback. Without CUDA the kernel runs under Triton's interpreter on tiny shapes; on CUDA the
same cases run compiled, plus the Llama and Qwen3 shapes. The output buffer is filled with NaN first, so an
element left unwritten fails.
"""

import pytest
import torch
from triton_marks import CUDA, DEVICE, gpu, run

from mhla_convert.kernels import decode_triton
from mhla_convert.ops.dispatch import select
from mhla_convert.ops.recurrent import DecodeState

pytestmark = pytest.mark.usefixtures("poisoned_kernel_buffers")  # (conftest.py)


# batch, heads, kv heads, D, Dv, chunk, window, exact chunks, per-head mixing, feature map, normalize
CASES = {
    "exact-2-gqa": (2, 4, 2, 8, 6, 4, 4, 2, False, "relu", True),
    "exact-1-per-head-elu": (2, 4, 2, 8, 8, 4, 5, 1, True, "elu", True),
    "exact-3-odd-dims": (1, 6, 3, 5, 7, 3, 6, 3, True, "relu", True),
    "linear-gqa-per-head": (2, 4, 2, 8, 6, 4, 4, 0, True, "relu", True),
    "linear-unnormalised": (2, 2, 2, 8, 8, 4, 3, 0, False, "elu", False),
    "linear-odd-dims-chunk": (1, 6, 2, 5, 7, 5, 6, 0, False, "relu", True),
}


def _pair(case, dtype, prompt):
    batch, heads, kv_heads, dim, dv, chunk, window, exact, per_head, fmap, normalize = case
    g = torch.Generator().manual_seed(1)
    k = torch.randn(batch, prompt, kv_heads, dim, generator=g).to(DEVICE, dtype)
    v = torch.randn(batch, prompt, kv_heads, dv, generator=g).to(DEVICE, dtype)
    lengths = torch.tensor([prompt - 3 * i for i in range(batch)], device=DEVICE)  # rows at different positions
    states = []
    for _ in range(2):
        state = DecodeState(batch, kv_heads, dim, dv, chunk_size=chunk, window=window, feature_map=fmap, dtype=dtype,
                            device=torch.device(DEVICE), exact_chunks=exact)
        state.prefill(k, v, lengths)
        states.append(state)
    relative = (torch.rand(heads, window, generator=g) if per_head else torch.rand(window, generator=g)) + 0.05
    if exact:
        relative[..., 1] = 0.0  # a zero weight: its window keys are not attended at all
    return states, relative.to(DEVICE)


def _tokens(case, dtype, steps, seed):
    batch, heads, kv_heads, dim, dv, chunk, *_ = case
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        q = torch.randn(batch, 1, heads, dim, generator=g)
        k = torch.randn(batch, 1, kv_heads, dim, generator=g)
        v = torch.randn(batch, 1, kv_heads, dv, generator=g)
        real = torch.ones(batch, dtype=torch.bool)
        if batch > 1 and t % 5 == 2:  # a padding token in the last row: φ(k) = 0 (relu; elu gives k = −inf)
            real[-1] = False
            k[-1] = -k[-1].abs() - 1 if case[9] == "relu" else float("-inf")
        yield q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), real.to(DEVICE)


def _split_columns(monkeypatch, columns):
    from dataclasses import replace

    from mhla_convert.kernels import settings

    launches = {dim: (*launch[:2], columns) for dim, launch in settings.SETTINGS.decode_launches.items()}
    monkeypatch.setattr(settings, "SETTINGS", replace(settings.SETTINGS, decode_launches=launches))


def _compare(ours, ref, tol):
    for name in ("position", *decode_triton._STATE):
        torch.testing.assert_close(getattr(ours, name), getattr(ref, name), **tol, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(ours.back_valid, ref.back_valid)


@run
@pytest.mark.parametrize("columns", [None, 4], ids=["one-program", "columns-split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_step_equals_torch_step(name, dtype, columns, monkeypatch):
    """Every token's output (real rows) and the whole state after it, over more than three chunk closes; then a
    rollback of each path and more tokens. With `columns`, each (row, key head) takes several programs, of 4 value
    columns each, whose last one updates the key sums."""
    if columns:
        _split_columns(monkeypatch, columns)
    case = CASES[name]
    normalize = case[-1]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    (ours, ref), relative = _pair(case, dtype, prompt=11)
    options = dict(normalize=normalize, scale=0.3, eps=1e-6)

    def steps(count, seed):
        for q, k, v, real in _tokens(case, dtype, count, seed):
            got = ours.step(q, k, v, real, relative, backend="triton", **options)
            want = ref.step(q, k, v, real, relative, backend="torch", **options)
            torch.testing.assert_close(got[real], want[real], **tol)
            _compare(ours, ref, dict(atol=1e-5, rtol=1e-5))

    steps(4 * case[5] + 1, seed=2)
    for state in (ours, ref):
        state.rollback(case[5])  # back across the last close, or within the open chunk
    _compare(ours, ref, dict(atol=1e-5, rtol=1e-5))
    steps(case[5] + 2, seed=3)


@run
def test_auto_and_refusals():
    """"auto" takes the kernel for CUDA inputs only (never the interpreter, nor inputs that need gradients); a named
    "triton" refuses what it cannot take, by name."""
    case = CASES["exact-2-gqa"]
    (state, _), relative = _pair(case, torch.float32, prompt=9)
    q, k, v, _ = next(_tokens(case, torch.float32, 1, seed=0))
    impl = select("decode", "auto", DecodeState.step_torch, state, q, k, v, relative, phi=state.phi)
    assert impl is (decode_triton.decode_step_triton if CUDA else DecodeState.step_torch)
    q.requires_grad_(True)
    assert decode_triton.decode_unsupported_reason(state, q, k, v, relative, phi=state.phi).startswith("inputs that")
    with pytest.raises(ValueError, match="gradients"):
        state.step(q, k, v, None, relative, normalize=True, scale=0.3, eps=1e-6, backend="triton")
    narrow = DecodeState(2, 2, 8, 6, chunk_size=4, window=2, feature_map="relu", dtype=torch.float32,
                         device=torch.device(DEVICE))
    with pytest.raises(ValueError, match="window"):
        narrow.step(q.detach(), k, v, None, relative[:2], normalize=True, scale=0.3, eps=1e-6, backend="triton")


@run
def test_decode_step_op_opcheck():
    """torch.library.opcheck of `mhla_convert::decode_step`: it mutates exactly the state tensors it declares
    (run for real). On CUDA also its fake implementation and AOT dispatch (the interpreter cannot run a kernel on
    fake tensors)."""
    case = CASES["exact-2-gqa"]
    (state, _), relative = _pair(case, torch.float32, prompt=11)
    q, k, v, real = next(_tokens(case, torch.float32, 1, seed=6))
    args = (q, k, v, relative, state.position, real, *(getattr(state, name) for name in decode_triton._STATE), 4, 2,
            0, True, True, 0.3, 1e-6)
    checks = ("test_schema", "test_autograd_registration", *(("test_faketensor", "test_aot_dispatch_dynamic")
                                                             if CUDA else ()))
    result = torch.library.opcheck(torch.ops.mhla_convert.decode_step.default, args, test_utils=checks)
    assert result == dict.fromkeys(checks, "SUCCESS")


@gpu
@pytest.mark.parametrize("shape", ["llama", "qwen3"])
def test_kernel_step_at_lm_shapes(shape):
    """The Llama-3.2-1B and Qwen3 head shapes with the LM defaults (chunk 64, window 8, 2 exact chunks), bf16:
    200 tokens from a 1,000-token prompt, batch 3."""
    heads, kv_heads, dim = {"llama": (32, 8, 64), "qwen3": (16, 8, 128)}[shape]
    case = (3, heads, kv_heads, dim, dim, 64, 8, 2, True, "relu", True)
    (ours, ref), relative = _pair(case, torch.bfloat16, prompt=1000)
    for q, k, v, real in _tokens(case, torch.bfloat16, 200, seed=4):
        got = ours.step(q, k, v, real, relative, normalize=True, scale=dim**-0.5, eps=1e-6, backend="triton")
        want = ref.step(q, k, v, real, relative, normalize=True, scale=dim**-0.5, eps=1e-6, backend="torch")
        torch.testing.assert_close(got[real], want[real], atol=2e-2, rtol=2e-2)
    _compare(ours, ref, dict(atol=1e-4, rtol=1e-4))


@run
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmap, dims, chunk, window, exact", [("relu", (8, 6), 4, 4, 0), ("elu", (5, 7), 3, 5, 2)])
def test_prompt_kernels_equal_torch(fmap, dims, chunk, window, exact, dtype, monkeypatch):
    """A state started from a prompt by the kernels equals the torch form's in every tensor: rows of no tokens, of
    fewer than the chunks kept apart, of a partial open chunk, and of the whole prompt (its older tokens over several
    programs' splits), the ring included."""
    from dataclasses import replace

    from mhla_convert.kernels import settings

    monkeypatch.setattr(settings, "SETTINGS", replace(settings.SETTINGS, prompt_split_tokens=64))
    dim, dv = dims
    g = torch.Generator().manual_seed(5)
    k = torch.randn(5, 150, 3, dim, generator=g).to(DEVICE, dtype)
    v = torch.randn(5, 150, 3, dv, generator=g).to(DEVICE, dtype)
    lengths = torch.tensor([150, 77, 9, 2, 0], device=DEVICE)
    states = [DecodeState(5, 3, dim, dv, chunk_size=chunk, window=window, feature_map=fmap, dtype=dtype,
                          device=torch.device(DEVICE), exact_chunks=exact) for _ in range(2)]
    for state in states:  # (what an earlier prompt left behind must not matter)
        for t in state.tensors():
            t.copy_(torch.full_like(t, 3))
    states[0].prefill_torch(k, v, lengths)
    decode_triton.prompt_triton(states[1], k, v, lengths)
    _compare(states[1], states[0], dict(atol=1e-4, rtol=1e-5))
    assert states[1].far_s[0].abs().sum() > 0 and not states[1].far_s[4].any()


def test_prompt_kernels_refuse_what_they_cannot_take():
    state = DecodeState(1, 2, 4, 4, chunk_size=4, window=4, feature_map=torch.sigmoid, dtype=torch.float32,
                        device=torch.device("cpu"))
    k = torch.zeros(1, 8, 2, 4)
    with pytest.raises(ValueError, match="feature map"):
        decode_triton.prompt_triton(state, k, k, torch.tensor([8]))
