"""The C++ eager SpMM entry ``prunekit_ext::spmm_csr_auto`` (csrc/spmm_entry.cu) and the runtime's use of it.

CPU: the Python decision (``gpu.eager_spmm_code`` / ``eager_spmm_variant``: opt-in, never for the tensor-core plan or
mixed dtypes), the C++ constants against gpu.py's, and SparseLinear falling back to the custom op. GPU (``cuda``): the
entry against a float64 reference for every variant it can choose, its output layout, its errors, ``plan_spmm_code``
against ``gpu.plan_spmm``, and SparseLinear taking the entry with ``PRUNEKIT_SPMM_CPP=1``.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess

import pytest
import torch

from prunekit import formats
from prunekit.deploy.runtime.sparse_linear import SparseLinear
from prunekit.kernels import build, gpu, ops, reference
from prunekit.kernels.layout import new_spmm_output
from prunekit.kernels.testing import TOLERANCE, encode_csr, random_sparse_weight, relative_error, spmm_reference64

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ENTRY_SOURCE = build.CSRC_DIR / "spmm_entry.cu"


@pytest.fixture
def cpp_on(monkeypatch):
    monkeypatch.setenv(gpu.EAGER_CPP_ENV, "1")
    monkeypatch.setenv(gpu.TC_AUTO_ENV, "0")


@pytest.fixture(autouse=True)
def _library_loaded(request):
    """``torch.ops.prunekit_ext.*`` exists only once the library is loaded: load it for the GPU tests."""
    if request.node.get_closest_marker("cuda") and torch.cuda.is_available():
        gpu._ensure_loaded()


# --- CPU: the decision function -------------------------------------------------------------------------------------


def test_eager_cpp_enabled_reads_the_flag_and_defaults_on(monkeypatch):
    monkeypatch.delenv(gpu.EAGER_CPP_ENV, raising=False)
    assert gpu.eager_cpp_enabled() is gpu.EAGER_CPP_DEFAULT is True  # on since its H100 run (2026-11-26)
    for value, expected in (("1", True), ("0", False), ("", False), ("false", False), ("true", True)):
        monkeypatch.setenv(gpu.EAGER_CPP_ENV, value)
        assert gpu.eager_cpp_enabled() is expected, value


def test_eager_spmm_code_never_takes_the_tensor_core_plan(monkeypatch):
    monkeypatch.setenv(gpu.BITMAP_AUTO_ENV, "0")  # the bitmap rule's range up to BITMAP_WIDE_MAX_N: its own test below
    monkeypatch.setenv(
        gpu.DENSE_AUTO_ENV, "0"
    )  # the dense rule's range from DENSE_MIN_N: tests/kernels/test_spmm_dense.py
    monkeypatch.setenv(gpu.DIRECT_MID_N_AUTO_ENV, "0")  # N 33-64: test_spmm_bitmap.py's test of the mid-N direct rule
    half = torch.float16
    assert gpu.eager_spmm_code("tc", half, half, 1, tc_auto=False) is None
    assert gpu.eager_spmm_code("auto", half, half, gpu.TC_MIN_N, tc_auto=True) is None
    assert gpu.eager_spmm_code("auto", torch.bfloat16, torch.bfloat16, 4096, tc_auto=True) is None
    # below TC_MIN_N, with tc off, or in fp32 the plan is a CUDA-core one: the entry takes it
    assert gpu.eager_spmm_code("auto", half, half, gpu.TC_MIN_N - 1, tc_auto=True) == 0
    assert gpu.eager_spmm_code("auto", half, half, 4096, tc_auto=False) == 0
    assert gpu.eager_spmm_code("auto", torch.float32, torch.float32, 4096, tc_auto=True) == 0
    # the entry never runs a tc plan: wherever plan_spmm may say tc (its density rule is unknown to the entry, which
    # sees no weight), the call goes to Python, which plans it; below TC_MIN_N or with tc off the entry takes it
    for plan_n in (1, 64, 65, 128, 4096):
        for tc_auto in (False, True):
            for nnz in (30000, 100000, 300000, 600000):  # 2.9% to 57% dense
                plan = gpu._plan_spmm(1024, 1024, plan_n, nnz, 132, "auto", half, tc_auto)
                code = gpu.eager_spmm_code("auto", half, half, plan_n, tc_auto)
                assert not (plan.variant == "tc" and code is not None), (plan_n, tc_auto, nnz)
                assert (code is None) == (tc_auto and plan_n >= gpu.TC_MIN_N), (plan_n, tc_auto, nnz)


def test_eager_spmm_code_leaves_the_scatter_and_bitmap_range_to_python(monkeypatch):
    half = torch.float16
    monkeypatch.delenv(gpu.SCATTER_AUTO_ENV, raising=False)
    monkeypatch.delenv(gpu.BITMAP_AUTO_ENV, raising=False)
    monkeypatch.setenv(gpu.DENSE_AUTO_ENV, "0")  # its range from N = 65: test_spmm_dense.py
    for n in range(gpu.BITMAP_MIN_N, gpu.SCATTER_MAX_N + 1):
        assert gpu.eager_spmm_code("auto", half, half, n, tc_auto=False) is None  # density decides: gpu.spmm_csr
        assert gpu.eager_spmm_code("auto", torch.float32, torch.float32, n, tc_auto=False) == 0
    assert gpu.eager_spmm_code("auto", half, half, 1, tc_auto=False) == 0
    monkeypatch.setenv(gpu.SCATTER_AUTO_ENV, "0")
    assert gpu.eager_spmm_code("auto", half, half, 16, tc_auto=False) is None  # the bitmap rule is still on
    assert gpu.eager_spmm_code("auto", half, half, 4, tc_auto=False) is None
    monkeypatch.setenv(gpu.BITMAP_AUTO_ENV, "0")
    assert gpu.eager_spmm_code("auto", half, half, 16, tc_auto=False) == 0
    assert gpu.eager_spmm_code("auto", half, half, 4, tc_auto=False) == 0
    monkeypatch.delenv(gpu.SCATTER_AUTO_ENV)
    assert gpu.eager_spmm_code("auto", half, half, 4, tc_auto=False) == 0  # below the scatter range
    assert gpu.eager_spmm_code("auto", half, half, 9, tc_auto=False) is None
    sizes = (1, 2, 4, 5, 8, 9, 15, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 4096)
    classes = [gpu.eager_size_class(n) for n in sizes]
    assert classes == [0, 1, 1, 2, 2, 3, 3, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9]
    # N 17-256: the wide bitmap rule reads the density too (fp32: the entry)
    monkeypatch.delenv(gpu.BITMAP_AUTO_ENV)
    for n in (17, 64, 65, gpu.BITMAP_WIDE_MAX_N):
        assert gpu.eager_spmm_code("auto", half, half, n, tc_auto=False) is None, n
        assert gpu.eager_spmm_code("auto", torch.float32, torch.float32, n, tc_auto=False) == 0, n
    assert gpu.eager_spmm_code("auto", half, half, gpu.BITMAP_WIDE_MAX_N + 1, tc_auto=False) == 0


def test_eager_spmm_code_rejects_mixed_and_unsupported_dtypes():
    assert gpu.eager_spmm_code("auto", torch.float32, torch.float16, 1, tc_auto=False) is None
    assert gpu.eager_spmm_code("auto", torch.float64, torch.float64, 1, tc_auto=False) is None
    for dtype in gpu.EAGER_DTYPES:
        assert gpu.eager_spmm_code("auto", dtype, dtype, 1, tc_auto=False) == 0


def test_eager_spmm_code_maps_forced_variants_and_rejects_unknown():
    codes = {v: gpu.eager_spmm_code(v, torch.float16, torch.float16, 1, tc_auto=False) for v in gpu.SPMM_VARIANTS}
    assert codes == {
        "auto": 0,
        "rowwarp": 1,
        "rowwarp_global": 2,
        "direct": 3,
        "tiled": 4,
        "tc": None,
        "scatter": None,
        "bitmap": None,
        "dense": 8,  # the entry runs it (spmm_dense.cu)
    }
    with pytest.raises(ValueError, match="unknown spmm variant"):
        gpu.eager_spmm_code("fast", torch.float16, torch.float16, 16, tc_auto=False)


def test_eager_spmm_variant_is_none_when_off_or_not_cuda(monkeypatch):
    values = torch.zeros(8, dtype=torch.float16)
    x = torch.zeros(4, 3, dtype=torch.float16)
    monkeypatch.delenv(gpu.EAGER_CPP_ENV, raising=False)
    assert gpu.eager_spmm_variant(values, x) is None
    monkeypatch.setenv(gpu.EAGER_CPP_ENV, "1")
    assert gpu.eager_spmm_variant(values, x) is None  # CPU tensors: the reference op runs
    assert gpu.eager_spmm_variant(values, x[None]) is None  # not (K, N)


def test_plan_code_fields_follow_spmm_plan():
    plan = gpu._plan_spmm(64, 300, 3, 64 * 160, 132, "auto", torch.float16, False)
    assert gpu.spmm_plan_code(plan) == (1, 32, 4, 8, 0, 1)
    assert gpu.spmm_plan_code(gpu._plan_spmm(64, 300, 300, 100, 132, "direct", None, False)) == (3, 32, 16, 8, 1, 1)
    assert set(gpu.SPMM_VARIANT_CODES) == set(gpu.SPMM_VARIANTS)


def _cpp_constants() -> dict[str, int]:
    text = ENTRY_SOURCE.read_text()
    return {name: int(value) for name, value in re.findall(r"constexpr int64_t (\w+) = (\d+);", text)}


def test_cpp_entry_constants_match_gpu_py():
    """The C++ plan is gpu.plan_spmm ported: its thresholds and variant codes must be gpu.py's (the GPU test compares
    whole plans; this catches a one-sided edit without a GPU)."""
    cpp = _cpp_constants()
    for name in (
        "ROWWARP_MAX_N",
        "TC_MIN_N",
        "TC_MIN_DENSITY_DENOMINATOR",
        "TC_SMALL_N",
        "TC_MIN_DENSITY_DENOMINATOR_SMALL_N",
        "TC_SMALL_K",
        "TC_MIN_DENSITY_DENOMINATOR_SMALL_K",
        "SUBWARP_MIN_NNZ",
        "STAGE_X_MIN_N",
        "STAGE_X_MIN_ROWS_PER_SM",
        "DECODE_STAGE_X_MAX_BYTES",
        "DECODE_STAGE_X_MIN_ROWS_PER_SM",
        "DECODE_STAGE_X_MIN_DENSITY_DENOMINATOR",
        "DECODE_STAGE_X_SHORT_ROWS_MIN_ROWS_PER_SM",
    ):
        assert cpp[name] == getattr(gpu, name), name
    assert (cpp["DECODE_STAGE_X_MIN_N"], cpp["DECODE_STAGE_X_MAX_N"]) == (gpu.SCATTER_MIN_N, gpu.BITMAP_MAX_N)
    assert cpp["TILED_N_TILE"] == gpu.TILED_N_TILE
    assert cpp["TILED_BIG_ROWS_PER_BLOCK"] == gpu.TILED_ROWS_PER_BLOCK[8]
    assert cpp["TC_WARPS"] == gpu.TC_WARPS
    codes = {"kAuto": "auto", "kRowwarp": "rowwarp", "kRowwarpGlobal": "rowwarp_global", "kDirect": "direct"}
    codes |= {"kTiled": "tiled", "kTc": "tc"}
    assert {name: cpp[name] for name in codes} == {name: gpu.SPMM_VARIANT_CODES[v] for name, v in codes.items()}
    tiles = re.search(r"TC_TILES\{\{(.*?)\}\};", ENTRY_SOURCE.read_text()).group(1)
    assert tuple(tuple(map(int, t)) for t in re.findall(r"\{(\d+), (\d+)\}", tiles)) == gpu.TC_TILES


def _csr_layer(m=48, k=40, dtype=torch.float16, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    dense = random_sparse_weight(m, k, 0.7, dtype, "cpu", g, empty_rows=2, single_rows=2)
    b = torch.randn(m, generator=g).to(dtype) if bias else None
    return dense, b, SparseLinear(formats.encode("csr", dense), b)


def test_sparse_linear_csr_on_cpu_keeps_the_custom_op(cpp_on):
    dense, bias, layer = _csr_layer(dtype=torch.float32)
    for tokens in (1, 5):
        x = torch.randn(2, tokens, 40)
        y = layer(x)
        ref = (x.double() @ dense.double().t() + bias.double()).float()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert not hasattr(layer.w_values, gpu.OP_ENTRY_ATTR)  # CPU calls never ask for (or cache) an eager decision


def test_sparse_linear_csr_on_cpu_stays_differentiable(cpp_on):
    dense, bias, layer = _csr_layer(dtype=torch.float32, bias=False)
    x = torch.randn(3, 40, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, dense.sum(0).expand(3, 40), rtol=1e-5, atol=1e-5)


def test_sparse_linear_csr_eager_calls_the_launcher_where_no_entry_applies(cpp_on, monkeypatch):
    """Eager CUDA inference (faked on the CPU, where gpu.spmm_rows_call finds no C++ entry) calls the CUDA launcher
    gpu.spmm_csr directly with X^T (K, N) as a view, M and the bias, skipping the custom-op dispatch; an input that
    needs a gradient goes through the differentiable custom op instead."""
    from prunekit.deploy.runtime import sparse_linear

    calls = []

    def launcher(values, row_offsets, column_indices, row_indices, x, m, bias=None, activation="none"):
        calls.append((tuple(x.shape), x.stride(0), m, bias is not None))
        return reference.spmm_csr(values, row_offsets, column_indices, row_indices, x, m, bias, activation)

    monkeypatch.setattr(sparse_linear, "_eager_cuda", lambda xt: True)
    monkeypatch.setattr(gpu, "spmm_csr", launcher)
    dense, bias, layer = _csr_layer(dtype=torch.float32)
    for tokens in (1, 3, gpu.TC_MIN_N):
        x = torch.randn(tokens, 40)
        y = layer(x)
        assert y.shape == (tokens, 48)
        torch.testing.assert_close(y, x @ dense.t() + bias, rtol=1e-5, atol=1e-5)
    assert calls == [((40, n), 1, 48, True) for n in (1, 3, gpu.TC_MIN_N)]
    y = layer(torch.randn(2, 5, 40))  # leading dimensions: 10 tokens
    assert y.shape == (2, 5, 48) and calls[-1][0] == (40, 10)
    x = torch.randn(4, 40, requires_grad=True)
    layer(x).sum().backward()
    assert len(calls) == 4 and x.grad is not None  # the custom op's autograd, not the CUDA implementation


def test_sparse_linear_csr_keeps_the_entry_parts_per_layer(cpp_on, monkeypatch):
    """SparseLinear's eager CUDA CSR call (faked on the CPU) with gpu.spmm_rows_call's parts: made once per (x dtype,
    bias dtype, N), made again after an in-place edit of the weight; the bitmap entry gets (buffer, x, bias, False,
    cfg, shape) and spmm_csr_auto (values, row_offsets, column_indices, row_indices, x, M, bias, False, code), x being
    the activations as given; where there are no parts, the launcher gpu.spmm_csr runs the call on X^T."""
    from prunekit.deploy.runtime import sparse_linear

    made, ran = [], []

    def reference_rows(values, offsets, cols, rows, x, m, bias):
        return reference.spmm_csr(values, offsets, cols, rows, x.t(), m, bias).t()

    def bitmap_entry(buffer, x, bias, relu, cfg, shape):
        ran.append(("bitmap", x, buffer, cfg, shape))
        return reference_rows(*layer_parts(), x, 48, bias)

    def auto_entry(values, offsets, cols, rows, x, m, bias, relu, code):
        ran.append(("auto", x, code))
        return reference_rows(values, offsets, cols, rows, x, m, bias)

    def rows_call(values, offsets, cols, rows, x, m, bias=None):
        made.append(x.shape[0])
        if x.shape[0] == 3:
            return None
        return (True, bitmap_entry, "buffer", 7, 9) if x.shape[0] <= 16 else (False, auto_entry, 5)

    def launcher(values, offsets, cols, row_indices, x, m, bias=None, activation="none"):
        ran.append(("launcher", x.t()))  # X^T, a view of the activations
        return reference.spmm_csr(values, offsets, cols, row_indices, x, m, bias, activation)

    monkeypatch.setattr(sparse_linear, "_eager_cuda", lambda xt: True)
    monkeypatch.setattr(gpu, "spmm_rows_call", rows_call)
    monkeypatch.setattr(gpu, "spmm_csr", launcher)
    dense, bias, layer = _csr_layer(dtype=torch.float32)

    def layer_parts():
        b = layer._buffers
        return b["w_values"], b["w_row_offsets"], b["w_column_indices"], b["w_row_indices"]

    for tokens in (4, 4, 40, 3, 3):
        x = torch.randn(tokens, 40)
        y = layer(x)
        torch.testing.assert_close(y, x @ dense.t() + bias, rtol=1e-5, atol=1e-5)
        kind, seen = ran[-1][0], ran[-1][1]  # the entries get x itself; the launcher x.t(), a view of it
        assert seen is x if kind != "launcher" else (seen.data_ptr() == x.data_ptr() and seen.shape == x.shape)
    assert made == [4, 40, 3]  # once per N
    assert [r[0] for r in ran] == ["bitmap", "bitmap", "auto", "launcher", "launcher"]
    assert ran[0][2:] == ("buffer", 7, 9) and ran[2][2] == 5
    with torch.no_grad():
        layer.w_values.mul_(2)  # in place: the parts are made again
    x = torch.randn(4, 40)
    torch.testing.assert_close(layer(x), x @ (2 * dense).t() + bias, rtol=1e-5, atol=1e-5)
    assert made == [4, 40, 3, 4]
    del layer.bias  # no bias: a key of its own
    torch.testing.assert_close(layer(x), x @ (2 * dense).t(), rtol=1e-5, atol=1e-5)
    assert made == [4, 40, 3, 4, 4]
    layer.bias = bias.clone()  # a plain attribute now, not a parameter: still added
    torch.testing.assert_close(layer(x), x @ (2 * dense).t() + bias, rtol=1e-5, atol=1e-5)


def test_spmm_op_entry_decides_once_per_key(cpp_on, monkeypatch):
    """gpu.spmm_op_entry, exercised on the CPU with its rules stood in for: one decision per (x dtype, bias or not, M,
    N), N's size class above BITMAP_WIDE_MAX_N; the bitmap entry and its plan where the bitmap rule takes the call,
    else spmm_csr_auto's code; kept on the values tensor and made again after an in-place edit of the weight;
    $PRUNEKIT_SPMM_CPP=0 gives the Python launcher."""
    asked, built = [], []

    def takes(values, x2d, m, k, bias=None):
        asked.append(("bitmap", x2d.shape[0]))
        return 2 <= x2d.shape[0] <= 16

    def plan(csr, m, k, device, n=1):
        built.append(n)
        return f"plan{n}"

    def variant(values, x, variant="auto", m=None):
        asked.append(("auto", x.shape[1]))
        return gpu.SPMM_VARIANT_CODES["auto"]

    monkeypatch.setattr(gpu, "eager_bitmap_takes", takes)
    monkeypatch.setattr(gpu, "bitmap_linear_plan", plan)
    monkeypatch.setattr(gpu, "eager_spmm_variant", variant)
    c = encode_csr(random_sparse_weight(48, 40, 0.7, torch.float16, "cpu"))
    values, offsets, cols = c["values"], c["row_offsets"], c["column_indices"]
    bias = torch.randn(48).half()

    def entry(n, b=None, m=48):
        return gpu.spmm_op_entry(values, offsets, cols, torch.randn(n, 40).half().t(), m, b)

    wide = gpu.BITMAP_WIDE_MAX_N
    got = [entry(n) for n in (1, 4, 4, 16, 100, wide + 10, wide + 20)]
    auto = ("auto", gpu.SPMM_VARIANT_CODES["auto"])
    assert got == [auto, ("bitmap", "plan4"), ("bitmap", "plan4"), ("bitmap", "plan16"), auto, auto, auto]
    assert built == [4, 16]  # N = 4 decided once; wide + 10 and wide + 20 share a size class
    assert [a for a in asked if a[0] == "auto"] == [("auto", 1), ("auto", 100), ("auto", wide + 10)]
    # the activations (N, K) with rows=True: the same keys, so the same decisions, none made again
    before = len(asked)
    rows = [gpu.spmm_op_entry(values, offsets, cols, torch.randn(n, 40).half(), 48, None, rows=True) for n in (4, 100)]
    assert rows == [("bitmap", "plan4"), auto] and built == [4, 16] and len(asked) == before
    entries = gpu.spmm_op_entries(values)
    assert (torch.float16, True, 48, 4) in entries and (
        torch.float16,
        True,
        48,
        -gpu.eager_size_class(wide + 10),
    ) in entries
    assert entry(4, bias) == ("bitmap", "plan4") and entry(4, m=40) == ("bitmap", "plan4")
    assert built == [4, 16, 4, 4]  # a bias and another M are keys of their own
    values.mul_(2)  # a new version: every decision is made again
    assert entry(4) == ("bitmap", "plan4") and built[-1] == 4 and len(built) == 5
    monkeypatch.setenv(gpu.EAGER_CPP_ENV, "0")
    values.mul_(0.5)
    assert entry(4) == ("auto", None) and len(built) == 5


# --- GPU: the entry against float64 ------------------------------------------------------------------------------


def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _shapes() -> list[tuple[int, int, int, float]]:
    """(M, K, N, sparsity): M = 1, odd K and N, every rowwarp N tile, subwarps 8 and 32 (a dense-ish K = 300), and
    M = 16 * SMs + 3 rows so that ``auto`` stages X in shared memory (N = 40) and forced ``tiled`` takes 8-row warps
    (N = 1030)."""
    big_m = 16 * _sm_count() + 3
    return [
        (1, 7, 1, 0.5),
        (33, 45, 3, 0.7),
        (40, 100, 8, 0.6),
        (77, 203, 17, 0.8),
        (64, 300, 5, 0.5),
        (50, 77, 64, 0.8),
        (130, 301, 129, 0.9),
        (19, 40, 512, 0.7),
        (big_m, 96, 40, 0.5),
        (big_m, 96, 1030, 0.9),
    ]


def _x_layouts(x2d: torch.Tensor) -> dict[str, torch.Tensor]:
    """(K, N) activations: the runtime's x2d.t() (column-major), row-major, and neither (every other column)."""
    k = x2d.shape[1]
    wide = torch.randn(k, 2 * x2d.shape[0], device=x2d.device).to(x2d.dtype)
    wide[:, ::2] = x2d.t()
    return {"xT": x2d.t(), "xrow": x2d.t().contiguous(), "xstrided": wide[:, ::2]}


