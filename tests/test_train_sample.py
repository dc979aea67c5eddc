"""Sampling from converted checkpoints with each family's pipeline on tiny local components, and
the whole demo pipeline (convert → transfer → fine-tune → save → reload → sample)."""

import imageio.v2 as imageio
import numpy as np
import pytest
import typer
from PIL import Image
from typer.testing import CliRunner

import mhla_convert
from mhla_convert.train.commands import register
from mhla_convert.train.demo import run_pipeline_demo
from mhla_convert.train.metrics import read_metrics

BLOCKS = {"wan": "1x2x2"}


def _cli():
    app = typer.Typer()
    register(app)
    return app


def _checkpoint(name: str, path, blocks: str | None = "1x2x2"):
    model = mhla_convert.tiny_model(name)
    mhla_convert.convert(model, blocks=blocks)
    mhla_convert.save_pretrained(model, path)
    return path


def test_sample_i2v_from_a_first_frame(tmp_path):
    ckpt = _checkpoint("tiny-wan-i2v", tmp_path / "ckpt")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 80, 3), dtype=np.uint8)).save(tmp_path / "first.png")
    out = tmp_path / "clip.mp4"
    args = [
        "sample", str(ckpt), "--prompt", "a red cube", "--image", str(tmp_path / "first.png"), "--out", str(out),
        "--steps", "2",
    ]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    assert imageio.get_reader(out).count_frames() == 5


@pytest.mark.parametrize("name, image, message", [("tiny-wan-i2v", False, "pass the first frame with --image"),
                                                  ("tiny-wan", True, "--image is for Wan image-to-video checkpoints")])
def test_sample_refuses_a_wrong_image_option_in_one_line(name, image, message, tmp_path):
    ckpt = _checkpoint(name, tmp_path / "ckpt")
    Image.new("RGB", (64, 64)).save(tmp_path / "first.png")
    extra = ["--image", str(tmp_path / "first.png")] if image else []
    result = CliRunner().invoke(_cli(), ["sample", str(ckpt), "--out", str(tmp_path / "x.mp4"), *extra])
    assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1


def test_sample_refuses_a_missing_checkpoint_in_one_line(tmp_path):
    result = CliRunner().invoke(_cli(), ["sample", str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")])
    assert (
        result.exit_code == 2
        and result.output.startswith("error: cannot load checkpoint")
        and result.output.count("\n") == 1
    )


def test_pipeline_demo(tmp_path, capsys):
    run = run_pipeline_demo(tmp_path / "demo")
    losses = [r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["stage"] == "finetune"]
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5])
    assert (run / "sample.mp4").exists() and (run / "model" / "mhla_config.json").exists()
    assert "finetune loss:" in capsys.readouterr().out
