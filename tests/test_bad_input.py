"""Bad input at every entry point is refused with one line naming the problem: exit code 2 and no
traceback on the command line, a ValueError (or the training / evaluation error type) in Python, and
nothing written where the output would have gone. Most cases are refused before any model loads;
the checkpoints the sampling and damaged-file cases need are built once per module."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import mhla_convert
from mhla_convert import convert, mhla_attention, tiny_model
from mhla_convert.cli import app
from mhla_convert.families import adapter_for_family
from mhla_convert.ops.blocks import BlockLayout
from mhla_convert.train import TrainError

runner = CliRunner()
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line(result, *fragments, before_load: bool = True):
    """Exit code 2, exactly one `error:` line on stderr naming `fragments`, no traceback; with
    `before_load`, nothing at all on stdout (no "loading ..." step began)."""
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.output
    assert "Traceback" not in result.output
    if before_load:
        assert result.stdout == "", result.output
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


# --- convert: command line ------------------------------------------------------------------------

CONVERT_CLI = [
    (["tiny-dit", "--blocks", "99x99"], ["token grid 8x8", "at most 8x8"]),
    (["tiny-wan", "--blocks", "22x2x2"], ["token grid 21x30x50", "at most 21x30x50"]),
    (["tiny-dit", "--blocks", "2.5x2"], ["blocks must look like '4x4'"]),
    (["tiny-dit", "--blocks", "22"], ["blocks must have 2 axes for dit"]),
    (["tiny-dit", "--blocks", "0x4"], ["every blocks axis must be ≥ 1"]),
    (["tiny-llama", "--blocks", "4x4"], ["llama is causal"]),
    (["tiny-dit", "--layers", "1.7"], ["--layers must be comma-separated layer indices"]),
    (["tiny-dit", "--layers", "9"], ["layer indices [9] out of range", "6 layers"]),
    (["tiny-dit", "--layers", "-1"], ["whole numbers ≥ 0"]),
    (["tiny-dit", "--ratio", "nan"], ["ratio must be in [0, 1]"]),
    (["tiny-dit", "--ratio", "-0.5"], ["ratio must be in [0, 1]"]),
    (["tiny-dit", "--strategy", "best"], ["strategy must be one of"]),
    (["tiny-dit", "--attention", "softmax"], ["attention must be one of"]),
    (["tiny-dit", "--attention", "linear", "--blocks", "2x2"], ["attention='linear' is MHLA with one block"]),
    (["tiny-dit", "--mixing-init", "1.5"], ["mixing_init must be"]),
    (["tiny-dit", "--mixing-init", "local"], ["mixing_init must be", "'local'"]),
    (["tiny-dit", "--mixing-init", "nan"], ["mixing_init must be"]),
    (["tiny-dit", "--strategy", "auto"], ["needs calibration data"]),
    (["tiny-dit", "--attention", "linear", "--calibration", "synthetic"], ["--calibration ranks layers"]),
    (["tiny-dit", "--exact-radius", "none", "--calibration", "synthetic"], ["--calibration ranks layers"]),
    (["tiny-dit", "--exact-radius", "1.5"], ["--exact-radius must be a whole number"]),
    (["tiny-dit", "--strategy", "auto", "--calibration", "synthetic", "--fit-steps", "-1"], ["--fit-steps must be"]),
    (["tiny-dit", "--strategy", "auto", "--calibration", "synthetic", "--calibration-batches", "0"],
     ["--calibration-batches must be"]),
    (["tiny-dit", "--dtype", "fp8"], ["dtype must be one of"]),
]


@pytest.mark.parametrize("args, fragments", CONVERT_CLI, ids=[" ".join(a) for a, _ in CONVERT_CLI])
def test_convert_cli_refuses_before_loading(args, fragments, tmp_path):
    out = tmp_path / "out"
    assert_one_line(cli(*args, "--out", out), *fragments)
    assert not out.exists()


def test_convert_cli_refuses_an_output_dir_it_would_overwrite_before_loading(tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line(cli("tiny-dit", "--out", out), "is not an MHLA checkpoint")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


# --- convert: Python API --------------------------------------------------------------------------

CONVERT_API = [
    ("tiny-dit", dict(layers=[1.7]), "layers must be a list of layer indices"),
    ("tiny-dit", dict(layers="12"), "layers must be a list of layer indices"),
    ("tiny-dit", dict(layers=[True]), "layers must be a list of layer indices"),
    ("tiny-dit", dict(layers=[6]), "out of range"),
    ("tiny-dit", dict(blocks=(2.5, 2)), "blocks must be whole numbers"),
    ("tiny-dit", dict(blocks="22"), "blocks must have 2 axes"),
    ("tiny-dit", dict(blocks="4x4x4x4"), "blocks must look like"),
    ("tiny-dit", dict(blocks=(99, 99)), "at most 8x8"),
    ("tiny-dit", dict(blocks=(9, 2)), "at most 8x8"),
    ("tiny-dit", dict(blocks=(0, 4)), "every blocks axis must be ≥ 1"),
    ("tiny-dit", dict(eps=-1e-6), "eps must be a finite number > 0"),
    ("tiny-dit", dict(eps=0.0), "eps must be a finite number > 0"),
    ("tiny-dit", dict(eps=float("nan")), "eps must be a finite number > 0"),
    ("tiny-dit", dict(eps="1e-6"), "eps must be a finite number > 0"),
    ("tiny-dit", dict(scale=-1.0), "scale must be a finite number > 0"),
    ("tiny-dit", dict(scale=float("inf")), "scale must be a finite number > 0"),
    ("tiny-dit", dict(feature_map="rleu"), "feature_map must be one of ['elu', 'hedgehog', 'relu']"),
    ("tiny-dit", dict(feature_map=["relu"]), "feature_map must be one of ['elu', 'hedgehog', 'relu'] or a callable"),
    ("tiny-dit", dict(backend="trtion"), "backend must be one of"),
    ("tiny-dit", dict(backend=None), "backend must be one of"),
    ("tiny-dit", dict(mixing_init=1.5), "mixing_init must be"),
    ("tiny-dit", dict(mixing_init="local"), "mixing_init must be"),
    ("tiny-dit", dict(mixing_init=True), "mixing_init must be"),
    ("tiny-dit", dict(normalize="yes"), "normalize must be true or false"),
    ("tiny-dit", dict(rope="after"), "rope must be"),
    ("tiny-dit", dict(per_head_mixing=1), "per_head_mixing must be true or false"),
    ("tiny-dit", dict(ratio=1.5), "ratio must be in [0, 1]"),
    ("tiny-dit", dict(ratio=True), "ratio must be in [0, 1]"),
    ("tiny-dit", dict(strategy="best"), "strategy must be one of"),
    ("tiny-dit", dict(attention="softmax"), "attention must be one of"),
    ("tiny-dit", dict(fit_steps=-1), "fit_steps must be a whole number ≥ 0"),
    ("tiny-dit", dict(calibration=[{}], exact_radius=None), "calibration data ranks layers for strategy 'auto'"),
    ("tiny-dit", dict(calibration=[{}]), "calibration batch 0 does not run through the model"),
    ("tiny-dit", dict(eps2=1.0), "unknown MHLA options ['eps2']"),
    ("tiny-dit", dict(causal=True), "unknown MHLA options ['causal']"),
    ("tiny-llama", dict(chunk_size=0), "chunk_size must be a whole number ≥ 1"),
    ("tiny-llama", dict(chunk_size=64.0), "chunk_size must be a whole number ≥ 1"),
    ("tiny-llama", dict(window=-1), "window must be a whole number ≥ 1"),
    ("tiny-llama", dict(blocks=(2,)), "llama is causal"),
    ("tiny-llama", dict(attention="linear", window=4), "attention='linear' is MHLA with window 1"),
    ("tiny-llama", dict(exact_chunks=8), "exact_chunks=8 must be < window=8 (llama's default)"),
    ("tiny-llama", dict(window=2), "exact_chunks=2 (llama's default) must be < window=2"),
    ("tiny-llama", dict(exact_radius=1), "exact_radius=1 is for non-causal models; llama is causal"),
    ("tiny-dit", dict(exact_chunks=1), "exact_chunks=1 is for causal models (LMs); dit is not causal"),
    ("tiny-dit", dict(normalize=False), "exact_radius=1 (dit's default) needs normalize=true"),
    ("tiny-dit", dict(text_exact=False), "text_exact=False is for joint text-image models (FLUX.1, Qwen-Image, "
                                         "HunyuanVideo), not dit; drop it"),
    ("tiny-llama", dict(text_exact=False), "text_exact=False is for joint text-image models"),
]


@pytest.mark.parametrize("name, options, message", CONVERT_API, ids=[f"{n}-{o}" for n, o, _ in CONVERT_API])
def test_convert_api_refuses_and_leaves_the_model_alone(name, options, message):
    model = tiny_model(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        convert(model, **options)
    assert not getattr(model, "mhla_plan", None) and not mhla_convert.mhla_layers(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("options, message", [
    (dict(blocks="22"), "blocks must be whole numbers"),
    (dict(blocks=(4.0, 4)), "blocks must be whole numbers"),
    (dict(window=2.5), "window must be a whole number"),
    (dict(output_norm="no"), "output_norm must be true or false"),
])
def test_layer_config_refuses_what_it_would_truncate(options, message):
    with pytest.raises(ValueError, match=message):
        mhla_convert.MHLAConfig(**options)


def test_converting_twice_is_refused():
    model = tiny_model("tiny-dit")
    convert(model, ratio=0.5)
    with pytest.raises(ValueError, match="already converted"):
        convert(model, ratio=1.0)


# --- recipes and the finetune command ------------------------------------------------------------

RECIPE = """\
model: {name: tiny-dit}
conversion: {ratio: 1.0}
data: {kind: synthetic, num_samples: 8, batch_size: 2}
stages: [{name: finetune, steps: 1}]
logging: {trackers: []}
"""

RECIPE_SETS = [
    ("conversion.blocks=99x99", ["conversion: blocks 99x99 do not fit", "at most 8x8"]),
    ("conversion.blocks=[2.5, 2]", ["conversion.blocks[0]: expected an integer"]),
    ("conversion.blocks=22", ["conversion.blocks: expected a string or a list of an integer or null; got 22"]),
    ("conversion.blocks=2x", ["conversion.blocks: blocks must look like"]),
    ("conversion.blocks=[4, 4, 4]", ["conversion: blocks must have 2 axes"]),
    ("conversion.layers=[1.7]", ["conversion.layers[0]: expected an integer; got 1.7"]),
    ("conversion.layers=[-1]", ["conversion.layers: layers must be a list of layer indices"]),
    ("conversion.layers=[9]", ["conversion: layer indices [9] out of range"]),
    ("conversion.ratio=2", ["conversion.ratio: must be in [0, 1]"]),
    ("conversion.attention=softmax", ["conversion.attention: expected one of 'mhla', 'linear'"]),
    ("conversion.options.eps=-1.0", ["conversion.options.eps: eps must be a finite number > 0"]),
    ("conversion.options.scale=0", ["conversion.options.scale: scale must be a finite number > 0"]),
    ("conversion.options.feature_map=rleu", ["conversion.options.feature_map: feature_map must be one of"]),
    ("conversion.options.backend=trtion", ["conversion.options.backend: backend must be one of"]),
    ("conversion.options.mixing_init=2", ["conversion.options.mixing_init: mixing_init must be"]),
    ("conversion.options.chunk_size=0", ["conversion.options.chunk_size: chunk_size must be a whole number"]),
    ("conversion.options.causal=true", ["conversion.options.causal: unknown MHLA option"]),
    ("optimizer.lr=0", ["optimizer.lr: must be a finite number > 0"]),
    ("schedule.warmup_steps=-1", ["schedule.warmup_steps: must be ≥ 0"]),
    ("objective.flow_shift=-3.0", ["objective.flow_shift: must be a finite number > 0"]),
    ("model.family=ditt", ["model.family: unknown family 'ditt'"]),
    ("data.height=0", ["data.height: must be ≥ 1; got 0"]),
    ("data.latent_size=[8]", ["data.latent_size: give the latent height and width"]),
    ("data.num_workers=-1", ["data.num_workers: must be ≥ 0"]),
    ("seed=-1", ["seed: must be ≥ 0; got -1"]),
    ("objective.num_train_timesteps=0", ["objective.num_train_timesteps: must be ≥ 1"]),
    ("push_to_hub={repo_id: 'my model!!'}", ["push_to_hub.repo_id: not a Hub repo id", "you/model-mhla"]),
]


@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    return path


@pytest.mark.parametrize("override, fragments", RECIPE_SETS, ids=[s for s, _ in RECIPE_SETS])
def test_finetune_refuses_bad_recipe_values(override, fragments, recipe_file, tmp_path):
    out = tmp_path / "run"
    assert_one_line(cli("finetune", recipe_file, "--out", out, "--set", override), *fragments)
    assert not out.exists()


def _image_folder(root, rows):
    root.mkdir()
    for i in range(2):
        Image.fromarray(np.full((32, 32, 3), 40 * i, dtype=np.uint8)).save(root / f"img{i}.png")
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    (root / "metadata.jsonl").write_text("".join(line + "\n" for line in rows))
    return root


GOOD_LINE = '{"file_name": "img0.png", "label": 1}'
FOLDERS = [
    ([GOOD_LINE, '{"file_name": "img1.png", "label": 3'], "metadata.jsonl:2: not valid JSON"),
    ([GOOD_LINE, '["img1.png", 3]'], "metadata.jsonl:2: every line needs a file_name"),
    ([GOOD_LINE, '{"file_name": "img9.png", "label": 3}'], "metadata.jsonl:2: every line needs a file_name"),
    ([GOOD_LINE, '{"file_name": "img1.png", "label": 1000}'],
     'metadata.jsonl:2: "label" must be a class label 0 … 999'),
    (['{"file_name": "img1.png", "label": -1}'], 'metadata.jsonl:1: "label" must be a class label'),
    (['{"file_name": "img1.png", "label": 2.5}'], 'metadata.jsonl:1: "label" must be a class label'),
    ([GOOD_LINE, '{"file_name": "img1.png"}'], 'metadata.jsonl:2: "label" must be a class label'),
    ([GOOD_LINE, '{"file_name": "broken.png", "label": 2}'], "metadata.jsonl:2: cannot read"),
]


@pytest.mark.parametrize("rows, fragment", FOLDERS, ids=[f[1].split(": ", 1)[1][:28] + str(i)
                                                          for i, f in enumerate(FOLDERS)])
def test_finetune_refuses_bad_training_data_before_encoding(rows, fragment, recipe_file, tmp_path, monkeypatch):
    from mhla_convert.train import encode

    monkeypatch.setattr(encode, "encode_folder", lambda *a: pytest.fail("encoding started on bad data"))
    root = _image_folder(tmp_path / "data", rows)
    out = tmp_path / "run"
    result = cli("finetune", recipe_file, "--out", out, "--set", f"data={{kind: folder, path: {root}, height: 32, "
                 "width: 32}")
    assert_one_line(result, fragment, str(root / "metadata.jsonl"), before_load=False)
    assert not (root / ".mhla_cache").exists() and not (out / "model").exists()


def test_finetune_refuses_a_folder_size_the_vae_and_patches_cannot_tile(recipe_file, tmp_path, monkeypatch):
    from mhla_convert.families.diffusers_base import DiffusersAdapter

    monkeypatch.setattr(DiffusersAdapter, "encode_latents", lambda *a: pytest.fail("encoding began"))
    root = _image_folder(tmp_path / "data", [GOOD_LINE])
    result = cli("finetune", recipe_file, "--out", tmp_path / "run", "--set",
                 f"data={{kind: folder, path: {root}, height: 30, width: 32}}")
    assert_one_line(result, "data.height 30 must be a multiple of", "(the VAE's factor", "× the patch size 2)",
                    before_load=False)


# --- sample ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Converted tiny DiT, Llama and PixArt checkpoints, shared by the sampling and damaged-file cases."""
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for name in ("tiny-dit", "tiny-llama", "tiny-pixart"):
        model = tiny_model(name)
        convert(model, ratio=0.5)
        paths[name] = mhla_convert.save_pretrained(model, root / name)
    dit = adapter_for_family("dit")
    model = dit.build({**dit.tiny_config(), "num_embeds_ada_norm": 10})  # too few classes for DiTPipeline's guidance
    convert(model, ratio=0.5)
    paths["dit-10-classes"] = mhla_convert.save_pretrained(model, root / "dit-10-classes")
    return paths


