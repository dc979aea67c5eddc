"""MHLA under torch.compile: every family's converted tiny model traces whole (no graph break) and the
compiled model computes what the eager one does; the operators' custom ops pass `torch.library.opcheck`
(schema, fake tensors, autograd registration, AOT dispatch) and gradcheck. On CUDA: the same for the
Triton path, and a whole converted forward captured in a CUDA graph."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch._dynamo.testing

import mhla_convert
from mhla_convert.families import adapter_for_model, families
from mhla_convert.layer import MHLAConfig, MHLAttention
from mhla_convert.mixing import toeplitz_causal_mixing
from mhla_convert.ops import BlockLayout, mhla_attention, mhla_attention_reference
from mhla_convert.ops.exact_op import exact_attention_op
from mhla_convert.ops.mhla import attention_op

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

def _interpreted() -> bool:
    """Whether the Triton kernels run under the interpreter here (see test_kernels.py)."""
    try:
        from mhla_convert.kernels import mhla_triton
    except ImportError:
        return False
    return type(mhla_triton.K._readout_kernel).__name__ == "InterpretedFunction"


# FLUX reads its token grid from `img_ids` on the host (docs/converter.md, "MM-DiT"): graph breaks there
HOST_GRID = ("tiny-flux",)
TINY = [name for _, cls in sorted(families().items()) for name in cls().tiny_configs() if name not in HOST_GRID]
CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (and no TRITON_INTERPRET)")
interp = pytest.mark.skipif(not _interpreted(), reason="Triton is absent, or compiled here (no TRITON_INTERPRET)")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _converted(tiny, name, device="cpu", **options):
    """A converted tiny model (the family's defaults, updated by `options`) with non-trivial mixing, and its inputs:
    a small uneven grid (diffusers) or 70 tokens (LMs: chunks of 16, so past the exact window of 2 chunks; no
    generation cache, whose first allocation happens in eager code), batch 2."""
    torch.manual_seed(0)
    model = tiny(name, device=device)
    causal = adapter_for_model(model).causal
    mhla_convert.convert(model, ratio=0.67, **({"chunk_size": 16} if causal else {}), **options)
    with torch.no_grad():
        for _, layer in mhla_convert.mhla_layers(model):
            layer.mixing.mul_(torch.rand_like(layer.mixing))
    adapter = adapter_for_model(model)
    native = adapter.native_grid(model)
    grid = (70,) if native is None else tuple(min(g, 6) for g in native)
    torch.manual_seed(0)
    return model, {**adapter.example_inputs(model, grid, 2), **({"use_cache": False} if causal else {})}


def _main(out):
    return out.sample if hasattr(out, "sample") else out.logits


OPS = (torch.ops.mhla_convert.attention.default, torch.ops.mhla_convert.exact_attention.default,
       torch.ops.mhla_convert.joint_attention.default)


def _op_count(gm) -> int:
    return sum(node.target in OPS for node in gm.graph.nodes)


@pytest.mark.parametrize("name", TINY)
def test_converted_model_traces_without_graph_breaks(name, tiny):
    model, inputs = _converted(tiny, name)
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(**inputs)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1
    # every converted layer is one custom-op node (LMs' exact local chunks too)
    assert sum(_op_count(g) for g in explained.graphs) == len(list(mhla_convert.mhla_layers(model)))


@pytest.mark.parametrize("name", TINY)
def test_compiled_model_equals_eager(name, tiny):
    """fullgraph=True fails on any graph break; aot_eager runs the traced graph (the custom ops included) as
    traced, so this checks the tracing, not a code generator's rounding."""
    model, inputs = _converted(tiny, name)
    with torch.no_grad():
        want = _main(model(**inputs))
        got = _main(torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_converted_lm_with_its_default_cache_compiles_whole(tiny):
    """A converted LM called as transformers calls it by default (`use_cache=True`: a `DynamicCache`, whose MHLA
    states are allocated and filled inside the traced forward) traces without a graph break, as the original does;
    compiled, it returns eager's logits and a cache that the next step, eager or compiled, continues. That step runs
    with autograd on, as a plain call does: its output's gradient must not need the state it then updates."""
    torch.manual_seed(0)
    model = tiny("tiny-llama").eval()
    mhla_convert.convert(model, ratio=0.5, chunk_size=16)  # softmax and MHLA layers, exact chunks, 40 tokens
    # (transformers ≥ 5.24 takes the cache as `cache`, earlier releases as `past_key_values`)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    prompt, token = torch.randint(3, 128, (2, 40)), torch.randint(3, 128, (2, 1))
    explained = torch._dynamo.explain(model)(prompt)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        want, got = model(prompt), compiled(prompt)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-6, atol=1e-6)
    got_cache = got.past_key_values
    assert got_cache.get_seq_length() == 40
    want_next = model(token, **{name: want.past_key_values}).logits
    got_next = compiled(token, **{name: got_cache}).logits
    torch.testing.assert_close(got_next, want_next, rtol=1e-6, atol=1e-6)
    assert got_cache.get_seq_length() == 41
    want_next.sum().backward()
    mixing = [layer.mixing for _, layer in mhla_convert.mhla_layers(model)]
    want_grads = [m.grad.clone() for m in mixing]
    model.zero_grad()
    got_next.sum().backward()
    for g, w in zip((m.grad for m in mixing), want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("causal", [False, True], ids=["grid", "causal"])
def test_compiled_layer_gradients_equal_eager(causal):
    """Gradients through the registered backward equal eager autograd's, the mixing's included."""
    torch.manual_seed(0)
    config = MHLAConfig(causal=True, chunk_size=4, window=3) if causal else MHLAConfig(blocks=(2, 3))
    layer = MHLAttention(24, 4, num_kv_heads=2, qk_norm="per_head", config=config)
    with torch.no_grad():
        layer.mixing.mul_(torch.rand_like(layer.mixing))
    x, grid = torch.randn(2, 15, 24), (None if causal else (3, 5))
    compiled = torch.compile(lambda x: layer(x, grid), fullgraph=True, backend="aot_eager")
    grads = []
    for run in (lambda x: layer(x, grid), compiled):
        layer.zero_grad()
        x.grad = None
        run(x.requires_grad_()).square().mean().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in layer.parameters()])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-sana"])
