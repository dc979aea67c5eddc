"""The Triton backend of `mhla_attention`: launches the kernels of `mhla_kernels` and wraps them
in an autograd Function whose backward also yields the gradient of the (learnable) mixing.

Forward: summaries (1 launch) → mixing GEMM (1) → readout (1). Backward: query side (dq, and per
token 1/(den + eps) and −do·o) → dS̃ and dz̃ by the summaries kernel over φ(q) and do, weighted by those →
mixingᵀ GEMM (dS) → key side (dk, dv) → ⟨dS̃, S⟩ partials for dmixing; for half inputs and M ≤ 128
one launch of the one-tile kernel (`_mix_sweep_kernel`) makes dS and those partials in one pass over
dS̃, and the partials are summed by one more launch (for large problems on a second stream, beside the key
side: `SIDE_SUM_MIN_ELEMENTS`). dq and dS̃ are separate launches because a dS̃ accumulator beside dq's
would hold the kernel at one program per SM. On Hopper the launches are chained by programmatic dependent
launch (`PDL`).
The summaries at float32 precision and the mixed ones (in the input dtype for half inputs: they are a
matmul operand, as in fla) are kept from forward to backward: (B·H·M·D·Dv) floats each, far below the
activations for M ≪ N. Training keeps that precision for the mixing gradient (with half summaries the
rounding does not average out of it over few blocks): float32, or, where the one-tile kernel makes
the gradient, hi + lo half parts of which the forward's mixing reads only hi (`_summaries`). Inference
(no autograd) keeps nothing, writes the summaries in the input's half precision and mixes them in one
tile of all M blocks (M ≤ 128) or, for many blocks, with torch.matmul.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import operator
import os
from dataclasses import dataclass

import torch
import triton

from ..ops.blocks import BlockLayout
from ..ops.feature_maps import FEATURE_MAPS
from . import mhla_kernels as K

_PHI_IDS = {id(FEATURE_MAPS["relu"]): 0, id(FEATURE_MAPS["elu"]): 1}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128  # one (D, Dv) summary tile lives in registers
MAX_CHUNK = 128  # a causal chunk is one tile
# launch shapes (module attributes so benchmarks/kernel_breakdown.py can sweep them)
TILE_TOKENS = 64  # token tile of the non-causal kernels
WIDE_WARPS = 8  # warps per program when a head dim is ≥ 128 (else 4)
MIX_TILES = (32, 128, 32, 4)  # BM, BN, BK, warps of the row-tiled mixing GEMM (`kernel_breakdown.py`)
# the mixing GEMMs of half-precision inputs when all M blocks fit one tile of BM = p2(M) rows and each output
# head reads one input head (`_mix_sweep_kernel`): (BM, operand) -> (BN, warps, stages, programs per SM), chosen
# with `kernel_breakdown.py --mix-sweep`. Holding the whole mixing once per program means no summary column is
# read twice, which more than halves Wan's mixing (M = 105) against the row-tiled kernel. Operand "half":
# inference's half summaries; "float": training's float32 summaries; "grad": the backward's dS̃ with the mixing
# gradient in the same pass, over hi + lo halves (64-column tiles in 2 stages: only 2 stages fit beside the
# mixing weights' hi + lo halves in shared memory); "grad_float": the same over float32 dS̃ and summaries (where
# those are not halves: blocks split over programs, or HILO_SUMMARIES off), whose tiles take twice the room (a
# 64-column tile does not fit in shared memory there). Other BM (at M = 16 the row-tiled kernel is as fast),
# float32 inputs and grouped heads take `_mix_kernel` with MIX_TILES (and `_dmix_kernel`)
MIX_SWEEP: dict = {(128, "half"): (128, 8, 3, 1), (64, "half"): (64, 4, 3, 2), (128, "float"): (64, 8, 3, 1),
                   (128, "grad"): (64, 8, 2, 1), (64, "grad"): (32, 4, 3, 2),
                   (128, "grad_float"): (32, 8, 3, 1), (64, "grad_float"): (32, 4, 3, 2)}
MATMUL_MIX_MIN_BLOCKS = 256  # inference with M at least this mixes through torch.matmul: a large M x M mixing
# is a real GEMM, where torch.matmul beats both mixing kernels (causal 32k, M = 512); at M <= 128 it gains nothing
SPLIT_HEAD_DIMS = True  # non-causal forward tiles cover a head dim like 72 in two parts (`head_dim_parts`)
PROGRAMS_PER_SM = 4  # split a block's tiles over programs below this many programs per SM
# forward launch shapes per head dims (D, Dv): (warps, stages[, token tile]) of the summaries and readout
# launches; absent = (the plan's warps, Triton's default, TILE_TOKENS). Chosen with `kernel_breakdown.py --sweep
# fwd` on an H200: 4 warps and 2 stages suit D = 128, 72 (as 64 + 16) and 64; D = 32 is best at the default.
FWD_CONFIGS: dict = {(128, 128): (4, 2), (72, 72): (4, 2), (64, 64): (4, 2)}  # keyed on (D, Dv)
# each non-causal launch's own (warps, stages, register cap[, token tile]) per head dims, over the defaults
# above, chosen with `kernel_breakdown.py --sweep LAUNCH` on an H200. The kernels are latency-bound, so what
# counts is programs per SM: a register cap lets one more program share the SM (Wan's summaries: 2 programs of
# 8 warps; dq at 128 registers: 4 programs, a few bytes spilled), and the readout's 1 stage leaves shared memory
# for 4 programs instead of 3. "bwd_summaries" is dS̃ (the summaries kernel, weighted; dz̃ its tile product with
# W[1]). DiT's summaries keep the defaults: 32-token tiles help at 16k tokens but split the 1,024-token
# problem over programs, which costs more there.
LAUNCH_CONFIGS: dict = {
    "summaries": {(128, 128): (8, 3, 128)},
    "readout": {(128, 128): (4, 1, 128)},
    "bwd_queries": {(128, 128): (4, 1, 128, 32), (72, 72): (4, 1, 168, 32)},
    "bwd_summaries": {(128, 128): (8, 3, 128, 32), (72, 72): (4, 3, None)},
    "bwd_keys": {(128, 128): (8, 2, 128, 64), (72, 72): (8, 2, 128, 64)},
}


HILO_SUMMARIES = True  # training's summaries as hi + lo halves where the one-tile kernel makes the mixing gradient
# (`_summaries`; dS̃ too): the forward's mixing reads only the hi halves (half the bytes of float32, and the
# faster half-precision operand), and the gradient's three half products of the parts keep float32 precision
SUM_TILES = (64, 32, 4)  # rows, columns, warps of the mixing gradient's partials sum (`_sum_partials_kernel`)
PDL = True  # chain each operator's launches by programmatic dependent launch (Hopper and later; `_chained`)
# the mixing gradient's partials are summed on a second stream beside the key side from this many elements of q,
# k, v and o on (B·N·(H + H_kv)·(D + Dv); Wan, DiT and SANA at 16k tokens and more), where the sum's launch is
# hidden behind the key side. Below it the two stream waits' host time would go on host-bound shapes.
SIDE_SUM_MIN_ELEMENTS = 1 << 25

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # (Triton reads it once too, at import)


def interpreting() -> bool:
    return _INTERPRET


def qkv_reason(q, k, v, phi) -> str | None:
    """The feature-map and dtype clauses of the attention and the decoding-step kernels."""
    if id(phi) not in _PHI_IDS:
        return "a callable feature map (kernels know 'relu' and 'elu')"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (kernels take one of fp16, bf16, fp32 for q, k and v)"
    return None


def device_reason(x) -> str | None:
    """The device clause of every Triton entry point: CUDA, or the CPU under the interpreter."""
    if not (x.is_cuda or (x.device.type == "cpu" and interpreting())):
        return f"device {x.device} (CUDA, or the CPU under TRITON_INTERPRET=1)"
    return None


def head_dims_reason(q, v) -> str | None:
    """The head-dim clause of the attention and the decoding-step kernels."""
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dims {q.shape[-1]}/{v.shape[-1]} > {MAX_HEAD_DIM}"
    return None


def unsupported_reason(q, k, v, mixing, layout: BlockLayout, *, causal: bool, phi) -> str | None:
    """Why these inputs need the torch path, or None when the kernels take them."""
    reason = qkv_reason(q, k, v, phi) or device_reason(q)
    if reason:
        return reason
    if not (q.device == k.device == v.device == mixing.device):  # (the launches pass bare addresses)
        return f"tensors on several devices (q {q.device}, k {k.device}, v {v.device}, mixing {mixing.device})"
    reason = head_dims_reason(q, v)
    if reason:
        return reason
    if causal and layout.tokens_per_block > MAX_CHUNK:
        return f"causal chunk of {layout.tokens_per_block} tokens > {MAX_CHUNK}"
    return None


def supports(q, k, v, mixing, layout, *, causal, phi) -> bool:
    return q.is_cuda and unsupported_reason(q, k, v, mixing, layout, causal=causal, phi=phi) is None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # (triton.cdiv costs microseconds per call: it is a JIT-aware function)


def _p2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def head_dim_parts(x: int) -> tuple[int, int]:
    """Power-of-two column parts (first, second) that cover head dim x in the forward tiles:
    (p2(x), 0) when x is a power of two or splitting saves nothing, else the largest power of two
    below x and the rest rounded up: 72 → (64, 16) instead of 128 columns, 96 → (64, 32)."""
    whole = _p2(x)
    lo = whole // 2
    hi = _p2(x - lo) if x > lo >= 16 else whole
    return (lo, hi) if lo + hi < whole else (whole, 0)


_PROPS: dict = {}


def _props(device):
    props = _PROPS.get(device.index)
    if props is None:
        props = _PROPS[device.index] = torch.cuda.get_device_properties(device)
    return props


def _programs_wanted(device) -> int:
    """Enough programs to fill the GPU a few times over (a split threshold, nothing more)."""
    return PROGRAMS_PER_SM * _props(device).multi_processor_count if device.type == "cuda" else 1


def _chain_kw(device) -> dict:
    """Launch options of a chained launch: programmatic dependent launch where the GPU has it (sm_90+)."""
    on = PDL and device.type == "cuda" and not interpreting() and _props(device).major >= 9
    return dict(PDL=True, launch_pdl=True) if on else {}


_LAUNCHERS: dict = {}


def _launch(fn, grid, args, kw):
    """fn[grid](*args, **kw) for a launch outside `_static` (the recurrent step, the rotary op). On CUDA the
    compiled kernel is kept per (fn, grid, scalar args, tensor dtypes and 16-byte alignment) and launched
    directly afterwards (`_cached`)."""
    if interpreting():
        return fn[grid](*args, **kw)
    key = (id(fn), grid, tuple(kw.items()),
           *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args])
    if len(_LAUNCHERS) > 4096:
        _LAUNCHERS.clear()
    _cached(_LAUNCHERS, key, fn, grid, kw, None, args)


def _cached(table, key, fn, grid, kw, stream, args, more=(), fast=None):
    """fn[grid](*args, *more, **kw) on the current stream or `stream`, through `table`'s entry at `key`, which
    `_compiled` makes on first use. `fast`: `args` as the direct launch takes them (tensors as addresses)."""
    hit = table.get(key)
    if hit:
        _direct(hit, args if fast is None else fast, more, stream)
    elif hit is None:
        table[key] = _compiled(fn, grid, (*args, *more), kw, stream)
    else:
        with _on(stream):
            fn[grid](*args, *more, **kw)


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _compiled(fn, grid, args, kw, stream):
    """Launch through Triton (compiling on first use) and return how to launch the same kernel directly: (run,
    its arguments before and after the kernel's, 3-D grid). `run` is Triton's C launcher itself, called without
    its argument binding and cache-key hashing and, where the kernel needs no scratch memory, without the Python
    wrapper around it: most of the host time of a small forward. False where Triton's internals are not as
    expected: Triton's own launch is kept then."""
    with _on(stream):
        kernel = fn[grid](*args, **kw)
    if hasattr(kernel, "result"):
        kernel = kernel.result()
    try:
        binder = fn.device_caches[triton.runtime.driver.active.get_current_device()][4]
        bound = binder(*args, **kw)[0]
        tail = tuple(bound[name] for name in list(bound)[len(args):])  # constexprs and defaults, fixed by the key
        launcher, meta = kernel.run, (kernel.function, kernel.packed_metadata, None, None, None)  # (no hooks)
    except Exception:  # noqa: BLE001
        return False
    run, head = launcher, meta
    if getattr(launcher, "global_scratch_size", 1) == 0 and getattr(launcher, "profile_scratch_size", 1) == 0:
        try:
            run, head = (
                launcher.launch,
                (meta[0], launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, *meta[1:]),
            )
        except AttributeError:
            pass
    return run, head, tail, grid + (1,) * (3 - len(grid))


def _direct(hit, args, more, stream):
    """Launch a kernel `_compiled` made: its arguments `args` and `more` (for a launch of `_run`: tensors as their
    addresses, which Triton's launcher would otherwise ask each tensor for and check with the driver, then the
    integers)."""
    run, head, tail, g = hit
    # the raw handle, as Triton's own launcher asks it: torch.cuda.current_stream() would be a large share of a
    # cached launch's host time
    raw = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice()) if stream is None else stream.cuda_stream
    run(g[0], g[1], g[2], raw, *head, *args, *more, *tail)


