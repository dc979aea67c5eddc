"""Generation speed of converted LMs against their originals: prefill, decoding, peak memory, host overhead.

    python benchmarks/lm_generate.py [--models llama,qwen3] [--variants original,mhla,hybrid]
        [--prompts 8192,32768] [--batches 1,8] [--new-tokens 256] [--out DIR] [--tiny]

Models: Llama-3.2-1B- and Qwen3-1.7B-shaped (the default), and by name Gemma-3-1B- (`gemma3`: five sliding-window
layers to each global one) and Qwen3-30B-A3B-shaped (`qwen3-moe`: 128 experts, about 61 GB in bf16), built from their
hub `config.json` (written out below; no download) with random weights, bf16, `attn_implementation="sdpa"`.
Variants: `original`; `mhla`, every self-attention converted with `mhla_convert.convert(model, ratio=1.0)` (the
family's defaults; `--mhla-option KEY=VALUE` changes one); `hybrid`, `ratio=0.5` (every other layer).

Every variant decodes on the same path, transformers' static-cache recipe: a `StaticCache` sized for the
prompt and the new tokens, the prompt in one eager forward (as `generate()` runs it), then one greedy token
per step through `torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)`
(inductor + CUDA graphs). That is the compiled forward `generate(cache_implementation="static")` builds for
itself, without generate()'s per-token host work: on CUDA, generate() reads `unfinished_sequences.max()` on
the host after every token (a device sync) and runs its logits processors and stopping criteria in Python
while the GPU waits. The loop here keeps tokens and positions on the GPU and never synchronises, so it is
the fastest path transformers offers and its wall time measures the model rather than generate(). `--tiny`
checks the loop's logits against generate()'s.

Per (model, variant, prompt, batch), after a warm-up on the same shapes and the same cache (prompt and a
few steps: compile and CUDA-graph capture; the cache is `reset()` and reused, as generate() reuses its own,
so the graphs replay on the same addresses):

- prefill ms: CUDA events around the prompt's forward;
- decode: wall clock of the `new_tokens - 1` decoding steps (the prompt's forward gives the first token),
  from an idle GPU to the last token (so the host's time counts where the GPU waits on it); ms per step and
  tokens/s = batch x steps / time;
- peak GiB: `torch.cuda.max_memory_allocated` over the prefill and over the whole generation (reset just
  before it: weights, cache and CUDA-graph pools included), and the cache's own tensors in MiB;
- wall/gpu: the decoding step's wall time against its GPU time, measured twice, on steps after the measured
  ones: the kernels' busy time under `torch.profiler` (union of the CUDA kernel, memcpy and memset
  intervals), and CUDA events around steps queued behind a GPU sleep (so the GPU runs them back to back and
  never waits on the host). Near 1: the GPU paces decoding; the project's target is below 1.3;
- ratios against the original of the same model and shape: prefill and decode speed-up, peak-memory ratio.

Prints progress lines while it runs and a Markdown table at the end (date, GPU, versions, command); the raw
numbers go to DIR/lm_generate.json after every configuration (rows of earlier runs in the same file are kept
unless measured again) and the table of all its rows to DIR/lm_generate.md. A configuration that fails (out
of memory, a compile error) is recorded with its error and the run goes on.

`--tiny`: 2-3-layer, 64-wide versions of the models on the CPU in float32, prompts 64 and 128, 8 new tokens,
no compile (`--compile eager` traces the step with dynamo alone), perf_counter timings: a smoke run.
"""

from __future__ import annotations

import argparse
import ast
import gc
import inspect
import json
import shlex
import sys
import time
import traceback
from datetime import date
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

