"""Compile the MHLA kernels for an H100/H200 (sm_90) on any machine, GPU or not, and print what each
launch of the target shapes costs in resources: registers and stack per thread, shared memory, the
SASS instruction count (static: how much index arithmetic a tile costs), and how its global loads and
stores are issued (`ld.global.v4` = 16 bytes at a time, `ld.global.b16` = one
half-precision value, `cp.async` = pipelined copies into shared memory).

    python benchmarks/offline_compile.py [--shapes wan-31500,dit-16384]   (the shapes of kernel_breakdown.py)

Why: register pressure (programs per SM) and scalar loads are what most limit these kernels, and both
show here without a GPU. The launch arguments are the library's own
(`mhla_triton._static`), for bf16 inputs and the inference path; needs Triton's NVIDIA backend (it
ships with the `triton` wheel: ptxas, cuobjdump).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from kernel_breakdown import SHAPES  # (benchmarks/ is the script's directory, so on sys.path)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mhla_convert.kernels import mhla_triton as MT
from mhla_convert.ops.feature_maps import resolve_feature_map

H200_SMS = 132
# launch name -> pointer types of its tensors, in order (bf16 inputs; summaries as `_forward` writes them;
# the one-tile mixing kernel adds the summaries and gradient partials; dS as that kernel writes it). Where
# training keeps summaries and dS̃ as hi + lo halves (`_static`'s "hilo"), HILO_POINTERS replaces them
POINTERS = {
    "summaries": ("*bf16",) * 4,
    "summaries_hilo": ("*bf16",) * 4,
    "mix_half": ("*fp32", "*bf16", "*bf16"),
    "readout": ("*bf16", "*bf16", "*bf16", "*bf16", "*fp32", "*bf16"),
    "mix": ("*fp32", "*fp32", "*bf16"),
    "bwd_queries": ("*bf16",) * 6 + ("*fp32", "*bf16", "*fp32"),
    "bwd_summaries": ("*bf16", "*bf16", "*fp32", "*fp32"),
    "mix_t": ("*fp32", "*fp32", "*bf16"),
    "bwd_keys": ("*bf16",) * 4 + ("*fp32", "*bf16", "*fp32", "*bf16", "*bf16", "*fp32"),
    "sum_partials": ("*fp32", "*fp32"),
}
HILO_POINTERS = {"bwd_summaries": ("*bf16", "*bf16", "*bf16", "*fp32"), "mix_t": ("*fp32", "*bf16", "*bf16")}


def compile_sm90(fn, args: dict, options: dict):
    """triton.compile of `fn` with `args` by name: pointer type strings, ints (divisible by 16 →
    specialised as Triton does at run time) and the kernel's constexprs."""
    constexpr = {p.name for p in fn.params if p.is_constexpr}
    signature, constants, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = args.get(param.name, param.default)
        if param.name in constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, str):
            signature[param.name], attrs[(i,)] = value, [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def resources(kernel) -> dict:
    """Registers and stack per thread and the SASS instruction count (cuobjdump on the cubin), shared
    memory, and the PTX's memory ops."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage, sass = (subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
                       for flag in ("--dump-resource-usage", "-sass"))
    regs, stack = re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
    ops: dict[str, int] = {}
    memory_op = r"\b(ld\.global[\w.]*|st\.global[\w.]*|cp\.async\.c[ag]\.shared\.global)"
    for op in re.findall(memory_op, kernel.asm["ptx"]):
        ops[op] = ops.get(op, 0) + 1
    instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M))
    return dict(regs=int(regs), stack=int(stack), smem=kernel.metadata.shared, ops=ops, instructions=instructions)


def main():
    if "--shapes" in sys.argv:
        keep = sys.argv[sys.argv.index("--shapes") + 1].split(",")
        for name in [n for n in SHAPES if n not in keep]:
            del SHAPES[name]
    MT._programs_wanted = lambda device: MT.PROGRAMS_PER_SM * H200_SMS  # the H200's launch splits, on any machine
    kernels = dict(summaries=MT.K._summaries_kernel, summaries_hilo=MT.K._summaries_kernel,
                   readout=MT.K._readout_kernel, bwd_queries=MT.K._bwd_query_kernel,
                   bwd_summaries=MT.K._summaries_kernel, bwd_keys=MT.K._bwd_key_kernel,
                   sum_partials=MT.K._sum_partials_kernel)
    print("| shape | launch | kernel | grid | warps, stages | registers | stack | shared memory | SASS instructions | "
          "global memory ops (per thread, in the PTX) |")
    for shape, (heads, dim, layout, causal) in SHAPES.items():
        q = torch.empty(1, layout.num_tokens, heads, dim, dtype=torch.bfloat16, device="meta")
        mixing = torch.empty(layout.num_blocks, layout.num_blocks, device="meta")
        plan = MT._plan(q, q, q, mixing, layout, causal=causal, phi=resolve_feature_map("relu"), normalize=True,
                        scale=dim**-0.5, eps=1e-6)
        static = MT._static(plan, torch.device("meta"))
        for name, pointers in POINTERS.items():
            if static[name] is None:  # (no hi + lo summaries for this shape)
                continue
            fn, launch = (kernels[name], static[name]) if name in kernels else static[name]
            grid, ints, kw, _ = launch
            pointers = HILO_POINTERS.get(name, pointers) if static["hilo"] else pointers
            if fn is MT.K._mix_sweep_kernel:
                pointers += ("*bf16" if name == "mix_t" and static["hilo"] else "*fp32", "*fp32")
            kw = dict(kw)
            options = dict(num_warps=kw.pop("num_warps"), num_stages=kw.pop("num_stages", 3),
                           maxnreg=kw.pop("maxnreg", None))
            r = resources(compile_sm90(fn, {**dict(zip(fn.arg_names, (*pointers, *ints))), **kw}, options))
            ops = ", ".join(f"{k} {v}" for k, v in sorted(r["ops"].items()))
            print(f"| {shape} | {name} | {fn.__name__} | {grid} | {options['num_warps']}, {options['num_stages']} | "
                  f"{r['regs']} | {r['stack']} | {r['smem']} | {r['instructions']} | {ops} |", flush=True)


if __name__ == "__main__":
    main()
