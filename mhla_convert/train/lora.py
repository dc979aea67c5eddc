"""LoRA adapters (PEFT) on converted models: added for a `train: lora` stage, merged into the
weights or saved beside the model in the libraries' own layouts, and loaded back onto a model.

A saved adapter directory holds PEFT's layout (adapter_config.json + adapter_model.safetensors,
keys under `base_model.model.`), which `PeftModel.from_pretrained(model, DIR)` loads; for diffusion
families whose pipeline has diffusers' LoRA loader (SANA, Wan) also `pytorch_lora_weights.safetensors`,
which `pipe.load_lora_weights(DIR)` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from ..layer import mhla_layers
from .errors import TrainError
from .recipe import LoraSpec

MHLA_LINEARS = ("to_q", "to_k", "to_v", "to_out")
PEFT_PREFIX = "base_model.model."  # where PeftModel keeps the wrapped model: its saved keys start so


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
    """The LoRA weights alone: PEFT's adapter layout, and diffusers' where the family's pipeline
    loads LoRA (see the module docstring), saved atomically. `base`: the model the adapter belongs on
    (recorded as the adapter config's base_model_name_or_path)."""
    import copy

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from ..io import write_atomically

    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    config = copy.copy(model._mhla_lora_config)
    config.base_model_name_or_path = base
    pipeline = _lora_pipeline(model)

    def write(staging: Path) -> None:
        save_file({PEFT_PREFIX + k: v for k, v in state.items()}, str(staging / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        config.save_pretrained(str(staging))
        if pipeline is not None:
            metadata = json.loads((staging / "adapter_config.json").read_text())
            pipeline.save_lora_weights(staging, transformer_lora_layers=state,
                                       transformer_lora_adapter_metadata=metadata)

    write_atomically(directory, write)


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
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            if merge:
                module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    del model._mhla_lora_config


def check_adapter(model: nn.Module, directory: Path) -> None:
    """Refuse, in one line, an adapter that is not PEFT's or that was trained on another model: every
    LoRA weight must sit on a linear layer of `model` of matching shape."""
    from safetensors import safe_open

    config, weights = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config.is_file() or not weights.is_file():
        raise TrainError(f"{directory} is not a PEFT adapter (it needs adapter_config.json and "
                         "adapter_model.safetensors): pass the adapter/ folder a `merge: false` LoRA run saved")
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    made_for = f" (it was made for {base})" if base else ""
    modules = dict(model.named_modules())
    with safe_open(weights, framework="pt") as f:
        for key in f.keys():
            name, _, part = key.removeprefix(PEFT_PREFIX).partition(".lora_")
            if part not in ("A.weight", "B.weight"):
                continue
            layer, shape = modules.get(name), f.get_slice(key).get_shape()
            if not isinstance(layer, nn.Linear):
                problem = f"this model has no linear layer {name}"
            elif (part == "A.weight" and shape[1] != layer.in_features) or (
                    part == "B.weight" and shape[0] != layer.out_features):
                problem = f"its {key} of shape {tuple(shape)} does not fit {name} {tuple(layer.weight.shape)}"
            else:
                continue
            raise TrainError(f"the adapter {directory} does not fit this model{made_for}: {problem}; "
                             "pass the adapter trained on this checkpoint")


def load_adapter(model: nn.Module, directory) -> nn.Module:
    """`model` with the PEFT adapter in `directory` merged into its weights (exactly the model a
    `merge: true` run saves), after `check_adapter`."""
    from peft import PeftModel

    directory = Path(directory)
    check_adapter(model, directory)
    return PeftModel.from_pretrained(model, str(directory)).merge_and_unload()
