"""Publish a saved MHLA checkpoint (and a LoRA adapter trained on it) on the Hugging Face Hub with
generated model cards that follow the Hub's conventions: `library_name` is the host library
(transformers, diffusers; `peft` for an adapter) with `mhla-convert` a tag, `base_model` with its
`base_model_relation`, and a `model-index` from an evaluation kept beside the checkpoint.

An adapter is published in a repo of its own (by default REPO_ID-lora) whose adapter_config.json names
the model repo, pinned to the commit just pushed, as its base: the layout `AutoPeftModelForCausalLM`
and `PeftModel.from_pretrained` load, and that the Hub lists among the model's adapters."""

from __future__ import annotations

import json
import math
from pathlib import Path

from huggingface_hub import CommitOperationAdd, EvalResult, HfApi, ModelCard, ModelCardData

from .families import adapter_for_family
from .io import read_mhla_config, resolve_saved
from .locations import HUB_ERRORS, HUB_ID, checkpoint_dir, one_line

FINGERPRINT_KEY = "mhla_base_fingerprint"  # an adapter card's metadata key for its base's fingerprint

CARD_FILE = "README.md"
EVAL_FILE = "eval.json"  # an evaluation (`mhla-convert eval`) kept beside the checkpoint: its table goes in the card
ADAPTER_CONFIG = "adapter_config.json"
TAGS = ["mhla-convert", "mhla", "linear-attention"]
# What the libraries' save_pretrained(push_to_hub=True) takes for the push, as push_to_hub does
HUB_OPTIONS = ("repo_id", "commit_message", "commit_description", "private", "token", "revision", "create_pr", "tags")

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

ADAPTER_TEMPLATE = """---
{card_data}
---

# {title}

A LoRA adapter (PEFT) for {base_line}, a model converted to **Multi-Head Linear Attention (MHLA)** with
`mhla-convert`.

```python
{load}
```

`mhla_convert.train.lora.load_adapter(model, adapter)` (and `mhla-convert sample --adapter`) merges it in, and
refuses it on any model but the one it was trained on: this card records that model's fingerprint
(`mhla_base_fingerprint`); `force=True` (`--force`) applies it anyway.
"""

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


def _eval_results(directory: Path, task: str) -> list[EvalResult]:
    """The model's metrics in eval.json as the card's model-index: one result per finite metric, on the
    data it names (a local folder by its name, as the card shows it)."""
    path = directory / EVAL_FILE
    if not path.is_file():
        return []
    result = json.loads(_public_eval(path))
    data = result.get("meta", {}).get("data", {})
    dataset = data.get("path") or data.get("kind") or "held-out"
    return [EvalResult(task_type=task, dataset_type=dataset, dataset_name=dataset, metric_type=name,
                       metric_value=value)
            for name, value in result["model"].items() if isinstance(value, (int, float)) and math.isfinite(value)]


