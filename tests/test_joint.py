"""Joint text–image MHLA (`ops.joint`, MM-DiT families) against its O(N²) definition."""

from __future__ import annotations

import pytest
import torch

from mhla_convert.ops.joint import joint_attention
from mhla_convert.ops.reference import joint_attention_reference


def _inputs(batch, text, grid, heads=4, kv_heads=4, dim=8, blocks=(2, 3), per_head=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = text + grid[0] * grid[1]
    q = torch.randn(batch, n, heads, dim, generator=g)
    k = torch.randn(batch, n, kv_heads, dim, generator=g)
    v = torch.randn(batch, n, kv_heads, dim + 2, generator=g)
    m = blocks[0] * blocks[1] + 1
    mixing = torch.rand(*((heads,) if per_head else ()), m, m, generator=g)
    return q, k, v, mixing


CASES = [  # (batch, text, odd grid, blocks, exact_radius, kv_heads, per_head)
    (2, 5, (5, 7), (2, 3), 1, 4, False),
    (3, 3, (7, 5), (3, 2), 0, 2, True),
    (2, 4, (6, 5), (2, 2), None, 4, False),
    (1, 6, (5, 5), (3, 3), (1, 0), 1, False),
]


@pytest.mark.parametrize("batch, text, grid, blocks, radius, kv_heads, per_head", CASES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("text_exact", [True, False])
def test_joint_matches_reference_with_gradients(batch, text, grid, blocks, radius, kv_heads, per_head, masked,
                                                text_exact):
    q, k, v, mixing = _inputs(batch, text, grid, kv_heads=kv_heads, blocks=blocks, per_head=per_head)
    mask = None
    if masked:  # padded text keys, at least one real token per row
        lengths = torch.randint(1, text + 1, (batch, 1), generator=torch.Generator().manual_seed(1))
        mask = torch.arange(text)[None] < lengths
    options = dict(text=text, grid=grid, blocks=blocks, exact_radius=radius, text_mask=mask, text_exact=text_exact)
    tensors = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
    copies = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
    out = joint_attention(*tensors, **options)
    ref = joint_attention_reference(*copies, **options)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * grad).sum().backward()
    (ref * grad).sum().backward()
    for mine, theirs in zip(tensors, copies):  # (float32 sums in another order: a few 1e-5 apart)
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=5e-5)


def test_text_column_and_row_act_as_specified():
    """Weight 0 on the text column: image queries ignore the text entirely; a padded text key changes nothing."""
    q, k, v, mixing = _inputs(2, 4, (5, 6))
    mixing[:-1, -1] = 0
    out = joint_attention(q, k, v, mixing, text=4, grid=(5, 6), blocks=(2, 3), exact_radius=1)
    v2 = v.clone()
    v2[:, :4] += 1
    assert torch.equal(joint_attention(q, k, v2, mixing, text=4, grid=(5, 6), blocks=(2, 3), exact_radius=1)[:, 4:],
                       out[:, 4:])
    mask = torch.tensor([[True, True, True, False]] * 2)
    k2 = k.clone()
    k2[:, 3] = 100.0
    mixing[:-1, -1] = 1
    a = joint_attention(q, k, v, mixing, text=4, grid=(5, 6), blocks=(2, 3), exact_radius=1, text_mask=mask)
    b = joint_attention(q, k2, v, mixing, text=4, grid=(5, 6), blocks=(2, 3), exact_radius=1, text_mask=mask)
    assert torch.equal(a, b)


def test_bad_inputs_are_refused():
    q, k, v, mixing = _inputs(1, 3, (4, 4))
    with pytest.raises(ValueError, match="text must be"):
        joint_attention(q, k, v, mixing, text=0, grid=(4, 4), blocks=(2, 3))
    with pytest.raises(ValueError, match="prod\\(grid\\)"):
        joint_attention(q, k, v, mixing, text=3, grid=(4, 3), blocks=(2, 3))
    with pytest.raises(ValueError, match="text_mask"):
        joint_attention(q, k, v, mixing, text=3, grid=(4, 4), blocks=(2, 3), text_mask=torch.ones(1, 2).bool())
    q, k, v, mixing = _inputs(1, 3, (4, 6))
    with pytest.raises(ValueError, match="text_exact must be true or false"):
        joint_attention(q, k, v, mixing, text=3, grid=(4, 6), blocks=(2, 3), text_exact="no")


@pytest.mark.parametrize("radius, text_exact", [(1, True), (None, True), (1, False)])
def test_compiled_joint_attention_equals_eager_with_gradients(radius, text_exact):
    """Under torch.compile the operator is one custom op (no graph break), whose backward recomputes the torch path."""
    q, k, v, mixing = _inputs(2, 3, (5, 6), kv_heads=2, per_head=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    options = dict(text=3, grid=(5, 6), blocks=(2, 3), exact_radius=radius, text_mask=mask, text_exact=text_exact)

    def run(fn):
        tensors = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
        out = fn(*tensors)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [out.detach(), *(t.grad for t in tensors)]

    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: joint_attention(*t, **options), fullgraph=True, backend="aot_eager")
    for got, want in zip(run(compiled), run(lambda *t: joint_attention(*t, **options))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
