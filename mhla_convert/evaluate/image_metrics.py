"""PSNR and SSIM between two batches of images or videos with values in [0, 1], in float64; and,
from local weights only, FID (through torchmetrics) and CLIP score (through transformers).

Shapes: (N, C, H, W) for images, (N, F, C, H, W) for videos. PSNR and SSIM return one value per
sample, shape (N,)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

WINDOW = 11
SIGMA = 1.5
K1, K2 = 0.01, 0.03


def _pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape != y.shape:
        raise ValueError(f"images to compare must have one shape; got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.dim() < 4:
        raise ValueError(f"expected (N, C, H, W) images or (N, F, C, H, W) videos; got shape {tuple(x.shape)}")
    return x.to(torch.float64), y.to(torch.float64)


def psnr(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB per sample, from the mean squared error over all of the
    sample's pixels (all frames of a video); +inf for identical samples."""
    x, y = _pair(x, y)
    mse = (x - y).square().flatten(1).mean(1)
    return 10 * torch.log10(data_range**2 / mse)  # mse == 0 gives +inf


def gaussian_window(size: int, sigma: float = SIGMA) -> torch.Tensor:
    """The normalised 2-D Gaussian window (size × size), in float64."""
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-coords.square() / (2 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g)


def ssim(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Structural similarity per sample (Wang et al. 2004): local statistics under an 11×11 Gaussian
    window (sigma 1.5), K1 = 0.01, K2 = 0.03, the SSIM map over the positions where the window fits
    inside the image ('valid', as in the authors' reference code), averaged over pixels, channels
    and frames. Images smaller than 11 pixels on a side use a window as large as the image's
    shorter side (same sigma), so tiny-model samples get a value as well. In [-1, 1]; 1 only for
    identical images."""
    x, y = _pair(x, y)
    lead, (c, h, w) = x.shape[:-3], x.shape[-3:]
    size = min(WINDOW, h, w)
    kernel = gaussian_window(size).to(x.device).expand(c, 1, size, size)
    x, y = x.reshape(-1, c, h, w), y.reshape(-1, c, h, w)

    def local_mean(t):
        return F.conv2d(t, kernel, groups=c)

    mu_x, mu_y = local_mean(x), local_mean(y)
    var_x = local_mean(x * x) - mu_x.square()
    var_y = local_mean(y * y) - mu_y.square()
    cov = local_mean(x * y) - mu_x * mu_y
    c1, c2 = (K1 * data_range) ** 2, (K2 * data_range) ** 2
    ssim_map = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x.square() + mu_y.square() + c1) * (var_x + var_y + c2))
    per_image = ssim_map.flatten(1).mean(1)
    return per_image.reshape(lead[0], -1).mean(1)


# Optional learned metrics, only from local weights: nothing is downloaded.

def resolve_fid_weights(path: str | Path | None) -> Path | None:
    """The local FID Inception weights file (pt_inception-2015-12-05-6726825d.pth), checked along with
    the packages FID needs; None: no FID."""
    if path is None:
        return None
    missing = [name for name in ("torchmetrics", "torch_fidelity") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"FID needs {' and '.join(missing)}: pip install 'torchmetrics[image]'")
    if not Path(path).is_file():
        raise ValueError(f"fid_weights {path} is not a file: pass the local FID Inception weights "
                         "(pt_inception-2015-12-05-6726825d.pth)")
    return Path(path)


def resolve_clip_model(name_or_path: str | Path | None) -> str | None:
    """A local CLIP model directory, or the cached snapshot of a hub id; None: no CLIP score."""
    if name_or_path is None:
        return None
    if Path(name_or_path).is_dir():
        return str(name_or_path)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(str(name_or_path), local_files_only=True)
    except (OSError, ValueError):  # not in the cache, or not a repo id
        raise ValueError(f"clip_model {name_or_path!r} is neither a local directory nor a model in the local "
                         "Hugging Face cache") from None


def fid(images: torch.Tensor, reference: torch.Tensor, weights: Path) -> float:
    """Fréchet Inception distance of (N, 3, H, W) [0, 1] images to the reference images (N >= 2 each)."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    metric = FrechetInceptionDistance(feature=2048, normalize=True, feature_extractor_weights_path=str(weights))
    metric.update(reference.float().cpu(), real=True)
    metric.update(images.float().cpu(), real=False)
    return metric.compute().item()


def clip_score(images: torch.Tensor, prompts: list[str], model: str) -> float:
    """CLIP score (Hessel et al. 2021, as torchmetrics defines it: 100 × max(cosine similarity, 0),
    averaged) of (N, 3, H, W) [0, 1] images to their prompts, with the CLIP model in directory `model`.
    Computed with transformers' CLIPModel directly: torchmetrics' CLIPScore expects the tensors that
    `get_image_features` returned before transformers 5."""
    from transformers import CLIPModel, CLIPProcessor

    clip, processor = CLIPModel.from_pretrained(model).eval(), CLIPProcessor.from_pretrained(model)
    pixels = list((images.movedim(1, -1) * 255).round().to(torch.uint8).cpu().numpy())
    inputs = processor(text=list(prompts), images=pixels, return_tensors="pt", padding=True, truncation=True)
    with torch.no_grad():
        out = clip(**inputs)
    cosine = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds, dim=-1)
    return (100 * cosine.clamp(min=0)).mean().item()