def model_card(directory, repo_id: str, tags: list[str] | None = None) -> ModelCard:
    """A README.md for the checkpoint in `directory`: YAML metadata (the host library, the base model and
    its relation, pipeline tag, license, tags with `tags` added, and the model-index of `eval.json` when it
    is there), install and load snippets, the conversion table and the evaluation. Local paths are never
    shown: a local base model appears by its folder name."""
    directory = Path(directory)
    meta = read_mhla_config(directory)
    base = meta.get("base_model")
    adapter = adapter_for_family(meta["family"])
    config = _config(directory)
    base_card = meta.get("base_model_card") or _base_card_data(base, meta.get("base_model_revision"),
                                                                meta.get("base_model_subfolder"))
    on_hub = _is_hub_id(base)
    pipeline_tag = base_card.get("pipeline_tag") or adapter.pipeline_tag(config)
    data = ModelCardData(
        library_name=meta["library"], base_model=base if on_hub else None,
        base_model_relation="finetune" if on_hub else None,  # the Hub's word for weights derived from the base
        pipeline_tag=pipeline_tag, license=base_card.get("license"), license_name=base_card.get("license_name"),
        tags=[*TAGS, meta["family"], *(tags or [])],
        **({"model_name": repo_id, "eval_results": results} if (results := _eval_results(directory, pipeline_tag))
           else {}),  # the model-index names the model
    )
    shown = base if on_hub else (Path(base).name if base else meta.get("base_model_name")) or meta["model_class"]
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
                revision: str | None = None, create_pr: bool = False,
                commit_message: str | None = None, commit_description: str | None = None,
                tags: list[str] | None = None, adapter=None, adapter_repo_id: str | None = None,
                force: bool = False) -> str:
    """Create `repo_id` if needed and upload the checkpoint in `directory` with a generated model card,
    in one commit (to `revision`, a branch created when missing, or as a pull request with `create_pr`);
    returns the repo's URL (the pull request's with `create_pr`). The card is uploaded from memory:
    `directory` is left as it is. `adapter`: a LoRA adapter folder saved for this checkpoint, pushed after
    it to `adapter_repo_id` (default REPO_ID-lora) by `push_adapter`; one saved for another model is
    refused unless `force`."""
    directory = resolve_saved(directory)
    if adapter is not None:
        check_adapter_base(adapter, directory, force=force)
    card = str(model_card(directory, repo_id, tags)).encode()
    operations = [CommitOperationAdd(p.relative_to(directory).as_posix(), _public_eval(p) if p.name == EVAL_FILE
                                     and p.parent == directory else p) for p in _uploaded(directory)]
    operations.append(CommitOperationAdd(CARD_FILE, card))
    url, commit = _commit(directory, repo_id, operations, private=private, token=token, revision=revision,
                          create_pr=create_pr, commit_message=commit_message or "Upload MHLA-converted model",
                          commit_description=commit_description)
    if adapter is not None:
        push_adapter(adapter, directory, repo_id, adapter_repo_id=adapter_repo_id, base_revision=(
            getattr(commit, "oid", None) or revision), private=private, token=token, revision=revision,
            create_pr=create_pr)
    return url


def push_saved(save, repo_id: str, **options) -> str:
    """`push_to_hub` of what `save(folder)` writes into a temporary folder: the converted classes'
    `push_to_hub`."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / repo_id.split("/")[-1]
        save(folder)
        return push_to_hub(folder, repo_id, **options)


def push_adapter(adapter, directory, repo_id: str, *, adapter_repo_id: str | None = None,
                 base_revision: str | None = None, private: bool | None = None, token: str | None = None,
                 revision: str | None = None, create_pr: bool = False,
                 commit_message: str = "Upload LoRA adapter of an MHLA-converted model") -> str:
    """Upload the LoRA adapter folder `adapter` of the checkpoint in `directory`, published as `repo_id`
    (at `base_revision`), to `adapter_repo_id` (default REPO_ID-lora): its adapter_config.json names that
    repo as the base model (what AutoPeftModel loads) and its card is made for it; both go up from memory,
    the folder is left as it is. Returns the adapter repo's URL."""
    adapter = resolve_saved(adapter)
    adapter_repo_id = adapter_repo_id or f"{repo_id}-lora"
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    config.update(base_model_name_or_path=repo_id, revision=base_revision)
    local_card = adapter / CARD_FILE
    fingerprint = ModelCard.load(local_card).data.to_dict().get(FINGERPRINT_KEY) if local_card.is_file() else None
    directory = resolve_saved(directory)
    card = adapter_card(read_mhla_config(directory), _config(directory), repo_id, fingerprint, where=adapter_repo_id)
    operations = [CommitOperationAdd(p.relative_to(adapter).as_posix(), p) for p in _uploaded(adapter)
                  if p != adapter / ADAPTER_CONFIG]
    operations += [CommitOperationAdd(ADAPTER_CONFIG, json.dumps(config, indent=2).encode()),
                   CommitOperationAdd(CARD_FILE, str(card).encode())]
    return _commit(adapter, adapter_repo_id, operations, private=private, token=token, revision=revision,
                   create_pr=create_pr, commit_message=commit_message)[0]


