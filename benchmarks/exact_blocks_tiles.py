"""Launch settings of the exact-block forward (`kernels/exact_blocks_triton.py`: each query's own block read with the
softmax kernel, the rest through the mixed summaries) at Wan2.1-1.3B's self-attention shapes, on the inference path:
every candidate (query tile, key tile, warps, stages) timed, fastest first, beside the settings in use. What
`Settings.exact_blocks_forward` is chosen from. A script, never a test.

    python benchmarks/exact_blocks_tiles.py [--resolutions 480p,720p] [--out docs/bench/exact_blocks_tiles.txt]

Times are medians of triton.testing.do_bench (ms), bf16, batch 1, 12 heads of 128, the exact region each query's
own block (`exact_radius: 0`, Wan's default), 7 × 3 × 5 blocks. A candidate whose tiles do not fit the GPU's shared
memory or registers is listed as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from datetime import date

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from mhla_convert.kernels import exact_blocks_triton, settings
from mhla_convert.ops import BlockLayout

# resolution -> latent token grid of 81 frames (frames, height, width) after Wan's 1 × 2 × 2 patches
GRIDS = {"480p": (21, 30, 50), "720p": (21, 45, 80)}
BLOCKS = (7, 3, 5)
HEADS, DIM = 12, 128


def candidates() -> list[settings.Launch]:
    """Query tiles of 64 and 128 with key tiles of 32-128, 4 or 8 warps, 1-3 stages; query tiles of 32 with 4 warps."""
    wide = [settings.Launch(warps, stages, tokens=tokens, keys=keys)
            for tokens, keys, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3))]
    narrow = [settings.Launch(4, stages, tokens=32, keys=keys) for keys, stages in itertools.product((64, 128), (2, 3))]
    return wide + narrow


def _inputs(grid: tuple[int, ...]):
    layout = BlockLayout.create(grid, BLOCKS)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, layout.num_tokens, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g) * 0.3
               for _ in range(3))
    mixing = torch.rand(layout.num_blocks, layout.num_blocks, device="cuda", generator=g) + 0.05
    return (q, k, v, mixing), layout


def time_launch(launch: settings.Launch | None, inputs, layout) -> float:
    """ms of one forward under `launch` (None: the settings in use) for the head dim's entry."""
    table = settings.SETTINGS
    if launch is not None:
        table = dataclasses.replace(table, exact_blocks_forward={**table.exact_blocks_forward, DIM: launch})
    saved, settings.SETTINGS = settings.SETTINGS, table
    try:
        def call():
            return exact_blocks_triton.mhla_attention_exact_blocks_triton(
                *inputs, layout, exact_radius=(0, 0, 0), phi=F.relu, scale=DIM**-0.5, eps=1e-6)

        with torch.no_grad():
            return do_bench(call, warmup=10, rep=100, return_mode="median")
    finally:
        settings.SETTINGS = saved


def _label(launch: settings.Launch) -> str:
    return f"query {launch.tokens}, keys {launch.keys}, {launch.warps} warps, {launch.stages} stages"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--resolutions", default="480p,720p")
    ap.add_argument("--out", default="docs/bench/exact_blocks_tiles.txt")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("exact_blocks_tiles.py times Triton kernels: it needs a CUDA GPU")
    lines = [f"# exact-block forward launch settings, {date.today()}, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, bf16, {HEADS} heads x {DIM}, blocks {'x'.join(map(str, BLOCKS))}",
             f"# in use: {settings.SETTINGS.exact_blocks_forward[DIM]}"]
    for resolution in args.resolutions.split(","):
        inputs, layout = _inputs(GRIDS[resolution])
        current = time_launch(None, inputs, layout)
        rows = []
        for launch in candidates():
            try:
                rows.append((time_launch(launch, inputs, layout), _label(launch)))
            except Exception as err:  # (triton's OutOfResources and compile errors: the candidate does not fit)
                rows.append((float("inf"), f"{_label(launch)}: does not fit ({type(err).__name__})"))
        lines.append(f"\n## {resolution}: {layout.num_tokens} tokens, blocks of {layout.tokens_per_block}; "
                     f"in use {current:.3f} ms")
        lines += [f"{ms:8.3f} ms  {current / ms:5.2f}x  {label}" for ms, label in sorted(rows)]
        print("\n".join(lines[-len(rows) - 1:]), flush=True)
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    main()
