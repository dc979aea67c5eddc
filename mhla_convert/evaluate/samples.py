"""Side-by-side samples of a (converted) diffusion transformer and its reference: both run inside
the family's diffusers pipeline, on the same prompts (or DiT class labels) and the same seeds, so
they start from the same noise. Writes one grid (`samples.png`, top row the reference, bottom row
the model; for video models also `samples.mp4`, the same grid per frame, and the PNG holds the first
frames) and scores the model's samples against the reference's with PSNR and SSIM. How a family's
pipeline is built and called is its adapter's (`DiffusersAdapter.sampling_pipeline`, `generate`), as
for `mhla-convert sample`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..families import families
from ..io import write_file_atomically
from ..locations import components_of
from .image_metrics import clip_score, fid, psnr, resolve_clip_model, resolve_fid_weights, ssim

DEFAULT_PROMPTS = (
    "a red panda sitting on a mossy log in a forest",
    "a lighthouse on a rocky coast at sunset",
    "a bowl of ramen with a soft-boiled egg, studio photo",
    "an astronaut riding a horse on the moon",
    "a watercolor painting of a city street in the rain",
    "a close-up of a hummingbird drinking from a flower",
    "a snowy mountain village at night with warm lights",
    "a vintage car parked in front of a neon diner",
)
# ImageNet classes: golden retriever, otter, red panda, geyser, macaw, valley, balloon, arctic fox
DEFAULT_CLASSES = (207, 360, 387, 974, 88, 979, 417, 279)
LABELS = ("reference", "model")
LABEL_WIDTH = 64  # the strip left of the grid that names each row (even, so video frames stay even-sized)
PAD = 2
VIDEO_FPS = 16


@torch.no_grad()
def compare_samples(model: nn.Module, reference: nn.Module, *, family: str, out_dir: Path, num_samples: int = 4,
                    seed: int = 0, steps: int = 20, device=None, prompts: list[str] | None = None,
                    class_labels: list[int] | None = None, base: str | None = None,
                    fid_weights: str | Path | None = None, clip_model: str | Path | None = None) -> dict[str, float]:
    """Sample `model` and `reference` side by side and score the model against the reference.

    Sample i of both uses a generator seeded with `seed + i`, so two calls give identical images and
    metrics. Prompts (text-conditional families) or class labels (class-conditional ones: DiT)
    default to `num_samples` built-in ones; when given, there is one sample per entry. The VAE, text
    encoder and scheduler come from `base` (default: the base model recorded on `reference`, then on
    `model`); built-in tiny models get tiny in-process ones. Both transformers are put in eval mode
    and moved to `device`.

    Returns {"psnr": mean dB (inf when a sample matches exactly), "ssim": mean SSIM}, over the
    float [0, 1] pipeline outputs in float64. Only when asked for, from local weights (nothing is
    downloaded; a missing package or file is a one-line error): `fid_weights` (the FID Inception
    weights file; needs torchmetrics[image]) adds "fid" of the model's samples to the reference's,
    and `clip_model` (a CLIP directory, or a hub id already in the Hugging Face cache) adds
    "clip_score" and "clip_score_reference"; videos are scored on their first frames.
    """
    adapter = _diffusion_adapter(family)
    num_classes = adapter.num_classes(model)
    conditions = _conditions(family, num_classes, num_samples, prompts, class_labels)
    if clip_model is not None and num_classes is not None:
        raise ValueError(f"clip_model scores samples against their prompts; {family} samples are class-conditional "
                         "(drop clip_model)")
    if fid_weights is not None and len(conditions) < 2:
        raise ValueError("FID compares two sets of samples: ask for at least 2 (num_samples, prompts or class_labels)")
    fid_path, clip_path = resolve_fid_weights(fid_weights), resolve_clip_model(clip_model)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base = base or components_of(reference) or components_of(model)
    for transformer in (reference, model):
        if adapter.takes_first_frame(transformer):
            raise ValueError("sample comparison generates from prompts alone; image-to-video models need a first frame")
        transformer.eval().to(device)

    pipe, ref_samples = draw_samples(adapter, reference, base, conditions, seed=seed, steps=steps, device=device)
    _, model_samples = draw_samples(adapter, model, base, conditions, seed=seed, steps=steps, device=device, pipe=pipe)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(ref_samples, model_samples, out_dir, video=adapter.video)
    metrics = {"psnr": psnr(model_samples, ref_samples).mean().item(),
               "ssim": ssim(model_samples, ref_samples).mean().item()}
    firsts = [s[:, 0] if adapter.video else s for s in (ref_samples, model_samples)]
    if fid_path is not None:
        metrics["fid"] = fid(firsts[1], firsts[0], fid_path)
    if clip_path is not None:
        metrics["clip_score"] = clip_score(firsts[1], conditions, clip_path)
        metrics["clip_score_reference"] = clip_score(firsts[0], conditions, clip_path)
    return metrics


def draw_samples(adapter, transformer: nn.Module, base: str | None, conditions: list, *, seed: int, steps: int,
                 device, pipe=None):
    """(pipeline, samples): one sample per condition (class label or prompt) from `transformer` in its
    family's pipeline, sample i from a generator seeded with `seed + i`, as float64 (N, C, H, W) or
    (N, F, C, H, W) in [0, 1]. A `pipe` from an earlier call is reused around `transformer` (the same
    VAE, text encoder and scheduler)."""
    if pipe is None:
        pipe = adapter.sampling_pipeline(transformer, base, device=device)
    else:
        pipe.register_modules(transformer=transformer)
    condition = "prompt" if adapter.num_classes(transformer) is None else "class_label"
    generators = [torch.Generator(device).manual_seed(seed + i) for i in range(len(conditions))]
    return pipe, torch.stack([
        _as_tensor(adapter.generate(pipe, base, generator=g, steps=steps, output_type="np", **{condition: c}))
        for c, g in zip(conditions, generators)])


def components_source(family: str, transformer: nn.Module, candidates) -> str:
    """The first of `candidates` (directories or hub ids, in order; None skipped) that holds the VAE, text
    encoder and scheduler of the family's pipeline around `transformer`: its model_index.json, read with
    diffusers' `load_config` (built-in tiny models: their in-process parts). Checked before sampling."""
    import diffusers

    from ..train.components import is_tiny

    cls = getattr(diffusers, _diffusion_adapter(family).pipeline_name(transformer))
    tried = list(dict.fromkeys(c for c in candidates if c))
    for source in tried:
        if is_tiny(source):
            return source
        try:
            cls.load_config(source)
            return source
        except (OSError, ValueError):
            continue
    where = (f"{tried[0]} holds no" if len(tried) == 1 else f"none of {', '.join(tried)} holds a" if tried
             else "no base model is recorded to hold its")
    raise ValueError(f"sample comparison needs the rest of a {cls.__name__} (VAE, scheduler, any text encoder), but "
                     f"{where} model_index.json: give --components DIR_OR_ID (the base pipeline), or --no-samples")


