"""Wanda scores vs a hand computation; SparseGPT vs least squares and vs magnitude; exact masks."""

from __future__ import annotations

import pytest
import torch

from prunekit.errors import PatternError
from prunekit.prune.criteria import magnitude, rowwise_mask, wanda
from prunekit.prune.patterns import NM, Block, Unstructured
from prunekit.prune.sparsegpt import sparsegpt_prune


def test_wanda_score_matches_hand_computation():
    weight = torch.tensor([[1.0, -2.0, 3.0], [-4.0, 0.5, 0.0]])
    x = torch.tensor([[1.0, 0.0, 2.0], [2.0, 3.0, 0.0], [0.0, 4.0, 0.0]])  # (tokens, in_features)
    # ||X_j||_2 over tokens: sqrt(1+4+0)=sqrt(5), sqrt(0+9+16)=5, sqrt(4+0+0)=2
    norms = torch.tensor([5**0.5, 5.0, 2.0])
    expected = torch.tensor([[1 * 5**0.5, 2 * 5.0, 3 * 2.0], [4 * 5**0.5, 0.5 * 5.0, 0.0]])
    torch.testing.assert_close(wanda(weight, x.norm(dim=0)), expected)
    torch.testing.assert_close(wanda(weight, norms), expected)
    # Per-row comparison at 1/3 sparsity: row 0 drops |1|*sqrt5=2.236 (not 2*5), row 1 drops the 0.
    keep = rowwise_mask(wanda(weight, norms), 1 / 3)
    assert keep.tolist() == [[False, True, True], [True, True, False]]


def test_wanda_rejects_norms_of_the_wrong_size():
    with pytest.raises(PatternError, match="input norms"):
        wanda(torch.ones(2, 3), torch.ones(4))


@pytest.mark.parametrize("rows,cols,sparsity", [(7, 13, 0.5), (5, 8, 0.3), (1, 9, 0.9), (6, 4, 0.0)])
def test_rowwise_mask_prunes_exactly_round_sparsity_times_numel(rows, cols, sparsity):
    scores = torch.rand(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    keep = rowwise_mask(scores, sparsity)
    assert int((~keep).sum()) == round(sparsity * rows * cols)
    per_row = (~keep).sum(dim=1)
    assert int(per_row.max() - per_row.min()) <= 1
    for r in range(rows):  # within a row, every pruned score is <= every kept score
        if (~keep[r]).any() and keep[r].any():
            assert scores[r][~keep[r]].max() <= scores[r][keep[r]].min()


def _layer(seed: int, tokens: int = 256, cols: int = 16, rows: int = 6):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g, dtype=torch.float64)
    x = torch.randn(tokens, cols, generator=g, dtype=torch.float64) @ mix  # correlated inputs
    weight = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    return x, weight


def _rel_error(x, weight, approx):
    return float(((x @ weight.T - x @ approx.T) ** 2).sum() / ((x @ weight.T) ** 2).sum())


@pytest.mark.parametrize("block_size", [16, 5])
def test_sparsegpt_with_pruned_prefix_equals_least_squares(block_size):
    # Pruning the first k columns: every pruned weight is compensated by all kept ones, so the
    # OBS sequence is the exact least-squares reconstruction on the kept columns.
    x, weight = _layer(0)
    keep = torch.ones_like(weight, dtype=torch.bool)
    keep[:, :7] = False
    pruned, mask = sparsegpt_prune(weight, x.T @ x, Unstructured(), 7 / 16, block_size=block_size, damp=0.0, mask=keep)
    optimal = torch.linalg.lstsq(x[:, 7:], x @ weight.T).solution.T
    torch.testing.assert_close(pruned[:, 7:], optimal, rtol=1e-9, atol=1e-9)
    assert torch.equal(mask, keep) and bool((pruned[:, :7] == 0).all())


def test_sparsegpt_compensates_a_redundant_input_exactly():
    # Inputs 8..15 repeat inputs 0..7 (rank-deficient H): pruning one copy of each loses nothing.
    g = torch.Generator().manual_seed(1)
    half = torch.randn(128, 8, generator=g, dtype=torch.float64)
    x = torch.cat([half, half], dim=1)
    weight = torch.randn(4, 16, generator=g, dtype=torch.float64)
    keep = torch.ones(4, 16, dtype=torch.bool)
    keep[:, :8] = False  # x @ W^T is unchanged when w[:, j + 8] absorbs w[:, j]
    pruned, _ = sparsegpt_prune(weight, x.T @ x, Unstructured(), 0.5, damp=1e-9, mask=keep)
    assert _rel_error(x, weight, pruned) < 1e-9
    assert _rel_error(x, weight, weight * keep) > 0.1


@pytest.mark.parametrize(
    "pattern,sparsity", [(Unstructured(), 0.5), (NM(2, 4), 0.5), (Block(2, 4), 0.5), (Unstructured(), 0.8)]
)
def test_sparsegpt_beats_magnitude_and_obeys_the_pattern(pattern, sparsity):
    x, weight = _layer(2, cols=32, rows=8)
    pruned, keep = sparsegpt_prune(weight.float(), (x.T @ x).float(), pattern, sparsity, block_size=8)
    assert pattern.is_valid(keep)
    expected_zeros = int((~pattern.mask(magnitude(weight), sparsity)).sum())
    assert int((~keep).sum()) == expected_zeros
    assert bool((pruned[~keep] == 0).all()) and pruned.dtype == torch.float32
    magnitude_pruned = weight * pattern.mask(magnitude(weight), sparsity)
    assert _rel_error(x, weight, pruned.double()) < 0.8 * _rel_error(x, weight, magnitude_pruned)


def test_sparsegpt_handles_dead_inputs_and_rejects_bad_hessians():
    x, weight = _layer(3)
    x[:, 3] = 0.0  # an input never active: its Hessian row is zero
    pruned, keep = sparsegpt_prune(weight, x.T @ x, NM(2, 4), 0.5)
    assert NM(2, 4).is_valid(keep) and torch.isfinite(pruned).all()
    bad = x.T @ x
    bad[0, 0] = float("nan")
    with pytest.raises(PatternError, match="inf/NaN"):
        sparsegpt_prune(weight, bad, NM(2, 4), 0.5)
    with pytest.raises(PatternError, match="does not match"):
        sparsegpt_prune(weight, torch.eye(3, dtype=torch.float64), NM(2, 4), 0.5)