SAMPLE = [
    ("tiny-dit", ["--class-label", "1000"], "png", ["--class-label must be a class of this checkpoint, 0 … 999"]),
    ("tiny-dit", ["--class-label", "-1"], "png", ["--class-label must be a class", "got -1"]),
    ("tiny-dit", ["--prompt", "class 207"], "png", ["class-conditional", "--class-label N (0 … 999), not --prompt"]),
    ("tiny-llama", ["--class-label", "3"], "txt", ["--class-label is for class-conditional checkpoints"]),
    ("tiny-dit", ["--steps", "0"], "png", ["--steps must be a whole number ≥ 1; got 0"]),
    ("tiny-dit", ["--steps", "-5"], "png", ["--steps must be a whole number ≥ 1"]),
    ("tiny-dit", [], "txt", ["a dit checkpoint samples image", ".png"]),
    ("tiny-llama", [], "png", ["a llama checkpoint samples text", ".txt"]),
    ("tiny-dit", [], "mp4", ["a dit checkpoint samples image"]),
    ("tiny-dit", ["--device", "gpu0"], "png", ["device must be like cpu, cuda or cuda:1"]),
    ("tiny-dit", ["--num-frames", "5"], "png", ["--num-frames is for video checkpoints"]),
    ("tiny-dit", ["--guidance-scale", "-1"], "png", ["--guidance-scale must be a finite number ≥ 0"]),
    ("tiny-dit", ["--guidance-scale", "nan"], "png", ["--guidance-scale must be a finite number ≥ 0"]),
    ("dit-10-classes", ["--guidance-scale", "4"], "png", ["--guidance-scale 4.0: the pipeline guides with class 1000",
                                                          "10-class checkpoint lacks", "use --guidance-scale 1"]),
    ("tiny-dit", ["--height", "0"], "png", ["--height must be a whole number ≥ 1"]),
    ("tiny-llama", ["--max-new-tokens", "0"], "txt", ["--max-new-tokens must be a whole number ≥ 1"]),
    ("tiny-dit", ["--seed", "-1"], "png", ["--seed must be a whole number ≥ 0; got -1"]),
    ("tiny-llama", ["--prompt", ""], "txt", ["--prompt is empty"]),
    ("tiny-pixart", ["--prompt", "  "], "png", ["--prompt is empty", "leave --prompt out"]),
]