def sample_conditions(adapter, model: nn.Module, num_samples: int, prompts=None, class_labels=None) -> list:
    """The class label or prompt of each sample: the given ones, or `num_samples` built-in ones."""
    return _conditions(adapter.name, adapter.num_classes(model), num_samples, prompts, class_labels)


def _diffusion_adapter(family: str):
    """The family's adapter, refused unless its samples come from a diffusers pipeline."""
    known = families()
    if family not in known or known[family].library != "diffusers":
        diffusion = sorted(name for name, cls in known.items() if cls.library == "diffusers")
        raise ValueError(f"sample comparison is for the diffusion families {', '.join(diffusion)}; got {family!r}")
    return known[family]()


def _conditions(family: str, num_classes: int | None, num_samples: int, prompts, class_labels) -> list:
    """The class label or prompt of each sample."""
    if num_classes is not None:
        if prompts is not None:
            raise ValueError(f"{family} is class-conditional: pass class_labels instead of prompts")
        defaults = [c % num_classes for c in _cycle(DEFAULT_CLASSES, num_samples)]  # tiny models have few classes
        chosen = list(class_labels) if class_labels is not None else defaults
        if not chosen or not all(0 <= c < num_classes for c in chosen):
            raise ValueError(f"class_labels must be a non-empty list of classes in [0, {num_classes}); got {chosen}")
        return chosen
    if class_labels is not None:
        raise ValueError(f"{family} is text-conditional: pass prompts instead of class_labels")
    chosen = list(prompts) if prompts is not None else _cycle(DEFAULT_PROMPTS, num_samples)
    if not chosen:
        raise ValueError("prompts is empty: pass at least one prompt (or leave it out for the built-in ones)")
    return chosen


def _cycle(values, n: int) -> list:
    if n < 1:
        raise ValueError(f"num_samples must be at least 1; got {n}")
    return [values[i % len(values)] for i in range(n)]


def _as_tensor(sample) -> torch.Tensor:
    """A pipeline's (H, W, C) image or (F, H, W, C) frames as float64 (C, H, W) / (F, C, H, W) in [0, 1]."""
    return torch.from_numpy(np.asarray(sample, dtype=np.float64)).movedim(-1, -3).clamp(0, 1)


def sample_grid(samples: torch.Tensor, label: str):
    """One labelled row of samples as a PIL image (videos: their first frames)."""
    return _grid([samples[:, 0] if samples.ndim == 5 else samples], [label])


def _write(ref_samples: torch.Tensor, model_samples: torch.Tensor, out_dir: Path, *, video: bool) -> None:
    if not video:
        grid = _grid([ref_samples, model_samples])
        write_file_atomically(out_dir / "samples.png", grid.save)
        return
    import imageio.v2 as imageio

    frames = [_grid([ref_samples[:, f], model_samples[:, f]]) for f in range(ref_samples.shape[1])]
    write_file_atomically(out_dir / "samples.png", frames[0].save)
    # even width and height (yuv420p) by construction, so no resizing to 16-pixel blocks
    write_file_atomically(out_dir / "samples.mp4", lambda path: imageio.mimwrite(
        path, [np.asarray(f) for f in frames], fps=VIDEO_FPS, macro_block_size=1))


def _grid(rows: list[torch.Tensor], labels=None):
    """One row of (N, C, H, W) images per label (default LABELS), each row named in a strip on its left."""
    from PIL import Image, ImageDraw

    n, _, h, w = rows[0].shape
    canvas = Image.new("RGB", (LABEL_WIDTH + PAD + n * (w + PAD), PAD + len(rows) * (h + PAD)), "white")
    draw = ImageDraw.Draw(canvas)
    for r, (label, images) in enumerate(zip(labels or LABELS, rows)):
        top = PAD + r * (h + PAD)
        draw.text((PAD, top), label, fill="black")
        pixels = (images.movedim(1, -1) * 255).round().to(torch.uint8).numpy()
        for i, image in enumerate(pixels):
            canvas.paste(Image.fromarray(image), (LABEL_WIDTH + PAD + i * (w + PAD), top))
    return canvas
