"""MHLA operators: `mhla_attention` (parallel, any backend), the O(N²) reference, and the
recurrent decoding state of a causal layer."""

from .blocks import BlockLayout
from .dispatch import available_backends, register_backend
from .feature_maps import FEATURE_MAPS, resolve_feature_map
from .mhla import check_inputs, mhla_attention, mhla_attention_torch
from .recurrent import DecodeState
from .reference import mhla_attention_reference, mhla_weights_reference

__all__ = [
    "BlockLayout", "DecodeState", "FEATURE_MAPS", "available_backends", "check_inputs", "mhla_attention",
    "mhla_attention_reference", "mhla_attention_torch", "mhla_weights_reference", "register_backend",
    "resolve_feature_map",
]