def test_compiled_training_step_equals_eager(name, tiny):
    """A whole model's gradients through the registered backward (causal and non-causal) equal eager autograd."""
    model, inputs = _converted(tiny, name)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    grads = []
    for run in (model, compiled):
        model.zero_grad()
        _main(run(**inputs)).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("mixing" in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow
def test_inductor_compiled_model_equals_eager(tiny):
    model, inputs = _converted(tiny, "tiny-sana")
    with torch.no_grad():
        want = _main(model(**inputs))
        got = _main(torch.compile(model, fullgraph=True)(**inputs))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["grid", "causal"])
def test_dynamic_token_count_compiles_once(causal):
    """With dynamic shapes one graph serves every sequence length / grid (the op's layout is symbolic)."""
    torch.manual_seed(0)
    config = MHLAConfig(causal=True, chunk_size=4, window=3) if causal else MHLAConfig(blocks=(2, 2))
    layer = MHLAttention(24, 4, num_kv_heads=2, config=config)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x, grid: layer(x, grid), fullgraph=True, backend=counter, dynamic=True)
    frames = []
    for n in (10, 13, 30):
        grid = None if causal else (n // 2, 2)
        x = torch.randn(2, n if causal else n // 2 * 2, 24)
        torch.testing.assert_close(compiled(x, grid), layer(x, grid), rtol=1e-6, atol=1e-6)
        frames.append(counter.frame_count)
    assert frames[0] == frames[-1]  # no recompilation


def test_compiled_layer_with_callable_feature_map_traces_inline():
    """A callable φ cannot cross an op schema: it is traced inline, still without a graph break."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 12, 2, 8), torch.randn(2, 12, 2, 8), torch.randn(2, 12, 2, 8)
    mixing = torch.rand(4, 4)

    def fn(q, k, v, mixing):
        return mhla_attention(q, k, v, mixing, grid=(3, 4), blocks=(2, 2), feature_map=torch.sigmoid)

    explained = torch._dynamo.explain(fn)(q, k, v, mixing)
    assert explained.graph_break_count == 0 and sum(_op_count(g) for g in explained.graphs) == 0
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, mixing),
                               fn(q, k, v, mixing))


def test_compiled_decode_steps_equal_eager():
    """A causal layer's prefill and recurrent steps (through a chunk boundary) compiled as one function."""
    torch.manual_seed(0)
    layer = MHLAttention(32, 4, num_kv_heads=2, config=MHLAConfig(causal=True, chunk_size=3, window=3))
    with torch.no_grad():
        layer.mixing.copy_(torch.rand_like(layer.mixing))
    q, k, v = layer.project(torch.randn(2, 10, 32))

    def decode(q, k, v):
        out, state = layer.decode(q[:, :5], k[:, :5], v[:, :5], None)
        outs = [out]
        for t in range(5, 10):
            o, state = layer.decode(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], state)
            outs.append(o)
        return torch.cat(outs, 1), state.cur_s, state.recent_s, state.far_s

    with torch.no_grad():
        explained = torch._dynamo.explain(decode)(q, k, v)
        # one custom-op node, the prompt's; the steps trace as torch ops
        assert explained.graph_break_count == 0 and sum(_op_count(g) for g in explained.graphs) == 1
        want = decode(q, k, v)
        got = torch.compile(decode, fullgraph=True, backend="aot_eager")(q, k, v)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(want[0], layer.attend(q, k, v), rtol=1e-5, atol=1e-6)  # decode = parallel form


# --- the custom ops ---------------------------------------------------------------------------------------------
# (grid, blocks, chunk_size, causal, H, H_kv, D, Dv, per-head mixing, normalize, feature map)
ATTENTION_CASES = {
    "2d-uneven": ((5, 7), (2, 3), None, False, 2, 2, 8, 8, False, True, "relu"),
    "3d-gqa-per-head-elu-unnorm": ((2, 3, 5), (2, 2, 3), None, False, 4, 2, 8, 6, True, False, "elu"),
    "1d-one-kv-head": ((11,), (3,), None, False, 3, 1, 4, 5, False, True, "elu"),
    "causal-chunks-gqa": ((13,), None, 4, True, 4, 2, 8, 8, False, True, "relu"),
    "causal-blocks-per-head": ((10,), (3,), None, True, 2, 2, 6, 4, True, True, "elu"),
}


def _attention_args(case, batch=2, dtype=torch.float32, device="cpu", backend="torch"):
    grid, blocks, chunk, causal, heads, kv_heads, dim, dv, per_head, normalize, fmap = case
    n = torch.Size(grid).numel()
    layout = BlockLayout.chunked(n, chunk) if chunk else BlockLayout.create(grid, blocks)
    m = layout.num_blocks
    q = torch.randn(batch, n, heads, dim, dtype=dtype, device=device)
    k = torch.randn(batch, n, kv_heads, dim, dtype=dtype, device=device)
    v = torch.randn(batch, n, kv_heads, dv, dtype=dtype, device=device)
    mixing = torch.rand(*((heads,) if per_head else ()), m, m, dtype=dtype, device=device) + 0.1
    tensors = [t.requires_grad_() for t in (q, k, v, mixing)]
    options = [list(layout.grid), list(layout.blocks), list(layout.block_size), causal, fmap, normalize, dim ** -0.5,
               1e-6, backend]
    return tensors, options


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_op_opcheck(name):
    torch.manual_seed(0)
    tensors, options = _attention_args(ATTENTION_CASES[name])
    torch.library.opcheck(attention_op, (*tensors, *options))


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_op_matches_reference_and_gradcheck(name):
    """The op and its backward against the O(N²) reference; float64 gradcheck of the backward op."""
    case = ATTENTION_CASES[name]
    grid, blocks, chunk, causal, *_, normalize, fmap = case
    torch.manual_seed(0)
    tensors, options = _attention_args(case, dtype=torch.float64)
    out = attention_op(*tensors, *options)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, tensors, grad)
    want_out = mhla_attention_reference(*tensors, grid=grid, blocks=blocks, chunk_size=chunk, causal=causal,
                                        feature_map=fmap, normalize=normalize)
    want = torch.autograd.grad(want_out, tensors, grad)
    torch.testing.assert_close(out, want_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    small, options = _attention_args(case, batch=1, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda *t: attention_op(*t, *options), small, fast_mode=True)


def test_attention_op_frozen_mixing():
    """Inputs that need no gradient get none (and the others are unchanged)."""
    torch.manual_seed(0)
    tensors, options = _attention_args(ATTENTION_CASES["causal-chunks-gqa"])
    tensors[3].requires_grad_(False)
    out = attention_op(*tensors, *options)
    out.sum().backward()
    assert tensors[3].grad is None and all(t.grad is not None for t in tensors[:3])
    torch.library.opcheck(attention_op, (*tensors, *options))


@interp
@pytest.mark.parametrize("name", ["2d-uneven", "causal-chunks-gqa"])
def test_attention_op_triton_interpreted(name):
    """The Triton path inside the op (the kernels under the interpreter): opcheck, and gradients through the
    backend's registered backward against the torch path's."""
    torch.manual_seed(0)
    tensors, options = _attention_args(ATTENTION_CASES[name], backend="triton")
    torch.library.opcheck(attention_op, (*tensors, *options), test_utils=("test_schema", "test_autograd_registration",
                                                                         "test_faketensor"))
    out = attention_op(*tensors, *options)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, tensors, grad)
    want_out = attention_op(*tensors, *options[:-1], "torch")
    want = torch.autograd.grad(want_out, tensors, grad)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True], ids=["all-keys", "key-mask"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_exact_attention_op_opcheck_and_gradcheck(per_head, masked):
    """The exact-local-chunks op (GQA, a partial last chunk, 2 exact chunks): opcheck, the parallel form's value
    and gradients through the backward op, float64 gradcheck."""
    torch.manual_seed(0)

    def args(batch, dtype):
        n, chunk = 11, 3
        layout = BlockLayout.chunked(n, chunk)
        q, k, v = (torch.randn(batch, n, h, 4, dtype=dtype) for h in (4, 2, 2))
        mixing = torch.rand(*((4,) if per_head else ()), 4, 4, dtype=dtype).tril() + 0.1
        key_mask = (torch.arange(n) >= 2).expand(batch, n).contiguous() if masked else None
        options = [list(layout.grid), list(layout.blocks), list(layout.block_size), True, [2], "elu", 0.5, 1e-6,
                   "torch"]
        return [t.requires_grad_() for t in (q, k, v, mixing)], key_mask, options

    tensors, key_mask, options = args(2, torch.float32)
    torch.library.opcheck(exact_attention_op, (*tensors, key_mask, *options))
    tensors, key_mask, options = args(2, torch.float64)
    out = exact_attention_op(*tensors, key_mask, *options)
    want = mhla_attention(*tensors, causal=True, chunk_size=3, exact_chunks=2, feature_map="elu", scale=0.5,
                          key_mask=key_mask, backend="torch")
    torch.testing.assert_close(out, want)
    grad = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, tensors, grad), torch.autograd.grad(want, tensors, grad)):
        torch.testing.assert_close(g, w)
    small, key_mask, options = args(1, torch.float64)
    assert torch.autograd.gradcheck(lambda *t: exact_attention_op(*t, key_mask, *options), small, fast_mode=True)


