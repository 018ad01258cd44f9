from __future__ import annotations

import pytest
import torch

from prunekit.errors import PatternError
from prunekit.prune.patterns import NM, Block, Unstructured, parse_pattern


def random_shapes(count: int, multiple_rows: int = 1, multiple_cols: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        rows = int(torch.randint(1, 9, (1,), generator=g)) * multiple_rows
        cols = int(torch.randint(1, 9, (1,), generator=g)) * multiple_cols
        yield rows, cols


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.9, 0.99])
def test_unstructured_mask_reaches_exact_sparsity(sparsity):
    for shape in random_shapes(10, 3, 5):
        scores = torch.randn(shape)
        mask = Unstructured().mask(scores, sparsity)
        assert int((~mask).sum()) == round(sparsity * scores.numel())
        kept, pruned = scores[mask], scores[~mask]
        if kept.numel() and pruned.numel():
            assert kept.min() >= pruned.max()


@pytest.mark.parametrize("block", [(2, 3), (4, 4), (1, 8)])
def test_block_mask_keeps_whole_blocks_at_exact_block_sparsity(block):
    pattern = Block(*block)
    for shape in random_shapes(10, *block):
        mask = pattern.mask(torch.randn(shape), 0.5)
        assert pattern.is_valid(mask)
        nblocks = mask.numel() // (block[0] * block[1])
        assert int((~mask).sum()) // (block[0] * block[1]) == round(0.5 * nblocks)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (3, 7)])
def test_nm_mask_keeps_exactly_n_per_group(n, m):
    pattern = NM(n, m)
    for shape in random_shapes(10, 1, m):
        mask = pattern.mask(torch.randn(shape), pattern.check_sparsity(None))
        assert pattern.is_valid(mask)
        assert bool((mask.reshape(shape[0], -1, m).sum(-1) == n).all())


def test_nm_mask_keeps_the_largest_scores_in_each_group():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.2, 3.0, 1.0, 2.0, 0.0]])
    mask = NM(2, 4).mask(scores, 0.5)
    assert mask.tolist() == [[False, True, True, False, True, False, True, False]]


def test_invalid_masks_are_rejected():
    assert not NM(2, 4).is_valid(torch.ones(2, 8, dtype=torch.bool))
    partial = torch.zeros(4, 4, dtype=torch.bool)
    partial[0, 0] = True
    assert not Block(2, 2).is_valid(partial)
    assert not Block(3, 3).is_valid(torch.zeros(4, 4, dtype=torch.bool))


@pytest.mark.parametrize(
    "text,expected",
    [
        ("unstructured", Unstructured()),
        ("block:32x32", Block(32, 32)),
        ("block:16x64", Block(16, 64)),
        ("2:4", NM(2, 4)),
    ],
)
def test_pattern_strings_round_trip(text, expected):
    assert parse_pattern(text) == expected
    assert parse_pattern(str(expected)) == expected


@pytest.mark.parametrize("text", ["dense", "block:0x4", "block:4", "5:4", "0:4", "2:4:8", ""])
def test_bad_pattern_strings_raise_pattern_error(text):
    with pytest.raises(PatternError):
        parse_pattern(text)


@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5, float("nan")])
def test_sparsity_outside_unit_interval_is_rejected(sparsity):
    with pytest.raises(PatternError):
        Unstructured().check_sparsity(sparsity)


def test_nm_sparsity_is_implied_and_contradictions_rejected():
    assert NM(2, 4).check_sparsity(None) == 0.5
    assert NM(1, 4).check_sparsity(0.75) == 0.75
    with pytest.raises(PatternError):
        NM(2, 4).check_sparsity(0.7)


def test_unfit_shapes_are_reported():
    assert NM(2, 4).unfit_reason((8, 6)) is not None
    assert Block(4, 4).unfit_reason((6, 8)) is not None
    assert Block(4, 4).unfit_reason((8, 8)) is None
