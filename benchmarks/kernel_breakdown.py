"""Where the Triton path's time goes, and how the launch shapes move it: times each launch of the forward
(training and inference) and of the backward, and the whole forward and backward, for the target shapes,
with the default settings and then with one switch of `mhla_convert.kernels.mhla_triton` changed at a time.
It drives the backend's internal launch functions directly (there is no public API for single launches).

    python benchmarks/kernel_breakdown.py [--shapes a,b]
        [--sweep fwd,summaries,... | --mix-sweep | --regs | --once SHAPE]

--sweep fwd times the forward per (warps, stages, token tile) setting of the summaries and readout
launches instead (what `mhla_triton.FWD_CONFIGS` holds per head dim); --sweep LAUNCH (summaries, readout,
bwd_queries, bwd_summaries, bwd_keys) one launch per (warps, stages, register cap[, token tile]) of its
`LAUNCH_CONFIGS` entry; --mix-sweep each mixing launch per one-tile
launch shape (`MIX_SWEEP`) and through the row-tiled `MIX_TILES` kernel;
--regs the registers, spills and shared memory of every kernel compiled by a forward and backward per shape.
"""

from __future__ import annotations

import torch
import triton
from triton.testing import do_bench

from mhla_convert.kernels import mhla_triton as MT
from mhla_convert.ops import BlockLayout, mhla_attention_torch, resolve_feature_map

SHAPES = {  # name -> (H, D, layout, causal)
    "dit-1024": (16, 72, BlockLayout.create((32, 32), (4, 4)), False),
    "sana-1024": (70, 32, BlockLayout.create((32, 32), (4, 4)), False),
    "wan-31500": (12, 128, BlockLayout.create((21, 30, 50), (7, 3, 5)), False),
    "dit-16384": (16, 72, BlockLayout.create((128, 128), (8, 8)), False),
    "sana-16384": (70, 32, BlockLayout.create((128, 128), (8, 8)), False),
    "causal-32768": (32, 64, BlockLayout.chunked(32768, 64), True),
}
KNOBS = [("default", {}), ("PDL", {"PDL": False}), ("MATMUL_MIX_MIN_BLOCKS", {"MATMUL_MIX_MIN_BLOCKS": 0}),
         ("SPLIT_HEAD_DIMS", {"SPLIT_HEAD_DIMS": False}), ("HILO_SUMMARIES", {"HILO_SUMMARIES": False})]


