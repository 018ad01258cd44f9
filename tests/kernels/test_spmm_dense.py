"""The ``dense`` SpMM variant (csrc/spmm_dense.cu): the CSR weight decompressed by ``prunekit_ext::csr_to_dense``, then
one cuBLAS GEMM.

CPU: the reference decompression and the public op ``prunekit::csr_to_dense`` (CPU and fake implementations), the
``auto`` rule and its switch, and the eager entry's code. GPU (``cuda``): the decompression kernel against the
reference on memory poisoned first (every dtype, both index widths, odd K, several shared-memory chunks, empty rows),
the variant against a float64 reference into a poisoned output (both layouts, bias and ReLU, odd sizes), the C++ entry
with the ``dense`` code, a CUDA graph, and ``SparseLinear`` taking the variant through ``auto``.
"""

from __future__ import annotations

import pytest
import torch

from prunekit import formats
from prunekit.deploy.runtime.sparse_linear import SparseLinear
from prunekit.kernels import gpu, ops, reference
from prunekit.kernels.testing import (
    SPMM_EDGE_CASES,
    TOLERANCE,
    encode_csr,
    random_sparse_weight,
    random_spmm_case,
    relative_error,
    spmm_reference64,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def _library_loaded(request):
    """``torch.ops.prunekit_ext.*`` exists only once the library is loaded: load it for the GPU tests."""
    if request.node.get_closest_marker("cuda") and torch.cuda.is_available():
        gpu._ensure_loaded()


# --- CPU: the reference and the public op ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("case", SPMM_EDGE_CASES, ids=lambda c: f"{c[0]}x{c[1]}")
def test_reference_decompression_gives_back_the_weight(dtype, case):
    m, k, sparsity, empty_rows = case
    dense, csr, _, _ = random_spmm_case(m, k, 1, sparsity, empty_rows, dtype, seed=m * k)
    out = reference.csr_to_dense(csr["values"], csr["row_offsets"], csr["column_indices"], m, k)
    assert out.dtype == dtype and out.shape == (m, k) and out.is_contiguous()
    assert torch.equal(out, dense)  # padding entries are zeros on a real column: the sum is exact


def test_reference_decompression_adds_entries_on_one_position():
    values = torch.tensor([1.0, 2.0, 0.5, 4.0])
    row_offsets = torch.tensor([0, 3, 3, 4], dtype=torch.int32)
    column_indices = torch.tensor([1, 1, 2, 0], dtype=torch.int16)
    out = reference.csr_to_dense(values, row_offsets, column_indices, 3, 3)
    assert torch.equal(out, torch.tensor([[0.0, 3.0, 0.5], [0.0, 0.0, 0.0], [4.0, 0.0, 0.0]]))


def test_public_op_runs_the_reference_on_cpu_and_has_a_fake():
    w = random_sparse_weight(9, 21, 0.7, torch.bfloat16, empty_rows=2)
    csr = encode_csr(w)
    args = (csr["values"], csr["row_offsets"], csr["column_indices"], 9, 21)
    assert torch.equal(ops.csr_to_dense(*args), w)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = ops.csr_to_dense(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.shape == (9, 21) and fake.dtype == torch.bfloat16


# --- CPU: the rule --------------------------------------------------------------------------------------------------


def test_dense_auto_enabled_reads_the_flag(monkeypatch):
    monkeypatch.delenv(gpu.DENSE_AUTO_ENV, raising=False)
    assert gpu.dense_auto_enabled() is gpu.DENSE_AUTO_DEFAULT
    for value, expected in (("1", True), ("0", False), ("", False), ("false", False), ("true", True)):
        monkeypatch.setenv(gpu.DENSE_AUTO_ENV, value)
        assert gpu.dense_auto_enabled() is expected, value


def test_plan_takes_dense_only_where_its_rule_holds():
    m = k = 1024
    forced = gpu._plan_spmm(m, k, 1, 10, 132, "dense", None)
    assert forced.variant == "dense"  # forced: any N, any dtype
    for n in (1, 16, gpu.DENSE_MIN_N - 1, gpu.DENSE_MIN_N, 128, 129, 256, 257, 4096):
        den = gpu.dense_min_density_denominator(n, k)
        floor = -(-m * k // den)  # smallest nnz_padded at or above the floor
        for nnz, dtype, dense_auto in (
            (floor, torch.float16, True),
            (m * k, torch.bfloat16, True),
            (floor, torch.float16, False),
            (m * k, torch.float32, True),
            (m * k, None, True),
            (max(0, floor - 1), torch.float16, True),
        ):
            plan = gpu._plan_spmm(m, k, n, nnz, 132, "auto", dtype, True, True, 8, True, dense_auto)
            expected = dense_auto and dtype in gpu.TC_DTYPES and n >= gpu.DENSE_MIN_N and nnz * den >= m * k
            assert (plan.variant == "dense") == expected, (n, nnz, dtype, dense_auto, plan)


def test_eager_code_runs_dense_in_the_entry_and_leaves_its_range_to_python(monkeypatch):
    half = torch.float16
    monkeypatch.setenv(gpu.BITMAP_AUTO_ENV, "0")
    assert gpu.eager_spmm_code("dense", half, half, 1, tc_auto=False) == gpu.SPMM_VARIANT_CODES["dense"] == 8
    assert gpu.eager_spmm_code("dense", torch.float32, torch.float32, 4096, tc_auto=False) == 8
    monkeypatch.setenv(gpu.DENSE_AUTO_ENV, "1")
    # from DENSE_MIN_N the rule reads the density: eager_spmm_variant plans the call
    assert gpu.eager_spmm_code("auto", half, half, gpu.DENSE_MIN_N, tc_auto=False) is None
    assert gpu.eager_spmm_code("auto", half, half, 4096, tc_auto=False) is None
    assert gpu.eager_spmm_code("auto", torch.float32, torch.float32, 4096, tc_auto=False) == 0
    assert gpu.eager_spmm_code("auto", half, half, gpu.DENSE_MIN_N - 1, tc_auto=False) is None  # mid-N direct rule
    monkeypatch.setenv(gpu.DIRECT_MID_N_AUTO_ENV, "0")
    assert gpu.eager_spmm_code("auto", half, half, gpu.DENSE_MIN_N - 1, tc_auto=False) == 0
    monkeypatch.setenv(gpu.DENSE_AUTO_ENV, "0")
    assert gpu.eager_spmm_code("auto", half, half, 4096, tc_auto=False) == 0


def test_dense_rule_changes_only_between_eager_size_classes():
    # spmm_op_entry keeps one decision per size class above BITMAP_WIDE_MAX_N and per N below: the rule's N floor and
    # density floors may only change where eager_size_class does
    for n in range(gpu.DENSE_MIN_N, 1100):
        if gpu.eager_size_class(n) == gpu.eager_size_class(n + 1):
            assert (n >= gpu.DENSE_MIN_N) == (n + 1 >= gpu.DENSE_MIN_N)
            for k in (64, 768, 1024, 1025, 4096):
                assert gpu.dense_min_density_denominator(n, k) == gpu.dense_min_density_denominator(n + 1, k), (n, k)
    assert gpu.eager_size_class(gpu.DENSE_MIN_N - 1) != gpu.eager_size_class(gpu.DENSE_MIN_N)


# --- GPU: the decompression kernel ----------------------------------------------------------------------------------


def _poison_allocator(nbytes: int) -> None:
    """Fill about ``nbytes`` of the caching allocator's free memory with NaN, so that a buffer allocated next (the
    kernel's output) starts as NaN wherever the kernel fails to write."""
    junk = torch.full((nbytes // 2 + 1024,), float("nan"), dtype=torch.float16, device="cuda")
    del junk


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32], ids=str)
@pytest.mark.parametrize(
    "m,k,sparsity,empty_rows",
    [
        *SPMM_EDGE_CASES,
        (5, 30001, 0.9, 1),
        (3, 12289, 0.5, 1),
        (2, 24576, 0.99, 0),
        (64, 4096, 0.0, 0),
        (6, 2048, 0.5, 1),  # the longest rows a warp takes in fp16 (4 KB), M not a multiple of 4 rows per block
        (7, 2056, 0.5, 1),  # one vector more: a block per row
        (1030, 384, 0.9, 5),  # MiniLM's K, warp rows in 258 blocks, the last one partly past M
    ],
    ids=str,
)
def test_csr_to_dense_kernel_matches_the_reference(dtype, index_dtype, m, k, sparsity, empty_rows):
    dense, csr, _, _ = random_spmm_case(m, k, 1, sparsity, empty_rows, dtype, seed=m + k, device="cuda")
    cols = csr["column_indices"].to(index_dtype)
    _poison_allocator(m * k * 4 + 4096)
    out = gpu.csr_to_dense(csr["values"], csr["row_offsets"], cols, m, k)
    torch.cuda.synchronize()
    assert out.shape == (m, k) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, dense)
    raw = torch.ops.prunekit_ext.csr_to_dense(csr["values"], csr["row_offsets"], cols, m, k)
    assert torch.equal(raw, dense)  # the op's own view of its 16-byte-row buffer


@pytest.mark.cuda
def test_csr_to_dense_kernel_skips_zero_padding_and_takes_empty_sizes():
    # zeros repeating a real column, before and after it (the format pads after the row's last column), and -0.0
    values = torch.tensor([0.0, 2.0, 0.0, -0.0, 0.5, 4.0, 0.0], device="cuda").half()
    row_offsets = torch.tensor([0, 5, 5, 7], dtype=torch.int32, device="cuda")
    cols = torch.tensor([1, 1, 1, 2, 2, 0, 0], dtype=torch.int16, device="cuda")
    out = gpu.csr_to_dense(values, row_offsets, cols, 3, 3)
    assert torch.equal(out.cpu(), torch.tensor([[0.0, 2.0, 0.5], [0.0, 0.0, 0.0], [4.0, 0.0, 0.0]]).half())
    empty = gpu.csr_to_dense(values[:0], torch.zeros(1, dtype=torch.int32, device="cuda"), cols[:0], 0, 7)
    assert empty.shape == (0, 7)
    assert torch.equal(ops.csr_to_dense(values, row_offsets, cols, 3, 3), out)  # the public op on CUDA


@pytest.mark.cuda
def test_csr_to_dense_kernel_errors_are_one_sentence():
    c = encode_csr(random_sparse_weight(4, 8, 0.5, torch.float16, "cuda"))
    with pytest.raises(RuntimeError, match="row_offsets has 5 entries, expected M \\+ 1 = 4"):
        gpu.csr_to_dense(c["values"], c["row_offsets"], c["column_indices"], 3, 8)
    with pytest.raises(RuntimeError, match="float16, bfloat16 or float32"):
        gpu.csr_to_dense(c["values"].double(), c["row_offsets"], c["column_indices"], 4, 8)


# --- GPU: the variant -----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SPMM_EDGE_CASES, ids=lambda c: f"{c[0]}x{c[1]}")
@pytest.mark.parametrize("n", [1, 3, 65, 130])
@pytest.mark.parametrize("transposed", [True, False], ids=["x2d.t()", "row-major X"])
def test_dense_variant_matches_float64(dtype, case, n, transposed):
    m, k, sparsity, empty_rows = case
    dense, csr, x2d, bias = random_spmm_case(m, k, n, sparsity, empty_rows, dtype, seed=7 * m + n, device="cuda")
    x = x2d.t() if transposed else x2d.t().contiguous()
    for b, activation in ((None, "none"), (bias, "none"), (bias, "relu"), (None, "relu")):
        out = torch.full((n, m), float("nan"), dtype=dtype, device="cuda").t() if transposed else None
        if not transposed:
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        y = gpu.spmm_csr(**csr, x=x, m=m, bias=b, activation=activation, variant="dense", out=out)
        assert y.data_ptr() == out.data_ptr()
        ref = spmm_reference64(dense, x, b, activation)
        assert relative_error(y, ref) <= TOLERANCE[dtype], (b is not None, activation)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [True, False], ids=["rows", "x (K, N)"])
def test_cpp_entry_runs_the_dense_code(dtype, rows):
    m, k, n = 300, 777, 70
    dense, csr, x2d, bias = random_spmm_case(m, k, n, 0.8, 3, dtype, seed=11, device="cuda")
    code = gpu.SPMM_VARIANT_CODES["dense"] | (gpu.SPMM_ROWS if rows else 0)
    x = x2d if rows else x2d.t()
    _poison_allocator(n * m * 4 + m * k * 4)
    y = torch.ops.prunekit_ext.spmm_csr_auto(*csr.values(), x, m, bias, True, code)
    ref = spmm_reference64(dense, x2d.t(), bias, "relu")
    assert relative_error(y.t() if rows else y, ref) <= TOLERANCE[dtype]
    plan = torch.ops.prunekit_ext.plan_spmm_code(m, k, n, csr["values"].numel(), 132, 8, dtype, True)
    assert tuple(plan) == gpu.spmm_plan_code(gpu._plan_spmm(m, k, n, csr["values"].numel(), 132, "dense", dtype))


@pytest.mark.cuda
def test_dense_variant_replays_in_a_cuda_graph():
    m, k, n = 512, 1024, 256
    dense, csr, x2d, bias = random_spmm_case(m, k, n, 0.9, 4, torch.float16, seed=5, device="cuda")
    x = x2d.clone()
    y = gpu.spmm_csr(**csr, x=x.t(), m=m, bias=bias, activation="relu", variant="dense")  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gpu.spmm_csr(**csr, x=x.t(), m=m, bias=bias, activation="relu", variant="dense")
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(y, spmm_reference64(dense, x.t(), bias, "relu")) <= TOLERANCE[torch.float16]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sparse_linear_takes_dense_through_auto(dtype, monkeypatch):
    monkeypatch.setenv(gpu.DENSE_AUTO_ENV, "1")
    monkeypatch.setenv(gpu.EAGER_CPP_ENV, "1")
    monkeypatch.setattr(gpu, "DENSE_MIN_DENSITY_DENOMINATOR", 1 << 20)  # every density, whatever the measured floor
    gpu._plan_spmm.cache_clear()  # plans are cached per shape: none made under another floor
    m, k = 192, 640
    w = random_sparse_weight(m, k, 0.9, dtype, "cpu", torch.Generator().manual_seed(2), empty_rows=3)
    bias = torch.randn(m).to(dtype)
    layer = SparseLinear(formats.encode("csr", w), bias).cuda()
    try:
        for tokens in (gpu.DENSE_MIN_N, 300):
            x = torch.randn(tokens, k, device="cuda").to(dtype)
            with torch.inference_mode():
                y = layer(x)
            ref = spmm_reference64(w, x.t(), bias, "none").t()
            assert relative_error(y, ref) <= TOLERANCE[dtype], tokens
        entries = gpu.spmm_op_entries(layer.w_values)
        assert entries and all(e == ("auto", gpu.SPMM_VARIANT_CODES["dense"]) for e in entries.values()), entries
    finally:
        gpu._plan_spmm.cache_clear()
