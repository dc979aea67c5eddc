"""Launch settings of the Triton kernels: tile sizes, warps, stages and the thresholds that pick a kernel.

One table, `SETTINGS`, read at each launch by `mhla_triton` (attention), `exact_triton` (attention with exact
local chunks), `decode_triton` (an LM layer's decoding state) and `rotary_triton` (norm + rotary). Settings are fixed
rather than autotuned, which would time every candidate at each new shape inside a model's first forward.
The token-row kernels are limited by latency rather than bandwidth: a (D, Dv) float32 accumulator per program
leaves room for few programs per SM, so most settings trade tile size against programs per SM. A program takes
maxnreg x 32 x warps of an SM's 64K registers: 8 warps at 128 registers fit 2 programs per SM, 4 warps at 128
fit 4, 4 warps at 168 fit 3. Tests replace the table (`dataclasses.replace`) to reach a kernel on small shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Launch(NamedTuple):
    """The settings of one launch; None keeps the default named on each field."""

    warps: int | None = None  # None: `Settings.wide_warps` for 128-column head-dim tiles, else `Settings.warps`
    stages: int | None = None  # software pipelining depth; None: Triton's default
    maxnreg: int | None = None  # register cap per thread; None: the compiler's choice
    tokens: int | None = None  # token tile (non-causal); None: `Settings.tile_tokens`
    keys: int | None = None  # key tile where it differs from the query tile (`tokens`); None: the same


# 4 warps, 2 stages: the fewer stages leave shared memory for more programs per SM, and column parts of at most
# 64 (72 = 64 + 16) need no more warps
_NARROW = Launch(4, 2)


def _launches() -> dict[str, dict[int, Launch]]:
    """Per launch and head dim (D == Dv), non-causal: where the defaults leave programs per SM unused."""
    return {
        # D = 128: 8 warps under a 128-register cap, so 2 programs share an SM
        "summaries": {128: Launch(8, 3, 128), 72: _NARROW, 64: _NARROW},
        # D = 128: 1 stage leaves shared memory for 4 programs per SM instead of 3
        "readout": {128: Launch(4, 1, 128), 72: _NARROW, 64: _NARROW},
        # no accumulator across tiles: a register cap and 32-token tiles give 4 programs per SM at D = 128 (a few
        # bytes spill) and 3 at D = 72
        "bwd_queries": {128: Launch(4, 1, 128, 32), 72: Launch(4, 1, 168, 32)},
        # dS̃ (the summaries kernel, weighted): as the summaries, 2 programs per SM at D = 128
        "bwd_summaries": {128: Launch(8, 3, 128, 32), 72: Launch(4, 3), 64: _NARROW},
        # dk and dv beside dS: 8 warps under a 128-register cap (2 programs per SM) over 64-token tiles
        "bwd_keys": {128: Launch(8, 2, 128, 64), 72: Launch(8, 2, 128, 64)},
    }


def _causal_launches() -> dict[str, dict[int, Launch]]:
    """Per launch and head dim, causal: a token tile is a whole chunk (no token tile to choose); the
    summaries-shaped launches take `_NARROW`."""
    narrow = {dim: _NARROW for dim in (128, 72, 64)}
    # dS̃ at D = 64: a 168-register cap (0.110 ms at the 32k shape, against 0.127 uncapped)
    return {"summaries": narrow, "readout": narrow, "bwd_summaries": {**narrow, 64: Launch(4, 2, 168)}}


def _mix_sweep() -> dict[tuple[int, str], tuple[int, int, int, int]]:
    """(BM, operand) -> (column tile, warps, stages, programs per SM) of the one-tile mixing kernel."""
    return {
        # inference's half summaries (half the bytes per column of float32 ones: the widest column tiles)
        (128, "half"): (128, 8, 3, 1), (64, "half"): (64, 4, 3, 2),
        # training's float32 summaries: their tiles take twice the room of half ones
        (128, "float"): (64, 8, 3, 1),
        # the backward's dS̃ with the mixing gradient in the same pass, over hi + lo halves: only 2 stages fit
        # beside the mixing weights' hi + lo halves in shared memory
        (128, "grad"): (64, 8, 2, 1), (64, "grad"): (32, 4, 3, 2),
        # the same over float32 dS̃ and summaries (blocks split over programs): a 64-column tile does not fit
        (128, "grad_float"): (32, 8, 3, 1), (64, "grad_float"): (32, 4, 3, 2),
    }


@dataclass(frozen=True, eq=False)
class Settings:
    """The launch settings (one instance: `SETTINGS`). Compared and hashed by identity: the launch planners cache
    their plans per table, so a replaced table (`dataclasses.replace`) is planned afresh."""

    # largest head dim (D and Dv) the kernels take: one (D, Dv) float32 summary tile lives in a program's registers
    max_head_dim: int = 128
    # largest causal chunk: a chunk is one token tile, its masked C x C product in registers
    max_chunk: int = 128
    # token tile of the non-causal token-row kernels: large enough for tensor-core tile products, small enough
    # that its operand tiles fit beside the (D, Dv) accumulator
    tile_tokens: int = 64
    # warps per program: 4 for the token-row kernels, the decoding state's prompt and the rotary op; 8 where a head
    # dim's tile is 128 columns wide (D > 64), whose (D, Dv) accumulator needs the registers of 8 warps
    warps: int = 4
    wide_warps: int = 8
    # a launch whose programs fill the GPU fewer times than this splits each block's token tiles over several
    # programs (which add float32 partials): small problems then still use every SM
    programs_per_sm: int = 4
    # overrides of warps, stages, register cap and token tile per launch and head dim (`_launches`)
    launches: dict[str, dict[int, Launch]] = field(default_factory=_launches)
    causal_launches: dict[str, dict[int, Launch]] = field(default_factory=_causal_launches)
    # the one-tile mixing kernel (`_mix_sweep_kernel`, `_mix_sweep`), used when all M blocks fit one tile of
    # BM = p2(M) rows and each output head reads one input head: it holds the whole M x M mixing once per
    # program, so no summary column is read twice. Other M (at M ≤ 16 the row-tiled kernel is as fast), float32
    # inputs and grouped heads take `_mix_kernel`
    mix_sweep: dict[tuple[int, str], tuple[int, int, int, int]] = field(default_factory=_mix_sweep)
    # the row-tiled mixing GEMM (`_mix_kernel`): BM, BN, BK, warps. Each row tile reads its summary columns again,
    # so 64 rows read them half as often as 32; 128 rows take 8 warps and gain nothing over 64
    mix_tiles: tuple[int, int, int, int] = (64, 128, 32, 4)
    # from this many blocks torch.matmul mixes half-precision summaries, forward and transposed: a large M x M
    # mixing is a real GEMM, where cuBLAS's tiling beats the row-tiled kernel 2.5x (one half product against its
    # two, of the float32 mixing weights' hi + lo parts, at M = 512). Training then keeps its summaries and dS̃ in
    # half precision, and the mixing gradient takes half products of them: at 256 and 512 bf16 chunks its error
    # stays at 1.1-1.8x the torch path's own, as the float32 path's does at few blocks (three products of hi + lo
    # halves, 1.1-1.4x, took 0.32 ms against 0.12 at the causal 32k shape). Fewer blocks keep float32, for
    # precision: on the tests' cases of 3-16 blocks, mixing rounded summaries raised the bf16 mixing gradient's
    # error by up to 1.4x; at M ≤ 128 cuBLAS gains nothing
    matmul_mix_min_blocks: int = 256
    # the mixing gradient's ⟨dS̃_i, S_j⟩ partials (`_dmix_kernel`), by operand ("half" or "float"): BM = BN (at most
    # p2(M), at least 32), BK, warps, stages, and programs per SM that the splits aim at. 128 x 128 tiles read each
    # column of dS̃ and S half as often as 64 x 64 ones. Half operands (the causal 32k shape): 128 columns a step,
    # 3 stages and one program of 8 warps per SM were the best of 96 settings (0.124 ms; 2 stages: 0.18-0.24)
    dmix_tiles: dict[str, tuple[int, int, int, int, int]] = field(
        default_factory=lambda: {"half": (128, 128, 8, 3, 1), "float": (128, 64, 4, 3, 2)})
    # the partials' fixed-order sum (`_sum_partials_kernel`): rows, columns, warps
    sum_tiles: tuple[int, int, int] = (64, 32, 4)
    # an LM layer's decoding step (`decode_triton`): each (row, key head) owns its state, so at batch 1 only H_kv
    # of them run; their value columns are split over programs so that one token's work spreads over more SMs. By
    # the widest head dim: (warps, elements, value columns per program), where elements bounds a program's (query
    # heads x summary rows x value columns) mixture and its (query heads x window tokens x head dim) products,
    # which must stay in registers
    decode_launches: dict[int, tuple[int, int, int]] = field(
        default_factory=lambda: {16: (4, 16384, 16), 32: (4, 16384, 16), 64: (4, 16384, 16), 128: (4, 16384, 32)})
    # a prompt's older-chunk sums at the start of decoding (`decode_triton`): tokens per program. 512 splits 32k
    # tokens of one row over 64 programs per key head, enough to fill the SMs at batch 1
    prompt_split_tokens: int = 512
    # causal attention with exact local chunks (`exact_triton`): (warps, stages) by the widest head-dim tile. At 64,
    # 4 warps take ~220 registers a thread (two programs per SM) without spilling; at 128, 4 warps spill and 8 do
    # not. Two stages prefetch the next window chunk; at 64 a third still fits beside two programs per SM and also
    # overlaps the far summaries' load (about 6% at the Llama-3.2-1B shape)
    exact_launches: dict[int, tuple[int, int]] = field(
        default_factory=lambda: {16: (4, 2), 32: (4, 2), 64: (4, 3), 128: (8, 2)})
    # the forward of non-causal attention with an exact block neighbourhood (`exact_blocks_triton`), by the widest
    # head-dim tile: warps, stages, query tile (`tokens`) and key tile (`keys`) of its softmax launch; its summaries
    # launch takes the same warps, stages and query tile. At 128, 64-token query and key tiles under 4 warps and 3
    # stages were the fastest of 40 settings at Wan2.1's 480p and 720p shapes (benchmarks/exact_blocks_tiles.py),
    # 1.5x and 2.1x the 8 warps and 2 stages of the causal exact kernel that it used before. DiT's and PixArt's head
    # dim of 72 (tiles of 128 columns) takes the same entry; the sweep did not time their neighbourhoods
    exact_blocks_forward: dict[int, Launch] = field(default_factory=lambda: {
        16: Launch(4, 2), 32: Launch(4, 2), 64: Launch(4, 3), 128: Launch(4, 3)})
    # the backward of non-causal attention with an exact block neighbourhood (`exact_blocks_triton`), by the widest
    # head-dim tile: warps, stages and the token tile of its three launches (register cap unused). Its query-side
    # and key-side kernels each hold two (tokens x head dim) float32 accumulators beside their score tiles (dq and
    # the query rows; dk and dv), so at 64 and 128 they take 32-token tiles, and at 128 8 warps: compiled for sm_90
    # that spills nothing but 96 bytes a thread in the key side, where 64-token tiles (or 4 warps at 128) spill
    # hundreds. Untuned: on an H200 these settings take a Wan-sized fwd+bwd 3.3x faster than the torch path
    # (docs/benchmarks.md), but no sweep chose among the settings that fit
    exact_blocks_backward: dict[int, Launch] = field(default_factory=lambda: {
        16: Launch(4, 2), 32: Launch(4, 2), 64: Launch(4, 2, tokens=32), 128: Launch(8, 1, tokens=32)})


SETTINGS = Settings()
