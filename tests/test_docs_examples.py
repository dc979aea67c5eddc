"""The examples in README.md and docs/*.md run, so they cannot drift from the code.

Every shell command (in ```sh / ```bash blocks, and `$ ` lines of other blocks) and every ```python
block is one test. They run offline, on CPU, on tiny models, in one shared folder (`workspace`)
that holds what the examples read (converted checkpoints, a base model folder, data), made once:

- a hub model an example names is replaced by the built-in tiny model of its family (`TINY`);
- `mhla-convert ...` runs in process (typer's runner); pushes go to a stand-in Hub that records them;
- Python examples may use the names in `GIVEN` as the reader's own data, and run with `device="cpu"`;
- the operators take their CPU path (torch), as they do for users: not the Triton interpreter that
  the kernel tests run under.

What cannot run here is skipped with its reason: a whole block by an HTML comment on the line
before its fence, `<!-- test: skip (reason) -->`; a single command by an entry in `SKIPPED`. A new
example that is neither runnable nor skipped fails, and so does a `SKIPPED` entry that names no
example any more.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

REPO = Path(__file__).parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Hub models the examples name -> what stands in for them here (a built-in tiny model of the same
# family, or a folder the workspace holds).
TINY = {
    "wan2.1": "tiny-wan",
    "sana-1600m": "tiny-sana",
    "sana-600m": "tiny-sana",
    "qwen3-0.6b": "tiny-qwen3",
    "meta-llama/Llama-3.2-1B": "hub/Llama-3.2-1B",
}
PYTHON_SUBSTITUTIONS = {'device="cuda"': 'device="cpu"'}  # the tests run without a GPU
GIVEN = {"input_ids": lambda: torch.tensor([[1, 5, 9, 2]])}  # what Python examples take as the reader's own

SKIPPED = {  # single commands of a block that otherwise runs -> why they do not run here
    "accelerate launch -m mhla_convert.train recipes/wan2.1-1.3b-mhla-h67.yaml --out runs/wan":
        "trains Wan2.1-1.3B on several GPUs",
    "accelerate launch -m mhla_convert.train recipes/wan2.1-1.3b-mhla.yaml --out runs/wan":
        "trains Wan2.1-1.3B on several GPUs",
    "mhla-convert finetune recipes/wan2.1-1.3b-mhla.yaml --out runs/wan --set optimizer.lr=1e-5 "
    "--set stages.1.steps=2000": "trains Wan2.1-1.3B for 2000 steps (a GPU job)",
    "mhla-convert eval runs/llama/model --reference meta-llama/Llama-3.2-1B --data corpus.jsonl --out eval/llama "
    "--batch-size 8 --num-batches 32 --dtype bf16 --device cuda": "needs a GPU (--device cuda)",
    "mhla-convert demo": "tests/test_cli.py::test_demo_runs runs it",
}

SHELL = {"sh", "bash", "shell", "console"}
SKIP_MARK = re.compile(r"<!--\s*test:\s*skip\s*(?:\((?P<reason>[^)]*)\))?\s*-->")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")


@dataclass
class Example:
    file: Path
    line: int
    kind: str  # "shell" (one command) or "python" (one block)
    text: str
    skip: str | None = None  # why it does not run here

    @property
    def id(self) -> str:
        first = self.text.splitlines()[0] if self.kind == "python" else self.text
        return f"{self.file.name}:{self.line}: {first[:60]}"


def _commands(lines: list[str], first_line: int, shell_block: bool) -> list[tuple[int, str]]:
    """(line number, command) of a shell block, or of the `$ ` lines of a transcript, with `\\`
    continuations joined and comments dropped."""
    out, pending, start = [], "", 0
    for number, raw in enumerate(lines, first_line):
        line = raw.rstrip()
        if not pending:
            if line.startswith("$ "):
                line = line[2:]
            elif not shell_block:
                continue
            start = number
        pending += " " + line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        command = shlex.join(shlex.split(pending, comments=True))
        pending = ""
        if command:
            out.append((start, command))
    return out


def examples(path: Path) -> list[Example]:
    found, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        body, lang = lines[i + 1:end], fence["lang"]
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = SKIP_MARK.search(before)
        skip = (mark["reason"] or "").strip() if mark else None
        if mark and not skip:
            raise AssertionError(f"{path.name}:{i}: give the reason a block is skipped: <!-- test: skip (why) -->")
        if lang == "python":
            found.append(Example(path, i + 2, "python", "\n".join(body), skip))
        else:
            for number, command in _commands(body, i + 2, lang in SHELL):
                found.append(Example(path, number, "shell", command, skip or SKIPPED.get(command)))
        i = end + 1
    return found


EXAMPLES = [e for path in DOCUMENTS for e in examples(path)]


# --- what the examples read ------------------------------------------------------------------------


def _tiny(name: str):
    from mhla_convert.models import tiny_model

    return tiny_model(name)


def _converted(name: str, directory: Path, **options) -> None:
    from mhla_convert import convert, save_pretrained

    model = _tiny(name)
    convert(model, **options)
    save_pretrained(model, directory)


def _base_dit(root: Path) -> None:
    """A DiT saved as diffusers pipelines keep it (transformer/ beside model_index.json), 8 layers deep."""
    from mhla_convert.families import adapter_for_family
    from mhla_convert.models import tiny_models

    family, config = tiny_models()["tiny-dit"]
    adapter_for_family(family).build({**config, "num_layers": 8}).save_pretrained(root / "transformer")
    (root / "model_index.json").write_text('{"_class_name": "DiTPipeline"}')


def _latents(directory: Path) -> None:
    from safetensors.torch import save_file

    from mhla_convert.families import adapter_for_model
    from mhla_convert.train.recipe import DataSpec

    model = _tiny("tiny-wan")
    columns = adapter_for_model(model).synthetic_data(model, DataSpec(kind="synthetic", num_samples=8), seed=0)
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in columns.items()}, str(directory / "latents.safetensors"))


def _text(path: Path) -> None:
    words = "the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun".split()
    path.write_text("".join(json.dumps({"text": " ".join(words[i:] + words[:i]) * 3}) + "\n" for i in range(16)))


WORKSPACE = {  # path an example reads -> how it is made
    "wan-mhla": lambda p: _converted("tiny-wan", p, ratio=0.67),
    "sana-mhla": lambda p: _converted("tiny-sana", p, blocks="4x4"),
    "runs/dit/model": lambda p: _converted("tiny-dit", p, ratio=1.0),
    "runs/wan/model": lambda p: _converted("tiny-wan", p, ratio=1.0),
    "runs/tiny-wan/model": lambda p: _converted("tiny-wan", p, ratio=1.0),
    "my-dit": _base_dit,
    "hub/Llama-3.2-1B": lambda p: _tiny("tiny-llama").save_pretrained(p),  # as transformers saves it
    "corpus.jsonl": _text,
    "latents": _latents,
    "recipes": lambda p: p.symlink_to(REPO / "recipes"),  # the commands run from the repository root
}


@pytest.fixture(scope="module", autouse=True)
def cpu_operators():
    """No Triton interpreter (tests/conftest.py turns it on for the kernel tests): what users' CPUs run."""
    try:
        from mhla_convert.kernels import mhla_triton
    except ImportError:  # no Triton: torch it is
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mhla_triton, "_INTERPRET", False)
        yield


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docs")
    for name, make in WORKSPACE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        make(root / name)
    return root


