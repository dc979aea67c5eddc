"""MHLA's recurrent state inside a transformers `Cache`, so `generate()` works unchanged.

`generate()` builds a `DynamicCache` from the model config with one KV layer per decoder layer.
An MHLA attention module swaps its own slot for an `MHLACacheLayer` the first time it sees the
cache (`mhla_cache_layer`), so nothing needs to know about MHLA ahead of time: not the config
(`layer_types` must stay standard for `save_pretrained`), not `generate`, not a user-made cache.
Softmax layers of a hybrid model keep their ordinary KV layers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from ..ops import MHLAState


class MHLACacheLayer(DynamicLayer):
    """One MHLA layer's slot: holds an `MHLAState` (fixed size) instead of growing K/V tensors.

    It subclasses `DynamicLayer` so that transformers treats it as a full-attention layer when it
    asks the cache for lengths: `get_seq_length` (hence positions) and `get_mask_sizes` (hence
    the masks of the softmax layers in a hybrid) report the true number of tokens consumed.
    """

    is_croppable = False  # a running sum cannot forget tokens: no assisted / speculative rollback
    supports_early_init = False  # nothing to pre-allocate from K/V shapes

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state: MHLAState | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError(
            "this cache layer belongs to an MHLA attention and holds a recurrent state, not keys and values; "
            "call a softmax teacher without past_key_values (or with its own cache)"
        )

    def get_seq_length(self) -> int:
        return 0 if self.state is None else self.state.position

    def reset(self) -> None:
        self.state = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError("an MHLA recurrent state cannot be cropped (it keeps sums, not per-token keys)")

    def _map(self, fn) -> None:
        if self.state is not None:
            self.state = self.state.map(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def offload(self) -> None:  # the state is small: it stays where the layer runs
        pass

    def prefetch(self) -> None:
        pass


def mhla_cache_layer(cache: Cache, layer_idx: int) -> MHLACacheLayer:
    """The MHLA slot of `cache` for `layer_idx`, installed on first use.

    The slot it replaces must be empty: MHLA cannot continue from softmax keys and values.
    """
    layers = cache.layers
    while len(layers) <= layer_idx:  # a lazily grown DynamicCache() has no slot yet
        layers.append(DynamicLayer())
    slot = layers[layer_idx]
    if isinstance(slot, MHLACacheLayer):
        return slot
    if isinstance(slot, StaticLayer):
        raise ValueError("MHLA layers need a dynamic cache: call generate() without cache_implementation='static'")
    if slot.get_seq_length() > 0:
        raise ValueError(
            f"cache layer {layer_idx} already holds softmax keys/values; an MHLA layer cannot continue from them"
        )
    layers[layer_idx] = MHLACacheLayer()
    return layers[layer_idx]