# the hub config.json of each model (meta-llama/Llama-3.2-1B, Qwen/Qwen3-1.7B), less its token ids and dtype
CONFIGS = {
    "llama": ("Llama-3.2-1B", dict(
        model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False, attention_dropout=0.0,
        head_dim=64, hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=8192,
        max_position_embeddings=131072, mlp_bias=False, num_attention_heads=32, num_hidden_layers=16,
        num_key_value_heads=8, pretraining_tp=1, rms_norm_eps=1e-5,
        rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192, rope_type="llama3"),
        rope_theta=500000.0, tie_word_embeddings=True, use_cache=True, vocab_size=128256,
    )),
    "qwen3": ("Qwen3-1.7B", dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=False, attention_dropout=0.0,
        head_dim=128, hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=6144,
        max_position_embeddings=40960, max_window_layers=28, num_attention_heads=16, num_hidden_layers=28,
        num_key_value_heads=8, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000, sliding_window=None,
        tie_word_embeddings=True, use_cache=True, use_sliding_window=False, vocab_size=151936,
    )),
    "gemma3": ("Gemma-3-1B", dict(  # google/gemma-3-1b-pt: 5 sliding-window layers (512 tokens) to each global one
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], attention_bias=False, attention_dropout=0.0,
        attn_logit_softcapping=None, final_logit_softcapping=None, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", hidden_size=1152, initializer_range=0.02, intermediate_size=6912,
        max_position_embeddings=32768, num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1,
        query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_local_base_freq=10000.0, rope_scaling=None,
        rope_theta=1000000.0, sliding_window=512, sliding_window_pattern=6, use_cache=True, vocab_size=262144,
    )),
    "qwen3-moe": ("Qwen3-30B-A3B", dict(  # 128 experts, 8 a token: the attention converts, the experts stay
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], attention_bias=False, attention_dropout=0.0,
        decoder_sparse_step=1, head_dim=128, hidden_act="silu", hidden_size=2048, initializer_range=0.02,
        intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[],
        moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4, output_router_logits=False,
        rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None,
        tie_word_embeddings=False, use_cache=True, use_sliding_window=False, vocab_size=151936,
    )),
}
# --tiny: the same configs, narrow and shallow (Qwen3 keeps head_dim != hidden / heads)
TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, vocab_size=256, max_window_layers=2),
    "gemma3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, vocab_size=256, sliding_window=128,
                   sliding_window_pattern=3),
    "qwen3-moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=4, num_experts_per_tok=2,
                      vocab_size=256, max_window_layers=2),
}
VARIANTS = {"original": None, "mhla": 1.0, "hybrid": 0.5}  # variant -> convert(ratio=...)
WARMUP_STEPS = 5  # decoding steps of the warm-up: CUDA graph trees run, record, then replay
PROBE_STEPS = 8  # decoding steps under the profiler, and again behind a GPU sleep
SLEEP_CYCLES = 400_000_000  # the GPU sleep the probe's steps queue behind (about 0.2 s)
GIB = 2**30


def _csv(kind, choices=None):
    def parse(text):
        items = [kind(x) for x in text.split(",") if x]
        bad = [x for x in items if choices is not None and x not in choices]
        if bad or not items:
            expected = ", ".join(choices or [kind.__name__])
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {expected}")
        return items
    return parse


