"""The MHLA layer: projections, optional q/k norms and RoPE, the mixing parameter, the operator.

Usable standalone; family adapters build one per converted attention and move the host's
pretrained projections and norms into it, so the only new parameters are `mixing` (and the
optional output norm).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Callable, ClassVar, Literal

import torch
from torch import nn

from .mixing import (
    MixingInit,
    check_mixing_init,
    initial_mixing,
    region_mixing,
    relative_causal_mixing,
    toeplitz_causal_mixing,
)
from .ops import DecodeState, mhla_attention
from .ops.blocks import as_axes, whole_number
from .ops.exact_blocks import exact_mask, exact_radius_axes
from .ops.feature_maps import LEARNED_FEATURE_MAPS
from .ops.mhla import check_options
from .ops.retrieval import merge_heads, retrieval_attention, split_heads

# (q, k) → (q, k) on (B, N, H, D). A rotary object may also offer `norm_rotate(x, norm, head_dim, backend)`:
# x (B, N, H·D) → (B, N, H, D) normed across heads and rotated in one pass (Wan's, ops.rotary.InterleavedRotary).
Rotary = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class MHLAConfig:
    """Every MHLA option of one layer (saved verbatim in mhla_config.json).

    blocks: blocks per token-grid axis (non-causal); M = prod(blocks).
    causal / chunk_size / window: causal layers split tokens into chunks of `chunk_size` and learn
        one mixing weight per chunk distance up to `window` (see mixing.py), so no length cap.
    exact_chunks: causal only: the query's own chunk and the `exact_chunks − 1` before it are read with
        the host's softmax kernel instead of linear summaries (ops.exact_local); < window; 0 = pure MHLA.
    exact_radius: non-causal only: the blocks within this many blocks of a query's own along every grid axis
        (a whole number or one per axis; 0 = its own block) are read with the host's softmax kernel instead of
        linear summaries (ops.exact_blocks); None = pure MHLA.
    retrieval_heads: causal only: key-head indices whose query heads keep the host's softmax over every earlier
        token (ops.retrieval) while the other heads run MHLA: a linear summary cannot look a token up far back, these
        heads can. Costs their share of a full KV cache while decoding; () = none. The same heads in every layer,
        or {layer index: heads} (`for_layer` gives one layer's; `convert(retrieval_share=...)` picks them).
    text_exact: joint text–image families (FLUX.1, Qwen-Image, HunyuanVideo) only: every query reads the text tokens
        with the host's softmax kernel (True), or through one summary of the text, as a block of its own (False;
        ops.joint; torch paths only).
    far_init: with an exact region, the initial mixing weight of what lies outside it, relative to the region's 1
        and shaped by `mixing_init` (mixing.region_mixing): 0 starts as the host's attention cut to the region;
        conversion with calibration data fits it per layer (calibrate.py).
    feature_map: φ of the linear part: "relu", "elu" (elu + 1), or "hedgehog", learned per key head
        (ops.feature_maps.HedgehogFeatureMap, new weights the layer owns as `feature_map`; torch paths only).
    rope: "before_feature_map" rotates q and k with the host's RoPE, then applies φ — the
        operator's exact semantics, weights stay non-negative; "none" ignores the host's RoPE.
    output_norm: per-head RMSNorm on the attention output (new parameters, weight 1).
    """

    blocks: tuple[int, ...] | None = None
    causal: bool = False
    chunk_size: int = 64
    window: int = 8
    exact_chunks: int = 0
    exact_radius: int | tuple[int, ...] | None = None
    retrieval_heads: tuple[int, ...] | dict[int, tuple[int, ...]] = ()
    text_exact: bool = True
    far_init: float = 0.0
    feature_map: str = "relu"
    normalize: bool = True
    scale: float | None = None
    eps: float = 1e-6
    mixing_init: MixingInit = "locality"
    learnable_mixing: bool = True
    per_head_mixing: bool = False
    output_norm: bool = False
    rope: Literal["before_feature_map", "none"] = "before_feature_map"
    backend: str = "auto"

    def __post_init__(self):
        """Every field is checked here, so each way in (the Python API, the CLI, recipes, a saved
        mhla_config.json) refuses the same bad values with the same message, before any layer exists."""
        if self.blocks is not None:
            self.blocks = as_axes("blocks", self.blocks)
        for name in ("causal", "learnable_mixing", "per_head_mixing", "output_norm", "text_exact"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false; got {getattr(self, name)!r}")
        for name in ("chunk_size", "window"):
            value = getattr(self, name)
            if whole_number(value) is None or value < 1:
                raise ValueError(f"{name} must be a whole number ≥ 1; got {value!r}")
        if self.rope not in ("before_feature_map", "none"):
            raise ValueError(f"rope must be 'before_feature_map' or 'none'; got {self.rope!r}")
        check_mixing_init(self.mixing_init)
        check_options(feature_map=self.feature_map, normalize=self.normalize, scale=self.scale, eps=self.eps,
                      backend=self.backend)
        if whole_number(self.exact_chunks) is None or self.exact_chunks < 0:
            raise ValueError(f"exact_chunks must be a whole number ≥ 0; got {self.exact_chunks!r}")
        if self.exact_chunks and not (self.causal and self.exact_chunks < self.window and self.normalize):
            raise ValueError(
                f"exact_chunks={self.exact_chunks} needs a causal, normalised layer and exact_chunks < window "
                f"(window={self.window}); use exact_chunks=0 or raise window")
        if not (isinstance(self.far_init, (int, float)) and not isinstance(self.far_init, bool)
                and 0 <= self.far_init < float("inf")):
            raise ValueError(f"far_init must be a finite number ≥ 0; got {self.far_init!r}")
        self.retrieval_heads = _retrieval_heads(self.retrieval_heads)
        if self.retrieval_heads and not self.causal:
            raise ValueError(f"retrieval_heads={self.to_dict()['retrieval_heads']} is for causal models (LMs); drop it")
        if self.exact_radius is not None:
            axes = len(self.blocks) if self.blocks is not None else (
                1 if isinstance(self.exact_radius, int) else len(self.exact_radius))
            radius = exact_radius_axes(self.exact_radius, axes)
            self.exact_radius = radius[0] if isinstance(self.exact_radius, int) else radius
            if self.causal or not self.normalize:
                raise ValueError(f"exact_radius={self.exact_radius} needs a non-causal, normalised layer; causal "
                                 "layers read their nearest chunks exactly with exact_chunks")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["blocks"] = list(self.blocks) if self.blocks is not None else None
        heads = self.retrieval_heads
        out["retrieval_heads"] = {str(i): list(h) for i, h in heads.items()} if isinstance(heads, dict) else list(heads)
        if isinstance(self.exact_radius, tuple):
            out["exact_radius"] = list(self.exact_radius)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "MHLAConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown MHLA options {unknown}; allowed: {sorted(known)}")
        return cls(**data)

    def replace(self, **changes) -> "MHLAConfig":
        return dataclasses.replace(self, **changes)

    def for_layer(self, index: int) -> "MHLAConfig":
        """Layer `index`'s config: its own retrieval heads where they are given per layer."""
        heads = self.retrieval_heads
        return self.replace(retrieval_heads=heads.get(index, ())) if isinstance(heads, dict) else self


