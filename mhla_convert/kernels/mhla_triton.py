"""The Triton backend of `mhla_attention`: plans and launches the kernels of `mhla_kernels` (with the launch
settings of `settings`) and wraps them in an autograd Function whose backward also yields the gradient of the
(learnable) mixing. Each launch is a `launch.KernelLaunch`: Triton's `kernel[grid](*args, **meta)` the first time, then
the compiled kernel that launch found, while the tensors specialise alike. Under torch.compile an inference call
can instead be the triton op `attention_inference_op`, whose kernels inductor launches itself
(`mhla_attention_triton_traced`).

Forward: summaries (1 launch) → mixing GEMM (1) → readout (1). Backward: query side (dq, and per
token 1/(den + eps) and −do·o) → dS̃ and dz̃ by the summaries kernel over φ(q) and do, weighted by those →
mixingᵀ GEMM (dS) → key side (dk, dv) → ⟨dS̃, S⟩ partials for dmixing; for half inputs and M ≤ 128
one launch of the one-tile kernel (`_mix_sweep_kernel`) makes dS and those partials in one pass over
dS̃, and the partials are summed by one more launch. dq and dS̃ are separate launches because a dS̃
accumulator beside dq's would hold the kernel at one program per SM. On Hopper and later the launches are
chained by programmatic dependent launch (`_chained`): each kernel's programs take SMs as the previous
launch's last programs drain, and wait for its writes before touching memory.
The summaries at float32 precision and the mixed ones (in the input dtype for half inputs: they are a
matmul operand, as in fla) are kept from forward to backward: (B·H·M·D·Dv) floats each, far below the
activations for M ≪ N. Training keeps that precision for the mixing gradient (with half summaries the
rounding does not average out of it over few blocks): float32, or, where the one-tile kernel makes
the gradient, hi + lo half parts of which the mixings read only hi (`_Launches.form`). Inference (no
autograd) keeps nothing, writes the summaries in the input's half precision and mixes them in one tile of
all M blocks (M ≤ 128). Many blocks (`Settings.matmul_mix_min_blocks`) are mixed with torch.matmul, forward
and transposed, over half summaries and dS̃ in training too: there the M x M mixing is a large GEMM, and
the mixing gradient's half products of hundreds of blocks are as precise as the float32 path's are at few.

The launch arguments (`_Launches`) of each input signature are made once and kept in a bounded cache
(`_launches_of`), as the block layouts are (`ops.blocks`), with the compiled kernels their launches found: tensors
and results are never kept between calls.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple

import torch
from torch.autograd.function import once_differentiable
from torch.library import triton_op

from ..ops.blocks import BlockLayout
from ..ops.feature_maps import FEATURE_MAPS
from . import mhla_kernels as K
from . import settings
from .launch import KernelLaunch, TracedLaunch, launch_with

KERNEL_FEATURE_MAPS = {"relu": 0, "elu": 1}  # the feature maps the kernels apply, by name: their PHI ids
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the mixing gradient's product precision per input dtype (`_Plan.dmix_prec`)
_DMIX_PRECISION = {torch.float16: "tf32x3", torch.bfloat16: "tf32", torch.float32: "ieee"}
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # (Triton reads it once too, at import)


def interpreting() -> bool:
    return _INTERPRET


def phi_id(phi) -> int | None:
    """The kernels' id of feature map `phi` (their PHI argument), or None where they do not apply it. Compared by
    identity, which torch.compile traces (it does not trace `id`)."""
    for name, kernel_id in KERNEL_FEATURE_MAPS.items():
        if phi is FEATURE_MAPS[name]:
            return kernel_id
    return None


def qkv_reason(q, k, v, phi) -> str | None:
    """The feature-map and dtype clauses of the attention and the decoding-step kernels."""
    if phi_id(phi) is None:
        return "a callable feature map (kernels know 'relu' and 'elu')"
    return dtypes_reason(q, k, v)


def dtypes_reason(q, k, v) -> str | None:
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
    most = settings.SETTINGS.max_head_dim
    if q.shape[-1] > most or v.shape[-1] > most:
        return f"head dims {q.shape[-1]}/{v.shape[-1]} > {most}"
    return None


def unsupported_reason(q, k, v, mixing, layout: BlockLayout, *, causal: bool, phi) -> str | None:
    """Why these inputs need the torch path, or None when the kernels take them."""
    reason = qkv_reason(q, k, v, phi) or device_reason(q)
    if reason:
        return reason
    if not (q.device == k.device == v.device == mixing.device):  # (named here, not as a pointer error of Triton's)
        return f"tensors on several devices (q {q.device}, k {k.device}, v {v.device}, mixing {mixing.device})"
    reason = head_dims_reason(q, v)
    if reason:
        return reason
    most = settings.SETTINGS.max_chunk
    if causal and layout.tokens_per_block > most:
        return f"causal chunk of {layout.tokens_per_block} tokens > {most}"
    return None


def supports(q, k, v, mixing, layout, *, causal, phi) -> bool:
    return q.is_cuda and unsupported_reason(q, k, v, mixing, layout, causal=causal, phi=phi) is None


# (plain integer helpers: triton.cdiv and triton.next_power_of_2 are constexpr functions, made for kernels)
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def _p2(x: int) -> int:
    return max(16, next_power_of_2(x))


def head_dim_parts(x: int) -> tuple[int, int]:
    """Power-of-two column parts (first, second) that cover head dim x in the forward tiles:
    (p2(x), 0) when x is a power of two or splitting saves nothing, else the largest power of two
    below x and the rest rounded up: 72 → (64, 16) instead of 128 columns, 96 → (64, 32)."""
    whole = _p2(x)
    lo = whole // 2
    hi = _p2(x - lo) if x > lo >= 16 else whole
    return (lo, hi) if lo + hi < whole else (whole, 0)


@functools.cache
def _gpu(device) -> tuple[int, int]:
    """(SMs, compute capability's major) of a CUDA device: facts that never change, read once (torch's query takes
    a few µs of host time, and every eager call of the operator asks)."""
    properties = torch.cuda.get_device_properties(device)
    return properties.multi_processor_count, properties.major


def _programs_wanted(device) -> int:
    """Enough programs to fill the GPU a few times over (a split threshold, nothing more)."""
    if device.type != "cuda":
        return 1
    return settings.SETTINGS.programs_per_sm * _gpu(device)[0]


def _chained(device) -> bool:
    """Whether the launches are chained by programmatic dependent launch: on GPUs that have it (sm_90+)."""
    return device.type == "cuda" and not interpreting() and _gpu(device)[1] >= 9


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
    """Everything the launches need that is fixed by the shapes, the options and the device."""

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
    wanted: int  # programs that fill the device (`_programs_wanted`)
    chained: bool  # launches chained by programmatic dependent launch (`_chained`)
    traced: bool  # launched inside the triton op that torch.compile traces (`attention_inference_op`)
    # the mixing gradient's products of float32 summaries and dS̃ (`_dmix_kernel`): tf32 rounds them to fp16's own
    # precision, which left fp16 gradients at 3-4x the torch path's error; three tf32 products (tf32x3) keep float32's
    dmix_prec: str
    settings: settings.Settings  # the table the plan was made with, which its launches read too

    @property
    def half_inputs(self) -> bool:
        return self.prec == "tf32"

    @property
    def mix_sh(self) -> int:
        return self.m * self.m if self.per_head else 0

    def launch(self, grid: tuple, ints: tuple, meta: dict) -> KernelLaunch:
        return (TracedLaunch if self.traced else KernelLaunch)(grid, ints, meta)

    def chain_kw(self) -> dict:
        """The kernels' PDL switch and Triton's launch option, where launches are chained."""
        return dict(PDL=True, launch_pdl=True) if self.chained else {}

    def heads_kw(self) -> dict:
        return dict(HKV_GROUP=self.heads // self.kv_heads, HMIX_GROUP=self.heads // self.mix_heads, HMIX=self.mix_heads,
                    M=self.m, COLS=self.cols, MIX_SH=self.mix_sh, scale=self.scale, eps=self.eps)

    def tile_kw(self) -> dict:
        return dict(**self.geometry, D=self.dim, DV=self.dv, BT=self.bt, BD=self.bd, BDV=self.bdv, PHI=self.phi,
                    num_warps=self.warps)


class _Signature(NamedTuple):
    """All a plan depends on: the inputs' shapes, dtype and device, the options, the settings table in force and
    the device's facts. A cache key (`_launches_of`)."""

    q_shape: torch.Size
    kv_heads: int
    dv: int
    per_head: bool  # mixing (H, M, M)
    dtype: torch.dtype
    device: torch.device
    layout: BlockLayout
    causal: bool
    phi: Callable
    normalize: bool
    scale: float
    eps: float
    settings: settings.Settings
    wanted: int
    chained: bool
    traced: bool