def check_adapter_base(adapter, directory, *, force: bool = False) -> None:
    """Refuse, in one line, pushing `adapter` with a checkpoint other than the one it was saved for (its
    config's base_model_name_or_path), unless `force`."""
    adapter, directory = Path(adapter), Path(directory)
    config = adapter / ADAPTER_CONFIG
    if not config.is_file():
        raise ValueError(f"{adapter} is not a PEFT adapter (it has no {ADAPTER_CONFIG}): pass the adapter/ folder "
                         "a `merge: false` LoRA run saved")
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    if not force and (not base or not Path(base).expanduser().exists()
                      or not Path(base).expanduser().resolve().samefile(directory.resolve())):
        raise ValueError(f"the adapter {adapter} was saved for {base}, not for {directory}: push it with the "
                         "checkpoint it was trained on, or pass --force (force=True) to push it anyway")


def adapter_card(meta: dict, config: dict, base: str | None, fingerprint: str | None, where: str) -> ModelCard:
    """A README.md for a LoRA adapter of a converted model (its mhla_config.json record `meta` and config),
    which `base` names (a hub id, or a local path shown by its folder name), loaded from `where`:
    `library_name: peft`, the base model with relation `adapter`, the pipeline tag, and the base's
    fingerprint (`load_adapter` refuses the adapter on any other model)."""
    family = adapter_for_family(meta["family"])
    on_hub = _is_hub_id(base)
    shown = base if on_hub else Path(base).name if base else meta["model_class"]
    data = ModelCardData(
        library_name="peft", base_model=base if on_hub else None, base_model_relation="adapter" if on_hub else None,
        pipeline_tag=family.pipeline_tag(config), tags=[*TAGS, "lora", meta["family"], meta["library"]],
        **{FINGERPRINT_KEY: fingerprint} if fingerprint else {},
    )
    if meta["library"] == "transformers":
        load = ('import mhla_convert  # registers the converted model classes\n'
                'from peft import AutoPeftModelForCausalLM\n\n'
                f'model = AutoPeftModelForCausalLM.from_pretrained("{where}")')
    else:
        load = ('import mhla_convert\nfrom peft import PeftModel\n\n'
                f'transformer = PeftModel.from_pretrained(mhla_convert.from_pretrained("{shown}"), "{where}")')
    return ModelCard(ADAPTER_TEMPLATE.format(
        card_data=data.to_yaml(), title=where, load=load,
        base_line=f"[{base}](https://huggingface.co/{base})" if on_hub else f"`{shown}`"))


def _config(directory: Path) -> dict:
    return json.loads((checkpoint_dir(directory) / "config.json").read_text())


def _uploaded(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and not _hidden_or_card(p.relative_to(directory)))


def _commit(directory: Path, repo_id: str, operations: list, *, private, token, revision, create_pr,
            commit_message: str, commit_description: str | None = None):
    """(URL, commit info): `operations` committed to `repo_id`, created if needed, as transformers' push does
    (a missing `revision` branch is created first); a Hub or network failure is one line naming the fix."""
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        commit = api.create_commit(repo_id, operations, commit_message=commit_message, repo_type="model",
                                   revision=revision, create_pr=create_pr, commit_description=commit_description)
    except HUB_ERRORS as error:
        raise OSError(
            f"could not push {directory} to {repo_id!r} on the Hugging Face Hub ({type(error).__name__}: "
            f"{one_line(error)}); check the network (unset HF_HUB_OFFLINE) and your token (`hf auth login`), "
            f"then push again: mhla-convert push {directory} {repo_id}"
        ) from error
    return str(commit.pr_url if create_pr and getattr(commit, "pr_url", None) else url), commit


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
