"""`mhla-convert sample`: the family's own sampling (`FamilyAdapter.sample`): its diffusers pipeline
around a converted transformer (PNG, or MP4 for Wan: WanPipeline, or WanImageToVideoPipeline from a
first frame for I2V models), or `generate` for LMs. The checkpoint is a directory or a hub id (offline: from
the local cache). The other components are the checkpoint's own (an LM's tokenizer, a pipeline's parts) where it
has them, else come from the base model recorded in mhla_config.json, or are the tiny in-process ones for
built-in tiny models. A LoRA adapter (PEFT's layout, as a `merge: false` run saves it) is merged in first when
given. A model whose outputs are inf/NaN (a diverged one) is refused before anything is written."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..families import adapter_for_family
from ..finite import watch_outputs
from ..io import check_writable, local_checkpoint, resolve_saved, write_file_atomically
from ..locations import components_of
from ..ops.blocks import whole_number
from ..placement import check_device
from .errors import TrainError
from .lora import load_adapter, read_adapter

DEFAULT_PROMPT = "a photo of a cat"
SUFFIXES = {"image": (".png", ".jpg", ".jpeg", ".webp"), "video": (".mp4",), "text": (".txt",)}


def _checkpoint_files(checkpoint, subfolder: str | None) -> Path:
    """The folder holding the checkpoint's files: a local one (in `subfolder`, or a pipeline's transformer/), or a
    hub id's, from the Hub or, offline, the local cache."""
    local = resolve_saved(checkpoint)
    if subfolder is not None and local.is_dir() and not (local / subfolder).is_dir():
        raise TrainError(f"{local} has no subfolder {subfolder!r}: check --subfolder")
    try:
        return local_checkpoint(checkpoint, subfolder=subfolder)
    except (OSError, ValueError) as exc:
        raise TrainError(f"cannot load checkpoint {checkpoint}: {str(exc).splitlines()[0]}") from None


def _load(checkpoint, subfolder: str | None, device):
    from .. import from_pretrained

    try:  # by what was given: a hub pipeline's other parts then come from its repo
        model = from_pretrained(checkpoint, subfolder=subfolder, device=device)
    except (OSError, ValueError) as exc:
        raise TrainError(f"cannot load checkpoint {checkpoint}: {str(exc).splitlines()[0]}") from None
    return model.eval()


def _skeleton(checkpoint: Path):
    """The checkpoint's family adapter and its base model on the meta device
    (from config.json less the conversion record, which the base class does not take): enough to check the
    sampling options before any weights load."""
    from ..io import read_mhla_config
    from ..locations import read_json
    from ..models import meta_model

    try:
        meta = read_mhla_config(checkpoint)
        adapter = adapter_for_family(meta["family"])
        return adapter, meta_model(adapter, adapter.base_config(read_json(checkpoint / "config.json")))
    except (OSError, ValueError) as exc:
        raise TrainError(f"cannot load checkpoint {checkpoint}: {str(exc).splitlines()[0]}") from None


def _positive(**values) -> None:
    for name, value in values.items():
        if value is not None and (whole_number(value) is None or value < 1):
            raise TrainError(f"--{name.replace('_', '-')} must be a whole number ≥ 1; got {value!r}")


