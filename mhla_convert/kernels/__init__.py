"""Fused Triton kernels for MHLA. Importing this registers the "triton" backend of
`mhla_attention`; without Triton the import fails and `dispatch` keeps the torch path."""

import triton  # noqa: F401  (ImportError here means: no Triton backend)

from ..ops.dispatch import register_backend
from .mhla_triton import mhla_attention_triton, supports, unsupported_reason

register_backend("triton", mhla_attention_triton, supports)

__all__ = ["mhla_attention_triton", "supports", "unsupported_reason"]
