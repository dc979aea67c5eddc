"""Decoding-step benchmark: the recurrent MHLA step (`mhla_recurrent_step`), torch vs Triton, per token.

    python benchmarks/decode_step.py [--batch 1 --heads 32 --kv-heads 8 --dim 64 --window 8 --chunk 64 --dtype bf16]

Defaults: one Llama-3.2-1B-shaped layer (H = 32, H_kv = 8, D = 64) with a window of 8 chunks of 64. The state
is prefilled with 1,000 tokens (all W − 2 recent chunks and the far sum in use), then `--tokens` steps run
back to back, chunk closures included. Prints µs per token: wall clock over all steps with one synchronize
at the end (host and GPU, what a decoding loop sees; median of 5 runs) and, for the Triton kernel alone,
do_bench's CUDA-event time of one launch. A script, never a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mhla_convert.ops import init_state, mhla_recurrent_step
from mhla_convert.placement import DTYPES, parse_dtype


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("batch", 1), ("heads", 32), ("kv-heads", 8), ("dim", 64), ("window", 8), ("chunk", 64),
                          ("prefill", 1000), ("tokens", 512)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    a = ap.parse_args()
    dt, dev = parse_dtype(a.dtype), "cuda"
    torch.manual_seed(0)
    n = a.prefill + a.tokens
    q = torch.randn(a.batch, n, a.heads, a.dim, device=dev, dtype=dt)
    k = torch.randn(a.batch, n, a.kv_heads, a.dim, device=dev, dtype=dt)
    v = torch.randn(a.batch, n, a.kv_heads, a.dim, device=dev, dtype=dt)
    relative = torch.rand(a.window, device=dev)
    steps = [[x[:, t : t + 1] for x in (q, k, v)] for t in range(a.prefill, n)]
    state0 = init_state(k[:, : a.prefill], v[:, : a.prefill], chunk_size=a.chunk, window=a.window)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} {a.dtype} B={a.batch} H={a.heads} "
          f"H_kv={a.kv_heads} D={a.dim} W={a.window} chunk={a.chunk} prefill={a.prefill} tokens={a.tokens}")
    outs = {}
    for backend in ("torch", "triton"):
        def run():
            state, out = state0, []
            for s in steps:
                o, state = mhla_recurrent_step(state, *s, relative, backend=backend)
                out.append(o)
            return out

        outs[backend] = run()  # warm-up (compiles every NREC variant)
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / a.tokens * 1e6)
        print(f"| {backend} step | {statistics.median(times):.1f} us/token (wall, median of 5 x {a.tokens} tokens) |")
    err = max(((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(outs["triton"], outs["torch"]))
    print(f"max relative difference triton vs torch over the tokens: {err:.2e}")
    from triton.testing import do_bench

    from mhla_convert.kernels import mhla_recurrent_step_triton
    from mhla_convert.ops import resolve_feature_map

    relu = resolve_feature_map("relu")
    kern = do_bench(lambda: mhla_recurrent_step_triton(state0, *steps[0], relative, phi=relu, normalize=True,
                                                       scale=a.dim**-0.5, eps=1e-6),
                    warmup=25, rep=200, return_mode="median")
    print(f"| triton step, one call (do_bench, CUDA events) | {kern * 1e3:.1f} us |")


if __name__ == "__main__":
    main()
