"""``prunekit::spmm_csr`` is differentiable: its gradients equal dense autograd's (values through SDDMM, X through
A^T dY, bias through row sums), padding entries get none, and the autograd registration passes opcheck. CPU."""

from __future__ import annotations

import pytest
import torch

from prunekit.kernels import ops, reference
from prunekit.kernels.testing import encode_csr, random_sparse_weight


def _problem(m, k, n, seed, transposed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    dense = random_sparse_weight(m, k, 0.7, dtype, generator=gen, empty_rows=2, single_rows=2)
    csr = encode_csr(dense)
    x2d = torch.randn(n, k, generator=gen, dtype=dtype)
    x = x2d.t() if transposed else x2d.t().contiguous()
    bias = torch.randn(m, generator=gen, dtype=dtype)
    return dense, csr, x, bias


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("shape", [(17, 23, 5), (1, 9, 1), (33, 40, 8)])
def test_spmm_csr_gradients_equal_dense_autograd(transposed, activation, shape):
    m, k, n = shape
    dense, csr, x, bias = _problem(m, k, n, seed=m * k + n, transposed=transposed)
    pad = reference.csr_padding_mask(csr["row_offsets"], csr["column_indices"])
    rows = torch.repeat_interleave(torch.arange(m), (csr["row_offsets"][1:] - csr["row_offsets"][:-1]).long())
    cols = csr["column_indices"].long()

    values = csr["values"].clone().requires_grad_(True)
    xs = x.detach().clone().requires_grad_(True)
    bs = bias.clone().requires_grad_(True)
    y = ops.spmm_csr(values, csr["row_offsets"], csr["column_indices"], csr["row_indices"], xs, m, bs, activation)
    upstream = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    (y * upstream).sum().backward()

    wd = dense.clone().requires_grad_(True)
    xd = x.detach().clone().requires_grad_(True)
    bd = bias.clone().requires_grad_(True)
    yd = wd @ xd + bd[:, None]
    if activation == "relu":
        yd = torch.relu(yd)
    (yd * upstream).sum().backward()

    torch.testing.assert_close(y.detach(), yd.detach())
    torch.testing.assert_close(xs.grad, xd.grad)
    torch.testing.assert_close(bs.grad, bd.grad)
    assert torch.all(values.grad[pad] == 0)
    torch.testing.assert_close(values.grad[~pad], wd.grad[rows[~pad], cols[~pad]])


def test_spmm_csr_gradient_flows_only_to_the_inputs_that_ask_for_it():
    _, csr, x, bias = _problem(12, 16, 4, seed=3, transposed=True)
    values = csr["values"].clone().requires_grad_(True)
    y = ops.spmm_csr(values, csr["row_offsets"], csr["column_indices"], csr["row_indices"], x, 12, bias, "none")
    y.sum().backward()
    assert values.grad is not None and values.grad.shape == values.shape and x.grad is None and bias.grad is None


def test_spmm_csr_input_gradient_is_a_transposed_spmm():
    dense, csr, _, _ = _problem(21, 30, 6, seed=5, transposed=False)
    dy = torch.randn(21, 6, dtype=torch.float64)
    got = reference.spmm_csr_transposed(csr["values"], csr["row_offsets"], csr["column_indices"], dy, 30)
    torch.testing.assert_close(got, dense.t() @ dy)


@pytest.mark.parametrize("transposed", [False, True])
def test_opcheck_spmm_csr_with_autograd(transposed):
    _, csr, x, bias = _problem(19, 23, 5, seed=7, transposed=transposed, dtype=torch.float32)
    args = (
        csr["values"].clone().requires_grad_(True),
        csr["row_offsets"],
        csr["column_indices"],
        csr["row_indices"],
        x.detach().clone().requires_grad_(True),
        19,
        bias.clone().requires_grad_(True),
        "relu",
    )
    torch.library.opcheck(ops.spmm_csr, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(21, 30), (1, 9), (40, 3), (5, 70)])