@pytest.mark.parametrize("name, args, suffix, fragments", SAMPLE,
                         ids=[f"{n}{' '.join(a)}.{s}" for n, a, s, _ in SAMPLE])
def test_sample_refuses_before_loading(name, args, suffix, fragments, checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr("mhla_convert.train.sampling._load", lambda *a: pytest.fail("the checkpoint was loaded"))
    out = tmp_path / "samples" / f"x.{suffix}"
    assert_one_line(cli("sample", checkpoints[name], "--out", out, *args), *fragments)
    assert not out.parent.exists()


def test_sample_refuses_a_size_the_vae_and_patches_cannot_tile(checkpoints, tmp_path):
    out = tmp_path / "x.png"
    result = cli("sample", checkpoints["tiny-pixart"], "--out", out, "--height", "30", "--steps", "1")
    assert_one_line(result, "--height 30 must be a multiple of", "(the VAE's factor", "× the patch size 2)",
                    before_load=False)
    assert not out.exists()


@NO_CUDA
def test_sample_refuses_cuda_without_a_gpu(checkpoints, tmp_path):
    out = tmp_path / "x.png"
    assert_one_line(cli("sample", checkpoints["tiny-dit"], "--out", out, "--device", "cuda"), "no usable CUDA GPU")
    assert not out.exists()


# --- damaged checkpoints ---------------------------------------------------------------------------


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_json(name, change):
    def edit(directory):
        path = directory / name
        data = json.loads(path.read_text())
        path.write_text(json.dumps(change(data)))
    return edit


def _drop(*keys):
    def change(data):
        node = data
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]
        return data
    return change


