"""Mixing matrices: the paper's locality-biased init (§4.2), uniform, their causal variants, and
the relative (Toeplitz) causal form that lets an LM run past any length it was trained on.

Relative causal mixing. An LM sees an unbounded number of chunks, so a fixed (M, M) matrix caps
its length (the published code stops at 2048 tokens). Here a causal layer learns one weight per
chunk distance, r[0] for the query's own chunk, r[δ] for δ = 1 … W-2 chunks back, and r[W-1] for
every chunk at least W-1 back. The dense matrix m_ij = r[min(i - j, W - 1)] (j ≤ i) therefore
extends to any number of chunks with the weights it was trained with, and decoding needs only the
last W-2 chunk summaries plus one running sum of everything older (see ops.recurrent).
"""

from __future__ import annotations

import torch

from .ops.blocks import as_axes

MixingInit = str | float  # "locality", "uniform", or α ∈ [0, 1]: α·locality + (1-α)·uniform


def _row_normalise(m: torch.Tensor) -> torch.Tensor:
    return m / m.sum(-1, keepdim=True)


def locality_mixing(blocks, *, causal: bool = False, dtype=torch.float32) -> torch.Tensor:
    """m_ij ∝ 1 − dist(i, j) / max_k dist(i, k), Euclidean over block centres, rows sum to 1.

    Causal: only j, k ≤ i count (lower-triangular). A row whose max distance is 0 (M = 1, or the
    first causal block) puts all its weight on itself. The published code normalises columns;
    the paper (and this) normalises rows, so every query block reads a convex mixture.
    """
    blocks = as_axes("blocks", blocks)
    axes = [torch.arange(b, dtype=torch.float64) for b in blocks]
    centres = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(blocks))
    dist = torch.cdist(centres, centres)
    m = dist.shape[0]
    allowed = torch.ones(m, m, dtype=torch.bool).tril() if causal else torch.ones(m, m, dtype=torch.bool)
    dist = dist.masked_fill(~allowed, 0.0)
    far = dist.amax(-1, keepdim=True)
    weights = torch.where(far > 0, 1.0 - dist / far.clamp_min(1e-12), torch.eye(m, dtype=torch.float64))
    weights = weights.masked_fill(~allowed, 0.0)
    return _row_normalise(weights).to(dtype)


def uniform_mixing(num_blocks: int, *, causal: bool = False, dtype=torch.float32) -> torch.Tensor:
    """Every allowed block equally: with normalize=True this is plain (global or causal) linear attention."""
    ones = torch.ones(num_blocks, num_blocks, dtype=torch.float64)
    if causal:
        ones = ones.tril()
    return _row_normalise(ones).to(dtype)


def relative_causal_mixing(window: int, init: MixingInit = "locality", dtype=torch.float32) -> torch.Tensor:
    """Relative weights r[0 … W-1] (r[W-1] covers every distance ≥ W-1), summing to 1.

    locality: r[δ] ∝ 1 − δ / W (the 1-D locality prior by chunk distance, the tail kept > 0);
    uniform: all equal, which with normalize=True is plain causal linear attention.
    """
    if window < 1:
        raise ValueError(f"window must be ≥ 1; got {window}")
    delta = torch.arange(window, dtype=torch.float64)
    local = _row_normalise(1.0 - delta / window)
    uniform = torch.full((window,), 1.0 / window, dtype=torch.float64)
    return _blend(init, local, uniform).to(dtype)


def initial_mixing(init: MixingInit, blocks, *, dtype=torch.float32) -> torch.Tensor:
    """The (M, M) non-causal mixing for a layer's config."""
    blocks = as_axes("blocks", blocks)
    local = locality_mixing(blocks, dtype=torch.float64)
    return _blend(init, local, uniform_mixing(local.shape[0], dtype=torch.float64)).to(dtype)


def check_mixing_init(init: MixingInit) -> None:
    if init in ("locality", "uniform") and isinstance(init, str):
        return
    if not (isinstance(init, (int, float)) and not isinstance(init, bool) and 0.0 <= init <= 1.0):
        raise ValueError(f"mixing_init must be 'locality', 'uniform' or a blend weight in [0, 1]; got {init!r}")


def _blend(init: MixingInit, local: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    check_mixing_init(init)
    if init == "locality":
        return local
    if init == "uniform":
        return uniform
    return init * local + (1.0 - init) * uniform


def region_mixing(shape: torch.Tensor, region: torch.Tensor, far: float) -> torch.Tensor:
    """The init of a layer with an exact region: weight 1 on the region, so it starts as the host's softmax attention
    cut to it, and `far` · shape_ij / shape_ii outside (`shape`: a locality / uniform init, (M, M) or relative (W,);
    `region`: bool, alike). far = 0 starts exactly at that cut attention; larger values let the summaries count.
    Rows are scaled so that their largest weight is 1 (the output is normalised, so only ratios matter), which keeps
    every weight in [0, 1] for `clamp_mixing_`."""
    diagonal = shape[..., :1] if shape.dim() == 1 else shape.diagonal()[:, None]
    weights = torch.where(region.to(shape.device), torch.ones_like(shape), far * shape / diagonal)
    return weights / weights.amax(-1, keepdim=True)


def toeplitz_causal_mixing(relative: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Dense causal mixing m_ij = r[min(i − j, W − 1)] for j ≤ i, else 0: (…, W) → (…, M, M)."""
    idx = torch.arange(num_blocks, device=relative.device)
    delta = idx[:, None] - idx[None, :]
    dense = relative[..., delta.clamp(0, relative.shape[-1] - 1)]
    return dense * (delta >= 0)


@torch.no_grad()
def clamp_mixing_(module: torch.nn.Module) -> None:
    """Project every MHLA mixing parameter back onto [0, 1] (paper §4.2); call after each optimizer step."""
    for name, param in module.named_parameters():
        if name == "mixing" or name.endswith(".mixing"):
            param.clamp_(0.0, 1.0)
