"""Names loading and saving share: the attribute recording where a model came from, the file that
marks an MHLA checkpoint, what a hub id looks like, what reaching the Hub can raise, the error
for an unreachable hub, and reading a JSON file that may be damaged."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

SOURCE_ATTR = "mhla_source"  # set on loaded models: {"base_model", "revision", "subfolder"}, saved with them
MHLA_CONFIG = "mhla_config.json"
PIPELINE_SUBFOLDER = "transformer"  # where a diffusers pipeline keeps its transformer
HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def _transport_errors() -> tuple[type[Exception], ...]:
    """The base errors of whichever HTTP library this huggingface_hub uses: its `errors.HTTPError` where it
    names one (httpx or its successor), else httpx's and requests' own (older releases)."""
    found = []
    for module, name in (("huggingface_hub.errors", "HTTPError"), ("httpx", "HTTPError"),
                         ("requests", "RequestException")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


# huggingface_hub's own errors are OSErrors (HTTP status, offline mode, not in the cache); its HTTP
# library's transport errors (connection refused, timeouts) derive only from that library's base error.
TRANSPORT_ERRORS = _transport_errors()
HUB_ERRORS: tuple[type[Exception], ...] = (OSError, *TRANSPORT_ERRORS)


def one_line(error: Exception) -> str:
    """`error`'s message on one line (hub errors spread theirs over several)."""
    return " ".join(str(error).split())


def hub_unreachable(repo_id: str, error: Exception) -> OSError:
    return OSError(
        f"could not reach the Hugging Face Hub for {repo_id!r} ({type(error).__name__}: {one_line(error)}); "
        "check the network, or set HF_HUB_OFFLINE=1 and pass a local directory instead "
        "(a model saved with save_pretrained, or a pipeline folder with transformer/)"
    )


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; a missing, unreadable or malformed file is a one-line ValueError naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is missing: the checkpoint or model directory is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({one_line(error)}): the file is damaged; "
                         "save or download it again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}: the file is damaged; "
                         "save or download it again")
    return data


def checkpoint_dir(directory) -> Path:
    """Where the MHLA checkpoint in `directory` is: itself, or for a pipeline directory
    (model_index.json) holding a converted transformer, its transformer/ folder."""
    directory = Path(directory)
    inner = directory / PIPELINE_SUBFOLDER
    if (not (directory / MHLA_CONFIG).is_file() and (directory / "model_index.json").is_file()
            and (inner / MHLA_CONFIG).is_file()):
        return inner
    return directory
