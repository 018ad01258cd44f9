"""The SpMV kernel (``csrc/spmv_csr.cu``), rowwarp's path at N <= 4, against float64 with the output poisoned first.

It takes 1, 2, 4 or 8 rows per warp by M (one wave of warps on the GPU), 2-8 warps per block, x from a shared-memory copy
(16-byte loads where x is contiguous, aligned and K a multiple of the vector width, else element by element), and
programmatic dependent launch on sm_90. At N = 2-4 the same kernel runs a tile of 4 tokens (X staged as [K][4]) where X
fits in 48 KB and M gives 8 rows per SM. These tests cover each of those by shape: M = 1 and M past every rows-per-warp
step, empty rows and rows of one non-zero, odd K, strided x, int32 column indices (K > 32767), fp16 / bf16 / fp32, the
fallback to rowwarp's own kernel (x over the shared-memory limit, ``$PRUNEKIT_SPMV=0``), and chained layers reading the
previous layer's output eagerly and in a CUDA graph (a kernel that read x before the previous one finished would see
NaN).
"""

from __future__ import annotations

import pytest
import torch

from prunekit.kernels import gpu
from prunekit.kernels.testing import (
    TOLERANCE,
    encode_csr,
    random_sparse_weight,
    relative_error,
    rerun_chain,
    spmm_reference64,
)

pytestmark = pytest.mark.cuda
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _wave() -> int:
    """Warps of one wave as spmv_csr.cu counts them (4 blocks of 8 warps per SM)."""
    return torch.cuda.get_device_properties(0).multi_processor_count * 4 * 8


def _check(
    m,
    k,
    sparsity,
    dtype,
    seed,
    *,
    n=1,
    x_stride=1,
    transposed=False,
    activation="relu",
    bias=True,
    monkeypatch=None,
    env=None,
):
    """One ``rowwarp`` call at ``n`` tokens against float64, the output poisoned with NaN first. ``transposed``: X is the
    runtime's ``x2d.t()`` (each token's column contiguous) and Y the transposed view of an ``(N, M)`` buffer; else X is
    ``(K, N)`` with row stride ``x_stride * n`` (a slice of a wider matrix) and Y a contiguous ``(M, N)``."""
    if monkeypatch is not None:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
    g = torch.Generator(device="cuda").manual_seed(seed)
    dense = random_sparse_weight(m, k, sparsity, dtype, "cuda", g, empty_rows=min(3, m), single_rows=min(2, m))
    c = encode_csr(dense)
    if transposed:
        x = torch.randn(n, k, generator=g, device="cuda").to(dtype).t()
        out = torch.full((n, m), float("nan"), dtype=dtype, device="cuda").t()
    else:
        x = torch.randn(k, n * x_stride, generator=g, device="cuda").to(dtype)[:, :n]
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    b = torch.randn(m, generator=g, device="cuda").to(dtype) if bias else None
    y = gpu.spmm_csr(**c, x=x, m=m, bias=b, activation=activation, variant="rowwarp", out=out)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr()
    assert not torch.isnan(y).any()
    ref = spmm_reference64(dense, x, b, activation)
    assert relative_error(y, ref) <= TOLERANCE[dtype]
    return c


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, k, sparsity",
    [(1, 7, 0.5), (1, 4096, 0.9), (5, 33, 0.0), (77, 203, 0.8), (768, 3072, 0.9), (3000, 768, 0.8), (300, 1, 0.0)],
)
def test_spmv_matches_float64(dtype, m, k, sparsity):
    _check(m, k, sparsity, dtype, seed=m + k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("factor", [1.5, 3, 6])  # 2, 4 and 8 rows per warp
def test_spmv_several_rows_per_warp(dtype, factor):
    _check(int(_wave() * factor) + 5, 96, 0.7, dtype, seed=int(factor * 10))


@pytest.mark.parametrize("dtype", DTYPES)
def test_spmv_strided_x_and_no_bias(dtype):
    _check(129, 517, 0.8, dtype, seed=3, x_stride=3, activation="none", bias=False)


def test_spmv_int32_indices_and_large_x():
    c = _check(64, 40000, 0.99, torch.float16, seed=4)  # 80 KB of x in shared memory (opt-in limit)
    assert c["column_indices"].dtype == torch.int32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize(("m", "k", "sparsity"), [(1, 40, 0.5), (77, 203, 0.8), (1200, 1031, 0.8), (3000, 768, 0.9)])
def test_token_tile_matches_float64(dtype, n, transposed, m, k, sparsity):
    """N = 2-4 on 1200 / 3000 rows: the 4-token tile (tokens >= N staged as zeros), both X and Y layouts, odd K; the
    other cases (few rows, N = 5-8) are rowwarp's own kernel, checked alike."""
    takes = gpu.spmv_takes(m, k, n, dtype.itemsize, gpu._sm_count(torch.device("cuda")))
    assert takes == (m >= 1200 and n <= 4)
    _check(m, k, sparsity, dtype, seed=m + k + n, n=n, transposed=transposed)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("factor", [1.5, 3, 6])  # more rows per warp, clamped at 4 for the token tile
def test_token_tile_several_rows_per_warp(n, factor):
    _check(int(_wave() * factor) + 5, 96, 0.7, torch.float16, seed=n, n=n, transposed=True)


def test_token_tile_strided_x_and_large_x():
    _check(1500, 517, 0.8, torch.float16, seed=9, n=3, x_stride=2, activation="none", bias=False)
    _check(1500, 6144, 0.98, torch.float16, seed=10, n=4, transposed=True)  # 48 KB of X: the limit
    _check(1500, 6160, 0.98, torch.float16, seed=11, n=4, transposed=True)  # over it: rowwarp's own kernel


@pytest.mark.parametrize("env", [{"PRUNEKIT_SPMV": "0"}, {"PRUNEKIT_SPMV_PDL": "0"}])
def test_spmv_switches(env, monkeypatch):
    _check(1000, 1000, 0.9, torch.float16, seed=5, monkeypatch=monkeypatch, env=env)


def test_x_over_the_shared_memory_limit_falls_back():
    _check(40, 60000, 0.995, torch.float16, seed=6)  # 120 KB of x: rowwarp's own kernel


def test_spmv_all_rows_empty():
    _check(50, 64, 1.0, torch.float16, seed=7)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_chained_spmv_layers_read_the_previous_output(graph, pdl, monkeypatch):
    monkeypatch.setenv("PRUNEKIT_SPMV_PDL", pdl)
    width, dtype = 3000, torch.float16
    g = torch.Generator(device="cuda").manual_seed(8)
    layers = []
    for _ in range(4):
        dense = (random_sparse_weight(width, width, 0.9, dtype, "cuda", g) * (3 / width**0.5)).to(dtype)
        layers.append((dense, encode_csr(dense), (0.1 * torch.randn(width, generator=g, device="cuda")).to(dtype)))
    x0 = torch.randn(width, 1, generator=g, device="cuda").to(dtype)
    outs = [torch.empty(width, 1, dtype=dtype, device="cuda") for _ in layers]

    def chain():
        x = x0
        for (_, c, b), out in zip(layers, outs, strict=True):
            out.fill_(float("nan"))
            x = gpu.spmm_csr(**c, x=x, m=width, bias=b, activation="relu", variant="rowwarp", out=out)

    rerun_chain(chain, x0, graph)
    for (dense, _, b), x, out in zip(layers, [x0, *outs[:-1]], outs, strict=True):
        assert not torch.isnan(out).any()
        assert relative_error(out, spmm_reference64(dense, x, b, "relu")) <= TOLERANCE[dtype]
