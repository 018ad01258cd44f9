"""The ``ks`` format: (a, d, b, c) blocks per Kronecker-sparse factor, exact round trips and byte counts."""

from __future__ import annotations

import pytest
import torch

from prunekit.errors import FormatError
from prunekit.formats import decode, encode, format_names
from prunekit.formats.ks import blocks_to_dense, dense_to_blocks, encode_factors, ks_support, parse_patterns
from prunekit.prune import prune_tensor
from prunekit.prune.patterns import KroneckerSparse

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def random_quads(count: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        yield tuple(int(v) for v in torch.randint(1, 6, (4,), generator=g))


def ks_weight(quad, dtype, seed=0):
    pat = KroneckerSparse(*quad)
    w = torch.randn(pat.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return prune_tensor(w, pat, pat.check_sparsity(None))


def test_ks_is_registered():
    assert "ks" in format_names()


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_factor_round_trips_exactly_with_exact_bytes(dtype):
    for seed, quad in enumerate(random_quads(12)):
        a, b, c, d = quad
        w = ks_weight(quad, dtype, seed)
        enc = encode("ks", w, dict(zip("abcd", quad)))
        assert enc.format == "ks" and enc.shape == w.shape
        assert tuple(enc.components["blocks"].shape) == (a, d, b, c)
        assert enc.components["blocks"].is_contiguous()
        assert enc.params["patterns"] == ",".join(map(str, quad))
        out = decode(enc)
        assert out.dtype == dtype and torch.equal(out, w)
        assert enc.nbytes == a * b * c * d * w.element_size()


def test_blocks_follow_the_documented_index_convention():
    a, b, c, d = 3, 2, 4, 5
    blocks = torch.randn(a, d, b, c)
    dense = blocks_to_dense(blocks)
    for alpha in range(a):
        for delta in range(d):
            for beta in range(b):
                for gamma in range(c):
                    assert (
                        dense[(alpha * b + beta) * d + delta, (alpha * c + gamma) * d + delta]
                        == blocks[alpha, delta, beta, gamma]
                    )
    assert int((dense != 0).sum()) == a * b * c * d
    assert bool((dense[~ks_support((a, b, c, d))] == 0).all())
    assert torch.equal(dense_to_blocks(dense, (a, b, c, d)), blocks)


def test_zero_and_all_support_weights_round_trip():
    quad = (2, 3, 3, 2)
    support = ks_support(quad)
    for w in (torch.zeros(support.shape), (torch.randn(support.shape) + 10) * support):
        assert torch.equal(decode(encode("ks", w, {"patterns": "2,3,3,2"})), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_chain_stores_each_factor_and_decodes_to_the_product(dtype):
    g = torch.Generator().manual_seed(1)
    factors = [torch.randn(1, 2, 4, 4, generator=g).to(dtype), torch.randn(2, 1, 4, 4, generator=g).to(dtype)]
    enc = encode_factors(factors)
    assert enc.params == {"patterns": "1,4,4,2/2,4,4,1"}
    assert list(enc.components) == ["blocks", "blocks1"]
    assert enc.nbytes == 2 * 32 * factors[0].element_size()
    ref = blocks_to_dense(factors[0]).double() @ blocks_to_dense(factors[1]).double()
    out = decode(enc)
    assert out.dtype == dtype and out.shape == (8, 8)
    tol = 1e-12 if dtype == torch.float64 else (1e-6 if dtype == torch.float32 else 2e-3)
    assert float((out.double() - ref).norm() / ref.norm()) < tol


@pytest.mark.parametrize(
    "weight,params,match",
    [
        (torch.randn(30, 40), {"a": 2, "b": 3, "c": 4, "d": 5}, "outside the support"),
        (torch.randn(30, 41), {"a": 2, "b": 3, "c": 4, "d": 5}, "is not"),
        (torch.randn(8, 8), {}, "needs a Kronecker-sparse pattern"),
        (torch.randn(8, 8), {"patterns": "1,4,4,2/2,4,4,1"}, "factorize"),
        (torch.randn(8, 8), {"patterns": "1,4,4"}, "four integers"),
        (torch.randn(2, 8, 8), {"patterns": "1,4,4,2"}, "2-D"),
        (torch.ones(8, 8, dtype=torch.int32), {"patterns": "1,8,8,1"}, "floating-point"),
    ],
)
def test_bad_encodes_raise_format_error(weight, params, match):
    with pytest.raises(FormatError, match=match):
        encode("ks", weight, params)


def test_encode_factors_rejects_shapes_that_do_not_compose():
    with pytest.raises(FormatError, match="columns but factor 2"):
        encode_factors([torch.randn(1, 1, 4, 4), torch.randn(1, 1, 3, 3)])
    with pytest.raises(FormatError, match="at least one"):
        encode_factors([])
    with pytest.raises(FormatError, match=r"\(a, d, b, c\)"):
        encode_factors([torch.randn(4, 4)])
    assert parse_patterns("1,4,4,2/2,4,4,1") == [(1, 4, 4, 2), (2, 4, 4, 1)]
