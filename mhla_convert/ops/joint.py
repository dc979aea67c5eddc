"""Joint text–image MHLA for MM-DiT transformers (FLUX, Qwen-Image), whose attention runs over the text tokens and
the image tokens together, concatenated text first.

The L text tokens are few and carry the prompt, so every query reads them exactly, with the softmax kernel; the N
image tokens lie on a token grid split into M blocks, read as in `mhla_attention` (summaries, and with `exact_radius`
each query block's neighbourhood exactly). The text tokens are one more block, index M, of an (M + 1, M + 1) mixing:

    image query t in block i, image key s in block j:  w_ts = m_ij · exp(q_t·k_s / √D)     if j ∈ E(i)
                                                              m_ij · scale·φ(q_t)·φ(k_s)  otherwise
    image query t in block i, text key s:              w_ts = m_iM · exp(q_t·k_s / √D)
    text query t, image key s in block j:              w_ts = m_Mj · scale·φ(q_t)·φ(k_s)
    text query t, text key s:                          w_ts = m_MM · exp(q_t·k_s / √D)

    o_t = Σ_s w_ts v_s / (Σ_s w_ts + eps)

so each row, text or image, is one normalised distribution over all L + N keys: the mixing learns how much the text,
the neighbourhood and the summaries count against each other. Text queries read the image through the summaries
mixed by row M (one query block of their own); `text_mask` (B, L) bool drops padded text keys. Cost:
O((L + N)·d² + M²·d² + N·(K·T + L)·d + L²·d) for K neighbourhood blocks of T tokens.
"""

from __future__ import annotations

import torch

from .blocks import BlockLayout
from .exact_blocks import block_summaries, exact_mask, exact_radius_axes, far_reads, grouped_mixing, near_read
from .exact_local import read_window
from .feature_maps import FeatureMap, resolve_feature_map
from .mhla import check_inputs, check_options


def check_joint_inputs(q, k, v, mixing, *, text: int, grid, blocks, text_mask=None) -> BlockLayout:
    """Validate shapes (as `check_inputs`, on the image tokens) and return the image tokens' block layout."""
    if not (isinstance(text, int) and 0 < text < q.shape[1]):
        raise ValueError(f"text must be the number of text tokens, in [1, {q.shape[1] - 1}]; got {text!r}")
    if not isinstance(mixing, torch.Tensor) or mixing.dim() not in (2, 3) or mixing.shape[-1] != mixing.shape[-2]:
        raise ValueError("mixing must be a square (M + 1, M + 1) or (H, M + 1, M + 1) tensor (index M: the text)")
    image = (slice(None), slice(text, None))
    layout = check_inputs(q[image], k[image], v[image], mixing[..., :-1, :-1], grid=grid, blocks=blocks, causal=False)
    if text_mask is not None and (text_mask.shape != (q.shape[0], text) or text_mask.dtype != torch.bool):
        raise ValueError(f"text_mask must be a (B, L) = {(q.shape[0], text)} bool tensor; got {text_mask.dtype} "
                         f"{tuple(text_mask.shape)}")
    return layout


def joint_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mixing: torch.Tensor, *, text: int, grid, blocks,
    exact_radius=None, feature_map: FeatureMap = "relu", scale: float | None = None, eps: float = 1e-6,
    text_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Joint MHLA (module doc). q, k, v: (B, L + N, H, D) / (B, L + N, H_kv, D) / (B, L + N, H_kv, D_v), the `text`
    = L text tokens first, then the N image tokens of `grid` in row-major order; mixing (M + 1, M + 1) or
    (H, M + 1, M + 1), M = prod(blocks), index M the text; exact_radius as `mhla_attention`'s (None: the image keys
    only through summaries); text_mask (B, L) bool, False for padding. → (B, L + N, H, D_v) in q's dtype."""
    layout = check_joint_inputs(q, k, v, mixing, text=text, grid=grid, blocks=blocks, text_mask=text_mask)
    check_options(feature_map=feature_map, normalize=True, scale=scale, eps=eps, backend="torch")
    phi = resolve_feature_map(feature_map)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    batch, _, heads, _ = q.shape
    kv_heads, groups, dv = k.shape[2], heads // k.shape[2], v.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    m, t = layout.num_blocks, layout.tokens_per_block
    mix = grouped_mixing(mixing.to(acc), kv_heads, groups)  # (·, ·, M + 1, M + 1)
    dtype, (q, k, v) = q.dtype, (t.to(acc) for t in (q, k, v))
    qt, kt, vt, qi, ki, vi = q[:, :text], k[:, :text], v[:, :text], q[:, text:], k[:, text:], v[:, text:]

    def text_window(x):  # (B, L, H_kv, X) → (B, H_kv, 1, 1, L, X)
        return x.permute(0, 2, 1, 3)[:, :, None, None]

    kw, vw = text_window(kt), text_window(vt)
    real = (torch.ones(batch, text, dtype=torch.bool, device=q.device) if text_mask is None
            else text_mask)[:, None, None, None, None]  # (B, 1, 1, 1, 1, L)

    # image keys: block summaries; the image queries' reads of them, then of their neighbourhood and the text
    s, z = block_summaries(layout.to_blocks(phi(ki)), vb := layout.to_blocks(vi))
    image_mix = mix[..., :m, :m]
    radius = None if exact_radius is None else exact_radius_axes(exact_radius, len(layout.grid))
    far = image_mix if radius is None else image_mix.masked_fill(exact_mask(layout.blocks, radius, q.device), 0.0)
    qf = layout.to_blocks(phi(qi) * scale).view(batch, kv_heads, groups, m, t, -1)
    num, den = far_reads(qf, s, z, far)
    to_text = mix[..., :m, m:, None].expand(*mix.shape[:-2], m, 1, text)  # (·, ·, M, 1, L)
    allowed = real & (to_text > 0)
    if radius is None:
        qr = layout.to_blocks(qi).view(batch, kv_heads, groups, m, t, -1)
        image_out = read_window(num, den, qr, kw, vw, to_text, allowed, eps=eps)
    else:
        image_out = near_read(num, den, qi, ki, vb, image_mix, layout, radius, real=None, eps=eps,
                              extra=(kw, vw, to_text, allowed))

    # text queries: one query block of their own, row M
    qtf = (phi(qt) * scale).permute(0, 2, 1, 3).reshape(batch, kv_heads, groups, 1, text, -1)
    num_t, den_t = far_reads(qtf, s, z, mix[..., m:, :m])
    qtr = qt.permute(0, 2, 1, 3).reshape(batch, kv_heads, groups, 1, text, -1)
    self_text = mix[..., m:, m:, None]  # (·, ·, 1, 1, 1)
    text_out = read_window(num_t, den_t, qtr, kw, vw, self_text, real & (self_text > 0), eps=eps)

    image_out = layout.from_blocks(image_out.reshape(batch, heads, m, t, dv))  # (B, N, H, Dv)
    text_out = text_out.reshape(batch, heads, text, dv).transpose(1, 2)
    return torch.cat([text_out, image_out], 1).to(dtype)
