"""LoRA adapters (PEFT) on converted models: added for a `train: lora` stage, merged into the
weights or saved beside the model in the libraries' own layouts, and loaded back onto a model.

A saved adapter directory holds what PEFT's `save_pretrained` writes (adapter_config.json with the
task type and base model, adapter_model.safetensors with keys under `base_model.model.`), which
`PeftModel.from_pretrained(model, DIR)` and, for LMs, `AutoPeftModelForCausalLM.from_pretrained(DIR)`
load; a model card (README.md) recording the base model's fingerprint; and for diffusion families
whose pipeline has diffusers' LoRA loader (SANA, Wan) also `pytorch_lora_weights.safetensors`, which
`pipe.load_lora_weights(DIR)` and `pipe.transformer.load_lora_adapter(DIR)` load.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from ..hub import CARD_FILE, FINGERPRINT_KEY, adapter_card
from ..layer import mhla_layers
from ..locations import one_line, read_json
from .errors import TrainError
from .recipe import LoraSpec

MHLA_LINEARS = ("to_q", "to_k", "to_v", "to_out")
PEFT_PREFIX = "base_model.model."  # where PeftModel keeps the wrapped model: its saved keys start so
TASK_TYPES = {"transformers": "CAUSAL_LM"}  # PEFT's task type by host library; diffusers models have none
FINGERPRINT_SAMPLES = 256  # values of each weight that `base_fingerprint` reads


def lora_targets(model: nn.Module, spec: LoraSpec) -> list[str]:
    if spec.targets:
        return list(spec.targets)
    return [f"{name}.{sub}" for name, layer in mhla_layers(model) for sub, m in layer.named_modules()
            if isinstance(m, nn.Linear) and sub.split(".")[0] in {layer.submodule_name(n) for n in MHLA_LINEARS}]


def add_lora(model: nn.Module, spec: LoraSpec) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=lora_targets(model, spec)
    )
    try:
        inject_adapter_in_model(config, model)
    except ValueError as exc:
        raise TrainError(f"stage lora.targets: {exc}") from None
    model._mhla_lora_config = config


def has_lora(model: nn.Module) -> bool:
    return hasattr(model, "_mhla_lora_config")


def save_adapter(model: nn.Module, directory: Path, base: str | None = None) -> None:
    """The LoRA weights alone, saved atomically: PEFT's layout through PEFT's own `save_pretrained` (with
    the task type: CAUSAL_LM for LMs, none for diffusers models), the model card, and diffusers' layout
    where the family's pipeline loads LoRA (see the module docstring). `base`: the model the adapter
    belongs on (the adapter config's base_model_name_or_path, which AutoPeftModel loads it onto); the
    card records `model`'s fingerprint (`base_fingerprint`), which `load_adapter` checks. `model` keeps
    its LoRA layers, with the same weights."""
    import copy

    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    from ..families import adapter_for_model
    from ..io import mhla_metadata, write_atomically

    family = adapter_for_model(model)
    meta, model_config = mhla_metadata(model), model.config
    model_config = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    config = copy.copy(model._mhla_lora_config)
    config.task_type = TASK_TYPES.get(family.library)
    fingerprint = base_fingerprint(model)
    trainable = {p: p.requires_grad for p in model.parameters()}
    _strip_lora(model, merge=False)
    # PEFT's wrapper over the same modules: fresh LoRA layers, given the trained weights
    peft_model = get_peft_model(model, config, autocast_adapter_dtype=False)
    if set_peft_model_state_dict(model, state).unexpected_keys:
        raise RuntimeError("PEFT's wrapper holds other LoRA layers than the trained model")
    peft_model.peft_config["default"].base_model_name_or_path = base
    for parameter, flag in trainable.items():  # PEFT freezes the base weights: as they were
        parameter.requires_grad_(flag)
    pipeline = _lora_pipeline(model)

    def write(staging: Path) -> None:
        peft_model.save_pretrained(str(staging))
        card = adapter_card(meta, model_config, base, fingerprint, where=Path(directory).name)
        card.save(staging / CARD_FILE)  # in place of PEFT's template card
        if pipeline is not None:  # diffusers' loader reads the config from the file, where no local path belongs
            metadata = json.loads((staging / "adapter_config.json").read_text()) | {"base_model_name_or_path": None}
            pipeline.save_lora_weights(staging, transformer_lora_layers=state,
                                       transformer_lora_adapter_metadata=metadata)

    write_atomically(directory, write)


def base_fingerprint(model: nn.Module) -> str:
    """What identifies the converted model an adapter belongs on: a sha256 of its conversion (family,
    converted layers, attention, MHLA options) and of every base weight's name, shape and an evenly
    spaced sample of its values, taken as bfloat16 so a float32 and a bfloat16 load of one checkpoint
    agree. LoRA layers are left out: the fingerprint of a model with or without them is the same."""
    import hashlib

    import torch

    from ..convert import PLAN_ATTR

    plan = getattr(model, PLAN_ATTR, None) or {}
    digest = hashlib.sha256(json.dumps({k: plan.get(k) for k in ("family", "layers", "attention", "mhla_config")},
                                       sort_keys=True, default=list).encode())
    for name, parameter in sorted(model.named_parameters()):
        if "lora_" in name:
            continue
        values = parameter.detach().reshape(-1)
        index = torch.linspace(0, values.numel() - 1, min(values.numel(), FINGERPRINT_SAMPLES),
                               device=values.device).long()
        digest.update(f"{name.replace('.base_layer.', '.')}{tuple(parameter.shape)}".encode())
        digest.update(values[index].to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def _lora_pipeline(model: nn.Module):
    """The diffusers pipeline class around `model` if it loads LoRA weights (else None)."""
    from ..families import adapter_for_model

    adapter = adapter_for_model(model)
    if adapter.library != "diffusers":
        return None
    import diffusers
    from diffusers.loaders.lora_base import LoraBaseMixin

    pipeline = getattr(diffusers, adapter.pipeline_name(model), None)
    return pipeline if isinstance(pipeline, type) and issubclass(pipeline, LoraBaseMixin) else None


def remove_lora(model: nn.Module, merge: bool) -> None:
    """Swap every LoRA layer back for its base layer, folding the update in when `merge`."""
    _strip_lora(model, merge)
    del model._mhla_lora_config


def _strip_lora(model: nn.Module, merge: bool) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            if merge:
                module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    if "peft_config" in vars(model):  # PEFT's record of the adapters it added
        del model.peft_config


def check_adapter(model: nn.Module, directory: Path) -> None:
    """Refuse, in one line, an adapter that is not PEFT's or that was trained on another model: every
    LoRA weight must sit on a linear layer of `model` of matching shape."""
    config, shapes = read_adapter(directory)
    base = config.get("base_model_name_or_path")
    made_for = f" (it was made for {base})" if base else ""
    modules = dict(model.named_modules())
    for key, shape in shapes.items():
        name, _, part = key.removeprefix(PEFT_PREFIX).partition(".lora_")
        if part not in ("A.weight", "B.weight"):
            continue
        layer = modules.get(name)
        if not isinstance(layer, nn.Linear):
            problem = f"this model has no linear layer {name}"
        elif (part == "A.weight" and shape[1] != layer.in_features) or (
                part == "B.weight" and shape[0] != layer.out_features):
            problem = f"its {key} of shape {tuple(shape)} does not fit {name} {tuple(layer.weight.shape)}"
        else:
            continue
        raise TrainError(f"the adapter {directory} does not fit this model{made_for}: {problem}; "
                         "pass the adapter trained on this checkpoint")


def read_adapter(directory: Path) -> tuple[dict, dict[str, list[int]]]:
    """(adapter_config.json, {weight name: shape}) of the PEFT adapter in `directory`; a missing, damaged or
    truncated file is refused in one line (TrainError) before any model needs to load."""
    from safetensors import SafetensorError, safe_open

    config, weights = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config.is_file() or not weights.is_file():
        raise TrainError(f"{directory} is not a PEFT adapter (it needs adapter_config.json and "
                         "adapter_model.safetensors): pass the adapter/ folder a `merge: false` LoRA run saved")
    try:
        settings = read_json(config)
        with safe_open(weights, framework="pt") as f:
            shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}
    except ValueError as exc:
        raise TrainError(f"the adapter {directory}: {exc}") from None
    except (SafetensorError, OSError) as exc:
        raise TrainError(f"the adapter {directory}: {weights.name} cannot be read ({one_line(exc)}): the file is "
                         "damaged or cut short; save or copy the adapter again") from None
    return settings, shapes


def check_base(model: nn.Module, directory: Path) -> None:
    """Refuse, in one line, an adapter whose card records another base model's fingerprint than `model`'s
    (one trained on another model of the same shapes); an adapter without a recorded fingerprint passes."""
    from huggingface_hub import ModelCard

    card = directory / CARD_FILE
    recorded = ModelCard.load(card).data.to_dict().get(FINGERPRINT_KEY) if card.is_file() else None
    if recorded and recorded != base_fingerprint(model):
        raise TrainError(f"the adapter {directory} was trained on another model than this one (its {CARD_FILE} "
                         f"records the base fingerprint {recorded[:12]}…, this model's is "
                         f"{base_fingerprint(model)[:12]}…): apply it to the checkpoint it was trained on, or "
                         "pass force=True (--force) to apply it anyway")


def load_adapter(model: nn.Module, directory, *, force: bool = False) -> nn.Module:
    """`model` with the PEFT adapter in `directory` merged into its weights (exactly the model a
    `merge: true` run saves), after `check_adapter` and, unless `force`, `check_base`."""
    from peft import PeftModel

    directory = Path(directory)
    check_adapter(model, directory)
    if not force:
        check_base(model, directory)
    return PeftModel.from_pretrained(model, str(directory)).merge_and_unload()
