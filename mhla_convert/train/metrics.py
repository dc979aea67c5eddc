"""`DIR/metrics.jsonl`: one JSON object per logged step, trimmed back to the resume point so a
resumed run's file reads as one uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsFile:
    def __init__(self, path: Path, resume_step: int):
        self.path = Path(path)
        kept = []
        if self.path.exists() and resume_step > 0:
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= resume_step
            ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
