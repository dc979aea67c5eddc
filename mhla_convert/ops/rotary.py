"""Rotary position embeddings with the q/k norms before them: Wan's on interleaved channel pairs after an RMSNorm
across heads, and Llama-style LMs' on the two halves of each head after Qwen3's per-head RMSNorm (or none).

The torch paths are the hosts' own ops (diffusers' `WanAttnProcessor`, transformers' `apply_rotary_pos_emb`), so a
converted layer and its distillation teacher rotate bitwise alike in training. They run as several elementwise
passes: on an H200 ~1 ms per Wan layer at 31,500 tokens, as much as the four projections and several times the MHLA
op (docs/benchmarks.md). Inference on CUDA takes one fused pass per tensor instead (`kernels.rotary_triton`): read
x, norm, rotate, write, in float32 with one rounding (the hosts' ops round after each step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .dispatch import select


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on (B, N, H, D): pair (x[2i], x[2i+1]) turns by the angle whose cosine is
    cos[..., 2i] and sine sin[..., 2i+1] (cos/sin broadcastable, e.g. (1, N, 1, D)).

    Computed in float32 (or x's wider dtype) whatever the tables' dtype: with diffusers' float32 tables that is
    what type promotion gives the host's op, bit for bit; with tables a wrapper cast to bf16 it keeps the same
    ops and saved tensors. FSDP2's mixed precision casts a block's inputs in its forward but (torch 2.11) not
    when activation checkpointing recomputes it, and checkpointing refuses a recomputation whose saved tensors
    differ in dtype from the forward's."""
    acc = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(acc).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2].to(acc), sin[..., 1::2].to(acc)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


def norm_rotate_torch(x, cos, sin, *, head_dim: int, norm: nn.Module | None):
    if norm is not None:
        x = norm(x)
    return rotate_interleaved(x.unflatten(-1, (-1, head_dim)), cos, sin)


def norm_rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, head_dim: int,
                            norm: nn.Module | None = None, backend: str = "auto") -> torch.Tensor:
    """x (B, N, H·D) → (B, N, H, D): `norm` over the last dim (an `nn.RMSNorm`, or None), then
    `rotate_interleaved` by cos/sin of shape (1 or B, N, 1, D). `backend="auto"` fuses both into one
    pass on CUDA when no gradient is needed; training keeps the torch path, and so does torch.compile, which
    fuses it by itself."""
    return _norm_rotate("rotary", norm_rotate_torch, x, cos, sin, head_dim, norm, backend)


def _norm_rotate(op: str, torch_impl, x, cos, sin, head_dim: int, norm, backend: str) -> torch.Tensor:
    """`op`'s implementation for `backend` on x (B, N, H·D); "auto" keeps `torch_impl` under torch.compile,
    whose inductor fuses its ops into one pass itself."""
    if head_dim % 2 or x.shape[-1] % head_dim:
        raise ValueError(f"head_dim must be even and divide x's last dim ({x.shape[-1]}); got {head_dim}")
    if backend == "auto" and torch.compiler.is_compiling():
        backend = "torch"
    impl = select(op, backend, torch_impl, x, cos, sin, head_dim=head_dim, norm=norm)
    return impl(x, cos, sin, head_dim=head_dim, norm=norm)


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb` on (B, N, H, D): x·cos + rotate_half(x)·sin with cos, sin (B, N, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(2) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(2)


def norm_rotate_half_torch(x, cos, sin, *, head_dim: int, norm: nn.Module | None):
    x = x.unflatten(-1, (-1, head_dim))
    return rotate_half_split(x if norm is None else norm(x), cos, sin)


def norm_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, head_dim: int,
                     norm: nn.Module | None = None, backend: str = "auto") -> torch.Tensor:
    """x (B, N, H·D) → (B, N, H, D): `norm` over each head's D channels (Qwen3's q/k norm, or None), then
    `rotate_half_split` by cos/sin of shape (1 or B, N, D). `backend="auto"` fuses both into one pass on CUDA when
    no gradient is needed and the norm is an RMSNorm; training and torch.compile keep the torch path."""
    return _norm_rotate("rotary_half", norm_rotate_half_torch, x, cos, sin, head_dim, norm, backend)


@dataclass(frozen=True, eq=False)
class HalfSplitRotary:
    """transformers' RoPE as an LM layer's `rotary` callable, (q, k) → (q, k) on (B, N, H, D); `norm_rotate`
    also takes the q/k norm per head, so a layer can do both in one pass per tensor."""

    cos: torch.Tensor
    sin: torch.Tensor
    norm_kind = "per_head"  # the q/k norm `norm_rotate` takes (the layer's `qk_norm`)

    def __call__(self, q, k):
        return rotate_half_split(q, self.cos, self.sin), rotate_half_split(k, self.cos, self.sin)

    def norm_rotate(self, x, norm, head_dim: int, backend: str = "auto"):
        return norm_rotate_half(x, self.cos, self.sin, head_dim=head_dim, norm=norm, backend=backend)


@dataclass(frozen=True, eq=False)
class InterleavedRotary:
    """Wan's RoPE as a layer's `rotary` callable, (q, k) → (q, k) on (B, N, H, D); `norm_rotate`
    also takes the q/k norm across heads, so a layer can do both in one pass per tensor."""

    cos: torch.Tensor
    sin: torch.Tensor
    norm_kind = "across_heads"

    def __call__(self, q, k):
        return rotate_interleaved(q, self.cos, self.sin), rotate_interleaved(k, self.cos, self.sin)

    def norm_rotate(self, x, norm, head_dim: int, backend: str = "auto"):
        return norm_rotate_interleaved(x, self.cos, self.sin, head_dim=head_dim, norm=norm, backend=backend)
