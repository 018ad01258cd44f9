"""The rowwarp launcher's own transpose of X (csrc/spmm_rowwarp.cu, ``row_major_x``): X that is not row-major (the
runtime's ``x2d.t()``, or any other strides) is copied into a row-major ``(K, N rounded up to the tile)`` buffer by a
small kernel, and the rowwarp kernel after it starts early with programmatic dependent launch (sm_90).

GPU only (``cuda``): every result against a float64 reference with the output poisoned first, for the three dtypes,
N from 2 to 64 (each rowwarp tile, N not a multiple of it), odd K, the shared-memory variant, with the transpose and
PDL on and off (``$PRUNEKIT_ROWWARP_TRANSPOSE`` / ``$PRUNEKIT_ROWWARP_PDL``, read at each call); through the raw
operator, ``gpu.spmm_csr`` and the eager C++ entry with its ROWS flag; inside a CUDA graph; and, by torch.profiler,
that the transpose kernel replaces torch's copy.
"""

from __future__ import annotations

import pytest
import torch

from prunekit.kernels import gpu
from prunekit.kernels.layout import new_spmm_output
from prunekit.kernels.testing import TOLERANCE, encode_csr, random_sparse_weight, relative_error, spmm_reference64

pytestmark = pytest.mark.cuda
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TRANSPOSE_ENV = "PRUNEKIT_ROWWARP_TRANSPOSE"
PDL_ENV = "PRUNEKIT_ROWWARP_PDL"
# (M, K, N, sparsity): every N tile of rowwarp (4, 8, 16) with N below, at and past it, odd K (the transpose's last
# block partly idle), one K past 256 threads * a few blocks, M = 1, and 64 columns (four 16-column tiles).
SHAPES = [
    (1, 7, 2, 0.5),
    (33, 45, 3, 0.7),
    (40, 100, 5, 0.6),
    (77, 203, 8, 0.8),
    (64, 300, 12, 0.5),
    (50, 1031, 16, 0.9),
    (130, 301, 17, 0.9),
    (19, 77, 33, 0.7),
    (70, 513, 64, 0.95),
]


@pytest.fixture(autouse=True)
def _loaded():
    gpu._ensure_loaded()


