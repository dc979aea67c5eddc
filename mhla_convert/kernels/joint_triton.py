"""The Triton inference path of joint text–image MHLA (`ops.joint`; its torch path is the reference this is tested
against).

An image query's row is non-causal MHLA with an exact block neighbourhood (`exact_blocks_triton`) plus the L text
keys read exactly at weight m_iM: the exact-block forward reads the text as further key tiles after the
neighbourhood's, in the same flash-style softmax (its `ExtraKeys`), so the row stays one normalised distribution
and nothing of size N × L reaches memory. The L text queries' rows run the torch path's `text_rows` over the block
summaries that forward already made.

Inference only: a call that needs gradients takes the torch path, as do layers without an exact region and inputs
the exact-block kernels do not take (`unsupported_reason`). Importing this module registers the backend (as
"triton" of the op "joint" of `ops.dispatch`).
"""

from __future__ import annotations

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


def joint_attention_triton(q, k, v, mixing, layout: BlockLayout, *, text, exact_radius, phi, scale, eps,
                           text_mask=None, text_exact=True) -> torch.Tensor:
    """The Triton inference path (same contract as `ops.joint.joint_attention_torch`)."""
    reason = unsupported_reason(q, k, v, mixing, layout, text=text, exact_radius=exact_radius, phi=phi,
                                text_mask=text_mask, text_exact=text_exact)
    if reason is not None:
        raise ValueError(f"the triton backend does not take {reason}; use backend='auto' or 'torch'")
    batch, heads, m = q.shape[0], q.shape[2], layout.num_blocks
    kv_heads, groups = k.shape[2], heads // k.shape[2]
    qt, kt, vt, qi, ki, vi = q[:, :text], k[:, :text], v[:, :text], q[:, text:], k[:, text:], v[:, text:]

    # image queries: neighbourhood, summaries and the text in one exact-block forward
    to_text = mixing[..., :m, m].reshape(-1, m)  # (H or 1, M)
    extra = exact_blocks_triton.ExtraKeys(kt, vt, to_text, text_mask)
    image_out, s, z = exact_blocks_triton.forward_with_extra_keys(
        qi, ki, vi, mixing[..., :m, :m], layout, extra, exact_radius=exact_radius, phi=phi, scale=scale, eps=eps)

    # text queries: the torch path's rows (L of them), over the image's block summaries
    if s is None:  # (every block reads every other exactly: the forward made no summaries)
        s, z = block_summaries(layout.to_blocks(phi(ki.float())), layout.to_blocks(vi.float()))
    mix = grouped_mixing(mixing.float(), kv_heads, groups)  # (·, ·, M + 1, M + 1)
    real = real_text(text_mask, batch, text, q.device)
    text_out = text_rows(qt.float(), kt.float(), vt.float(), s.float(), z.float(), mix, real, phi=phi, scale=scale,
                         eps=eps)
    return torch.cat([text_out.to(q.dtype), image_out], 1)


register("joint", "triton", joint_attention_triton, supports)
