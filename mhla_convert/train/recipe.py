"""The recipe schema (plain dataclasses) and its validation, done before any model loads.

Every key is checked: an unknown or misspelt key, a wrong type or a value outside its choices is a
`RecipeError` that names the key, the allowed values and the recipe line.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from ..locations import one_line
from ..specs import DataSpec, ObjectiveSpec
from .errors import RecipeError
from .yaml_lines import Located, LocatedList, load

TRACKERS = ("tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive")


@dataclass
class ModelSpec:
    """Either a base model to convert (`name`: alias, hub id or local dir) or an MHLA `checkpoint`."""

    name: str | None = None
    checkpoint: str | None = None
    family: str | None = None  # a guard: refuse a model of another family (a registered family name)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass
class ConversionSpec:
    ratio: float = 1.0
    strategy: Literal["spread", "first", "last", "auto"] = "spread"
    layers: list[int] | str | None = None  # indices, or a layer type of config.layer_types
    blocks: str | list[int] | None = None
    attention: Literal["mhla", "linear", "local"] = "mhla"
    calibration_batches: int = 4  # batches of the recipe's data that score the layers (auto) and fit far weights
    retrieval_share: float = 0.0  # LMs: share of key heads kept softmax, chosen on the calibration batches
    options: dict = field(default_factory=dict)  # MHLAConfig fields


@dataclass
class ValidationSpec:
    """Held-out loss during training: at step 0, every `every` optimizer steps and at each stage's end.

    The held-out examples come from `path` (read like `data`, same kind) or, with `split`, from the
    training data itself: that fraction is set aside by a seeded draw and never trained on.
    """

    split: float | None = None
    path: str | None = None
    every: int = 0  # optimizer steps; 0: only at step 0 and at the end of each stage
    num_batches: int = 8  # held-out batches per evaluation (fewer if the set is smaller)
    batch_size: int | None = None  # default: data.batch_size
    keep_best: bool = True  # save the model with the lowest validation loss to <out>/best
    num_samples: int = 0  # diffusion: samples drawn at each validation, written to <out>/samples and the trackers
    prompts: list[str] | None = None  # text-conditional families (default: built-in prompts)
    class_labels: list[int] | None = None  # class-conditional families (DiT; default: built-in classes)
    sample_steps: int = 20  # inference steps per sample


@dataclass
class LoraSpec:
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    targets: list[str] | None = None  # default: q/k/v/out of every MHLA layer
    merge: bool = True  # merge into the weights at the end, else save an adapter next to the model


@dataclass
class StageSpec:
    name: Literal["attention_transfer", "finetune"]
    steps: int
    lr: float | None = None  # default: optimizer.lr
    train: Literal["mhla", "attention", "all", "lora"] = "mhla"
    lora: LoraSpec | None = None


@dataclass
class OptimizerSpec:
    name: Literal["adamw"] = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float | None = 1.0


@dataclass
class ScheduleSpec:
    name: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0  # per stage, capped at the stage's steps


@dataclass
class LoggingSpec:
    every: int = 1
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str = "mhla-finetune"


@dataclass
class PushSpec:
    repo_id: str
    private: bool = True


@dataclass
class Recipe:
    model: ModelSpec
    data: DataSpec
    stages: list[StageSpec]
    conversion: ConversionSpec | None = None
    validation: ValidationSpec | None = None
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    objective: ObjectiveSpec = field(default_factory=ObjectiveSpec)
    logging: LoggingSpec = field(default_factory=LoggingSpec)
    precision: Literal["no", "bf16", "fp16"] = "no"
    gradient_accumulation: int = 1
    gradient_checkpointing: bool = False
    checkpoint_every: int = 0  # optimizer steps; 0: only at the end of each stage
    keep_checkpoints: int = 2
    seed: int = 0
    push_to_hub: PushSpec | None = None

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- building dataclasses from located YAML -------------------------------------------------------


class _Ctx:
    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, line, problem: str) -> RecipeError:
        where = f"{self.source}:{line}" if isinstance(line, int) else f"{self.source} ({line})" if line else self.source
        return RecipeError(f"{where}: {key}: {problem}")


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None)) + " or null"
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping"}
    return names.get(tp, str(tp))


class _Mismatch(Exception):
    pass


def _convert(tp, value, key: str, line, ctx: _Ctx):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arg in (a for a in typing.get_args(tp) if a is not type(None)):
            try:
                return _convert(arg, value, key, line, ctx)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise _Mismatch
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch
        lines = getattr(value, "item_lines", [line] * len(value))
        return [
            _value(typing.get_args(tp)[0], v, f"{key}[{i}]", ln, ctx) for i, (v, ln) in enumerate(zip(value, lines))
        ]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch
        return _build(tp, value, key, line, ctx)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is dict and isinstance(value, dict):
        return _plain(value)
    if tp in (str, bool) and isinstance(value, tp):
        return value
    raise _Mismatch


def _plain(value):
    """Located YAML containers → plain dicts and lists (they must dump and pickle like any other)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _value(tp, value, key, line, ctx):
    try:
        return _convert(tp, value, key, line, ctx)
    except _Mismatch:
        raise ctx.fail(key, line, f"expected {_describe(tp)}; got {value!r}") from None