def _poison_allocator(numel: int, dtype: torch.dtype) -> None:
    """Fill a freed block of the caching allocator with NaN: the entry's output of that size reuses it, so an element
    the kernel fails to write shows up as NaN."""
    block = torch.full((max(1, numel),), float("nan"), dtype=dtype, device="cuda")
    del block


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape_index", range(10))
def test_entry_matches_float64_for_every_variant(dtype, shape_index, cpp_on):
    m, k, n, sparsity = _shapes()[shape_index]
    g = torch.Generator(device="cuda").manual_seed(shape_index)
    dense = random_sparse_weight(m, k, sparsity, dtype, "cuda", g, empty_rows=min(2, m - 1), single_rows=min(2, m - 1))
    c = encode_csr(dense)
    x2d = torch.randn(n, k, generator=g, device="cuda").to(dtype)
    bias = torch.randn(m, generator=g, device="cuda").to(dtype)
    entry = torch.ops.prunekit_ext.spmm_csr_auto.default
    gpu._ensure_loaded()
    for (layout, x), (activation, b) in itertools.product(_x_layouts(x2d).items(), (("relu", bias), ("none", None))):
        ref = spmm_reference64(dense, x, b, activation)
        for variant in ("auto", "rowwarp", "rowwarp_global", "direct", "tiled"):
            _poison_allocator(m * n, dtype)
            y = entry(*c.values(), x, m, b, activation == "relu", gpu.SPMM_VARIANT_CODES[variant])
            torch.cuda.synchronize()
            assert y.shape == (m, n) and y.dtype == dtype
            assert y.stride() == new_spmm_output(x, m).stride(), (layout, variant)
            err = relative_error(y, ref)
            assert err <= TOLERANCE[dtype], f"{variant} {layout} {activation} {dtype} {m}x{k}x{n}: rel err {err:.2e}"
            if layout == "xT":  # the same call on the activations (N, K) with SPMM_ROWS: Y^T (N, M) as it is
                _poison_allocator(m * n, dtype)
                code = gpu.SPMM_VARIANT_CODES[variant] | gpu.SPMM_ROWS
                y = entry(*c.values(), x2d, m, b, activation == "relu", code)
                torch.cuda.synchronize()
                assert y.shape == (n, m) and y.is_contiguous(), variant
                err = relative_error(y.t(), ref)
                assert err <= TOLERANCE[dtype], f"{variant} rows {activation} {dtype} {m}x{k}x{n}: rel err {err:.2e}"