def test_transposed_pattern_is_a_valid_prunekit_csr_of_a_transpose(dtype, shape):
    from prunekit.formats.csr import vector_width
    from prunekit.kernels.csr_transpose import transpose_pattern, transposed_values

    m, k = shape
    dense, csr, _, _ = _problem(m, k, 4, seed=m + k, transposed=False, dtype=torch.float64)
    dense = dense.to(dtype)
    csr = encode_csr(dense)
    plan = transpose_pattern(csr["row_offsets"], csr["column_indices"], k, dtype)
    want = encode_csr(dense.t().contiguous())  # the format's own encoding of A^T
    for name in ("row_offsets", "column_indices", "row_indices"):
        got = getattr(plan, name)
        assert got.dtype == want[name].dtype and torch.equal(got, want[name]), name
    torch.testing.assert_close(transposed_values(csr["values"], plan), want["values"], rtol=0, atol=0)
    assert plan.nnz_padded % vector_width(dtype) == 0 and plan.nnz_padded == want["values"].numel()


def test_transposed_pattern_refuses_indices_that_do_not_fit():
    from prunekit.kernels.csr_transpose import transpose_pattern

    _, csr, _, _ = _problem(6, 8, 2, seed=2, transposed=False)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        transpose_pattern(csr["row_offsets"], csr["column_indices"], 5, torch.float64)
    with pytest.raises(ValueError, match="row_offsets"):
        transpose_pattern(csr["row_offsets"][:-1], csr["column_indices"], 8, torch.float64)


@pytest.mark.parametrize("transposed", [False, True])
def test_input_gradient_through_the_kernel_path_equals_dense(transposed):
    # the CUDA backward's path (prunekit::spmm_csr on A^T), run here through the op's CPU implementation
    dense, csr, _, _ = _problem(33, 40, 6, seed=11, transposed=False, dtype=torch.float32)
    dy2d = torch.randn(6, 33, generator=torch.Generator().manual_seed(4))
    dy = dy2d.t() if transposed else dy2d.t().contiguous()
    got = ops.spmm_csr_input_grad(csr["values"], csr["row_offsets"], csr["column_indices"], dy, 40, use_kernels=True)
    ref = ops.spmm_csr_input_grad(csr["values"], csr["row_offsets"], csr["column_indices"], dy, 40, use_kernels=False)
    torch.testing.assert_close(got, dense.t() @ dy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cuda_backward_runs_the_kernels_on_the_transpose_and_matches_float64(dtype):
    m, k, n = 300, 257, 37
    dense64, csr, _, _ = _problem(m, k, n, seed=9, transposed=False)
    dense = dense64.to(dtype)
    csr = {name: t.cuda() for name, t in encode_csr(dense).items()}
    x2d = torch.randn(n, k, generator=torch.Generator().manual_seed(6)).to(dtype).cuda()
    xs = x2d.t().detach().clone().requires_grad_(True)
    values = csr["values"].clone().requires_grad_(True)
    y = ops.spmm_csr(values, csr["row_offsets"], csr["column_indices"], csr["row_indices"], xs, m)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype).cuda()
    (y.float() * upstream.float()).sum().backward()
    ref = dense.double().t() @ upstream.double().cpu()
    err = float((xs.grad.double().cpu() - ref).norm() / ref.norm())
    assert err < (2e-3 if dtype == torch.float16 else 1e-5), err


def test_transposed_pattern_is_cached_on_the_indices_until_they_change():
    from prunekit.kernels.csr_transpose import cached_transpose_pattern

    _, csr, _, _ = _problem(12, 20, 2, seed=8, transposed=False, dtype=torch.float32)
    ro, ci = csr["row_offsets"], csr["column_indices"].clone()
    first = cached_transpose_pattern(ro, ci, 20, torch.float32)
    assert cached_transpose_pattern(ro, ci, 20, torch.float32) is first
    assert cached_transpose_pattern(ro, ci, 20, torch.float16) is not first  # other padding width
    ci[0] = ci[0]  # an in-place write bumps the version counter
    assert cached_transpose_pattern(ro, ci, 20, torch.float32) is not first
