"""`mhla-convert sample`: the family's own sampling (`FamilyAdapter.sample`): its diffusers pipeline
around a converted transformer (PNG, or MP4 for Wan: WanPipeline, or WanImageToVideoPipeline from a
first frame for I2V models), or `generate` for LMs. The other components come from the base model
recorded in mhla_config.json, or are the tiny in-process ones for built-in tiny models. A LoRA
adapter (PEFT's layout, as a `merge: false` run saves it) is merged in first when given."""

from __future__ import annotations

from pathlib import Path

import torch

from ..families import adapter_for_family
from .errors import TrainError
from .lora import load_adapter


def _load(checkpoint: Path, device, subfolder: str | None = None):
    from .. import from_pretrained
    from ..io import read_mhla_config

    if subfolder is not None:
        if not (checkpoint / subfolder).is_dir():
            raise TrainError(f"{checkpoint} has no subfolder {subfolder!r}: check --subfolder")
        checkpoint = checkpoint / subfolder
    try:
        meta = read_mhla_config(checkpoint)
        model = from_pretrained(checkpoint, device=device)
    except (OSError, ValueError) as exc:
        raise TrainError(f"cannot load checkpoint {checkpoint}: {str(exc).splitlines()[0]}") from None
    return meta, model.eval()


@torch.no_grad()
def sample(checkpoint, prompt: str, out, *, class_label: int = 0, steps: int = 20, guidance_scale: float | None = None,
           height: int | None = None, width: int | None = None, num_frames: int | None = None, max_new_tokens: int = 32,
           seed: int = 0, device: str | None = None, image=None, lora_adapter=None,
           subfolder: str | None = None) -> Path:
    out = Path(out)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    meta, model = _load(Path(checkpoint), device, subfolder)
    if lora_adapter is not None:
        model = load_adapter(model, lora_adapter)
    adapter = adapter_for_family(meta["family"])
    first_frame = _first_frame(image, i2v=adapter.takes_first_frame(model))
    out.parent.mkdir(parents=True, exist_ok=True)
    result = adapter.sample(model, meta.get("base_model"), prompt, device=device, seed=seed, steps=steps,
                            guidance_scale=guidance_scale, class_label=class_label, height=height, width=width,
                            num_frames=num_frames, max_new_tokens=max_new_tokens, image=first_frame)
    if adapter.sample_kind == "text":
        out.write_text(result + "\n")
        print(result)
        return out
    if adapter.sample_kind == "video":
        return _write_video(result, out)
    result.save(out if out.suffix else out.with_suffix(".png"))
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
