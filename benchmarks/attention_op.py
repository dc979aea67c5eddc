"""Attention-operator benchmark: SDPA vs MHLA (torch path) vs MHLA (Triton) — and, causal, fla's
`chunk_linear_attn` when installed, with and without its normaliser — forward and forward+backward, over N for
the target shapes. Non-causal shapes also time MHLA with each query block's own block read exactly
(`exact_radius=0`, the Wan default), on the torch path and on Triton (`mhla_exact_*`).

    python benchmarks/attention_op.py [--shapes wan,dit,sana,causal] [--dtype bf16] [--timing eager,graph]
        [--out docs/bench/attention_op]

Each call is timed two ways (ms, medians after warm-up): `eager`, as a Python loop of calls
(triton.testing.do_bench), which at small shapes measures the host's launch time as much as the GPU's; and
`graph`, the calls captured in a CUDA graph and replayed (triton.testing.do_bench_cudagraph), as under
torch.compile(mode="reduce-overhead"): the GPU time alone. Prints a table, writes <out>.csv and, with
matplotlib, <out>.png (time vs N). A script, never a test.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
from datetime import date

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from mhla_convert.mixing import locality_mixing
from mhla_convert.ops import mhla_attention
from mhla_convert.placement import DTYPES, parse_dtype

# name -> (heads, head dim, [(grid, blocks), ...]); causal rows use chunk 64
SHAPES = {
    "wan": (12, 128, [((21, 10, 20), (7, 3, 5)), ((21, 20, 40), (7, 3, 5)), ((21, 30, 50), (7, 3, 5))]),
    "dit": (16, 72, [((32, 32), (4, 4)), ((64, 64), (8, 8)), ((128, 128), (8, 8))]),
    "sana": (70, 32, [((32, 32), (4, 4)), ((64, 64), (8, 8)), ((128, 128), (8, 8))]),
    "causal": (32, 64, [((2048,), None), ((8192,), None), ((32768,), None)]),
}
CHUNK = 64


def _time(fn, timing: str) -> float:
    if timing == "eager":
        return do_bench(fn, warmup=25, rep=200, return_mode="median")
    try:
        return do_bench_cudagraph(fn, rep=200, return_mode="median")
    except RuntimeError as err:  # a call that cannot be captured (a host synchronisation) has no graph time
        print(f"  no CUDA graph: {str(err).splitlines()[0]}", flush=True)
        return float("nan")


def _fwd_bwd(fn, inputs):
    def run():
        out = fn()
        out.backward(grad)
        for t in inputs:
            t.grad = None

    grad = torch.randn_like(fn())
    return run


def bench_row(family, heads, dim, grid, blocks, dtype, timings):
    causal = family == "causal"
    n = math.prod(grid)
    dev = "cuda"
    make = lambda *s: torch.randn(*s, device=dev, dtype=dtype, requires_grad=True)  # noqa: E731
    q, k, v = make(1, n, heads, dim), make(1, n, heads, dim), make(1, n, heads, dim)
    if causal:
        m = -(-n // CHUNK)
        mixing = torch.rand(m, m, device=dev).tril().requires_grad_()
        kw = dict(causal=True, chunk_size=CHUNK)
    else:
        mixing = locality_mixing(blocks).to(dev).requires_grad_()
        kw = dict(grid=grid, blocks=blocks)
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    variants = {
        "sdpa": (lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), [qt, kt, vt]),
        "mhla_torch": (lambda: mhla_attention(q, k, v, mixing, backend="torch", **kw), [q, k, v, mixing]),
        "mhla_triton": (lambda: mhla_attention(q, k, v, mixing, backend="triton", **kw), [q, k, v, mixing]),
    }
    if not causal:
        exact = dict(kw, exact_radius=0)
        variants["mhla_exact_torch"] = (lambda: mhla_attention(q, k, v, mixing, backend="torch", **exact),
                                        [q, k, v, mixing])
        variants["mhla_exact_triton"] = (lambda: mhla_attention(q, k, v, mixing, backend="triton", **exact),
                                         [q, k, v, mixing])
    if causal:
        try:
            from fla.ops.linear_attn import chunk_linear_attn

            variants["fla_chunk_linear_attn"] = (lambda: chunk_linear_attn(q, k, v)[0], [q, k, v])
            # without the normaliser, as MHLA's Triton path computes its own in the same passes
            variants["fla_unnormalized"] = (lambda: chunk_linear_attn(q, k, v, normalize=False)[0], [q, k, v])
        except ImportError:
            pass
    row = dict(family=family, N=n, grid="x".join(map(str, grid)), M=mixing.shape[-1], H=heads, D=dim)
    for name, (fn, inputs) in variants.items():
        for timing in timings:
            suffix = "" if timing == "eager" else f"_{timing}"
            with torch.no_grad():
                row[f"{name}_fwd{suffix}"] = _time(fn, timing)
            row[f"{name}_fwdbwd{suffix}"] = _time(_fwd_bwd(fn, inputs), timing)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="wan,dit,sana,causal")
    ap.add_argument("--dtype", default="bf16", choices=DTYPES)
    ap.add_argument("--timing", default="eager,graph", help="eager, graph or both (comma-separated)")
    ap.add_argument("--out", default="docs/bench/attention_op")
    args = ap.parse_args()
    timings = [t for t in args.timing.split(",") if t]
    if not timings or set(timings) - {"eager", "graph"}:
        ap.error("--timing takes eager, graph or eager,graph")
    rows = []
    for family in args.shapes.split(","):
        heads, dim, sizes = SHAPES[family]
        for grid, blocks in sizes:
            rows.append(bench_row(family, heads, dim, grid, blocks, parse_dtype(args.dtype), timings))
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[-1]).index(k) if k in rows[-1] else 99)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"\n{date.today()} {torch.cuda.get_device_name()} {args.dtype}, batch 1, ms (median)")
    timed = [k for k in keys if k.endswith(("_fwd", "_fwdbwd", "_fwd_graph", "_fwdbwd_graph"))]
    print("| family | N | M | " + " | ".join(timed) + " |")
    for r in rows:
        cells = " | ".join(f"{r[k]:.3f}" if k in r else "-" for k in timed)
        print(f"| {r['family']} | {r['N']} | {r['M']} | {cells} |")
    _plot(rows, timed, args.out + ".png")


def _plot(rows, timed, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    families = sorted({r["family"] for r in rows})
    fig, axes = plt.subplots(1, len(families), figsize=(5 * len(families), 4), squeeze=False)
    for ax, fam in zip(axes[0], families):
        sub = [r for r in rows if r["family"] == fam]
        for key in timed:
            if all(key in r for r in sub):
                ax.plot([r["N"] for r in sub], [r[key] for r in sub], marker="o", label=key)
        ax.set(title=fam, xlabel="N", ylabel="ms", xscale="log", yscale="log")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
