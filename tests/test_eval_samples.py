"""Side-by-side samples of a model and its reference (`mhla-convert eval`): PSNR / SSIM against
hand-computed values and a direct SSIM, and the sample grids of each diffusion family on tiny models."""

import math

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from PIL import Image

import mhla_convert
from mhla_convert.evaluate.image_metrics import K1, K2, gaussian_window, psnr, ssim
from mhla_convert.evaluate.samples import LABEL_WIDTH, PAD, compare_samples


def _images(seed, shape=(2, 3, 16, 16)):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _direct_ssim(x, y, size):
    """SSIM of one (C, H, W) pair, window by window with explicit weighted sums."""
    w = gaussian_window(size).numpy()
    x, y = x.numpy(), y.numpy()
    c1, c2 = K1**2, K2**2
    values = []
    for ch in range(x.shape[0]):
        for i in range(x.shape[1] - size + 1):
            for j in range(x.shape[2] - size + 1):
                a, b = x[ch, i:i + size, j:j + size], y[ch, i:i + size, j:j + size]
                ma, mb = (w * a).sum(), (w * b).sum()
                va, vb = (w * (a - ma) ** 2).sum(), (w * (b - mb) ** 2).sum()
                cov = (w * (a - ma) * (b - mb)).sum()
                values.append((2 * ma * mb + c1) * (2 * cov + c2) / ((ma**2 + mb**2 + c1) * (va + vb + c2)))
    return float(np.mean(values))


def test_identical_images_give_infinite_psnr_and_ssim_one():
    x = _images(0)
    assert torch.isinf(psnr(x, x)).all() and (psnr(x, x) > 0).all()
    assert torch.allclose(ssim(x, x), torch.ones(2, dtype=torch.float64))


def test_psnr_of_a_known_mse():
    x = torch.zeros(1, 3, 8, 8)
    assert psnr(x, x + 0.1).item() == pytest.approx(20.0)  # mse 0.01
    assert psnr(x, x + 0.5).item() == pytest.approx(10 * math.log10(4))


def test_ssim_of_constant_images_is_the_luminance_term():
    x = torch.zeros(1, 3, 12, 12)
    c1 = K1**2
    assert ssim(x, x + 0.2).item() == pytest.approx(c1 / (0.2**2 + c1))


@pytest.mark.parametrize("shape, size", [((2, 3, 16, 16), 11), ((1, 3, 6, 9), 6)])
def test_ssim_matches_a_direct_implementation(shape, size):
    x, y = _images(1, shape), _images(2, shape)
    y = 0.6 * x + 0.4 * y  # correlated, so SSIM is far from 0
    got = ssim(x, y)
    for n in range(shape[0]):
        assert got[n].item() == pytest.approx(_direct_ssim(x[n], y[n], size), abs=1e-12)


def test_metrics_are_symmetric_and_ssim_in_range():
    x, y = _images(3), _images(4)
    assert torch.equal(psnr(x, y), psnr(y, x))
    assert torch.allclose(ssim(x, y), ssim(y, x), atol=1e-15)
    anti = ssim(x, 1 - x)
    assert (anti < 0).all() and (anti >= -1).all() and (ssim(x, y) <= 1).all()


def test_video_ssim_averages_over_frames():
    x, y = _images(5, (2, 3, 3, 12, 12)), _images(6, (2, 3, 3, 12, 12))
    per_frame = torch.stack([ssim(x[:, f], y[:, f]) for f in range(3)], 1)
    assert torch.allclose(ssim(x, y), per_frame.mean(1))
    assert psnr(x, y).shape == (2,)


def test_mismatched_shapes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="one shape"):
        psnr(torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 9))


# Sample grids of each diffusion family on tiny models (1 step, 1-2 samples).

BLOCKS = {"wan": "1x2x2"}


def _pair(family):
    reference, model = mhla_convert.tiny_model(f"tiny-{family}"), mhla_convert.tiny_model(f"tiny-{family}")
    mhla_convert.convert(model, ratio=1.0, blocks=BLOCKS.get(family))
    return model, reference


def _compare(model, reference, family, out_dir, num_samples=2, **kwargs):
    return compare_samples(model, reference, family=family, out_dir=out_dir, num_samples=num_samples, steps=1,
                           device="cpu", **kwargs)