def breakdown(heads, dim, layout, causal, backward=True):
    n = layout.num_tokens
    q, k, v = (torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    m = layout.num_blocks
    mixing = torch.rand(m, m, device="cuda")
    phi = resolve_feature_map("relu")
    plan = MT._plan(q, k, v, mixing, layout, causal=causal, phi=phi, normalize=True, scale=dim**-0.5, eps=1e-6)
    s, st, o = MT._forward(plan, q, k, v, mixing)
    do = torch.randn_like(o)
    t = lambda fn: do_bench(fn, warmup=10, rep=60, return_mode="median")  # noqa: E731
    want = mhla_attention_torch(q.float(), k.float(), v.float(), mixing, layout, causal=causal, phi=phi,
                                normalize=True, scale=dim**-0.5, eps=1e-6)
    err = ((MT._inference(plan, q, k, v, mixing).float() - want).norm() / want.norm()).item()
    s_half = MT._summaries(plan, k, v, half=True)
    readout = MT._static(plan, q.device)["readout"]
    return dict(
        err_x1e3=err * 1e3,
        summaries=t(lambda: MT._summaries(plan, k, v)),
        mix=t(lambda: MT._mix_summaries(plan, mixing, s, q.dtype)),
        fwd=t(lambda: MT._forward(plan, q, k, v, mixing)),
        infer=t(lambda: MT._inference(plan, q, k, v, mixing)),
        infer_summaries=t(lambda: MT._summaries(plan, k, v, half=True)),
        infer_mix=t(lambda: MT._mix_summaries(plan, mixing, s_half, q.dtype)),
        readout=t(lambda: MT._run(MT.K._readout_kernel, readout, (q, k, v, st, mixing, o))),
        **(_bwd_times(t, plan, q, k, v, mixing, s, st, o, do) if backward else {}),
    )


def _bwd_times(t, plan, q, k, v, mixing, s, st, o, do):
    f = MT._static(plan, q.device)
    dq, w = MT._bwd_queries(plan, q, k, v, o, do, st, mixing, f)
    dst = MT._bwd_summaries(plan, q, do, w, f)
    ds, part = MT._mix_t(plan, mixing, dst, s, st.dtype, f)
    _, _, dmii = MT._bwd_keys(plan, q, k, v, do, mixing, ds, w, f)
    return dict(
        bwd=t(lambda: MT._backward(plan, q, k, v, mixing, s, st, o, do, True)),
        bwd_q=t(lambda: MT._bwd_queries(plan, q, k, v, o, do, st, mixing, f)),
        bwd_dst=t(lambda: MT._bwd_summaries(plan, q, do, w, f)),
        bwd_mixT=t(lambda: MT._mix_t(plan, mixing, dst, s, st.dtype, f)),
        bwd_k=t(lambda: MT._bwd_keys(plan, q, k, v, do, mixing, ds, w, f)),
        bwd_dmix=t(lambda: MT._mixing_grad(plan, dst, s, part, dmii, f)),
    )


# candidate launch settings per shape, against an empty entry (the plan's warps, Triton's default stages, its
# token tile):
# --sweep fwd sets FWD_CONFIGS (warps, stages, token tile) of the summaries and readout; --sweep LAUNCH one
# launch's LAUNCH_CONFIGS entry (warps, stages, register cap[, token tile]). name -> (timed key, settings)
SWEEPS = {
    "fwd": ("fwd", [(4, 2), (4, 3), (8, 2), (8, 3), (4, 2, 128), (4, 2, 32)]),
    "summaries": ("infer_summaries", [(8, 3, 128), (8, 2, 128), (8, 3, 128, 32), (8, 4, 128, 32), (4, 3, 168, 32),
                                      (8, 3, None, 32)]),
    "readout": ("readout", [(4, 1, 128), (4, 2, 128, 32), (4, 2, 96, 32), (4, 3, 128, 32), (4, 1, 128, 32), (8, 2, 128),
                            (4, 2, None, 32), (8, 3, 128, 32)]),
    "bwd_queries": ("bwd_q", [(4, 2, 168, 32), (4, 1, 168, 32), (4, 2, 128, 32), (8, 2, 128, 32), (8, 1, 128, 32),
                              (8, 1, None, 32), (8, 1, 128, 64), (4, 1, 128, 32), (4, 1, None, 32), (4, 1, 168, 16)]),
    "bwd_summaries": ("bwd_dst", [(8, 3, 128), (8, 2, 128), (8, 4, 128), (8, 3, None), (4, 3, None), (4, 3, 168),
                                  (8, 3, 128, 32)]),
    "bwd_keys": ("bwd_k", [(8, 3, None, 64), (8, 2, 128, 64), (8, 3, 128, 64), (4, 2, 168, 32), (8, 1, 128, 64),
                           (8, 2, 128, 32), (4, 2, 128, 64), (8, 1, None, 64), (4, 1, 168, 64), (4, 1, 168, 32)]),
}


def _set_configs(kind, value):
    if kind == "fwd":
        MT.FWD_CONFIGS = value
    else:
        MT.LAUNCH_CONFIGS[kind] = value


def config_sweep(kind):
    """One launch (or the forward) per launch setting, one shape at a time, and per head dim the setting
    of least summed time over its shapes (each shape relative to the default)."""
    timed, settings = SWEEPS[kind]
    saved = MT.FWD_CONFIGS if kind == "fwd" else MT.LAUNCH_CONFIGS[kind]
    backward = timed.startswith("bwd")
    print(f"| shape | {kind} setting | " + " | ".join(breakdown_keys(backward)) + " | (ms) |")
    totals = {}
    for shape, (heads, dim, layout, causal) in SHAPES.items():
        for cfg in [None, *settings]:
            _set_configs(kind, {} if cfg is None else {(dim, dim): cfg})
            try:
                r = breakdown(heads, dim, layout, causal, backward=backward)
            except triton.runtime.errors.OutOfResources as err:
                print(f"| {shape} | {cfg} | {err} |", flush=True)
                continue
            if cfg is None:
                ref = r[timed]
            totals.setdefault(dim, {}).setdefault(cfg, 0.0)
            totals[dim][cfg] += r[timed] / ref
            print(f"| {shape} | {cfg or 'default'} | " + " | ".join(f"{r[key]:.3f}" for key in r) + " |", flush=True)
    _set_configs(kind, saved)
    print("best per head dim:", {dim: min(t, key=t.get) for dim, t in totals.items()})


def breakdown_keys(backward=True):
    fwd = ["rel. err x1e3", "summaries", "mix", "fwd", "infer", "infer: summaries", "infer: mix", "readout"]
    return fwd + (["bwd", "bwd: dq", "bwd: dS̃ (summaries)", "mixT (+ dmix partials: one-tile)", "keys", "dmix"]
                  if backward else [])


# (BN, warps, stages, programs per SM) of the one-tile mixing kernel, per operand kind (`MT.MIX_SWEEP`)
MIX_SWEEP = {
    "half": [(128, 8, 2, 1), (128, 8, 3, 1), (64, 4, 3, 2), (64, 8, 3, 2), (32, 4, 4, 2)],
    "float": [(64, 8, 2, 1), (64, 8, 3, 1), (64, 4, 2, 2), (32, 4, 3, 2), (32, 8, 3, 1), (128, 8, 2, 1)],
    "grad": [(64, 8, 2, 1), (32, 8, 3, 1), (32, 8, 4, 1), (64, 8, 3, 1), (32, 4, 3, 2), (32, 4, 2, 4)],
    "grad_float": [(32, 8, 3, 1), (32, 8, 2, 1), (64, 8, 2, 1), (32, 4, 3, 2)],
}


def _inputs(heads, dim, layout, causal):
    q, k, v = (torch.randn(1, layout.num_tokens, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mixing = torch.rand(layout.num_blocks, layout.num_blocks, device="cuda")
    plan = MT._plan(q, k, v, mixing, layout, causal=causal, phi=resolve_feature_map("relu"), normalize=True,
                    scale=dim**-0.5, eps=1e-6)
    return plan, q, k, v, mixing


def mix_sweep():
    """Each mixing launch per one-tile launch shape (`MIX_SWEEP`) against the row-tiled kernel: inference's
    half summaries ("half"), training's float32 ones ("float"), and the backward's transposed mixing with
    the mixing gradient over hi + lo halves ("grad") or float32 dS̃ and summaries ("grad_float", where
    `_static` finds no one-tile "grad" setting: its summaries are then float32); row-tiled: the transposed
    GEMM plus `_dmix_kernel`."""
    saved = MT.MIX_SWEEP
    print("| shape | operand | (BN, warps, stages, programs per SM) | ms |")
    for shape, args in SHAPES.items():
        plan, q, k, v, mixing = _inputs(*args)
        _, st, o = MT._forward(plan, q, k, v, mixing)
        s_half = MT._forward(plan, q, k, v, mixing, half_summaries=True)[0]  # what inference mixes
        s_float = torch.randn(plan.batch, plan.kv_heads, plan.m, plan.cols, device="cuda")
        do = torch.randn_like(o)
        dmii = torch.zeros(plan.batch, plan.heads, plan.m, device="cuda")
        t = lambda fn: do_bench(fn, warmup=10, rep=60, return_mode="median")  # noqa: E731

        def grad():
            _, part = MT._mix_t(plan, mixing, dst, s, st.dtype, f)
            MT._mixing_grad(plan, dst, s, part, dmii, f)

        launches = {"half": lambda: MT._mix(plan, mixing, s_half, st, kind="mix_half"),
                    "float": lambda: MT._mix(plan, mixing, s_float, st, kind="mix"), "grad": grad, "grad_float": grad}
        for kind, fn in launches.items():
            for tiles in [*MIX_SWEEP[kind], "row-tiled"]:
                MT.MIX_SWEEP = {} if tiles == "row-tiled" else {(MT._p2(plan.m), kind): tiles}
                # summaries and dS̃ as this setting's backward has them (float32, or hi + lo halves)
                f = MT._static(plan, q.device)
                s = MT._summaries(plan, k, v, f=f)
                dst = MT._bwd_summaries(plan, q, do, MT._bwd_queries(plan, q, k, v, o, do, st, mixing, f)[1], f)
                try:
                    print(f"| {shape} | {kind} | {tiles} | {t(fn):.4f} |", flush=True)
                except triton.runtime.errors.OutOfResources as err:
                    print(f"| {shape} | {kind} | {tiles} | {err} |", flush=True)
    MT.MIX_SWEEP = saved


def _compiled():
    out = {}
    for fn in (MT.K._summaries_kernel, MT.K._mix_kernel, MT.K._mix_sweep_kernel, MT.K._readout_kernel,
               MT.K._bwd_query_kernel, MT.K._bwd_key_kernel, MT.K._dmix_kernel):
        for cache in fn.device_caches.values():
            for key, kernel in cache[0].items():
                out[(fn.__name__, key)] = kernel.result() if hasattr(kernel, "result") else kernel
    return out


def regs():
    """Registers / spills / shared memory of each kernel compiled for a forward and backward per shape."""
    for shape, args in SHAPES.items():
        before = set(_compiled())
        plan, q, k, v, mixing = _inputs(*args)
        s, st, o = MT._forward(plan, q, k, v, mixing)
        MT._backward(plan, q, k, v, mixing, s, st, o, torch.randn_like(o), True)
        torch.cuda.synchronize()
        for (name, _), kernel in _compiled().items():
            if (name, _) not in before:
                md = kernel.metadata
                print(f"{shape} {name}: regs {kernel.n_regs} spills {kernel.n_spills} smem {md.shared} "
                      f"warps {md.num_warps} stages {md.num_stages}", flush=True)


def main():
    import sys

    if "--shapes" in sys.argv:  # a subset of SHAPES, comma-separated names
        keep = sys.argv[sys.argv.index("--shapes") + 1].split(",")
        for name in list(SHAPES):
            if name not in keep:
                del SHAPES[name]

    if "--once" in sys.argv:  # three inference forwards of one shape, nothing else (for `ncu`)
        plan, q, k, v, mixing = _inputs(*SHAPES[sys.argv[sys.argv.index("--once") + 1]])
        for _ in range(3):
            MT._inference(plan, q, k, v, mixing)
        return torch.cuda.synchronize()
    for flag, fn in (("--mix-sweep", mix_sweep), ("--regs", regs)):
        if flag in sys.argv:
            return fn()

    if "--sweep" in sys.argv:
        for kind in sys.argv[sys.argv.index("--sweep") + 1].split(","):
            config_sweep(kind)
        return
    defaults = {name: getattr(MT, name) for name in ("TILE_TOKENS", "WIDE_WARPS", "PROGRAMS_PER_SM", "MIX_TILES",
                                                     "SPLIT_HEAD_DIMS", "MATMUL_MIX_MIN_BLOCKS", "PDL",
                                                     "HILO_SUMMARIES")}
    print("| shape | setting | " + " | ".join(breakdown_keys()) + " | (ms) |")
    for shape, args in SHAPES.items():
        for label, change in KNOBS:
            for name, value in {**defaults, **change}.items():
                setattr(MT, name, value)
            r = breakdown(*args)
            setting = "default" if not change else f"{label}={list(change.values())[0]}"
            print(f"| {shape} | {setting} | " + " | ".join(f"{r[key]:.3f}" for key in r) + " |", flush=True)
    for name, value in defaults.items():
        setattr(MT, name, value)


if __name__ == "__main__":
    main()