def _option(text):
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=_csv(str, CONFIGS), default=["llama", "qwen3"])
    ap.add_argument("--variants", type=_csv(str, VARIANTS), default=list(VARIANTS))
    ap.add_argument("--prompts", type=_csv(int), help="prompt lengths (default 8192,32768; --tiny: 64,128)")
    ap.add_argument("--batches", type=_csv(int), default=[1, 8])
    ap.add_argument("--new-tokens", type=int, help="new tokens per row, the prompt's included (default 256; --tiny 8)")
    ap.add_argument("--compile", choices=("reduce-overhead", "eager", "none"),
                    help="the decoding step: inductor + CUDA graphs (default), dynamo alone (a tracing check), "
                         "or eager PyTorch (default with --tiny)")
    ap.add_argument("--mhla-option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                    help="a convert() keyword for the mhla and hybrid variants, e.g. exact_chunks=0")
    ap.add_argument("--out", type=Path, default=Path("docs/bench"), help="directory of lm_generate.json and .md")
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a smoke run")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    args.prompts = args.prompts or ([64, 128] if args.tiny else [8192, 32768])
    args.new_tokens = args.new_tokens or (8 if args.tiny else 256)
    args.compile = args.compile or ("none" if args.tiny else "reduce-overhead")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (the prompt's forward gives the first)")
    if not args.tiny and not torch.cuda.is_available():
        ap.error("the benchmark needs a CUDA GPU; --tiny runs tiny models on the CPU")
    return args


# --- models ------------------------------------------------------------------------------------------------
def build(name: str, tiny: bool, device, dtype, seed: int = 0):
    """The model `name` with random weights (the same for every call with the same seed and device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {**CONFIGS[name][1], **(TINY[name] if tiny else {})}
    hf_config = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def variant_model(name, variant, args, device, dtype):
    """(model, converted layer indices)."""
    from mhla_convert import convert

    model = build(name, args.tiny, device, dtype)
    if VARIANTS[variant] is None:
        return model, []
    report = convert(model, ratio=VARIANTS[variant], **dict(args.mhla_option))
    return model, report.converted


def _cache_kw(model) -> str:
    """transformers >= 5.24 takes the cache as `cache`, earlier releases as `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _step_fn(model, mode: str):
    if mode == "none":
        return model.forward
    if mode == "eager":
        return torch.compile(model.forward, backend="eager", fullgraph=True, dynamic=False)
    return torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)


def cache_bytes(cache) -> int:
    """Bytes of the tensors a cache's layers hold, directly or in objects they hold (an MHLA layer's state and its
    retrieval heads' keys and values)."""
    tensors = {}

    def visit(obj, depth):
        for value in vars(obj).values():
            if isinstance(value, torch.Tensor):
                tensors[(value.data_ptr(), value.nbytes)] = value.nbytes
            elif depth and hasattr(value, "__dict__") and not callable(value):
                visit(value, depth - 1)

    for layer in cache.layers:
        visit(layer, 2)
    return sum(tensors.values())


# --- one generation ----------------------------------------------------------------------------------------
class Generation:
    """Greedy decoding of one batch of prompts on a static cache: the prompt eagerly, each later token
    through `step` (the compiled forward). Tokens and positions stay on the device: nothing synchronises."""

    def __init__(self, model, step, cache, prompt: torch.Tensor):
        self.model, self.step, self.cache, self.prompt = model, step, cache, prompt
        self.kw = {_cache_kw(model): cache, "use_cache": True}

    def reset(self):
        self.cache.reset()

    def prefill(self):
        logits = self.model(input_ids=self.prompt, logits_to_keep=1, **self.kw).logits[:, -1]
        self.tokens, self.logits = [logits.argmax(-1, keepdim=True)], [logits.float()]
        self.position = torch.full_like(self.tokens[0], self.prompt.shape[1])

    def decode(self, steps: int, keep_logits: bool = False):
        for _ in range(steps):
            torch.compiler.cudagraph_mark_step_begin()
            logits = self.step(input_ids=self.tokens[-1], position_ids=self.position, **self.kw).logits[:, -1]
            self.tokens.append(logits.argmax(-1, keepdim=True))
            self.position.add_(1)
            if keep_logits:
                self.logits.append(logits.float().clone())

    def new_tokens(self) -> torch.Tensor:
        return torch.cat(self.tokens, 1)


def _count(group: str, name: str) -> int:
    """One of torch.compile's counters: ("stats", "unique_graphs") graphs compiled, ("inductor",
    "cudagraph_skips") compiled graphs that run without CUDA graphs (inductor logs why)."""
    from torch._dynamo.utils import counters

    return counters[group][name]


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def _ms(fn, cuda) -> float:
    """Wall time of fn() from an idle device to its last kernel."""
    _sync(cuda)
    start = time.perf_counter()
    fn()
    _sync(cuda)
    return (time.perf_counter() - start) * 1e3


def _event_ms(fn, cuda) -> float:
    if not cuda:
        return _ms(fn, cuda)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def profiled_gpu_ms(fn, cuda) -> float | None:
    """GPU busy time of fn() under torch.profiler: the union of its device intervals (kernels, copies)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(cuda)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if not e.is_user_annotation and e.device_type == DeviceType.CUDA)
    busy, reach = 0.0, float("-inf")
    for start, end in spans:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy / 1e3 if spans else None


def held_gpu_ms(fn) -> float | None:
    """CUDA-event time of fn()'s work queued behind a GPU sleep, so it runs back to back without waiting on
    the host; None if the host took longer to queue it than the sleep lasted."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    torch.cuda.synchronize()
    events[0].record()
    torch.cuda._sleep(SLEEP_CYCLES)
    events[1].record()
    start = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - start) * 1e3
    events[2].record()
    torch.cuda.synchronize()
    return events[1].elapsed_time(events[2]) if host_ms < events[0].elapsed_time(events[1]) else None


def measure(model, args, prompt_len: int, batch: int, device) -> dict:
    cuda = device.type == "cuda"
    from transformers.cache_utils import StaticCache

    steps = args.new_tokens - 1
    probe = PROBE_STEPS
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + args.new_tokens + 2 * probe)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                           generator=torch.Generator().manual_seed(prompt_len + batch)).to(device)
    gen = Generation(model, _step_fn(model, args.compile), cache, prompt)
    row, skips = {}, _count("inductor", "cudagraph_skips")
    with torch.no_grad():
        t0 = time.perf_counter()
        gen.reset()
        gen.prefill()
        gen.decode(min(WARMUP_STEPS, steps))
        warm = gen.new_tokens()
        _sync(cuda)
        row["warmup_s"] = time.perf_counter() - t0
        graphs = _count("stats", "unique_graphs")
        gen.reset()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        row["prefill_ms"] = _event_ms(gen.prefill, cuda)
        row["prefill_peak_gib"] = torch.cuda.max_memory_allocated() / GIB if cuda else None
        row["decode_ms"] = _ms(lambda: gen.decode(steps, keep_logits=args.tiny), cuda)
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB if cuda else None
        row["cache_mib"] = cache_bytes(cache) / 2**20
        row["compiled_while_measured"] = _count("stats", "unique_graphs") - graphs  # 0 unless a guard failed
        tokens = gen.new_tokens()
        row["repeat_ok"] = torch.equal(tokens[:, : warm.shape[1]], warm)
        row["decode_steps"] = steps
        row["decode_ms_per_step"] = row["decode_ms"] / steps
        row["decode_tok_s"] = batch * steps / row["decode_ms"] * 1e3
        # steps after the measured ones
        gpu = profiled_gpu_ms(lambda: gen.decode(probe), cuda) if cuda else None
        held = held_gpu_ms(lambda: gen.decode(probe)) if cuda else None
        for how, ms in (("profiler", gpu), ("held", held)):
            row[f"gpu_ms_per_step_{how}"] = None if ms is None else ms / probe
            row[f"wall_over_gpu_{how}"] = None if not ms else row["decode_ms_per_step"] / (ms / probe)
        if args.tiny:
            row.update(check_against_generate(model, prompt, gen, args.new_tokens))
    row["cudagraph_skips"] = _count("inductor", "cudagraph_skips") - skips
    return row


def check_against_generate(model, prompt, gen: Generation, new_tokens: int) -> dict:
    """The loop's tokens and logits against generate()'s on a static cache (eager): the loop drives the model
    as generate() does."""
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                         return_dict_in_generate=True, output_logits=True)
    want = torch.stack([t.float() for t in out.logits], 1)
    got = torch.stack(gen.logits[:new_tokens], 1)
    same = torch.equal(out.sequences[:, prompt.shape[1]:], gen.new_tokens()[:, :new_tokens])
    return {"same_tokens_as_generate": same, "max_logit_diff_vs_generate": (got - want).abs().max().item()}


# --- results -----------------------------------------------------------------------------------------------
def environment(args, device) -> dict:
    def ver(package):
        try:
            return version(package)
        except PackageNotFoundError:
            return "absent"

    cuda = device.type == "cuda"
    return {
        "date": str(date.today()), "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "transformers": ver("transformers"), "triton": ver("triton"),
        "dtype": "float32" if args.tiny else "bfloat16", "compile": args.compile,
        "mhla_options": dict(args.mhla_option),
        "command": shlex.join(["python", "benchmarks/lm_generate.py", *args.argv]),
    }


def row_key(row) -> tuple:
    return row["model"], row["variant"], row["prompt"], row["batch"], row["new_tokens"], row["tiny"]


class Results:
    """DIR/lm_generate.json: {"runs": [environment], "rows": [...]}, rewritten after every row."""

    def __init__(self, out: Path, env: dict):
        self.path = out / "lm_generate.json"
        out.mkdir(parents=True, exist_ok=True)
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"runs": [], "rows": []}
        self.run = len(self.data["runs"])
        self.data["runs"].append(env)
        self.mine = []

    def add(self, row: dict) -> None:
        row = {**row, "run": self.run}
        self.data["rows"] = [r for r in self.data["rows"] if row_key(r) != row_key(row)] + [row]
        self.mine.append(row)
        self.path.write_text(json.dumps(self.data, indent=1))
        self.path.with_suffix(".md").write_text(table(self.data["rows"], self.data["runs"]))


def _fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


def table(rows: list[dict], runs: list[dict]) -> str:
    used = sorted({r["run"] for r in rows})
    lines = [f"run {i}: {runs[i]['date']}, {runs[i]['gpu']}, torch {runs[i]['torch']}, transformers "
             f"{runs[i]['transformers']}, triton {runs[i]['triton']}, {runs[i]['dtype']}, decoding step compile: "
             f"{runs[i]['compile']}; `{runs[i]['command']}`" for i in used]
    lines += ["", "Ratios against the original of the same model and shape: speed-up (original time / variant time) "
              "and peak memory (variant / original). wall/gpu: decoding step's wall time over its GPU time "
              "(profiler's kernel time; back to back behind a GPU sleep).", "",
              "| model | variant | prompt | batch | prefill ms | prefill x | decode ms/step | decode tok/s | decode x "
              "| prefill peak GiB | peak GiB | peak ratio | cache MiB | wall/gpu (profiler) | wall/gpu (held) | note |",
              "|" + "---|" * 16]
    # each variant against the original measured in the same run (process) where there is one
    originals = {}
    for r in rows:
        if r["variant"] == "original" and not r.get("error"):
            shape = (r["model"], r["prompt"], r["batch"], r["new_tokens"], r["tiny"])
            originals[(r["run"], *shape)] = originals[shape] = r
    for r in rows:
        shape = (r["model"], r["prompt"], r["batch"], r["new_tokens"], r["tiny"])
        base = originals.get((r["run"], *shape), originals.get(shape))
        if r.get("error"):
            lines.append(f"| {r['model']} | {r['variant']} | {r['prompt']} | {r['batch']} |" + " |" * 11
                         + f" {r['error'].splitlines()[0][:200]} |")
            continue

        def ratio(key, inverse=False):
            if base is None or not base.get(key) or not r.get(key):
                return "-"
            return f"{(r[key] / base[key]) if inverse else (base[key] / r[key]):.2f}"

        note = [] if r.get("repeat_ok", True) else ["warm-up and measured tokens differ"]
        if r.get("compiled_while_measured"):
            note.append(f"{r['compiled_while_measured']} graph(s) compiled during the measured run")
        if r.get("cudagraph_skips"):
            note.append("ran without CUDA graphs (the log says why)")
        if "same_tokens_as_generate" in r:
            note.append(f"vs generate(): tokens {'same' if r['same_tokens_as_generate'] else 'DIFFER'}, "
                        f"logits within {r['max_logit_diff_vs_generate']:.1e}")
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['prompt']} | {r['batch']} | {r['prefill_ms']:.1f} "
            f"| {ratio('prefill_ms')} | {r['decode_ms_per_step']:.3f} | {r['decode_tok_s']:.0f} "
            f"| {ratio('decode_ms_per_step')} | {_fmt(r['prefill_peak_gib'])} | {_fmt(r['peak_gib'])} "
            f"| {ratio('peak_gib', inverse=True)} | {r['cache_mib']:.1f} | {_fmt(r.get('wall_over_gpu_profiler'))} "
            f"| {_fmt(r.get('wall_over_gpu_held'))} | {'; '.join(note)} |")
    return "\n".join(lines) + "\n"


def _free(cuda):
    torch._dynamo.reset()  # also frees the CUDA-graph pools of the previous shapes
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()


def run(args, results: Results, device, dtype) -> None:
    cuda = device.type == "cuda"
    for name in args.models:
        for variant in args.variants:
            common = {"model": name, "model_name": CONFIGS[name][0], "variant": variant, "tiny": args.tiny,
                      "new_tokens": args.new_tokens}
            try:
                model, converted = variant_model(name, variant, args, device, dtype)
                model_error = None
            except Exception as e:  # noqa: BLE001 - recorded in every row of the variant
                traceback.print_exc()
                model, converted, model_error = None, [], f"{type(e).__name__}: {e}"
            for prompt_len in args.prompts:
                for batch in args.batches:
                    row = {**common, "prompt": prompt_len, "batch": batch, "converted_layers": converted}
                    label = f"[{name} {variant} prompt {prompt_len} batch {batch}]"
                    start = time.perf_counter()
                    if model_error:
                        row["error"] = model_error
                    else:
                        try:
                            row.update(measure(model, args, prompt_len, batch, device))
                        except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
                            traceback.print_exc()
                            row["error"] = f"{type(e).__name__}: {e}"
                    _free(cuda)
                    results.add(row)
                    took = time.perf_counter() - start
                    if row.get("error"):
                        print(f"{label} FAILED after {took:.1f} s: {row['error'].splitlines()[0]}", flush=True)
                    else:
                        print(f"{label} warm-up {row['warmup_s']:.1f} s, prefill {row['prefill_ms']:.1f} ms, "
                              f"decode {row['decode_ms_per_step']:.3f} ms/step ({row['decode_tok_s']:.0f} tok/s), "
                              f"peak {_fmt(row['peak_gib'])} GiB, wall/gpu {_fmt(row.get('wall_over_gpu_profiler'))} "
                              f"/ {_fmt(row.get('wall_over_gpu_held'))}; {took:.1f} s", flush=True)
            del model
            _free(cuda)


def main(argv=None) -> dict:
    """Runs the benchmark; returns {"runs": [environment], "rows": this run's rows}."""
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    env = environment(args, device)
    results = Results(args.out, env)
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    threads = torch.get_num_threads()
    if args.tiny:
        torch.set_num_threads(1)  # tiny ops: threads only add overhead, and contention on a shared CPU
    try:
        run(args, results, device, dtype)
    finally:
        torch.set_num_threads(threads)
    print()
    print(table(results.mine, results.data["runs"]), flush=True)
    return {"runs": results.data["runs"], "rows": results.mine}


if __name__ == "__main__":
    main()