@pytest.mark.cuda
def test_entry_shapes_cover_every_cuda_core_plan():
    """The shapes above reach every branch of the C++ plan (else the float64 test would not check them)."""
    plans = set()
    for m, k, n, sparsity in _shapes():
        nnz = encode_csr(random_sparse_weight(m, k, sparsity, torch.float16, "cuda"))["values"].numel()
        for variant in ("auto", "rowwarp", "rowwarp_global", "direct", "tiled"):
            plans.add(gpu.plan_spmm(m, k, n, nnz, _sm_count(), variant, torch.float16))
    rowwarp = [p for p in plans if p.variant == "rowwarp"]
    assert {p.subwarp for p in rowwarp} == {8, 32}
    assert {p.ntile for p in rowwarp} == {1, 4, 8, 16}
    assert {p.stage_x for p in rowwarp} == {False, True}
    assert {p.rows_per_warp for p in plans if p.variant == "tiled"} == {2, 8}
    assert any(p.variant == "direct" for p in plans)
    big_m = 16 * _sm_count() + 3
    nnz = encode_csr(random_sparse_weight(big_m, 96, 0.5, torch.float16, "cuda"))["values"].numel()
    assert gpu.plan_spmm(big_m, 96, 40, nnz, _sm_count()).stage_x  # auto itself stages X


