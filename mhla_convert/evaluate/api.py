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
from .data import data_spec, held_out
from .errors import EvalError
from .loss import batches, heldout_loss
from .models import adapter_of, base_model, check_comparable, describe, is_language_model, resolve_model
from .objective import training_objective

ModelSpec = nn.Module | str | Path


def _versions() -> dict[str, str]:
    import diffusers
    import transformers

    from .. import __version__

    return {"mhla_convert": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "diffusers": diffusers.__version__, "python": platform.python_version()}


METRICS = ("loss", "fid", "clip")  # what `metrics` may ask for; the held-out loss is always scored


def _check_counts(seed: int, **counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise EvalError(f"{name} must be at least 1; got {value}")
    if seed < 0:
        raise EvalError(f"seed must be a whole number ≥ 0; got {seed}")


def _learned_metrics(metrics: Sequence[str], fid_weights, clip_model, samples: bool | None) -> dict:
    """compare_samples' FID / CLIP options for `metrics`, their local weights checked before any model loads."""
    from .image_metrics import resolve_clip_model, resolve_fid_weights

    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise EvalError(f"unknown metric(s) {', '.join(unknown)}; choose from {', '.join(METRICS)}")
    wanted = {"fid": ("fid_weights", fid_weights, "--fid-weights FILE (the FID Inception weights, "
                      "pt_inception-2015-12-05-6726825d.pth)"),
              "clip": ("clip_model", clip_model, "--clip-model DIR (a CLIP model saved with save_pretrained)")}
    options = {}
    for metric, (option, value, fix) in wanted.items():
        if metric not in metrics:
            continue
        if value is None:
            raise EvalError(f"the {metric} metric needs local weights, nothing is downloaded: give {fix}")
        if samples is False:
            raise EvalError(f"the {metric} metric scores the compared samples: drop --no-samples or the metric")
        try:
            options[option] = (resolve_fid_weights if metric == "fid" else resolve_clip_model)(value)
        except ValueError as error:
            raise EvalError(str(error)) from None
    return options


def _compare_samples(model, reference, *, family, out_dir, **options):
    """Sample similarity of model and reference (evaluate/samples.py)."""
    from .samples import compare_samples

    device = next(model.parameters()).device
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        return compare_samples(model, reference, family=family, out_dir=out_dir, device=device, **options)
    with tempfile.TemporaryDirectory() as scratch:  # no output directory: the sample files are not kept
        return compare_samples(model, reference, family=family, out_dir=Path(scratch), device=device, **options)


def _refuse_non_finite(finite: bool, role: str, spec: ModelSpec, where: str) -> None:
    if not finite:
        raise EvalError(f"the {role} {describe(spec)} gives inf/NaN outputs {where}: it has diverged; evaluate an "
                        "earlier checkpoint, or train it again with a lower learning rate")


def _finite_score(score, model: nn.Module, role: str, spec: ModelSpec) -> dict[str, float]:
    """`score(model)`, refused when the model's outputs (or its loss) are not finite."""
    with watch_outputs(model) as watch:
        metrics = score(model, role)
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


def _sample_options(adapter, model: nn.Module, reference: nn.Module, spec: DataSpec, learned: dict, **options):
    """compare_samples' options, refused here (before any scoring) where sampling could not run: the
    pipeline's other components (from data option components, else the reference's or the model's
    base model), FID's two samples, CLIP's prompts."""
    from .samples import components_source

    try:
        base = components_source(adapter.name, reference, [spec.components, base_model(reference), base_model(model)])
    except ValueError as error:
        raise EvalError(str(error)) from None
    if "fid_weights" in learned and options["num_samples"] < 2:
        raise EvalError(f"FID compares two sets of samples: num_samples must be at least 2; got "
                        f"{options['num_samples']}")
    if "clip_model" in learned and adapter.num_classes(model) is not None:
        raise EvalError(f"the clip metric scores samples against their prompts; {adapter.name} samples are "
                        "class-conditional: drop clip")
    return {**options, **learned, "base": base}


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
    progress: bool

    @torch.no_grad()
    def __call__(self, model: nn.Module, role: str) -> dict[str, float]:
        training = model.training
        model.eval()
        try:
            language_model = is_language_model(self.adapter)
            metrics = heldout_loss(model, self.objective, self.batches, seed=self.seed,
                                   timesteps=None if language_model else self.timesteps,
                                   progress=f"{role} loss" if self.progress else None)
            if language_model:
                metrics.update(lm.perplexity(metrics["loss"]))
                metrics.update(lm.passkey_accuracy(model, self.passkey, trials=self.trials, seed=self.seed,
                                                   progress=f"{role} passkey" if self.progress else None))
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
    metrics: Sequence[str] = ("loss",),
    fid_weights: str | Path | None = None,
    clip_model: str | Path | None = None,
    progress: bool = True,
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
    metrics: besides the held-out loss (always scored), "fid" and "clip" score the compared samples:
        FID of the model's samples to the reference's, from the local Inception weights file
        `fid_weights` (needs torchmetrics[image]); CLIP score of both to their prompts, with the
        local CLIP model `clip_model` (a directory, or a hub id already in the local cache). Nothing
        is downloaded. seed: a whole number ≥ 0.
    out_dir: write eval.json and summary.md there (refused if it holds anything else).
    progress: progress bars of the scoring on stderr, when it is a terminal.

    Returns {"model": {metric: value}, "reference": {...}, "gap_percent": {...}, "comparison": {...},
    "meta": {...}}; "loss" is always among the metrics.
    """
    _check_counts(seed, batch_size=batch_size, num_batches=num_batches, timesteps=timesteps,
                  passkey_trials=passkey_trials, num_samples=num_samples, sample_steps=sample_steps)
    learned = _learned_metrics(list(metrics), fid_weights, clip_model, samples)
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
    if (samples or learned) and (language_model or ref is None):
        asked = "the fid and clip metrics score compared samples, which need" if learned else "sample comparison needs"
        raise EvalError(f"{asked} a diffusion model and a reference; leave out samples")
    compare = ref is not None and (samples or (samples is None and not language_model))
    if compare:  # everything sampling needs is checked before anything is scored
        learned = _sample_options(adapter, loaded, ref, spec, learned, num_samples=num_samples, seed=seed,
                                  steps=sample_steps)

    components = base_model(loaded) or (base_model(ref) if ref is not None else None)
    columns = held_out(spec, adapter, loaded, num_examples=num_examples, seed=seed, components=components)
    batch_list = batches(columns, batch_size)
    lengths = lm.passkey_lengths(loaded, passkey_lengths) if language_model else []
    score = _Scorer(adapter, training_objective(adapter, objective), batch_list, seed=seed, timesteps=timesteps,
                    passkey=lengths, trials=passkey_trials, tasks=list(tasks or []), task_limit=task_limit,
                    tokenizer_source=spec.components or components, batch_size=batch_size, progress=progress)

    result: dict = {"model": _finite_score(score, loaded, "model", model)}
    if ref is not None:
        result["reference"] = _finite_score(score, ref, "reference", reference)
        result["gap_percent"] = report.gaps(result["model"], result["reference"])
        if compare:
            with ExitStack() as stack:
                watches = [stack.enter_context(watch_outputs(m)) for m in (loaded, ref)]
                comparison = _compare_samples(loaded, ref, family=adapter.name, out_dir=out, **learned)
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
