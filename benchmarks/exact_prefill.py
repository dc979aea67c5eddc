"""LM prefill attention benchmark: causal MHLA with exact local chunks (what converted LMs run) — torch path
against Triton — and the original's causal SDPA (flash attention), per layer, forward only.

    python benchmarks/exact_prefill.py [--shapes llama-1b,qwen3] [--batch 8] [--tokens 32768] [--dtype bf16]

Defaults: Llama-3.2-1B-shaped (H = 32, H_kv = 8, D = 64) and Qwen3-shaped (H = 16, H_kv = 8, D = 128) layers,
chunks of 64, 2 exact chunks, a window of 8 (shared relative mixing). Prints, per variant, the median
forward time (ms, triton.testing.do_bench) and the peak memory it allocates beyond its inputs, output included
(MiB); "OOM" where it does not fit. A script, never a test.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from mhla_convert.mixing import toeplitz_causal_mixing
from mhla_convert.ops import mhla_attention
from mhla_convert.placement import DTYPES, parse_dtype

SHAPES = {"llama-1b": (32, 8, 64), "qwen3": (16, 8, 128)}  # heads, kv heads, head dim


def _sdpa(q, k, v):
    """The original's prefill: causal flash attention on (B, H, N, D), GQA without copies."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _measure(fn) -> tuple[float, float] | None:
    """(median ms, peak MiB allocated beyond what was live before), or None when it runs out of memory."""
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        return do_bench(fn, warmup=5, rep=50, return_mode="median"), peak
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama-1b,qwen3")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--exact-chunks", type=int, default=2)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    a = ap.parse_args()
    dt = parse_dtype(a.dtype)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} {a.dtype} B={a.batch} N={a.tokens} "
          f"C={a.chunk} L={a.exact_chunks} W={a.window}; forward ms (median), peak MiB beyond the inputs")
    print("| shape | variant | ms | peak MiB | vs SDPA |")
    for name in a.shapes.split(","):
        bench_shape(name, a, dt)
        torch.cuda.empty_cache()


def bench_shape(name, a, dt):
    heads, kv_heads, dim = SHAPES[name]
    torch.manual_seed(0)
    q, k, v = (torch.randn(a.batch, a.tokens, h, dim, device="cuda", dtype=dt) for h in (heads, kv_heads, kv_heads))
    mixing = toeplitz_causal_mixing(torch.rand(a.window, device="cuda") + 0.05, -(-a.tokens // a.chunk))
    kw = dict(causal=True, chunk_size=a.chunk, exact_chunks=a.exact_chunks)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    variants = {
        "sdpa (flash)": lambda: _sdpa(qt, kt, vt),
        "exact triton": lambda: mhla_attention(q, k, v, mixing, backend="triton", **kw),
        "exact torch": lambda: mhla_attention(q, k, v, mixing, backend="torch", **kw),
    }
    base = None
    with torch.no_grad():
        for variant, fn in variants.items():
            got = _measure(fn)
            if got is None:
                print(f"| {name} | {variant} | OOM | OOM | - |", flush=True)
                continue
            ms, peak = got
            base = ms if variant.startswith("sdpa") else base
            ratio = f"{base / ms:.2f}x" if base else "-"
            print(f"| {name} | {variant} | {ms:.3f} | {peak:.0f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
