"""Launch settings of the exact-block forward (`kernels/exact_blocks_triton.py`: each query's exact block
neighbourhood read with the softmax kernel, the rest through the mixed summaries) at Wan2.1-1.3B's self-attention
shapes and FLUX.1's joint one, on the inference path: every candidate (query tile, key tile, warps, stages) timed,
fastest first, beside the settings in use. What `Settings.exact_blocks_forward` is chosen from. A script, never a
test.

    python benchmarks/exact_blocks_tiles.py [--shapes 480p,720p] [--out docs/bench/exact_blocks_tiles.txt]
    python benchmarks/exact_blocks_tiles.py --shapes flux-1024 --out /tmp/flux_tiles.txt

Times are medians of triton.testing.do_bench (ms), bf16, batch 1, heads of 128. Wan (480p, 720p): 12 heads, the
exact region each query's own block (`exact_radius: 0`, Wan's default), 7 × 3 × 5 blocks. FLUX at 1024²
(`flux-1024`): 24 heads, `joint_attention` over 512 text tokens and 64 × 64 image tokens in 8 × 8 blocks, each
query's 3 × 3-block neighbourhood exact (FLUX's default). A candidate whose tiles do not fit the GPU's shared memory
or registers is listed as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from datetime import date

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from mhla_convert.kernels import exact_blocks_triton, joint_triton, settings
from mhla_convert.ops import BlockLayout

# name -> (token grid, blocks, heads, exact radius, text tokens): Wan's latent grids of 81 frames after its 1 × 2 × 2
# patches; FLUX's packed 1024² latents with its prompt
SHAPES = {"480p": ((21, 30, 50), (7, 3, 5), 12, (0, 0, 0), 0), "720p": ((21, 45, 80), (7, 3, 5), 12, (0, 0, 0), 0),
          "flux-1024": ((64, 64), (8, 8), 24, (1, 1), 512)}
DIM = 128


def candidates() -> list[settings.Launch]:
    """Query tiles of 64 and 128 with key tiles of 32-128, 4 or 8 warps, 1-3 stages; query tiles of 32 with 4 warps."""
    wide = [settings.Launch(warps, stages, tokens=tokens, keys=keys)
            for tokens, keys, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2, 3))]
    narrow = [settings.Launch(4, stages, tokens=32, keys=keys) for keys, stages in itertools.product((64, 128), (2, 3))]
    return wide + narrow


def _inputs(shape):
    """(call(), layout): one inference forward of `shape` under the settings in use when it is called."""
    grid, blocks, heads, radius, text = SHAPES[shape]
    layout = BlockLayout.create(grid, blocks)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, text + layout.num_tokens, heads, DIM, device="cuda", dtype=torch.bfloat16,
                           generator=g) * 0.3 for _ in range(3))
    m = layout.num_blocks + (1 if text else 0)  # (the text: one more block of the mixing)
    mixing = torch.rand(m, m, device="cuda", generator=g) + 0.05
    options = dict(exact_radius=radius, phi=F.relu, scale=DIM**-0.5, eps=1e-6)
    if text:
        return lambda: joint_triton.joint_attention_triton(q, k, v, mixing, layout, text=text, **options), layout
    return lambda: exact_blocks_triton.mhla_attention_exact_blocks_triton(q, k, v, mixing, layout, **options), layout


def time_launch(launch: settings.Launch | None, call) -> float:
    """ms of `call` under `launch` (None: the settings in use) for the head dim's entry."""
    table = settings.SETTINGS
    if launch is not None:
        table = dataclasses.replace(table, exact_blocks_forward={**table.exact_blocks_forward, DIM: launch})
    saved, settings.SETTINGS = settings.SETTINGS, table
    try:
        with torch.no_grad():
            return do_bench(call, warmup=10, rep=100, return_mode="median")
    finally:
        settings.SETTINGS = saved


def _label(launch: settings.Launch) -> str:
    return f"query {launch.tokens}, keys {launch.keys}, {launch.warps} warps, {launch.stages} stages"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="480p,720p", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--out", default="docs/bench/exact_blocks_tiles.txt")
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    if set(shapes) - set(SHAPES):
        ap.error(f"--shapes: expected some of {', '.join(SHAPES)}; got {args.shapes!r}")
    if not torch.cuda.is_available():
        raise SystemExit("exact_blocks_tiles.py times Triton kernels: it needs a CUDA GPU")
    lines = [f"# exact-block forward launch settings, {date.today()}, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}, bf16, heads of {DIM}",
             f"# in use: {settings.SETTINGS.exact_blocks_forward[DIM]}"]
    for shape in shapes:
        call, layout = _inputs(shape)
        current = time_launch(None, call)
        rows = []
        for launch in candidates():
            try:
                rows.append((time_launch(launch, call), _label(launch)))
            except Exception as err:  # (triton's OutOfResources and compile errors: the candidate does not fit)
                rows.append((float("inf"), f"{_label(launch)}: does not fit ({type(err).__name__})"))
        grid, blocks, heads, _, text = SHAPES[shape]
        lines.append(f"\n## {shape}: {heads} heads, {layout.num_tokens} tokens{f' + {text} text' if text else ''}, "
                     f"blocks {'x'.join(map(str, blocks))} of {layout.tokens_per_block}; in use {current:.3f} ms")
        lines += [f"{ms:8.3f} ms  {current / ms:5.2f}x  {label}" for ms, label in sorted(rows)]
        print("\n".join(lines[-len(rows) - 1:]), flush=True)
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    main()
