"""A 2-process data-parallel run (DDP over gloo on CPU) through `accelerate launch`, as in
docs/finetuning.md."""

import os
import subprocess
import sys
from pathlib import Path

from mhla_convert.train.metrics import read_metrics

ROOT = Path(__file__).parent.parent


def test_two_process_accelerate_launch(tmp_path):
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "29517",
           "-m", "mhla_convert.train", str(ROOT / "recipes" / "tiny-dit.yaml"), "--out", str(tmp_path / "run"),
           "--set", "stages.1.steps=10", "--set", "checkpoint_every=5"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    last = sorted((run / "checkpoints").iterdir())[-1]
    assert (last / "random_states_1.pkl").exists()  # two ranks saved their RNG state
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[-1]["samples_per_s"] > 0 and (run / "model" / "mhla_config.json").exists()
