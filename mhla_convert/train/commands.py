"""The `finetune` and `sample` commands; `register(app)` adds them to the `mhla-convert` CLI and
`main()` is what `python -m mhla_convert.train` / `accelerate launch -m mhla_convert.train` run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .errors import TrainError


def _one_line(fn):
    """Run `fn`, turning a TrainError into one line on stderr and exit status 2."""
    try:
        return fn()
    except TrainError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def finetune(
    recipe: Path = typer.Argument(..., help="Recipe YAML (see recipes/)."),
    out: Path = typer.Option(..., "--out", help="Run directory: checkpoints/, metrics.jsonl, model/."),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a recipe key, e.g. --set optimizer.lr=1e-4 --set stages.0.steps=10."
    ),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Continue from the latest checkpoint in --out."),
) -> None:
    """Convert (or load) a model and fine-tune it as the recipe says; single device, or many under
    `accelerate launch`."""

    def run():
        from ..verbosity import configure_libraries
        from .recipe import load_recipe
        from .trainer import train

        configure_libraries()
        train(load_recipe(recipe, set_), out, resume=resume)

    _one_line(run)


def sample(
    checkpoint: Path = typer.Argument(
        ..., help="A model saved by finetune (DIR/model) or mhla_convert.save_pretrained."
    ),
    prompt: Optional[str] = typer.Option(
        None, "--prompt", help="Text prompt (SANA, PixArt, Wan) or LM prompt (default: 'a photo of a cat')."),
    image: Optional[Path] = typer.Option(
        None, "--image", help="Wan image-to-video: the first frame (required for I2V checkpoints)."
    ),
    out: Path = typer.Option(..., "--out", help="Output file: .png for images, .mp4 for Wan, .txt for LMs."),
    class_label: Optional[int] = typer.Option(
        None, "--class-label", help="DiT (class-conditional): the class to draw, e.g. 207 (default: 0)."),
    steps: int = typer.Option(20, "--steps", help="Denoising steps."),
    guidance_scale: Optional[float] = typer.Option(
        None, "--guidance-scale", help="Classifier-free guidance (pipeline default when unset)."
    ),
    height: Optional[int] = typer.Option(None, "--height"),
    width: Optional[int] = typer.Option(None, "--width"),
    num_frames: Optional[int] = typer.Option(None, "--num-frames", help="Wan: frames (4k+1)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="LMs: tokens to generate."),
    seed: int = typer.Option(0, "--seed"),
    device: Optional[str] = typer.Option(None, "--device"),
    subfolder: Optional[str] = typer.Option(None, "--subfolder", help="The checkpoint's folder inside CHECKPOINT."),
    adapter: Optional[Path] = typer.Option(
        None, "--adapter", help="A LoRA adapter folder to merge in first (DIR/adapter of a `merge: false` run)."
    ),
    force: bool = typer.Option(
        False, "--force", help="With --adapter: merge it in even if it was trained on another model of the same "
        "shapes."),
) -> None:
    """Sample from a converted checkpoint with its family's pipeline (or `generate` for LMs)."""

    def run():
        from ..verbosity import configure_libraries
        from .sampling import sample as _sample

        configure_libraries()
        path = _sample(
            checkpoint, prompt, out, class_label=class_label, steps=steps, guidance_scale=guidance_scale, height=height,
            width=width, num_frames=num_frames, max_new_tokens=max_new_tokens, seed=seed, device=device, image=image,
            lora_adapter=adapter, force=force, subfolder=subfolder,
        )
        typer.echo(f"wrote {path}")

    _one_line(run)


def register(app: typer.Typer) -> None:
    app.command("finetune")(finetune)
    app.command("sample")(sample)


def main() -> None:
    typer.run(finetune)
