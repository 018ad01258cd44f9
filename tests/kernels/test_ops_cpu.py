"""Every prunekit custom op passes torch.library.opcheck on CPU (schema, fake impl, dispatch), and the fake impls
give the real outputs' shapes, dtypes and strides."""

from __future__ import annotations

import pytest
import torch

from prunekit import formats
from prunekit.kernels import ops
from prunekit.kernels.testing import encode_csr, random_sparse_weight


def _csr(m=19, k=23, dtype=torch.float32, seed=0):
    dense = random_sparse_weight(m, k, 0.7, dtype, generator=torch.Generator().manual_seed(seed), empty_rows=1)
    return dense, encode_csr(dense)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_spmm_csr(transposed, with_bias):
    _, c = _csr()
    x2d = torch.randn(5, 23)
    x = x2d.t() if transposed else x2d.t().contiguous()
    bias = torch.randn(19) if with_bias else None
    args = (c["values"], c["row_offsets"], c["column_indices"], c["row_indices"], x, 19, bias, "relu")
    torch.library.opcheck(ops.spmm_csr, args)


def test_opcheck_sddmm_csr():
    _, c = _csr()
    args = (c["row_offsets"], c["column_indices"], c["row_indices"], torch.randn(19, 6), torch.randn(23, 6))
    torch.library.opcheck(ops.sddmm_csr, args)


def test_opcheck_bsr_mm():
    dense = torch.randn(8, 12) * (torch.rand(2, 3).repeat_interleave(4, 0).repeat_interleave(4, 1) > 0.4)
    c = formats.encode("bsr", dense, {"block_rows": 4, "block_cols": 4}).components
    args = (c["blocks"], c["crow_indices"], c["col_indices"], torch.randn(12, 3), 8, None, "none")
    torch.library.opcheck(ops.bsr_mm, args)


def test_opcheck_nm_mm():
    dense = torch.randn(4, 16)
    groups = dense.reshape(4, 4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(2, groups.abs().topk(2, dim=2).indices, True)
    dense = (groups * keep).reshape(4, 16)
    enc = formats.encode("nm", dense, {"n": 2, "m": 4})
    c, p = enc.components, enc.params
    args = (c["values"], c["metadata"], torch.randn(16, 3), int(p["n"]), int(p["m"]), int(p["bits"]), None, "none")
    torch.library.opcheck(ops.nm_mm, args)


@pytest.mark.parametrize("transposed", [False, True])
def test_spmm_fake_matches_real_strides(transposed):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, c = _csr()
    x2d = torch.randn(7, 23)
    x = x2d.t() if transposed else x2d.t().contiguous()
    real = ops.spmm_csr(**c, x=x, m=19)
    with FakeTensorMode() as mode:
        fc = {k: mode.from_tensor(v) for k, v in c.items()}
        fake = ops.spmm_csr(**fc, x=mode.from_tensor(x), m=19)
    assert fake.shape == real.shape and fake.stride() == real.stride() and fake.dtype == real.dtype


def test_spmm_csr_compiles_with_torch_compile():
    dense, c = _csr()
    x = torch.randn(23, 4)

    @torch.compile(backend="eager", fullgraph=True)
    def f(values, row_offsets, column_indices, row_indices, x):
        return ops.spmm_csr(values, row_offsets, column_indices, row_indices, x, 19, None, "relu")

    torch.testing.assert_close(f(**c, x=x), torch.relu(dense @ x), rtol=1e-5, atol=1e-5)
