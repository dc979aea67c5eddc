"""Start-up time: `import mhla_convert` against `import torch, transformers`, the CLI's `--help` and `list` against
Python's own start, and loading a tiny converted LM through `trust_remote_code` against its base model.

Each command runs in a fresh interpreter `--runs` times (wall time); the medians are printed, with `-X importtime`'s
ten slowest imports of `import mhla_convert`. CPU only, no downloads:

    python benchmarks/startup.py --runs 7
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAVE = """
import sys
from mhla_convert import convert, save_pretrained, tiny_model
model = tiny_model("tiny-llama")
model.save_pretrained(sys.argv[1] + "/base")
convert(model, layers=[1, 3])
save_pretrained(model, sys.argv[1] + "/mhla")
"""
LOAD = "import sys; from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({!r}{})"


def wall(argv: list[str], runs: int) -> float:
    """Median wall time of `argv` in seconds."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, stdin=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest_imports(code: str, count: int = 10) -> list[tuple[float, str]]:
    """The `count` largest cumulative import times (s) in `python -X importtime -c code`."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], check=True, capture_output=True,
                         text=True).stderr
    rows = []
    for line in err.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = (part.strip() for part in line.removeprefix("import time:").split("|"))
        rows.append((int(cumulative) / 1e6, name))
    return sorted(rows, reverse=True)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="Runs per command (the median is reported).")
    args = parser.parse_args()
    python = [sys.executable, "-c"]
    cli = [str(Path(sys.executable).with_name("mhla-convert"))]  # the installed command, beside this Python
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-c", SAVE, tmp], check=True, capture_output=True)
        rows = {
            "python -c pass": wall([*python, "pass"], args.runs),
            "import torch, transformers": wall([*python, "import torch, transformers"], args.runs),
            "import mhla_convert": wall([*python, "import mhla_convert"], args.runs),
            "mhla-convert --help": wall([*cli, "--help"], args.runs),
            "mhla-convert list": wall([*cli, "list"], args.runs),
            "AutoModelForCausalLM: the base LM": wall([*python, LOAD.format(f"{tmp}/base", "")], args.runs),
            "AutoModelForCausalLM: converted, trust_remote_code":
                wall([*python, LOAD.format(f"{tmp}/mhla", ", trust_remote_code=True")], args.runs),
        }
    width = max(map(len, rows))
    print(f"median wall time of {args.runs} runs, seconds")
    for name, seconds in rows.items():
        print(f"  {name.ljust(width)}  {seconds:6.2f}")
    base, ours, start = rows["import torch, transformers"], rows["import mhla_convert"], rows["python -c pass"]
    print(f"import mhla_convert / import torch, transformers: {ours / base:.2f}")
    print(f"--help and list beyond Python's start: {rows['mhla-convert --help'] - start:.2f}, "
          f"{rows['mhla-convert list'] - start:.2f}")
    print("slowest imports of `import mhla_convert` (cumulative, seconds):")
    for seconds, name in slowest_imports("import mhla_convert"):
        print(f"  {seconds:6.3f}  {name}")


if __name__ == "__main__":
    main()