def _plan(sig: _Signature) -> _Plan:
    s, layout, causal = sig.settings, sig.layout, sig.causal
    batch, _, heads, dim = sig.q_shape
    kv_heads, dv, per_head = sig.kv_heads, sig.dv, sig.per_head
    pad = (1,) * (3 - len(layout.grid))
    grid, size, blocks = pad + layout.grid, pad + layout.block_size, pad + layout.blocks
    t = layout.tokens_per_block
    geometry = dict(
        L0=grid[0], L1=grid[1], L2=grid[2], S0=size[0], S1=size[1], S2=size[2], NB1=blocks[1], NB2=blocks[2], T=t
    )
    bt = _p2(t) if causal else min(s.tile_tokens, _p2(t))
    bd, bdv = _p2(dim), _p2(dv)
    return _Plan(
        batch, layout.num_tokens, heads, kv_heads, heads if per_head else kv_heads, dim, dv, layout.num_blocks,
        dim * dv + dim, causal, phi_id(sig.phi), sig.normalize, sig.scale, sig.eps, geometry, bt, bd, bdv,
        "ieee" if sig.dtype == torch.float32 else "tf32", per_head, s.wide_warps if max(bd, bdv) >= 128 else s.warps,
        sig.wanted, sig.chained, sig.traced, _DMIX_PRECISION[sig.dtype], s,
    )