def _build(cls, data: dict, prefix: str, line, ctx: _Ctx):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    key_lines = getattr(data, "key_lines", {})
    kwargs = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise ctx.fail(name, key_lines.get(key, line), f"unknown key; allowed keys here: {', '.join(fields)}")
        kwargs[key] = _value(hints[key], value, name, key_lines.get(key, line), ctx)
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ctx.fail(prefix or "recipe", line, f"missing required key(s): {', '.join(missing)}")
    return cls(**kwargs)


# --- cross-field rules ---------------------------------------------------------------------------


def _line(data, *path):
    """The line of a nested key, falling back to its closest located parent."""
    line = getattr(data, "line", None)
    for key in path:
        if isinstance(data, Located) and key in data:
            line, data = data.key_lines.get(key, line), data[key]
        elif isinstance(data, LocatedList) and isinstance(key, int) and key < len(data):
            line, data = data.item_lines[key], data[key]
        else:
            break
    return line


def _check(recipe: Recipe, raw, ctx: _Ctx) -> None:
    from ..families import families

    m = recipe.model
    if m.family is not None and m.family not in families():
        allowed = ", ".join(repr(name) for name in sorted(families()))
        where = _line(raw, "model", "family")
        raise ctx.fail("model.family", where, f"unknown family {m.family!r}; allowed: {allowed}")
    if (m.name is None) == (m.checkpoint is None):
        raise ctx.fail(
            "model",
            _line(raw, "model"),
            "give exactly one of model.name (a base model to convert) or model.checkpoint (an MHLA checkpoint)",
        )
    if m.checkpoint and recipe.conversion is not None:
        raise ctx.fail(
            "conversion",
            _line(raw, "conversion"),
            "a converted checkpoint needs no conversion section; remove it or use model.name",
        )
    if m.name and recipe.conversion is None:
        recipe.conversion = ConversionSpec()
    if recipe.conversion:
        _check_conversion(recipe.conversion, _family(m), raw, ctx)
        if not 0.0 <= recipe.conversion.ratio <= 1.0:
            raise ctx.fail(
                "conversion.ratio",
                _line(raw, "conversion", "ratio"),
                f"must be in [0, 1]; got {recipe.conversion.ratio}",
            )
        if recipe.conversion.calibration_batches < 1:
            where = _line(raw, "conversion", "calibration_batches")
            raise ctx.fail("conversion.calibration_batches", where, "must be ≥ 1")
    d = recipe.data
    if d.kind != "synthetic" and not d.path:
        raise ctx.fail("data.path", _line(raw, "data"), f"data.kind {d.kind!r} needs data.path (a directory or file)")
    for key in ("batch_size", "num_samples", "context_length", "encode_batch_size", "height", "width", "num_frames",
                "latent_frames", "max_text_length"):
        if getattr(d, key) < 1:
            raise ctx.fail(f"data.{key}", _line(raw, "data", key), f"must be ≥ 1; got {getattr(d, key)}")
    if d.num_workers < 0:
        raise ctx.fail("data.num_workers", _line(raw, "data", "num_workers"), f"must be ≥ 0; got {d.num_workers}")
    if d.latent_size is not None and (len(d.latent_size) != 2 or min(d.latent_size) < 1):
        raise ctx.fail("data.latent_size", _line(raw, "data", "latent_size"),
                       f"give the latent height and width, e.g. [32, 32]; got {d.latent_size}")
    if not recipe.stages:
        raise ctx.fail("stages", _line(raw, "stages"), "give at least one stage: attention_transfer and/or finetune")
    for i, stage in enumerate(recipe.stages):
        where = _line(raw, "stages", i)
        if stage.steps < 1:
            raise ctx.fail(f"stages[{i}].steps", where, f"must be ≥ 1; got {stage.steps}")
        if stage.name == "attention_transfer":
            if stage.train != "mhla":
                raise ctx.fail(
                    f"stages[{i}].train", where, "attention_transfer trains the MHLA layers only; allowed: 'mhla'"
                )
            if m.checkpoint:
                raise ctx.fail(
                    f"stages[{i}]",
                    where,
                    "attention_transfer needs the original attention as teacher: "
                    "use model.name + conversion, not model.checkpoint",
                )
        if (stage.train == "lora") != (stage.lora is not None):
            stage.lora = stage.lora or LoraSpec()
            if stage.train != "lora":
                raise ctx.fail(f"stages[{i}].lora", where, "a lora section needs train: lora")
        if stage.train == "lora" and i != len(recipe.stages) - 1:
            raise ctx.fail(
                f"stages[{i}].train",
                where,
                "a LoRA stage must be the last stage (its adapter is merged or saved at the end)",
            )
    checks = {"gradient_accumulation": 1, "keep_checkpoints": 1, "checkpoint_every": 0, "seed": 0}
    for key, low in checks.items():
        if getattr(recipe, key) < low:
            raise ctx.fail(key, _line(raw, key), f"must be ≥ {low}; got {getattr(recipe, key)}")
    if recipe.push_to_hub is not None:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(recipe.push_to_hub.repo_id)
        except HFValidationError as exc:
            raise ctx.fail("push_to_hub.repo_id", _line(raw, "push_to_hub", "repo_id"),
                           f"not a Hub repo id ({one_line(exc)}); give one like you/model-mhla") from None
    for i, tracker in enumerate(recipe.logging.trackers):
        if tracker not in TRACKERS:
            raise ctx.fail(
                f"logging.trackers[{i}]",
                _line(raw, "logging", "trackers", i),
                f"unknown tracker {tracker!r}; allowed: {', '.join(TRACKERS)} (or an empty list)",
            )
    if recipe.logging.every < 1:
        raise ctx.fail("logging.every", _line(raw, "logging", "every"), "must be ≥ 1")
    _check_optimizer(recipe, raw, ctx)
    _check_distill(recipe, raw, ctx)
    _check_validation(recipe, raw, ctx)


