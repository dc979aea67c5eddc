"""Mixing inits (paper §4.2), the relative causal form and the [0, 1] projection."""

import pytest
import torch

from mhla_convert import MHLAConfig, MHLAttention, clamp_mixing_
from mhla_convert.mixing import (
    initial_mixing,
    locality_mixing,
    relative_causal_mixing,
    toeplitz_causal_mixing,
    uniform_mixing,
)


@pytest.mark.parametrize("blocks", [(5,), (4, 4), (3, 5), (7, 3, 5), (1, 1)])
def test_locality_rows_sum_to_one_and_fall_with_distance(blocks):
    m = locality_mixing(blocks, dtype=torch.float64)
    torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[0], dtype=torch.float64))
    assert (m >= 0).all()
    axes = [torch.arange(b, dtype=torch.float64) for b in blocks]
    centres = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, len(blocks))
    dist = torch.cdist(centres, centres)
    for i in range(m.shape[0]):
        order = dist[i].argsort()
        assert (m[i, order].diff() <= 1e-12).all(), f"row {i} must fall with distance"
        assert m[i, i] == m[i].max()


def test_locality_is_row_normalised_not_column_normalised():
    m = locality_mixing((3, 4), dtype=torch.float64)  # rectangular block grid: rows and columns differ
    assert not torch.allclose(m.sum(0), torch.ones(12, dtype=torch.float64))


def test_causal_variants_are_lower_triangular_rows_sum_to_one():
    for m in (locality_mixing(6, causal=True), uniform_mixing(6, causal=True)):
        assert torch.equal(m, m.tril())
        torch.testing.assert_close(m.sum(-1), torch.ones(6))
    torch.testing.assert_close(uniform_mixing(4), torch.full((4, 4), 0.25))


def test_relative_causal_mixing_extends_to_any_length():
    r = relative_causal_mixing(3)
    torch.testing.assert_close(r.sum(), torch.tensor(1.0))
    assert (r.diff() < 0).all()
    dense = toeplitz_causal_mixing(r, 6)
    assert torch.equal(dense, dense.tril())
    assert dense[5, 5] == r[0] and dense[5, 4] == r[1] and dense[5, 0] == r[2] and dense[5, 3] == r[2]


def test_blend_and_bad_init():
    local, uni = initial_mixing("locality", (2, 2)), initial_mixing("uniform", (2, 2))
    torch.testing.assert_close(initial_mixing(0.25, (2, 2)), 0.25 * local + 0.75 * uni)
    with pytest.raises(ValueError, match="mixing_init must be"):
        initial_mixing("gaussian", (2, 2))


def test_clamp_projects_every_mixing_onto_unit_interval():
    model = torch.nn.Sequential(
        MHLAttention(16, 2, config=MHLAConfig(blocks=(2,))), MHLAttention(16, 2, config=MHLAConfig(causal=True))
    )
    with torch.no_grad():
        for layer in model:
            layer.mixing.uniform_(-2, 2)
    weights_before = model[0].to_q.weight.clone()
    clamp_mixing_(model)
    for layer in model:
        assert layer.mixing.min() >= 0 and layer.mixing.max() <= 1
    assert torch.equal(model[0].to_q.weight, weights_before)
