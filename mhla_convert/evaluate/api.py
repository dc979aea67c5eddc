"""`evaluate(model, data, reference)`: how close a converted model is to its original.

Both models are scored on the same held-out batches with the family's own training objective (and,
for language models, perplexity, passkey retrieval and optionally lm-eval tasks; for diffusion
models with a reference, a comparison of their samples). Everything is seeded, so two runs give
identical numbers. Bad input is an `EvalError` raised before any model loads where it can be; a
model whose outputs are inf/NaN (a diverged one) is an `EvalError` too, and no report is written.
"""

from __future__ import annotations

import math
import platform
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from ..families import FamilyAdapter
from ..finite import watch_outputs
from ..placement import check_device
from ..train.recipe import DataSpec, ObjectiveSpec
from . import lm, report
from .data import batches, data_spec, held_out
from .errors import EvalError
from .loss import heldout_loss
from .models import adapter_of, base_model, check_comparable, describe, is_language_model, resolve_model
from .objective import training_objective

ModelSpec = nn.Module | str | Path


def _versions() -> dict[str, str]:
    import diffusers
    import transformers

    from .. import __version__

    return {"mhla_convert": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "diffusers": diffusers.__version__, "python": platform.python_version()}


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise EvalError(f"{name} must be at least 1; got {value}")


def _compare_samples(model, reference, *, family, out_dir, num_samples, seed, steps):
    """Sample similarity of model and reference (evaluate/samples.py)."""
    from .samples import compare_samples

    device = next(model.parameters()).device
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        return compare_samples(model, reference, family=family, out_dir=out_dir, num_samples=num_samples, seed=seed,
                               steps=steps, device=device)
    with tempfile.TemporaryDirectory() as scratch:  # no output directory: the sample files are not kept
        return compare_samples(model, reference, family=family, out_dir=Path(scratch), num_samples=num_samples,
                               seed=seed, steps=steps, device=device)


def _refuse_non_finite(finite: bool, role: str, spec: ModelSpec, where: str) -> None:
    if not finite:
        raise EvalError(f"the {role} {describe(spec)} gives inf/NaN outputs {where}: it has diverged; evaluate an "
                        "earlier checkpoint, or train it again with a lower learning rate")


def _finite_score(score, model: nn.Module, role: str, spec: ModelSpec) -> dict[str, float]:
    """`score(model)`, refused when the model's outputs (or its loss) are not finite."""
    with watch_outputs(model) as watch:
        metrics = score(model)
    _refuse_non_finite(watch.finite and math.isfinite(metrics["loss"]), role, spec, "on the held-out data")
    return metrics


def _load_models(model: ModelSpec, reference: ModelSpec | None, *, dtype, device, subfolders=(None, None)):
    """(model, reference or None, the model's family adapter), refusing a reference that takes other inputs."""
    loaded = resolve_model(model, role="model", dtype=dtype, device=device, subfolder=subfolders[0])
    adapter = adapter_of(loaded, "model")
    if reference is None:
        return loaded, None, adapter
    ref = resolve_model(reference, role="reference", dtype=dtype, device=device, subfolder=subfolders[1])
    check_comparable(loaded, ref, (adapter.name, adapter_of(ref, "reference").name))
    return loaded, ref, adapter


@dataclass
class _Scorer:
    """One evaluation's fixed inputs, applied to the model and the reference alike."""

    adapter: FamilyAdapter
    objective: object
    batches: list[dict]
    seed: int
    timesteps: int
    passkey: list[int]
    trials: int
    tasks: list[str]
    task_limit: int | None
    tokenizer_source: str | None
    batch_size: int

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> dict[str, float]:
        training = model.training
        model.eval()
        try:
            language_model = is_language_model(self.adapter)
            metrics = heldout_loss(model, self.objective, self.batches, language_model=language_model,
                                   seed=self.seed, num_timesteps=self.timesteps)
            if language_model:
                metrics.update(lm.perplexity(metrics["loss"]))
                metrics.update(lm.passkey_accuracy(model, self.passkey, trials=self.trials, seed=self.seed))
                if self.tasks:
                    from ..train.components import tokenizer

                    metrics.update(lm.lm_eval_scores(model, self.tasks, tokenizer=tokenizer(self.tokenizer_source),
                                                  batch_size=self.batch_size, limit=self.task_limit, seed=self.seed))
            return metrics
        finally:
            model.train(training)