def _family(m: ModelSpec) -> str | None:
    """The recipe model's family where it is known without the model: model.family, or that of a built-in tiny
    model or alias model.name names."""
    if m.family is not None or m.name is None:
        return m.family
    from ..models import aliases, tiny_models

    known = {**{alias: f for alias, (f, _) in aliases().items()}, **{t: f for t, (f, _) in tiny_models().items()}}
    return known.get(m.name)


def _check_conversion(c: ConversionSpec, family: str | None, raw, ctx: _Ctx) -> None:
    """The conversion options, each by the checks `convert` runs (options.py), at its own line, then together (on
    the `family`'s kind of model where it is known); what needs the model (the family's defaults, layer range,
    blocks against the token grid) is checked once its config is known."""
    from ..families import adapter_for_family
    from ..options import USER_OPTIONS, check_mhla_option, check_mhla_options, parse_blocks, parse_layers

    for key, value in c.options.items():
        where = _line(raw, "conversion", "options", key)
        if key not in USER_OPTIONS:
            allowed = ", ".join(USER_OPTIONS)
            raise ctx.fail(f"conversion.options.{key}", where, f"unknown MHLA option; allowed: {allowed}")
        try:
            check_mhla_option(key, value)
        except ValueError as exc:
            raise ctx.fail(f"conversion.options.{key}", where, str(exc)) from None
    causal = None if family is None else adapter_for_family(family).causal
    try:
        check_mhla_options(c.options, causal=causal, family=family)
    except ValueError as exc:  # at the exact region's line: what the conflicts are about
        key = next((k for k in ("exact_chunks", "exact_radius") if k in c.options), None)
        path = ("conversion", "options") + ((key,) if key else ())
        raise ctx.fail(".".join(path), _line(raw, *path), str(exc)) from None
    for key, parse in (("blocks", parse_blocks), ("layers", parse_layers)):
        try:
            parse(getattr(c, key))
        except ValueError as exc:
            raise ctx.fail(f"conversion.{key}", _line(raw, "conversion", key), str(exc)) from None


