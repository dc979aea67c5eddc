"""Recurrent (token-by-token) causal MHLA for decoding, with a relative (Toeplitz) mixing: `DecodeState`.

With m_ij = r[min(i − j, W − 1)], query chunk i reads
    P_i = Σ_{δ=1}^{W-2} r[δ] S_{i−δ} + r[W−1] · Σ_{j ≤ i−W+1} S_j + r[0] · (current chunk so far),
so the state keeps the current chunk's summary, the last W−2 closed chunk summaries and one
running sum of everything older — its size never grows with the sequence:

    floats per layer = W · B · H_kv · D · (D_v + 1)        (kept in float32)

and each token costs O(W · D · D_v), whatever its position. Outputs equal the chunkwise parallel
form (`mhla_attention(..., causal=True, chunk_size=C)` with `toeplitz_causal_mixing(r, M)`).

The state's tensors are allocated once, at the prompt, and every later token changes them in place
without Python-side branching (chunk closes are `torch.where` per row in `DecodeState.step_torch`, masked
writes in the one-launch Triton step of `kernels.decode_triton`): the same code serves `MHLAttention.decode`,
an LM's `DynamicCache` and its `StaticCache` under `torch.compile` / CUDA graphs (families/lm_cache.py).
Each row of the batch is at its own position (the number of real tokens it has consumed), so left-padded
rows chunk their tokens exactly as they would alone.

Besides the summaries it holds what rolling back needs (`rollback`, for assisted / speculative decoding):

- the (recent, far) summaries as they were before the last chunk close, and
- a ring of the last 2·C tokens' keys and values (C = chunk size),

so any rollback that stays within the open chunk and the one before it — at least C tokens — is
rebuilt exactly: the summaries come back from the copy, the open chunk is re-summed from the
ring. Rolling back further raises. Memory: 2W − 1 summaries instead of W, plus 2·C·H_kv·(D + D_v)
key/value numbers in the model dtype, per row.

With `exact_chunks = L > 0` (ops.exact_local) the same ring, (L + 2)·C slots, is the exact window:
a token reads the ring's tokens of its own chunk and the L − 1 before it with the softmax kernel,
and only the summaries of older chunks.

With retrieval heads (ops.retrieval) the state covers the MHLA heads alone and keeps a `RetrievalCache`, the
retrieval heads' keys and values, beside it; every method below serves both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .dispatch import select
from .exact_local import read_window, window_relative
from .feature_maps import resolve_feature_map
from .retrieval import RetrievalCache, merge_heads, split_heads

if TYPE_CHECKING:
    from ..layer import MHLAConfig

_PREFILL_GROUP = 1024  # tokens per partial product in `DecodeState.older_sums_torch`
FIELDS = (
    "position", "cur_s", "cur_z", "recent_s", "recent_z", "far_s", "far_z",
    "back_recent_s", "back_recent_z", "back_far_s", "back_far_z", "back_valid", "ring_k", "ring_v", "arrivals",
)


def _per_row(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) → broadcastable against `like` (B, ...)."""
    return mask.view(-1, *(1,) * (like.dim() - 1))