def _split(tiles: int, programs: int, wanted: int) -> tuple[int, int]:
    """Split `tiles` token tiles of each of `programs` programs so that about `wanted` run:
    returns (splits, tiles per split)."""
    per = math.ceil(tiles / max(1, min(tiles, math.ceil(wanted / programs))))
    return math.ceil(tiles / per), per


def _new(*shape, device, dtype, zero: bool = False) -> torch.Tensor:
    """Every buffer a kernel writes comes from here (tests poison it with NaN)."""
    return (torch.zeros if zero else torch.empty)(*shape, device=device, dtype=dtype)


@dataclass(frozen=True)
class _Plan:
    """Everything the launches need that is fixed by the shapes and options."""

    batch: int
    tokens: int
    heads: int
    kv_heads: int
    mix_heads: int  # heads with their own mixed summary: H when mixing is per head, else H_kv
    dim: int
    dv: int
    m: int
    cols: int
    causal: bool
    phi: int
    normalize: bool
    scale: float
    eps: float
    geometry: dict
    bt: int
    bd: int
    bdv: int
    prec: str
    per_head: bool
    warps: int

    @property
    def half_inputs(self) -> bool:
        return self.prec == "tf32"

    @property
    def mix_sh(self) -> int:
        return self.m * self.m if self.per_head else 0

    def heads_kw(self) -> dict:
        return dict(HKV_GROUP=self.heads // self.kv_heads, HMIX_GROUP=self.heads // self.mix_heads, HMIX=self.mix_heads,
                    M=self.m, COLS=self.cols, MIX_SH=self.mix_sh, scale=self.scale, eps=self.eps)

    def tile_kw(self) -> dict:
        return dict(**self.geometry, D=self.dim, DV=self.dv, BT=self.bt, BD=self.bd, BDV=self.bdv, PHI=self.phi,
                    num_warps=self.warps)


