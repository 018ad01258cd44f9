from __future__ import annotations

import pytest
import torch

from prunekit.errors import FormatError
from prunekit.formats import decode, encode, format_names, get_format
from prunekit.formats.csr import vector_width
from prunekit.prune import prune_tensor
from prunekit.prune.patterns import NM, Block, Unstructured

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
PATTERNS = [
    (Unstructured(), 0.5, {}),
    (Unstructured(), 0.95, {}),
    (Block(4, 8), 0.5, {"block_rows": 4, "block_cols": 8}),
    (NM(2, 4), None, {"n": 2, "m": 4}),
    (NM(1, 4), None, {"n": 1, "m": 4}),
    (NM(4, 8), None, {"n": 4, "m": 8}),
]


def pruned_weight(pattern, sparsity, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g).to(dtype)
    w = prune_tensor(w, pattern, pattern.check_sparsity(sparsity))
    w[1] = 0  # an empty row
    return w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern,sparsity,params", PATTERNS, ids=lambda v: str(v))
@pytest.mark.parametrize("fmt", ["dense", "csr", "bsr", "nm", "bitmask"])
def test_every_pattern_and_format_round_trips_exactly(dtype, pattern, sparsity, params, fmt):
    for seed, shape in enumerate([(8, 16), (24, 40), (16, 64)]):
        w = pruned_weight(pattern, sparsity, shape, dtype, seed)
        assert pattern.is_valid(w != 0) or isinstance(pattern, Block)
        fmt_params = params if fmt in ("bsr", "nm") else {}
        if fmt == "nm" and "n" not in params:
            with pytest.raises(FormatError):
                encode(fmt, w, fmt_params)
            continue
        if fmt == "bsr" and "block_rows" not in params:
            fmt_params = {"block_rows": 8, "block_cols": 8}
        enc = encode(fmt, w, fmt_params)
        assert torch.equal(decode(enc), w)
        assert decode(enc).dtype == dtype
        assert enc.nbytes == sum(t.numel() * t.element_size() for t in enc.components.values())


@pytest.mark.parametrize("fmt", ["csr", "bitmask", "bsr", "dense"])
def test_all_zero_and_all_dense_tensors_round_trip(fmt):
    params = {"block_rows": 4, "block_cols": 4} if fmt == "bsr" else {}
    for w in (torch.zeros(8, 12), torch.randn(8, 12) + 10):
        assert torch.equal(decode(encode(fmt, w, params)), w)


def test_csr_layout_is_sputnik_kernel_ready():
    w = torch.randn(33, 70)
    w[w.abs() < 1.0] = 0
    w[5] = 0
    for dtype in (torch.float32, torch.float16):
        enc = encode("csr", w.to(dtype))
        c = enc.components
        width = vector_width(dtype)
        lengths = c["row_offsets"][1:] - c["row_offsets"][:-1]
        assert bool((lengths % width == 0).all())
        nnz = (w != 0).sum(1)
        assert torch.equal(lengths, ((nnz + width - 1) // width * width).to(torch.int32))
        assert c["column_indices"].dtype == torch.int16
        assert c["row_offsets"].dtype == torch.int32
        order = c["row_indices"].long()
        assert bool((nnz[order][:-1] >= nnz[order][1:]).all())
        assert sorted(order.tolist()) == list(range(33))


def test_csr_uses_int32_columns_when_int16_cannot_hold_them():
    w = torch.zeros(2, 40000)
    w[0, 39999] = 1.0
    enc = encode("csr", w)
    assert enc.components["column_indices"].dtype == torch.int32
    assert torch.equal(decode(enc), w)


def test_nm_format_refuses_tensors_that_break_the_pattern():
    with pytest.raises(FormatError):
        encode("nm", torch.ones(4, 8), {"n": 2, "m": 4})
    with pytest.raises(FormatError):
        encode("nm", torch.zeros(4, 6), {"n": 2, "m": 4})


def test_two_of_four_metadata_costs_two_bits_per_kept_value():
    w = prune_tensor(torch.randn(16, 64, dtype=torch.float16), NM(2, 4), 0.5)
    enc = encode("nm", w, {"n": 2, "m": 4})
    assert enc.components["metadata"].numel() == 16 * 64 // 4 * 2 * 2 // 8
    assert enc.nbytes == 16 * 32 * 2 + 16 * 8


def test_unknown_format_is_a_format_error():
    with pytest.raises(FormatError):
        get_format("coo")
    assert {"csr", "bsr", "nm", "bitmask", "dense"} <= set(format_names())
