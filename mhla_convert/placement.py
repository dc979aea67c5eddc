"""Where a loaded model's weights go: dtype names, the cast that keeps a model's float32 tensors,
and the device.

One numeric policy for every way a model is cast or loaded in a lower precision (`cast_model`: tiny
models, `from_pretrained`, models handed to `evaluate`), the one the libraries' own loaders follow, so a
converted model loads the same through them and through mhla-convert: floating parameters and buffers take
the dtype asked for, except, kept in float32,
- the model's `_keep_in_fp32_modules` (diffusers' `from_pretrained(torch_dtype=...)` keeps them, e.g. Wan's
  RoPE tables and modulation);
- every MHLA layer's `mixing` (a converted LM's is built in float32, and transformers' loader keeps a
  parameter in the dtype the model built it with; the few mixing weights cost nothing in float32);
- a transformers model's buffers it does not save (RoPE `inv_freq`): transformers computes them in float32
  and its loader leaves them so.
"""

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
    if not isinstance(dtype, str) or dtype.lower() not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype.lower()]


def loader_dtype(dtype=None, torch_dtype=None) -> torch.dtype | None:
    """The one dtype a loader is asked for: `dtype=` (transformers' and diffusers' name now) or `torch_dtype=`
    (their older one), as a torch dtype; None or "auto": as saved."""
    dtype, torch_dtype = (None if d == "auto" else parse_dtype(d) for d in (dtype, torch_dtype))
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise ValueError(f"dtype={dtype} and torch_dtype={torch_dtype} disagree; give one (torch_dtype is the older "
                         "name of dtype)")
    return dtype if dtype is not None else torch_dtype


SPREAD = ("auto", "balanced", "balanced_low_0", "sequential")  # device maps over several devices


def loader_device(device=None, device_map=None):
    """The one device a loader is asked for: `device=`, or the one device a `device_map` names (a device,
    a GPU index or {"": device}); a map spreading the model over several devices is refused."""
    check_device(device)
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if isinstance(device_map, dict) or (isinstance(device_map, str) and device_map in SPREAD):
        raise ValueError(f"an MHLA model loads onto one device; got device_map={device_map!r} (pass a device such "
                         "as 'cuda', or move the model after loading)")
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        device_map = torch.device("cuda", device_map)
    if device is not None and device_map is not None and torch.device(device) != torch.device(device_map):
        raise ValueError(f"device={device!r} and device_map={device_map!r} disagree; give one")
    check_device(device_map)
    return device if device is not None else device_map


def check_device(device) -> None:
    """Refuse a device name torch does not know, or an accelerator this machine does not have,
    before anything loads (None: the caller's default)."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be like cpu, cuda or cuda:1; got {device!r}") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {device!r}: this machine has no usable CUDA GPU; use cpu")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"device {device!r}: this machine has {count} CUDA GPU(s), cuda:0 … cuda:{count - 1}")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available on this machine; use cpu")


def _floating_tensors(model: nn.Module):
    """(module, key, tensor, kept) for every floating parameter and buffer; `kept`: it stays in float32 (see
    the module doc)."""
    from transformers import PreTrainedModel

    from .layer import MHLAttention

    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    unsaved_buffers = isinstance(model, PreTrainedModel)
    for module_name, module in model.named_modules():
        for key, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None and tensor.is_floating_point():
                kept = (bool(keep & set(f"{module_name}.{key}".split(".")))
                        or (isinstance(module, MHLAttention) and key == "mixing")
                        or (unsaved_buffers and key in module._non_persistent_buffers_set))
                yield module, key, tensor, kept


def _set(module: nn.Module, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if isinstance(tensor, nn.Parameter):
        tensor.data = tensor.data.to(dtype)  # in place, so ties survive
    else:
        module._buffers[key] = tensor.to(dtype)


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters and buffers to `dtype`, except those kept in float32 (see the module doc;
    a plain `.to(dtype)` would cast those too). Parameters are cast in place, so ties survive."""
    for module, key, tensor, kept in list(_floating_tensors(model)):
        if not kept:
            _set(module, key, tensor, dtype)
        elif torch.finfo(tensor.dtype).bits < 32:
            _set(module, key, tensor, torch.float32)
    return model


def keep_fp32_modules(model: nn.Module) -> nn.Module:
    """Put the tensors kept in float32 (the model's `_keep_in_fp32_modules`, …) back in float32 where a loader
    left them in a lower precision (diffusers' `from_single_file` keeps them only for float16)."""
    for module, key, tensor, kept in list(_floating_tensors(model)):
        if kept and torch.finfo(tensor.dtype).bits < 32:
            _set(module, key, tensor, torch.float32)
    return model


def place_model(model: nn.Module, torch_dtype, device) -> nn.Module:
    dtype = parse_dtype(torch_dtype)
    if dtype is not None:
        cast_model(model, dtype)
    return model.to(device) if device is not None else model