@pytest.mark.cuda
def test_entry_copies_misaligned_and_converts_bias(cpp_on):
    """Offset views of values/column_indices (not 16-byte aligned) are copied in C++; an fp32 bias is converted."""
    m, k, n = 45, 77, 9
    dense = random_sparse_weight(m, k, 0.8, torch.float16, "cuda", empty_rows=2, single_rows=2)
    c = encode_csr(dense)
    shifted = {}
    for name in ("values", "column_indices"):
        t = c[name]
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
        buf[1:] = t
        shifted[name] = buf[1:]
        assert shifted[name].data_ptr() % 16 != 0
    x = torch.randn(n, k, device="cuda").half().t()
    bias = torch.randn(m, device="cuda")
    y = torch.ops.prunekit_ext.spmm_csr_auto(
        shifted["values"], c["row_offsets"], shifted["column_indices"], c["row_indices"], x, m, bias, True, 0
    )
    assert relative_error(y, spmm_reference64(dense, x, bias.half(), "relu")) <= TOLERANCE[torch.float16]


@pytest.mark.cuda
def test_entry_empty_shapes_and_all_zero_weight():
    m, k = 20, 50
    c = encode_csr(torch.zeros(m, k, dtype=torch.float16, device="cuda"))
    bias = torch.randn(m, device="cuda").half()
    y = torch.ops.prunekit_ext.spmm_csr_auto(*c.values(), torch.randn(k, 7, device="cuda").half(), m, bias, False, 0)
    torch.testing.assert_close(y, bias[:, None].expand(m, 7))
    assert torch.ops.prunekit_ext.spmm_csr_auto(
        *c.values(), torch.empty(k, 0, device="cuda").half(), m, None, False, 0
    ).shape == (m, 0)
    e = encode_csr(torch.zeros(0, k, dtype=torch.float16, device="cuda"))
    assert torch.ops.prunekit_ext.spmm_csr_auto(
        *e.values(), torch.randn(k, 3, device="cuda").half(), 0, None, False, 0
    ).shape == (0, 3)


