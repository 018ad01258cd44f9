"""CUDA SDDMM against a float64 reference, outputs poisoned with NaN first."""

from __future__ import annotations

import pytest
import torch

from prunekit.kernels import gpu, ops, reference
from prunekit.kernels.testing import TOLERANCE, encode_csr, random_sparse_weight, relative_error, sddmm_reference64

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "m,n,kin,sparsity", [(1, 5, 1, 0.5), (33, 47, 7, 0.8), (128, 300, 64, 0.9), (70, 90, 1000, 0.6)]
)
def test_sddmm_matches_float64_reference(dtype, m, n, kin, sparsity):
    g = torch.Generator(device="cuda").manual_seed(m + n + kin)
    dense = random_sparse_weight(m, n, sparsity, dtype, "cuda", g, empty_rows=min(2, m - 1), single_rows=1)
    c = encode_csr(dense)
    a = torch.randn(m, kin, generator=g, device="cuda").to(dtype)
    b = torch.randn(n, kin, generator=g, device="cuda").to(dtype)
    out = torch.full_like(c["values"], float("nan"))
    gpu.sddmm_csr(c["row_offsets"], c["column_indices"], c["row_indices"], a, b, out=out)
    assert relative_error(out, sddmm_reference64(c, a, b)) <= TOLERANCE[dtype]
    assert torch.all(out[reference.csr_padding_mask(c["row_offsets"], c["column_indices"])] == 0)


def test_sddmm_op_on_transposed_gradient_views():
    m, n, tokens = 64, 96, 33
    dense = random_sparse_weight(m, n, 0.9, torch.float16, "cuda")
    c = encode_csr(dense)
    dy = torch.randn(tokens, m, device="cuda").half()
    x = torch.randn(tokens, n, device="cuda").half()
    grad = ops.sddmm_csr(c["row_offsets"], c["column_indices"], c["row_indices"], dy.t(), x.t())
    assert relative_error(grad, sddmm_reference64(c, dy.t(), x.t())) <= TOLERANCE[torch.float16]


def test_opcheck_sddmm_csr_cuda():
    c = encode_csr(random_sparse_weight(20, 30, 0.7, torch.float32, "cuda"))
    args = (
        c["row_offsets"],
        c["column_indices"],
        c["row_indices"],
        torch.randn(20, 9, device="cuda"),
        torch.randn(30, 9, device="cuda"),
    )
    torch.library.opcheck(ops.sddmm_csr, args)
