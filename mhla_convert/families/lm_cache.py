"""MHLA's recurrent state inside a transformers `Cache`, so `generate()` works unchanged.

`generate()` builds a `DynamicCache` or, with `cache_implementation="static"`, a `StaticCache`
from the model config, with one KV layer per decoder layer. An MHLA attention module swaps its
own slot for an MHLA cache layer the first time it sees the cache (`mhla_cache_layer`), so
nothing needs to know about MHLA ahead of time: not the config (`layer_types` must stay standard
for `save_pretrained`), not `generate`, not a user-made cache. Softmax layers of a hybrid keep
their ordinary KV layers.

Each MHLA cache layer holds a `DecodeState` (ops/recurrent.py): fixed-shape tensors allocated at the
prompt and updated in place (with retrieval heads, also their keys and values: a static cache's length of them).
The layer subclasses the one it replaces, so transformers sizes the masks of the softmax layers and counts tokens
the same way whichever layer it asks:
`MHLACacheLayer` (a `DynamicLayer`), `MHLAStaticLayer` (a `StaticLayer`: compileable, its length a
tensor, every tensor at a static address) and `MHLAStaticSlidingLayer` (a `StaticSlidingWindowLayer`,
for sliding-window hosts such as Mistral, with that class's length bookkeeping).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer, StaticSlidingWindowLayer

from ..layer import MHLAConfig
from ..ops.recurrent import DecodeState


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


class _MHLASlot:
    """What the three MHLA cache layers share: the state, prefill, decoding steps, crop, reorder."""

    capacity: int | None = None  # tokens the cache holds where fixed (a static cache's): the retrieval heads' buffers
    is_croppable = True  # rollback within the open chunk and the one before it (DecodeState.rollback)
    supports_early_init = False  # nothing to pre-allocate from K/V shapes

    def _init_slot(self) -> None:
        self.state: DecodeState | None = None
        self.has_state = False  # False until the prompt: the next call runs the parallel form

    def _count(self, tokens: int) -> None:
        raise NotImplementedError

    def _allocated(self, state: DecodeState) -> None:
        """Called once a new state is allocated (on the prompt, never while compiled)."""

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError(
            "this cache layer belongs to an MHLA attention and holds a recurrent state, not keys and values; "
            "call a softmax teacher without a cache (or with its own)"
        )

    def prefill(self, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, config: MHLAConfig, tokens: int,
                feature_map=None):
        """Start from a prompt: k, v (B, N, H_kv, D) hold each row's `lengths` real tokens first;
        `tokens` is the number of cache positions the call consumed (padding included); `feature_map`: the
        layer's (`MHLAttention.phi`)."""
        state = DecodeState.from_prompt(k, v, lengths, config, reuse=self.state, feature_map=feature_map,
                                        capacity=self.capacity)
        if state is not self.state:
            self.state = state
            self._allocated(state)
        self.has_state = True
        self._count(tokens)

    def decode(self, q, k, v, real: torch.Tensor | None, relative: torch.Tensor, config: MHLAConfig) -> torch.Tensor:
        """Continue the state token by token → output (B, N, H, Dv); `real` (B, N) marks non-padding."""
        out = self.state.steps(q, k, v, real, relative, config)
        self._count(q.shape[1])
        return out

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` tokens (transformers' convention: a count ≤ 0)."""
        if tokens_to_remove > 0:
            raise ValueError(f"an MHLA cache layer is cropped by a negative token count; got {tokens_to_remove}")
        if tokens_to_remove and self.has_state:
            self.state.rollback(-tokens_to_remove)
            self._count(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state.reorder(beam_idx)

    def reset(self) -> None:
        if self.state is not None:
            self.state.reset()
        self.has_state = False

    def offload(self) -> None:  # the state is small: it stays where the layer runs
        pass

    def prefetch(self) -> None:
        pass


class MHLACacheLayer(_MHLASlot, DynamicLayer):
    """The slot in a `DynamicCache`. Its length is a Python int: `get_seq_length` (hence positions)
    and `get_mask_sizes` (hence the masks of the softmax layers) count every token consumed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._init_slot()
        self.length = 0

    def _count(self, tokens: int) -> None:
        self.length += tokens

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        super().reset()
        self.length = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state.map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state.map(lambda t: t[indices])


class MHLAStaticLayer(_MHLASlot, StaticLayer):
    """The slot in a `StaticCache`: compileable. Its length is `cumulative_length`, a tensor updated
    in place as `StaticLayer`'s, and every state tensor is marked as a static address (CUDA graphs)."""

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self._init_slot()

    @property
    def capacity(self) -> int:
        return self.max_cache_len

    def _allocated(self, state: DecodeState) -> None:
        self.device = state.position.device
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not _is_compiling():
            for t in (*state.tensors(), self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def _count(self, tokens: int) -> None:
        self.cumulative_length.add_(tokens)

    def reset(self) -> None:
        super().reset()
        self.cumulative_length.zero_()


class MHLAStaticSlidingLayer(MHLAStaticLayer, StaticSlidingWindowLayer):
    """The slot replacing a `StaticSlidingWindowLayer`: it also keeps that class's Python-int length,
    which transformers sizes sliding-window masks with (MHLA itself has no window)."""

    def __init__(self, max_cache_len: int, **kwargs):
        # the replaced layer's window is already min(window, max_cache_len): keep it
        super().__init__(max_cache_len=max_cache_len, sliding_window=max_cache_len, **kwargs)

    def prefill(self, k, v, lengths, config: MHLAConfig, tokens: int, feature_map=None):
        if config.retrieval_heads:
            raise ValueError("retrieval heads read every earlier token, which a sliding-window cache layer does not "
                             "keep: decode with the dynamic cache (cache_implementation='dynamic') or convert without "
                             "retrieval_heads")
        super().prefill(k, v, lengths, config, tokens, feature_map)

    def _count(self, tokens: int) -> None:
        super()._count(tokens)
        self.cumulative_length_int += tokens

    def reset(self) -> None:
        super().reset()
        self.cumulative_length_int = 0


def mhla_cache_layer(cache: Cache, layer_idx: int) -> _MHLASlot:
    """The MHLA slot of `cache` for `layer_idx`, installed on first use.

    The slot it replaces must be empty: MHLA cannot continue from softmax keys and values.
    """
    layers = cache.layers
    while len(layers) <= layer_idx:  # a lazily grown DynamicCache() has no slot yet
        layers.append(DynamicLayer())
    slot = layers[layer_idx]
    if isinstance(slot, _MHLASlot):
        return slot
    if int(slot.get_seq_length()) > 0:
        raise ValueError(
            f"cache layer {layer_idx} already holds softmax keys/values; an MHLA layer cannot continue from them"
        )
    if isinstance(slot, StaticSlidingWindowLayer):
        layers[layer_idx] = MHLAStaticSlidingLayer(slot.max_cache_len)
    elif isinstance(slot, StaticLayer):
        layers[layer_idx] = MHLAStaticLayer(slot.max_cache_len)
    elif isinstance(slot, DynamicLayer):
        layers[layer_idx] = MHLACacheLayer()
    else:
        raise ValueError(
            f"an MHLA layer keeps its state in a dynamic or static cache layer; layer {layer_idx} is a "
            f"{type(slot).__name__}: use generate() with cache_implementation 'dynamic' or 'static'"
        )
    return layers[layer_idx]
