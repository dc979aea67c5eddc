"""The deliberately slow, obviously-correct O(N²) MHLA: it writes out every weight w_ts. Tests
use it as the oracle for every fast path; it shares nothing with them but the feature maps."""

from __future__ import annotations

import torch

from .feature_maps import FeatureMap, resolve_feature_map
from .mhla import check_inputs


def mhla_weights_reference(
    q, k, mixing, *, grid=None, blocks=None, causal=False, chunk_size=None, feature_map: FeatureMap = "relu",
    scale=None, exact_chunks=0, exact_radius=None,
) -> torch.Tensor:
    """The explicit (B, H, N, N) weight matrix w_ts = m[b(t), b(s)]·scale·φ(q_t)·φ(k_s), with the kernel
    exp(q_t·k_s / √D) instead where b(t) − b(s) < exact_chunks (causal) or where the blocks' coordinates differ by
    at most exact_radius along every grid axis (non-causal)."""
    layout = check_inputs(q, k, k, mixing, grid=grid, blocks=blocks, causal=causal, chunk_size=chunk_size)
    phi = resolve_feature_map(feature_map)
    acc = torch.promote_types(q.dtype, torch.float32)
    heads, n = q.shape[2], q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.repeat_interleave(heads // k.shape[2], dim=2)
    scores = torch.einsum("bthd,bshd->bhts", phi(q.to(acc)) * scale, phi(k.to(acc)))
    ids = layout.block_ids(device=q.device)
    per_head = mixing.to(acc).expand(heads, *mixing.shape[-2:])
    near = None
    if exact_chunks:
        near = (ids[:, None] - ids[None, :]) < exact_chunks
    elif exact_radius is not None:
        radius = torch.tensor(exact_radius, device=q.device).expand(len(layout.blocks))
        coords = torch.stack(torch.unravel_index(ids, layout.blocks), -1)  # (N, axes) block coordinates
        near = ((coords[:, None] - coords[None, :]).abs() <= radius).all(-1)
    if near is not None:
        exact = torch.einsum("bthd,bshd->bhts", q.to(acc), k.to(acc)).mul(q.shape[-1] ** -0.5).exp()
        scores = torch.where(near, exact, scores)
    w = scores * per_head[:, ids][:, :, ids]
    if causal:
        w = w * torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return w


def mhla_attention_reference(
    q, k, v, mixing, *, grid=None, blocks=None, causal=False, chunk_size=None,
    feature_map: FeatureMap = "relu", normalize=True, scale=None, eps=1e-6, exact_chunks=0, exact_radius=None,
) -> torch.Tensor:
    """o_t = Σ_s w_ts v_s / (Σ_s w_ts + eps), straight from the definition."""
    w = mhla_weights_reference(
        q, k, mixing, grid=grid, blocks=blocks, causal=causal, chunk_size=chunk_size, feature_map=feature_map,
        scale=scale, exact_chunks=exact_chunks, exact_radius=exact_radius,
    )
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2).to(w.dtype)
    out = torch.einsum("bhts,bshe->bthe", w, v)
    if normalize:
        out = out / (w.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)
    return out.to(q.dtype)


def joint_attention_reference(
    q, k, v, mixing, *, text, grid, blocks, exact_radius=None, feature_map: FeatureMap = "relu", scale=None, eps=1e-6,
    text_mask=None, text_exact=True,
) -> torch.Tensor:
    """`ops.joint.joint_attention` from its definition: the explicit (B, H, L + N, L + N) weights — image–image from
    `mhla_weights_reference` with mixing[:M, :M], the softmax kernel on every text key (`text_exact` False: φ(q)·φ(k)),
    φ(q)·φ(k) from text queries to image keys — each times its blocks' mixing weight (the text: index M), padded text
    keys 0, rows normalised."""
    phi = resolve_feature_map(feature_map)
    acc = torch.promote_types(q.dtype, torch.float32)
    heads, n, m = q.shape[2], q.shape[1], mixing.shape[-1] - 1
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype, (q, k, v) = q.dtype, (t.to(acc) for t in (q, k, v))
    k, v = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (k, v))
    per_head = mixing.to(acc).expand(heads, m + 1, m + 1)
    w = torch.empty(q.shape[0], heads, n, n, dtype=acc, device=q.device)
    w[..., text:, text:] = mhla_weights_reference(q[:, text:], k[:, text:], per_head[:, :m, :m], grid=grid,
                                                  blocks=blocks, feature_map=feature_map, scale=scale,
                                                  exact_radius=exact_radius)
    ids = torch.cat([torch.full((text,), m, device=q.device),
                     check_inputs(q[:, text:], k[:, text:], k[:, text:], per_head[:, :m, :m], grid=grid,
                                  blocks=blocks, causal=False).block_ids(device=q.device)])
    weights = per_head[:, ids][:, :, ids]  # (H, L + N, L + N)
    if text_exact:
        to_text = torch.einsum("bthd,bshd->bhts", q, k[:, :text]).mul(q.shape[-1] ** -0.5).exp()
    else:
        to_text = torch.einsum("bthd,bshd->bhts", phi(q) * scale, phi(k[:, :text]))
    w[..., :text] = to_text * weights[:, :, :text]
    w[..., :text, text:] = (torch.einsum("bthd,bshd->bhts", phi(q[:, :text]) * scale, phi(k[:, text:]))
                            * weights[:, :text, text:])
    if text_mask is not None:
        w[..., :text] = w[..., :text] * text_mask[:, None, None, :]
    out = torch.einsum("bhts,bshe->bthe", w, v)
    return (out / (w.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)).to(dtype)
