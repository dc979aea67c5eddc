"""Token grid → block layout.

An axis of length L split into b blocks has block size s = ceil(L / b); coordinate c lies in block
c // s, and flat block ids are row-major over the block grid. Padding the grid up to b·s per axis
and reshaping gives every block the same token count T = prod(s), which is what makes the torch
path a handful of batched GEMMs; padded tokens are zeroed *after* the feature map so they add
nothing to any summary.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch


def whole_number(value) -> int | None:
    """`value` as an int when it is a whole number type (int, numpy or 0-d torch integer), else None.
    Floats, bools and strings are not whole numbers here: 2.5 or "22" must never become 2 or (2, 2)."""
    if isinstance(value, (bool, str, bytes, float)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_axes(name: str, value) -> tuple[int, ...]:
    """`value` (an int or a sequence of 1 to 3 ints, each ≥ 1) as a tuple of ints; anything else is refused.
    While tracing, sizes may be symbolic and are taken as given (checking them would pin them to one value)."""
    if torch.compiler.is_compiling():
        return tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if whole_number(value) is not None:
        value = (value,)
    iterable = hasattr(value, "__iter__") and not isinstance(value, (str, bytes))
    out = tuple(whole_number(v) for v in value) if iterable else (None,)
    if None in out:
        raise ValueError(f"{name} must be whole numbers like (N,), (H, W) or (T, H, W); got {value!r}")
    if not 1 <= len(out) <= 3:
        raise ValueError(f"{name} must have 1, 2 or 3 axes; got {value!r}")
    if min(out) < 1:
        raise ValueError(f"every {name} axis must be ≥ 1; got {value!r}")
    return out


@dataclass(frozen=True)
class BlockLayout:
    """How a row-major token grid maps onto a grid of blocks."""

    grid: tuple[int, ...]
    blocks: tuple[int, ...]
    block_size: tuple[int, ...]

    @classmethod
    def chunked(cls, num_tokens: int, chunk_size: int) -> "BlockLayout":
        """1-D chunks of exactly `chunk_size` tokens (the last may be shorter): the causal layout,
        whose boundaries must not move as the sequence grows."""
        if whole_number(chunk_size) is None or chunk_size < 1:
            raise ValueError(f"chunk_size must be a whole number ≥ 1; got {chunk_size!r}")
        return cls((num_tokens,), (-(-num_tokens // chunk_size),), (chunk_size,))

    @classmethod
    def create(cls, grid, blocks) -> "BlockLayout":
        """Validated layout of `blocks` over `grid`; cached, as every eager operator call asks for one (a
        traced call is made once: it builds its layout without the cache, which torch.compile would not keep)."""
        if torch.compiler.is_compiling():
            return cls._build(grid, blocks)
        if _ints(grid) and _ints(blocks):  # (the cache's own build checks their values)
            return _cached_layout(grid, blocks)
        # other types are checked before the cache: (2.0, 2.0) hashes like (2, 2) and must not find its layout there
        return _cached_layout(as_axes("grid", grid), as_axes("blocks", blocks))

    @classmethod
    def _build(cls, grid, blocks) -> "BlockLayout":
        grid, blocks = as_axes("grid", grid), as_axes("blocks", blocks)
        if len(blocks) != len(grid):
            raise ValueError(
                f"blocks must have one entry per grid axis (len {len(grid)} for grid {grid}); got {blocks}"
            )
        for axis, (length, b) in enumerate(zip(grid, blocks)):
            if b > length:
                raise ValueError(
                    f"blocks[{axis}] must be in [1, {length}] (grid axis {axis} has {length} tokens); got {b}"
                )
        return cls(grid, blocks, tuple(-(-length // b) for length, b in zip(grid, blocks)))

    @property
    def num_tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def num_blocks(self) -> int:
        return math.prod(self.blocks)

    @property
    def tokens_per_block(self) -> int:
        return math.prod(self.block_size)

    @property
    def padded_grid(self) -> tuple[int, ...]:
        return tuple(b * s for b, s in zip(self.blocks, self.block_size))

    @property
    def needs_padding(self) -> bool:
        return self.padded_grid != self.grid

    def block_ids(self, device=None) -> torch.Tensor:
        """Flat block id of every token, shape (N,): the definition, used by the reference."""
        ids = torch.zeros(self.grid, dtype=torch.long, device=device)
        for axis, (length, s) in enumerate(zip(self.grid, self.block_size)):
            shape = [1] * len(self.grid)
            shape[axis] = length
            stride = math.prod(self.blocks[axis + 1 :])
            ids = ids + (torch.arange(length, device=device) // s).view(shape) * stride
        return ids.reshape(-1)

    # (B, N, H, D) <-> (B, H, M, T, D)
    def to_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Gather tokens block by block: (B, N, H, D) → (B, H, M, T, D), zero-padded."""
        batch, _, heads, dim = x.shape
        nd = len(self.grid)
        x = x.reshape(batch, *self.grid, heads, dim)
        if self.needs_padding:
            pad = []
            for length, padded in zip(reversed(self.grid), reversed(self.padded_grid)):
                pad += [0, padded - length]
            x = torch.nn.functional.pad(x, [0, 0, 0, 0] + pad)
        split = [batch]
        for b, s in zip(self.blocks, self.block_size):
            split += [b, s]
        x = x.reshape(*split, heads, dim)
        # dims: 0 batch, (1+2a) block axis a, (2+2a) in-block axis a, 1+2nd heads, 2+2nd dim
        perm = [0, 1 + 2 * nd] + [1 + 2 * a for a in range(nd)] + [2 + 2 * a for a in range(nd)] + [2 + 2 * nd]
        return x.permute(perm).reshape(batch, heads, self.num_blocks, self.tokens_per_block, dim)

    def from_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_blocks`: (B, H, M, T, D) → (B, N, H, D), padding dropped."""
        batch, heads, _, _, dim = x.shape
        nd = len(self.grid)
        x = x.reshape(batch, heads, *self.blocks, *self.block_size, dim)
        perm = [0]
        for a in range(nd):
            perm += [2 + a, 2 + nd + a]
        perm += [1, 2 + 2 * nd]
        x = x.permute(perm).reshape(batch, *self.padded_grid, heads, dim)
        if self.needs_padding:
            x = x[(slice(None), *(slice(0, length) for length in self.grid))]
        return x.reshape(batch, self.num_tokens, heads, dim)


def _ints(value) -> bool:
    """Whether `value` is a tuple of plain ints (no bools, floats or numpy integers), as layouts are cached by."""
    return type(value) is tuple and all(type(v) is int for v in value)


@functools.lru_cache(maxsize=1024)
def _cached_layout(grid, blocks) -> BlockLayout:
    return BlockLayout._build(grid, blocks)
