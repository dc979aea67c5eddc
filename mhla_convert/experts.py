"""Pipelines that split denoising between two transformers ("experts"), converted together.

Wan2.2-A14B (T2V and I2V) holds `transformer`, the high-noise expert, and `transformer_2`, the low-noise one:
diffusers' WanPipeline and WanImageToVideoPipeline call `transformer` at timesteps t ≥ boundary_ratio ·
num_train_timesteps and `transformer_2` below. `convert(pipe)` converts both with one plan:

- the same layer indices in both experts, from one ratio and strategy. Every denoising step runs exactly one
  expert, so the same plan gives every step the same speed-up, and the two checkpoints the same layout;
- `strategy="auto"` scores layer i as the pipeline uses it: each calibration example goes to the expert that
  denoises it at its timestep (as the pipeline routes it), and the score of layer i is the mean output change
  over all examples, each measured in its own expert with layer i converted there. Since converting a layer of
  one expert leaves the other's outputs alone, this is each expert's sensitivity weighted by its share of the
  examples: one ranking of the layer indices over both experts;
- the weight outside an exact region is fitted per expert on the examples it denoises.

A calibration set with no example in one expert's noise range cannot score that expert and is refused.
`pipe.save_pretrained` then saves both (diffusers records their converted class), and
`DiffusionPipeline.from_pretrained` reloads both converted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .locations import HUB_ERRORS, hub_unreachable, read_json

EXPERTS = ("transformer", "transformer_2")  # diffusers' names: high noise, then low noise


def index_experts(index: dict[str, Any]) -> tuple[str, ...]:
    """The experts a pipeline's model_index.json names, when it names more than one (else none)."""
    present = tuple(name for name in EXPERTS if (index.get(name) or [None])[0] is not None)
    return present if len(present) > 1 and index.get("boundary_ratio") is not None else ()


def refuse_one_expert(location: str, experts: tuple[str, ...]) -> ValueError:
    """The error for loading a two-expert pipeline as one model."""
    return ValueError(
        f"{location} is a pipeline of {len(experts)} experts ({', '.join(experts)}, switched by its boundary_ratio), "
        "converted together: use `mhla-convert MODEL --pipeline` or convert(DiffusionPipeline.from_pretrained(...)); "
        f"for one expert alone, name it (--subfolder / subfolder= {experts[-1]}); fine-tuning recipes train one "
        "transformer: give model.checkpoint DIR/transformer or DIR/transformer_2 of a converted pipeline")