def test_toeplitz_mixing_of_a_compiled_layer_is_traced():
    """The causal layer builds its mixing from `relative` inside the trace: gradients reach it."""
    torch.manual_seed(0)
    relative = torch.rand(4, requires_grad=True)
    compiled = torch.compile(lambda r: toeplitz_causal_mixing(r, 6).sum(), fullgraph=True, backend="aot_eager")
    compiled(relative).backward()
    assert relative.grad is not None and relative.grad.abs().sum() > 0


# --- CUDA: the Triton path inside the ops, CUDA graphs --------------------------------------------------------------
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_cuda_attention_op_opcheck_triton(name, dtype):
    torch.manual_seed(0)
    tensors, options = _attention_args(ATTENTION_CASES[name], dtype=dtype, device="cuda", backend="triton")
    torch.library.opcheck(attention_op, (*tensors, *options))
    tensors[3].requires_grad_(False)
    torch.library.opcheck(attention_op, (*tensors, *options))


@pytest.mark.parametrize("why", ["causal", "register cap", None])
def test_traced_inference_declines_what_inductor_cannot_launch(why, monkeypatch):
    """The Triton backend's traced form (the triton op inductor launches itself) declines causal attention and head
    dims whose launches take a register cap (inductor passes none), so the graph calls the opaque op there."""
    mhla_triton = pytest.importorskip("mhla_convert.kernels.mhla_triton")
    monkeypatch.setattr(mhla_triton, "interpreting", lambda: False)
    monkeypatch.setattr(mhla_triton, "attention_inference_op", lambda *args: "the triton op")
    dim = 128 if why == "register cap" else 16
    q = torch.empty(1, 16, 2, dim, device="meta")
    layout = BlockLayout.chunked(16, 4) if why == "causal" else BlockLayout.create((4, 4), (2, 2))
    assert mhla_triton.settings.SETTINGS.launches["summaries"][128].maxnreg  # (the case this test stands for)
    got = mhla_triton.mhla_attention_triton_traced(q, q, q, torch.empty(4, 4, device="meta"), layout,
                                                   causal=why == "causal", feature_map="relu", normalize=True,
                                                   scale=1.0, eps=1e-6)
    assert got == (None if why else "the triton op")


