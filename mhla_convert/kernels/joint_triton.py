"""The Triton inference path of joint text–image MHLA (`ops.joint`; its torch path is the reference this is tested
against).

One launch of the exact-block forward kernels (`exact_blocks_triton`, its `ExtraTokens`) does both kinds of row. An
image query's row is non-causal MHLA with an exact block neighbourhood plus the L text keys read exactly at weight
m_iM, as further key tiles after the neighbourhood's in the same flash-style softmax, so the row stays one
normalised distribution and nothing of size N × L reaches memory. The text queries are one more query block, M,
with no neighbourhood: the text keys exactly at m_MM and every image block's summary, mixed by the mixing's row M
beside the image blocks' own mixtures (one GEMM). Both write into the joint output in place.

Inference only: a call that needs gradients takes the torch path, as do layers without an exact region and inputs
the exact-block kernels do not take (`unsupported_reason`). Importing this module registers the backend (as
"triton" of the op "joint" of `ops.dispatch`).
"""

from __future__ import annotations

import torch

from ..ops.blocks import BlockLayout
from ..ops.dispatch import register
from . import exact_blocks_triton
from .mhla_triton import _new


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
    m = layout.num_blocks
    out = _new(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    # the text keys' weight for each image block and (column M) the text queries; the text queries' weight of each
    # image block's summary
    to_text, from_text = mixing[..., :, m].reshape(-1, m + 1), mixing[..., m, :m].reshape(-1, m)  # (H or 1, ·)
    text_tokens = exact_blocks_triton.ExtraTokens(q[:, :text], k[:, :text], v[:, :text], to_text, from_text, text_mask,
                                                  out[:, :text])
    image = (slice(None), slice(text, None))
    exact_blocks_triton.forward_with_extra_tokens(q[image], k[image], v[image], mixing[..., :m, :m], layout,
                                                  text_tokens, out=out[image], exact_radius=exact_radius, phi=phi,
                                                  scale=scale, eps=eps)
    return out


register("joint", "triton", joint_attention_triton, supports)
