"""Retrieval heads: key heads of a causal MHLA layer whose query heads keep the host's softmax over every
earlier token, while the layer's other heads run MHLA.

A linear summary is a fixed-size memory: it cannot look one token up among thousands, which is what copying from
far back needs (an induction head). Keeping a few heads exact gives that back at a cost proportional to their
share of the key heads: their keys and values are cached whole while decoding, the other heads keep MHLA's
fixed-size state. Which heads: `MHLAConfig.retrieval_heads`, key-head indices (the query heads reading a key head,
under grouped-query attention, go with it).

`split_heads` / `merge_heads`: the head bookkeeping shared by the parallel form and decoding.
`retrieval_attention`: the parallel form (causal softmax, the host's √D scale).
`RetrievalCache`: the retrieval heads' keys and values while decoding, each row at its own position.
`far_retrieval` / `choose_retrieval_heads`: which heads to keep, from the original's attention on calibration data
(`convert(retrieval_share=...)`): the heads that retrieve single tokens beyond the exact region most sharply.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=None)
def _head_order(retrieval: tuple[int, ...], kv_heads: int, groups: int) -> tuple[list[int], list[int], list[int]]:
    """(the MHLA heads' indices, the retrieval heads', the inverse of their concatenation) among kv_heads · groups
    heads; computed once per layout."""
    def heads(kv):
        return [h * groups + j for h in kv for j in range(groups)]

    linear, far = heads(h for h in range(kv_heads) if h not in retrieval), heads(sorted(retrieval))
    order = linear + far
    return linear, far, sorted(range(len(order)), key=order.__getitem__)


def split_heads(x: torch.Tensor, retrieval: tuple[int, ...], kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, N, H, ·) with H a multiple of `kv_heads` (key heads, or the query heads reading them) → (the MHLA
    heads', the retrieval heads'), each in head order."""
    linear, far, _ = _head_order(retrieval, kv_heads, x.shape[2] // kv_heads)
    return x[:, :, linear], x[:, :, far]


def merge_heads(linear: torch.Tensor, retrieval_out: torch.Tensor, retrieval: tuple[int, ...],
                kv_heads: int) -> torch.Tensor:
    """`split_heads`' inverse on outputs (B, N, ·, Dv) → (B, N, H, Dv)."""
    _, _, inverse = _head_order(retrieval, kv_heads, (linear.shape[2] + retrieval_out.shape[2]) // kv_heads)
    return torch.cat([linear, retrieval_out.to(linear.dtype)], 2)[:, :, inverse]


def _softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q (B, Nq, Hq, D), k / v (B, Nk, Hr, ·), `mask` bool broadcastable to (B, Hq, Nq, Nk) or None (causal) →
    (B, Nq, Hq, Dv)."""
    groups = q.shape[2] // k.shape[2]
    k, v = (t.transpose(1, 2).repeat_interleave(groups, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, is_causal=mask is None)
    return out.transpose(1, 2)


def retrieval_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention of query heads q (B, N, Hq, D) over keys k / values v (B, N, Hr, ·) → (B, N, Hq, Dv);
    `key_mask` (B, N) bool marks real keys (a query always reads itself, so padding rows stay finite)."""
    if key_mask is None:
        return _softmax(q, k, v, None)
    n = q.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    own = torch.eye(n, dtype=torch.bool, device=q.device)
    return _softmax(q, k, v, (causal & (key_mask[:, None, None, :] | own)))


class RetrievalCache:
    """The retrieval heads' keys and values (B, capacity, H_r, ·) in the model dtype, and each row's number of real
    tokens, `position` (B,): token t of a row sits at index t. A `capacity` given at the prompt is fixed (a static
    cache's length: every tensor keeps its address, for CUDA graphs); without one the buffers grow as tokens come."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, capacity: int | None):
        batch, n, heads, _ = k.shape
        self.fixed = capacity is not None
        size = capacity if self.fixed else max(2 * n, 64)
        self.keys = k.new_zeros(batch, size, heads, k.shape[-1])
        self.values = v.new_zeros(batch, size, heads, v.shape[-1])
        self.position = torch.zeros(batch, dtype=torch.long, device=k.device)
        self.consumed = 0  # growable: tokens taken, padding included, a bound on every row's position

    @classmethod
    def from_prompt(cls, k, v, lengths: torch.Tensor, capacity: int | None,
                    reuse: RetrievalCache | None = None) -> RetrievalCache:
        """Start from the prompt's keys and values (B, N, H_r, ·), each row's `lengths` real tokens first."""
        if capacity is not None and k.shape[1] > capacity:
            raise ValueError(f"a prompt of {k.shape[1]} tokens does not fit a cache of {capacity}: raise max_cache_len")
        cache = reuse if reuse is not None and reuse.fits(k, v, capacity) else cls(k, v, capacity)
        with torch.no_grad():  # (what lies past a row's position is never read: the mask stops there)
            cache.keys[:, : k.shape[1]] = k
            cache.values[:, : v.shape[1]] = v
            cache.position.copy_(lengths)
        if not cache.fixed:
            cache.consumed = k.shape[1]
        return cache

    def fits(self, k, v, capacity: int | None) -> bool:
        return (self.fixed and capacity == self.keys.shape[1] and self.keys.shape[0] == k.shape[0]
                and self.keys.shape[2:] == k.shape[2:] and self.values.shape[-1] == v.shape[-1]
                and self.keys.dtype == k.dtype and self.keys.device == k.device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.position]

    def _grow(self) -> None:
        """Make room for one more token (growable buffers; a fixed capacity is the cache's length, which
        `generate()` keeps within)."""
        if self.consumed >= self.keys.shape[1]:
            self.keys, self.values = (torch.cat([t, torch.zeros_like(t)], 1) for t in (self.keys, self.values))
        self.consumed += 1

    def step(self, q, k, v, real: torch.Tensor | None) -> torch.Tensor:
        """One token per row: q (B, 1, Hq, D), k / v (B, 1, H_r, ·), `real` (B,) bool (None: all) → (B, 1, Hq, Dv).
        A token that is not real is neither stored nor counted (its output is finite and unused)."""
        if not self.fixed:
            self._grow()
        batch = k.shape[0]
        adv = torch.ones(batch, dtype=torch.bool, device=k.device) if real is None else real
        rows = torch.arange(batch, device=k.device)
        slot = self.position.clamp(max=self.keys.shape[1] - 1)
        with torch.no_grad():
            keep = adv.view(-1, 1, 1)
            self.keys[rows, slot] = torch.where(keep, k[:, 0], self.keys[rows, slot])
            self.values[rows, slot] = torch.where(keep, v[:, 0], self.values[rows, slot])
        seen = torch.arange(self.keys.shape[1], device=k.device) <= slot[:, None]  # (B, capacity)
        out = _softmax(q, self.keys, self.values, seen[:, None, None, :])
        with torch.no_grad():
            self.position.add_(adv)
        return out

    @torch.no_grad()
    def rollback(self, tokens: int) -> None:
        self.position.sub_(tokens).clamp_(min=0)
        if not self.fixed:
            self.consumed = max(self.consumed - tokens, 0)

    def map(self, fn) -> None:
        self.keys, self.values, self.position = (fn(t) for t in self.tensors())

    @torch.no_grad()
    def reset(self) -> None:
        for t in self.tensors():
            t.zero_()
        self.consumed = 0


_QUERY_ROWS = 256  # queries per score matrix in `far_retrieval`


@torch.no_grad()
def far_retrieval(q: torch.Tensor, k: torch.Tensor, chunk_size: int, exact_chunks: int) -> torch.Tensor:
    """Per key head (H_kv,): how sharply its queries retrieve single tokens beyond their exact region, which is what
    a linear summary cannot do. For each query of q (B, N, H, D), the largest causal softmax weight it gives one key
    of k (B, N, H_kv, D) outside its exact region (`exact_chunks` chunks of `chunk_size` tokens, its own included),
    squared so that one sharp read outweighs many diffuse ones; the first token is left out (attention sinks park
    weight there, which retrieves nothing). The mean over queries, the largest over a key head's query heads."""
    batch, n, heads, dim = q.shape
    kv_heads = k.shape[2]
    keys = k.float().transpose(1, 2).repeat_interleave(heads // kv_heads, 1)  # (B, H, N, D)
    positions = torch.arange(n, device=q.device)
    total = torch.zeros(heads, device=q.device)
    for start in range(0, n, _QUERY_ROWS):
        rows = positions[start : start + _QUERY_ROWS]
        scores = q[:, rows].float().transpose(1, 2) @ keys.transpose(-1, -2) * dim**-0.5  # (B, H, rows, N)
        p = scores.masked_fill(rows[:, None] < positions, float("-inf")).softmax(-1)
        far = ((rows[:, None] // chunk_size - positions // chunk_size) >= exact_chunks) & (positions > 0)
        total += p.masked_fill(~far, 0).amax(-1).square().sum((0, -1))
    return (total / (batch * n)).view(kv_heads, -1).amax(-1)


def choose_retrieval_heads(scores: dict[int, torch.Tensor], share: float) -> dict[int, tuple[int, ...]]:
    """The retrieval heads for `share` (0 … 1) of all key heads in `scores` ({layer: `far_retrieval` per key head}):
    the highest scores across layers, at least one head, never every head of a layer → {layer: heads}."""
    ranked = sorted(((float(s), layer, head) for layer, row in scores.items() for head, s in enumerate(row)),
                    reverse=True)
    wanted = max(1, round(share * len(ranked)))
    chosen: dict[int, list[int]] = {}
    for _, layer, head in ranked:
        if sum(map(len, chosen.values())) == wanted:
            break
        if len(chosen.get(layer, [])) < len(scores[layer]) - 1:
            chosen.setdefault(layer, []).append(head)
    return {layer: tuple(sorted(heads)) for layer, heads in sorted(chosen.items())}
