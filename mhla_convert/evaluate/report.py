"""What an evaluation writes: DIR/eval.json (atomically), DIR/summary.md, and the printed table.

eval.json: {"model": {metric: value}, "reference": {...}, "gap_percent": {...}, "comparison": {...},
"meta": {...}}; "reference" and "gap_percent" only with a reference, "comparison" (sample
similarity, model against reference) only when samples were compared.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from ..io import check_writable
from .errors import EvalError

EVAL_JSON = "eval.json"
SUMMARY_MD = "summary.md"
SAMPLE_FILES = ("samples.png", "samples.mp4")
PREVIOUS_EVAL_FILES = {EVAL_JSON, SUMMARY_MD, *SAMPLE_FILES}  # replaced by a new evaluation


def _stale_temporary(name: str) -> bool:
    """A temporary file of `_atomic_write` that a killed evaluation left (removed by the next one)."""
    return name.endswith(".tmp") and any(name.startswith(f".{kept}.") for kept in (EVAL_JSON, SUMMARY_MD))


def check_out_dir(out_dir: Path) -> None:
    """Refuse a directory holding anything but a previous evaluation's files (nothing is overwritten), and one
    that cannot be made or written."""
    if out_dir.exists() and not out_dir.is_dir():
        raise EvalError(f"{out_dir} is a file; give a directory for the evaluation's output (--out)")
    try:
        check_writable(out_dir)
    except ValueError as error:
        raise EvalError(f"--out: {error}") from None
    if out_dir.is_dir():
        other = sorted(p.name for p in out_dir.iterdir()
                       if p.name not in PREVIOUS_EVAL_FILES and not _stale_temporary(p.name))
        if other:
            raise EvalError(f"{out_dir} already holds {', '.join(other[:3])}{' …' if len(other) > 3 else ''}, "
                            "not a previous evaluation: give a new or empty output directory")


def gap_percent(model: float, reference: float) -> float | None:
    """(model − reference) / |reference| in percent; None where the reference is 0 and the model is not."""
    if model == reference:
        return 0.0
    if reference == 0 or not math.isfinite(reference) or not math.isfinite(model):
        return None
    return 100.0 * (model - reference) / abs(reference)


def gaps(model: dict[str, float], reference: dict[str, float]) -> dict[str, float | None]:
    return {name: gap_percent(value, reference[name]) for name, value in model.items() if name in reference}


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _value(value: float | None) -> str:
    if value is None:
        return "—"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.4e}"
    return f"{value:.4f}"


def _gap(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}%"


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    """(metric, model, reference, gap %) for every metric, comparisons last."""
    model, reference = result["model"], result.get("reference")
    gap = result.get("gap_percent", {})
    out = [(name, _value(value), _value(reference.get(name)) if reference else "—",
            _gap(gap[name]) if name in gap else "—") for name, value in model.items()]
    out += [(name, _value(value), "—", "—") for name, value in result.get("comparison", {}).items()]
    return out


def table(result: dict) -> str:
    header = ("metric", "model", "reference", "gap %")
    body = rows(result)
    width = [max(len(r[c]) for r in [header, *body]) for c in range(4)]

    def line(row):  # the metric name left-aligned, numbers right-aligned
        return "  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, width)))

    return "\n".join([line(header), "  ".join("-" * w for w in width), *map(line, body)])


def summary_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# Evaluation of {meta['model']}", ""]
    if "reference" in result:
        lines += [f"Reference: {meta['reference']}. Gap = (model − reference) / |reference|; for losses and "
                  "perplexity a positive gap is worse, for accuracies a negative one.", ""]
    lines += [f"Family {meta['family']}, data {meta['data']['kind']}"
              f"{' ' + meta['data']['path'] if meta['data'].get('path') else ''}, "
              f"{meta['num_examples']} examples, seed {meta['seed']}.", ""]
    lines += ["| metric | model | reference | gap % |", "|---|---:|---:|---:|"]
    lines += [f"| {' | '.join(r)} |" for r in rows(result)]
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: Path) -> Path:
    """eval.json and summary.md into `out_dir` (checked with `check_out_dir` first); returns eval.json's path."""
    check_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in (p for p in out_dir.iterdir() if _stale_temporary(p.name)):
        stale.unlink()
    for name, text in ((EVAL_JSON, json.dumps(result, indent=2) + "\n"), (SUMMARY_MD, summary_markdown(result))):
        try:
            _atomic_write(out_dir / name, text)
        except OSError as error:  # a full disk, a quota, a folder gone meanwhile
            raise EvalError(f"cannot write {out_dir / name}: {error.strerror or error}; free space there or give "
                            "another --out") from None
    return out_dir / EVAL_JSON