@pytest.fixture
def hub(monkeypatch) -> list[tuple[str, list[str]]]:
    """A stand-in Hub: pushes succeed and are recorded as (repo id, uploaded paths)."""
    from huggingface_hub import HfApi

    pushed = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: f"https://huggingface.co/{repo_id}")
    monkeypatch.setattr(HfApi, "create_commit", lambda self, repo_id, operations, **kw: pushed.append(
        (repo_id, [op.path_in_repo for op in operations])))
    return pushed


# --- the tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.id)
def test_example_runs(example, workspace, hub, monkeypatch):
    if example.skip:
        pytest.skip(example.skip)
    monkeypatch.chdir(workspace)
    if example.kind == "python":
        code = example.text
        for real, tiny in {**{f'"{k}"': f'"{v}"' for k, v in TINY.items()}, **PYTHON_SUBSTITUTIONS}.items():
            code = code.replace(real, tiny)
        namespace = {"__name__": "__docs__", **{name: make() for name, make in GIVEN.items()}}
        exec(compile(code, f"{example.file}:{example.line}", "exec"), namespace)
        return
    words = [TINY.get(word, word) for word in shlex.split(example.text)]
    assert words[0] == "mhla-convert", (
        f"{example.id}: only `mhla-convert ...` commands run here; skip this one with its reason "
        "(SKIPPED, or <!-- test: skip (why) --> before its block)"
    )
    from mhla_convert.cli import app

    result = CliRunner().invoke(app, words[1:])
    assert result.exit_code == 0, f"{example.text}\n{result.output}"
    if words[1] == "push" or "--push" in words:
        assert len(hub) == 1 and "mhla_config.json" in hub[0][1]  # the checkpoint reached the (stand-in) Hub


def test_every_skipped_command_is_in_the_docs():
    commands = {e.text for e in EXAMPLES if e.kind == "shell"}
    assert not set(SKIPPED) - commands, "SKIPPED names commands the docs no longer hold"

