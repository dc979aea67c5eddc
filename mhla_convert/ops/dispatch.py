"""Backend selection for the operators (`mhla_attention`, the decoding state, the rotary ops).

Kernels register per operator: `register(op, name, impl, supports)`. `select` returns the torch
implementation for "torch"; for "auto" the first registered backend whose `supports(*args, **kw)`
accepts the inputs (device, dtype, shapes, …), else torch, logging the choice once at debug level;
a named backend is returned as is (its implementation refuses inputs it cannot take, by name).

Operators and their implementation signatures:
- "attention": `ops.mhla.mhla_attention_torch`; supports(q, k, v, mixing, layout, *, causal, phi); an optional
  backward(do, q, k, v, mixing, layout, *, causal, phi, normalize, scale, eps, needs_grad) → (dq, dk, dv, dmixing);
  an optional traced(q, k, v, mixing, layout, *, causal, feature_map, normalize, scale, eps) → output, or None where
  it declines: inference inside a graph torch.compile traces;
- "rotary": `ops.rotary.norm_rotate_torch`; supports(x, cos, sin, *, head_dim, norm);
- "rotary_half": `ops.rotary.norm_rotate_half_torch`; supports(x, cos, sin, *, head_dim, norm);
- "exact" (causal attention with exact local chunks): `ops.exact_local.mhla_attention_exact_local_torch`;
  supports(q, k, v, mixing, layout, *, exact_chunks, phi, key_mask); an optional
  backward(do, q, k, v, mixing, layout, *, exact_chunks, phi, scale, eps, needs_grad, key_mask) → (dq, dk, dv, dmixing);
- "exact_blocks" (non-causal attention with an exact block neighbourhood):
  `ops.exact_blocks.mhla_attention_exact_blocks_torch`; supports(q, k, v, mixing, layout, *, exact_radius, phi,
  key_mask); an optional backward as "exact"'s, with exact_radius for exact_chunks;
- "joint" (joint text–image attention of MM-DiT families): `ops.joint.joint_attention_torch`; supports(q, k, v,
  mixing, layout, *, text, exact_radius, phi, text_mask, text_exact);
- "decode" (a causal layer's decoding step on its `DecodeState`, in place): `ops.recurrent.DecodeState.step_torch`;
  supports(state, q, k, v, relative, *, phi);
- "prompt" (a causal layer's `DecodeState` started afresh from a prompt, in place):
  `ops.recurrent.DecodeState.prefill_torch`; supports(state, k, v, lengths).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger("mhla_convert.ops")

OPS = ("attention", "rotary", "rotary_half", "exact", "exact_blocks", "joint", "decode", "prompt")
_REGISTRY: dict[str, dict[str, tuple[Callable, Callable[..., bool]]]] = {op: {} for op in OPS}
_BACKWARDS: dict[Callable, Callable] = {}
_TRACED: dict[Callable, Callable] = {}
_logged: set[tuple] = set()
_loaded = False


def register(op: str, name: str, impl: Callable, supports: Callable[..., bool],
             backward: Callable | None = None, traced: Callable | None = None) -> None:
    """`backward`: the gradients of `impl` from its inputs alone, for the op's backward under torch.compile (see
    `ops.mhla.attention_op`); without one, `impl` runs again under `torch.func.vjp`. `traced`: a form of `impl` for
    inference inside a graph torch.compile traces, which returns None where it declines (see `ops.mhla`)."""
    _REGISTRY[op][name] = (impl, supports)
    if backward is not None:
        _BACKWARDS[impl] = backward
    if traced is not None:
        _TRACED[impl] = traced


def backward_of(impl: Callable) -> Callable | None:
    return _BACKWARDS.get(impl)


def traced_of(impl: Callable) -> Callable | None:
    return _TRACED.get(impl)


def register_backend(name: str, impl: Callable, supports: Callable[..., bool],
                     backward: Callable | None = None) -> None:
    """A backend of `mhla_attention` (the public extension point)."""
    register("attention", name, impl, supports, backward)


def _load_optional_backends() -> None:
    """Import the kernels once (on first use: they import `ops`); they register on import, and
    absent or broken Triton just means torch only."""
    global _loaded
    if not _loaded:
        _loaded = True
        try:
            import mhla_convert.kernels  # noqa: F401
        except ImportError:
            pass


def available_backends(op: str = "attention") -> list[str]:
    _load_optional_backends()
    return ["torch", *sorted(_REGISTRY[op])]


def select(op: str, backend: str, torch_impl: Callable, *args, **kwargs) -> Callable:
    """The implementation of `op` for `backend` ("auto", "torch" or a registered name)."""
    if backend == "torch":
        return torch_impl
    _load_optional_backends()
    table = _REGISTRY[op]
    if backend == "auto":
        for name, (impl, supports) in table.items():
            if supports(*args, **kwargs):
                _log_once(op, name, args)
                return impl
        _log_once(op, "torch", args)
        return torch_impl
    if backend not in table:
        raise ValueError(f"backend must be one of {['auto', *available_backends(op)]}; got {backend!r}")
    return table[backend][0]


def _log_once(op: str, name: str, args) -> None:
    if torch.compiler.is_compiling():  # (a traced graph neither logs nor keeps this set)
        return
    x = next(a for a in args if hasattr(a, "dtype"))  # the first tensor argument
    key = (op, name, x.device.type, x.dtype)
    if key not in _logged:
        _logged.add(key)
        logger.debug("%s: %s backend for %s %s", op, name, x.device.type, x.dtype)