DAMAGE = {
    "truncated weights": (lambda d: _truncate(d / "model.safetensors"), "model.safetensors cannot be read"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "model.safetensors cannot be read"),
    "malformed mhla_config": (lambda d: (d / "mhla_config.json").write_text('{"format_version": 1,'),
                              "mhla_config.json is not valid JSON"),
    "mhla_config a list": (lambda d: (d / "mhla_config.json").write_text("[1]"),
                           "mhla_config.json must hold a JSON object"),
    "no plan": (_edit_json("mhla_config.json", _drop("plan")), "mhla_config.json lacks plan"),
    "no plan.layers": (_edit_json("mhla_config.json", _drop("plan", "layers")), "mhla_config.json lacks plan.layers"),
    "no mhla.blocks": (_edit_json("mhla_config.json", _drop("mhla", "blocks")), "mhla_config.json lacks mhla.blocks"),
    "feature map typo": (_edit_json("mhla_config.json", lambda d: {**d, "mhla": {**d["mhla"], "feature_map": "rleu"}}),
                         "mhla_config.json: feature_map must be one of"),
    "unknown family": (_edit_json("mhla_config.json", lambda d: {**d, "family": "ditt"}),
                       "mhla_config.json: unsupported model family 'ditt'"),
    "fractional layer": (_edit_json("mhla_config.json", lambda d: {**d, "plan": {**d["plan"], "layers": [1.5]}}),
                         "mhla_config.json: layers must be a list of layer indices"),
    "no config.json": (lambda d: (d / "config.json").unlink(), "config.json is missing"),
    "malformed config.json": (lambda d: (d / "config.json").write_text("{"), "config.json is not valid JSON"),
}


