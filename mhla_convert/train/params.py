"""Which parameters a stage trains: the MHLA layers, all self-attention, everything, or LoRA
adapters (PEFT) on the MHLA projections."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from ..layer import mhla_layers
from .errors import TrainError
from .recipe import LoraSpec

MHLA_LINEARS = ("to_q", "to_k", "to_v", "to_out")


def select_trainable(model: nn.Module, mode: str, adapter) -> list:
    """Freeze everything, unfreeze what `mode` trains, return those parameters. A layer converted
    with `learnable_mixing: false` keeps its mixing weights fixed whatever the mode."""
    model.requires_grad_(False)
    if mode == "all":
        model.requires_grad_(True)
    elif mode == "mhla":
        for _, layer in mhla_layers(model):
            layer.requires_grad_(True)
    elif mode == "attention":
        for module in adapter.attention_modules(model):
            module.requires_grad_(True)
    elif mode == "lora":
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    for _, layer in mhla_layers(model):
        if not layer.config.learnable_mixing:
            layer.mixing.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainError(f"train: {mode} selects no parameters in this model (no MHLA layers converted?)")
    return params


def lora_targets(model: nn.Module, spec: LoraSpec) -> list[str]:
    if spec.targets:
        return list(spec.targets)
    return [f"{name}.{sub}" for name, layer in mhla_layers(model) for sub, m in layer.named_modules()
            if isinstance(m, nn.Linear) and sub.split(".")[0] in MHLA_LINEARS]


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


def save_adapter(model: nn.Module, directory: Path) -> None:
    """The LoRA weights alone, in PEFT's adapter layout (adapter_model.safetensors + config), saved
    atomically."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from ..io import write_atomically

    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    config = model._mhla_lora_config.to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}

    def write(staging: Path) -> None:
        save_file(state, str(staging / "adapter_model.safetensors"))
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=1, default=str))

    write_atomically(directory, write)


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
