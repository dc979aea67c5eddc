"""Crashes leave nothing wrong behind: a replacing save swaps the new checkpoint in atomically, so
its target is never missing; a save killed by SIGKILL (mid-weights, right after the swap, or between
the two renames of the fallback without an atomic swap) is recovered by every reader and swept at
the next save; a training run killed mid-checkpoint resumes to the bit-identical result; an
unreadable progress.json falls back to the checkpoint before it."""

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

from mhla_convert import convert, evaluate, from_pretrained, load_model, save_pretrained
from mhla_convert.families import adapter_for_model
from mhla_convert.io import read_mhla_config
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
    elif where == "after-swap":  # the new checkpoint is in place, the old one not yet removed
        real_exchange = io.exchange
        def exchange(a, b):
            if not real_exchange(a, b):
                sys.exit(3)  # no atomic swap on this file system
            die()
        io.exchange = exchange
    else:  # the fallback: the old checkpoint is renamed aside, the new one not yet into place
        io.exchange = lambda a, b: False
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


def _can_swap(directory: Path) -> bool:
    from mhla_convert.io import exchange

    (directory / "a").mkdir()
    (directory / "b").mkdir()
    try:
        return exchange(directory / "a", directory / "b")
    finally:
        (directory / "a").rmdir()
        (directory / "b").rmdir()


@pytest.mark.parametrize("where", ["weights", "after-swap", "between-renames"])
def test_a_killed_save_is_recovered_on_load_and_swept_on_save(tiny, run_model, tmp_path, caplog, where):
    if where == "after-swap" and not _can_swap(tmp_path):
        pytest.skip("this file system has no atomic swap (RENAME_EXCHANGE)")
    model = tiny("tiny-dit")
    convert(model, layers=[1])
    target = save_pretrained(model, tmp_path / "ckpt")
    _run_killed(KILLED_SAVE, target, where)

    left = _listing(tmp_path)
    assert any(name.startswith(".ckpt.tmp-") for name in left), left  # the killed save's staging folder
    if where == "between-renames":
        assert "ckpt" not in left and any(name.startswith(".ckpt.old-") for name in left), left
    else:
        assert "ckpt" in left, left  # never missing
    with caplog.at_level(logging.WARNING, logger="mhla_convert.io"):
        reloaded = from_pretrained(target)
    recovered = [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()]
    assert len(recovered) == (where == "between-renames") and all("\n" not in m for m in recovered)
    assert "ckpt" in _listing(tmp_path)
    if where == "after-swap":  # the save had completed: the new checkpoint (the old one waits for the sweep)
        assert reloaded.mhla_plan["layers"] == [2, 3]
    else:
        assert reloaded.mhla_plan["layers"] == [1]  # the previous checkpoint, whole
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


def test_a_replacing_save_never_leaves_its_target_missing(tiny, tmp_path, monkeypatch):
    """Every move of a replacing save leaves a complete checkpoint at the target (one atomic swap)."""
    import mhla_convert.io as io

    if not _can_swap(tmp_path):
        pytest.skip("this file system has no atomic swap (RENAME_EXCHANGE)")
    model = tiny("tiny-dit")
    convert(model, layers=[1])
    target = save_pretrained(model, tmp_path / "ckpt")
    seen = []

    def watched(move):
        def run(*args):
            result = move(*args)
            seen.append((target / "mhla_config.json").is_file())
            return result
        return run

    monkeypatch.setattr(io, "exchange", watched(io.exchange))
    monkeypatch.setattr(Path, "rename", watched(Path.rename))
    convert(again := tiny("tiny-dit"), layers=[0])
    save_pretrained(again, target)
    assert seen == [True]  # one move: the swap
    assert from_pretrained(target).mhla_plan["layers"] == [0] and _listing(tmp_path) == ["ckpt"]


def _cut_off_between_renames(target: Path, tiny) -> None:
    """What a replacing save without an atomic swap leaves when killed between its two renames: the
    old checkpoint renamed aside, the new one complete in its staging folder, no target."""
    new = tiny("tiny-dit")
    convert(new, layers=[0])
    save_pretrained(new, target.with_name(f".{target.name}.tmp-killed"))
    target.rename(target.with_name(f".{target.name}.old-1234abcd"))


def _sample(path: Path, out: Path) -> None:
    from typer.testing import CliRunner

    from mhla_convert.cli import app

    result = CliRunner().invoke(app, ["sample", str(path), "--out", str(out), "--steps", "1", "--device", "cpu"])
    assert result.exit_code == 0 and out.is_file(), result.output


READERS = {  # (the checkpoint, the model saved there, a folder for output) -> read it
    "from_pretrained": lambda path, model, tmp: from_pretrained(path),
    "converted class": lambda path, model, tmp: type(model).from_pretrained(path),
    "load_model": lambda path, model, tmp: load_model(str(path)),
    "read_mhla_config": lambda path, model, tmp: read_mhla_config(path),
    "sample": lambda path, model, tmp: _sample(path, tmp / "x.png"),
    "eval": lambda path, model, tmp: evaluate(str(path), "synthetic", batch_size=2, num_batches=1, timesteps=2,
                                              samples=False, device="cpu"),
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("layout", ["checkpoint", "pipeline"])
def test_every_reader_resolves_a_save_cut_off_between_its_renames(tiny, tmp_path, reader, layout):
    model = tiny("tiny-dit")
    convert(model, layers=[1])
    if layout == "pipeline":  # a pipeline folder, saved as a whole, read through its transformer/
        target = tmp_path / "pipe"
        save_pretrained(model, target / "transformer")
        (target / "model_index.json").write_text("{}")
        path = target / "transformer"
    else:
        target = path = save_pretrained(model, tmp_path / "ckpt")
    _cut_off_between_renames(target, tiny)
    assert not target.exists()
    READERS[reader](path, model, tmp_path)
    assert (target / "mhla_config.json").is_file() or (target / "transformer" / "mhla_config.json").is_file()
    assert not any(".old-" in name for name in _listing(tmp_path))
    assert from_pretrained(path).mhla_plan["layers"] == [1]  # the checkpoint the save would have replaced


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


def test_checkpoint_discovery_resolves_a_save_cut_off_between_its_renames(tmp_path):
    from mhla_convert import __version__
    from mhla_convert.train import checkpoints

    out = tmp_path / "run"
    assert train(parse_recipe(RECIPE), out, stop_after=4, **QUIET) is None  # checkpoints at steps 2 and 4
    root = out / "checkpoints"
    (root / "step-00000004").rename(root / ".step-00000004.old-1234abcd")  # a re-save of step 4, cut off
    found = checkpoints.latest(out, __version__)
    assert found.path == root / "step-00000004" and found.step == 4 and found.guard["stage"] == 1
    assert _listing(root) == ["step-00000002", "step-00000004"]


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
