"""Training checkpoints: Accelerate `save_state` into a temp dir renamed into place (a crash mid-save
never leaves a half checkpoint that looks complete), plus `progress.json` (step, stage, version)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import TrainError

PREFIX = "step-"


@dataclass
class Checkpoint:
    path: Path
    step: int
    stage: int


def checkpoint_dir(out: Path) -> Path:
    return Path(out) / "checkpoints"


def latest(out: Path, version: str) -> Checkpoint | None:
    """The newest complete checkpoint of a run, refusing one written by another package version."""
    root = checkpoint_dir(out)
    found = sorted(root.glob(f"{PREFIX}*/progress.json")) if root.is_dir() else []
    if not found:
        return None
    progress = json.loads(found[-1].read_text())
    if progress.get("version") != version:
        raise TrainError(
            f"{found[-1].parent} was written by mhla-convert {progress.get('version')}, this is {version}: "
            f"resume with that version, or start afresh with a new --out (or --no-resume)"
        )
    return Checkpoint(found[-1].parent, progress["step"], progress["stage"])


def save(accelerator, out: Path, step: int, stage: int, version: str, keep: int) -> Path:
    root = checkpoint_dir(out)
    final, tmp = root / f"{PREFIX}{step:08d}", root / f".tmp-{PREFIX}{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "progress.json").write_text(json.dumps({"step": step, "stage": stage, "version": version}))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final