@pytest.mark.cuda
def test_entry_errors_are_clear():
    m, k = 20, 50
    c = encode_csr(random_sparse_weight(m, k, 0.5, torch.float16, "cuda"))
    x = torch.randn(k, 4, device="cuda").half()
    entry = torch.ops.prunekit_ext.spmm_csr_auto
    with pytest.raises(RuntimeError, match="must share one dtype"):
        entry(*c.values(), x.float(), m, None, False, 0)
    with pytest.raises(RuntimeError, match="expected M \\+ 1"):
        entry(*c.values(), x, m + 1, None, False, 0)
    with pytest.raises(RuntimeError, match="2-D"):
        entry(*c.values(), x[None], m, None, False, 0)
    with pytest.raises(RuntimeError, match="bias must be"):
        entry(*c.values(), x, m, torch.zeros(m + 1, device="cuda").half(), False, 0)


@pytest.mark.cuda
def test_entry_refuses_the_tensor_core_code():
    m, k = 20, 50
    c = encode_csr(random_sparse_weight(m, k, 0.5, torch.float16, "cuda"))
    x = torch.randn(k, 4, device="cuda").half()
    with pytest.raises(RuntimeError, match="tensor-core variant"):
        torch.ops.prunekit_ext.spmm_csr_auto(*c.values(), x, m, None, False, gpu.SPMM_VARIANT_CODES["tc"])


