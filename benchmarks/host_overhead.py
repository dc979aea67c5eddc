"""Host time vs device time of one MHLA forward at the small shapes (is the forward launch-bound?).

    python benchmarks/host_overhead.py

Host: wall time per call of 500 forwards enqueued without synchronising. Device: do_bench median
(CUDA events). Equal numbers mean the GPU waits on Python.
"""

import sys
import time

import torch
from triton.testing import do_bench

from mhla_convert.mixing import locality_mixing
from mhla_convert.ops import mhla_attention

def host_ms(fn, calls=500) -> float:
    """Wall time per call of `calls` calls enqueued without synchronising (after 20 warm-up calls)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return ms


for name, heads, dim, grid, blocks in (("dit-1024", 16, 72, (32, 32), (4, 4)), ("sana-1024", 70, 32, (32, 32), (4, 4))):
    q, k, v = (torch.randn(1, 1024, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mixing = locality_mixing(blocks).cuda()
    with torch.no_grad():
        run = lambda: mhla_attention(q, k, v, mixing, grid=grid, blocks=blocks, backend="triton")  # noqa: E731
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)  # noqa: E731
        host, sdpa_host = host_ms(run), host_ms(sdpa)
        print(f"{name}: MHLA host {host:.4f} ms/call, do_bench {do_bench(run, return_mode='median'):.4f} ms; "
              f"SDPA host {sdpa_host:.4f}, do_bench {do_bench(sdpa, return_mode='median'):.4f}", flush=True)

if "--profile" in sys.argv:  # where the host time of dit-1024 goes
    import cProfile
    import pstats

    q, k, v = (torch.randn(1, 1024, 16, 72, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
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