@pytest.fixture
def damaged(checkpoints, tmp_path):
    def make(kind, name="tiny-dit"):
        directory = tmp_path / "damaged"
        shutil.copytree(checkpoints[name], directory)
        DAMAGE[kind][0](directory)
        return directory
    return make


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_checkpoint_is_one_line_from_sample(kind, damaged, tmp_path):
    directory, out = damaged(kind), tmp_path / "x.png"
    assert_one_line(cli("sample", directory, "--out", out), f"cannot load checkpoint {directory}",
                    DAMAGE[kind][1])
    assert not out.exists()


@pytest.mark.parametrize("kind", ["truncated weights", "malformed mhla_config", "no plan", "feature map typo"])
def test_damaged_checkpoint_is_a_value_error_naming_the_file(kind, damaged):
    directory = damaged(kind)
    with pytest.raises(ValueError, match=str(directory)) as error:
        mhla_convert.from_pretrained(directory)
    assert DAMAGE[kind][1] in str(error.value)


def _adapter(directory, config='{"peft_type": "LORA"}'):
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "adapter_config.json").write_text(config)
    save_file({"base_model.model.x.lora_A.weight": torch.zeros(2, 8)}, str(directory / "adapter_model.safetensors"))
    return directory


ADAPTERS = {
    "config not JSON": (lambda d: _adapter(d, config='{"peft_type": "LORA",'), "adapter_config.json is not valid JSON"),
    "truncated weights": (lambda d: _truncate(_adapter(d) / "adapter_model.safetensors"),
                          "adapter_model.safetensors cannot be read"),
}