def _plan_cases():
    """(m, k, n, nnz_padded, num_sms, variant, dtype, tc_auto) over which the C++ and Python plans must agree: every
    variant, dtype class, tc_auto and SM count, around the rules' edges (the decode copy of X: 13199 / 13200 rows at 100
    rows per SM of 132, 14336 rows, K = 7265)."""
    dtypes = (None, torch.float16, torch.bfloat16, torch.float32)
    for m, k, n, density, sms, variant, dtype, tc_auto in itertools.product(
        (0, 1, 100, 2111, 4096, 11008, 13199, 13200, 14336), (7, 64, 4096, 7265), (0, 1, 4, 5, 8, 9, 12, 16, 17, 32, 64, 65, 129, 4096),
        (0.0, 0.02, 0.03, 0.05, 0.5, 1.0), (108, 132), gpu.SPMM_VARIANTS, dtypes, (False, True),
    ):  # fmt: skip
        yield m, k, n, int(m * k * density), sms, variant, dtype, tc_auto


@pytest.mark.cuda
def test_plan_spmm_code_cpp_matches_python():
    gpu._ensure_loaded()
    for case in _plan_cases():
        m, k, n, nnz, sms, variant, dtype, tc_auto = case
        cpp = torch.ops.prunekit_ext.plan_spmm_code(m, k, n, nnz, sms, gpu.SPMM_VARIANT_CODES[variant], dtype, tc_auto)
        assert tuple(cpp) == gpu.spmm_plan_code(gpu._plan_spmm(*case)), case


PLAN_DRIVER = r"""
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#define PRUNEKIT_CHECK(cond, ...) \
  do {                              \
    if (!(cond)) throw std::runtime_error("check failed"); \
  } while (0)
%s
int main() {
  long long m, k, n, nnz, sms, variant, tcd, tca;
  while (std::scanf("%%lld %%lld %%lld %%lld %%lld %%lld %%lld %%lld", &m, &k, &n, &nnz, &sms, &variant, &tcd, &tca) == 8) {
    const auto p = plan_spmm(m, k, n, nnz, sms, variant, tcd != 0, tca != 0);
    std::printf("%%lld %%lld %%lld %%lld %%lld %%lld\n", (long long)p[0], (long long)p[1], (long long)p[2],
                (long long)p[3], (long long)p[4], (long long)p[5]);
  }
  return 0;
}
"""


def _entry_plan_source() -> str:
    """The C++ plan of csrc/spmm_entry.cu (its constants, ceil_div and plan_spmm), cut out of the source as it is."""
    text = ENTRY_SOURCE.read_text()
    consts = re.findall(r"^constexpr (?:int64_t|std::array<.*?>) \w+.*?;.*$", text, flags=re.M)
    ceil = re.search(r"^int64_t ceil_div\(.*\}$", text, flags=re.M).group(0)
    plan = re.search(r"^std::array<int64_t, 6> plan_spmm\(.*?^\}$", text, flags=re.M | re.S).group(0)
    return "\n".join([*consts, ceil, plan])


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a host C++ compiler")
def test_plan_spmm_cpp_source_matches_python_on_the_cpu(tmp_path):
    """csrc/spmm_entry.cu's plan_spmm, compiled alone with the host compiler (no CUDA, no torch), against
    gpu._plan_spmm over _plan_cases (the GPU test's grid, test_plan_spmm_code_cpp_matches_python). A rule edited on
    one side only fails here without a GPU."""
    source = tmp_path / "plan.cpp"
    source.write_text(PLAN_DRIVER % _entry_plan_source())
    exe = tmp_path / "plan"
    subprocess.run(["c++", "-std=c++17", "-O1", str(source), "-o", str(exe)], check=True, capture_output=True)
    cases = list(_plan_cases())
    lines = [
        f"{m} {k} {n} {nnz} {sms} {gpu.SPMM_VARIANT_CODES[variant]} {int(dtype in gpu.TC_DTYPES)} {int(tc_auto)}"
        for m, k, n, nnz, sms, variant, dtype, tc_auto in cases
    ]
    out = subprocess.run([str(exe)], input="\n".join(lines), capture_output=True, text=True, check=True).stdout
    cpp = [tuple(map(int, line.split())) for line in out.splitlines()]
    assert len(cpp) == len(cases)
    for case, got in zip(cases, cpp):
        assert got == gpu.spmm_plan_code(gpu._plan_spmm(*case)), case


# --- GPU: the runtime takes the entry ------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_linear_eager_csr_goes_through_the_cpp_entry(dtype, cpp_on, monkeypatch):
    dense, bias, layer = _csr_layer(96, 80, dtype, seed=3)
    layer = layer.cuda()

    def custom_op_called(*args, **kwargs):
        raise AssertionError("the custom op ran: the C++ entry was not taken")

    monkeypatch.setattr(ops, "spmm_csr", custom_op_called)
    for tokens in (1, 5, 70, 130):
        x = torch.randn(2, tokens, 80, device="cuda").to(dtype)
        with torch.inference_mode():
            y = layer(x)
        assert y.shape == (2, tokens, 96) and y.is_contiguous()
        ref = x.double() @ dense.double().cuda().t() + bias.double().cuda()
        assert relative_error(y, ref) <= TOLERANCE[dtype]
    x = torch.randn(1, 80, device="cuda").to(dtype)  # N = 1
    with torch.inference_mode():
        y = layer(x)
    assert relative_error(y, x.double() @ dense.double().cuda().t() + bias.double().cuda()) <= TOLERANCE[dtype]
    # x (2, tokens, 80) gives N = 2, 10, 140, 260. At N = 2 the bitmap rule does not take K = 80 < BITMAP_MIN_K, so the
    # rules choose rowwarp and the entry runs it; at N = 10 16-bit types get scatter (30% dense), which stays in
    # Python; N = 140 (bitmap's wide range, K too small for it) and 260 (size class 9, keyed -9) take the entry: with the dense
    # variant in 16-bit types (30% dense, over its floor; its code passed to the entry), else its own rule (direct)
    entries = gpu.spmm_op_entries(layer.w_values)
    assert {key[3] for key in entries} == {1, 2, 10, 140, -9}
    small = None if dtype in gpu.TC_DTYPES else gpu.SPMM_VARIANT_CODES["auto"]
    wide = gpu.SPMM_VARIANT_CODES["dense" if dtype in gpu.TC_DTYPES else "auto"]
    assert {key[3]: entry for key, entry in entries.items()} == {
        n: ("auto", small if n == 10 else wide if n in (140, -9) else 0) for n in (1, 2, 10, 140, -9)
    }


