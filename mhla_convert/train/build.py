"""The model a recipe trains: a base model loaded and converted (keeping its original attention
as teachers when a stage needs them, and a copy of the whole original model when a finetune stage
distils from it), or an already-converted MHLA checkpoint."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from torch import nn

from ..placement import parse_dtype
from .errors import TrainError
from .recipe import Recipe


@dataclass
class Built:
    model: nn.Module
    adapter: object  # the model's FamilyAdapter
    converted: list[int]
    teachers: list[nn.Module] = field(default_factory=list)  # originals of the converted layers
    report: object = None
    original: nn.Module | None = None  # objective.distill: the unconverted model, frozen, in eval mode

    def students(self) -> list[nn.Module]:
        attention = self.adapter.attention_modules(self.model)
        return [attention[i] for i in self.converted]


def build_model(recipe: Recipe, *, teachers: bool = True, plan: dict | None = None) -> Built:
    """`teachers=False` skips copying the original attention (rebuilding a model to load weights into);
    `plan` (a converted model's `mhla_plan`) redoes that conversion instead of choosing layers again."""
    from ..calibrate import fits_far_weight
    from ..convert import PLAN_ATTR, apply_plan, check_conversion, convert
    from ..families import UnsupportedModelError, adapter_for_model
    from .transfer import snapshot_attention

    spec, dtype = recipe.model, parse_dtype(recipe.model.dtype)
    what = f"model.checkpoint {spec.checkpoint}" if spec.checkpoint else f"model.name {spec.name}"
    try:
        if spec.checkpoint:
            from .. import from_pretrained

            model = from_pretrained(spec.checkpoint, torch_dtype=dtype)
        else:
            from ..models import load_source, resolve

            source = resolve(spec.name)
            if plan is None:
                _check_conversion(recipe, source)
            model = load_source(source, torch_dtype=dtype)
        adapter = adapter_for_model(model)
    except (UnsupportedModelError, FileNotFoundError, OSError, ValueError) as exc:
        raise TrainError(f"cannot load {what}: {str(exc).splitlines()[0]}") from None
    if spec.family and adapter.name != spec.family:
        raise TrainError(
            f"this recipe is for family {spec.family!r} but {spec.name or spec.checkpoint} is a {adapter.name!r} "
            f"model: use a {spec.family} model or a {adapter.name} recipe"
        )
    if spec.checkpoint:
        plan = getattr(model, PLAN_ATTR, None) or {}
        return Built(model, adapter, list(plan.get("layers", [])))
    needs_teachers = teachers and any(s.name == "attention_transfer" for s in recipe.stages)
    originals = snapshot_attention(adapter, model) if needs_teachers else []
    distills = teachers and recipe.objective.distill > 0 and any(s.name == "finetune" for s in recipe.stages)
    original = snapshot_model(model) if distills else None
    c = recipe.conversion
    try:
        if plan:
            report = apply_plan(model, plan)
        else:
            auto = c.strategy == "auto" and c.layers is None
            config = check_conversion(model, ratio=c.ratio, strategy=c.strategy, layers=c.layers, blocks=c.blocks,
                                      attention=c.attention, **c.options)
            calibrate = auto or fits_far_weight(config, c.attention) or bool(c.retrieval_share)
            calibration = _calibration(recipe, adapter, model) if calibrate else None
            report = convert(model, ratio=c.ratio, strategy=c.strategy, layers=c.layers, blocks=c.blocks,
                             attention=c.attention, calibration=calibration, retrieval_share=c.retrieval_share,
                             **c.options)
    except ValueError as exc:
        raise TrainError(f"conversion: {exc}") from None
    if not plan and (auto or c.retrieval_share):
        _same_choice_on_every_process(report.converted, report.config.get("retrieval_heads"))
    kept = [originals[i] for i in report.converted] if originals else []
    return Built(model, adapter, list(report.converted), kept, report, original)


def snapshot_model(model: nn.Module) -> nn.Module:
    """A frozen copy of the whole model, taken before `convert` (which moves the attention weights
    into the new layers, so the copy must not share them): the distillation teacher."""
    original = copy.deepcopy(model)
    return original.requires_grad_(False).eval()


def _same_choice_on_every_process(converted: list[int], retrieval_heads=None) -> None:
    """Strategy auto scores the layers, and retrieval_share the key heads, on every process, each on its own device.
    Their choices must agree, or each process would train a different model (and the run would fail later, far from
    the cause, or train on silently). Every process sees every choice, so all of them stop together."""
    from accelerate import PartialState
    from accelerate.utils import gather_object

    def agree(mine, what: str, fix: str) -> None:
        chosen = gather_object([mine])
        if any(choice != chosen[0] for choice in chosen):
            per_process = "; ".join(f"process {rank}: {choice}" for rank, choice in enumerate(chosen))
            raise TrainError(f"conversion: {what} on different processes ({per_process}), as their calibration "
                             f"scores differ by device; set {fix.format(chosen[0])} in the recipe to train the main "
                             "process's choice")

    if PartialState().num_processes < 2:
        return
    agree(sorted(converted), "strategy auto chose different layers", "conversion.layers: {}")
    if retrieval_heads:
        agree(retrieval_heads, "retrieval_share chose different retrieval heads",
              "conversion.options.retrieval_heads: {} (without retrieval_share)")


def _check_conversion(recipe: Recipe, source) -> None:
    """The conversion section against the model's config (layer range, blocks against the token
    grid), before its weights load or download."""
    from ..convert import check_conversion
    from ..models import source_meta_model

    skeleton = source_meta_model(source)
    if skeleton is None:
        return
    c = recipe.conversion
    try:
        check_conversion(skeleton, ratio=c.ratio, strategy=c.strategy, layers=c.layers, blocks=c.blocks,
                         attention=c.attention, **c.options)
    except ValueError as exc:
        raise TrainError(f"conversion: {exc}") from None


def _calibration(recipe: Recipe, adapter, model: nn.Module) -> list[dict]:
    """conversion.calibration_batches batches of the recipe's own data, as model inputs. The model
    moves to this process's device first (where it trains): scoring runs one forward per layer and batch."""
    from accelerate import PartialState

    from ..locations import components_of
    from .calibration import calibration_batches

    model.to(PartialState().device)
    base = components_of(model)
    with PartialState().main_process_first():  # one process encodes, the others read its cache
        return calibration_batches(adapter, model, recipe.data, num_batches=recipe.conversion.calibration_batches,
                                   seed=recipe.seed, objective=recipe.objective,
                                   components=recipe.data.components or base)