def check_sample_options(adapter, skeleton, out: Path, *, prompt, class_label, steps, guidance_scale, height, width,
                         num_frames, max_new_tokens, device, seed: int = 0) -> None:
    """Refuse sampling options the checkpoint cannot honour (one-line TrainError), before it loads."""
    _positive(steps=steps, height=height, width=width, num_frames=num_frames, max_new_tokens=max_new_tokens)
    if whole_number(seed) is None or seed < 0:
        raise TrainError(f"--seed must be a whole number ≥ 0; got {seed!r}")
    if prompt is not None and not prompt.strip():
        raise TrainError(f"--prompt is empty: give some text, or leave --prompt out for {DEFAULT_PROMPT!r}")
    try:
        check_writable(out)
    except ValueError as exc:
        raise TrainError(f"--out: {exc}") from None
    if guidance_scale is not None and not (guidance_scale >= 0 and math.isfinite(guidance_scale)):
        raise TrainError(f"--guidance-scale must be a finite number ≥ 0; got {guidance_scale}")
    try:
        check_device(device)
    except ValueError as exc:
        raise TrainError(f"--device: {exc}") from None
    allowed = SUFFIXES[adapter.sample_kind]
    if out.suffix and out.suffix.lower() not in allowed:
        raise TrainError(f"--out {out}: a {adapter.name} checkpoint samples {adapter.sample_kind}; "
                         f"name the file {' or '.join(allowed)}")
    classes = getattr(adapter, "num_classes", lambda model: None)(skeleton)
    if classes is None and class_label is not None:
        raise TrainError(f"--class-label is for class-conditional checkpoints (DiT); this {adapter.name} checkpoint "
                         "takes --prompt")
    if classes is not None and prompt is not None:
        raise TrainError(f"this {adapter.name} checkpoint is class-conditional: it draws --class-label N "
                         f"(0 … {classes - 1}), not --prompt")
    if class_label is not None and (whole_number(class_label) is None or not 0 <= class_label < classes):
        raise TrainError(f"--class-label must be a class of this checkpoint, 0 … {classes - 1}; got {class_label!r}")
    null = getattr(adapter, "null_class", None)  # the class label a class-conditional pipeline guides with
    if null is not None and classes is not None and classes < null and (guidance_scale or 0) > 1:
        raise TrainError(f"--guidance-scale {guidance_scale}: the pipeline guides with class {null} as its null class, "
                         f"which this {classes}-class checkpoint lacks; use --guidance-scale 1 (no guidance)")
    if num_frames is not None and adapter.sample_kind != "video":
        raise TrainError(f"--num-frames is for video checkpoints (Wan); this {adapter.name} checkpoint samples "
                         f"{adapter.sample_kind}")
    if num_frames is not None and num_frames % 4 != 1:
        raise TrainError(f"--num-frames must be 4k+1 (1, 5, 9, …, 81): Wan's VAE packs 4 frames per latent; "
                         f"got {num_frames}")


@torch.no_grad()
def sample(checkpoint, prompt: str | None, out, *, class_label: int | None = None, steps: int = 20,
           guidance_scale: float | None = None, height: int | None = None, width: int | None = None,
           num_frames: int | None = None, max_new_tokens: int = 32, seed: int = 0, device: str | None = None,
           image=None, lora_adapter=None, force: bool = False, subfolder: str | None = None) -> Path:
    """`prompt` None: a default prompt (text-conditional families); class-conditional ones take
    `class_label` (default 0) instead. `lora_adapter`: a PEFT adapter folder merged in first (one trained on
    another model of the same shapes only with `force`)."""
    out = Path(out)
    adapter, skeleton = _skeleton(_checkpoint_files(checkpoint, subfolder))
    check_sample_options(adapter, skeleton, out, prompt=prompt, class_label=class_label, steps=steps,
                         guidance_scale=guidance_scale, height=height, width=width, num_frames=num_frames,
                         max_new_tokens=max_new_tokens, device=device, seed=seed)
    first_frame = _first_frame(image, i2v=adapter.takes_first_frame(skeleton))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if lora_adapter is not None:
        read_adapter(Path(resolve_saved(lora_adapter)))  # a damaged adapter is refused before the model loads
    model = _load(checkpoint, subfolder, device)
    if lora_adapter is not None:
        model = load_adapter(model, resolve_saved(lora_adapter), force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    with watch_outputs(model) as watch:
        try:
            result = adapter.sample(model, components_of(model), DEFAULT_PROMPT if prompt is None else prompt,
                                    device=device, seed=seed, steps=steps, guidance_scale=guidance_scale,
                                    class_label=class_label or 0, height=height, width=width, num_frames=num_frames,
                                    max_new_tokens=max_new_tokens, image=first_frame)
        except (RuntimeError, ValueError):  # what a pipeline may make of inf/NaN (sampling from NaN probabilities)
            if watch.finite:
                raise
    if not watch.finite:
        with_adapter = f" with the adapter {lora_adapter}" if lora_adapter is not None else ""
        raise TrainError(f"{checkpoint}{with_adapter} gives inf/NaN outputs, so there is no sample to write: the "
                         "model has diverged; sample an earlier checkpoint, or train again with a lower learning rate")
    try:
        return _write(adapter.sample_kind, result, out)
    except OSError as exc:  # a full disk, a quota, a folder gone meanwhile
        raise TrainError(f"cannot write {out}: {exc.strerror or exc}; free space there or give another --out") from None


def _write(kind: str, result, out: Path) -> Path:
    if kind == "text":
        out = write_file_atomically(out if out.suffix else out.with_suffix(".txt"), lambda path: path.write_text(
            result + "\n"))
        print(result)
        return out
    if kind == "video":
        return _write_video(result, out)
    return write_file_atomically(out if out.suffix else out.with_suffix(".png"), result.save)


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

    return write_file_atomically(out if out.suffix else out.with_suffix(".mp4"), lambda path: imageio.mimwrite(
        path, [(np.clip(f, 0, 1) * 255).astype("uint8") for f in frames], fps=fps))
