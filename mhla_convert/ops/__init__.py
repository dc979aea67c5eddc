"""MHLA operators: `mhla_attention` (parallel, any backend), the O(N²) reference, and the
recurrent step for causal decoding."""

from .blocks import BlockLayout
from .dispatch import available_backends, register_backend
from .exact_local import ExactLocalState, exact_local_step, init_exact_state
from .feature_maps import FEATURE_MAPS, resolve_feature_map
from .mhla import check_inputs, mhla_attention, mhla_attention_torch
from .recurrent import MHLAState, init_state, mhla_recurrent_step
from .reference import mhla_attention_reference, mhla_weights_reference

__all__ = [
    "BlockLayout", "ExactLocalState", "FEATURE_MAPS", "MHLAState", "available_backends", "check_inputs",
    "exact_local_step", "init_exact_state", "init_state",
    "mhla_attention", "mhla_attention_reference", "mhla_attention_torch", "mhla_recurrent_step",
    "mhla_weights_reference", "register_backend", "resolve_feature_map",
]