@pytest.mark.parametrize("kind", ADAPTERS)
def test_damaged_adapter_is_one_line_before_the_model_loads(kind, checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr("mhla_convert.train.sampling._load", lambda *a: pytest.fail("the checkpoint was loaded"))
    make, fragment = ADAPTERS[kind]
    make(tmp_path / "adapter")
    out = tmp_path / "x.png"
    assert_one_line(cli("sample", checkpoints["tiny-dit"], "--out", out, "--adapter", tmp_path / "adapter"),
                    f"the adapter {tmp_path / 'adapter'}", fragment)
    assert not out.exists()


# --- outputs that cannot be written -----------------------------------------------------------------


@pytest.fixture
def unwritable(tmp_path):
    """A folder nothing can be made in: a read-only one, or for root (whom permissions do not stop) /sys."""
    if os.geteuid() == 0:
        yield Path("/sys")
        return
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o500)
    yield folder
    folder.chmod(0o700)


@pytest.mark.parametrize("command", ["eval", "finetune", "sample"])
def test_an_output_path_that_cannot_be_written_is_refused_before_loading(command, unwritable, checkpoints,
                                                                         recipe_file, tmp_path, monkeypatch):
    monkeypatch.setattr("mhla_convert.train.sampling._load", lambda *a: pytest.fail("the checkpoint was loaded"))
    monkeypatch.setattr("mhla_convert.train.trainer.build_model", lambda *a: pytest.fail("a model was built"))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    start = {"eval": ["eval", "tiny-dit", "--data", "synthetic"], "finetune": ["finetune", recipe_file],
             "sample": ["sample", checkpoints["tiny-dit"]]}[command]
    name = "x.png" if command == "sample" else "out"
    assert_one_line(cli(*start, "--out", unwritable / name), "cannot write", str(unwritable))
    assert_one_line(cli(*start, "--out", a_file / name), f"{a_file} is a file")
    if command != "sample":  # an existing file as the output directory
        assert_one_line(cli(*start, "--out", a_file), f"{a_file} is a file")
    assert a_file.read_text() == "mine"


