"""Publish a saved MHLA checkpoint on the Hugging Face Hub with a generated model card."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi, ModelCard, ModelCardData

from .io import read_mhla_config

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
    """Create `repo_id` if needed, write the model card into `directory`, upload it; returns the URL."""
    directory = Path(directory)
    model_card(directory, repo_id).save(directory / "README.md")
    api = HfApi(token=token)
    url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    api.upload_folder(folder_path=str(directory), repo_id=repo_id, repo_type="model", commit_message=commit_message)
    return str(url)