@pytest.mark.cuda
def test_entry_takes_direct_where_tc_is_possible_but_not_chosen(monkeypatch):
    """fp16 with tc on, N >= TC_MIN_N: given M, the weight's own plan decides. At 95% (below tc's and bitmap's density
    floors) it is direct, so the entry gets the call at N = 70, 128 (class 6), 130, 256 (class 7) and 300 (class 8);
    at 70% tc or bitmap is chosen and the call stays in Python. The entry's result matches float64."""
    monkeypatch.delenv(gpu.EAGER_CPP_ENV, raising=False)
    monkeypatch.delenv(gpu.TC_AUTO_ENV, raising=False)
    monkeypatch.delenv(gpu.BITMAP_AUTO_ENV, raising=False)
    monkeypatch.setenv(gpu.DENSE_AUTO_ENV, "0")  # the dense rule over this range: test_spmm_dense.py
    g = torch.Generator(device="cuda").manual_seed(8)
    m, k = 2304, 2048  # 17 rows per SM on the H100: at 95% bitmap's floor stays 10% (gpu.BITMAP_WIDE_FEW_ROWS_PER_SM)
    for sparsity, takes in ((0.95, True), (0.7, False)):
        dense = random_sparse_weight(m, k, sparsity, torch.float16, "cuda", g)
        c = encode_csr(dense)
        for n in (70, 128, 130, 256, 300):
            x = torch.randn(n, k, generator=g, device="cuda").half().t()
            plan = gpu.plan_spmm(m, k, n, c["values"].numel(), 132, "auto", torch.float16)
            code = gpu.eager_spmm_variant(c["values"], x, m=m)
            assert (code is not None) == takes == (plan.variant == "direct"), (sparsity, n, plan.variant)
            if code is not None:
                csr = (c["values"], c["row_offsets"], c["column_indices"], c["row_indices"])
                y = torch.ops.prunekit_ext.spmm_csr_auto.default(*csr, x, m, None, False, code)
                assert relative_error(y, spmm_reference64(dense, x, None, "none")) <= TOLERANCE[torch.float16], n


@pytest.mark.cuda
def test_sparse_linear_eager_csr_falls_back_for_tc_mixed_dtypes_and_gradients(cpp_on, monkeypatch):
    dense, bias, layer = _csr_layer(96, 80, torch.float16, seed=4)
    layer = layer.cuda()
    x = torch.randn(70, 80, device="cuda", dtype=torch.float16)
    monkeypatch.setenv(gpu.TC_AUTO_ENV, "1")  # N = 70 >= TC_MIN_N in fp16: the tc plan, which stays in Python
    assert gpu.eager_spmm_variant(layer.w_values, x.t()) is None
    assert gpu.eager_spmm_variant(layer.w_values, x[:1].t()) == 0
    monkeypatch.setenv(gpu.TC_AUTO_ENV, "0")
    y = layer(x.float())  # fp32 activations, fp16 weights: mixed precision through gpu.spmm_csr
    assert y.dtype == torch.float32
    assert relative_error(y, x.double() @ dense.double().cuda().t() + bias.double().cuda()) <= TOLERANCE[torch.float16]
    # mixed dtypes go to gpu.spmm_csr unasked: no decision is kept
    assert not hasattr(layer.w_values, gpu.OP_ENTRY_ATTR)
    xg = x[:3].clone().requires_grad_()
    layer(xg).sum().backward()  # needs a gradient: the differentiable custom op, not the entry
    torch.testing.assert_close(xg.grad.double(), dense.double().cuda().sum(0).expand(3, 80), rtol=2e-3, atol=2e-2)


@pytest.mark.cuda
def test_sparse_linear_takes_the_entry_where_the_density_rules_choose_rowwarp(monkeypatch):
    """fp16 at N = 4 and 16 (the bitmap and scatter rules' range): a 97%-sparse layer with K >= 1024 and M * K over
    gpu.BITMAP_SMALL_ELEMENTS gets rowwarp from the rules, so the C++ entry runs it (neither the launcher nor the custom
    op); an 80%-sparse one the bitmap entry."""
    monkeypatch.delenv(gpu.EAGER_CPP_ENV, raising=False)
    monkeypatch.delenv(gpu.BITMAP_AUTO_ENV, raising=False)

    def not_here(*args, **kwargs):
        raise AssertionError("the Python launcher or the custom op ran")

    for sparsity in (0.97, 0.8):
        g = torch.Generator().manual_seed(int(sparsity * 100))
        dense = random_sparse_weight(2048, 2048, sparsity, torch.float16, "cpu", g)
        bias = torch.randn(2048, generator=g).half()
        layer = SparseLinear(formats.encode("csr", dense), bias).cuda()
        with monkeypatch.context() as patch:
            patch.setattr(gpu, "spmm_csr", not_here)
            patch.setattr(ops, "spmm_csr", not_here)
            for n in (4, 16):
                x = torch.randn(n, 2048, device="cuda").half()
                with torch.inference_mode():
                    y = layer(x)
                ref = x.double() @ dense.double().cuda().t() + bias.double().cuda()
                assert relative_error(y, ref) <= TOLERANCE[torch.float16], (sparsity, n)
        entries = gpu.spmm_op_entries(layer.w_values)
        kinds = {key[3]: (kind, plan if kind == "auto" else "plan") for key, (kind, plan) in entries.items()}
        if sparsity > 0.9:
            assert kinds == {4: ("auto", 0), 16: ("auto", 0)}
        else:
            assert kinds == {4: ("bitmap", "plan"), 16: ("bitmap", "plan")}