class DecodeState:
    """The recurrent state of one layer for `batch` rows; see the module docstring.

    Tensors (B rows, H = H_kv, K = W − 2 summaries kept, R ring slots: 2·C, (exact_chunks + 2)·C with exact chunks):
    position (B,) real tokens consumed; cur_s / cur_z (B, H, D, Dv) / (B, H, D) the open chunk;
    recent_s / recent_z (B, H, K, D, Dv) / (B, H, K, D), oldest first, zeros before the first
    closes; far_s / far_z every older chunk; back_* the recent / far summaries before the last
    close and back_valid whether they are known; ring_k / ring_v (B, R, H, D) / (B, R, H, Dv): the
    token at position t sits in slot t mod R.
    """

    def __init__(self, batch: int, kv_heads: int, dim: int, dv: int, *, chunk_size: int, window: int,
                 feature_map, dtype: torch.dtype, device: torch.device, exact_chunks: int = 0):
        """`dim`: the keys' size; the summaries' is φ's (`features` of a learned map, else `dim`)."""
        acc = torch.promote_types(dtype, torch.float32)
        self.chunk_size, self.window, self.keep = chunk_size, window, max(window - 2, 0)
        # exact chunks: the window (≤ L·C tokens) must survive a rollback (< 2·C tokens) whose rejected tokens
        # overwrote the slots before it
        self.exact_chunks, self.slots = exact_chunks, (exact_chunks + 2 if exact_chunks else 2) * chunk_size
        self.feature_map = feature_map
        self.phi = resolve_feature_map(feature_map)
        features = getattr(self.phi, "features", dim)

        def zeros(*shape, dtype=acc):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.position = zeros(batch, dtype=torch.long)
        self.cur_s, self.cur_z = zeros(batch, kv_heads, features, dv), zeros(batch, kv_heads, features)
        self.recent_s = zeros(batch, kv_heads, self.keep, features, dv)
        self.recent_z = zeros(batch, kv_heads, self.keep, features)
        self.far_s, self.far_z = zeros(batch, kv_heads, features, dv), zeros(batch, kv_heads, features)
        self.back_recent_s, self.back_recent_z = torch.zeros_like(self.recent_s), torch.zeros_like(self.recent_z)
        self.back_far_s, self.back_far_z = torch.zeros_like(self.far_s), torch.zeros_like(self.far_z)
        self.back_valid = zeros(batch, dtype=torch.bool)
        self.ring_k = zeros(batch, self.slots, kv_heads, dim, dtype=dtype)
        self.ring_v = zeros(batch, self.slots, kv_heads, dv, dtype=dtype)
        self.arrivals = zeros(batch, kv_heads, dtype=torch.int32)  # the fused step's counter, 0 between steps
        self.retrieval: RetrievalCache | None = None  # the retrieval heads' keys and values (`from_prompt`)
        self.retrieval_heads, self.all_kv_heads = (), kv_heads

    @classmethod
    def from_prompt(cls, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, config: MHLAConfig,
                    reuse: DecodeState | None = None, feature_map=None, capacity: int | None = None) -> DecodeState:
        """A state started from a prompt of keys k (B, N, H_kv, D) and values v (B, N, H_kv, Dv) that hold each row's
        `lengths` real tokens first, for a causal layer of `config`: `reuse`, restarted in place where it fits (a
        static cache's), else a new one. `feature_map`: the layer's (`MHLAttention.phi`), if not the config's;
        `capacity`: the tokens a static cache holds (its retrieval heads' buffers; None: they grow)."""
        feature_map = config.feature_map if feature_map is None else feature_map
        settings = dict(chunk_size=config.chunk_size, window=config.window, feature_map=feature_map,
                        exact_chunks=config.exact_chunks)
        all_kv_heads, retrieval = k.shape[2], config.retrieval_heads
        if retrieval:
            (k, kr), (v, vr) = split_heads(k, retrieval, all_kv_heads), split_heads(v, retrieval, all_kv_heads)
        state = reuse
        if state is None or not state.fits(k, v, **settings):
            state = cls(k.shape[0], k.shape[2], k.shape[3], v.shape[3], dtype=k.dtype, device=k.device, **settings)
        state.prefill(k, v, lengths, backend=config.backend)
        state.retrieval_heads, state.all_kv_heads = retrieval, all_kv_heads
        state.retrieval = RetrievalCache.from_prompt(kr, vr, lengths, capacity, state.retrieval) if retrieval else None
        return state

    def tensors(self) -> list[torch.Tensor]:
        """The state's tensors: `FIELDS` in order, then the retrieval heads' keys, values and positions."""
        return [getattr(self, name) for name in FIELDS] + (self.retrieval.tensors() if self.retrieval else [])

    def fits(self, k: torch.Tensor, v: torch.Tensor, chunk_size: int, window: int, feature_map,
             exact_chunks: int = 0) -> bool:
        """Whether this state can take a new prompt of keys k and values v (B, N, H, D) in place."""
        batch, _, heads, dim = k.shape
        settings = (self.chunk_size, self.window, self.feature_map, self.exact_chunks)
        return (
            settings == (chunk_size, window, feature_map, exact_chunks)
            and self.ring_k.shape[0] == batch and self.ring_k.shape[2:] == (heads, dim)
            and self.ring_v.shape[-1] == v.shape[-1] and self.ring_k.dtype == k.dtype
            and self.ring_k.device == k.device
        )

    # --- the prompt --------------------------------------------------------------------------
    def prefill(self, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, backend: str = "auto") -> None:
        """Start every row afresh from its first `lengths[b]` tokens of k (B, N, H, D), v (B, N, H, Dv);
        the rest of a row is ignored (the caller packs each row's real tokens first). The "prompt" op of
        `ops.dispatch`: `prefill_torch`, or a kernel."""
        with torch.no_grad():  # (a context, not a decorator: torch.compile traces it on a state made in its graph)
            select("prompt", backend, DecodeState.prefill_torch, self, k, v, lengths)(self, k, v, lengths)

    def prefill_torch(self, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
        """`prefill` in torch. Only the K + 2 chunks around a row's open one are summed one by one (the rollback
        copies, the recent ones, the open one); everything older is one sum per row and head (`older_sums_torch`)."""
        C, K, acc = self.chunk_size, self.keep, self.cur_s.dtype
        n = k.shape[1]
        closed = lengths // C
        first = (closed - K - 1) * C  # the first token of the oldest chunk kept apart: the rollback copy's oldest
        tokens = first[:, None] + torch.arange((K + 2) * C, device=k.device)  # (B, (K + 2)·C)
        kept = (tokens >= 0) & (tokens < lengths[:, None])

        def near(x, fn=lambda x: x):  # → fn(x) (B, K + 2, C, H, ·) of those chunks, zeros outside a row's tokens
            x = fn(x.gather(1, tokens.clamp(0, n - 1)[..., None, None].expand(-1, -1, *x.shape[2:])).to(acc))
            return torch.where(kept[..., None, None], x, 0).unflatten(1, (K + 2, C))

        fk, vb = near(k, self.phi), near(v)
        s, z = torch.einsum("bnchd,bnche->bnhde", fk, vb), fk.sum(2)  # per-chunk sums (B, K + 2, H, ·)
        back_far_s, back_far_z = self.older_sums_torch(k, v, first)
        self.back_far_s.copy_(back_far_s)
        self.back_far_z.copy_(back_far_z)
        self.far_s.copy_(back_far_s + s[:, 0])
        self.far_z.copy_(self.back_far_z + z[:, 0])
        self.back_recent_s.copy_(s[:, :K].transpose(1, 2))
        self.back_recent_z.copy_(z[:, :K].transpose(1, 2))
        self.recent_s.copy_(s[:, 1 : K + 1].transpose(1, 2))
        self.recent_z.copy_(z[:, 1 : K + 1].transpose(1, 2))
        self.cur_s.copy_(s[:, K + 1])
        self.cur_z.copy_(z[:, K + 1])
        self.back_valid.copy_(closed >= 1)
        self.position.copy_(lengths)
        # the ring: the last R tokens of each row, token t in slot t mod R
        idx = self._ring_positions().clamp(0, n - 1)
        self.ring_k.copy_(k.gather(1, idx[..., None, None].expand(-1, -1, *k.shape[2:])))
        self.ring_v.copy_(v.gather(1, idx[..., None, None].expand(-1, -1, *v.shape[2:])))

    def older_sums_torch(self, k: torch.Tensor, v: torch.Tensor, first: torch.Tensor):
        """(Σ φ(k_t) v_tᵀ (B, H, D, Dv), Σ φ(k_t) (B, H, D)) over each row's tokens t < first[b], in the state's
        dtype. Summed by groups of tokens, then over the groups: cuBLAS runs one float32 product over all N tokens
        on a handful of SMs, many shorter ones on all of them."""
        acc, n = self.cur_s.dtype, k.shape[1]
        older = torch.arange(n, device=k.device) < first[:, None]
        fk = torch.where(older[..., None, None], self.phi(k.to(acc)), 0)
        pad = -n % _PREFILL_GROUP
        grouped = (F.pad(x, (0, 0, 0, 0, 0, pad)).unflatten(1, (-1, _PREFILL_GROUP)) for x in (fk, v.to(acc)))
        return torch.einsum("bgthd,bgthe->bghde", *grouped).sum(1), fk.sum(1)

    def _ring_positions(self) -> torch.Tensor:
        """(B, R): the position of the token each ring slot holds (the last R positions; < 0: none)."""
        R = self.slots
        first = (self.position - R)[:, None]
        return first + (torch.arange(R, device=first.device) - first) % R

    # --- the tokens after it ------------------------------------------------------------------
    def steps(self, q, k, v, real: torch.Tensor | None, relative: torch.Tensor, config: MHLAConfig) -> torch.Tensor:
        """Continue every row token by token: q (B, N, H, D), k (B, N, H_kv, D), v (B, N, H_kv, Dv), `real` (B, N)
        bool marks non-padding (None: all), `relative` (W,) or (H, W) the mixing → output (B, N, H, Dv)."""
        if self.retrieval is not None:
            heads = self.retrieval_heads, self.all_kv_heads
            (q, qr), (k, kr), (v, vr) = (split_heads(t, *heads) for t in (q, k, v))
            far = [self.retrieval.step(qr[:, t : t + 1], kr[:, t : t + 1], vr[:, t : t + 1],
                                       None if real is None else real[:, t]) for t in range(q.shape[1])]
            return merge_heads(self._linear_steps(q, k, v, real, relative, config), torch.cat(far, 1), *heads)
        return self._linear_steps(q, k, v, real, relative, config)

    def _linear_steps(self, q, k, v, real, relative, config: MHLAConfig) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5 if config.scale is None else config.scale
        outs = [
            self.step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], None if real is None else real[:, t],
                      relative, normalize=config.normalize, scale=scale, eps=config.eps, backend=config.backend)
            for t in range(q.shape[1])
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def step(self, q, k, v, real: torch.Tensor | None, relative: torch.Tensor, *, normalize: bool, scale: float,
             eps: float, backend: str) -> torch.Tensor:
        """One token per row: q (B, 1, H, D), k (B, 1, H_kv, D), v (B, 1, H_kv, Dv), real (B,) bool
        (None: all) → output (B, 1, H, Dv). A row whose token is not real keeps its state (its key
        must give φ(k) = 0). Updates in place, branch-free: the "decode" op of `ops.dispatch` (`step_torch`, or
        one fused kernel per layer, `kernels.decode_triton`), then the row positions."""
        impl = select("decode", backend, DecodeState.step_torch, self, q, k, v, relative, phi=self.phi)
        out = impl(self, q, k, v, real, relative, normalize=normalize, scale=scale, eps=eps)
        with torch.no_grad():
            adv = torch.ones_like(self.back_valid) if real is None else real
            position = self.position + adv
            self.back_valid.logical_or_(adv & (position % self.chunk_size == 0))
            self.position.copy_(position)
        return out

    def step_torch(self, q, k, v, real, relative, *, normalize: bool, scale: float, eps: float) -> torch.Tensor:
        """The step's torch reference: the output, and every tensor but the row positions updated."""
        if self.exact_chunks:
            out, cur_s, cur_z = self._exact_step(q, k, v, relative, scale=scale, eps=eps)
        else:
            num, den, cur_s, cur_z = self._terms(q, k, v, relative, scale=scale)
            out = (num / (den + eps) if normalize else num).reshape(*q.shape[:3], -1).to(q.dtype)
        with torch.no_grad():
            self._advance(k[:, 0], v[:, 0], cur_s, cur_z, real)
        return out

    def _exact_step(self, q, k, v, relative, *, scale: float, eps: float):
        """The step with exact chunks: summaries of chunks ≥ L back, the softmax kernel over the ring's
        tokens of the L nearest chunks and the token itself (ops.exact_local)."""
        C, L, acc = self.chunk_size, self.exact_chunks, self.cur_s.dtype
        batch, _, heads, dim = q.shape
        kv_heads = k.shape[2]
        far = relative * (torch.arange(relative.shape[-1], device=relative.device) >= L)
        num, den, cur_s, cur_z = self._terms(q, k, v, far, scale=scale)
        positions = torch.cat([self._ring_positions(), self.position[:, None]], 1)  # (B, R + 1)
        start = (self.position // C - L + 1).clamp(min=0) * C
        in_window = positions >= start[:, None]  # ring slots still empty hold negative positions
        distance = (self.position[:, None] // C - positions.clamp(min=0) // C).clamp(0, L - 1)
        weights = window_relative(relative.to(acc), distance, kv_heads, heads // kv_heads)  # (B, ·, ·, 1, R + 1)
        keys, values = (torch.cat([ring, new], 1).to(acc).transpose(1, 2).unsqueeze(2)
                        for ring, new in ((self.ring_k, k), (self.ring_v, v)))  # (B, H_kv, 1, R + 1, ·)
        allowed = (weights > 0) & in_window[:, None, None, None, :]
        qr = q[:, 0].to(acc).view(batch, kv_heads, heads // kv_heads, 1, dim)
        out = read_window(num, den, qr, keys, values, weights, allowed, eps=eps)
        return out.reshape(batch, 1, heads, -1).to(q.dtype), cur_s, cur_z

    def _terms(self, q, k, v, relative, *, scale: float):
        """One token's linear read of the summaries, unnormalised: numerator (B, H_kv, g, 1, Dv) and denominator
        (B, H_kv, g, 1, 1) in the state's dtype; and the open chunk's summary and z with the token added."""
        batch, _, heads, _ = q.shape
        kv_heads = k.shape[2]
        groups = heads // kv_heads
        acc = self.cur_s.dtype
        summaries = self.recent_s, self.recent_z, self.far_s, self.far_z
        if torch.is_grad_enabled() and relative.requires_grad:  # autograd keeps them for r's gradient: the step then
            summaries = tuple(t.clone() for t in summaries)  # updates them in place
        recent_s, recent_z, far_s, far_z = summaries

        fk, fv = self.phi(k[:, 0].to(acc)), v[:, 0].to(acc)  # (B, H_kv, D), (B, H_kv, Dv)
        cur_s = self.cur_s + fk.unsqueeze(-1) * fv.unsqueeze(-2)
        cur_z = self.cur_z + fk

        r = relative.to(acc)
        r = r.view(1, 1, -1) if r.dim() == 1 else r.view(kv_heads, groups, -1)  # (·, ·, W)
        w_recent = r[..., 1 : self.keep + 1].flip(-1).unsqueeze(-2)  # (·, ·, 1, K): distance K … 1
        w_far, w_self = r[..., -1, None], r[..., 0, None]  # (·, ·, 1)

        def mixed(recent, far, cur):  # → (B, H_kv, g, X)
            past = (w_recent @ recent.flatten(3).unsqueeze(2)).squeeze(-2) if self.keep else 0.0
            return past + w_far * far.flatten(2).unsqueeze(2) + w_self * cur.flatten(2).unsqueeze(2)

        fq = (self.phi(q[:, 0].to(acc)) * scale).view(batch, kv_heads, groups, 1, -1)
        num = fq @ mixed(recent_s, far_s, cur_s).unflatten(-1, (fq.shape[-1], -1))
        den = fq @ mixed(recent_z, far_z, cur_z).unsqueeze(-1)
        return num, den, cur_s, cur_z

    def _advance(self, k, v, cur_s, cur_z, real) -> None:
        batch = k.shape[0]
        adv = torch.ones(batch, dtype=torch.bool, device=k.device) if real is None else real
        rows, slot = torch.arange(batch, device=k.device), self.position % self.slots
        self.ring_k[rows, slot] = torch.where(_per_row(adv, k), k, self.ring_k[rows, slot])
        self.ring_v[rows, slot] = torch.where(_per_row(adv, v), v, self.ring_v[rows, slot])
        close = adv & ((self.position + adv) % self.chunk_size == 0)
        for back, now in ((self.back_recent_s, self.recent_s), (self.back_recent_z, self.recent_z),
                          (self.back_far_s, self.far_s), (self.back_far_z, self.far_z)):
            back.copy_(torch.where(_per_row(close, now), now, back))
        for far, recent, cur in ((self.far_s, self.recent_s, cur_s), (self.far_z, self.recent_z, cur_z)):
            if self.keep:
                far.add_(torch.where(_per_row(close, far), recent[:, :, 0], 0))
                shifted = torch.cat([recent[:, :, 1:], cur.unsqueeze(2)], 2)
                recent.copy_(torch.where(_per_row(close, recent), shifted, recent))
            else:
                far.add_(torch.where(_per_row(close, far), cur, 0))
        self.cur_s.copy_(torch.where(_per_row(close, cur_s), 0, cur_s))
        self.cur_z.copy_(torch.where(_per_row(close, cur_z), 0, cur_z))

    # --- going back, reordering ----------------------------------------------------------------
    @torch.no_grad()
    def rollback(self, tokens: int) -> None:
        """Forget the last `tokens` tokens of every row (assisted decoding's `crop`)."""
        if tokens <= 0:
            return
        C = self.chunk_size
        position = self.position - tokens
        start = self.position - self.position % C  # where the open chunk began
        into_previous = position < start
        if bool(((position < 0) | (position < start - C) | (into_previous & ~self.back_valid)).any()):
            raise ValueError(
                f"an MHLA state can go back at most to the start of the chunk before its open one ({C} tokens "
                f"or more); cannot forget {tokens} tokens here"
            )
        for back, now in ((self.back_recent_s, self.recent_s), (self.back_recent_z, self.recent_z),
                          (self.back_far_s, self.far_s), (self.back_far_z, self.far_z)):
            now.copy_(torch.where(_per_row(into_previous, now), back, now))
        base = torch.where(into_previous, start - C, start)
        held = self._ring_positions()
        use = (held >= base[:, None]) & (held < position[:, None])  # (B, R): tokens of the open chunk
        fk = torch.where(use[..., None, None], self.phi(self.ring_k.to(self.cur_s.dtype)), 0)
        self.cur_s.copy_(torch.einsum("brhd,brhe->bhde", fk, self.ring_v.to(self.cur_s.dtype)))
        self.cur_z.copy_(fk.sum(1))
        self.back_valid.logical_and_(~into_previous)
        self.position.copy_(position)
        if self.retrieval is not None:
            self.retrieval.rollback(tokens)

    @torch.no_grad()
    def reorder(self, index: torch.Tensor) -> None:
        """Rows ← rows[index], in place (beam search)."""
        for t in self.tensors():
            t.copy_(t.index_select(0, index.to(t.device)))

    def map(self, fn) -> None:
        """Replace every tensor by fn(tensor) (batch reshaping; changes shapes, so not for a static cache)."""
        for name in FIELDS:
            setattr(self, name, fn(getattr(self, name)))
        if self.retrieval is not None:
            self.retrieval.map(fn)

    @torch.no_grad()
    def reset(self) -> None:
        for name in FIELDS:
            getattr(self, name).zero_()
        if self.retrieval is not None:
            self.retrieval.reset()
