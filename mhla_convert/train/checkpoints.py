"""Training checkpoints: Accelerate `save_state` into a hidden staging folder renamed into place (a
crash mid-save never leaves a half checkpoint that looks complete), plus `progress.json` (step,
stage, version, and the divergence guard's reference values), written last. What a killed save
leaves is removed at the next save (a checkpoint a replacing save left renamed aside is put back by
`latest` itself), and a checkpoint that cannot be read is passed over for the one before it. The
trainer saves a checkpoint only after the model passed its divergence checks, so the newest one is
the last good one."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..io import recover_interrupted_save, swap_into_place
from .errors import TrainError

logger = logging.getLogger(__name__)

PREFIX = "step-"
PROGRESS = "progress.json"


@dataclass
class Checkpoint:
    path: Path
    step: int
    stage: int
    guard: dict | None = None  # the divergence guard's state at this step (absent in older checkpoints)


def checkpoint_dir(out: Path) -> Path:
    return Path(out) / "checkpoints"


def _read_progress(path: Path) -> dict:
    progress = json.loads(path.read_text())
    if not isinstance(progress, dict) or not all(isinstance(progress.get(k), int) for k in ("step", "stage")):
        raise ValueError("no integer step and stage")
    return progress


def latest(out: Path, version: str) -> Checkpoint | None:
    """The newest complete checkpoint of a run, refusing one written by another package version. One
    whose progress.json cannot be read is passed over (with a warning) for the one before it. A save
    cut off between its two renames is settled first."""
    recover(out)
    root = checkpoint_dir(out)
    found = sorted(root.glob(f"{PREFIX}*/{PROGRESS}")) if root.is_dir() else []
    unreadable = []
    for path in reversed(found):
        try:
            progress = _read_progress(path)
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            unreadable.append(f"{path} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
            continue
        if unreadable:
            logger.warning("passing over unreadable %s; using %s", "; ".join(unreadable), path.parent)
        if progress.get("version") != version:
            raise TrainError(
                f"{path.parent} was written by mhla-convert {progress.get('version')}, this is {version}: "
                "resume with that version, or start afresh with a new --out"
            )
        guard = progress.get("guard")
        return Checkpoint(path.parent, progress["step"], progress["stage"], guard if isinstance(guard, dict) else None)
    if unreadable:
        raise TrainError(
            f"no readable checkpoint left in {root}: {unreadable[0]} cannot be read; "
            "restore that file, or start afresh with a new --out"
        )
    return None


def recover(out: Path) -> None:
    """Put back a checkpoint that a replacing save, killed between its two renames, left renamed
    aside (every process may call it at once)."""
    root = checkpoint_dir(out)
    for aside in list(root.glob(f".{PREFIX}*.old-*")) if root.is_dir() else []:
        recover_interrupted_save(root / aside.name[1:].rpartition(".old-")[0])


def save(accelerator, out: Path, step: int, stage: int, version: str, keep: int, guard: dict | None = None) -> Path:
    root = checkpoint_dir(out)
    final = root / f"{PREFIX}{step:08d}"
    staging = root / f".{final.name}.tmp-save"  # one name that every process can compute
    if accelerator.is_main_process:
        _sweep(root)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        progress = {"step": step, "stage": stage, "version": version, **({"guard": guard} if guard else {})}
        (staging / PROGRESS).write_text(json.dumps(progress))
        swap_into_place(staging, final)
        for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
            _remove(old)
    accelerator.wait_for_everyone()
    return final


def _remove(checkpoint: Path) -> None:
    """Remove a checkpoint, its progress.json first: a kill midway leaves no complete-looking half."""
    (checkpoint / PROGRESS).unlink(missing_ok=True)
    shutil.rmtree(checkpoint)


def _sweep(root: Path) -> None:
    """Remove what killed saves and removals left: staging folders, and checkpoints without progress.json."""
    if not root.is_dir():
        return
    for path in root.glob(f".{PREFIX}*.tmp-*"):
        shutil.rmtree(path)
    for path in root.glob(f"{PREFIX}*"):
        if path.is_dir() and not (path / PROGRESS).is_file():
            shutil.rmtree(path)
