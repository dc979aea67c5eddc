"""The whole main job on the embedded default, tiny and offline: convert a tiny Wan, attention
transfer, fine-tune on synthetic video latents (the loss printed going down), save as
safetensors, reload, sample an MP4."""

from __future__ import annotations

import tempfile
from pathlib import Path

from .recipe import parse_recipe

DEMO_RECIPE = """\
model: {name: tiny-wan, family: wan}
conversion: {ratio: 0.67, blocks: 1x2x2}     # the paper's hybrid: every third layer keeps softmax
data: {kind: synthetic, num_samples: 64, batch_size: 8, latent_frames: 2, latent_size: [8, 8]}
stages:
  - {name: attention_transfer, steps: 10, lr: 1.0e-3}
  - {name: finetune, steps: 40, train: all}
optimizer: {lr: 2.0e-3, grad_clip: 1.0}
logging: {every: 1, trackers: []}
"""


def run_pipeline_demo(out: str | Path | None = None) -> Path:
    """Returns the run directory (a temporary one unless `out` is given)."""
    from .. import from_pretrained, mhla_layers
    from .metrics import read_metrics
    from .sampling import sample
    from .trainer import train

    out = Path(out) if out else Path(tempfile.mkdtemp(prefix="mhla-demo-"))
    recipe = parse_recipe(DEMO_RECIPE, "demo recipe")
    print(
        f"1-3. convert tiny-wan, attention transfer ({recipe.stages[0].steps} steps), "
        f"fine-tune ({recipe.stages[1].steps} steps) -> {out}"
    )
    model_dir = train(recipe, out, resume=False)
    records = read_metrics(out / "metrics.jsonl")
    for name in ("attention_transfer", "finetune"):
        losses = [r["loss"] for r in records if r["stage"] == name]
        marks = [f"{losses[i]:.4f}" for i in range(0, len(losses), max(1, len(losses) // 5))] + [f"{losses[-1]:.4f}"]
        print(f"   {name} loss: {' -> '.join(marks)}")
    print(f"4. saved safetensors + mhla_config.json in {model_dir}")
    model = from_pretrained(model_dir)
    print(f"5. reloaded: {type(model).__name__} with {len(mhla_layers(model))} MHLA layers")
    video = sample(model_dir, "a tiny test video", out / "sample.mp4", steps=4)
    print(f"6. sampled {video}")
    return out
