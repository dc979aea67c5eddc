"""Causal MHLA whose nearest chunks are read exactly: the softmax kernel within the local window.

With `exact_chunks = L > 0`, a query in chunk i weighs a key in chunk j by

    w_ts = m_ij · exp(q_t·k_s / √D)            if i − j < L   (its own chunk and the L − 1 before it)
    w_ts = m_ij · scale · φ(q_t)·φ(k_s)        otherwise      (the key–value summaries, as in plain MHLA)

and normalises as MHLA does: o_t = Σ_s w_ts v_s / (Σ_s w_ts + eps). The exact kernel is the host's own
softmax attention, so the local window — what a converted LM leans on most, exact copying of nearby
tokens — stays the original's while older context costs O(d²) per chunk. The mixing weights still
scale every chunk, so they learn how much the summaries count against the window.

Decoding (`ops.recurrent.DecodeState`) keeps the usual recurrent summaries of closed chunks plus a ring of the
window's raw keys and values — (exact_chunks + 2) · chunk_size tokens, whatever the sequence length.

Exponentials are taken after subtracting each row's largest window score (at least 0), with the
linear terms and eps scaled by the same factor: the result is the formula above, without overflow.

The parallel form dispatches like `mhla_attention` (op "exact" of `ops.dispatch`; the Triton backend is
`kernels.exact_triton`); under torch.compile it is one custom op (`ops.exact_op`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .blocks import BlockLayout
from .feature_maps import key_features


def _grouped(x: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """(M, M) → (1, 1, M, M); (H, M, M) → (H_kv, g, M, M)."""
    return x.view(1, 1, *x.shape) if x.dim() == 2 else x.view(kv_heads, groups, *x.shape[-2:])


def _window(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """(B, H, M, T, X) → (B, H, M, chunks·T, X): for chunk i, chunks i − chunks + 1 … i (zeros before 0)."""
    m = x.shape[2]
    padded = F.pad(x, (0, 0, 0, 0, chunks - 1, 0))
    return torch.cat([padded[:, :, d : d + m] for d in range(chunks)], dim=-2)


def window_weights(mix: torch.Tensor, chunks: int, tokens: int) -> torch.Tensor:
    """(…, M, M) mixing → (…, M, 1, chunks·T): m_{i, i−δ} for each key of the window, 0 before chunk 0."""
    m = mix.shape[-1]
    diagonals = (mix.diagonal(-delta, -2, -1) for delta in range(chunks - 1, -1, -1))
    per_chunk = [F.pad(d, (m - d.shape[-1], 0)) for d in diagonals]
    return torch.stack(per_chunk, -1).repeat_interleave(tokens, -1).unsqueeze(-2)


def read_window(num, den, q, keys, values, weights, allowed, *, eps: float) -> torch.Tensor:
    """Linear reads (num (…, T, Dv), den (…, T, 1)) plus the softmax kernel over window keys, normalised:
    q (…, T, D); keys (…, K, D), values (…, K, Dv), weights and `allowed` (bool) broadcastable to (…, T, K)."""
    scores = (q * q.shape[-1] ** -0.5) @ keys.transpose(-1, -2)
    shift = scores.masked_fill(~allowed, float("-inf")).amax(-1, keepdim=True).clamp_min(0).detach()
    a = torch.exp((scores - shift).masked_fill(~allowed, float("-inf"))) * weights
    decay = torch.exp(-shift)
    return (num * decay + a @ values) / (den * decay + a.sum(-1, keepdim=True) + eps * decay)


def mhla_attention_exact_local_torch(
    q, k, v, mixing, layout: BlockLayout, *, exact_chunks: int, phi, scale, eps, key_mask=None
):
    """Chunkwise causal MHLA with the last `exact_chunks` chunks read by the softmax kernel (module doc);
    `key_mask` (B, N) bool marks real keys (False: padding, weight 0)."""
    batch, _, heads, dim = q.shape
    kv_heads, groups, dv = k.shape[2], heads // k.shape[2], v.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    m, t = layout.num_blocks, layout.tokens_per_block
    mix = _grouped(mixing.to(acc), kv_heads, groups)

    # far chunks (distance ≥ L): mixed key–value summaries, as in plain MHLA
    qf = layout.to_blocks(phi(q.to(acc)) * scale).view(batch, kv_heads, groups, m, t, -1)
    kf = layout.to_blocks(key_features(phi, k.to(acc), key_mask)).unsqueeze(2)
    vb = layout.to_blocks(v.to(acc))  # (B, H_kv, M, T, Dv)
    far = mix.tril(-exact_chunks)
    s = kf.transpose(-1, -2) @ vb.unsqueeze(2)
    num = qf @ torch.matmul(far, s.flatten(-2)).unflatten(-1, s.shape[-2:])  # (B, H_kv, g, M, T, Dv)
    den = qf @ torch.matmul(far, kf.sum(-2)).unsqueeze(-1)  # (B, H_kv, g, M, T, 1)

    # window chunks (distance < L): the softmax kernel, causal within the query's own chunk
    qr = layout.to_blocks(q.to(acc)).view(batch, kv_heads, groups, m, t, -1)
    kw = _window(layout.to_blocks(k.to(acc)), exact_chunks).unsqueeze(2)  # (B, H_kv, 1, M, L·T, D)
    vw = _window(vb, exact_chunks).unsqueeze(2)
    causal = torch.ones(t, exact_chunks * t, dtype=torch.bool, device=q.device).tril((exact_chunks - 1) * t)
    weights = window_weights(mix, exact_chunks, t)  # (·, ·, M, 1, L·T)
    allowed = causal & (weights > 0)
    if key_mask is not None:
        real = _window(layout.to_blocks(key_mask[:, :, None, None].to(acc)), exact_chunks)  # (B, 1, M, L·T, 1)
        allowed = allowed & (real.view(batch, 1, 1, m, 1, -1) > 0)
    out = read_window(num, den, qr, kw, vw, weights, allowed, eps=eps)
    return layout.from_blocks(out.reshape(batch, heads, m, t, dv)).to(q.dtype)


def window_relative(relative: torch.Tensor, distance: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """Relative mixing (W,) or (H, W) read at chunk distances `distance` (B, K) → (B, ·, ·, 1, K): m for every
    window key, broadcastable against (B, H_kv, g, 1, K)."""
    rel = relative.view(1, 1, -1) if relative.dim() == 1 else relative.view(kv_heads, groups, -1)
    return rel[..., distance].permute(2, 0, 1, 3).unsqueeze(-2)  # (·, ·, B, K) → (B, ·, ·, 1, K)
