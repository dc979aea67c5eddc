"""`make demo`: the main job on an embedded default, tiny and offline."""

from __future__ import annotations

import torch

from .layer import MHLAConfig, MHLAttention
from .ops import mhla_attention_reference


def run_demo() -> None:
    torch.manual_seed(0)
    grid, blocks = (7, 9), (2, 3)
    layer = MHLAttention(64, 4, config=MHLAConfig(blocks=blocks))
    x = torch.randn(2, grid[0] * grid[1], 64)
    out = layer(x, grid=grid)
    q, k, v = layer.project(x)
    ref = layer.output(mhla_attention_reference(q, k, v, layer.mixing, grid=grid, blocks=blocks))
    print(f"MHLA layer on a {grid[0]}x{grid[1]} token grid in {blocks[0]}x{blocks[1]} blocks (M={layer.num_blocks})")
    print(f"output {tuple(out.shape)}; max |fast - explicit O(N^2) reference| = {(out - ref).abs().max():.2e}")