def test_a_full_disk_is_one_line_and_leaves_nothing_behind(checkpoints, tmp_path, monkeypatch):
    from PIL import Image as PILImage

    from mhla_convert.evaluate import EvalError, evaluate, report
    from mhla_convert.train.sampling import sample

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PILImage.Image, "save", full)
    with pytest.raises(TrainError, match=r"cannot write .*x\.png: No space left on device; free space") as error:
        sample(checkpoints["tiny-dit"], None, tmp_path / "s" / "x.png", steps=1, device="cpu")
    assert "\n" not in str(error.value) and list((tmp_path / "s").iterdir()) == []
    monkeypatch.setattr(report, "_atomic_write", full)
    with pytest.raises(EvalError, match=r"cannot write .*eval\.json: No space left on device; free space"):
        evaluate("tiny-dit", "synthetic", out_dir=tmp_path / "e", batch_size=1, num_batches=1, timesteps=1)
    assert list((tmp_path / "e").iterdir()) == []


# --- damaged or mismatched data ---------------------------------------------------------------------


def test_a_corpus_with_a_malformed_json_line_is_one_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "the quick brown fox"}\n{"text": "jumps over\n{"text": "the lazy dog"}\n')
    result = cli("eval", "tiny-llama", "--data", corpus, "--out", tmp_path / "eval", "--passkey-lengths", "")
    assert_one_line(result, f"{corpus}:2: not valid JSON", "fix or remove it", before_load=False)
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("model, corpus, fragments", [
    ("tiny-llama", "", ["holds no text: its file is empty"]),
    ("tiny-dit", "some text\n", ["is text, but a dit model is calibrated on latents", "'synthetic'"]),
])
def test_calibration_data_is_checked_before_the_model_loads(model, corpus, fragments, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(corpus)
    out = tmp_path / "out"
    assert_one_line(cli(model, "--ratio", "0.5", "--strategy", "auto", "--calibration", path, "--out", out),
                    *fragments)
    assert not out.exists()


# --- eval ------------------------------------------------------------------------------------------

EVAL = [
    (["tiny-dit", "--batch-size", "0"], ["batch_size must be at least 1"]),
    (["tiny-dit", "--num-batches", "0"], ["num_batches must be at least 1"]),
    (["tiny-dit", "--timesteps", "0"], ["timesteps must be at least 1"]),
    (["tiny-dit", "--device", "gpu0"], ["device must be like cpu, cuda or cuda:1"]),
    (["tiny-dit", "--dtype", "fp8"], ["dtype must be one of"]),
    (["tiny-dit", "--seed", "-1"], ["seed must be a whole number ≥ 0; got -1"]),
    (["tiny-dit", "--metrics", "loss,fid"], ["the fid metric needs local weights", "--fid-weights"]),
    (["tiny-dit", "--metrics", "clip", "--clip-model", "/nonexistent/clip"], ["neither a local directory"]),
    (["tiny-dit", "--metrics", "loss,lpips"], ["unknown metric(s) lpips; choose from loss, fid, clip"]),
]


@pytest.mark.parametrize("args, fragments", EVAL, ids=[" ".join(a) for a, _ in EVAL])
def test_eval_refuses_before_loading(args, fragments, tmp_path):
    out = tmp_path / "eval"
    assert_one_line(cli("eval", *args, "--data", "synthetic", "--out", out), *fragments)
    assert not out.exists()


@NO_CUDA
def test_eval_refuses_cuda_without_a_gpu(tmp_path):
    out = tmp_path / "eval"
    assert_one_line(cli("eval", "tiny-dit", "--data", "synthetic", "--out", out, "--device", "cuda"),
                    "no usable CUDA GPU")
    assert not out.exists()


def test_eval_against_a_bare_transformer_folder_refuses_before_scoring(tmp_path, monkeypatch):
    """A reference folder holding only the transformer has no VAE to sample with: said before any loss."""
    from mhla_convert.evaluate import api as eval_api

    monkeypatch.setattr(eval_api, "heldout_loss", lambda *a, **k: pytest.fail("scoring began"))
    tiny_model("tiny-dit").save_pretrained(tmp_path / "bare")
    out = tmp_path / "eval"
    result = cli("eval", tmp_path / "bare", "--reference", tmp_path / "bare", "--data", "synthetic", "--out", out,
                 "--device", "cpu")
    assert_one_line(result, "sample comparison needs the rest of a DiTPipeline", f"{tmp_path / 'bare'} holds no "
                    "model_index.json", "--components", "--no-samples", before_load=False)
    assert not out.exists()


def test_eval_of_text_for_a_model_without_a_tokenizer(tmp_path):
    tiny_model("tiny-llama").save_pretrained(tmp_path / "lm")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to score\n" * 50)
    result = cli("eval", tmp_path / "lm", "--data", corpus, "--out", tmp_path / "eval", "--device", "cpu")
    assert_one_line(result, "this model has no tokenizer;", "--components", before_load=False)


def test_eval_of_a_damaged_checkpoint_names_the_file(damaged, tmp_path):
    directory, out = damaged("truncated weights"), tmp_path / "eval"
    result = cli("eval", directory, "--data", "synthetic", "--out", out, "--device", "cpu")
    assert_one_line(result, str(directory / "model.safetensors"), "cannot be read")
    assert not out.exists()


# --- the operator ----------------------------------------------------------------------------------


def _qkv(n=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, n, 2, 4, generator=g).to(dtype) for _ in range(3)]


MIX = torch.full((4, 4), 0.25)
OPS = [
    (lambda q, k, v: dict(q=q[0], k=k, v=v), "q must be (B, N, H, D)"),
    (lambda q, k, v: dict(q=q, k=k[:, :8], v=v), "k must be (B=2, N=16"),
    (lambda q, k, v: dict(q=q.long(), k=k, v=v), "q must be a floating-point torch.Tensor; got a torch.int64 tensor"),
    (lambda q, k, v: dict(q=q, k=k, v=v, mixing=MIX.int()), "mixing must be a floating-point torch.Tensor"),
    (lambda q, k, v: dict(q=q.tolist(), k=k, v=v), "q must be a floating-point torch.Tensor; got list"),
    (lambda q, k, v: dict(q=q, k=k, v=v, grid=(4, 5)), "prod(grid) must equal N=16"),
    (lambda q, k, v: dict(q=q, k=k, v=v, blocks=(2.5, 2)), "blocks must be whole numbers"),
    (lambda q, k, v: dict(q=q, k=k, v=v, grid=("4", "4")), "grid must be whole numbers"),
    (lambda q, k, v: dict(q=q, k=k, v=v, blocks=(8, 2)), "blocks[0] must be in [1, 4]"),
    (lambda q, k, v: dict(q=q, k=k, v=v, mixing=torch.ones(3, 3)), "mixing must be (M, M) = (4, 4)"),
    (lambda q, k, v: dict(q=q, k=k, v=v, eps=-1.0), "eps must be a finite number > 0"),
    (lambda q, k, v: dict(q=q, k=k, v=v, scale=float("nan")), "scale must be a finite number > 0"),
    (lambda q, k, v: dict(q=q, k=k, v=v, feature_map="rleu"), "feature_map must be one of"),
    (lambda q, k, v: dict(q=q, k=k, v=v, backend="nope"), "backend must be one of"),
    (lambda q, k, v: dict(q=q, k=k, v=v, normalize="yes"), "normalize must be true or false"),
    (lambda q, k, v: dict(q=q, k=k, v=v, grid=None, blocks=None, causal=True, chunk_size=2.5),
     "chunk_size must be a whole number ≥ 1"),
]


@pytest.mark.parametrize("make, message", OPS, ids=[m[:32] for _, m in OPS])
def test_operator_refuses_bad_inputs(make, message):
    q, k, v = _qkv()
    call = {"mixing": MIX, "grid": (4, 4), "blocks": (2, 2), **make(q, k, v)}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        mhla_attention(**call)


@pytest.mark.parametrize("blocks", [(2.0, 2.0), (True, 2), [2, 2.0]], ids=str)
def test_cached_layouts_are_not_found_by_equal_non_integers(blocks):
    """(2.0, 2.0) and (True, 2) hash and compare like (2, 2) and (1, 2): a cached layout of those ints must not
    answer for them."""
    BlockLayout.create((4, 4), (2, 2))
    BlockLayout.create((4, 4), (1, 2))
    with pytest.raises(ValueError, match="blocks must be whole numbers"):
        BlockLayout.create((4, 4), blocks)


def test_training_errors_share_the_one_line_type():
    """Recipe errors are TrainErrors (the finetune command's one-line type), not bare exceptions."""
    from mhla_convert.train import parse_recipe

    with pytest.raises(TrainError, match="conversion.options.eps"):
        parse_recipe(RECIPE.replace("{ratio: 1.0}", "{options: {eps: -1.0}}"))
