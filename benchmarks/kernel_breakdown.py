"""Where the Triton path's time goes: the GPU time of each kernel of the MHLA operator's inference forward,
training forward and backward, for the target shapes, from torch.profiler traces of public `mhla_attention`
calls, beside each whole step's do_bench time. The joint shapes (FLUX.1 at 1024² and 2048², Qwen-Image at 1328²:
`joint_attention` over 512 text tokens and the image, the families' blocks and exact region) time the inference
forward beside SDPA over the same tokens.

    python benchmarks/kernel_breakdown.py [--shapes a,b] [--once SHAPE]

Kernel times are means over the profiled calls (µs per call; a kernel launched twice per call, such as the
summaries kernel in the backward, is summed); a step's do_bench time is less than the sum of its kernels where
chained launches overlap at their edges. --once SHAPE runs three inference forwards of one shape and nothing
else (for `ncu` or `nsys`).
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from mhla_convert.ops import mhla_attention
from mhla_convert.ops.joint import joint_attention

SHAPES = {  # name -> (H, D, grid, blocks, causal chunk or None)
    "dit-1024": (16, 72, (32, 32), (4, 4), None),
    "sana-1024": (70, 32, (32, 32), (4, 4), None),
    "wan-31500": (12, 128, (21, 30, 50), (7, 3, 5), None),
    "dit-16384": (16, 72, (128, 128), (8, 8), None),
    "sana-16384": (70, 32, (128, 128), (8, 8), None),
    "causal-32768": (32, 64, (32768,), None, 64),
}
JOINT_SHAPES = {  # name -> (H, D, image grid, blocks, exact radius, text tokens)
    "flux-1024": (24, 128, (64, 64), (8, 8), 1, 512),
    "qwen-image-1328": (24, 128, (83, 83), (8, 8), 1, 512),
    "flux-2048": (24, 128, (128, 128), (8, 8), 1, 512),
}
CALLS = 10  # profiled calls per step


def _inputs(heads, dim, grid, blocks, chunk):
    n = torch.Size(grid).numel()
    q, k, v = (torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    m = n // chunk if chunk else torch.Size(blocks).numel()
    mixing = torch.rand(m, m, device="cuda")
    mixing = mixing.tril() if chunk else mixing
    kw = dict(grid=grid, blocks=blocks, causal=True, chunk_size=chunk) if chunk else dict(grid=grid, blocks=blocks)
    return (q, k, v, mixing), kw


def kernel_times(step, calls=CALLS) -> dict[str, float]:
    """µs of GPU time per call of `step` (a list of `calls` thunks, or one to call `calls` times), per kernel."""
    steps = step if isinstance(step, list) else [step] * calls
    steps[0]()  # (warm-up: compiles)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for fn in steps[1:]:
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type == DeviceType.CUDA and event.self_device_time_total > 0:
            times[event.key] += event.self_device_time_total / (len(steps) - 1)
    return dict(times)


def breakdown(heads, dim, grid, blocks, chunk):
    """{step: (do_bench ms, {kernel: µs per call})} for the inference forward, the training forward and the
    backward."""
    tensors, kw = _inputs(heads, dim, grid, blocks, chunk)
    leaves = [t.detach().requires_grad_() for t in tensors]
    grad = torch.randn_like(tensors[0])

    def infer():
        with torch.no_grad():
            return mhla_attention(*tensors, **kw, backend="triton")

    def forward():
        return mhla_attention(*leaves, **kw, backend="triton")

    def backward_of(out):
        return lambda: torch.autograd.grad(out, leaves, grad)

    out = forward()
    bwd_ms = do_bench(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True), return_mode="median")
    bwd = kernel_times([backward_of(forward()) for _ in range(CALLS + 1)])
    return {
        "inference forward": (do_bench(infer, return_mode="median"), kernel_times(infer)),
        "training forward": (do_bench(forward, return_mode="median"), kernel_times(forward)),
        "backward": (bwd_ms, bwd),
    }


def joint_breakdown(heads, dim, grid, blocks, radius, text):
    """{step: (do_bench ms, {kernel: µs per call})} for the joint inference forward and SDPA over the same tokens."""
    n = text + torch.Size(grid).numel()
    q, k, v = (torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    m = torch.Size(blocks).numel() + 1
    mixing = torch.rand(m, m, device="cuda")

    def joint():
        with torch.no_grad():
            return joint_attention(q, k, v, mixing, text=text, grid=grid, blocks=blocks, exact_radius=radius,
                                   backend="triton")

    qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))

    def sdpa():
        return F.scaled_dot_product_attention(qs, ks, vs)

    return {step: (do_bench(fn, return_mode="median"), kernel_times(fn))
            for step, fn in (("joint inference forward", joint), ("SDPA", sdpa))}


def main():
    if "--shapes" in sys.argv:  # a subset of SHAPES and JOINT_SHAPES, comma-separated names
        keep = sys.argv[sys.argv.index("--shapes") + 1].split(",")
        for shapes in (SHAPES, JOINT_SHAPES):
            for name in [n for n in shapes if n not in keep]:
                del shapes[name]
    if "--once" in sys.argv:
        tensors, kw = _inputs(*SHAPES[sys.argv[sys.argv.index("--once") + 1]])
        with torch.no_grad():
            for _ in range(3):
                mhla_attention(*tensors, **kw, backend="triton")
        return torch.cuda.synchronize()

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, batch 1")
    print("| shape | step | do_bench ms | Σ kernels ms | kernel | µs per call |")
    print("|---|---|---|---|---|---|")
    runs = [(shape, breakdown, args) for shape, args in SHAPES.items()]
    for shape, run, args in runs + [(shape, joint_breakdown, args) for shape, args in JOINT_SHAPES.items()]:
        for step, (ms, kernels) in run(*args).items():
            total = sum(kernels.values()) / 1e3
            for i, (name, us) in enumerate(sorted(kernels.items(), key=lambda item: -item[1])):
                lead = f"| {shape} | {step} | {ms:.3f} | {total:.3f} |" if i == 0 else "| | | | |"
                print(f"{lead} {name} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
