"""CPU reference ops (the oracle of the CUDA kernels) against float64 dense math, and the device CSR encoder."""

from __future__ import annotations

import pytest
import torch

from prunekit import formats
from prunekit.kernels import ops, reference
from prunekit.kernels.layout import transposed_io
from prunekit.kernels.testing import (
    encode_csr,
    random_sparse_weight,
    relative_error,
    sddmm_reference64,
    spmm_reference64,
)

SHAPES = [(1, 1, 1), (1, 37, 3), (29, 53, 7), (64, 40, 1), (17, 9, 33)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_encode_csr_matches_formats_encoder(m, k, n, dtype):
    g = torch.Generator().manual_seed(m * 1000 + k)
    dense = random_sparse_weight(m, k, 0.7, dtype, generator=g, empty_rows=min(1, m), single_rows=min(1, m - 1))
    ours = encode_csr(dense)
    theirs = formats.encode("csr", dense).components
    assert set(ours) == set(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype, name
        assert torch.equal(ours[name], theirs[name]), name


def test_encode_csr_uses_int32_indices_past_int16_range():
    dense = torch.zeros(2, 40000)
    dense[0, 39999] = 1.0
    dense[1, 3] = 2.0
    c = encode_csr(dense)
    assert c["column_indices"].dtype == torch.int32
    assert int(c["column_indices"][: c["row_offsets"][1]].max()) == 39999


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("activation", ["none", "relu"])
def test_spmm_reference_matches_float64_dense(m, k, n, transposed, activation):
    g = torch.Generator().manual_seed(7 + m + n)
    dense = random_sparse_weight(m, k, 0.6, torch.float32, generator=g, empty_rows=1)
    c = encode_csr(dense)
    x2d = torch.randn(n, k, generator=g)
    x = x2d.t() if transposed else x2d.t().contiguous()
    bias = torch.randn(m, generator=g)
    y = ops.spmm_csr(c["values"], c["row_offsets"], c["column_indices"], c["row_indices"], x, m, bias, activation)
    assert y.shape == (m, n)
    assert relative_error(y, spmm_reference64(dense, x, bias, activation)) < 1e-6


def test_spmm_output_layout_follows_x_layout():
    dense = random_sparse_weight(12, 10, 0.5, torch.float32, generator=torch.Generator().manual_seed(0))
    c = encode_csr(dense)
    x2d = torch.randn(6, 10)
    y_t = ops.spmm_csr(**c, x=x2d.t(), m=12)
    assert transposed_io(x2d.t()) and y_t.t().is_contiguous()
    y_r = ops.spmm_csr(**c, x=x2d.t().contiguous(), m=12)
    assert y_r.is_contiguous()
    torch.testing.assert_close(y_t, y_r)


def test_spmm_reference_rejects_unknown_activation():
    c = encode_csr(torch.eye(3))
    with pytest.raises(ValueError, match="unknown activation"):
        reference.spmm_csr(**c, x=torch.randn(3, 2), m=3, activation="gelu")


@pytest.mark.parametrize("m,k,kin", [(1, 1, 1), (13, 29, 5), (40, 17, 64), (8, 300, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sddmm_reference_samples_a_bt_at_pattern(m, k, kin, dtype):
    g = torch.Generator().manual_seed(m + k + kin)
    dense = random_sparse_weight(m, k, 0.7, dtype, generator=g, empty_rows=min(1, m - 1), single_rows=1)
    c = encode_csr(dense)
    a = torch.randn(m, kin, generator=g).to(dtype)
    b = torch.randn(k, kin, generator=g).to(dtype)
    out = ops.sddmm_csr(c["row_offsets"], c["column_indices"], c["row_indices"], a, b)
    assert out.shape == c["values"].shape and out.dtype == dtype
    ref = sddmm_reference64(c, a, b)
    assert relative_error(out, ref) < {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    # Every stored real entry equals the dense product there; every padding entry is exactly zero.
    pad = reference.csr_padding_mask(c["row_offsets"], c["column_indices"])
    assert torch.all(out[pad] == 0)
    assert int((~pad).sum()) == int((dense != 0).sum())
    full = a.double() @ b.double().t()
    rows = formats.csr.csr_rows(c["row_offsets"])
    real = ~pad
    torch.testing.assert_close(
        out[real].double(), full[rows[real], c["column_indices"][real].long()], rtol=2e-2, atol=2e-2
    )


def test_padding_mask_marks_only_repeats_within_a_row():
    ro = torch.tensor([0, 4, 4, 8], dtype=torch.int32)
    ci = torch.tensor([1, 5, 5, 5, 5, 6, 6, 6], dtype=torch.int16)
    pad = reference.csr_padding_mask(ro, ci)
    assert pad.tolist() == [False, False, True, True, False, False, True, True]
