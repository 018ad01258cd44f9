"""Kronecker-sparse patterns (Gonon et al. 2024) and the factorisation of weights into KS chains."""

from __future__ import annotations

import json

import pytest
import torch

from prunekit.errors import PatternError
from prunekit.formats.ks import blocks_to_dense
from prunekit.prune import prune_tensor
from prunekit.prune.kronecker import chain_product, factorize, factorize_checkpoint, recover_factors
from prunekit.prune.patterns import KroneckerChain, KroneckerSparse, parse_pattern

from ..conftest import tree_digest


def random_quads(count: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        yield tuple(int(v) for v in torch.randint(1, 5, (4,), generator=g))


def test_ks_mask_is_exactly_the_kronecker_support_with_density_1_over_ad():
    for a, b, c, d in random_quads(20):
        pat = KroneckerSparse(a, b, c, d)
        mask = pat.mask(torch.randn(pat.shape), pat.check_sparsity(None))
        assert mask.shape == (a * b * d, a * c * d) and mask.dtype == torch.bool
        expected = torch.kron(torch.kron(torch.eye(a), torch.ones(b, c)), torch.eye(d)) != 0
        assert torch.equal(mask, expected)
        assert int(mask.sum()) == a * b * c * d
        assert pat.is_valid(mask)
        assert pat.check_sparsity(None) == pytest.approx(1 - 1 / (a * d))


def test_ks_projection_keeps_the_support_whatever_the_scores():
    pat = KroneckerSparse(2, 3, 4, 2)
    w = torch.randn(pat.shape)
    pruned = prune_tensor(w, pat, pat.check_sparsity(None))
    support = pat.support()
    assert torch.equal(pruned[support], w[support]) and bool((pruned[~support] == 0).all())
    assert torch.equal(pat.mask(-w.abs(), 0.75), support)  # scores are ignored: the support is fixed


def test_ks_is_valid_rejects_entries_off_the_support_and_wrong_shapes():
    pat = KroneckerSparse(2, 2, 3, 2)
    mask = pat.support().clone()
    assert pat.is_valid(mask) and pat.is_valid(torch.zeros_like(mask))
    off = torch.nonzero(~mask)[0]
    mask[off[0], off[1]] = True
    assert not pat.is_valid(mask)
    assert not pat.is_valid(torch.ones(3, 3, dtype=torch.bool))


def test_ks_unfit_reason_names_the_expected_shape():
    pat = KroneckerSparse(2, 3, 4, 5)
    assert pat.unfit_reason((30, 40)) is None
    reason = pat.unfit_reason((30, 41))
    assert reason is not None and "30x40" in reason and "ks:2,3,4,5" in reason
    with pytest.raises(PatternError, match="30x40"):
        prune_tensor(torch.randn(31, 40), pat, pat.check_sparsity(None))


def test_ks_check_sparsity_accepts_the_implied_value_and_rejects_contradictions():
    pat = parse_pattern("ks:2,8,8,2")
    assert pat.check_sparsity(0.75) == 0.75
    with pytest.raises(PatternError, match="implies sparsity"):
        pat.check_sparsity(0.5)
    assert parse_pattern("ks:1,4,4,1").check_sparsity(None) == 0.0


@pytest.mark.parametrize(
    "text",
    ["ks:2,3,4,5", "ks:1,4,4,2/2,4,4,1", "KS:1,2,2,8/2,2,2,4/4,2,2,2/8,2,2,1", " ks:3,1,1,3 "],
)
def test_parse_pattern_round_trips_ks_factors_and_chains(text):
    pat = parse_pattern(text)
    assert parse_pattern(str(pat)) == pat
    assert isinstance(pat, KroneckerChain) == ("/" in text)


@pytest.mark.parametrize(
    "text,match",
    [
        ("ks:1,2,3", "four integers"),
        ("ks:1,2,3,4,5", "four integers"),
        ("ks:0,2,3,4", "positive"),
        ("ks:a,b,c,d", "four integers"),
        ("ks:", "four integers"),
        ("ks:1,2,3,4/1,2,3,4", "12 columns but factor 2 has 8 rows"),
        ("ks:2,2,2,2//2,2,2,2", "four integers"),
    ],
)
def test_parse_pattern_rejects_bad_ks_specs_with_one_line(text, match):
    with pytest.raises(PatternError, match=match) as info:
        parse_pattern(text)
    assert "\n" not in str(info.value)


def test_chain_shape_sparsity_and_product_support():
    chain = parse_pattern("ks:1,4,4,2/2,4,4,1")
    assert chain.shape == (8, 8) and chain.nparams == 64
    butterfly = parse_pattern("ks:1,2,2,4/2,2,2,2/4,2,2,1")
    assert butterfly.shape == (8, 8) and butterfly.implied_sparsity == pytest.approx(1 - 3 * 16 / 64)
    prod = chain_product([torch.randn(f.a, f.d, f.b, f.c, dtype=torch.float64) for f in butterfly.factors])
    assert butterfly.is_valid(prod != 0)
    with pytest.raises(PatternError, match="stores 48 parameters"):
        butterfly.check_sparsity(0.5)


def test_chain_mask_is_refused_with_the_factorize_command():
    chain = parse_pattern("ks:1,4,4,2/2,4,4,1")
    with pytest.raises(PatternError, match="prunekit ks factorize"):
        prune_tensor(torch.randn(8, 8), chain, chain.check_sparsity(None))


def random_chain(text: str, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    factors = parse_pattern(text).factors if "/" in text else (parse_pattern(text),)
    return [torch.randn(f.a, f.d, f.b, f.c, generator=g, dtype=dtype) for f in factors]


CHAINS = [
    "ks:1,4,4,2/2,4,4,1",
    "ks:1,2,2,8/2,2,2,4/4,2,2,2/8,2,2,1",  # a 16 x 16 butterfly
    "ks:2,3,5,2/1,4,6,5",
    "ks:1,8,4,2/4,2,3,1",
    "ks:3,4,4,1/1,6,2,2",
    "ks:2,8,2,4/4,4,8,1",
]


@pytest.mark.parametrize("text", CHAINS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_factorize_recovers_an_exact_product_of_ks_factors(text, dtype):
    for seed in range(3):
        weight = chain_product(random_chain(text, seed)).to(dtype)
        result = factorize(weight, text)
        assert result.exact_init
        assert result.rel_error < (1e-10 if dtype == torch.float64 else 1e-6), result.rel_error
        assert [tuple(f.shape) for f in result.factors] == [tuple(f.shape) for f in random_chain(text, seed)]
        assert all(f.dtype == dtype for f in result.factors)
        for f, blk in zip(parse_pattern(text).factors, result.factors):
            assert f.is_valid(blocks_to_dense(blk) != 0)


@pytest.mark.parametrize("text", ["ks:1,2,2,8/2,2,2,4/4,2,2,2/8,2,2,1", "ks:1,2,2,4/2,2,2,2/4,2,2,1"])
def test_factorize_error_never_increases_over_als_sweeps(text):
    for seed in range(3):
        weight = torch.randn(parse_pattern(text).shape, generator=torch.Generator().manual_seed(seed))
        result = factorize(weight, text, sweeps=15)
        assert len(result.history) >= 2
        for before, after in zip(result.history, result.history[1:]):
            assert after <= before + 1e-12
        assert 0.0 < result.rel_error < 1.0
        assert result.history[-1] < result.history[0]  # the sweeps did improve on the hierarchical start


def test_factorize_one_factor_is_the_projection_error():
    pat = KroneckerSparse(2, 3, 4, 2)
    w = torch.randn(pat.shape, dtype=torch.float64)
    result = factorize(w, pat)
    projected = w * pat.support()
    assert torch.equal(blocks_to_dense(result.factors[0]), projected)
    assert result.rel_error == pytest.approx(float((w - projected).norm() / w.norm()))


def test_factorize_rejects_wrong_shapes_and_non_ks_patterns():
    with pytest.raises(PatternError, match="not the shape"):
        factorize(torch.randn(8, 9), "ks:1,4,4,2/2,4,4,1")
    with pytest.raises(PatternError, match="not Kronecker-sparse"):
        factorize(torch.randn(8, 8), "2:4")
    with pytest.raises(PatternError, match="2-D floating"):
        factorize(torch.ones(8, 8, dtype=torch.int32), "ks:1,4,4,2/2,4,4,1")


def test_recover_factors_refuses_a_weight_that_is_not_such_a_product():
    text = "ks:1,2,2,4/2,2,2,2/4,2,2,1"
    exact = chain_product(random_chain(text, 0)).float()
    assert recover_factors(exact, text).rel_error < 1e-6
    with pytest.raises(PatternError, match="not a product"):
        recover_factors(torch.randn(8, 8), text)


def test_factorize_checkpoint_writes_products_and_records_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    state = {
        "fc1.weight": torch.randn(64, 32, generator=g),
        "fc1.bias": torch.randn(64, generator=g),
        "fc2.weight": torch.randn(48, 64, generator=g),
    }
    src = tmp_path / "m.safetensors"
    save_file(state, str(src))
    digest = tree_digest(src)
    text = "ks:2,8,2,4/4,4,8,1"
    result = factorize_checkpoint(src, tmp_path / "f.safetensors", text, sweeps=3)
    assert tree_digest(src) == digest
    assert set(result.errors) == {"fc1.weight"} and [n for n, _ in result.skipped] == ["fc2.weight"]
    out = load_file(str(tmp_path / "f.safetensors"))
    assert torch.equal(out["fc2.weight"], state["fc2.weight"]) and torch.equal(out["fc1.bias"], state["fc1.bias"])
    err = float((out["fc1.weight"] - state["fc1.weight"]).norm() / state["fc1.weight"].norm())
    assert err == pytest.approx(result.errors["fc1.weight"], rel=1e-3)
    assert recover_factors(out["fc1.weight"], text).rel_error < 1e-5
    side = json.loads((tmp_path / "f.safetensors.prunekit.json").read_text())
    record = side["tensors"]["fc1.weight"]
    assert record["pattern"] == text and record["method"] == "ks-factorize"
    assert record["rel_error"] == pytest.approx(result.errors["fc1.weight"])
    assert record["sparsity"] == pytest.approx(1 - (2 * 8 * 2 * 4 + 4 * 4 * 8) / (64 * 32))
    with pytest.raises(PatternError, match="nothing to factorize"):
        factorize_checkpoint(src, tmp_path / "g.safetensors", "ks:1,4,4,2/2,4,4,1")