@interp
def test_compiled_triton_inference_under_the_interpreter_is_the_opaque_op():
    """The interpreter's kernels cannot be traced into a triton op, so a compiled inference call through the Triton
    backend stays the opaque op there, and equals the eager call."""
    torch.manual_seed(0)
    tensors, (grid, blocks, *_) = _attention_args(ATTENTION_CASES["2d-uneven"])
    q, k, v, mixing = (t.detach() for t in tensors)

    def fn(q, k, v, mixing):
        return mhla_attention(q, k, v, mixing, grid=tuple(grid), blocks=tuple(blocks), backend="triton")

    with torch.no_grad():
        explained = torch._dynamo.explain(fn)(q, k, v, mixing)
        assert explained.graph_break_count == 0 and sum(_op_count(g) for g in explained.graphs) == 1
        assert torch.equal(torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, mixing), fn(q, k, v, mixing))


@interp
def test_triton_op_traced_with_symbolic_sizes_is_the_opaque_op():
    """Traced with symbolic sizes (dynamic=True, or a shape change that makes dynamo's sizes dynamic), the triton op
    plans nothing: it is the opaque op on the Triton backend, which plans each call's launches at run time. (Traced
    with fixed sizes it launches the kernels through `wrap_triton`, which the interpreter's kernels cannot take.)"""
    from mhla_convert.kernels.mhla_triton import attention_inference_op

    def fn(q, k, v, mixing):
        return attention_inference_op(q, k, v, mixing, [5, 7], [2, 3], [3, 3], "relu", True, 0.25, 1e-6)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    torch.manual_seed(0)
    for batch, heads in ((2, 2), (3, 4)):
        q, k, v = (torch.randn(batch, 35, heads, 8) for _ in range(3))
        mixing = torch.rand(6, 6)
        want = mhla_attention(q, k, v, mixing, grid=(5, 7), blocks=(2, 3), scale=0.25, backend="triton")
        assert torch.equal(compiled(q, k, v, mixing), want)