def _plan(q, k, v, mixing, layout: BlockLayout, *, causal, phi, normalize, scale, eps) -> _Plan:
    batch, _, heads, dim = q.shape
    kv_heads, dv = k.shape[2], v.shape[-1]
    per_head = mixing.dim() == 3
    pad = (1,) * (3 - len(layout.grid))
    grid, size, blocks = pad + layout.grid, pad + layout.block_size, pad + layout.blocks
    t = layout.tokens_per_block
    geometry = dict(
        L0=grid[0], L1=grid[1], L2=grid[2], S0=size[0], S1=size[1], S2=size[2], NB1=blocks[1], NB2=blocks[2], T=t
    )
    bt = _p2(t) if causal else min(TILE_TOKENS, _p2(t))
    bd, bdv = _p2(dim), _p2(dv)
    return _Plan(
        batch, layout.num_tokens, heads, kv_heads, heads if per_head else kv_heads, dim, dv, layout.num_blocks,
        dim * dv + dim, causal, _PHI_IDS[id(phi)], normalize, scale, eps, geometry, bt, bd, bdv,
        "ieee" if q.dtype == torch.float32 else "tf32", per_head, WIDE_WARPS if max(bd, bdv) >= 128 else 4,
    )


_FORWARD_SHAPED = ("summaries", "readout", "bwd_summaries")  # FWD_CONFIGS and head dims in two column parts


