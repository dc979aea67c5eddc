"""The Triton inference path of joint text–image MHLA (`kernels.joint_triton`) against the torch path (`ops.joint`,
itself tested against the O(N²) reference in test_joint.py).

Without CUDA the exact-block kernels run under Triton's interpreter on tiny shapes; on CUDA the same cases run
compiled, in float32 and bfloat16, plus a FLUX-sized one.
"""

import pytest
import torch
from triton_marks import DEVICE, gpu, run

from mhla_convert.kernels import joint_triton
from mhla_convert.ops import BlockLayout
from mhla_convert.ops.joint import joint_attention

pytestmark = pytest.mark.usefixtures("poisoned_kernel_buffers")  # (conftest.py)

# batch, text, grid, blocks, exact radius, kv heads, per-head mixing, padded text
CASES = {
    "2d-batch": (2, 5, (5, 7), (2, 3), 1, 4, False, False),
    "2d-gqa-per-head-padded": (3, 3, (7, 5), (3, 2), 0, 2, True, True),
    "2d-per-axis-mqa-padded": (1, 6, (5, 5), (3, 3), (1, 0), 1, False, True),
    "3d-video": (2, 4, (3, 4, 6), (3, 2, 3), (1, 0, 1), 2, False, False),
    # every block in every other's neighbourhood (no summaries made), and text longer than a key tile
    "2d-all-near-long-text-padded": (2, 37, (4, 6), (2, 2), 1, 2, True, True),
}


def _inputs(case, dtype=torch.float32, heads=4, dim=16, dv=18, seed=0):
    batch, text, grid, blocks, radius, kv_heads, per_head, padded = case
    g = torch.Generator().manual_seed(seed)
    n, m = text + torch.tensor(grid).prod().item(), torch.tensor(blocks).prod().item() + 1
    q = torch.randn(batch, n, heads, dim, generator=g)
    k = torch.randn(batch, n, kv_heads, dim, generator=g)
    v = torch.randn(batch, n, kv_heads, dv, generator=g)
    mixing = torch.rand(*((heads,) if per_head else ()), m, m, generator=g) + 0.05
    mixing[..., 0, -1] = 0  # the first image block ignores the text
    mask = None
    if padded:  # random lengths, and a first row whose text is all padding
        mask = torch.arange(text)[None] < torch.randint(1, text + 1, (batch, 1), generator=g)
        mask[0] = False
        mask = mask.to(DEVICE)
    options = dict(text=text, grid=grid, blocks=blocks, exact_radius=radius, text_mask=mask)
    return [t.to(device=DEVICE, dtype=dtype) for t in (q, k, v)] + [mixing.to(DEVICE)], options


@run
@pytest.mark.parametrize("name", CASES)
def test_matches_the_torch_path(name):
    tensors, options = _inputs(CASES[name])
    out = joint_attention(*tensors, backend="triton", **options)
    ref = joint_attention(*tensors, backend="torch", **options)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@gpu
@pytest.mark.parametrize("name", CASES)
def test_bf16_matches_the_torch_path(name):
    tensors, options = _inputs(CASES[name], dtype=torch.bfloat16)
    out = joint_attention(*tensors, backend="triton", **options)
    ref = joint_attention(*(t.float() for t in tensors), backend="torch", **options)
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)


@run
@pytest.mark.parametrize("name", ["2d-batch", "2d-gqa-per-head-padded"])
def test_text_queries_that_ignore_the_text(name):
    """m_MM = 0 (shared, and for every head of a per-head mixing): the text queries read the image's summaries
    alone."""
    tensors, options = _inputs(CASES[name])
    tensors[3][..., -1, -1] = 0
    out = joint_attention(*tensors, backend="triton", **options)
    ref = joint_attention(*tensors, backend="torch", **options)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@gpu
def test_flux_sized_bf16():
    """FLUX.1 at 1024²: 64x64 image tokens in 8x8 blocks, the neighbourhood exact, 512 text tokens, 24 heads of 128."""
    case = (1, 512, (64, 64), (8, 8), 1, 24, False, False)
    tensors, options = _inputs(case, dtype=torch.bfloat16, heads=24, dim=128, dv=128)
    out = joint_attention(*tensors, backend="triton", **options)
    ref = joint_attention(*(t.float() for t in tensors), backend="torch", **options)
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)


@run
def test_auto_keeps_the_torch_path_for_training_and_without_a_region():
    """Gradients, layers without an exact region and text read through its summary run the torch path;
    backend="triton" names why it cannot."""
    tensors, options = _inputs(CASES["2d-batch"])
    grads = [t.clone().requires_grad_() for t in tensors]
    layout = BlockLayout.create(options["grid"], options["blocks"])
    reason = joint_triton.unsupported_reason(*grads, layout, text=5, exact_radius=(1, 1), phi=torch.relu)
    assert reason.startswith("inputs that need gradients")
    assert not joint_triton.supports(*grads, layout, text=5, exact_radius=(1, 1), phi=torch.relu)
    out = joint_attention(*grads, **options)  # auto: the torch path, differentiable
    out.sum().backward()
    assert all(t.grad is not None for t in grads)
    with pytest.raises(ValueError, match="need gradients"):
        joint_attention(*grads, backend="triton", **options)
    with pytest.raises(ValueError, match="without an exact region"):
        joint_attention(*tensors, backend="triton", **{**options, "exact_radius": None})
    assert not joint_triton.supports(*tensors, layout, text=5, exact_radius=(1, 1), phi=torch.relu, text_exact=False)
    with pytest.raises(ValueError, match="text_exact=False"):
        joint_attention(*tensors, backend="triton", **{**options, "text_exact": False})