def _rows_strides(n: int, heads: int, dim: int) -> tuple[int, int, int]:
    """(batch, token, head) strides of a contiguous (B, N, H, D) tensor (every q/k/v/o here is one)."""
    return n * heads * dim, heads * dim, dim


_FORWARD_SHAPED = ("summaries", "readout", "bwd_summaries")  # head dims in two column parts (non-causal)
_INFERENCE = ("summaries", "readout")  # the token-row launches of an inference forward
_OPERANDS = {"mix": "float", "mix_half": "half", "mix_t": "grad", "mix_t_float": "grad_float"}  # mix_sweep's keys


class _Launches:
    """The launches of one plan, each made on first use: (grid, integer arguments, keyword arguments), or for
    the mixing GEMMs (kernel, launch). One object per input signature (`_launches_of`), shared by every call
    with it; training keeps the forward's for its backward. Launches read the plan's settings table, never the
    current one."""

    def __init__(self, p: _Plan):
        self.p = p

    def _kw(self, name: str) -> dict:
        """Tile and launch keyword arguments of one token-row launch: the plan's (its warps, Triton's default
        stages, its token tile), then the launch's entry of the settings per head dim. The summaries and
        readout shapes cover a head dim like 72 in two power-of-two column parts (`head_dim_parts`; non-causal)."""
        p = self.p
        s = p.settings
        kw = p.tile_kw()
        table = s.causal_launches if p.causal else s.launches
        own = table.get(name, {}).get(p.dim) if p.dim == p.dv else None
        if own:
            options = dict(num_warps=own.warps, num_stages=own.stages, maxnreg=own.maxnreg)
            kw.update({key: value for key, value in options.items() if value})
            if own.tokens and not p.causal:
                kw["BT"] = min(own.tokens, _p2(p.geometry["T"]))
        (bd, bdh), (bdv, bdvh) = head_dim_parts(p.dim), head_dim_parts(p.dv)
        if name in _FORWARD_SHAPED and not p.causal and (bdh or bdvh):
            kw.update(BD=bd, BDH=bdh, BDV=bdv, BDVH=bdvh)
        return kw

    def _tokens(self, name: str, heads: int, ints: tuple, atomic: bool = False, **extra):
        """A launch over (batch x heads, blocks, splits of each block's tiles); `atomic`: the kernel adds float32
        partials (ATOMIC) when a block is split."""
        p = self.p
        kw = {**self._kw(name), **extra}
        splits, per = _split(_cdiv(p.geometry["T"], kw["BT"]), p.batch * heads * p.m, p.wanted)
        kw.update(TILES_PER_PROG=per, DOT_PREC=p.prec, **p.chain_kw(), **({"ATOMIC": splits > 1} if atomic else {}))
        return p.launch((p.batch * heads, p.m, splits), ints, kw)

    def _strides(self):
        p = self.p
        return (_rows_strides(p.tokens, p.heads, p.dim), _rows_strides(p.tokens, p.kv_heads, p.dim),
                _rows_strides(p.tokens, p.kv_heads, p.dv), _rows_strides(p.tokens, p.heads, p.dv))

    def _heads_kw(self) -> dict:
        return dict(NORMALIZE=self.p.normalize, CAUSAL=self.p.causal, **self.p.heads_kw())

    @cached_property
    def summaries(self):
        p, (_, ks, vs, _) = self.p, self._strides()
        return self._tokens("summaries", p.kv_heads, (*ks, *vs, p.kv_heads, p.m, p.cols), atomic=True)

    @cached_property
    def _bwd_summaries_float(self):
        """dS̃ and dz̃: the summaries of φ(q) and dnum (`_summaries_kernel`, WEIGHTED)."""
        p, (qs, _, _, os_) = self.p, self._strides()
        return self._tokens("bwd_summaries", p.mix_heads, (*qs, *os_, p.mix_heads, p.m, p.cols), atomic=True,
                            GROUP=p.heads // p.mix_heads, WEIGHTED=True, scale=p.scale)

    @cached_property
    def form(self) -> str:
        """How training keeps its summaries and dS̃, for half inputs where no block is split over programs:
        "half" where torch.matmul mixes many blocks (`Settings.matmul_mix_min_blocks`), which rounds them to
        half precision anyway, and the mixing gradient's products are half-precision ones (over hundreds of
        blocks their rounding averages out of it); "hilo" (hi + lo halves) where the one-tile kernel makes
        the mixing gradient: its mixings read hi and the gradient reads both. Otherwise "float" (float32)."""
        p = self.p
        if not p.half_inputs or self.summaries[2]["ATOMIC"] or self._bwd_summaries_float[2]["ATOMIC"]:
            return "float"
        if p.m >= p.settings.matmul_mix_min_blocks:
            return "half"
        return "hilo" if self._mix_t_halves[0] is K._mix_sweep_kernel else "float"

    @cached_property
    def _mix_t_halves(self):
        return _mix_launch(self.p, "mix_t")

    def _lo(self, heads: int) -> int:
        """The lo half's offset in a (2, B, heads, M, COLS) halves buffer."""
        p = self.p
        return p.batch * heads * p.m * p.cols

    @cached_property
    def summaries_hilo(self):
        return launch_with(self.summaries, HILO=True, LO=self._lo(self.p.kv_heads))

    @cached_property
    def readout(self):
        p, (qs, ks, vs, os_) = self.p, self._strides()
        return self._tokens("readout", p.heads, (*qs, *ks, *vs, *os_, p.heads), **self._heads_kw())

    @cached_property
    def mix(self):
        return _mix_launch(self.p, "mix")

    @cached_property
    def mix_half(self):
        return _mix_launch(self.p, "mix_half")

    @cached_property
    def bwd_queries(self):
        p, (qs, ks, vs, os_) = self.p, self._strides()
        return self._tokens("bwd_queries", p.heads, (*qs, *ks, *vs, *os_, *os_, p.heads), **self._heads_kw(),
                            RECOMPUTE=p.causal and p.normalize and p.half_inputs)

    @cached_property
    def bwd_summaries(self):
        if self.form != "hilo":
            return self._bwd_summaries_float
        return launch_with(self._bwd_summaries_float, HILO=True, LO=self._lo(self.p.mix_heads))

    @cached_property
    def mix_t(self):
        """The transposed mixing's launch: the one-tile kernel over hi + lo halves, or the row-tiled one over
        float32 dS̃ (its own setting: the tiles take twice the room). None where torch.matmul mixes."""
        if self.form == "half":
            return None
        if self.form == "float":
            return _mix_launch(self.p, "mix_t_float")
        fn, launch = self._mix_t_halves
        return fn, launch_with(launch, HILO=True, LO=self._lo(self.p.kv_heads))  # (mixing heads = key heads)

    @cached_property
    def bwd_keys(self):
        p, (qs, ks, vs, os_) = self.p, self._strides()
        return self._tokens("bwd_keys", p.kv_heads, (*qs, *ks, *vs, *os_, p.heads, p.kv_heads), NORMALIZE=p.normalize,
                            CAUSAL=p.causal, HKV_GROUP=p.heads // p.kv_heads, M=p.m, COLS=p.cols, MIX_SH=p.mix_sh,
                            scale=p.scale)

    @cached_property
    def dmix(self):
        """⟨dS̃_i, S_j⟩ partials over (group, split) and M x M tiles (`_dmix_kernel`): as many splits of each group's
        column steps as fill the device once its live tiles are counted (one split per head, say, could leave a
        second wave a fifth full, and the SMs idle for most of it)."""
        p = self.p
        s = p.settings
        tile, bk, warps, stages, per_sm = s.dmix_tiles["half" if self.form == "half" else "float"]
        bm = min(tile, max(32, _p2(p.m)))
        tiles = _cdiv(p.m, bm)
        live = tiles * (tiles + 1) // 2 if p.causal else tiles * tiles
        groups = p.mix_heads if p.per_head else 1
        steps = p.batch * (1 if p.per_head else p.mix_heads) * _cdiv(p.cols, bk)
        wanted = max(1, p.wanted * per_sm // s.programs_per_sm)
        per = _cdiv(steps, max(1, min(steps, wanted // (groups * live))))
        splits = _cdiv(steps, per)
        ints = (p.mix_heads, p.mix_heads // p.kv_heads, p.batch, p.m, p.cols, per, splits)
        kw = dict(PER_HEAD=p.per_head, STRICT=p.causal, BM=bm, BN=bm, BK=bk, DOT_PREC=p.dmix_prec, num_warps=warps,
                  num_stages=stages, **p.chain_kw())
        return p.launch((groups * splits, tiles, tiles), ints, kw)

    @cached_property
    def sum_partials(self):
        """The mixing gradient's partials: rows (mixing head or one) x (batch, split[, head]) x M·M."""
        p, mix_t = self.p, self.mix_t
        if mix_t is not None and mix_t[0] is K._mix_sweep_kernel:  # (its grid: (batch x heads, splits))
            parts = mix_t[1][0][0] * mix_t[1][0][1]
        else:
            parts = self.dmix[0][0]
        rows = p.mix_heads if p.per_head else 1
        br, bc, warps = p.settings.sum_tiles
        kw = dict(R=parts // rows, C=p.m * p.m, BR=br, BC=bc, num_warps=warps, **p.chain_kw())
        return p.launch((rows, _cdiv(p.m * p.m, bc)), (), kw)


def _mix_launch(p: _Plan, kind: str):
    """(kernel, launch) of a mixing GEMM (all summaries contiguous (B, H, M, COLS)). "mix" (float32
    summaries) and "mix_half" (half ones: inference, and training's hi parts):
    out[b, hm] = mix[hm] @ S[b, hm // (H_mix/H_kv)].
    "mix_t": out[b, hk] = Σ over the mixing heads of key head hk of mixᵀ @ dS̃ (the one-tile kernel also
    yields the mixing gradient's partials), with dS̃ and S as hi + lo halves; "mix_t_float": the same over
    float32 ones (its own launch setting: the tiles take twice the shared memory)."""
    s = p.settings
    m, cols = p.m, p.cols
    if kind.startswith("mix_t"):
        h_in, h_out, r, gx, a_si, a_sk, mask = p.mix_heads, p.kv_heads, p.mix_heads // p.kv_heads, 1, 1, m, 2
    else:
        h_in, h_out, r, gx, a_si, a_sk, mask = p.kv_heads, p.mix_heads, 1, p.mix_heads // p.kv_heads, m, 1, 1
    strides = (h_in * m * cols, m * cols, h_out * m * cols, m * cols)
    mask = mask if p.causal else 0
    ints = (cols, h_out, gx, p.mix_sh, a_si, a_sk, *strides)
    sweep = s.mix_sweep.get((_p2(m), _OPERANDS[kind]))
    if sweep and r == 1 and p.half_inputs:
        bn, warps, stages, per_sm = sweep
        splits, per = _split(_cdiv(cols, bn), p.batch * h_out, max(1, p.wanted * per_sm // s.programs_per_sm))
        kw = dict(M=m, MASK=mask, BM=_p2(m), BN=bn, COL_TILES=per, DOT_PREC=p.prec, GRAD=kind.startswith("mix_t"),
                  num_warps=warps, num_stages=stages, **p.chain_kw())
        return K._mix_sweep_kernel, p.launch((p.batch * h_out, splits), ints, kw)
    bm, bn, bk, warps = s.mix_tiles
    kw = dict(M=m, R=r, MASK=mask, BM=bm, BN=bn, BK=bk, DOT_PREC=p.prec, num_warps=warps, **p.chain_kw())
    return K._mix_kernel, p.launch((p.batch * h_out, _cdiv(m, bm), _cdiv(cols, bn)), ints, kw)


def _run(fn, launch: KernelLaunch, tensors):
    """One launch: its tensors, then its integer arguments (`launch.KernelLaunch`)."""
    launch.run(fn, tensors)


def _summaries(p: _Plan, k, v, half: bool = False, f: _Launches | None = None):
    """Block summaries (B, H_kv, M, COLS). `half` (inference): in k's dtype when that is half precision (and
    the launch is not split over programs, which adds up float32 partials), which halves the bytes written
    here and read by the mixing GEMM. Training: in the form `_Launches.form` picks, float32, half, or two
    halves (2, B, H_kv, M, COLS): the rounded sums, all the forward's mixing reads (it rounds them anyway: half
    the bytes), and their remainders, which the mixing gradient adds back (with the rounded sums alone it left
    the tests' bound on few blocks: the rounding does not average out of ⟨dS̃, S⟩)."""
    f = f or _Launches(p)
    launch = f.summaries
    split = launch[2]["ATOMIC"]
    form = f.form if not half else "half" if not split and k.dtype != torch.float32 else "float"
    if form == "half":
        s = _new(p.batch, p.kv_heads, p.m, p.cols, device=k.device, dtype=k.dtype)
    elif form == "hilo":
        s, launch = _new(2, p.batch, p.kv_heads, p.m, p.cols, device=k.device, dtype=k.dtype), f.summaries_hilo
    else:
        s = _new(p.batch, p.kv_heads, p.m, p.cols, device=k.device, dtype=torch.float32, zero=split)
    _run(K._summaries_kernel, launch, (k, v, s, k))  # (k: a placeholder for the weights W)
    return s


def _mix(p: _Plan, mixing, x, out, *, kind: str, f: _Launches | None = None, s=None, part=None):
    """One mixing launch ("mix", "mix_half" or "mix_t" of `_Launches`); the one-tile kernel takes the summaries
    `s` (float32 or hi + lo) and the partials buffer `part` of the mixing gradient ("mix_t"; placeholders
    elsewhere)."""
    fn, launch = getattr(f or _Launches(p), kind)
    extra = (x if s is None else s, out if part is None else part) if fn is K._mix_sweep_kernel else ()
    _run(fn, launch, (mixing, x, out, *extra))
    return out


def _mix_matmul(p: _Plan, mixing, x, transposed: bool = False):
    """A mixing of many blocks through torch.matmul (cuBLAS), where the M x M mixing is a large GEMM whose
    tiling beats `_mix_kernel`'s, in x's half dtype: S̃ = mixing @ S (per head: broadcast over the query
    heads of each key head), or `transposed` dS = Σ mixingᵀ @ dS̃ over the mixing heads of each key head
    (their mixingsᵀ side by side along K: one GEMM). The mixing weights are rounded to x's dtype, as x is
    (in training too, where its summaries and dS̃ are half): an error of the size of x's own rounding. A causal
    shared mixing skips its triangle's empty quarter (`_triangular_matmul`); per-head ones stay whole GEMMs, since
    side by side along K a row half's nonzero columns are no single slice."""
    mix = mixing.to(x.dtype)
    if p.causal:
        mix = mix.tril(-1)
    if not p.per_head:
        a = mix.T if transposed else mix
        return _triangular_matmul(a, x, upper=transposed) if p.causal else torch.matmul(a, x)
    g = p.mix_heads // p.kv_heads
    mix = mix.view(p.kv_heads, g, p.m, p.m)
    if transposed:
        return torch.matmul(mix.permute(0, 3, 1, 2).reshape(p.kv_heads, p.m, g * p.m),
                            x.view(p.batch, p.kv_heads, g * p.m, p.cols))
    return torch.matmul(mix, x.unsqueeze(2)).view(p.batch, p.mix_heads, p.m, p.cols)


def _triangular_matmul(a, x, *, upper: bool):
    """a @ x for a strictly lower (or `upper`) triangular (M, M) a and (..., M, C) x, as two GEMMs over the halves of
    a's rows, each over only the columns that hold their nonzeros: 3/4 of the square's products."""
    m = a.shape[0]
    h = m // 2
    first, second = (slice(0, m), slice(h, m)) if upper else (slice(0, h), slice(0, m))
    out = torch.empty_like(x)
    torch.matmul(a[:h, first], x[..., first, :], out=out[..., :h, :])
    torch.matmul(a[h:, second], x[..., second, :], out=out[..., h:, :])
    return out


def _mix_summaries(p: _Plan, mixing, s, dtype, f: _Launches):
    """S̃ = mixing @ S in the inputs' `dtype`, from any of `_summaries`'s forms (of hi + lo, the rounded sums).
    Float32 summaries keep the mixing weights' float32 precision in the product (`_mix_dot`)."""
    s = s[0] if s.dim() == 5 else s
    if s.dtype == dtype != torch.float32 and p.m >= p.settings.matmul_mix_min_blocks:
        return _mix_matmul(p, mixing, s)
    return _mix(p, mixing, s, _new(p.batch, p.mix_heads, p.m, p.cols, device=s.device, dtype=dtype),
                kind="mix_half" if s.dtype != torch.float32 else "mix", f=f)


def _forward(p: _Plan, q, k, v, mixing, f: _Launches, half_summaries: bool = False):
    s = _summaries(p, k, v, half_summaries, f)
    st = _mix_summaries(p, mixing, s, q.dtype, f)
    o = _new(p.batch, p.tokens, p.heads, p.dv, device=q.device, dtype=q.dtype)
    _run(K._readout_kernel, f.readout, (q, k, v, st, mixing, o))
    return s, st, o


def _bwd_queries(p: _Plan, q, k, v, o, do, st, mixing, f: _Launches):
    """dq, and the per-token weights W (B, H, 2, N) = (1/(den + eps), −do·o) that dS̃ and the key side read."""
    dq = _new(*q.shape, device=q.device, dtype=q.dtype)
    w = _new(p.batch, p.heads, 2, p.tokens, device=q.device, dtype=torch.float32)
    _run(K._bwd_query_kernel, f.bwd_queries, (q, k, v, o, do, st, mixing, dq, w))
    return dq, w


def _bwd_summaries(p: _Plan, q, do, w, f: _Launches):
    """dS̃ = Σ φ(q)ᵀ dnum and dz̃ = Σ φ(q) dden per block and mixing head by the summaries kernel, in the
    training summaries' form (`_Launches.form`): float32, half, or hi + lo halves (2, B, H_mix, M, COLS)."""
    launch = f.bwd_summaries
    if f.form == "hilo":
        dst = _new(2, p.batch, p.mix_heads, p.m, p.cols, device=q.device, dtype=q.dtype)
    elif f.form == "half":
        dst = _new(p.batch, p.mix_heads, p.m, p.cols, device=q.device, dtype=q.dtype)
    else:
        dst = _new(p.batch, p.mix_heads, p.m, p.cols, device=q.device, dtype=torch.float32, zero=launch[2]["ATOMIC"])
    _run(K._summaries_kernel, launch, (q, do, dst, w))
    return dst


def _mix_t(p: _Plan, mixing, dst, s, dtype, f: _Launches):
    """dS = mixingᵀ dS̃ in the mixed summaries' `dtype` (the key side reads it as a matmul operand in that
    precision anyway), and the mixing gradient's partials when the one-tile kernel makes them in the same
    pass (else None). Many blocks: torch.matmul over half dS̃."""
    if f.mix_t is None:
        return _mix_matmul(p, mixing, dst, transposed=True), None
    fn, (grid, _, _) = f.mix_t
    one_tile = fn is K._mix_sweep_kernel
    ds = _new(p.batch, p.kv_heads, p.m, p.cols, device=dst.device, dtype=dtype)
    part = _new(grid[0] * grid[1], p.m, p.m, device=dst.device, dtype=torch.float32) if one_tile else None
    _mix(p, mixing, dst, ds, kind="mix_t", f=f, s=s, part=part)
    return ds, part


def _bwd_keys(p: _Plan, q, k, v, do, mixing, ds, w, f: _Launches):
    """dk, dv from dS = mixingᵀ dS̃, and (causal) each head's ∂/∂m_ii."""
    dev = q.device
    dk, dv = _new(*k.shape, device=dev, dtype=k.dtype), _new(*v.shape, device=dev, dtype=v.dtype)
    dmii = _new(p.batch, p.heads, p.m, device=dev, dtype=torch.float32) if p.causal else dk
    _run(K._bwd_key_kernel, f.bwd_keys, (q, k, v, do, mixing, ds, w, dk, dv, dmii))
    return dk, dv, dmii


def _backward(p: _Plan, q, k, v, mixing, s, st, o, do, need_mixing: bool, f: _Launches):
    """All tensors contiguous (B, N, H, D) or (B, H, M, COLS): the launch arguments are the plan's. `f`: the
    forward's launches (whose summaries `s` are in its form)."""
    dq, w = _bwd_queries(p, q, k, v, o, do, st, mixing, f)
    dst = _bwd_summaries(p, q, do, w, f)
    ds, part = _mix_t(p, mixing, dst, s, st.dtype, f)
    dk, dv, dmii = _bwd_keys(p, q, k, v, do, mixing, ds, w, f)
    dmix = _mixing_grad(p, dst, s, part, dmii, f) if need_mixing else None
    return dq, dk, dv, dmix.to(mixing.dtype) if need_mixing else None


def _mixing_grad(p: _Plan, dst, s, part, dmii, f: _Launches):
    """Sum of the ⟨dS̃_i, S_j⟩ partials (from `_mix_t`, or made here by `_dmix_kernel`) over batch and
    column splits (and heads, for shared mixing), plus the causal diagonal's own-chunk terms."""
    if part is None:
        launch = f.dmix
        part = _new(launch[0][0], p.m, p.m, device=dst.device, dtype=torch.float32)
        _run(K._dmix_kernel, launch, (dst, s, part))
    launch = f.sum_partials
    dmix = _new(launch[0][0], p.m, p.m, device=dst.device, dtype=torch.float32)
    _run(K._sum_partials_kernel, launch, (part, dmix))
    if p.causal:
        over = (0, 2) if p.per_head else (0, 1, 2)  # of (batch, mixing head, query head of one)
        dmix.diagonal(dim1=-2, dim2=-1).add_(dmii.view(p.batch, p.mix_heads, -1, p.m).sum(over))
    return dmix if p.per_head else dmix[0]


class MHLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mixing, f: _Launches):
        ctx.launches = f
        s, st, o = _forward(f.p, q, k, v, mixing, f)
        ctx.save_for_backward(q, k, v, mixing, s, st, o)
        return o

    @staticmethod
    @once_differentiable  # the kernels' backward has no backward: a second one fails loudly, not wrongly
    def backward(ctx, do):
        q, k, v, mixing, s, st, o = ctx.saved_tensors
        f = ctx.launches
        dq, dk, dv, dmix = _backward(f.p, q, k, v, mixing, s, st, o, do.contiguous(), ctx.needs_input_grad[3], f)
        return dq, dk, dv, dmix, None


@functools.lru_cache(maxsize=256)
def _launches_of(sig: _Signature) -> _Launches:
    """One `_Launches` per signature, shared by every call with it (and by threads: it holds integers, settings and
    compiled kernels, and its properties, computed once, are the same whoever computes them; a `KernelLaunch` replaces
    the kernel it keeps in one assignment). An eager call at a small shape would otherwise spend as long planning its
    launches as Triton spends launching them."""
    return _Launches(_plan(sig))


def _launches_for(q, k, v, mixing, layout: BlockLayout, *, causal, phi, normalize, scale, eps,
                  traced: bool = False) -> _Launches:
    """The launches of contiguous inputs; raises when the kernels do not take them. `traced`: launches inside the
    triton op that torch.compile traces (`attention_inference_op`), never chained."""
    reason = unsupported_reason(q, k, v, mixing, layout, causal=causal, phi=phi)
    if reason is not None:
        raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
    return _launches_of(_Signature(
        q.shape, k.shape[2], v.shape[-1], mixing.dim() == 3, q.dtype, q.device, layout, causal, phi, normalize,
        scale, eps, settings.SETTINGS, _programs_wanted(q.device), _chained(q.device) and not traced, traced,
    ))


def mhla_attention_triton(q, k, v, mixing, layout: BlockLayout, *, causal, phi, normalize, scale, eps):
    """The Triton backend (same contract as `ops.mhla.mhla_attention_torch`)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # dq, dk, dv are written with q's, k's, v's strides
    f = _launches_for(q, k, v, mixing, layout, causal=causal, phi=phi, normalize=normalize, scale=scale, eps=eps)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or mixing.requires_grad):
        return MHLAFunction.apply(q, k, v, mixing.contiguous(), f)
    return _inference(f, q, k, v, mixing.contiguous())


def mhla_attention_triton_backward(do, q, k, v, mixing, layout: BlockLayout, *, causal, phi, normalize, scale, eps,
                                   needs_grad):
    """(dq, dk, dv, dmixing) from the inputs alone: `MHLAFunction`'s forward launches again, then its backward's
    (the backward of the custom op `ops.mhla.attention_op`, which keeps nothing from its forward). dmixing is
    zeros unless needs_grad[3]."""
    q, k, v, mixing = q.contiguous(), k.contiguous(), v.contiguous(), mixing.contiguous()
    f = _launches_for(q, k, v, mixing, layout, causal=causal, phi=phi, normalize=normalize, scale=scale, eps=eps)
    s, st, o = _forward(f.p, q, k, v, mixing, f)
    dq, dk, dv, dmix = _backward(f.p, q, k, v, mixing, s, st, o, do.contiguous(), needs_grad[3], f)
    return dq, dk, dv, torch.zeros_like(mixing) if dmix is None else dmix


def _inference(f: _Launches, q, k, v, mixing):
    """The output alone: no autograd node, nothing kept, half-precision summaries."""
    return _forward(f.p, q, k, v, mixing, f, half_summaries=True)[2]


# --- inference inside a graph that torch.compile traces --------------------------------------------------------------
def mhla_attention_triton_traced(q, k, v, mixing, layout: BlockLayout, *, causal, feature_map: str, normalize, scale,
                                 eps) -> torch.Tensor | None:
    """An inference call inside a graph that torch.compile traces, as the triton op `attention_inference_op`:
    inductor launches its kernels itself, so the compiled graph spends no host time on the opaque op's dispatch, the
    launches' planning or Triton's launch path (about 0.1 ms per call, which bounds a compiled model at small
    shapes). None where the graph calls the opaque op (`ops.mhla.attention_op`) instead: causal attention, head dims
    whose launches take a register cap, which inductor cannot pass (it passes warps and stages), and the
    interpreter's kernels, which torch cannot trace (`torch.library.wrap_triton` knows compiled ones). (Symbolic
    shapes are left to the op itself: dynamo reports a symbolic size as an int here.)"""
    if causal or interpreting():
        return None
    dim, dv = q.shape[-1], v.shape[-1]
    # (compared, not looked up in the settings table: a size may be symbolic, and a symbolic size is no dict key)
    if any(dim == capped and dv == capped for capped in _capped_head_dims(settings.SETTINGS)):
        return None
    return attention_inference_op(q, k, v, mixing, list(layout.grid), list(layout.blocks), list(layout.block_size),
                                  feature_map, normalize, scale, eps)


def _capped_head_dims(s: settings.Settings) -> tuple[int, ...]:
    """The head dims (D == Dv) at which an inference forward's token-row launches take a register cap."""
    return tuple(sorted({dim for name in _INFERENCE for dim, own in s.launches.get(name, {}).items() if own.maxnreg}))


@triton_op("mhla_convert::attention_inference", mutates_args=())
def attention_inference_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mixing: torch.Tensor, grid: list[int],
                           blocks: list[int], block_size: list[int], feature_map: str, normalize: bool, scale: float,
                           eps: float) -> torch.Tensor:
    """Non-causal MHLA without autograd, on inputs `mhla_attention` checked (the layout as a `BlockLayout`'s grid,
    blocks and block size, the feature map by name): the inference forward's launches, as `TracedLaunch`es. Output
    (B, N, H, Dv) in q's dtype. Traced with symbolic sizes (a graph for many shapes), it is the opaque op
    `mhla_convert::attention` on the Triton backend instead, which plans its launches for each call's sizes."""
    if any(isinstance(size, torch.SymInt) for t in (q, k, v, mixing) for size in t.shape):
        return torch.ops.mhla_convert.attention(q, k, v, mixing, grid, blocks, block_size, False, feature_map,
                                                normalize, scale, eps, "triton")
    layout = BlockLayout(tuple(grid), tuple(blocks), tuple(block_size))
    q, k, v, mixing = (t.contiguous() for t in (q, k, v, mixing))
    f = _launches_for(q, k, v, mixing, layout, causal=False, phi=FEATURE_MAPS[feature_map], normalize=normalize,
                      scale=scale, eps=eps, traced=True)
    return _inference(f, q, k, v, mixing)