@interp
def test_backend_choice_traces_without_a_graph_break():
    """Inference under torch.compile chooses its backend while tracing (`ops.mhla._traced_inference`): the Triton
    backend's checks must trace whole (no `id()`, which dynamo does not trace)."""
    from mhla_convert.kernels.mhla_triton import unsupported_reason
    from mhla_convert.ops.feature_maps import resolve_feature_map

    q, mixing, layout = torch.randn(1, 16, 2, 16), torch.rand(4, 4), BlockLayout.create((4, 4), (2, 2))
    phi = resolve_feature_map("elu")
    check = torch.compile(lambda q: unsupported_reason(q, q, q, mixing, layout, causal=False, phi=phi) is None,
                          fullgraph=True, backend="eager")
    assert check(q)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-dit", "tiny-sana", "tiny-wan"])
def test_cuda_inductor_launches_the_inference_kernels_itself(name, tiny):
    """Compiled for inference in inductor's default mode, a converted diffusion model's plain MHLA layers (no exact
    region, which is one opaque op) are the triton op `attention_inference`: the generated code launches the kernels
    itself, never calls the opaque op, and gives eager's outputs."""
    from torch._inductor.utils import run_and_get_code

    model, inputs = _converted(tiny, name, device="cuda", exact_radius=None)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        want = _main(model(**inputs))
        got, code = run_and_get_code(lambda: _main(compiled(**inputs)))
    source = "\n".join(code)
    assert "_readout_kernel" in source and "mhla_convert.attention." not in source
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [None, True], ids=["a-second-shape", "dynamic"])
def test_cuda_compiled_inference_at_symbolic_sizes(dynamic):
    """Compiled with dynamic=True, or called at a second shape (dynamo then makes the changed sizes symbolic), an
    inference call is the opaque op inside the triton op, and gives eager's outputs at every shape."""
    torch.manual_seed(0)
    mixing = torch.rand(4, 4, device="cuda")

    def fn(q, k, v):
        return mhla_attention(q, k, v, mixing, grid=(8, 8), blocks=(2, 2), backend="triton")

    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    with torch.no_grad():
        for batch, heads in ((1, 2), (2, 3), (3, 5)):
            q, k, v = (torch.randn(batch, 64, heads, 16, device="cuda") for _ in range(3))
            torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), rtol=1e-5, atol=1e-6)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["2d-uneven", "3d-gqa-per-head-elu-unnorm", "1d-one-kv-head"])