def _launch_kw(p: _Plan, launch: str) -> dict:
    """Tile and launch keyword arguments of one launch (a key of LAUNCH_CONFIGS): the plan's (its warps,
    Triton's default stages, its token tile), then FWD_CONFIGS for the summaries and readout shapes, then,
    non-causal, the launch's own LAUNCH_CONFIGS entry. The summaries and readout shapes cover a head dim like
    72 in two power-of-two column parts (`head_dim_parts`; non-causal)."""
    kw = p.tile_kw()
    fwd = launch in _FORWARD_SHAPED
    warps, stages, tile = (*(FWD_CONFIGS.get((p.dim, p.dv), ()) if fwd else ()), None, None, None)[:3]
    cap = None
    own = None if p.causal else LAUNCH_CONFIGS[launch].get((p.dim, p.dv))
    if own:
        warps, stages, cap, tile = (*own, tile)[:4]
    kw["num_warps"] = warps or p.warps
    kw.update({"num_stages": stages} if stages else {}, **({"maxnreg": cap} if cap else {}))
    if tile and not p.causal:
        kw["BT"] = min(tile, _p2(p.geometry["T"]))
    (bd, bdh), (bdv, bdvh) = head_dim_parts(p.dim), head_dim_parts(p.dv)
    if fwd and SPLIT_HEAD_DIMS and not p.causal and (bdh or bdvh):
        kw.update(BD=bd, BDH=bdh, BDV=bdv, BDVH=bdvh)
    return kw


_STATIC: dict = {}


def _rows_strides(n: int, heads: int, dim: int) -> tuple[int, int, int]:
    """(batch, token, head) strides of a contiguous (B, N, H, D) tensor (every q/k/v/o here is one)."""
    return n * heads * dim, heads * dim, dim