def _check_optimizer(recipe: Recipe, raw, ctx: _Ctx) -> None:
    """Optimizer numbers that would train silently wrong (a negative clip flips the gradient, a NaN lr
    poisons every weight) are refused; NaN fails every comparison, so `not (x > 0)` refuses it too."""
    o = recipe.optimizer

    def fail(key, path, problem):
        return ctx.fail(key, _line(raw, *path), problem)

    def positive_lr(key, path, lr):
        if not (lr > 0 and math.isfinite(lr)):
            raise fail(key, path, f"must be a finite number > 0 (e.g. 1.0e-4); got {lr}")

    positive_lr("optimizer.lr", ("optimizer", "lr"), o.lr)
    for i, stage in enumerate(recipe.stages):
        if stage.lr is not None:
            positive_lr(f"stages[{i}].lr", ("stages", i, "lr"), stage.lr)
    if o.grad_clip is not None and not (o.grad_clip > 0 and math.isfinite(o.grad_clip)):
        raise fail("optimizer.grad_clip", ("optimizer", "grad_clip"),
                   f"must be a finite number > 0 (e.g. 1.0), or null for no clipping; got {o.grad_clip}")
    if len(o.betas) != 2:
        raise fail("optimizer.betas", ("optimizer", "betas"), f"give two numbers, e.g. [0.9, 0.999]; got {o.betas}")
    for i, beta in enumerate(o.betas):
        if not 0.0 <= beta < 1.0:
            raise fail(f"optimizer.betas[{i}]", ("optimizer", "betas"),
                       f"must be in [0, 1), e.g. [0.9, 0.999]; got {beta}")
    if not (o.eps > 0 and math.isfinite(o.eps)):
        raise fail("optimizer.eps", ("optimizer", "eps"), f"must be a finite number > 0 (e.g. 1.0e-8); got {o.eps}")
    if not (o.weight_decay >= 0 and math.isfinite(o.weight_decay)):
        raise fail("optimizer.weight_decay", ("optimizer", "weight_decay"),
                   f"must be a finite number ≥ 0 (0 for none); got {o.weight_decay}")
    if recipe.schedule.warmup_steps < 0:
        raise fail("schedule.warmup_steps", ("schedule", "warmup_steps"),
                   f"must be ≥ 0 (0 for no warmup); got {recipe.schedule.warmup_steps}")
    if recipe.objective.num_train_timesteps < 1:
        raise fail("objective.num_train_timesteps", ("objective", "num_train_timesteps"),
                   f"must be ≥ 1 (e.g. 1000, the schedule's length); got {recipe.objective.num_train_timesteps}")
    shift = recipe.objective.flow_shift
    if shift is not None and not (shift > 0 and math.isfinite(shift)):
        raise fail("objective.flow_shift", ("objective", "flow_shift"),
                   f"must be a finite number > 0 (e.g. 3.0), or null for the family's default; got {shift}")