def _retrieval_heads(heads):
    """retrieval_heads as the config keeps it: sorted tuples of key-head indices, per layer in a dict (its keys may
    come from JSON as strings); layers with none left out."""
    def indices(value, where=""):
        if not (isinstance(value, (list, tuple)) and all(whole_number(h) is not None and h >= 0 for h in value)
                and len(set(value)) == len(value)):
            raise ValueError(f"retrieval_heads{where} must be distinct key-head indices ≥ 0, e.g. [0] or "
                             f"{{3: [0, 5]}} per layer; got {value!r}")
        return tuple(sorted(operator.index(h) for h in value))

    if not isinstance(heads, dict):
        return indices(heads)
    layers = {}
    for key, value in heads.items():
        layer = int(key) if isinstance(key, str) and key.isdigit() else whole_number(key)
        if layer is None or layer < 0:
            raise ValueError(f"retrieval_heads per layer must be keyed by layer index ≥ 0; got {key!r}")
        if indices(value, f"[{key}]"):
            layers[layer] = indices(value)
    return dict(sorted(layers.items()))


class MHLAttention(nn.Module):
    """Multi-Head Linear Attention over a token grid (non-causal) or a sequence (causal).

    Submodules: to_q, to_k, to_v, to_out; norm_q / norm_k (Identity unless `qk_norm` is
    "across_heads" — applied on (B, N, H·D) — or "per_head" — on (B, N, H, D)); out_norm.
    Parameter `mixing`: (M, M) / (H, M, M) non-causal, (W,) / (H, W) relative causal.

    A subclass standing in for a host attention whose submodules have other names (Llama's q_proj,
    …, o_proj, q_norm, k_norm) lists them in `host_names`, {MHLA name: host name}: the submodules are
    registered under the host's names, so state-dict keys and the module names PEFT targets by
    default stay the host's, while the code here keeps using the MHLA names.
    """

    host_names: ClassVar[dict[str, str]] = {}

    def __init__(
        self, dim: int, num_heads: int, *, head_dim: int | None = None, num_kv_heads: int | None = None,
        qkv_bias: bool = False, out_bias: bool = True, out_dim: int | None = None,
        qk_norm: Literal["across_heads", "per_head"] | None = None, config: MHLAConfig | None = None,
    ):
        super().__init__()
        self.config = config = config or MHLAConfig()
        self.num_heads, self.head_dim = num_heads, head_dim or dim // num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        retrieval = config.retrieval_heads
        if isinstance(retrieval, dict):
            raise ValueError("retrieval_heads per layer: build each layer with config.for_layer(its index)")
        if retrieval and (max(retrieval) >= self.num_kv_heads or len(retrieval) == self.num_kv_heads):
            raise ValueError(f"retrieval_heads={list(retrieval)} must name some, not all, of the layer's "
                             f"{self.num_kv_heads} key heads (indices 0 … {self.num_kv_heads - 1})")
        inner, kv_inner = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.to_q = nn.Linear(dim, inner, bias=qkv_bias)
        self.to_k = nn.Linear(dim, kv_inner, bias=qkv_bias)
        self.to_v = nn.Linear(dim, kv_inner, bias=qkv_bias)
        self.to_out = nn.Linear(inner, out_dim or dim, bias=out_bias)
        self.qk_norm = qk_norm
        norm_dim = {"across_heads": (inner, kv_inner), "per_head": (self.head_dim, self.head_dim)}.get(qk_norm)
        self.norm_q = nn.RMSNorm(norm_dim[0], eps=1e-6) if norm_dim else nn.Identity()
        self.norm_k = nn.RMSNorm(norm_dim[1], eps=1e-6) if norm_dim else nn.Identity()
        self.out_norm = nn.RMSNorm(self.head_dim, eps=1e-6) if config.output_norm else nn.Identity()
        self.new_parameters()

    def new_parameters(self, device=None, dtype=None) -> None:
        """(Re)create what conversion adds to the host's weights, on `device`: the mixing (float32) and, for a
        learned feature map, its weights (in `dtype`)."""
        cfg = self.config
        self.mixing = nn.Parameter(self._initial_mixing().to(device), requires_grad=cfg.learnable_mixing)
        learned = LEARNED_FEATURE_MAPS.get(cfg.feature_map)
        if learned is not None:
            self.feature_map = learned(self.linear_kv_heads, self.head_dim, device=device, dtype=dtype)

    @property
    def linear_kv_heads(self) -> int:
        """The key heads MHLA runs on (all but the retrieval heads); the mixing and feature map are theirs."""
        return self.num_kv_heads - len(self.config.retrieval_heads)

    @property
    def phi(self):
        """The feature map as the operators take it: the config's name, or this layer's learned module."""
        return self.feature_map if self.config.feature_map in LEARNED_FEATURE_MAPS else self.config.feature_map

    @property
    def has_region(self) -> bool:
        """Whether part of each query's keys is read exactly (`exact_chunks` / `exact_radius`)."""
        return bool(self.config.exact_chunks) or self.config.exact_radius is not None

    def _initial_mixing(self, far_init: float | None = None) -> torch.Tensor:
        """The mixing at conversion; `far_init` overrides the config's (`calibrate.fit_far_weights`)."""
        cfg = self.config
        if cfg.causal:
            mixing = relative_causal_mixing(cfg.window, cfg.mixing_init)
            region = torch.arange(cfg.window) < cfg.exact_chunks if cfg.exact_chunks else None
        elif cfg.blocks is None:
            raise ValueError("MHLAConfig.blocks is required for a non-causal layer, e.g. blocks=(4, 4)")
        else:
            mixing = initial_mixing(cfg.mixing_init, cfg.blocks)
            radius = None if cfg.exact_radius is None else exact_radius_axes(cfg.exact_radius, len(cfg.blocks))
            region = None if radius is None else exact_mask(cfg.blocks, radius)
        if region is not None:
            mixing = region_mixing(mixing, region, cfg.far_init if far_init is None else far_init)
        if not cfg.per_head_mixing:
            return mixing
        heads = self.num_heads // self.num_kv_heads * self.linear_kv_heads
        return mixing.expand(heads, *mixing.shape).clone()

    def __getattr__(self, name: str):
        return super().__getattr__(self.host_names.get(name, name))

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(self.host_names.get(name, name), value)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(self.host_names.get(name, name))

    def submodule_name(self, name: str) -> str:
        """Where the MHLA submodule `name` (to_q, …, norm_k) is registered: its host name, if any."""
        return self.host_names.get(name, name)

    @property
    def num_blocks(self) -> int | None:
        return None if self.config.causal else self.mixing.shape[-1]

    def project(self, x: torch.Tensor, rotary: Rotary | None = None):
        """x (B, N, C) → q, k, v as (B, N, H, D), normed and rotated as the host model did."""
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        rotate = rotary is not None and self.config.rope == "before_feature_map"
        norm_rotate = getattr(rotary, "norm_rotate", None)
        if rotate and norm_rotate is not None and self.qk_norm in (None, rotary.norm_kind):
            # norm and rotation in one pass per tensor where a kernel takes them (ops.rotary)
            backend = "torch" if self.config.backend == "torch" else "auto"
            norms = (self.norm_q, self.norm_k) if self.qk_norm else (None, None)
            q, k = (norm_rotate(t, norm, self.head_dim, backend) for t, norm in zip((q, k), norms))
            return q, k, v.unflatten(-1, (-1, self.head_dim))
        if self.qk_norm == "across_heads":
            q, k = self.norm_q(q), self.norm_k(k)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        if self.qk_norm == "per_head":
            q, k = self.norm_q(q), self.norm_k(k)
        if rotate:
            q, k = rotary(q, k)
        return q, k, v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return self.to_out(self.out_norm(o).flatten(-2))

    def _op_options(self) -> dict:
        cfg = self.config
        options = dict(feature_map=self.phi, normalize=cfg.normalize, scale=cfg.scale, eps=cfg.eps)
        return options if cfg.exact_radius is None else {**options, "exact_radius": cfg.exact_radius}

    def attend(self, q, k, v, grid=None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The operator on projected (B, N, H, D) tensors; `grid` is required when non-causal; `key_mask`
        (B, N) bool marks real tokens (False: padding, which no query reads)."""
        cfg = self.config
        if cfg.causal and cfg.retrieval_heads:
            (q, qr), (k, kr), (v, vr) = (split_heads(t, cfg.retrieval_heads, self.num_kv_heads) for t in (q, k, v))
            return merge_heads(self._attend_causal(q, k, v, key_mask), retrieval_attention(qr, kr, vr, key_mask),
                               cfg.retrieval_heads, self.num_kv_heads)
        if cfg.causal:
            return self._attend_causal(q, k, v, key_mask)
        if grid is None:
            raise ValueError("a non-causal MHLA layer needs the token grid: forward(x, grid=(H, W)) or (T, H, W)")
        return mhla_attention(
            q, k, v, self.mixing, grid=grid, blocks=cfg.blocks, key_mask=key_mask, backend=cfg.backend,
            **self._op_options()
        )

    def _attend_causal(self, q, k, v, key_mask):
        cfg = self.config
        num_chunks = -(-q.shape[1] // cfg.chunk_size)
        mixing = toeplitz_causal_mixing(self.mixing, num_chunks)
        return mhla_attention(q, k, v, mixing, causal=True, chunk_size=cfg.chunk_size, exact_chunks=cfg.exact_chunks,
                              key_mask=key_mask, backend=cfg.backend, **self._op_options())

    def attend_real(self, q, k, v, real: torch.Tensor | None):
        """The causal parallel form over each row's real tokens alone (`real` (B, N) bool, None: all): padding
        anywhere in a row (left padding in batched generation) moves behind them, so chunk boundaries count real
        tokens only and a padded row gives what it gives unpadded. → output in the input order, and k, v
        (B, N, H_kv, ·) packed as attended, with each row's number of real tokens."""
        if real is None:
            return self.attend(q, k, v), k, v, torch.full(q.shape[:1], q.shape[1], device=q.device)
        order = torch.argsort((~real).to(torch.int32), dim=1, stable=True)  # real tokens first, in order

        def packed(t):
            return t.gather(1, order[:, :, None, None].expand_as(t))

        k, v = packed(k), packed(v)
        out = self.attend(packed(q), k, v)
        out = torch.empty_like(out).scatter_(1, order[:, :, None, None].expand_as(out), out)
        return out, k, v, real.sum(1)

    def decode(self, q, k, v, state: DecodeState | None,
               key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, DecodeState]:
        """Causal attention that continues `state` (None: a fresh sequence) → output, the state.

        A fresh input runs the parallel form over each row's real tokens (`attend_real`; `key_mask` (B, N) bool,
        False for padding, such as a prompt's left padding) and starts a `DecodeState` (ops.recurrent) from them;
        later tokens each take one recurrent step, which updates `state` in place.
        """
        cfg = self.config
        if not cfg.causal:
            raise ValueError("decode() is for causal MHLA layers")
        if state is None:
            out, k, v, lengths = self.attend_real(q, k, v, key_mask)
            return out, DecodeState.from_prompt(k, v, lengths, cfg, feature_map=self.phi)
        return state.steps(q, k, v, key_mask, self.mixing, cfg), state

    def forward(self, x: torch.Tensor, grid=None, rotary: Rotary | None = None) -> torch.Tensor:
        """x (B, N, C) → (B, N, out_dim). `grid`: the token grid (non-causal); `rotary`: a
        function applying the host's RoPE to (B, N, H, D) q and k."""
        q, k, v = self.project(x, rotary)
        return self.output(self.attend(q, k, v, grid))

    def extra_repr(self) -> str:
        cfg = self.config
        layout = f"window={cfg.window}, chunk={cfg.chunk_size}" if cfg.causal else f"blocks={cfg.blocks}"
        heads = f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        return f"{heads}, {layout}, causal={cfg.causal}"


def mhla_layers(module: nn.Module) -> list[tuple[str, MHLAttention]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MHLAttention)]