def _static(p: _Plan, device):
    """Per plan (and launch settings), everything but the tensors of every launch: grids, integer
    arguments, keyword arguments and a table for their compiled kernels (host time is most of a small
    forward+backward)."""
    wanted, knobs = _programs_wanted(device), _knobs()
    key = (id(p), device)
    hit = _STATIC.get(key)
    # (the entry keeps its plan alive, so its id stays its own; the settings are compared by value, a copy of them
    # kept: a benchmark may change a table in place)
    if hit is None or hit["plan"] is not p or hit["wanted"] != wanted or hit["knobs"] != knobs:
        chain = _chain_kw(device)

        def launch(name, heads, ints, atomic=False, **extra):
            """(grid, ints, kw, compiled-kernel table) of a launch over (batch x heads, blocks, splits of each
            block's tiles); `atomic`: the kernel adds float32 partials (ATOMIC) when a block is split."""
            kw = {**_launch_kw(p, name), **extra}
            splits, per = _split(_cdiv(p.geometry["T"], kw["BT"]), p.batch * heads * p.m, wanted)
            kw.update(TILES_PER_PROG=per, DOT_PREC=p.prec, **chain, **({"ATOMIC": splits > 1} if atomic else {}))
            return (p.batch * heads, p.m, splits), ints, kw, {}

        qs, ks = _rows_strides(p.tokens, p.heads, p.dim), _rows_strides(p.tokens, p.kv_heads, p.dim)
        vs, os_ = _rows_strides(p.tokens, p.kv_heads, p.dv), _rows_strides(p.tokens, p.heads, p.dv)
        heads = dict(NORMALIZE=p.normalize, CAUSAL=p.causal, **p.heads_kw())
        summaries = launch("summaries", p.kv_heads, (*ks, *vs, p.kv_heads, p.m, p.cols), atomic=True)
        # dS̃ and dz̃: the summaries of φ(q) and dnum (`_summaries_kernel`, WEIGHTED)
        bwd_summaries = launch("bwd_summaries", p.mix_heads, (*qs, *os_, p.mix_heads, p.m, p.cols), atomic=True,
                               GROUP=p.heads // p.mix_heads, WEIGHTED=True, scale=p.scale)
        # training's summaries and dS̃ as hi + lo halves where only the one-tile mixing gradient reads them whole
        # (its mixing heads are the key heads: both have the same size)
        mix_t = _mix_launch(p, wanted, "mix_t", chain)
        hilo = (HILO_SUMMARIES and p.half_inputs and not summaries[2]["ATOMIC"] and not bwd_summaries[2]["ATOMIC"]
                and mix_t[0] is K._mix_sweep_kernel)
        if not hilo:  # float32 dS̃ and summaries: their own setting (the tiles take twice the room)
            mix_t = _mix_launch(p, wanted, "mix_t_float", chain)
        if hilo:
            lo = dict(HILO=True, LO=p.batch * p.kv_heads * p.m * p.cols)
            mix_t = (mix_t[0], _with(mix_t[1], **lo))
            bwd_summaries = _with(bwd_summaries, **lo)
        hit = dict(
            plan=p,
            wanted=wanted,
            knobs=copy.deepcopy(knobs),
            hilo=hilo,
            summaries=summaries,
            summaries_hilo=_with(summaries, **lo) if hilo else None,
            readout=launch("readout", p.heads, (*qs, *ks, *vs, *os_, p.heads), **heads),
            mix_t=mix_t,
            **{kind: _mix_launch(p, wanted, kind, chain) for kind in ("mix", "mix_half")},
            bwd_queries=launch("bwd_queries", p.heads, (*qs, *ks, *vs, *os_, *os_, p.heads), **heads),
            bwd_summaries=bwd_summaries,
            bwd_keys=launch("bwd_keys", p.kv_heads, (*qs, *ks, *vs, *os_, p.heads, p.kv_heads), NORMALIZE=p.normalize,
                            CAUSAL=p.causal, HKV_GROUP=p.heads // p.kv_heads, M=p.m, COLS=p.cols, MIX_SH=p.mix_sh,
                            scale=p.scale),
            dmix=_dmix_launch(p, wanted, chain))
        # the mixing gradient's partials: rows (mixing head or one) x (batch, split[, head]) x M·M
        parts = mix_t[1][0][0] * mix_t[1][0][1] if mix_t[0] is K._mix_sweep_kernel else hit["dmix"][0][0]
        rows = p.mix_heads if p.per_head else 1
        br, bc, warps = SUM_TILES
        kw = dict(R=parts // rows, C=p.m * p.m, BR=br, BC=bc, num_warps=warps, **chain)
        hit["sum_partials"] = ((rows, _cdiv(p.m * p.m, bc)), (), kw, {})
        hit["side_sum"] = (device.type == "cuda" and not interpreting() and not p.causal
                           and p.batch * p.tokens * (p.heads + p.kv_heads) * (p.dim + p.dv) >= SIDE_SUM_MIN_ELEMENTS)
        if len(_STATIC) > 1024:
            _STATIC.clear()
        _STATIC[key] = hit
    return hit


def _knobs() -> tuple:
    """The launch settings `_static` reads (module constants: benchmarks and tests change them)."""
    return (FWD_CONFIGS, LAUNCH_CONFIGS, MIX_TILES, MIX_SWEEP, SUM_TILES, TILE_TOKENS, SPLIT_HEAD_DIMS, HILO_SUMMARIES,
            SIDE_SUM_MIN_ELEMENTS, PDL)


def _with(launch, **extra):
    """A launch with more keyword arguments."""
    grid, ints, kw, _ = launch
    return grid, ints, {**kw, **extra}, {}


_OPERANDS = {"mix": "float", "mix_half": "half", "mix_t": "grad", "mix_t_float": "grad_float"}  # MIX_SWEEP's keys


def _mix_launch(p: _Plan, wanted: int, kind: str, chain: dict):
    """(kernel, launch) of a mixing GEMM (all summaries contiguous (B, H, M, COLS)). "mix" (float32
    summaries) and "mix_half" (half ones: inference, and training's hi parts):
    out[b, hm] = mix[hm] @ S[b, hm // (H_mix/H_kv)].
    "mix_t": out[b, hk] = Σ over the mixing heads of key head hk of mixᵀ @ dS̃ (the one-tile kernel also
    yields the mixing gradient's partials), with dS̃ and S as hi + lo halves; "mix_t_float": the same over
    float32 ones (its own launch setting: the tiles take twice the shared memory)."""
    m, cols = p.m, p.cols
    if kind.startswith("mix_t"):
        h_in, h_out, r, gx, a_si, a_sk, mask = p.mix_heads, p.kv_heads, p.mix_heads // p.kv_heads, 1, 1, m, 2
    else:
        h_in, h_out, r, gx, a_si, a_sk, mask = p.kv_heads, p.mix_heads, 1, p.mix_heads // p.kv_heads, m, 1, 1
    strides = (h_in * m * cols, m * cols, h_out * m * cols, m * cols)
    mask = mask if p.causal else 0
    sweep = MIX_SWEEP.get((_p2(m), _OPERANDS[kind]))
    if sweep and r == 1 and p.half_inputs:
        bn, warps, stages, per_sm = sweep
        splits, per = _split(_cdiv(cols, bn), p.batch * h_out, max(1, wanted * per_sm // PROGRAMS_PER_SM))
        kw = dict(M=m, MASK=mask, BM=_p2(m), BN=bn, COL_TILES=per, DOT_PREC=p.prec, GRAD=kind.startswith("mix_t"),
                  num_warps=warps, num_stages=stages, **chain)
        return K._mix_sweep_kernel, ((p.batch * h_out, splits), (cols, h_out, gx, p.mix_sh, a_si, a_sk, *strides), kw,
                                     {})
    bm, bn, bk, warps = MIX_TILES
    kw = dict(M=m, R=r, MASK=mask, BM=bm, BN=bn, BK=bk, DOT_PREC=p.prec, num_warps=warps, **chain)
    ints = (cols, h_out, gx, p.mix_sh, a_si, a_sk, *strides)
    return K._mix_kernel, ((p.batch * h_out, _cdiv(m, bm), _cdiv(cols, bn)), ints, kw, {})


def _run(fn, launch, tensors, stream=None):
    """One of `_static`'s launches: tensors first, then the launch's integer arguments. The launch keeps its
    compiled kernel per tensor dtypes and 16-byte alignment in its own table (Triton specialises on both), so
    no key of its settings is built and hashed per call."""
    grid, ints, kw, table = launch
    if _INTERPRET:
        return fn[grid](*tensors, *ints, **kw)
    ptrs = [t.data_ptr() for t in tensors]
    sig = tuple([t.dtype for t in tensors])
    if functools.reduce(operator.or_, ptrs) % 16:  # (not all 16-byte aligned: which ones are)
        sig += tuple([a % 16 == 0 for a in ptrs])
    _cached(table, sig, fn, grid, kw, stream, tensors, ints, ptrs)


def _summaries(p: _Plan, k, v, half: bool = False, f=None):
    """Block summaries (B, H_kv, M, COLS). `half` (inference): in k's dtype when that is half precision (and
    the launch is not split over programs, which adds up float32 partials), which halves the bytes written
    here and read by the mixing GEMM. Training: float32, or where `_static` found it applies (`hilo`), as
    two halves (2, B, H_kv, M, COLS): the rounded sums, all the forward's mixing reads (it rounds them
    anyway: half the bytes), and their remainders, which the mixing gradient adds back (with the rounded
    sums alone it left the tests' bound on few blocks: the rounding does not average out of ⟨dS̃, S⟩).
    `f`: `_static(p, k.device)` when the caller has it."""
    f = f or _static(p, k.device)
    launch = f["summaries"]
    split = launch[2]["ATOMIC"]
    if half and not split and k.dtype != torch.float32:
        s = _new(p.batch, p.kv_heads, p.m, p.cols, device=k.device, dtype=k.dtype)
    elif not half and f["hilo"]:
        s, launch = _new(2, p.batch, p.kv_heads, p.m, p.cols, device=k.device, dtype=k.dtype), f["summaries_hilo"]
    else:
        s = _new(p.batch, p.kv_heads, p.m, p.cols, device=k.device, dtype=torch.float32, zero=split)
    _run(K._summaries_kernel, launch, (k, v, s, k))  # (k: a placeholder for the weights W)
    return s


def _mix(p: _Plan, mixing, x, out, *, kind: str, f=None, s=None, part=None):
    """One of `_static`'s mixing launches; the one-tile kernel takes the summaries `s` (float32 or hi + lo) and
    the partials buffer `part` of the mixing gradient ("mix_t"; placeholders elsewhere)."""
    fn, launch = (f or _static(p, x.device))[kind]
    extra = (x if s is None else s, out if part is None else part) if fn is K._mix_sweep_kernel else ()
    _run(fn, launch, (mixing, x, out, *extra))
    return out


def _mix_matmul(p: _Plan, mixing, s):
    """S̃ = mixing @ S through torch.matmul (cuBLAS) in S's dtype (per head: broadcast over the
    query heads of each key head). For half-precision summaries and many blocks, where cuBLAS's
    tiling beats `_mix_kernel` by 2x; the mixing weights are rounded to S's dtype."""
    mix = mixing.to(s.dtype)
    if p.causal:
        mix = mix.tril(-1)
    if not p.per_head:
        return torch.matmul(mix, s)
    g = p.mix_heads // p.kv_heads
    return torch.matmul(mix.view(p.kv_heads, g, p.m, p.m), s.unsqueeze(2)).view(p.batch, p.mix_heads, p.m, p.cols)


def _mix_summaries(p: _Plan, mixing, s, dtype, f=None):
    """S̃ = mixing @ S in the inputs' `dtype`, from any of `_summaries`'s forms (of hi + lo, the rounded sums)."""
    f = f or _static(p, s.device)
    s = s[0] if s.dim() == 5 else s
    if s.dtype == dtype != torch.float32 and p.m >= MATMUL_MIX_MIN_BLOCKS:
        return _mix_matmul(p, mixing, s)
    return _mix(p, mixing, s, _new(p.batch, p.mix_heads, p.m, p.cols, device=s.device, dtype=dtype),
                kind="mix_half" if s.dtype != torch.float32 else "mix", f=f)


def _forward(p: _Plan, q, k, v, mixing, half_summaries: bool = False, f=None):
    f = f or _static(p, q.device)
    s = _summaries(p, k, v, half_summaries, f)
    st = _mix_summaries(p, mixing, s, q.dtype, f)
    o = _new(p.batch, p.tokens, p.heads, p.dv, device=q.device, dtype=q.dtype)
    _run(K._readout_kernel, f["readout"], (q, k, v, st, mixing, o))
    return s, st, o


def _bwd_queries(p: _Plan, q, k, v, o, do, st, mixing, f):
    """dq, and the per-token weights W (B, H, 2, N) = (1/(den + eps), −do·o) that dS̃ and the key side read."""
    dq = _new(*q.shape, device=q.device, dtype=q.dtype)
    w = _new(p.batch, p.heads, 2, p.tokens, device=q.device, dtype=torch.float32)
    _run(K._bwd_query_kernel, f["bwd_queries"], (q, k, v, o, do, st, mixing, dq, w))
    return dq, w


def _bwd_summaries(p: _Plan, q, do, w, f):
    """dS̃ = Σ φ(q)ᵀ dnum and dz̃ = Σ φ(q) dden per block and mixing head by the summaries kernel: float32, or as
    hi + lo halves (2, B, H_mix, M, COLS) where the training summaries are (`_summaries`)."""
    launch = f["bwd_summaries"]
    if f["hilo"]:
        dst = _new(2, p.batch, p.mix_heads, p.m, p.cols, device=q.device, dtype=q.dtype)
    else:
        dst = _new(p.batch, p.mix_heads, p.m, p.cols, device=q.device, dtype=torch.float32, zero=launch[2]["ATOMIC"])
    _run(K._summaries_kernel, launch, (q, do, dst, w))
    return dst


def _mix_t(p: _Plan, mixing, dst, s, dtype, f):
    """dS = mixingᵀ dS̃, and the mixing gradient's partials when the one-tile kernel makes them in the same
    pass (else None). That kernel writes dS in the mixed summaries' half `dtype` (the key side reads it as a
    matmul operand in that precision anyway); the row-tiled one in float32 (a bf16 dS from that kernel costs
    it more than the key side's half-precision reads save)."""
    fn, launch = f["mix_t"]
    one_tile = fn is K._mix_sweep_kernel
    ds = _new(p.batch, p.kv_heads, p.m, p.cols, device=dst.device, dtype=dtype if one_tile else torch.float32)
    part = _new(launch[0][0] * launch[0][1], p.m, p.m, device=dst.device, dtype=torch.float32) if one_tile else None
    _mix(p, mixing, dst, ds, kind="mix_t", f=f, s=s, part=part)
    return ds, part


def _bwd_keys(p: _Plan, q, k, v, do, mixing, ds, w, f):
    """dk, dv from dS = mixingᵀ dS̃, and (causal) each head's ∂/∂m_ii."""
    dev = q.device
    dk, dv = _new(*k.shape, device=dev, dtype=k.dtype), _new(*v.shape, device=dev, dtype=v.dtype)
    dmii = _new(p.batch, p.heads, p.m, device=dev, dtype=torch.float32) if p.causal else dk
    _run(K._bwd_key_kernel, f["bwd_keys"], (q, k, v, do, mixing, ds, w, dk, dv, dmii))
    return dk, dv, dmii


def _backward(p: _Plan, q, k, v, mixing, s, st, o, do, need_mixing: bool, f=None):
    """All tensors contiguous (B, N, H, D) or (B, H, M, COLS): the launch arguments are the plan's. `f`: the
    forward's `_static` entry (whose summaries `s` are in its form)."""
    f = f or _static(p, q.device)
    dq, w = _bwd_queries(p, q, k, v, o, do, st, mixing, f)
    dst = _bwd_summaries(p, q, do, w, f)
    ds, part = _mix_t(p, mixing, dst, s, st.dtype, f)
    side = _side_stream(q.device) if need_mixing and part is not None and f["side_sum"] else None
    if side is not None:  # the partials' sum (all it needs is made) beside the key side
        dmix = _mixing_grad(p, dst, s, part, None, f, side)
    dk, dv, dmii = _bwd_keys(p, q, k, v, do, mixing, ds, w, f)
    if side is not None:
        side.join()
    elif need_mixing:
        dmix = _mixing_grad(p, dst, s, part, dmii, f)
    return dq, dk, dv, dmix.to(mixing.dtype) if need_mixing else None


class _SideStream:
    """A device's second stream, with the two events that fork work onto it from the current stream and join
    it back. Made once per device (a stream or event per backward costs host time); kernels go on it by its
    raw handle (`_run`), not under `torch.cuda.stream`, whose enter and exit, with `wait_stream`'s new
    events, would cost each backward about 0.1 ms of host time. Everything the side stream
    touches is allocated on the current stream, which waits for it (`join`) before anything after the
    backward, so freed memory is never reused under it."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)
        self.forked, self.done = torch.cuda.Event(), torch.cuda.Event()

    def fork(self):
        """The side stream waits for the current stream's work so far."""
        self.forked.record()
        self.stream.wait_event(self.forked)

    def join(self):
        """The current stream waits for the side stream's work so far."""
        self.done.record(self.stream)
        self.done.wait()


_SIDE_STREAMS: dict = {}


def _side_stream(device) -> _SideStream:
    side = _SIDE_STREAMS.get(device.index)
    if side is None:
        side = _SIDE_STREAMS[device.index] = _SideStream(device)
    return side


def _dmix_launch(p: _Plan, wanted: int, chain: dict):
    """⟨dS̃_i, S_j⟩ partials over (batch, mixing head, column split) and M x M tiles."""
    bm = bn = 64 if p.m > 32 else 32
    bk = 32
    tiles = _cdiv(p.m, bm) * _cdiv(p.m, bn)
    splits = max(1, min(_cdiv(p.cols, bk), _cdiv(wanted, p.batch * p.mix_heads * tiles)))
    split_cols = _cdiv(_cdiv(p.cols, splits), bk) * bk
    splits = _cdiv(p.cols, split_cols)
    kw = dict(STRICT=p.causal, BM=bm, BN=bn, BK=bk, DOT_PREC=p.prec, num_warps=4, **chain)
    ints = (p.mix_heads, p.mix_heads // p.kv_heads, p.m, p.cols, splits, split_cols)
    return (p.batch * p.mix_heads * splits, _cdiv(p.m, bm), _cdiv(p.m, bn)), ints, kw, {}


def _mixing_grad(p: _Plan, dst, s, part, dmii, f, side: _SideStream | None = None):
    """Sum of the ⟨dS̃_i, S_j⟩ partials (from `_mix_t`, or made here by `_dmix_kernel`) over batch and
    column splits (and heads, for shared mixing), plus the causal diagonal's own-chunk terms. `side`: the sum goes
    on that stream, after the current stream's work so far (non-causal, partials given)."""
    if part is None:
        launch = f["dmix"]
        part = _new(launch[0][0], p.m, p.m, device=dst.device, dtype=torch.float32)
        _run(K._dmix_kernel, launch, (dst, s, part))
    launch = f["sum_partials"]
    dmix = _new(launch[0][0], p.m, p.m, device=dst.device, dtype=torch.float32)
    if side is not None:
        side.fork()
    _run(K._sum_partials_kernel, launch, (part, dmix), side and side.stream)
    if p.causal:
        over = (0, 2) if p.per_head else (0, 1, 2)  # of (batch, mixing head, query head of one)
        dmix.diagonal(dim1=-2, dim2=-1).add_(dmii.view(p.batch, p.mix_heads, -1, p.m).sum(over))
    return dmix if p.per_head else dmix[0]


class MHLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mixing, plan: _Plan):
        ctx.plan, ctx.static = plan, _static(plan, q.device)
        s, st, o = _forward(plan, q, k, v, mixing, f=ctx.static)
        ctx.save_for_backward(q, k, v, mixing, s, st, o)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, mixing, s, st, o = ctx.saved_tensors
        dq, dk, dv, dmix = _backward(ctx.plan, q, k, v, mixing, s, st, o, do.contiguous(), ctx.needs_input_grad[3],
                                     ctx.static)
        return dq, dk, dv, dmix, None


def _plan_for(q, k, v, mixing, layout: BlockLayout, *, causal, phi, normalize, scale, eps) -> _Plan:
    """The plan of contiguous inputs; raises when the kernels do not take them."""
    # (every dtype and device: a plan is made only for inputs the kernels take, so a known key needs no check)
    key = (q.shape, k.shape, v.shape, mixing.shape, q.dtype, k.dtype, v.dtype, mixing.dtype, q.device, k.device,
           v.device, mixing.device, layout, causal, id(phi), normalize, scale, eps)
    plan = _PLANS.get(key)
    if plan is None:
        reason = unsupported_reason(q, k, v, mixing, layout, causal=causal, phi=phi)
        if reason is not None:
            raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
        plan = _plan(q, k, v, mixing, layout, causal=causal, phi=phi, normalize=normalize, scale=scale, eps=eps)
        if len(_PLANS) > 1024:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def mhla_attention_triton(q, k, v, mixing, layout: BlockLayout, *, causal, phi, normalize, scale, eps):
    """The Triton backend (same contract as `ops.mhla.mhla_attention_torch`)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # dq, dk, dv are written with q's, k's, v's strides
    plan = _plan_for(q, k, v, mixing, layout, causal=causal, phi=phi, normalize=normalize, scale=scale, eps=eps)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or mixing.requires_grad):
        return MHLAFunction.apply(q, k, v, mixing.contiguous(), plan)
    return _inference(plan, q, k, v, mixing.contiguous())


def mhla_attention_triton_backward(do, q, k, v, mixing, layout: BlockLayout, *, causal, phi, normalize, scale, eps,
                                   needs_grad):
    """(dq, dk, dv, dmixing) from the inputs alone: `MHLAFunction`'s forward launches again, then its backward's
    (the backward of the custom op `ops.mhla.attention_op`, which keeps nothing from its forward). dmixing is
    zeros unless needs_grad[3]."""
    q, k, v, mixing = q.contiguous(), k.contiguous(), v.contiguous(), mixing.contiguous()
    plan = _plan_for(q, k, v, mixing, layout, causal=causal, phi=phi, normalize=normalize, scale=scale, eps=eps)
    f = _static(plan, q.device)
    s, st, o = _forward(plan, q, k, v, mixing, f=f)
    dq, dk, dv, dmix = _backward(plan, q, k, v, mixing, s, st, o, do.contiguous(), needs_grad[3], f)
    return dq, dk, dv, torch.zeros_like(mixing) if dmix is None else dmix


def _inference(p: _Plan, q, k, v, mixing):
    """The output alone: no autograd node, nothing kept, half-precision summaries."""
    return _forward(p, q, k, v, mixing, half_summaries=True)[2]


_PLANS: dict = {}