def _grid_size(n, side):
    return LABEL_WIDTH + PAD + n * (side + PAD), PAD + 2 * (side + PAD)


@pytest.mark.parametrize("family", ["dit", "sana", "pixart", "wan"])
def test_a_model_against_itself_matches_exactly(family, tmp_path):
    reference = mhla_convert.tiny_model(f"tiny-{family}")
    assert _compare(reference, reference, family, tmp_path, num_samples=1) == {"psnr": math.inf, "ssim": 1.0}


@pytest.mark.parametrize("family, side", [("dit", 32), ("sana", 32), ("pixart", 32), ("wan", 64)])
def test_converted_model_against_its_base(family, side, tmp_path):
    metrics = _compare(*_pair(family), family, tmp_path)
    assert set(metrics) == {"psnr", "ssim"}
    assert math.isfinite(metrics["psnr"]) and metrics["psnr"] > 0 and -1 <= metrics["ssim"] < 1
    assert Image.open(tmp_path / "samples.png").size == _grid_size(2, side)
    if family == "wan":
        reader = imageio.get_reader(tmp_path / "samples.mp4")
        assert reader.count_frames() == 5 and tuple(reader.get_meta_data()["size"]) == _grid_size(2, side)


def test_two_calls_give_identical_samples_and_metrics(tmp_path):
    model, reference = _pair("dit")
    first = _compare(model, reference, "dit", tmp_path / "a", class_labels=[3, 3])
    second = _compare(model, reference, "dit", tmp_path / "b", class_labels=[3, 3])
    assert first == second
    assert (tmp_path / "a" / "samples.png").read_bytes() == (tmp_path / "b" / "samples.png").read_bytes()
    grid = np.asarray(Image.open(tmp_path / "a" / "samples.png"))
    tile = [grid[PAD:PAD + 32, LABEL_WIDTH + PAD + i * 34:LABEL_WIDTH + PAD + i * 34 + 32] for i in range(2)]
    assert not np.array_equal(tile[0], tile[1])  # same class, seed + i: different noise per sample


@pytest.mark.parametrize("family, kwargs, message", [
    ("llama", {}, "diffusion families"),
    ("dit", {"prompts": ["a cat"]}, "pass class_labels"),
    ("dit", {"class_labels": [1000]}, r"classes in \[0, 1000\)"),
    ("sana", {"class_labels": [1]}, "pass prompts"),
    ("sana", {"prompts": []}, "prompts is empty"),
    ("sana", {"fid_weights": "/nonexistent/inception.pth"}, "fid_weights|FID needs"),
    ("sana", {"fid_weights": "/nonexistent/inception.pth", "prompts": ["a cat"]}, "at least 2"),
    ("sana", {"clip_model": "/nonexistent/clip"}, "neither a local directory nor a model in the local"),
    ("dit", {"clip_model": "/nonexistent/clip"}, "class-conditional"),
])
def test_bad_requests_are_refused_in_one_line(family, kwargs, message, tmp_path):
    reference = mhla_convert.tiny_model("tiny-dit" if family == "llama" else f"tiny-{family}")
    with pytest.raises(ValueError, match=message) as error:
        _compare(reference, reference, family, tmp_path, **kwargs)
    assert "\n" not in str(error.value) and not (tmp_path / "samples.png").exists()


def test_wan_image_to_video_is_refused_in_one_line(tmp_path):
    reference = mhla_convert.tiny_model("tiny-wan-i2v")
    with pytest.raises(ValueError, match="need a first frame"):
        _compare(reference, reference, "wan", tmp_path)


def _tiny_clip(path):
    """A random 1-layer CLIP at 32 px with a character-level tokenizer, saved to `path`."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, PreTrainedTokenizerFast

    letters = {c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ,.-")}
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, **letters}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    torch.manual_seed(0)
    text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=128)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).save_pretrained(path)
    image_processor = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)
    image_processor = image_processor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    return path


def test_clip_score_from_a_local_clip_model(tmp_path):
    reference = mhla_convert.tiny_model("tiny-sana")
    clip = _tiny_clip(tmp_path / "clip")
    metrics = _compare(reference, reference, "sana", tmp_path / "out", clip_model=clip)
    assert set(metrics) == {"psnr", "ssim", "clip_score", "clip_score_reference"}
    assert 0 <= metrics["clip_score"] <= 100 and metrics["clip_score"] == metrics["clip_score_reference"]
