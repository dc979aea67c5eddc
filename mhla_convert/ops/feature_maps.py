"""Feature maps φ for linear attention. They must be non-negative so that every weight
w_ts = m·φ(q_t)·φ(k_s) is, which keeps the normaliser positive."""

from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F

FeatureMap = Union[str, Callable[[torch.Tensor], torch.Tensor]]


def _elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "elu": _elu_plus_one}


def resolve_feature_map(feature_map: FeatureMap) -> Callable[[torch.Tensor], torch.Tensor]:
    if callable(feature_map):
        return feature_map
    try:
        return FEATURE_MAPS[feature_map]
    except KeyError:
        raise ValueError(
            f"feature_map must be one of {sorted(FEATURE_MAPS)} or a callable; got {feature_map!r}"
        ) from None


def drop_keys(k: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """k (B, N, H, D) with the keys where `key_mask` (B, N) is False (padding) set to the dtype's lowest
    value, which every built-in feature map sends to 0: they add nothing to any summary."""
    return k if key_mask is None else k.masked_fill(~key_mask[:, :, None, None], torch.finfo(k.dtype).min)