def _check_distill(recipe: Recipe, raw, ctx: _Ctx) -> None:
    """objective.distill: a weight in [0, 1], and an original model to distil from: a base model the
    run converts itself (`model.name`), whose finetune stages use it."""
    distill = recipe.objective.distill
    where = _line(raw, "objective", "distill")
    if not (0.0 <= distill <= 1.0):  # NaN fails both comparisons
        raise ctx.fail("objective.distill", where,
                       f"must be a finite number in [0, 1] (0: no distillation, 1: distillation only); got {distill}")
    if not distill:
        return
    if recipe.model.checkpoint:
        raise ctx.fail("objective.distill", where,
                       "distillation needs the original model as teacher: use model.name + conversion, "
                       "not model.checkpoint (or set objective.distill: 0)")
    if not any(stage.name == "finetune" for stage in recipe.stages):
        raise ctx.fail("objective.distill", where,
                       "applies to finetune stages and this recipe has none: add one, or set objective.distill: 0")


def _check_validation(recipe: Recipe, raw, ctx: _Ctx) -> None:
    v = recipe.validation
    if v is None:
        return
    if (v.split is None) == (v.path is None):
        raise ctx.fail("validation", _line(raw, "validation"),
                       "give exactly one of validation.split (a fraction of the training data, e.g. 0.05) or "
                       "validation.path (held-out data of the same kind as data)")
    if v.split is not None and not 0.0 < v.split < 1.0:
        raise ctx.fail("validation.split", _line(raw, "validation", "split"), f"must be in (0, 1); got {v.split}")
    if v.path is not None and recipe.data.kind == "synthetic":
        raise ctx.fail("validation.path", _line(raw, "validation", "path"),
                       "synthetic data has no held-out files: use validation.split instead")
    for key, low in (("every", 0), ("num_batches", 1), ("batch_size", 1), ("num_samples", 0), ("sample_steps", 1)):
        value = getattr(v, key)
        if value is not None and value < low:
            raise ctx.fail(f"validation.{key}", _line(raw, "validation", key), f"must be ≥ {low}; got {value}")


# --- entry points --------------------------------------------------------------------------------


def apply_overrides(raw: Located, overrides: list[str]) -> Located:
    """`--set optimizer.lr=1e-3 --set stages.0.steps=5`: values parse as YAML."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {item}: expected key=value, e.g. --set optimizer.lr=1e-4")
        parts = key.split(".")
        node = raw
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise RecipeError(
                        f"--set {item}: {'.'.join(parts[:i]) or 'recipe'} is a list of {len(node)}; "
                        f"use an index 0 … {len(node) - 1}"
                    )
                idx = int(part)
                if last:
                    node[idx] = load(text)
                node = node[idx]
            elif isinstance(node, dict):
                if last:
                    node[part] = load(text)
                    if isinstance(node, Located):
                        node.key_lines[part] = f"--set {item}"
                else:
                    if part not in node or node[part] is None:
                        node[part] = Located()
                        node[part].line, node[part].key_lines = f"--set {item}", {}
                    node = node[part]
            else:
                raise RecipeError(f"--set {item}: {'.'.join(parts[:i])} is not a mapping")
    return raw


def parse_recipe(text: str, source: str = "<recipe>", overrides: list[str] = ()) -> Recipe:
    try:
        raw = load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise RecipeError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: a recipe is a YAML mapping with keys model, data, stages, …")
    raw = apply_overrides(raw, list(overrides))
    ctx = _Ctx(source)
    recipe = _build(Recipe, raw, "", getattr(raw, "line", None), ctx)
    _check(recipe, raw, ctx)
    return recipe


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path} not found; give a YAML file (see recipes/)")
    return parse_recipe(path.read_text(), str(path), overrides)

