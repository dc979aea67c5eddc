"""Crashes leave nothing wrong behind: a save killed by SIGKILL (mid-weights, or between the two
renames of a replacing save) is recovered at the next load and swept at the next save; a training
run killed mid-checkpoint resumes to the bit-identical result; an unreadable progress.json falls
back to the checkpoint before it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mhla_convert import convert, from_pretrained, save_pretrained
from mhla_convert.families import adapter_for_model
from mhla_convert.train import TrainError, parse_recipe
from mhla_convert.train.trainer import train

REPO = Path(__file__).parent.parent
QUIET = {"log": lambda *_: None}


def _run_killed(script: str, *args) -> None:
    """Run `script` in a fresh Python (this checkout's package) and expect it to die by SIGKILL."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# --- saving a model --------------------------------------------------------------------------------

KILLED_SAVE = """
    import os, signal, sys
    from pathlib import Path
    import mhla_convert.io as io
    from mhla_convert import convert, save_pretrained
    from mhla_convert.models import tiny_model

    target, where = sys.argv[1:]
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if where == "weights":  # the new weights are half written
        real_save = io.save_torch_state_dict
        def save(state, directory, **kwargs):
            real_save(dict(list(state.items())[:3]), directory, **kwargs)
            die()
        io.save_torch_state_dict = save
    else:  # the old checkpoint is renamed aside, the new one not yet into place
        real_rename = Path.rename
        def rename(self, destination):
            real_rename(self, destination)
            if ".old-" in Path(destination).name:
                die()
        Path.rename = rename
    model = tiny_model("tiny-dit")
    convert(model, layers=[2, 3])
    save_pretrained(model, target)
"""


@pytest.mark.parametrize("where", ["weights", "between-renames"])
def test_a_killed_save_is_recovered_on_load_and_swept_on_save(tiny, run_model, tmp_path, caplog, where):
    model = tiny("tiny-dit")
    convert(model, layers=[1])
    target = save_pretrained(model, tmp_path / "ckpt")
    _run_killed(KILLED_SAVE, target, where)

    left = _listing(tmp_path)
    assert any(name.startswith(".ckpt.tmp-") for name in left), left  # the killed save's staging folder
    if where == "between-renames":
        assert "ckpt" not in left and any(name.startswith(".ckpt.old-") for name in left), left
    with caplog.at_level(logging.WARNING, logger="mhla_convert.io"):
        reloaded = from_pretrained(target)
    assert reloaded.mhla_plan["layers"] == [1]  # the previous checkpoint, whole
    recovered = [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()]
    assert len(recovered) == (where == "between-renames") and all("\n" not in m for m in recovered)
    assert "ckpt" in _listing(tmp_path)
    torch.manual_seed(0)
    inputs = adapter_for_model(model).example_inputs(model, (6, 6), 2)
    assert torch.equal(run_model(reloaded, inputs), run_model(model, inputs))

    again = tiny("tiny-dit")
    convert(again, layers=[0])
    save_pretrained(again, target)
    assert _listing(tmp_path) == ["ckpt"]  # the staging folder left by the kill is gone
    assert from_pretrained(target).mhla_plan["layers"] == [0]


def test_a_failed_replacing_save_leaves_only_the_previous_checkpoint(tiny, tmp_path, monkeypatch):
    import mhla_convert.io as io

    model = tiny("tiny-dit")
    convert(model, layers=[1])
    target = save_pretrained(model, tmp_path / "ckpt")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(io, "save_torch_state_dict", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(model, target)
    assert _listing(tmp_path) == ["ckpt"]


def test_an_interrupted_sample_file_write_keeps_the_previous_file(tmp_path):
    """Sample images and videos, `best.json`: written to a hidden sibling with the same suffix, then renamed."""
    from mhla_convert.io import write_file_atomically

    target = tmp_path / "samples.png"
    write_file_atomically(target, lambda path: path.write_bytes(b"first") if path.suffix == ".png" else None)
    assert target.read_bytes() == b"first"

    def interrupted(path):
        path.write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_file_atomically(target, interrupted)
    assert target.read_bytes() == b"first" and _listing(tmp_path) == ["samples.png"]


def test_a_stale_copy_beside_a_present_checkpoint_is_removed_on_load(tiny, tmp_path, caplog):
    model = tiny("tiny-dit")
    convert(model, layers=[1])
    target = save_pretrained(model, tmp_path / "ckpt")
    (tmp_path / ".ckpt.old-12345678").mkdir()  # a kill during the removal after a completed swap
    with caplog.at_level(logging.WARNING, logger="mhla_convert.io"):
        from_pretrained(target)
    assert _listing(tmp_path) == ["ckpt"] and not caplog.records


# --- training --------------------------------------------------------------------------------------

RECIPE = """\
model: {name: tiny-dit}
data: {kind: synthetic, num_samples: 16, batch_size: 4}
stages:
  - {name: attention_transfer, steps: 2, lr: 1.0e-2}
  - {name: finetune, steps: 4, train: all}
optimizer: {lr: 1.0e-3}
schedule: {name: cosine, warmup_steps: 1}
checkpoint_every: 2
keep_checkpoints: 3
logging: {trackers: []}
"""

KILLED_TRAINING = """
    import os, signal, sys
    from accelerate import Accelerator
    from mhla_convert.cli import app

    recipe, out = sys.argv[1:]
    real_save_state = Accelerator.save_state
    def save_state(self, output_dir=None, **kwargs):
        real_save_state(self, output_dir, **kwargs)
        if "step-00000006" in output_dir:  # the last checkpoint is written but not yet renamed into place
            os.kill(os.getpid(), signal.SIGKILL)
    Accelerator.save_state = save_state
    app(["finetune", recipe, "--out", out])
"""


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted((run / "model").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("full") / "run"
    train(parse_recipe(RECIPE), out, **QUIET)
    return _weights(out)


def _assert_same(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name


def test_training_killed_mid_checkpoint_resumes_bit_identically(uninterrupted, tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(RECIPE)
    out = tmp_path / "run"
    _run_killed(KILLED_TRAINING, recipe, out)
    root = out / "checkpoints"
    assert _listing(root) == [".step-00000006.tmp-save", "step-00000002", "step-00000004"]
    assert not (out / "model").exists()

    train(parse_recipe(RECIPE), out, **QUIET)  # resumes from step 4
    _assert_same(_weights(out), uninterrupted)
    assert _listing(root) == ["step-00000002", "step-00000004", "step-00000006"]  # the staging folder swept


def test_an_unreadable_progress_file_falls_back_to_the_checkpoint_before(uninterrupted, tmp_path, caplog):
    out = tmp_path / "run"
    assert train(parse_recipe(RECIPE), out, stop_after=4, **QUIET) is None  # checkpoints at steps 2 and 4
    broken = out / "checkpoints" / "step-00000004" / "progress.json"
    broken.write_text('{"step": 4, "sta')  # cut off mid-write
    with caplog.at_level(logging.WARNING, logger="mhla_convert.train.checkpoints"):
        train(parse_recipe(RECIPE), out, **QUIET)  # resumes from step 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and str(broken) in warnings[0] and "step-00000002" in warnings[0]
    assert "\n" not in warnings[0]
    _assert_same(_weights(out), uninterrupted)


def test_no_readable_checkpoint_is_one_clear_error(tmp_path):
    out = tmp_path / "run"
    assert train(parse_recipe(RECIPE), out, stop_after=2, **QUIET) is None
    broken = out / "checkpoints" / "step-00000002" / "progress.json"
    broken.write_bytes(b"\xff\xfe")
    with pytest.raises(TrainError) as error:
        train(parse_recipe(RECIPE), out, **QUIET)
    message = str(error.value)
    assert str(broken) in message and "new --out" in message and "\n" not in message


def test_a_checkpoint_of_another_version_names_a_fix_that_works(tmp_path):
    out = tmp_path / "run"
    assert train(parse_recipe(RECIPE), out, stop_after=2, **QUIET) is None
    progress = out / "checkpoints" / "step-00000002" / "progress.json"
    progress.write_text(progress.read_text().replace('"version": "', '"version": "0.0.0-other'))
    with pytest.raises(TrainError, match=r"written by mhla-convert 0\.0\.0-other.*new --out") as error:
        train(parse_recipe(RECIPE), out, **QUIET)
    assert "--no-resume" not in str(error.value)  # which would refuse this directory
    train(parse_recipe(RECIPE), tmp_path / "new", **QUIET)  # the fix it names


def test_checkpoint_rotation_keeps_only_complete_checkpoints(tmp_path):
    out = tmp_path / "run"
    root = out / "checkpoints"
    root.mkdir(parents=True)
    (root / "step-00000001").mkdir()  # a removal killed after progress.json went
    (root / ".step-00000003.tmp-save").mkdir()  # a killed save
    train(parse_recipe(RECIPE, overrides=["keep_checkpoints=2"]), out, **QUIET)
    assert _listing(root) == ["step-00000004", "step-00000006"]


# --- evaluation output -----------------------------------------------------------------------------


def test_a_killed_evaluation_does_not_block_the_next_one(tmp_path):
    from mhla_convert.evaluate.report import write

    out = tmp_path / "eval"
    out.mkdir()
    (out / "eval.json").write_text("{}")
    (out / ".eval.json.k3y9x0_a.tmp").write_text('{"model": ')  # killed mid-write
    result = {"model": {"loss": 1.0}, "meta": {"family": "dit", "data": {"kind": "synthetic"}, "num_examples": 1,
                                               "seed": 0, "model": "m"}}
    write(result, out)
    assert _listing(out) == ["eval.json", "summary.md"]