def test_cuda_attention_inference_op_opcheck(name, dtype):
    from mhla_convert.kernels.mhla_triton import attention_inference_op

    torch.manual_seed(0)
    tensors, (grid, blocks, block_size, _, fmap, normalize, scale, eps, _) = _attention_args(
        ATTENTION_CASES[name], dtype=dtype, device="cuda")
    tensors = [t.detach() for t in tensors]
    # (not test_aot_dispatch_dynamic: the op plans its launches for fixed shapes, and traced calls with symbolic ones
    # take the opaque op instead)
    torch.library.opcheck(attention_inference_op, (*tensors, grid, blocks, block_size, fmap, normalize, scale, eps),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_static"))
    want = mhla_attention(*tensors, grid=tuple(grid), blocks=tuple(blocks), feature_map=fmap, normalize=normalize,
                          backend="triton")
    got = attention_inference_op(*tensors, grid, blocks, block_size, fmap, normalize, scale, eps)
    assert torch.equal(got, want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-sana", "tiny-wan"])
def test_cuda_graph_of_converted_forward_equals_eager(name, tiny):
    """mode="reduce-overhead" replays the whole compiled forward (Triton kernels included) as CUDA graphs."""
    model, inputs = _converted(tiny, name, device="cuda")
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        want = _main(model(**inputs)).clone()
        for _ in range(3):  # warm-up, record, replay
            got = _main(compiled(**inputs)).clone()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
