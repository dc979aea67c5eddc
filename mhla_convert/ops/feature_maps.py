"""Feature maps φ for linear attention. They must be non-negative so that every weight
w_ts = m·φ(q_t)·φ(k_s) is, which keeps the normaliser positive.

Fixed maps are named (`FEATURE_MAPS`: relu, elu + 1) and the kernels apply them inside. A learned map
(`LEARNED_FEATURE_MAPS`: hedgehog) has weights, so a layer owns one as a submodule and passes it to the
operators as a callable, which runs the torch paths.
"""

from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

FeatureMap = Union[str, Callable[[torch.Tensor], torch.Tensor]]


def _elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "elu": _elu_plus_one}


class HedgehogFeatureMap(nn.Module):
    """φ(x) = [softmax(x W), softmax(−x W)] over the feature axis, with one learned W (D × D) per key–value head
    (the query heads of a group share their key head's), after Hedgehog (Zhang et al., 2024) as LoLCATs uses it:
    the softmax makes φ(q)·φ(k) peak where q and k favour the same features, so a linear read can pick out a few
    keys as softmax attention does, where relu or elu + 1 spread weight over every key. φ has 2·D features
    (`features`): summaries and decoding states take twice the memory of a fixed map's.

    Takes (…, h, D) for h = H_kv key heads or H query heads (a multiple of H_kv). W starts as a random orthogonal
    matrix (the same seeded draw in every layer, so conversion is reproducible); attention transfer fits it.
    """

    def __init__(self, kv_heads: int, head_dim: int, *, device=None, dtype=None):
        super().__init__()
        self.kv_heads, self.features = kv_heads, 2 * head_dim
        self.weight = nn.Parameter(torch.empty(kv_heads, head_dim, head_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.is_meta:
            return
        draw = torch.randn(*self.weight.shape[1:], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        columns = torch.linalg.qr(draw).Q.to(self.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(columns.expand_as(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.shape[-2]
        grouped = x.unflatten(-2, (self.kv_heads, heads // self.kv_heads))  # (…, H_kv, g, D)
        z = torch.einsum("...hgd,hdf->...hgf", grouped, self.weight.to(x.dtype)).flatten(-3, -2)
        return torch.cat([z.softmax(-1), (-z).softmax(-1)], -1)

    def extra_repr(self) -> str:
        return f"kv_heads={self.kv_heads}, head_dim={self.weight.shape[1]}"


LEARNED_FEATURE_MAPS: dict[str, type[nn.Module]] = {"hedgehog": HedgehogFeatureMap}


def check_feature_map(feature_map) -> None:
    """Refuse what is neither a feature map's name (fixed or learned) nor a callable."""
    named = isinstance(feature_map, str) and (feature_map in FEATURE_MAPS or feature_map in LEARNED_FEATURE_MAPS)
    if not (named or callable(feature_map)):
        names = sorted([*FEATURE_MAPS, *LEARNED_FEATURE_MAPS])
        raise ValueError(f"feature_map must be one of {names} or a callable; got {feature_map!r}")


def resolve_feature_map(feature_map: FeatureMap) -> Callable[[torch.Tensor], torch.Tensor]:
    if callable(feature_map):
        return feature_map
    if feature_map in LEARNED_FEATURE_MAPS:
        raise ValueError(f"feature_map {feature_map!r} has weights: the operators take the module itself "
                         f"(an MHLA layer with feature_map={feature_map!r} owns one as `.feature_map`)")
    check_feature_map(feature_map)
    return FEATURE_MAPS[feature_map]


def drop_keys(k: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """k (B, N, H, D) with the keys where `key_mask` (B, N) is False (padding) set to the dtype's lowest
    value, which every fixed feature map sends to 0: they add nothing to any summary (the kernels' way)."""
    return k if key_mask is None else k.masked_fill(~key_mask[:, :, None, None], torch.finfo(k.dtype).min)


def key_features(phi: Callable[[torch.Tensor], torch.Tensor], k: torch.Tensor,
                 key_mask: torch.Tensor | None) -> torch.Tensor:
    """φ(k) for k (B, N, H, D), zero at the keys where `key_mask` (B, N) is False (padding), whatever φ is."""
    features = phi(k)
    return features if key_mask is None else features.masked_fill(~key_mask[:, :, None, None], 0)
