"""MHLA with an exact local region, dispatched and wrapped as one PyTorch custom op for both of its forms:

- causal, `exact_chunks = L`: a query's own chunk and the L − 1 before it (`ops.exact_local`, dispatch op "exact");
- non-causal, `exact_radius = r`: the blocks within r_a of a query's block on every grid axis (`ops.exact_blocks`,
  dispatch op "exact_blocks").

The region's extent travels as `exact`: (L,) when causal, r per axis otherwise. Eager calls run the chosen
backend's implementation directly; traced calls are one `exact_attention_op` node, which picks it at run time, and
whose backward runs that backend's registered backward, else its forward again under `torch.func.vjp`.
"""

from __future__ import annotations

import torch

from .blocks import BlockLayout
from .dispatch import select
from .exact_blocks import mhla_attention_exact_blocks_torch
from .exact_local import mhla_attention_exact_local_torch
from .feature_maps import FEATURE_MAPS, FeatureMap
from .library import backend_grads, register_attention_op


def _impl(q, k, v, mixing, layout: BlockLayout, *, causal: bool, exact, phi, key_mask, backend: str):
    """(implementation, its keyword for the region) of the backend that takes these inputs."""
    if causal:
        region = {"exact_chunks": exact[0]}
        impl = select("exact", backend, mhla_attention_exact_local_torch, q, k, v, mixing, layout, **region,
                      phi=phi, key_mask=key_mask)
    else:
        region = {"exact_radius": tuple(exact)}
        impl = select("exact_blocks", backend, mhla_attention_exact_blocks_torch, q, k, v, mixing, layout, **region,
                      phi=phi, key_mask=key_mask)
    return impl, region


def exact_attention(q, k, v, mixing, layout: BlockLayout, *, causal: bool, exact: tuple[int, ...],
                    feature_map: FeatureMap, phi, scale: float, eps: float, key_mask, backend: str):
    """`mhla_attention(..., exact_chunks=L)` or `(..., exact_radius=r)` on checked inputs (a callable feature map,
    which no op schema carries, is traced inline)."""
    if torch.compiler.is_compiling() and isinstance(feature_map, str):
        return exact_attention_op(q, k, v, mixing, key_mask, layout.grid, layout.blocks, layout.block_size, causal,
                                  list(exact), feature_map, scale, eps, backend)
    impl, region = _impl(q, k, v, mixing, layout, causal=causal, exact=exact, phi=phi, key_mask=key_mask,
                         backend=backend)
    return impl(q, k, v, mixing, layout, **region, phi=phi, scale=scale, eps=eps, key_mask=key_mask)


# --- the parallel form as a PyTorch custom op (as `ops.mhla.attention_op`) ------------------------------------------
_ARGS = ("SymInt[] grid, SymInt[] blocks, SymInt[] block_size, bool causal, int[] exact, str feature_map, "
         "float scale, float eps, str backend")


def _backend(q, k, v, mixing, key_mask, grid, blocks, block_size, causal, exact, feature_map, backend):
    """(implementation, layout, region keyword, φ) for the op's arguments."""
    layout = BlockLayout(tuple(grid), tuple(blocks), tuple(block_size))
    phi = FEATURE_MAPS[feature_map]
    impl, region = _impl(q, k, v, mixing, layout, causal=causal, exact=exact, phi=phi, key_mask=key_mask,
                         backend=backend)
    return impl, layout, region, phi


@torch.library.custom_op("mhla_convert::exact_attention", mutates_args=(),
                         schema=f"(Tensor q, Tensor k, Tensor v, Tensor mixing, Tensor? key_mask, {_ARGS}) -> Tensor")
def exact_attention_op(q, k, v, mixing, key_mask, grid, blocks, block_size, causal, exact, feature_map, scale, eps,
                       backend):
    """`exact_attention` on checked inputs: the layout as (grid, blocks, block_size) of a `BlockLayout`, the
    feature map by name. Output (B, N, H, D_v), contiguous, in q's dtype."""
    impl, layout, region, phi = _backend(q, k, v, mixing, key_mask, grid, blocks, block_size, causal, exact,
                                         feature_map, backend)
    return impl(q, k, v, mixing, layout, **region, phi=phi, scale=scale, eps=eps, key_mask=key_mask).contiguous()


@torch.library.custom_op(
    "mhla_convert::exact_attention_backward", mutates_args=(),
    schema=f"(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor mixing, Tensor? key_mask, bool[] needs_grad, {_ARGS}) "
           "-> (Tensor, Tensor, Tensor, Tensor)",
)
def exact_attention_backward_op(grad, q, k, v, mixing, key_mask, needs_grad, grid, blocks, block_size, causal, exact,
                                feature_map, scale, eps, backend):
    """(dq, dk, dv, dmixing) of `exact_attention_op` from the inputs alone (`library.backend_grads`)."""
    impl, layout, region, phi = _backend(q, k, v, mixing, key_mask, grid, blocks, block_size, causal, exact,
                                         feature_map, backend)
    options = dict(**region, phi=phi, scale=scale, eps=eps, key_mask=key_mask)
    return backend_grads(impl, grad, (q, k, v, mixing), layout, options, needs_grad)


register_attention_op(exact_attention_op, exact_attention_backward_op, saved=5, differentiable=4)  # (key_mask)
