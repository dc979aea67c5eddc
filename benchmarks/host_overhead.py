"""Host time against GPU time of one MHLA forward at the small shapes (is the forward launch-bound?), eager and
captured in a CUDA graph by torch.compile(mode="reduce-overhead"), and of one forward + backward step at the
small shapes and Wan's.

    python benchmarks/host_overhead.py [--parts] [--profile]

Forward: wall time per call of 500 forwards enqueued without synchronising; GPU: do_bench median (CUDA
events). Equal numbers mean the GPU waits on Python; a CUDA graph replays all the forward's launches at the
cost of one. Forward + backward: host time per step of 60 steps
enqueued while a GPU sleep holds the device (so no launch waits on the GPU), against the do_bench median of
the step. A step whose host time nears its GPU time is paced by the host whenever the host slows down.
--parts adds the host time of the DiT 1,024 forward through each public layer: `mhla_attention`, the Triton
backend called directly (`kernels.mhla_attention_triton`: no argument checks or backend choice) and the custom op
that torch.compile calls (`torch.ops.mhla_convert.attention`). --profile adds a cProfile of the DiT 1,024 forward
and forward + backward: where the host time goes.
"""

import sys
import time

import torch
from triton.testing import do_bench

from mhla_convert.mixing import locality_mixing
from mhla_convert.ops import mhla_attention

SMALL = (("dit-1024", 16, 72, (32, 32), (4, 4)), ("sana-1024", 70, 32, (32, 32), (4, 4)))
WAN = ("wan-31500", 12, 128, (21, 30, 50), (7, 3, 5))


def host_ms(fn, calls=500, hold=False) -> float:
    """Wall time per call of `calls` calls enqueued without synchronising (after 20 warm-up calls). `hold`: the
    calls are enqueued behind a GPU sleep, so none waits on the GPU (for calls with long GPU time)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    if hold:
        torch.cuda._sleep(400_000_000)  # (longer than the host takes to enqueue the calls)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return ms


def median_ms(fn) -> float:
    return do_bench(fn, return_mode="median")


def forward_rows():
    for name, heads, dim, grid, blocks in SMALL:
        q, k, v = (torch.randn(1, 1024, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        mixing = locality_mixing(blocks).cuda()
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        attend = lambda *t: mhla_attention(*t, grid=grid, blocks=blocks, backend="triton")  # noqa: E731
        graphed = torch.compile(attend, mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():
            run = lambda: attend(q, k, v, mixing)  # noqa: E731
            replay = lambda: graphed(q, k, v, mixing)  # noqa: E731
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)  # noqa: E731
            host, graph_host, sdpa_host = host_ms(run), host_ms(replay), host_ms(sdpa)
            print(f"{name}: MHLA host {host:.4f} ms/call, do_bench {median_ms(run):.4f} ms; "
                  f"MHLA in a CUDA graph host {graph_host:.4f}, do_bench {median_ms(replay):.4f}; "
                  f"SDPA host {sdpa_host:.4f}, do_bench {median_ms(sdpa):.4f}", flush=True)


def fwd_bwd(fn, inputs, grad):
    def step():
        fn().backward(grad)
        for t in inputs:
            t.grad = None
    return step


def step_rows():
    for name, heads, dim, grid, blocks in (*SMALL, WAN):
        n = torch.Size(grid).numel()
        q, k, v = (torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        mixing = locality_mixing(blocks).cuda().requires_grad_()
        grad = torch.randn_like(q)
        step = fwd_bwd(lambda: mhla_attention(q, k, v, mixing, grid=grid, blocks=blocks, backend="triton"),
                       [q, k, v, mixing], grad)
        line = (f"{name} forward + backward: MHLA host {host_ms(step, 60, hold=True):.4f} ms/step, "
                f"do_bench {median_ms(step):.4f} ms")
        if n <= 4096:
            t = lambda x: x.transpose(1, 2)  # noqa: E731
            sdpa = fwd_bwd(lambda: t(torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v))),
                           [q, k, v], grad)
            line += f"; SDPA host {host_ms(sdpa, 60, hold=True):.4f}, do_bench {median_ms(sdpa):.4f}"
        print(line, flush=True)


def parts():
    """Host µs per DiT 1,024 forward (no grad) through each public layer of the operator."""
    from mhla_convert.kernels import mhla_attention_triton
    from mhla_convert.ops import BlockLayout
    from mhla_convert.ops.feature_maps import resolve_feature_map

    q, k, v = (torch.randn(1, 1024, 16, 72, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mixing = locality_mixing((4, 4)).cuda()
    layout, scale = BlockLayout.create((32, 32), (4, 4)), 72 ** -0.5
    calls = {
        "mhla_attention": lambda: mhla_attention(q, k, v, mixing, grid=(32, 32), blocks=(4, 4), backend="triton"),
        "mhla_attention_triton": lambda: mhla_attention_triton(
            q, k, v, mixing, layout, causal=False, phi=resolve_feature_map("relu"), normalize=True, scale=scale,
            eps=1e-6),
        "torch.ops.mhla_convert.attention": lambda: torch.ops.mhla_convert.attention(
            q, k, v, mixing, layout.grid, layout.blocks, layout.block_size, False, "relu", True, scale, 1e-6, "triton"),
    }
    with torch.no_grad():
        print("dit-1024 forward, host µs per call: " + ", ".join(
            f"{name} {host_ms(fn, 1000) * 1e3:.1f}" for name, fn in calls.items()), flush=True)


def profile():
    """cProfile of the DiT 1,024 forward (no grad) and forward + backward: the host's costliest calls."""
    import cProfile
    import pstats

    q, k, v = (torch.randn(1, 1024, 16, 72, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    mixing = locality_mixing((4, 4)).cuda().requires_grad_()
    fwd = lambda: mhla_attention(q, k, v, mixing, grid=(32, 32), blocks=(4, 4), backend="triton")  # noqa: E731
    for label, fn, calls in (("forward, no grad", lambda: torch.no_grad()(fwd)(), 2000),
                             ("forward + backward", lambda: fwd().sum().backward(), 500)):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- {label}: {calls} calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def main():
    forward_rows()
    step_rows()
    if "--parts" in sys.argv:
        parts()
    if "--profile" in sys.argv:
        profile()


if __name__ == "__main__":
    main()