@pytest.mark.cuda
def test_sparse_linear_runs_the_decode_shared_copy_through_the_entry(monkeypatch):
    """fp16 at N = 12 and 16, 4096 x 4096 at 95% (gpu.decode_stages_x, padded density between 1/30 and 1/14): the rules
    choose rowwarp with its shared-memory copy of X, the entry's own "auto" plans the same (plan_spmm_code with
    tc_auto False is the plan spmm_csr_auto runs), so the layer hands it the call, and the result matches float64."""
    monkeypatch.delenv(gpu.EAGER_CPP_ENV, raising=False)
    monkeypatch.delenv(gpu.BITMAP_AUTO_ENV, raising=False)
    g = torch.Generator().manual_seed(95)
    dense = random_sparse_weight(4096, 4096, 0.95, torch.float16, "cpu", g)
    bias = torch.randn(4096, generator=g).half()
    layer = SparseLinear(formats.encode("csr", dense), bias).cuda()
    for n in (12, 16):
        x = torch.randn(n, 4096, device="cuda").half()
        plan = gpu.plan_spmm(4096, 4096, n, layer.w_values.numel(), gpu._sm_count(x.device), "auto", torch.float16)
        if plan != gpu.SpmmPlan("rowwarp", subwarp=32, ntile=16, stage_x=True):
            pytest.skip(f"this GPU's SM count gives another plan: {plan}")
        assert gpu.eager_spmm_variant(layer.w_values, x.t(), m=4096) == gpu.SPMM_VARIANT_CODES["auto"]
        cpp = torch.ops.prunekit_ext.plan_spmm_code(
            4096, 4096, n, layer.w_values.numel(), gpu._sm_count(x.device), 0, torch.float16, False
        )
        assert cpp == [gpu.SPMM_VARIANT_CODES["rowwarp"], 32, 16, 8, 1, 1], n
        with torch.inference_mode():
            y = layer(x)
        ref = x.double() @ dense.double().cuda().t() + bias.double().cuda()
        assert relative_error(y, ref) <= TOLERANCE[torch.float16], n


def test_size_classes_hold_the_density_floors_constant():
    """The runtime and the custom op cache one eager decision per size class (gpu.eager_size_class), so inside a class
    none of the rules' density floors may change: tc's (from TC_MIN_N), bitmap's at N <= 16 and its wide one, the dense
    variant's (from DENSE_MIN_N), and scatter's range."""
    for k in (512, 768, 1024, 3072, 4096, 11008):
        seen: dict[int, tuple] = {}
        for n in range(1, 600):
            floors = (
                gpu.tc_min_density_denominator(n, k) if n >= gpu.TC_MIN_N else None,
                gpu.bitmap_min_density_denominator(n, k) if gpu.BITMAP_MIN_N <= n <= gpu.BITMAP_MAX_N else None,
                gpu.bitmap_wide_min_density_denominator(n, k)
                if gpu.BITMAP_MAX_N < n <= gpu.BITMAP_WIDE_MAX_N
                else None,
                gpu.dense_min_density_denominator(n, k) if n >= gpu.DENSE_MIN_N else None,
                gpu.SCATTER_MIN_N <= n <= gpu.SCATTER_MAX_N,
                n <= gpu.SPMV_MAX_N,
                n <= gpu.ROWWARP_MAX_N,
                gpu.DIRECT_MID_N_MIN_N <= n <= gpu.ROWWARP_MAX_N,
                gpu.decode_stages_x(n, k, 11008),
            )
            assert seen.setdefault(gpu.eager_size_class(n), floors) == floors, (k, n)


def test_custom_op_cuda_impl_sends_other_calls_to_the_launcher(monkeypatch):
    """gpu.spmm_csr_op (prunekit::spmm_csr's CUDA implementation) passes to gpu.spmm_csr, untouched, every call it
    cannot give a C++ entry: x not on CUDA, mixed dtypes, a bias of another dtype or not contiguous, an unknown
    activation, N = 0."""
    calls = []

    def launcher(*args):
        calls.append(args)
        return "launcher"

    monkeypatch.setattr(gpu, "spmm_csr", launcher)
    c = encode_csr(random_sparse_weight(8, 32, 0.7, torch.float16, "cpu"))
    csr = (c["values"], c["row_offsets"], c["column_indices"], c["row_indices"])
    x = torch.randn(32, 4).half()
    cases = [
        (x, None, "none"),  # CPU x
        (x.float(), None, "none"),
        (x, torch.randn(8), "relu"),
        (x, torch.randn(16).half()[::2], "relu"),
        (x, None, "gelu"),
        (x[:, :0], None, "none"),
    ]
    for xi, bias, act in cases:
        assert gpu.spmm_csr_op(*csr, xi, 8, bias, act) == "launcher"
    assert len(calls) == len(cases)
    assert not hasattr(c["values"], gpu.OP_ENTRY_ATTR)


def test_spmm_op_entry_keeps_its_decision_for_an_inference_tensor_weight(cpp_on, monkeypatch):
    """An inference tensor has no version counter: spmm_op_entry's written-out stamp falls back to
    tensor_cache.stamp, and the decision is still made once."""
    asked = []
    monkeypatch.setattr(gpu, "eager_bitmap_takes", lambda *args, **kwargs: False)
    monkeypatch.setattr(gpu, "eager_spmm_variant", lambda values, x, variant="auto", m=None: asked.append(m) or 3)
    with torch.inference_mode():
        c = encode_csr(random_sparse_weight(48, 40, 0.7, torch.float16, "cpu"))
        x = torch.randn(4, 40).half().t()
        got = [gpu.spmm_op_entry(c["values"], c["row_offsets"], c["column_indices"], x, 48) for _ in range(2)]
    assert c["values"].is_inference()
    assert got == [("auto", 3), ("auto", 3)] and asked == [48]
