"""Fused Triton kernels for MHLA. Importing this registers the "triton" backend of
`mhla_attention`
and of the recurrent decoding step; without Triton the import fails and `dispatch` keeps the torch path."""

import triton  # noqa: F401  (ImportError here means: no Triton backend)

from ..ops.dispatch import register_backend, register_step_backend
from .mhla_triton import mhla_attention_triton, supports, unsupported_reason
from .recurrent_triton import mhla_recurrent_step_triton, step_supports, step_unsupported_reason

register_backend("triton", mhla_attention_triton, supports)
register_step_backend("triton", mhla_recurrent_step_triton, step_supports)

__all__ = ["mhla_attention_triton", "mhla_recurrent_step_triton", "step_supports", "step_unsupported_reason",
           "supports", "unsupported_reason"]
