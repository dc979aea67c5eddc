"""Which parameters a stage trains: the MHLA layers, all self-attention, everything, or LoRA
adapters (PEFT, lora.py) on the MHLA projections."""

from __future__ import annotations

from torch import nn

from ..layer import mhla_layers
from .errors import TrainError


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

