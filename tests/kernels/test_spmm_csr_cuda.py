"""CUDA SpMM (both variants) against a float64 reference on fresh random inputs, outputs poisoned with NaN first."""

from __future__ import annotations

import pytest
import torch

from prunekit.kernels import gpu, ops
from prunekit.kernels.testing import TOLERANCE, encode_csr, random_sparse_weight, relative_error, spmm_reference64

pytestmark = pytest.mark.cuda
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (M, K, N, sparsity): M = 1, odd K and N (not multiples of the vector width), several K chunks and N tiles, dense rows.
SHAPES = [
    (1, 7, 1, 0.5),
    (1, 300, 5, 0.9),
    (33, 45, 3, 0.7),
    (77, 203, 17, 0.8),
    (130, 301, 129, 0.9),
    (64, 1031, 260, 0.95),
    (257, 64, 33, 0.0),
    (50, 77, 16, 0.8),
    (40, 100, 8, 0.6),
    (20, 64, 4, 0.5),
    (33, 64, 48, 0.9),
    (19, 40, 512, 0.7),
]


def _poisoned(m, n, dtype, transposed):
    if transposed:
        return torch.full((n, m), float("nan"), dtype=dtype, device="cuda").t()
    return torch.full((m, n), float("nan"), dtype=dtype, device="cuda")


