"""2-process runs (gloo on CPU) through `accelerate launch`, as in docs/finetuning.md: DDP, and FSDP2
with a two-stage recipe (attention transfer, then fine-tuning every weight), interrupted and resumed
mid-way through each stage."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from mhla_convert.train.metrics import read_metrics

ROOT = Path(__file__).parent.parent
ENV = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}

# Two stages: the second trains weights the first keeps frozen (the feed-forward layers), so a run
# that kept the first stage's FSDP wrapping would leave them untouched.
TWO_STAGES = """\
model: {name: tiny-dit}
data: {kind: synthetic, num_samples: 16, batch_size: 2}
stages:
  - {name: attention_transfer, steps: 3, lr: 1.0e-2}
  - {name: finetune, steps: 4, train: all}
optimizer: {lr: 1.0e-3, grad_clip: 1.0}
schedule: {name: cosine, warmup_steps: 1}
checkpoint_every: 2
logging: {trackers: []}
"""


def _launch(args: list[str], port: int, *launch: str) -> subprocess.CompletedProcess:
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", *launch, "--num_processes", "2", "--main_process_port", str(port), *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_two_process_accelerate_launch(tmp_path):
    result = _launch(
        [
            "-m", "mhla_convert.train", str(ROOT / "recipes" / "tiny-dit.yaml"), "--out", str(tmp_path / "run"),
            "--set", "stages.1.steps=10", "--set", "checkpoint_every=5",
        ],
        29517,
        "--multi_gpu",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    last = sorted((run / "checkpoints").iterdir())[-1]
    assert (last / "random_states_1.pkl").exists()  # two ranks saved their RNG state
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 21))  # (not the transfer check's row)
    assert records[-1]["samples_per_s"] > 0 and (run / "model" / "mhla_config.json").exists()


def _fsdp_runs(out: Path) -> None:
    """Run under `accelerate launch --use_fsdp`: the two-stage recipe uninterrupted, and cut at
    step 2 (inside the transfer stage) and step 5 (inside fine-tuning), resumed each time."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    from mhla_convert.train import parse_recipe
    from mhla_convert.train.trainer import Trainer, train

    # Accelerate enables FSDP only on accelerators (a CPU launch becomes plain MULTI_CPU), while
    # torch's FSDP2 runs over gloo on CPU: present the launch as multi-device so the trainer's own
    # FSDP2 path (prepare, stage change, checkpoints, gathered save) is what runs.
    state = PartialState(cpu=True)
    state._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    # Three runs share this launch: keep the process group that each run's end_training would close.
    torch.distributed.destroy_process_group = lambda *_, **__: None
    recipe = parse_recipe(TWO_STAGES)
    quiet = lambda *_: None  # noqa: E731
    trainer = Trainer(recipe, out / "full", log=quiet)
    assert trainer.accelerator.distributed_type == DistributedType.FSDP and trainer.accelerator.is_fsdp2
    trainer.run()
    assert train(recipe, out / "cut", stop_after=2, log=quiet) is None
    assert train(recipe, out / "cut", stop_after=5, log=quiet) is None
    train(recipe, out / "cut", log=quiet)


def test_fsdp2_two_stage_recipe_resumes_in_either_stage(tmp_path):
    result = _launch([__file__, str(tmp_path)], 29519, "--use_fsdp", "--fsdp_version", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    from accelerate.utils import set_seed
    from safetensors.torch import load_file

    from mhla_convert.train import parse_recipe
    from mhla_convert.train.build import build_model

    def weights(run):
        return {
            k: v for f in sorted((tmp_path / run / "model").glob("*.safetensors")) for k, v in load_file(str(f)).items()
        }

    full, cut = weights("full"), weights("cut")
    assert full.keys() == cut.keys()
    for k in full:  # resuming in either stage reproduces the uninterrupted run
        torch.testing.assert_close(cut[k], full[k], rtol=0, atol=1e-6, msg=k)
    assert [r["step"] for r in read_metrics(tmp_path / "cut" / "metrics.jsonl")] == list(range(1, 8))
    set_seed(0)  # the trainer's own seed and build: the weights the run started from
    base = build_model(parse_recipe(TWO_STAGES), teachers=False).model.state_dict()
    ff = [k for k in full if ".ff." in k]
    assert ff and all(not torch.equal(full[k], base[k]) for k in ff), (
        "the fine-tuning stage did not train the feed-forward layers"
    )
    attention = [k for k in full if ".attn1.to_q." in k]
    assert attention and all(not torch.equal(full[k], base[k]) for k in attention)


AUTO = """\
model: {name: tiny-dit}
conversion: {ratio: 0.5, strategy: auto, calibration_batches: 1}
data: {kind: synthetic, num_samples: 8, batch_size: 2}
stages: [{name: finetune, steps: 2}]
logging: {trackers: []}
"""


def _auto_runs(out: Path) -> None:
    """Strategy auto under a 2-process launch: scored alike on both processes it trains; with scores that differ
    by process (as on devices whose kernels round differently) every process stops with the conversion error,
    which each writes to error_RANK.txt."""
    from accelerate import PartialState

    from mhla_convert.families import adapter_for_model
    from mhla_convert.train import TrainError, parse_recipe
    from mhla_convert.train.trainer import train

    destroy = torch.distributed.destroy_process_group
    torch.distributed.destroy_process_group = lambda *_, **__: None  # (two runs share this launch)
    recipe, quiet = parse_recipe(AUTO), lambda *_: None
    train(recipe, out / "agree", log=quiet)
    rank = PartialState().process_index

    def by_rank(model, *_, **__):
        layers = range(len(adapter_for_model(model).attention_modules(model)))
        return {i: float((i + rank) % 2) + 0.01 * i for i in layers}

    sys.modules["mhla_convert.convert"].layer_sensitivity = by_rank
    try:
        train(recipe, out / "differ", log=quiet)
    except TrainError as exc:
        (out / f"error_{rank}.txt").write_text(str(exc))
    torch.distributed.barrier()  # both processes past the error before either tears the group down
    destroy()


def test_auto_layer_choice_agrees_across_processes(tmp_path):
    result = _launch([__file__, "auto", str(tmp_path)], 29521, "--multi_gpu")
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    assert json.loads((tmp_path / "agree" / "model" / "mhla_config.json").read_text())["plan"]["strategy"] == "auto"
    for rank in (0, 1):
        error = (tmp_path / f"error_{rank}.txt").read_text()
        assert "chose different layers on different processes" in error and "process 1: [1, 3, 5]" in error, error


if __name__ == "__main__":  # the body of an `accelerate launch` above
    if sys.argv[1] == "auto":
        _auto_runs(Path(sys.argv[2]))
    else:
        _fsdp_runs(Path(sys.argv[1]))
