"""Publish a saved MHLA checkpoint on the Hugging Face Hub with a generated model card."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData

from .families import adapter_for_family
from .io import read_mhla_config, resolve_saved
from .locations import HUB_ERRORS, HUB_ID, checkpoint_dir, one_line

CARD_FILE = "README.md"
EVAL_FILE = "eval.json"  # an evaluation (`mhla-convert eval`) kept beside the checkpoint: its table goes in the card

CARD_TEMPLATE = """---
{card_data}
---

# {title}

{base_line} converted to **Multi-Head Linear Attention (MHLA)** with
`mhla-convert` {version}: {converted} of {num_layers}
self-attention layers run MHLA, the rest keep their original attention.

## Use

```bash
pip install mhla-convert
```

```python
{load}
```

{load_note} Or sample from the command line: `mhla-convert sample {repo_id} --out {sample_file}`.

## Conversion

| option | value |
|---|---|
{options}
{evaluation}"""

EVAL_SECTION = """
## Evaluation

{what}

| metric | model | reference | gap % |
|---|---:|---:|---:|
{rows}
"""


def _base_card_data(base: str | None, revision: str | None, subfolder: str | None) -> dict:
    """The base model's own card metadata where it is on this machine (a local folder, or the Hub
    cache): license and pipeline tag are carried over. Never downloads."""
    if not base:
        return {}
    path = Path(base).expanduser()
    candidates = []
    if path.is_dir():  # the model's folder, or the pipeline's around it
        in_pipeline = subfolder is None and (path.parent / "model_index.json").is_file()
        candidates = [path / CARD_FILE, *([path.parent / CARD_FILE] if in_pipeline else [])]
    elif HUB_ID.match(base):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(base, CARD_FILE, revision=revision)
        candidates = [Path(cached)] if isinstance(cached, str) else []
    for card in candidates:
        if card.is_file():
            return ModelCard.load(card).data.to_dict()
    return {}


def _is_hub_id(base: str | None) -> bool:
    return bool(base) and "/" in base and not Path(base).expanduser().exists() and bool(HUB_ID.match(base))


def _load_snippet(directory: Path, repo_id: str, meta: dict) -> tuple[str, str]:
    """(code, note): how this checkpoint loads through its library's own loaders."""
    if meta["library"] == "transformers":
        return (f'from transformers import AutoModelForCausalLM\n\n'
                f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)',
                "`trust_remote_code=True` runs the repo's `mhla_loader.py`, which imports mhla-convert "
                "(after `import mhla_convert` it is not needed).")
    if (directory / "model_index.json").is_file():
        return (f'import mhla_convert  # lets diffusers load the converted transformer\n'
                f'from diffusers import DiffusionPipeline\n\npipe = DiffusionPipeline.from_pretrained("{repo_id}")',
                "The pipeline's own class loads it too.")
    converted = f"MHLA{meta['model_class']}"
    return (f'import mhla_convert\n\ntransformer = mhla_convert.from_pretrained("{repo_id}")',
            f"`mhla_convert.diffusers_models.{converted}.from_pretrained` loads it as well; "
            f"the base class's own loader refuses this checkpoint.")


def _eval_section(directory: Path) -> str:
    path = directory / EVAL_FILE
    if not path.is_file():
        return ""
    from .evaluate.report import rows

    result = json.loads(path.read_text())
    meta = result.get("meta", {})
    data = meta.get("data", {})
    what = (f"From `mhla-convert eval` on {data.get('kind', 'held-out')} data ({meta.get('num_examples', '?')} "
            f"examples, seed {meta.get('seed', '?')})" + (", against the base model" if "reference" in result else "")
            + ". Gap = (model − reference) / |reference|.")
    return EVAL_SECTION.format(what=what, rows="\n".join(f"| {' | '.join(r)} |" for r in rows(result)))


def model_card(directory, repo_id: str) -> ModelCard:
    """A README.md for the checkpoint in `directory`: YAML metadata (library, base model, pipeline tag,
    license, tags), install and load snippets, the conversion table and, when `eval.json` is there, the
    evaluation. Local paths are never shown: a local base model appears by its folder name."""
    directory = Path(directory)
    meta = read_mhla_config(directory)
    base = meta.get("base_model")
    adapter = adapter_for_family(meta["family"])
    config = json.loads((checkpoint_dir(directory) / "config.json").read_text())
    base_card = _base_card_data(base, meta.get("base_model_revision"), meta.get("base_model_subfolder"))
    on_hub = _is_hub_id(base)
    data = ModelCardData(
        library_name="mhla-convert", base_model=base if on_hub else None,
        pipeline_tag=base_card.get("pipeline_tag") or adapter.pipeline_tag(config),
        license=base_card.get("license"), license_name=base_card.get("license_name"),
        tags=["mhla", "linear-attention", "mhla-convert", meta["family"], meta["library"]],
    )
    shown = base if on_hub else (Path(base).name if base else None) or meta["model_class"]
    plan, mhla = meta["plan"], meta["mhla"]
    options = {"family": meta["family"], "base model": shown, "attention": plan.get("attention", "mhla"),
               "converted layers": ", ".join(map(str, plan["layers"])) or "none"}
    if plan.get("strategy"):
        options["layers chosen by"] = plan["strategy"]
    options.update(mhla)
    load, load_note = _load_snippet(directory, repo_id, meta)
    return ModelCard(CARD_TEMPLATE.format(
        card_data=data.to_yaml(), title=repo_id, repo_id=repo_id, version=meta["mhla_convert_version"],
        load=load, load_note=load_note,
        base_line=f"[{base}](https://huggingface.co/{base})" if on_hub else f"`{shown}`",
        converted=len(plan["layers"]), num_layers=plan["num_layers"],
        options="\n".join(f"| {k} | `{v}` |" for k, v in options.items()),
        evaluation=_eval_section(directory),
        sample_file={"text": "out.txt", "video": "out.mp4"}.get(adapter.sample_kind, "out.png"),
    ))


def push_to_hub(directory, repo_id: str, *, private: bool | None = None, token: str | None = None,
                commit_message: str = "Upload MHLA-converted model") -> str:
    """Create `repo_id` if needed and upload the checkpoint in `directory` with a generated model card,
    in one commit; returns the URL. The card is uploaded from memory: `directory` is left as it is."""
    directory = resolve_saved(directory)
    card = str(model_card(directory, repo_id)).encode()
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not _hidden_or_card(p.relative_to(directory)))
    operations = [CommitOperationAdd(p.relative_to(directory).as_posix(), _public_eval(p) if p.name == EVAL_FILE
                                     and p.parent == directory else p) for p in files]
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


def _public_eval(path: Path) -> bytes:
    """eval.json as uploaded: the model, reference and data it names by folder name where they are local
    paths (as the card shows a local base), so no path of this machine reaches the Hub."""
    result = json.loads(path.read_text())
    meta = result.get("meta", {})
    for holder, key in ((meta, "model"), (meta, "reference"), (meta.get("data") or {}, "path")):
        value = holder.get(key)
        if isinstance(value, str) and (Path(value).is_absolute() or Path(value).expanduser().exists()):
            holder[key] = Path(value).name
    return json.dumps(result, indent=2).encode()


def _hidden_or_card(path: Path) -> bool:
    """Files not uploaded: a README.md (the generated card replaces it) and hidden files such as .cache/."""
    return path.as_posix() == CARD_FILE or any(part.startswith(".") for part in path.parts)
