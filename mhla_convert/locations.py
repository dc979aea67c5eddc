"""Names loading and saving share: the attribute recording where a model came from, the file that
marks an MHLA checkpoint, the files that travel with an LM's weights, what a hub id looks like, what reaching the
Hub can raise, the error for an unreachable hub, and reading a JSON file that may be damaged."""

from __future__ import annotations

import importlib
import json
import re
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

# Set on loaded models. Saved with them: "base_model" (a hub id or built-in tiny name; None for a local folder, whose
# path stays on this machine), "revision", "subfolder", and for a local base "name" (its folder's) and "card" (its
# model card's license and pipeline tag). In memory only: "components" (where the tokenizer or the
# pipeline's other parts load from, when not from base_model: a local base's folder, a checkpoint's own copies) and
# "companions" (relative name -> local file: what a save copies beside the weights).
SOURCE_ATTR = "mhla_source"
MHLA_CONFIG = "mhla_config.json"
PIPELINE_SUBFOLDER = "transformer"  # where a diffusers pipeline keeps its transformer
HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
# What an LM's folder holds beside its config and weights that a converted copy needs to be used on its own: the
# tokenizer (every format transformers reads), its chat templates, the generation config and a processor's config.
COMPANIONS = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
    "chat_template.json", "additional_chat_templates/*.jinja", "generation_config.json", "preprocessor_config.json",
    "processor_config.json",
)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def is_companion(name: str) -> bool:
    """Whether `name` (relative to a model folder, with /) is one of the `COMPANIONS`."""
    return any(fnmatch(name, pattern) for pattern in COMPANIONS)


def components_of(model) -> str | None:
    """Where `model`'s tokenizer or pipeline parts (VAE, text encoder) load from: a checkpoint's own copies or a local
    base's folder when known, else the base model it records (a hub id or tiny name)."""
    source = getattr(model, SOURCE_ATTR, None) or {}
    return source.get("components") or source.get("base_model")


def hub_offline() -> bool:
    """Whether huggingface_hub is in offline mode (HF_HUB_OFFLINE): hub ids then resolve through the local cache."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


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
    if hub_offline():
        return OSError(
            f"{repo_id!r} is not in the local Hugging Face cache, and HF_HUB_OFFLINE is set "
            f"({type(error).__name__}: {one_line(error)}); download it once with the network on "
            f"(`hf download {repo_id}`), or pass a local directory instead"
        )
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