def _case(m, k, n, sparsity, dtype, seed, transposed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dense = random_sparse_weight(m, k, sparsity, dtype, "cuda", g, empty_rows=min(2, m - 1), single_rows=min(2, m - 1))
    x2d = torch.randn(n, k, generator=g, device="cuda").to(dtype)
    x = x2d.t() if transposed else x2d.t().contiguous()
    bias = torch.randn(m, generator=g, device="cuda").to(dtype)
    return dense, encode_csr(dense), x, bias


@pytest.mark.parametrize("variant", ["rowwarp", "rowwarp_global", "direct", "tiled"])
@pytest.mark.parametrize("transposed", [False, True], ids=["xrow", "xT"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n,sparsity", SHAPES)
def test_spmm_matches_float64_reference(variant, transposed, dtype, m, k, n, sparsity):
    for seed, activation in ((0, "relu"), (1, "none")):
        dense, c, x, bias = _case(m, k, n, sparsity, dtype, seed + m + n, transposed)
        y = _poisoned(m, n, dtype, transposed)
        b = bias if activation == "relu" else None
        gpu.spmm_csr(**c, x=x, m=m, bias=b, activation=activation, variant=variant, out=y)
        err = relative_error(y, spmm_reference64(dense, x, b, activation))
        assert err <= TOLERANCE[dtype], f"{variant} {dtype} {m}x{k}x{n}: rel err {err:.2e}"


@pytest.mark.parametrize("warps", [2, 8])
@pytest.mark.parametrize("unroll", [4, 8, 16, 32])
@pytest.mark.parametrize("lpr", [4, 8, 16, 32])
@pytest.mark.parametrize("transposed", [False, True], ids=["xrow", "xT"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "m,k,n,sparsity",
    [(130, 301, 129, 0.9), (77, 203, 17, 0.8), (300, 700, 128, 0.98), (65, 64, 64, 0.5), (40, 2000, 64, 0.9)],
)
def test_direct_every_tile_setting(monkeypatch, warps, unroll, lpr, transposed, dtype, m, k, n, sparsity):
    """$PRUNEKIT_DIRECT_LPR (4 / 8 lanes per row: 32 / 64 fp16 columns per tile; 16 and 32),
    $PRUNEKIT_DIRECT_UNROLL (8 / 16 / 32 X loads in flight with the next chunk's pairs loaded ahead, several pairs per
    lane where it exceeds the lanes; 4, the original loop) and $PRUNEKIT_DIRECT_WARPS (2: blocks of 2-8 rows, fewer
    than VN at 32 lanes, so the transposed Y takes the element stores), in both Y layouts, at odd N (X copied into rows
    padded to whole vectors), with empty and single-entry rows, rows of one chunk and rows of many (40 x 2000 at 90%:
    about 200 entries)."""
    monkeypatch.setenv("PRUNEKIT_DIRECT_LPR", str(lpr))
    monkeypatch.setenv("PRUNEKIT_DIRECT_UNROLL", str(unroll))
    monkeypatch.setenv("PRUNEKIT_DIRECT_WARPS", str(warps))
    for seed, activation in ((0, "relu"), (1, "none")):
        dense, c, x, bias = _case(m, k, n, sparsity, dtype, seed + lpr + unroll + warps, transposed)
        y = _poisoned(m, n, dtype, transposed)
        b = bias if activation == "relu" else None
        gpu.spmm_csr(**c, x=x, m=m, bias=b, activation=activation, variant="direct", out=y)
        err = relative_error(y, spmm_reference64(dense, x, b, activation))
        assert err <= TOLERANCE[dtype], (
            f"direct lpr={lpr} unroll={unroll} warps={warps} {dtype} {m}x{k}x{n}: rel err {err:.2e}"
        )


@pytest.mark.parametrize("unroll", [16, 32])
@pytest.mark.parametrize("lpr", [4, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_direct_partial_chunks(monkeypatch, unroll, lpr, dtype):
    """Several pairs per lane (U > LPR): rows whose last chunk holds every count of entries from 1 to U (rows padded
    to 4 entries, and one row of each count unpadded through a CSR built by hand), X row-major, N = 64."""
    monkeypatch.setenv("PRUNEKIT_DIRECT_LPR", str(lpr))
    monkeypatch.setenv("PRUNEKIT_DIRECT_UNROLL", str(unroll))
    g = torch.Generator(device="cuda").manual_seed(lpr * unroll)
    k, n = 512, 64
    counts = [c + unroll * r for r in range(3) for c in range(1, unroll + 1)]  # 1..3U entries per row
    m = len(counts)
    cols = [torch.randperm(k, generator=g, device="cuda")[:c].sort().values for c in counts]
    column_indices = torch.cat(cols).int()
    values = torch.randn(column_indices.numel(), generator=g, device="cuda").to(dtype)
    row_offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    row_indices = torch.arange(m, dtype=torch.int32, device="cuda")
    dense = torch.zeros(m, k, dtype=dtype, device="cuda")
    for r, c in enumerate(cols):
        dense[r, c.long()] = values[row_offsets[r] : row_offsets[r + 1]]
    x = torch.randn(k, n, generator=g, device="cuda").to(dtype)
    y = _poisoned(m, n, dtype, False)
    gpu.spmm_csr(
        values=values,
        row_offsets=row_offsets,
        column_indices=column_indices,
        row_indices=row_indices,
        x=x,
        m=m,
        variant="direct",
        out=y,
    )
    assert relative_error(y, spmm_reference64(dense, x, None, "none")) <= TOLERANCE[dtype]


@pytest.mark.parametrize("transpose_env", ["1", "0"])
@pytest.mark.parametrize("transposed", [False, True], ids=["xrow", "xT"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [17, 20, 23, 33, 63])
def test_direct_n_not_a_multiple_of_the_vector(monkeypatch, transpose_env, transposed, dtype, n):
    """N not a multiple of the 16-byte vector: X of either layout is copied into rows padded with zeros to whole vectors
    (row_major_copy), and every lane loads vectors, the last one reading the padding; with
    $PRUNEKIT_ROWWARP_TRANSPOSE=0 torch's unpadded copy (or X as it is) takes the element loads. Y is stored only up
    to N (NaN-poisoned), at 4 / 8 lanes per row (the defaults up to N = 32 / 64)."""
    monkeypatch.setenv("PRUNEKIT_ROWWARP_TRANSPOSE", transpose_env)
    m, k = 300, 520
    for seed, activation in ((0, "relu"), (1, "none")):
        dense, c, x, bias = _case(m, k, n, 0.9, dtype, seed + n, transposed)
        b = bias if activation == "relu" else None
        for transposed_y in (False, True):
            y = _poisoned(m, n, dtype, transposed_y)
            gpu.spmm_csr(**c, x=x, m=m, bias=b, activation=activation, variant="direct", out=y)
            err = relative_error(y, spmm_reference64(dense, x, b, activation))
            assert err <= TOLERANCE[dtype], f"direct {dtype} N={n} env={transpose_env}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["every-other-token", "padded-rows"])
def test_direct_reads_x_of_other_strides(dtype, layout):
    """X neither row-major nor nn.Linear's transpose: the op copies it to row-major itself (row_major_copy) or, with
    unit stride along N, reads it in place (padded rows: the element path)."""
    m, k, n = 70, 300, 72
    g = torch.Generator(device="cuda").manual_seed(21)
    dense = random_sparse_weight(m, k, 0.9, dtype, "cuda", g, empty_rows=2, single_rows=2)
    if layout == "every-other-token":
        x = torch.randn(2 * n, k, generator=g, device="cuda").to(dtype)[::2].t()  # strides (1, 2K)
    else:
        x = torch.randn(k, n + 3, generator=g, device="cuda").to(dtype)[:, :n]  # strides (N + 3, 1)
    bias = torch.randn(m, generator=g, device="cuda").to(dtype)
    for transposed_y in (False, True):
        y = _poisoned(m, n, dtype, transposed_y)
        gpu.spmm_csr(**encode_csr(dense), x=x, m=m, bias=bias, activation="relu", variant="direct", out=y)
        assert relative_error(y, spmm_reference64(dense, x, bias, "relu")) <= TOLERANCE[dtype]


@pytest.mark.parametrize("variant", ["rowwarp", "direct", "tiled"])
def test_spmm_int32_column_indices(variant):
    m, k, n = 9, 33000, 20
    dense, c, x, bias = _case(m, k, n, 0.99, torch.float16, 5, True)
    assert c["column_indices"].dtype == torch.int32
    y = _poisoned(m, n, torch.float16, True)
    gpu.spmm_csr(**c, x=x, m=m, bias=bias, activation="relu", variant=variant, out=y)
    assert relative_error(y, spmm_reference64(dense, x, bias, "relu")) <= TOLERANCE[torch.float16]


def test_spmm_all_zero_weight_gives_bias():
    m, k, n = 20, 50, 7
    c = encode_csr(torch.zeros(m, k, dtype=torch.float16, device="cuda"))
    x = torch.randn(k, n, device="cuda").half()
    bias = torch.randn(m, device="cuda").half()
    for variant in ("rowwarp", "direct", "tiled"):
        y = _poisoned(m, n, torch.float16, False)
        gpu.spmm_csr(**c, x=x, m=m, bias=bias, variant=variant, out=y)
        torch.testing.assert_close(y, bias[:, None].expand(m, n))


@pytest.mark.parametrize("n", [1, 16, 300])
def test_op_dispatches_to_cuda_and_keeps_layout(n):
    m, k = 96, 128
    dense, c, x, bias = _case(m, k, n, 0.8, torch.float16, n, True)
    y = ops.spmm_csr(c["values"], c["row_offsets"], c["column_indices"], c["row_indices"], x, m, bias, "relu")
    assert y.is_cuda and y.shape == (m, n) and y.t().is_contiguous()
    assert relative_error(y, spmm_reference64(dense, x, bias, "relu")) <= TOLERANCE[torch.float16]


def test_op_mixed_precision_fp32_activations_fp16_weights():
    m, k, n = 40, 64, 8
    dense, c, x, _ = _case(m, k, n, 0.5, torch.float16, 3, True)
    y = ops.spmm_csr(**c, x=x.float(), m=m)
    assert y.dtype == torch.float32
    assert relative_error(y, spmm_reference64(dense, x, None, "none")) <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("transposed", [False, True])
def test_opcheck_spmm_csr_cuda(transposed):
    _, c, x, bias = _case(50, 70, 40, 0.8, torch.float16, 9, transposed)
    args = (c["values"], c["row_offsets"], c["column_indices"], c["row_indices"], x, 50, bias, "relu")
    torch.library.opcheck(ops.spmm_csr, args)


def test_repeated_runs_are_bitwise_identical():
    dense, c, x, bias = _case(300, 900, 200, 0.9, torch.bfloat16, 11, True)
    first = ops.spmm_csr(**c, x=x, m=300, bias=bias)
    for _ in range(3):
        assert torch.equal(ops.spmm_csr(**c, x=x, m=300, bias=bias), first)