@dataclass
class Experts:
    """The experts of a pipeline and the timestep at which denoising passes from the first to the second."""

    models: dict[str, nn.Module]
    boundary: float | None  # boundary_ratio · num_train_timesteps; None: one expert

    @classmethod
    def of_pipeline(cls, pipe) -> "Experts":
        models = {name: getattr(pipe, name) for name in EXPERTS if getattr(pipe, name, None) is not None}
        ratio = pipe.config.get("boundary_ratio")
        if not models:
            raise ValueError(f"{type(pipe).__name__} holds no transformer to convert")
        if len(models) > 1 and ratio is None:
            raise ValueError(f"{type(pipe).__name__} holds {', '.join(models)} but no boundary_ratio saying which "
                             "denoises when: set the pipeline's boundary_ratio")
        return cls(models, None if ratio is None else ratio * pipe.scheduler.config.num_train_timesteps)

    def route(self, batches: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """Each batch's examples, split by the expert that denoises them at their `timestep` (as the pipelines
        choose: the first at or above the boundary)."""
        if self.boundary is None:
            return {name: list(batches) for name in self.models}
        first, second = self.models
        routed = {first: [], second: []}
        for batch in batches:
            timestep = batch["timestep"]  # (B,), or (B, tokens) with a timestep per token: the example's is the max
            high = timestep.reshape(len(timestep), -1).amax(1) >= self.boundary
            for name, rows in ((first, high), (second, ~high)):
                if rows.all():
                    routed[name].append(batch)
                elif rows.any():
                    routed[name].append({k: _rows(v, rows) for k, v in batch.items()})
        return routed


def _rows(value, rows: torch.Tensor):
    """The examples `rows` of a batch entry that has one per example; anything else as it is."""
    return value[rows] if torch.is_tensor(value) and value.ndim and value.shape[0] == len(rows) else value


@dataclass
class PipelineReport:
    """Each expert's ConversionReport; all share the layers, the strategy and the sensitivity."""

    experts: dict[str, Any]

    @property
    def converted(self) -> list[int]:
        return next(iter(self.experts.values())).converted

    @property
    def sensitivity(self) -> dict[int, float] | None:
        return next(iter(self.experts.values())).sensitivity

    def __str__(self) -> str:
        return "\n\n".join(f"{name}:\n{report}" for name, report in self.experts.items())


def convert_pipeline(pipe, *, ratio: float = 1.0, strategy: str = "spread", layers=None, blocks=None,
                     attention: str = "mhla", calibration=None, fit_steps: int = 0, progress: bool = True,
                     **mhla_options) -> PipelineReport:
    """Convert every expert of `pipe` (a diffusers pipeline, or `Experts`) with one plan (module docstring);
    options as `convert`'s."""
    from .calibrate import check_calibration, fits_far_weight
    from .convert import PLAN_ATTR, UNUSED_CALIBRATION, check_conversion, convert
    from .families import adapter_for_model
    from .plan import AUTO_NEEDS_CALIBRATION, plan_layers
    from .sensitivity import layer_sensitivity

    experts = pipe if isinstance(pipe, Experts) else Experts.of_pipeline(pipe)
    options = dict(blocks=blocks, attention=attention, **mhla_options)
    configs = [check_conversion(m, ratio=ratio, strategy=strategy, layers=layers, **options)
               for m in experts.models.values()]  # every expert checked before any changes
    first = next(iter(experts.models.values()))
    auto = layers is None and strategy == "auto"
    fit_far = fits_far_weight(configs[0], attention)
    if auto and calibration is None:
        raise ValueError(AUTO_NEEDS_CALIBRATION)
    if calibration is not None and not (auto or fit_far):
        raise ValueError(UNUSED_CALIBRATION)
    if fit_steps and not auto:
        raise ValueError("fit_steps only fits layers while strategy 'auto' scores them; drop it or use strategy='auto'")
    routed = None
    if calibration is not None:
        routed = experts.route(check_calibration(calibration))
        empty = [name for name, batches in routed.items() if not batches]
        if empty:
            raise ValueError(f"no calibration example falls in {', '.join(empty)}'s noise range (timesteps "
                             f"{'≥' if empty[0] == EXPERTS[0] else '<'} {experts.boundary:g}): give more "
                             "calibration batches (--calibration-batches)")
    sensitivity = None
    if auto:
        scores = {name: layer_sensitivity(model, routed[name], configs[0], fit_steps=fit_steps, progress=progress)
                  for name, model in experts.models.items()}
        total = sum(len(batches) for batches in routed.values())
        sensitivity = {i: sum(len(routed[name]) * scores[name][i] for name in scores) / total
                       for i in scores[EXPERTS[0]]}
    num_layers = len(adapter_for_model(first).attention_modules(first))
    indices = plan_layers(num_layers, ratio=ratio, strategy=strategy, layers=layers, sensitivity=sensitivity)
    chosen_by = "explicit" if layers is not None else strategy
    reports = {}
    for name, model in experts.models.items():
        report = convert(model, layers=indices, calibration=routed[name] if routed and fit_far else None,
                         progress=progress, **options)
        report.strategy, report.sensitivity = chosen_by, sensitivity
        getattr(model, PLAN_ATTR).update(strategy=chosen_by, sensitivity=sensitivity)
        reports[name] = report
    if not isinstance(pipe, Experts):  # the pipeline records each component's class as it is given: now converted
        pipe.register_modules(**experts.models)
    return PipelineReport(reports)


def load_experts(source, torch_dtype=None) -> Experts:
    """Each expert of a pipeline source (`models.Source` with `experts`), loaded as `load_source` loads a model,
    and the boundary from its model_index.json and scheduler config."""
    from .models import load_source

    index = read_json(source_file(source, "model_index.json"))
    scheduler = read_json(source_file(source, "scheduler/scheduler_config.json"))
    models = {}
    for name in source.experts:
        config = read_json(source_file(source, f"{name}/config.json"))
        models[name] = load_source(replace(source, subfolder=name, config=config, experts=()), torch_dtype)
    return Experts(models, index["boundary_ratio"] * scheduler.get("num_train_timesteps", 1000))


def source_file(source, name: str) -> Path:
    """A file of a local or hub pipeline source, on this machine."""
    if source.kind == "local":
        return Path(source.location) / name
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(source.location, name, revision=source.revision, **source.hub))
    except HUB_ERRORS as error:
        raise hub_unreachable(source.location, error) from error


def tiny_pipeline(name: str, *, torch_dtype=None, device=None):
    """A built-in tiny pipeline of experts (`DiffusersAdapter.tiny_pipelines`, e.g. tiny-wan2.2-a14b): each expert
    the family's tiny model of its own seed, the boundary_ratio, and the family's tiny components."""
    import diffusers

    from .families import adapter_for_family, families
    from .models import tiny_model

    found = {tiny: (family, spec) for family, cls in sorted(families().items()) if cls.library == "diffusers"
             for tiny, spec in cls().tiny_pipelines().items()}
    if name not in found:
        raise ValueError(f"unknown tiny pipeline {name!r}; built-in: {', '.join(found) or 'none'}")
    family, spec = found[name]
    adapter = adapter_for_family(family)
    models = {expert: tiny_model(spec["experts"], seed=seed, torch_dtype=torch_dtype, device=device)
              for seed, expert in enumerate(EXPERTS)}
    cls = getattr(diffusers, adapter.pipeline_name(models[EXPERTS[0]]))
    parts = adapter.tiny_components(models[EXPERTS[0]])
    pipe = cls(**models, **parts, boundary_ratio=spec["boundary_ratio"])
    return pipe if device is None else pipe.to(device)
