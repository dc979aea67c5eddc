"""Fused Triton kernels for MHLA. Importing this registers the "triton" backend of `mhla_attention`,
of a causal layer's in-place decoding step and its start from a prompt, and of the q/k norm + rotary ops;
without Triton the import fails and `dispatch` keeps the torch path."""

import triton  # noqa: F401  (ImportError here means: no Triton backend)

from ..ops.dispatch import register
from .decode_triton import decode_step_triton, decode_supports, prompt_supports, prompt_triton
from .mhla_triton import (
    mhla_attention_triton,
    mhla_attention_triton_backward,
    mhla_attention_triton_traced,
    supports,
    unsupported_reason,
)
from .rotary_triton import (
    norm_rotate_half_supports,
    norm_rotate_half_triton,
    norm_rotate_supports,
    norm_rotate_triton,
    norm_rotate_unsupported_reason,
)

register("attention", "triton", mhla_attention_triton, supports, mhla_attention_triton_backward,
         mhla_attention_triton_traced)
register("rotary", "triton", norm_rotate_triton, norm_rotate_supports)
register("rotary_half", "triton", norm_rotate_half_triton, norm_rotate_half_supports)
register("decode", "triton", decode_step_triton, decode_supports)
register("prompt", "triton", prompt_triton, prompt_supports)

__all__ = [
    "decode_step_triton", "decode_supports", "mhla_attention_triton", "norm_rotate_supports", "norm_rotate_triton",
    "norm_rotate_unsupported_reason", "prompt_supports", "prompt_triton", "supports", "unsupported_reason",
]

# (register the "exact_blocks", "exact" and "joint" backends)
from . import exact_blocks_triton, exact_triton, joint_triton  # noqa: E402, F401
