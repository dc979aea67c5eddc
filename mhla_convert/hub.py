"""Publish a saved MHLA checkpoint on the Hugging Face Hub with a generated model card."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData

from .io import read_mhla_config
from .locations import HUB_ERRORS, one_line

CARD_FILE = "README.md"

CARD_TEMPLATE = """---
{card_data}
---

# {repo_id}

{base_line} converted to **Multi-Head Linear Attention (MHLA)** with
`mhla-convert` {version}: {converted} of {num_layers}
self-attention layers run MHLA, the rest keep their original attention.

## Conversion plan

| option | value |
|---|---|
{options}

## Load

```python
import mhla_convert

model = mhla_convert.from_pretrained("{repo_id}")
```

The base library's own `from_pretrained` would rebuild the original attention and drop the MHLA
weights, so load through `mhla_convert`.
"""


def model_card(directory, repo_id: str) -> ModelCard:
    """A README.md for the checkpoint in `directory`: base model, library, tags, plan, load snippet."""
    meta = read_mhla_config(directory)
    base = meta.get("base_model")
    on_hub = bool(base) and "/" in base and not Path(base).exists()
    data = ModelCardData(
        base_model=base if on_hub else None, library_name="mhla-convert",
        tags=["mhla", "linear-attention", meta["family"], meta["library"]],
    )
    plan, mhla = meta["plan"], meta["mhla"]
    options = {"family": meta["family"], "attention": plan.get("attention", "mhla"),
               "converted layers": ", ".join(map(str, plan["layers"])) or "none"}
    if plan.get("strategy"):
        options["layers chosen by"] = plan["strategy"]
    options.update(mhla)
    return ModelCard(CARD_TEMPLATE.format(
        card_data=data.to_yaml(), repo_id=repo_id, version=meta["mhla_convert_version"],
        base_line=f"[{base}](https://huggingface.co/{base})" if on_hub else f"`{base or meta['model_class']}`",
        converted=len(plan["layers"]), num_layers=plan["num_layers"],
        options="\n".join(f"| {k} | `{v}` |" for k, v in options.items()),
    ))


def push_to_hub(directory, repo_id: str, *, private: bool | None = None, token: str | None = None,
                commit_message: str = "Upload MHLA-converted model") -> str:
    """Create `repo_id` if needed and upload the checkpoint in `directory` with a generated model card,
    in one commit; returns the URL. The card is uploaded from memory: `directory` is left as it is."""
    directory = Path(directory)
    card = str(model_card(directory, repo_id)).encode()
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not _hidden_or_card(p.relative_to(directory)))
    operations = [CommitOperationAdd(p.relative_to(directory).as_posix(), p) for p in files]
    operations.append(CommitOperationAdd(CARD_FILE, card))
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.create_commit(repo_id, operations, commit_message=commit_message, repo_type="model")
    except HUB_ERRORS as error:
        raise OSError(
            f"could not push {directory} to {repo_id!r} on the Hugging Face Hub ({type(error).__name__}: "
            f"{one_line(error)}); check the network (unset HF_HUB_OFFLINE) and your token (`hf auth login`), "
            f"then push again: mhla-convert push {directory} {repo_id}"
        ) from error
    return str(url)


def _hidden_or_card(path: Path) -> bool:
    """Files not uploaded: a README.md (the generated card replaces it) and hidden files such as .cache/."""
    return path.as_posix() == CARD_FILE or any(part.startswith(".") for part in path.parts)