def evaluate(
    model: ModelSpec,
    data: str | Path | DataSpec,
    reference: ModelSpec | None = None,
    *,
    batch_size: int = 4,
    num_batches: int = 8,
    seed: int = 0,
    out_dir: str | Path | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    timesteps: int = 8,
    passkey_lengths: Sequence[int] = lm.DEFAULT_PASSKEY_LENGTHS,
    passkey_trials: int = 5,
    tasks: Sequence[str] | None = None,
    task_limit: int | None = None,
    samples: bool | None = None,
    num_samples: int = 4,
    sample_steps: int = 20,
    data_options: dict | None = None,
    objective: ObjectiveSpec | None = None,
    subfolder: str | None = None,
    reference_subfolder: str | None = None,
) -> dict:
    """Score `model` (and `reference`, on the same batches, timesteps and noise) on held-out `data`.

    model, reference: an nn.Module, or what the converter loads: alias, tiny-* name, local directory
        (a base model, or a converted checkpoint holding mhla_config.json) or hub id; `subfolder` /
        `reference_subfolder`: the model's folder inside such a directory or hub repo.
    data: "synthetic" (the family's built-in training set for `seed`), a .safetensors file or folder of
        latents, an image/video folder with metadata.jsonl, or text (.txt/.jsonl/.json/.parquet) for
        LMs; or a training `DataSpec`. `data_options` sets other DataSpec fields (context_length,
        height, components, cache_dir, …). The first batch_size × num_batches examples are used, in order.
    timesteps: diffusion timesteps per batch, one per equal-probability stratum of the training schedule.
    passkey_lengths, passkey_trials: the LM passkey probe (lengths above max_position_embeddings are
        skipped; () turns it off). tasks, task_limit: lm-eval-harness tasks (needs `lm_eval`).
    samples: compare sampled images/videos of model and reference (default: for diffusion models
        when a reference is given); num_samples, sample_steps size that comparison.
    out_dir: write eval.json and summary.md there (refused if it holds anything else).

    Returns {"model": {metric: value}, "reference": {...}, "gap_percent": {...}, "comparison": {...},
    "meta": {...}}; "loss" is always among the metrics.
    """
    _check_counts(batch_size=batch_size, num_batches=num_batches, timesteps=timesteps, passkey_trials=passkey_trials,
                  num_samples=num_samples, sample_steps=sample_steps)
    try:
        check_device(device)
    except ValueError as error:
        raise EvalError(str(error)) from None
    out = Path(out_dir).expanduser() if out_dir is not None else None
    if out is not None:
        report.check_out_dir(out)
    if tasks:
        lm.require_lm_eval()
    num_examples = batch_size * num_batches
    spec = data_spec(data, data_options)

    loaded, ref, adapter = _load_models(model, reference, dtype=dtype, device=device,
                                        subfolders=(subfolder, reference_subfolder))
    language_model = is_language_model(adapter)
    if not language_model and tasks:
        raise EvalError(f"lm-eval tasks are for language models; this is a {adapter.name} model: leave out tasks")
    if samples and (language_model or ref is None):
        raise EvalError("sample comparison needs a diffusion model and a reference; leave out samples")

    components = base_model(loaded) or (base_model(ref) if ref is not None else None)
    columns = held_out(spec, adapter, loaded, num_examples=num_examples, seed=seed, components=components)
    batch_list = batches(columns, batch_size)
    lengths = lm.passkey_lengths(loaded, passkey_lengths) if language_model else []
    score = _Scorer(adapter, training_objective(adapter, objective), batch_list, seed=seed, timesteps=timesteps,
                    passkey=lengths, trials=passkey_trials, tasks=list(tasks or []), task_limit=task_limit,
                    tokenizer_source=spec.components or components, batch_size=batch_size)

    result: dict = {"model": _finite_score(score, loaded, "model", model)}
    if ref is not None:
        result["reference"] = _finite_score(score, ref, "reference", reference)
        result["gap_percent"] = report.gaps(result["model"], result["reference"])
        if samples or (samples is None and not language_model):
            with ExitStack() as stack:
                watches = [stack.enter_context(watch_outputs(m)) for m in (loaded, ref)]
                comparison = _compare_samples(loaded, ref, family=adapter.name, out_dir=out,
                                              num_samples=num_samples, seed=seed, steps=sample_steps)
            for watch, role, given in zip(watches, ("model", "reference"), (model, reference)):
                _refuse_non_finite(watch.finite, role, given, "in its samples")
            if comparison:
                result["comparison"] = {f"sample_{k}": float(v) for k, v in comparison.items()}
    param = next(loaded.parameters())
    result["meta"] = {
        "family": adapter.name, "model": describe(model), "reference": describe(reference) if ref is not None else None,
        "data": {"kind": spec.kind, "path": spec.path}, "num_examples": len(next(iter(columns.values()))),
        "batch_size": batch_size, "num_batches": len(batch_list), "seed": seed,
        "timesteps_per_batch": None if language_model else timesteps, "passkey_lengths": lengths,
        "device": str(param.device), "dtype": str(param.dtype).removeprefix("torch."),
        "versions": _versions(),
    }
    if out is not None:
        report.write(result, out)
    return result
