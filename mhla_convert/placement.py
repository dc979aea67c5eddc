"""Where a loaded model's weights go: dtype names, the cast that keeps a model's float32 modules,
and the device."""

from __future__ import annotations

import torch
from torch import nn

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}") from None


def _floating_tensors(model: nn.Module):
    """(module, key, tensor, kept) for every floating parameter and buffer; `kept`: it belongs to
    one of the model's `_keep_in_fp32_modules`."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    for module_name, module in model.named_modules():
        for key, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None and tensor.is_floating_point():
                yield module, key, tensor, bool(keep & set(f"{module_name}.{key}".split(".")))


def _set(module: nn.Module, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if isinstance(tensor, nn.Parameter):
        tensor.data = tensor.data.to(dtype)  # in place, so ties survive
    else:
        module._buffers[key] = tensor.to(dtype)


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters and buffers to `dtype`, except the model's `_keep_in_fp32_modules`
    (what diffusers' `from_pretrained(torch_dtype=...)` does; a plain `.to(dtype)` would cast those
    too, e.g. Wan's RoPE tables and modulation). Parameters are cast in place, so ties survive."""
    for module, key, tensor, kept in list(_floating_tensors(model)):
        if not kept:
            _set(module, key, tensor, dtype)
    return model


def keep_fp32_modules(model: nn.Module) -> nn.Module:
    """Put the model's `_keep_in_fp32_modules` back in float32 where a loader left them in a lower
    precision (diffusers' `from_single_file` keeps them only for float16)."""
    for module, key, tensor, kept in list(_floating_tensors(model)):
        if kept and torch.finfo(tensor.dtype).bits < 32:
            _set(module, key, tensor, torch.float32)
    return model


def place_model(model: nn.Module, torch_dtype, device) -> nn.Module:
    dtype = parse_dtype(torch_dtype)
    if dtype is not None:
        cast_model(model, dtype)
    return model.to(device) if device is not None else model
