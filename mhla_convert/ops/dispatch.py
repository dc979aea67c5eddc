"""Backend selection for `mhla_attention`. Kernels register themselves here; `auto` picks the
first registered backend that accepts the inputs and falls back to torch.

A backend's `supports(q, k, v, mixing, layout, *, causal, phi) -> bool` sees everything that can
rule it out (device, dtype, head dims, feature map, chunk size); its implementation has the torch
path's signature (`ops.mhla.mhla_attention_torch`).

The recurrent decoding step (`ops.recurrent.mhla_recurrent_step`) has its own registry, same rules:
`supports(state, q, k, v, relative, *, phi) -> bool`, and an implementation
`impl(state, q, k, v, relative, *, phi, normalize, scale, eps) -> (output, new cur_s, new cur_z)`
(`ops.recurrent.step_torch`); closing a chunk stays with the caller."""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger("mhla_convert.ops")

# name -> (implementation, supports)
_BACKENDS: dict[str, tuple[Callable, Callable[..., bool]]] = {}
_STEP_BACKENDS: dict[str, tuple[Callable, Callable[..., bool]]] = {}
_logged: set[tuple] = set()


def register_backend(name: str, impl: Callable, supports: Callable[..., bool]) -> None:
    _BACKENDS[name] = (impl, supports)


def register_step_backend(name: str, impl: Callable, supports: Callable[..., bool]) -> None:
    _STEP_BACKENDS[name] = (impl, supports)


def _torch_impl():
    from .mhla import mhla_attention_torch

    return mhla_attention_torch


def available_backends() -> list[str]:
    _load_optional_backends()
    return ["torch", *sorted(_BACKENDS)]


def _load_optional_backends() -> None:
    try:  # kernels register on import; absent or broken Triton just means torch only
        import mhla_convert.kernels  # noqa: F401
    except ImportError:
        pass


def select_backend(backend: str, q, k, v, mixing, layout, *, causal: bool, phi) -> Callable:
    if backend == "torch":
        return _torch_impl()
    _load_optional_backends()
    if backend == "auto":
        for name, (impl, supports) in _BACKENDS.items():
            if supports(q, k, v, mixing, layout, causal=causal, phi=phi):
                _log_once(name, q, causal)
                return impl
        _log_once("torch", q, causal)
        return _torch_impl()
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {['auto', *available_backends()]}; got {backend!r}")
    return _BACKENDS[backend][0]


def select_step_backend(backend: str, state, q, k, v, relative, *, phi) -> Callable:
    """The implementation of one recurrent step: `auto` takes the first registered backend that
    accepts the inputs (Triton on CUDA), else torch."""
    from .recurrent import step_torch

    if backend == "torch":
        return step_torch
    _load_optional_backends()
    if backend == "auto":
        for name, (impl, supports) in _STEP_BACKENDS.items():
            if supports(state, q, k, v, relative, phi=phi):
                _log_once(f"{name} step", q, True)
                return impl
        _log_once("torch step", q, True)
        return step_torch
    if backend not in _STEP_BACKENDS:
        raise ValueError(f"backend must be one of {['auto', 'torch', *sorted(_STEP_BACKENDS)]}; got {backend!r}")
    return _STEP_BACKENDS[backend][0]


def _log_once(name: str, q: torch.Tensor, causal: bool) -> None:
    key = (name, q.device.type, q.dtype, causal)
    if key not in _logged:
        _logged.add(key)
        logger.debug("mhla_attention: %s backend for %s %s causal=%s", name, q.device.type, q.dtype, causal)