def _case(m, k, n, sparsity, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dense = random_sparse_weight(m, k, sparsity, dtype, "cuda", g, empty_rows=min(2, m - 1), single_rows=min(2, m - 1))
    x2d = torch.randn(n, k, generator=g, device="cuda").to(dtype)
    bias = torch.randn(m, generator=g, device="cuda").to(dtype)
    return dense, encode_csr(dense), x2d, bias


def _layouts(x2d: torch.Tensor) -> dict[str, torch.Tensor]:
    """(K, N) activations that are not row-major: the runtime's x2d.t() and every other column of a wider buffer."""
    k, n = x2d.shape[1], x2d.shape[0]
    wide = torch.randn(2 * n, k, device=x2d.device).to(x2d.dtype)
    wide[::2] = x2d
    return {"xT": x2d.t(), "xstrided": wide[::2].t()}


def _poisoned(x: torch.Tensor, m: int) -> torch.Tensor:
    y = new_spmm_output(x, m)
    y.fill_(float("nan"))
    return y


@pytest.mark.parametrize("settings", ["default", "no_pdl", "torch_copy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n,sparsity", SHAPES)
def test_rowwarp_on_transposed_x_matches_float64(settings, dtype, m, k, n, sparsity, monkeypatch):
    if settings == "no_pdl":
        monkeypatch.setenv(PDL_ENV, "0")
    if settings == "torch_copy":
        monkeypatch.setenv(TRANSPOSE_ENV, "0")
    dense, c, x2d, bias = _case(m, k, n, sparsity, dtype, m + n)
    op = torch.ops.prunekit_ext.spmm_csr_rowwarp.default
    cases = [(layout, x, "relu", bias) for layout, x in _layouts(x2d).items()] + [("xT", x2d.t(), "none", None)]
    for layout, x, activation, b in cases:
        ref = spmm_reference64(dense, x, b, activation)
        for subwarp in (8, 32):
            for stage_x in (False, True):
                ntile = 4 if n <= 4 else 8 if n <= 8 else 16
                y = _poisoned(x, m)
                op(*c.values(), x, y, b, activation == "relu", subwarp, ntile, stage_x)
                torch.cuda.synchronize()
                err = relative_error(y, ref)
                case = f"{settings} {layout} sw{subwarp} nt{ntile} stage{int(stage_x)} {dtype} {m}x{k}x{n}"
                assert err <= TOLERANCE[dtype], f"{case}: rel err {err:.2e}"
        # the launcher (gpu.spmm_csr) and the C++ entry with the ROWS flag, as the runtime calls them
        y = _poisoned(x, m)
        gpu.spmm_csr(**c, x=x, m=m, bias=b, activation=activation, variant="rowwarp", out=y)
        assert relative_error(y, ref) <= TOLERANCE[dtype], f"spmm_csr {settings} {layout} {dtype} {m}x{k}x{n}"
        if layout == "xT":
            entry = torch.ops.prunekit_ext.spmm_csr_auto.default
            code = gpu.SPMM_VARIANT_CODES["rowwarp"] | gpu.SPMM_ROWS
            block = torch.full((n * m,), float("nan"), dtype=dtype, device="cuda")
            del block  # the entry's (N, M) output reuses this freed, poisoned block
            yt = entry(*c.values(), x2d, m, b, activation == "relu", code)
            torch.cuda.synchronize()
            assert yt.shape == (n, m)
            assert relative_error(yt.t(), ref) <= TOLERANCE[dtype], f"entry {settings} {dtype} {m}x{k}x{n}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_rowwarp_shared_memory_variant_reads_the_transposed_copy(dtype):
    """M = 16 * SMs + 3 rows at N = 40: ``auto`` stages X in shared memory (rowwarp_smem_kernel) from the copy."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m, k, n = 16 * sms + 3, 96, 40
    dense, c, x2d, bias = _case(m, k, n, 0.5, dtype, 7)
    plan = gpu.plan_spmm(m, k, n, c["values"].numel(), sms, "auto", dtype)
    assert plan.variant == "rowwarp" and plan.stage_x
    x = x2d.t()
    y = _poisoned(x, m)
    gpu.spmm_csr(**c, x=x, m=m, bias=bias, activation="relu", variant="rowwarp", out=y)
    torch.cuda.synchronize()
    err = relative_error(y, spmm_reference64(dense, x, bias, "relu"))
    assert err <= TOLERANCE[dtype], f"rel err {err:.2e}"


def test_rowwarp_transpose_in_a_cuda_graph_matches_eager():
    """Programmatic dependent launch inside a captured graph: replays give the eager result for new inputs."""
    m, k, n = 300, 1031, 16
    dense, c, x2d, _ = _case(m, k, n, 0.9, torch.float16, 3)
    entry = torch.ops.prunekit_ext.spmm_csr_auto.default
    code = gpu.SPMM_VARIANT_CODES["auto"] | gpu.SPMM_ROWS  # rowwarp, X gathered from global memory at N = 16
    static_x = x2d.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        entry(*c.values(), static_x, m, None, False, code)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = entry(*c.values(), static_x, m, None, False, code)
    for seed in range(3):
        static_x.copy_(torch.randn(n, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        ref = spmm_reference64(dense, static_x.t(), None, "none")
        assert relative_error(static_y.t(), ref) <= TOLERANCE[torch.float16], seed


def _kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if not e.key.startswith("cuda")]


def test_the_transpose_kernel_replaces_torchs_copy(monkeypatch):
    m, k, n = 512, 1024, 16
    _, c, x2d, _ = _case(m, k, n, 0.98, torch.float16, 5)
    entry = torch.ops.prunekit_ext.spmm_csr_auto.default
    code = gpu.SPMM_VARIANT_CODES["auto"] | gpu.SPMM_ROWS  # rowwarp, X gathered from global memory at N = 16
    names = _kernel_names(lambda: entry(*c.values(), x2d, m, None, False, code))
    assert any("rowwarp_transpose_kernel" in name for name in names), names
    assert not any("copy" in name for name in names), names
    assert sum("spmm_rowwarp_kernel" in name for name in names) == 1, names
    monkeypatch.setenv(TRANSPOSE_ENV, "0")
    names = _kernel_names(lambda: entry(*c.values(), x2d, m, None, False, code))
    assert not any("rowwarp_transpose_kernel" in name for name in names), names
    assert any("copy" in name for name in names), names
    # row-major X is read as it is: no copy of either kind
    monkeypatch.delenv(TRANSPOSE_ENV)
    xr = x2d.t().contiguous()
    op_names = _kernel_names(lambda: gpu.spmm_csr(**c, x=xr, m=m, variant="rowwarp"))
    assert not any("rowwarp_transpose_kernel" in name or "copy" in name for name in op_names), op_names
