"""The Triton inference path of joint text–image MHLA (`ops.joint`; its torch path is the reference this is tested
against).

An image query's row is non-causal MHLA with an exact block neighbourhood (`exact_blocks_triton`) plus the L text
keys read exactly at weight m_iM. The first part comes from the exact-block kernels with each row's normaliser
den_t + eps (their log2-normaliser); the text part is one softmax read per row, with its own log-normaliser; the two
merge as flash-decoding merges partial attention results:

    o_t = σ(A_t − C_t) · o_image_t + σ(C_t − A_t) · o_text_t,   A_t = ln(den_t + eps),
                                                                 C_t = ln m_iM + ln Σ_{text s} exp(q_t·k_s / √D)

which is the joint formula's normalised row, eps counted once. The L text queries' rows run the torch path's
`text_rows`. Memory: the text scores, B·H·N·L float32 numbers (0.8 GB for FLUX at 2048², 16,384 image tokens).

Inference only: a call that needs gradients takes the torch path, as do layers without an exact region and inputs
the exact-block kernels do not take (`unsupported_reason`). Importing this module registers the backend (as
"triton" of the op "joint" of `ops.dispatch`).
"""

from __future__ import annotations

import math

import torch

from ..ops.blocks import BlockLayout
from ..ops.dispatch import register
from ..ops.exact_blocks import block_summaries, grouped_mixing
from ..ops.joint import real_text, text_rows
from . import exact_blocks_triton


def unsupported_reason(q, k, v, mixing, layout: BlockLayout, *, text, exact_radius, phi, text_mask=None,
                       text_exact=True) -> str | None:
    """Why these inputs need the torch path, or None when this path takes them."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, mixing)):
        return "inputs that need gradients (the Triton path is for inference)"
    if not text_exact:
        return "text read through its summary (text_exact=False)"
    if exact_radius is None:
        return "a joint layer without an exact region (exact_radius=None)"
    if text_mask is not None and text_mask.device != q.device:
        return f"a text_mask on {text_mask.device} with q on {q.device}"
    image = (slice(None), slice(text, None))
    return exact_blocks_triton.unsupported_reason(q[image], k[image], v[image], mixing[..., :-1, :-1], layout,
                                                  exact_radius=exact_radius, phi=phi)


def supports(q, k, v, mixing, layout, *, text, exact_radius, phi, text_mask=None, text_exact=True) -> bool:
    """For backend "auto": CUDA inputs this path takes (the interpreter is only for backend="triton")."""
    return q.is_cuda and unsupported_reason(q, k, v, mixing, layout, text=text, exact_radius=exact_radius, phi=phi,
                                            text_mask=text_mask, text_exact=text_exact) is None


def _text_reads(qi, kt, vt, to_text, real):
    """The image queries' softmax read of the text keys: (output (B, H_kv, g, N, Dv), C (B, H_kv, g, N, 1)) for
    qi (B, N, H, D), kt / vt (B, L, H_kv, ·), to_text (·, ·, N, 1) each row's weight m_iM, real (B, 1, 1, 1, L)."""
    batch, n, heads, dim = qi.shape
    kv_heads = kt.shape[2]
    qg = qi.float().view(batch, n, kv_heads, heads // kv_heads, dim).permute(0, 2, 3, 1, 4)
    keys, values = (x.float().permute(0, 2, 1, 3).unsqueeze(2) for x in (kt, vt))  # (B, H_kv, 1, L, ·)
    scores = (qg * dim**-0.5) @ keys.transpose(-1, -2)
    scores = scores.masked_fill(~real, float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    out = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min)) @ values
    return out, lse + to_text.log()


def joint_attention_triton(q, k, v, mixing, layout: BlockLayout, *, text, exact_radius, phi, scale, eps,
                           text_mask=None, text_exact=True) -> torch.Tensor:
    """The Triton inference path (same contract as `ops.joint.joint_attention_torch`)."""
    reason = unsupported_reason(q, k, v, mixing, layout, text=text, exact_radius=exact_radius, phi=phi,
                                text_mask=text_mask, text_exact=text_exact)
    if reason is not None:
        raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
    batch, _, heads, _ = q.shape
    kv_heads, groups, dv, m = k.shape[2], heads // k.shape[2], v.shape[-1], layout.num_blocks
    qt, kt, vt, qi, ki, vi = q[:, :text], k[:, :text], v[:, :text], q[:, text:], k[:, text:], v[:, text:]
    mix = grouped_mixing(mixing.float(), kv_heads, groups)  # (·, ·, M + 1, M + 1)
    real = real_text(text_mask, batch, text, q.device)

    # image queries: the neighbourhood and summaries by the exact-block kernels, the text by one softmax read
    o_image, lse2 = exact_blocks_triton.forward_with_normaliser(
        qi, ki, vi, mixing[..., :m, :m], layout, exact_radius=exact_radius, phi=phi, scale=scale, eps=eps)
    to_text = mix[..., :m, m][..., layout.block_ids(q.device)].unsqueeze(-1)  # (·, ·, N, 1)
    o_text, c = _text_reads(qi, kt, vt, to_text, real.view(batch, 1, 1, 1, text))
    a = lse2.view(batch, kv_heads, groups, -1, 1) * math.log(2.0)
    image_share = torch.sigmoid(a - c)
    o_image = o_image.float().view(batch, -1, kv_heads, groups, dv).permute(0, 2, 3, 1, 4)
    merged = torch.where(c == float("-inf"), o_image, image_share * o_image + (1 - image_share) * o_text)
    image_out = merged.permute(0, 3, 1, 2, 4).reshape(batch, -1, heads, dv)

    # text queries: the torch path's rows (L of them), over the image's block summaries
    s, z = block_summaries(layout.to_blocks(phi(ki.float())), layout.to_blocks(vi.float()))
    text_out = text_rows(qt.float(), kt.float(), vt.float(), s, z, mix, real, phi=phi, scale=scale, eps=eps)
    return torch.cat([text_out, image_out], 1).to(q.dtype)


register("joint", "triton", joint_attention_triton, supports)
