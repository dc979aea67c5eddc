"""Decoding a converted LM through transformers' caches: static vs dynamic, torch.compile, left
padding, beam search, assisted decoding (crop), and the fixed-shape state's rollback."""

import inspect

import pytest
import torch
from transformers import CompileConfig
from transformers.cache_utils import DynamicCache, StaticCache

from mhla_convert.convert import convert
from mhla_convert.families import adapter_for_family
from mhla_convert.families.llama import MHLALlamaAttention, _real_tokens
from mhla_convert.families.lm_cache import MHLACacheLayer, MHLAStaticLayer, MHLAStaticSlidingLayer
from mhla_convert.ops.recurrent import FIELDS, DecodeState

ADAPTER = adapter_for_family("llama")
C = 8  # chunk size: prompts span several chunks and generation crosses chunk boundaries


def converted(family: str, ratio: float, seed: int = 0, **options) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = ADAPTER.build(ADAPTER.tiny_configs()[f"tiny-{family}"]).eval()
    convert(model, ratio=ratio, chunk_size=C, **options)
    return model


def cache_kw(model, cache) -> dict:
    """transformers ≥ 5.24 takes the cache as `cache`, earlier releases as `past_key_values`."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def ids(batch=2, length=27, seed=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(model, prompt, new=12, mask=None, **kw):
    """Greedy, never stopping early (so rows of a batch and single runs stay comparable)."""
    mask = torch.ones_like(prompt) if mask is None else mask
    return model.generate(prompt, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          return_dict_in_generate=True, output_logits=True, **kw)


def assert_same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-5, rtol=1e-4)


def is_mhla(model):
    return [isinstance(layer.self_attn, MHLALlamaAttention) for layer in model.model.layers]


CASES = [("llama", 1.0), ("llama", 0.5), ("qwen3", 1.0), ("qwen3", 0.5)]


@pytest.mark.parametrize("family, ratio", [*CASES, ("mistral", 0.5)])
def test_static_generation_equals_dynamic(family, ratio):
    model = converted(family, ratio)
    prompt = ids()
    dynamic = generate(model, prompt)
    static = generate(model, prompt, cache_implementation="static")
    assert_same(static, dynamic)
    cache = static.past_key_values
    assert isinstance(cache, StaticCache) and cache.is_compileable
    slot_class = MHLAStaticSlidingLayer if family == "mistral" else MHLAStaticLayer
    assert [isinstance(slot, slot_class) for slot in cache.layers] == is_mhla(model)
    assert int(cache.get_seq_length()) == prompt.shape[1] + 12 - 1  # the last token is never fed back


def test_static_state_is_allocated_once_and_updated_in_place():
    model = converted("qwen3", 0.5)
    prompt = ids(length=13)
    cache = StaticCache(config=model.config, max_cache_len=40)
    with torch.no_grad():
        model(prompt, use_cache=True, **cache_kw(model, cache))
        slots = [slot for slot in cache.layers if isinstance(slot, MHLAStaticLayer)]
        addresses = [[t.data_ptr() for t in (*slot.state.tensors(), slot.cumulative_length)] for slot in slots]
        before = [t.clone() for t in slots[0].state.tensors()]
        for t in range(prompt.shape[1], 30):  # crosses two chunk boundaries
            model(ids(length=1, seed=t), use_cache=True, position_ids=torch.full((2, 1), t), **cache_kw(model, cache))
    assert [[t.data_ptr() for t in (*slot.state.tensors(), slot.cumulative_length)] for slot in slots] == addresses
    assert not all(torch.equal(a, b) for a, b in zip(before, slots[0].state.tensors()))  # it did change
    assert all(int(slot.cumulative_length) == 30 for slot in slots)
    assert slots[0].state.position.tolist() == [30, 30]


@pytest.mark.parametrize("family, ratio, options", [("llama", 0.5, {}), ("llama", 1.0, {"retrieval_heads": [1]})])
def test_compiled_static_generation_equals_dynamic(family, ratio, options):
    """generate()'s automatic compile of the decoding step (as on CUDA; forced on CPU): one graph,
    no graph break, no recompilation from one token to the next (with retrieval heads too)."""
    model = converted(family, ratio, **options)
    prompt = ids()
    dynamic = generate(model, prompt, new=5)
    compile_config = CompileConfig(fullgraph=True, backend="eager", mode=None, dynamic=False)
    compile_config._compile_all_devices = True  # generate() compiles on accelerators only, unless told
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            static = generate(model, prompt, new=5, cache_implementation="static", compile_config=compile_config)
    finally:
        torch._dynamo.reset()
    assert hasattr(model, "_compiled_call")  # the steps did go through torch.compile
    assert_same(static, dynamic)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family, ratio, exact", [("llama", 1.0, 2), ("qwen3", 0.5, 0)])
def test_cuda_graph_static_generation_equals_torch_steps(family, ratio, exact):
    """On CUDA, generate()'s own compile of the static-cache step (inductor, CUDA graphs): the fused decoding
    kernel inside the graph, a left-padded batch, 3 chunk closes; the same tokens as eager decoding through the
    torch step on a dynamic cache."""
    rows = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (19, 11)]
    prompt, mask = (t.cuda() for t in _left_padded(rows))
    models = []
    for backend in ("torch", "auto"):
        torch.manual_seed(0)
        model = ADAPTER.build(ADAPTER.tiny_configs()[f"tiny-{family}"]).eval().cuda()
        convert(model, ratio=ratio, chunk_size=C, exact_chunks=exact, backend=backend)
        models.append(model)
    want = generate(models[0], prompt, new=3 * C, mask=mask)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = generate(models[1], prompt, new=3 * C, mask=mask, cache_implementation="static",
                           compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead", dynamic=False))
    finally:
        torch._dynamo.reset()
    assert hasattr(models[1], "_compiled_call")
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-3, rtol=1e-3)


def _left_padded(rows):
    length = max(len(r) for r in rows)
    prompt = torch.stack([torch.cat([torch.full((length - len(r),), 7), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(length - len(r)), torch.ones(len(r))]).long() for r in rows])
    return prompt, mask


@pytest.mark.parametrize("family, ratio, cache", [
    ("llama", 1.0, "dynamic"), ("llama", 1.0, "static"), ("llama", 1.0, None),
    ("qwen3", 0.5, "dynamic"), ("qwen3", 0.5, "static"), ("mistral", 1.0, "static"),
])
def test_left_padded_batch_equals_rows_alone(family, ratio, cache):
    """Padding by amounts that are not multiples of the chunk size: the padded tokens never enter
    a state and each row chunks its own tokens, so every row generates what it does alone."""
    model = converted(family, ratio)
    rows = [ids(1, n, seed=n)[0] for n in (21, 30, 13)]
    prompt, mask = _left_padded(rows)
    kw = {"cache_implementation": cache} if cache else {"use_cache": False}
    batch = generate(model, prompt, new=8, mask=mask, **kw)
    for i, row in enumerate(rows):
        alone = generate(model, row[None], new=8, **kw)
        assert torch.equal(batch.sequences[i, prompt.shape[1]:], alone.sequences[0, len(row):])
        torch.testing.assert_close(torch.stack(batch.logits)[:, i], torch.stack(alone.logits)[:, 0],
                                   atol=1e-5, rtol=1e-4)


def test_real_tokens_any_padding_pattern():
    """Left, right and middle padding in a dynamic-style mask (the current tokens are the last
    columns) and a static-style one (absolute positions, free columns after them)."""
    real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    mask = causal[None] & real[:, None, :]  # (B, q, kv): padded keys masked
    assert torch.equal(_real_tokens(mask[:, None], 5), real)
    static = torch.zeros(3, 1, 5, 9, dtype=torch.bool)
    static[:, 0, :, 2:7] = mask  # the five tokens at positions 2..6 of a 9-slot cache, earlier ones padding too
    assert torch.equal(_real_tokens(static, 5), real)
    additive = torch.where(static, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(_real_tokens(additive, 5), real)
    # one search per mask tensor (each layer of a forward gets the same one), again once it changes in place
    assert _real_tokens(static, 5) is _real_tokens(static, 5)
    static[0, 0, :, 2:7] = causal
    assert torch.equal(_real_tokens(static, 5), torch.cat([torch.ones(1, 5, dtype=torch.bool), real[1:]]))
    assert _real_tokens(causal.expand(2, 1, 5, 5).clone(), 5) is None  # no padding: nothing to pack


@pytest.mark.parametrize("family, ratio", [("llama", 1.0), ("qwen3", 0.5)])
def test_beam_search_static_equals_dynamic(family, ratio):
    model = converted(family, ratio)
    prompt = ids()
    dynamic = generate(model, prompt, num_beams=2)
    assert_same(generate(model, prompt, num_beams=2, cache_implementation="static"), dynamic)
    assert torch.equal(generate(model, prompt, num_beams=2, use_cache=False).sequences, dynamic.sequences)


@pytest.mark.parametrize("options", [{}, {"retrieval_heads": [1]}], ids=["mhla", "retrieval-heads"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_assisted_decoding_equals_greedy(cache, options, monkeypatch):
    """A tiny MHLA assistant drafts 3 tokens at a time; the main model verifies them in one call
    and both caches roll back the rejected ones (across chunk boundaries too)."""
    model = converted("llama", 1.0, **options)
    assistant = converted("llama", 0.5, seed=0)
    with torch.no_grad():  # close to the main model, not equal: some drafts are accepted, some not
        for p in assistant.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    rollbacks = []
    rollback = DecodeState.rollback
    monkeypatch.setattr(DecodeState, "rollback", lambda self, n: (rollbacks.append(n), rollback(self, n)))
    prompt = ids(batch=1)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    greedy = generate(model, prompt, new=16, **kw)
    try:
        assisted = generate(model, prompt, new=16, assistant_model=assistant, **kw)
    except ValueError as e:  # transformers < 5.24 refuses static caches here
        if "not supported with Static cache" in str(e):
            pytest.skip(str(e))
        raise
    assert torch.equal(assisted.sequences, greedy.sequences)
    assert any(n > 0 for n in rollbacks)


def _state(k, v, lengths, steps, real=None):
    state = DecodeState(k.shape[0], k.shape[2], k.shape[3], v.shape[3], chunk_size=C, window=4,
                        feature_map="elu", dtype=k.dtype, device=k.device)
    state.prefill(k[:, : -steps or None], v[:, : -steps or None], lengths)
    q = torch.randn(k.shape[0], 1, 2 * k.shape[2], k.shape[3])
    for t in range(k.shape[1] - steps, k.shape[1]):
        state.step(q, k[:, t : t + 1], v[:, t : t + 1], real, torch.rand(4), normalize=True, scale=0.25, eps=1e-6,
                   backend="torch")
    return state


def test_prefill_equals_stepping_through_the_prompt():
    """A long prompt (far sums, recent chunks, rollback copies all in use; rows of different lengths) gives the
    state that a short prompt and token-by-token steps through the rest give."""
    torch.manual_seed(0)
    k, v = torch.randn(2, 61, 2, 8), torch.randn(2, 61, 2, 6)
    at_once = _state(k, v, torch.tensor([61, 45]), steps=0)
    assert at_once.position.tolist() == [61, 45] and bool(at_once.far_s.abs().sum() > 0)
    for row, length in enumerate((61, 45)):
        stepped = _state(k[:, :length], v[:, :length], torch.tensor([3, 3]), steps=length - 3)
        for name, got, want in zip(FIELDS, at_once.tensors(), stepped.tensors()):
            torch.testing.assert_close(got[row], want[row], atol=1e-4, rtol=1e-5, msg=name)


def test_rollback_rebuilds_the_earlier_state():
    """Rows at different positions (the prompt's real lengths differ) go back 0 … C tokens, across
    a chunk close or not; the result equals the state that never saw those tokens. Further back
    than the chunk before the open one: an error naming the limit."""
    torch.manual_seed(0)
    k, v = torch.randn(2, 40, 2, 8), torch.randn(2, 40, 2, 6)
    lengths = torch.tensor([19, 14])  # then 21 steps: rows end at 40 and 35
    full = _state(k, v, lengths, steps=21)
    for back in range(C + 1):
        state = _state(k, v, lengths, steps=21)
        state.rollback(back)
        expected = _state(k[:, : 40 - back], v[:, : 40 - back], lengths, steps=21 - back)
        for got, want in zip(state.tensors()[:7], expected.tensors()[:7]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert full.position.tolist() == [40, 35]
    with pytest.raises(ValueError, match="at most"):
        full.rollback(3 * C)


def test_dynamic_cache_crop_and_reorder():
    model = converted("llama", 0.5)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids(length=20), use_cache=True, **cache_kw(model, cache))
    slot = cache.layers[1]
    assert isinstance(slot, MHLACacheLayer) and cache.is_croppable and cache.get_seq_length() == 20
    cache.crop(-3)
    assert slot.get_seq_length() == 17 and slot.state.position.tolist() == [17, 17]
    with pytest.raises(ValueError, match="negative"):
        slot.crop(5)
    first = slot.state.cur_s[0].clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(slot.state.cur_s[1], first)


@pytest.mark.parametrize("exact", [1, 2, 3])
def test_exact_window_steps_match_the_parallel_form(exact):
    """With exact chunks the ring is the softmax window: each step equals the parallel form's row."""
    from mhla_convert.mixing import toeplitz_causal_mixing
    from mhla_convert.ops import mhla_attention

    torch.manual_seed(1)
    q, k, v = torch.randn(2, 29, 4, 8), torch.randn(2, 29, 2, 8), torch.randn(2, 29, 2, 6)
    relative = torch.rand(4) + 0.1
    want = mhla_attention(q, k, v, toeplitz_causal_mixing(relative, -(-29 // C)), causal=True, chunk_size=C,
                          exact_chunks=exact)
    state = DecodeState(2, 2, 8, 6, chunk_size=C, window=4, feature_map="relu", dtype=k.dtype, device=k.device,
                        exact_chunks=exact)
    state.prefill(k[:, :11], v[:, :11], torch.tensor([11, 11]))
    for t in range(11, 29):
        got = state.step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], None, relative, normalize=True,
                         scale=8**-0.5, eps=1e-6, backend="torch")
        torch.testing.assert_close(got, want[:, t : t + 1], atol=1e-5, rtol=1e-5)
