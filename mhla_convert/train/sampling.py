"""`mhla-convert sample`: the family's diffusers pipeline around a converted transformer (PNG, or
MP4 for Wan: WanPipeline, or WanImageToVideoPipeline from a first frame for I2V models), or
`generate` for LMs. The other components come from the base model recorded in mhla_config.json, or
are the tiny in-process ones for built-in tiny models."""

from __future__ import annotations

from pathlib import Path

import torch

from .components import is_i2v, is_tiny, pipeline, tokenizer
from .errors import TrainError

TINY_VIDEO = dict(height=64, width=64, num_frames=5)


def _load(checkpoint: Path, device):
    from .. import from_pretrained
    from ..io import read_mhla_config

    try:
        meta = read_mhla_config(checkpoint)
        model = from_pretrained(checkpoint, device=device)
    except (OSError, ValueError) as exc:
        raise TrainError(f"cannot load checkpoint {checkpoint}: {str(exc).splitlines()[0]}") from None
    return meta, model.eval()


@torch.no_grad()
def sample(checkpoint, prompt: str, out, *, class_label: int = 0, steps: int = 20, guidance_scale: float | None = None,
           height: int | None = None, width: int | None = None, num_frames: int | None = None, max_new_tokens: int = 32,
           seed: int = 0, device: str | None = None, image=None) -> Path:
    out = Path(out)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    meta, model = _load(Path(checkpoint), device)
    family, base = meta["family"], meta.get("base_model")
    first_frame = _first_frame(image, i2v=family == "wan" and is_i2v(model))
    out.parent.mkdir(parents=True, exist_ok=True)
    if family == "llama":
        tok = tokenizer(base)
        ids = tok(prompt, return_tensors="pt").to(device)
        generated = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(generated[0], skip_special_tokens=True)
        out.write_text(text + "\n")
        print(text)
        return out
    pipe = pipeline(family, model, base).to(device)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {"num_inference_steps": steps, "generator": torch.Generator(device).manual_seed(seed)}
    if guidance_scale is None and family == "dit" and is_tiny(base):
        guidance_scale = 1.0  # DiTPipeline's null class is hard-coded to 1000; tiny DiTs have fewer classes
    if guidance_scale is not None:
        kwargs["guidance_scale"] = guidance_scale
    if family == "dit":
        if model.config.out_channels is None:  # DiTPipeline reads it to split off a learned sigma
            model.register_to_config(out_channels=model.out_channels)
        image = pipe(class_labels=[class_label], **kwargs).images[0]
    elif family == "wan":
        size = TINY_VIDEO if is_tiny(base) else {}
        size = {**size, **{k: v for k, v in (("height", height), ("width", width), ("num_frames", num_frames)) if v is not None}}
        if first_frame is not None:
            kwargs["image"] = first_frame
        frames = pipe(prompt=prompt, output_type="np", **size, **kwargs).frames[0]
        return _write_video(frames, out)
    else:
        if is_tiny(base):  # the pipelines default to their real resolutions (and want multiples of 32)
            native = -(-model.config.sample_size * pipe.vae_scale_factor // 32) * 32
            height, width = height or native, width or native
        size = {k: v for k, v in (("height", height), ("width", width)) if v is not None}
        image = pipe(prompt=prompt, use_resolution_binning=not is_tiny(base), **size, **kwargs).images[0]
    image.save(out if out.suffix else out.with_suffix(".png"))
    return out


def _first_frame(image, *, i2v: bool):
    """The I2V first frame as RGB; refused before any pipeline loads when it is missing or unused."""
    if i2v and image is None:
        raise TrainError("this is a Wan image-to-video checkpoint: pass the first frame with --image FIRST_FRAME.png")
    if image is None:
        return None
    if not i2v:
        raise TrainError("--image is for Wan image-to-video checkpoints; this one generates from the prompt alone")
    from PIL import Image

    try:
        return Image.open(image).convert("RGB")
    except OSError as exc:
        raise TrainError(f"cannot read the first frame {image}: {str(exc).splitlines()[0]}") from None


def _write_video(frames, out: Path, fps: int = 16) -> Path:
    import imageio.v2 as imageio
    import numpy as np

    out = out if out.suffix else out.with_suffix(".mp4")
    imageio.mimwrite(out, [(np.clip(f, 0, 1) * 255).astype("uint8") for f in frames], fps=fps)
    return out
