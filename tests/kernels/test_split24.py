"""The ``split24`` SpMM variant (kernels/split24.py): a 2:4 part through cuSPARSELt plus a hypersparse residual
(csrc/spmm_residual.cu).

CPU: the split (exact, 2:4, the residual only where a group has more than two non-zeros), the residual's SELL layout, the
public op ``prunekit::residual_rows`` (CPU and fake implementations) against float64, the tile and grid rules,
the mode setting. GPU (``cuda``): the residual kernel against float64 into poisoned outputs (both modes, ReLU, every
tile size, odd N and K, empty rows, int16 and int32 columns, bf16, row parts), cuSPARSELt's beta = 1 (old Y read in its epilogue),
and the whole variant in both modes with bias and ReLU against float64, at odd N and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from prunekit.kernels import split24
from prunekit.kernels.testing import TOLERANCE, encode_csr, random_sparse_weight, relative_error


def _residual_case(m, k, n, density, dtype, device="cpu", empty_rows=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(m, k, generator=g) * (torch.rand(m, k, generator=g) < density)
    r[:empty_rows] = 0
    r = r.to(dtype)
    x = torch.randn(n, k, generator=g).to(dtype)
    return r.to(device), x.to(device)


# --- CPU --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sparsity", [0.5, 0.8, 0.9, 0.95])
def test_split_is_exact_and_2_4(sparsity):
    w = random_sparse_weight(64, 256, sparsity, torch.float32, generator=torch.Generator().manual_seed(3))
    w24, residual = split24.split_24(w)
    assert torch.equal(w24 + residual, w)
    assert int((w24.view(64, 64, 4) != 0).sum(-1).max()) <= 2
    groups = (w.view(64, 64, 4) != 0).sum(-1)
    res_groups = (residual.view(64, 64, 4) != 0).sum(-1)
    assert torch.equal(res_groups, (groups - 2).clamp_min(0))  # the residual holds exactly the extra non-zeros
    kept = w24.view(64, 64, 4).abs()
    dropped = residual.view(64, 64, 4).abs()
    # every kept magnitude is at least every dropped one in its group
    assert bool((kept.masked_fill(kept == 0, float("inf")).amin(-1) >= dropped.amax(-1)).all())


def test_split_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 4"):
        split24.split_24(torch.zeros(4, 6))
    with pytest.raises(ValueError, match="multiple of 4"):
        split24.split_24(torch.zeros(8))


@pytest.mark.parametrize("m,k", [(33, 64), (1, 8), (64, 40000)])
def test_residual_sell_round_trip(m, k):
    r, _ = _residual_case(m, k, 1, 0.05 if k < 1000 else 0.0005, torch.float32, empty_rows=min(3, m - 1))
    values, cols, slices = split24.residual_sell(r)
    assert slices.dtype == torch.int32 and slices.shape == (-(-m // 32) + 1,)
    assert cols.dtype == (torch.int16 if k <= 32767 else torch.int32)
    assert values.numel() == cols.numel() == 32 * int(slices[-1])
    counts = (r != 0).sum(1)
    padded = torch.zeros(-(-m // 32) * 32, dtype=torch.int64)
    padded[:m] = counts
    assert torch.equal((slices[1:] - slices[:-1]).long(), padded.view(-1, 32).amax(1))  # slots: the longest row
    assert torch.equal(split24.sell_to_dense(values, cols, slices, m, k), r.double())
    assert bool((values[cols < 0] == 0).all())


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_residual_op_cpu_against_float64(accumulate, relu):
    m, k, n, n_out = 40, 96, 19, 24
    r, x = _residual_case(m, k, n, 0.05, torch.float32, empty_rows=4, seed=1)
    values, cols, slices = split24.residual_sell(r)
    y0 = torch.randn(m, n_out)
    y = y0.clone() if accumulate else torch.full((m, n_out), float("nan"))
    split24.residual_rows(values, cols, slices, x, y, n, accumulate, relu)
    ref = torch.zeros(m, n_out, dtype=torch.float64)
    ref[:, :n] = r.double() @ x.double().t()
    if accumulate:
        ref += y0.double()
    if relu:
        ref = ref.clamp_min(0)
    assert torch.allclose(y.double(), ref, atol=1e-5)


def test_residual_op_fake_and_mutation_schema():
    op = torch.ops.prunekit.residual_rows.default
    assert op._schema.arguments[4].alias_info is not None and op._schema.arguments[4].alias_info.is_write
    with torch._subclasses.fake_tensor.FakeTensorMode():
        y = torch.empty(8, 16)
        assert op(torch.empty(64), torch.zeros(64, dtype=torch.int16), torch.zeros(2, dtype=torch.int32),
                  torch.empty(16, 32), y, 16, False, False) is None  # fmt: skip


def test_tile_and_grid_rules(monkeypatch):
    assert split24.residual_tile_n(1024) == 16
    assert split24.residual_tile_n(4096) == 16
    assert split24.residual_tile_n(7264) == 16  # 227 KB exactly
    assert split24.residual_tile_n(7265) == 8
    assert split24.residual_tile_n(11008) == 8
    assert split24.residual_tile_n(20000) == 4
    assert split24.residual_tile_n(60000) == 0
    assert split24.residual_tile_n(4096, forced=16) == 16
    assert split24.residual_tile_n(11008, forced=16) == 0
    assert split24.residual_row_parts(2048, 4096, 132) == 1  # 128 token tiles
    assert split24.residual_row_parts(256, 4096, 132) == 8  # 16 tiles
    assert split24.residual_row_parts(256, 4096, 132, tile_n=8) == 4
    assert split24.residual_row_parts(1, 4096, 132) == 132
    monkeypatch.delenv(split24.TILE_N_ENV, raising=False)
    assert split24.forced_tile_n() == 0
    monkeypatch.setenv(split24.TILE_N_ENV, "16")
    assert split24.forced_tile_n() == 16
    monkeypatch.setenv(split24.TILE_N_ENV, "32")
    with pytest.raises(ValueError, match="PRUNEKIT_SPLIT24_TILE_N"):
        split24.forced_tile_n()
    monkeypatch.delenv(split24.SLICES_ENV, raising=False)
    assert split24.slices_per_warp() == split24.DEFAULT_SLICES
    monkeypatch.setenv(split24.SLICES_ENV, "2")
    assert split24.slices_per_warp() == 2
    monkeypatch.setenv(split24.SLICES_ENV, "3")
    with pytest.raises(ValueError, match="PRUNEKIT_SPLIT24_SLICES"):
        split24.slices_per_warp()


def test_mode_setting(monkeypatch):
    monkeypatch.delenv(split24.MODE_ENV, raising=False)
    assert split24.mode() == split24.DEFAULT_MODE
    monkeypatch.setenv(split24.MODE_ENV, "post")
    assert split24.mode() == "post"
    assert split24.mode("beta") == "beta"
    monkeypatch.setenv(split24.MODE_ENV, "fused")
    with pytest.raises(ValueError, match="split24 mode"):
        split24.mode()


def test_layer_rule(monkeypatch):
    monkeypatch.setattr(split24, "takes", lambda m, k, dtype: True)  # the shape and cuSPARSELt checks: above
    x = torch.zeros(4, 4096, dtype=torch.float16)
    dense95 = random_sparse_weight(4096, 4096, 0.95, torch.float16, generator=torch.Generator().manual_seed(0))
    values95 = dense95[dense95 != 0]
    dense90 = random_sparse_weight(4096, 4096, 0.9, torch.float16, generator=torch.Generator().manual_seed(0))
    assert split24.layer_takes(values95, x, None, 4096)
    assert not split24.layer_takes(dense90[dense90 != 0], x, None, 4096)  # 90%: slower than the default path
    assert not split24.layer_takes(values95[: 1024 * 4096 // 20], x, None, 1024)  # under MIN_ELEMENTS
    assert not split24.layer_takes(values95, x.float(), None, 4096)
    assert not split24.layer_takes(values95, x, torch.zeros(4096), 4096)  # fp32 bias
    assert split24.layer_takes(values95, x, torch.zeros(4096, dtype=torch.float16), 4096)


def test_takes_rejects_cpu_shapes_and_dtypes():
    assert not split24.takes(100, 4096, torch.float16)  # M % 32
    assert not split24.takes(128, 100, torch.float16)  # K % 64
    assert not split24.takes(128, 4096, torch.float32)


# --- GPU --------------------------------------------------------------------------------------------------------------


def _needs_cslt():
    from prunekit.kernels import structured

    if not structured.native_cslt_available():
        pytest.skip("prunekit's cuSPARSELt binding is unavailable")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize(
    "m,k,n,n_out,density,empty",
    [
        (1, 64, 1, 1, 0.1, 0),
        (64, 4096, 64, 64, 0.002, 5),
        (97, 4096, 37, 48, 0.01, 9),  # odd M, N not a multiple of the tile, padded columns beyond n_valid
        (256, 11008, 40, 40, 0.002, 0),  # tile 8
        (64, 20000, 13, 16, 0.001, 0),  # tile 4
        (300, 512, 2048, 2048, 0.02, 30),
    ],
)
def test_residual_kernel_against_float64(dtype, accumulate, relu, m, k, n, n_out, density, empty):
    r, x = _residual_case(m, k, n, density, dtype, "cuda", empty_rows=empty, seed=m + k + n)
    values, cols, slices = split24.residual_sell(r)
    y0 = torch.randn(m, n_out, device="cuda").to(dtype)
    y = y0.clone() if accumulate else torch.full((m, n_out), float("nan"), device="cuda", dtype=dtype)
    split24.residual_rows_cuda(values, cols, slices, x, y, n, accumulate, relu)
    ref = torch.zeros(m, n_out, dtype=torch.float64)
    ref[:, :n] = r.double().cpu() @ x.double().cpu().t()
    if accumulate:
        ref += y0.double().cpu()
    if relu:
        ref = ref.clamp_min(0)
    assert bool(torch.isfinite(y).all())
    assert relative_error(y, ref) < TOLERANCE[dtype]
    if not accumulate:
        assert torch.equal(y[:, n:].cpu(), torch.zeros(m, n_out - n, dtype=dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("slices", ["1", "2"])
@pytest.mark.parametrize("tile_n", ["16", "8", "4"])
@pytest.mark.parametrize("k", [1000, 4097])  # odd K: the 2-byte staging path
def test_residual_kernel_every_tile(monkeypatch, tile_n, k, slices):
    monkeypatch.setenv(split24.TILE_N_ENV, tile_n)
    monkeypatch.setenv(split24.SLICES_ENV, slices)
    for accumulate in (False, True):
        m, n = 70, 45
        r, x = _residual_case(m, k, n, 0.01, torch.float16, "cuda", empty_rows=3, seed=k)
        values, cols, slices = split24.residual_sell(r)
        y0 = torch.randn(m, n, device="cuda", dtype=torch.float16)
        y = y0.clone() if accumulate else torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
        split24.residual_rows_cuda(values, cols, slices, x, y, n, accumulate, True)
        ref = r.double().cpu() @ x.double().cpu().t() + (y0.double().cpu() if accumulate else 0)
        assert relative_error(y, ref.clamp_min(0)) < TOLERANCE[torch.float16]


@pytest.mark.cuda
@pytest.mark.parametrize("row_parts", [1, 3, 64])
def test_residual_kernel_row_parts_and_int32_columns(row_parts):
    m, k, n = 200, 4096, 50
    r, x = _residual_case(m, k, n, 0.003, torch.float16, "cuda", empty_rows=7, seed=5)
    values, cols, slices = split24.residual_sell(r)
    for c in (cols, cols.to(torch.int32)):
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
        split24.residual_rows_cuda(values, c, slices, x, y, n, row_parts=row_parts)
        ref = r.double().cpu() @ x.double().cpu().t()
        assert relative_error(y, ref) < TOLERANCE[torch.float16]


@pytest.mark.cuda
def test_residual_kernel_through_the_op_and_a_strided_output():
    m, k, n = 64, 1024, 24
    r, x = _residual_case(m, k, n, 0.01, torch.float16, "cuda", seed=9)
    values, cols, slices = split24.residual_sell(r)
    buf = torch.full((m, 40), float("nan"), device="cuda", dtype=torch.float16)
    y = buf[:, 8:32]  # row stride 40, 16-byte aligned start: the vector path on a view
    split24.residual_rows(values, cols, slices, x, y, n, False, False)
    assert relative_error(y, r.double().cpu() @ x.double().cpu().t()) < TOLERANCE[torch.float16]
    assert bool(buf[:, :8].isnan().all()) and bool(buf[:, 32:].isnan().all())  # nothing outside the view
    xwide = torch.zeros(n, k + 8, device="cuda", dtype=torch.float16)
    xwide[:, :k] = x
    y2 = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
    split24.residual_rows(values, cols, slices, xwide[:, :k], y2, n, False, False)  # X's row stride K + 8
    assert torch.equal(y, y2)


@pytest.mark.cuda
def test_residual_kernel_rejects_bad_input():
    r, x = _residual_case(32, 64, 8, 0.1, torch.float16, "cuda")
    values, cols, slices = split24.residual_sell(r)
    y = torch.empty(32, 8, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="n_valid"):
        split24.residual_rows_cuda(values, cols, slices, x, y, 9)
    with pytest.raises(RuntimeError, match="row-major"):
        split24.residual_rows_cuda(values, cols, slices, x.t().contiguous().t(), y, 8)
    with pytest.raises(RuntimeError, match="one dtype"):
        split24.residual_rows_cuda(values, cols, slices, x.float(), y, 8)


def _weight(m, k, sparsity, dtype, seed):
    w = random_sparse_weight(m, k, sparsity, dtype, generator=torch.Generator().manual_seed(seed)).cuda()
    return w, encode_csr(w)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("relu", [False, True])
def test_cslt_beta_adds_the_old_output(dtype, relu):
    """cuSPARSELt's beta = 1 with C = D: y = act(W24 @ x + y_old + bias); the order of the epilogue (the ReLU after the
    add) is what the split's beta mode relies on."""
    _needs_cslt()
    from prunekit.kernels import structured

    m, k, n = 256, 512, 64
    w24, _ = split24.split_24(random_sparse_weight(m, k, 0.5, dtype, generator=torch.Generator().manual_seed(2)).cuda())
    native = structured._NativeWeight(w24.contiguous(), 0, 0)
    x = torch.randn(n, k, device="cuda").to(dtype)
    bias = torch.randn(m, device="cuda").to(dtype)
    y0 = torch.randn(m, n, device="cuda").to(dtype)
    y = y0.clone()
    torch.ops.prunekit_cslt.mm_beta.default(native.id, x.t(), y, bias, relu, 1.0)
    ref = w24.double().cpu() @ x.double().cpu().t() + y0.double().cpu() + bias.double().cpu()[:, None]
    if relu:
        ref = ref.clamp_min(0)
    assert relative_error(y, ref) < TOLERANCE[dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("split_mode", split24.MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,k,n,sparsity", [(256, 512, 128, 0.9), (128, 4096, 37, 0.8), (512, 1024, 2048, 0.95)])
def test_split24_linear_against_float64(split_mode, dtype, activation, bias, m, k, n, sparsity):
    _needs_cslt()
    w, csr = _weight(m, k, sparsity, dtype, seed=m + n)
    weight = split24.split24_weight(csr["values"], csr["row_offsets"], csr["column_indices"], m, k)
    x = torch.randn(n, k, device="cuda").to(dtype)
    b = torch.randn(m, device="cuda").to(dtype) if bias else None
    out = split24.linear(weight, x, b, activation, split_mode)
    assert out.shape == (n, m) and bool(torch.isfinite(out).all())
    ref = split24.reference(w.cpu(), x.cpu(), None if b is None else b.cpu(), activation)
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.cuda
def test_split24_weight_is_built_once_and_rebuilt_after_an_edit():
    _needs_cslt()
    m, k = 128, 256
    w, csr = _weight(m, k, 0.9, torch.float16, seed=4)
    first = split24.split24_weight(csr["values"], csr["row_offsets"], csr["column_indices"], m, k)
    assert split24.split24_weight(csr["values"], csr["row_offsets"], csr["column_indices"], m, k) is first
    assert first.extra_bytes() >= m * k * 2 * 9 // 16
    assert first.residual_nnz == int(split24.split_24(w)[1].count_nonzero())
    csr["values"].mul_(2)
    second = split24.split24_weight(csr["values"], csr["row_offsets"], csr["column_indices"], m, k)
    assert second is not first
    x = torch.randn(64, k, device="cuda", dtype=torch.float16)
    assert relative_error(split24.linear(second, x), split24.reference(2 * w.cpu(), x.cpu())) < 2e-3


@pytest.mark.cuda
@pytest.mark.parametrize("split_mode", split24.MODES)
def test_split24_linear_in_a_cuda_graph(split_mode):
    _needs_cslt()
    m, k, n = 256, 1024, 256
    w, csr = _weight(m, k, 0.9, torch.float16, seed=8)
    weight = split24.split24_weight(csr["values"], csr["row_offsets"], csr["column_indices"], m, k)
    x = torch.randn(n, k, device="cuda", dtype=torch.float16)
    split24.linear(weight, x, None, "relu", split_mode)  # plans built (and searched) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = split24.linear(weight, x, None, "relu", split_mode)
    x.copy_(torch.randn(n, k, device="cuda", dtype=torch.float16))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, split24.reference(w.cpu(), x.cpu(), None, "relu")) < 2e-3


def test_enabled_only_when_asked_and_from_min_n(monkeypatch):
    monkeypatch.delenv(split24.ENABLE_ENV, raising=False)
    assert not split24.enabled(4096)
    monkeypatch.setenv(split24.ENABLE_ENV, "1")
    assert split24.enabled(split24.MIN_N) and split24.enabled(8192)
    assert not split24.enabled(split24.MIN_N - 1)
    monkeypatch.setenv(split24.ENABLE_ENV, "0")
    assert not split24.enabled(4096)


@pytest.mark.cuda
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [2048, 2100])
def test_sparse_linear_takes_split24_when_asked(monkeypatch, bias, n):
    _needs_cslt()
    from prunekit import formats
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    m, k = 256, 512
    monkeypatch.setattr(split24, "MIN_ELEMENTS", m * k)
    w = random_sparse_weight(m, k, 0.95, torch.float16, generator=torch.Generator().manual_seed(n))
    b = torch.randn(m).half() if bias else None
    layer = SparseLinear(formats.encode("csr", w, {}), bias=b).cuda()
    x = torch.randn(n, k, device="cuda", dtype=torch.float16)
    ref = split24.reference(w, x.cpu(), b, "none")
    monkeypatch.delenv(split24.ENABLE_ENV, raising=False)
    with torch.inference_mode():
        off = layer(x)
    assert getattr(layer.w_values, split24._WEIGHT_ATTR, None) is None  # off by default: no 2:4 copy built
    monkeypatch.setenv(split24.ENABLE_ENV, "1")
    with torch.inference_mode():
        on = layer(x)
        again = layer(x.view(1, n, k))
    assert isinstance(getattr(layer.w_values, split24._WEIGHT_ATTR, None), split24.Split24Weight)
    assert on.shape == (n, m) and again.shape == (1, n, m)
    for out in (off, on, again.view(n, m)):
        assert relative_error(out, ref) < 2e-3
    with torch.inference_mode():
        small = layer(x[:64])  # below MIN_N: the usual CSR path
    assert relative_error(small, ref[:64]) < 2e-3
