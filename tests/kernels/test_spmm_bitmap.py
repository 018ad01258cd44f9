"""Decode bitmap SpMM on the GPU (``spmm_bitmap_plan.py`` + ``csrc/structured/nm24/nm24_decode.cu`` variant 2,
``gpu.spmm_csr(..., variant="bitmap")``).

CPU (CI): the launcher's plan and its refusals (the runtime's eager route to the C++ entry ``bitmap_linear``, through
``gpu.spmm_op_entry``, is tested on the CPU in ``test_spmm_entry.py``). CUDA (``@pytest.mark.cuda``): the kernel against float64 with
NaN-poisoned outputs on the edge-case shapes (empty rows, one non-zero, M = 1, odd K and N), N = 1..16, both X
layouts, fp16/bf16, bias + ReLU, one and several k-chunks reduced in clusters and with atomics (more than 16 chunks,
or ``$PRUNEKIT_NM24_CLUSTER=0``), N > 16 (blocks of 64 tokens over grid z) on the same cases, repeated calls (the workspace must come back zero), a fully dense and an all-zero
weight, and CUDA-graph replay. The format's own CPU checks are in ``test_spmm_bitmap_plan.py``.
"""

from __future__ import annotations

import pytest
import torch

from prunekit import formats
from prunekit.deploy.runtime.sparse_linear import SparseLinear
from prunekit.kernels import gpu, nm24, ops
from prunekit.kernels.layout import new_spmm_output
from prunekit.kernels.spmm_bitmap_plan import get_bitmap_plan
from prunekit.kernels.testing import (
    SPMM_EDGE_CASES,
    TOLERANCE,
    encode_csr,
    random_sparse_weight,
    random_spmm_case,
    relative_error,
    spmm_reference64,
)

pytestmark = pytest.mark.usefixtures("ring_kernel")  # conftest.py: the lean kernel only where a test sets it

DTYPES = [torch.float16, torch.bfloat16]
SHAPES = [(m, k, n, sp, e) for (m, k, sp, e), n in zip(SPMM_EDGE_CASES, (1, 5, 3, 16, 9, 16, 1, 8, 13), strict=True)]
# the same edge cases at N > 16 (blocks of 64 tokens; the last group partial, or exactly full at 64 and 128)
WIDE_SHAPES = [
    (m, k, n, sp, e) for (m, k, sp, e), n in zip(SPMM_EDGE_CASES, (17, 64, 65, 100, 128, 33, 129, 200, 71), strict=True)
]


def _run(c, x, m, bias, activation, out=None):
    return gpu.spmm_csr(
        c["values"],
        c["row_offsets"],
        c["column_indices"],
        c["row_indices"],
        x,
        m,
        bias,
        activation,
        variant="bitmap",
        out=out,
    )


def _clean(c, m, k) -> bool:
    plan = get_bitmap_plan(c["values"], c["row_offsets"], c["column_indices"], m, k)
    return int(plan.counters.abs().sum()) == 0 and float(plan.ws.abs().sum()) == 0.0


def _check_edge_case(dtype, m, k, n, sparsity, empty_rows, layout):
    """One edge case against float64, with and without bias + ReLU: a NaN-poisoned (M, N) output twice (the second
    call finds the workspace the first one left, which must be zero again), then the launcher's own output layout."""
    dense, c, x2d, bias = random_spmm_case(m, k, n, sparsity, empty_rows, dtype, m + k + n, "cuda")
    x = x2d.t() if layout == "transposed" else x2d.t().contiguous()
    for b, activation in ((bias, "relu"), (None, "none")):
        ref = spmm_reference64(dense, x, b, activation)
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        for _ in range(2):
            out.fill_(float("nan"))
            y = _run(c, x, m, b, activation, out)
            torch.cuda.synchronize()
            assert relative_error(y, ref) <= TOLERANCE[dtype]
            assert _clean(c, m, k)
        y = _run(c, x, m, b, activation)
        assert relative_error(y, ref) <= TOLERANCE[dtype]


def _check_every_n(dtype, density, seed):
    """A (1000, 2100) weight of this density (63 strips: idle warps in the last block of 8; 136 k-steps) against
    float64 at every N from 1 to 16, bias + ReLU, NaN-poisoned outputs; the workspace left zero."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    m, k = 1000, 2100
    dense = random_sparse_weight(m, k, 1.0 - density, dtype, "cuda", g, empty_rows=9, single_rows=3)
    c = encode_csr(dense)
    bias = torch.randn(m, generator=g, device="cuda").to(dtype)
    for n in range(1, 17):
        x = torch.randn(n, k, generator=g, device="cuda").to(dtype).t()
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        y = _run(c, x, m, bias, "relu", out)
        torch.cuda.synchronize()
        assert relative_error(y, spmm_reference64(dense, x, bias, "relu")) <= TOLERANCE[dtype], (density, n)
        assert _clean(c, m, k)


def _set_cluster(monkeypatch, cluster):
    """None: the defaults (clusters up to 16 k-chunks; more: atomics, finished by the second kernel on sm_90 at
    N <= 16); "0": atomics with fences and counters ($PRUNEKIT_NM24_CLUSTER=0, $PRUNEKIT_NM24_FINISH=0); "finish":
    atomics finished by the second kernel at N <= 16 ($PRUNEKIT_NM24_CLUSTER=0, $PRUNEKIT_NM24_FINISH=1)."""
    for var in (nm24.CLUSTER_ENV, nm24.FINISH_ENV):
        monkeypatch.delenv(var, raising=False)
    if cluster is not None:
        monkeypatch.setenv(nm24.CLUSTER_ENV, "0")
        monkeypatch.setenv(nm24.FINISH_ENV, "1" if cluster == "finish" else "0")


def _chunk_case(monkeypatch, chunk, cluster, seed):
    """K = 2500 (160 k-steps) and M = 300 at 80%, with $PRUNEKIT_NM24_CHUNK set (None: unset) and the k-chunk
    reduction as :func:`_set_cluster` takes it: the weight, its CSR and a bias."""
    _set_cluster(monkeypatch, cluster)
    for var, value in ((nm24.CHUNK_ENV, chunk),):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    g = torch.Generator(device="cuda").manual_seed(seed)
    dense = random_sparse_weight(300, 2500, 0.8, torch.float16, "cuda", g, empty_rows=5, single_rows=2)
    return dense, encode_csr(dense), torch.randn(300, generator=g, device="cuda").half(), g


# ----------------------------------------------------------------------------------------------------------- CPU


def test_bitmap_ring_setting(monkeypatch):
    monkeypatch.delenv(gpu.BITMAP_RING_ENV, raising=False)
    assert gpu.bitmap_ring() == gpu.BITMAP_RING
    monkeypatch.setenv(gpu.BITMAP_RING_ENV, "5")
    assert gpu.bitmap_ring() == 5
    monkeypatch.setenv(gpu.BITMAP_RING_ENV, "4")
    with pytest.raises(ValueError, match="bitmap decode ring"):
        gpu.bitmap_ring()


def test_plan_spmm_bitmap_rule(monkeypatch):
    monkeypatch.delenv(gpu.BITMAP_AUTO_ENV, raising=False)
    monkeypatch.delenv(gpu.SCATTER_AUTO_ENV, raising=False)

    def auto(m, k, n, sparsity, dtype=torch.float16):
        # nnz_padded about 1% above the non-zeros, as the CSR padding makes it in the benchmark
        return gpu.plan_spmm(m, k, n, int((1 - sparsity) * m * k * 1.01), 132, "auto", dtype).variant

    # The H100 rule with K >= 1024: rowwarp at N = 1; bitmap at N 2-8 up to 90% sparsity, at N 9-16 up to 95% (up to
    # 99% where M * K <= BITMAP_SMALL_ELEMENTS), and up to 90% where rowwarp's shared copy of X can pay
    # (decode_stages_x: 4096 x 4096 and 11008 x 4096); rowwarp above. The scatter rule (or rowwarp) where K < 1024.
    sparsities = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
    for m, k in ((4096, 4096), (11008, 4096), (4096, 11008), (768, 3072)):
        assert [auto(m, k, 1, s) for s in sparsities] == ["rowwarp"] * 7, (m, k)
        for n in (2, 4, 8):
            assert [auto(m, k, n, s) for s in sparsities] == ["bitmap"] * 4 + ["rowwarp"] * 3, (m, k, n)
        small = (m, k) == (768, 3072)  # M * K <= BITMAP_SMALL_ELEMENTS, M <= 768: bitmap at N 9-16 down to 1% density
        staged = k == 4096  # K x 16 fp16 tokens fit in 227 KB, M >= 31 rows per SM
        for n in (9, 12, 15, 16):
            want = ["bitmap"] * 7 if small else ["bitmap"] * (4 if staged else 5) + ["rowwarp"] * (3 if staged else 2)
            assert [auto(m, k, n, s) for s in sparsities] == want, (m, k, n)
            assert gpu.decode_stages_x(n, k, m) == staged, (m, k, n)
    assert [auto(4096, 4096, n, 0.8) for n in (1, 2, 8, 9, 16, 17)] == ["rowwarp"] + ["bitmap"] * 5
    assert [gpu.bitmap_min_density_denominator(n) for n in (2, 8, 9, 15, 16)] == [10, 10, 20, 20, 20]
    assert [gpu.bitmap_min_density_denominator(16, 4096, m) for m in (4091, 4092)] == [20, 14]  # 31 rows per SM
    assert [gpu.bitmap_min_density_denominator(9, k, 4096) for k in (7264, 7265)] == [14, 20]  # 227 KB of X
    # K = 768: rowwarp (the SpMV kernel's 4-token tile) at N <= 4, bitmap from N = 5 (the lean kernel from N = 9 too);
    # K = 512: rowwarp, and the scatter rule from N = 9
    assert [auto(3072, 768, n, 0.8) for n in (2, 4, 5, 8, 9, 16)] == ["rowwarp"] * 2 + ["bitmap"] * 4
    # small weights (M * K <= BITMAP_SMALL_ELEMENTS) at N 9-16: bitmap down to 1% (twenty-second session)
    assert [auto(3072, 768, n, 0.98) for n in (9, 16)] == ["bitmap", "bitmap"]
    assert [auto(768, 3072, n, s) for n in (9, 16) for s in (0.98, 0.99)] == ["bitmap"] * 4
    assert [auto(3072, 768, n, 0.995) for n in (9, 16)] == ["rowwarp"] * 2  # under 1%
    assert [auto(3072, 768, n, 0.98) for n in (4, 8)] == ["rowwarp"] * 2  # not at N <= 8
    # 4.2M elements; 3.1M but neither side 768 (1024 x 1024 and 2048 x 1536: rowwarp was faster); 768 x 5120 over 3M
    assert [auto(m, k, 16, 0.98) for m, k in ((2048, 2048), (2048, 1536), (1024, 1024), (768, 5120))] == ["rowwarp"] * 4
    assert [auto(m, k, 16, 0.98) for m, k in ((4096, 768), (768, 2048))] == ["bitmap"] * 2
    assert gpu.bitmap_min_density_denominator(16, 768, 3072) == gpu.BITMAP_SMALL_MIN_DENSITY_DENOMINATOR == 100
    assert (
        gpu.bitmap_min_density_denominator(16, 2048, 2048) == 20 and gpu.bitmap_min_density_denominator(8, 768, 4) == 20
    )
    assert [auto(3072, 768, n, 0.95) for n in (4, 5, 8)] == ["rowwarp", "bitmap", "bitmap"]  # 5% at N 5-8, K < 1024
    assert [auto(3072, 768, 8, s) for s in (0.96, 0.98)] == ["rowwarp"] * 2
    assert [auto(4096, 4096, 8, s) for s in (0.9, 0.95)] == ["bitmap", "rowwarp"]
    assert gpu.bitmap_min_density_denominator(8, 768) == 20 and gpu.bitmap_min_density_denominator(4, 768) == 10
    assert auto(3072, 512, 4, 0.8) == "rowwarp"
    assert auto(3072, 512, 16, 0.8) == "scatter"
    assert auto(4096, 4096, 16, 0.8, torch.float32) == "rowwarp"
    assert auto(4096, 4096, 16, 0.8, torch.bfloat16) == "bitmap"
    assert gpu.eager_spmm_code("auto", torch.float16, torch.float16, 16, tc_auto=False) is None
    monkeypatch.setenv(gpu.BITMAP_AUTO_ENV, "0")
    assert auto(4096, 4096, 16, 0.8) == "scatter"


def test_plan_spmm_decode_shared_copy_of_x(monkeypatch):
    """N 9-16, fp16 / bf16, where gpu.decode_stages_x (the thirty-second session's H100 rule): rowwarp stages X in
    shared memory from padded density 1/30 up to bitmap's floor of 1/14 for rows of 32-lane subwarps, for any rows from
    100 rows per SM (the thirty-third session's change; was 2 K padded non-zeros per SM), and gathers it from global
    memory otherwise; fp32, and shapes where X does not fit or M gives fewer than 31 rows per SM, keep the global
    gathers."""
    monkeypatch.delenv(gpu.BITMAP_AUTO_ENV, raising=False)

    def plan(m, k, n, nnz, dtype=torch.float16):
        return gpu.plan_spmm(m, k, n, nnz, 132, "auto", dtype)

    m, k = 4096, 4096
    low = -(-m * k // gpu.DECODE_STAGE_X_MIN_DENSITY_DENOMINATOR)  # the least nnz at density 1/30
    high = -(-m * k // gpu.BITMAP_MIN_DENSITY_DENOMINATOR_STAGED)  # bitmap from here
    for n in (9, 12, 16):
        assert plan(m, k, n, low) == gpu.SpmmPlan("rowwarp", subwarp=32, ntile=16, stage_x=True), n
        assert plan(m, k, n, low - 1).stage_x is False, n
        assert plan(m, k, n, high - 1, torch.bfloat16).stage_x is True, n
        assert plan(m, k, n, high).variant == "bitmap", n
        assert plan(m, k, n, low, torch.float32).stage_x is False, n
    assert plan(m, k, 8, low).variant == "rowwarp" and plan(m, k, 8, low).stage_x is False  # N <= 8: not this rule
    assert plan(4091, k, 16, low).stage_x is False  # 30.99 rows per SM
    # 98%: rows of about 85 padded entries (8-lane subwarps) get the copy only from 100 rows per SM
    for rows, staged in ((14336, True), (11008, False), (4096, False)):
        p98 = plan(rows, k, 16, rows * 88)
        assert (p98.subwarp, p98.stage_x) == (8, staged), rows
    floor = gpu.DECODE_STAGE_X_SHORT_ROWS_MIN_ROWS_PER_SM * 132
    for per_row in (40, 88, 128):  # 99%, 98% and 97% (density just under 1/30): the rows per SM decide
        assert plan(floor, k, 16, floor * per_row).stage_x is True, per_row
        assert plan(floor - 1, k, 16, (floor - 1) * per_row).stage_x is False, per_row
    assert plan(m, 7265, 16, m * 7265 // 25) == gpu.SpmmPlan("rowwarp", subwarp=32, ntile=16, stage_x=False)  # > 227 KB


def test_plan_spmm_direct_mid_n_rule(monkeypatch):
    """N 33-64, fp16/bf16 (the thirty-first session's H100 rules): direct where the padded density is at most 1/16 and M
    gives at least 16 rows per SM, over bitmap and rowwarp; at N 17-32 from DIRECT_LOW_N_MIN_ROWS_PER_SM (48) rows per
    SM; never for fp32, at N <= 16 or with the rules off ($PRUNEKIT_SPMM_DIRECT_MID=0), where eager_spmm_code hands
    the call back to the entry's own rule."""
    for env in (gpu.BITMAP_AUTO_ENV, gpu.DENSE_AUTO_ENV, gpu.TC_AUTO_ENV, gpu.DIRECT_MID_N_AUTO_ENV):
        monkeypatch.delenv(env, raising=False)

    def auto(m, k, n, nnz, dtype=torch.float16, sms=132):
        return gpu.plan_spmm(m, k, n, nnz, sms, "auto", dtype).variant

    m, k = 4096, 4096
    edge = m * k // gpu.DIRECT_MID_N_MIN_SPARSITY_DENOMINATOR  # padded density 1/16 exactly
    for n in (33, 48, 64):
        assert auto(m, k, n, edge) == "direct", n
        assert auto(m, k, n, edge + 1) == "bitmap", n  # above 1/16: the wide bitmap rule (>= 5%)
        assert auto(m, k, n, m * k // 50, torch.bfloat16) == "direct", n  # 98%
        assert auto(m, k, n, m * k // 50, torch.float32) == "rowwarp", n
    assert auto(m, k, 32, m * k // 50) == "rowwarp"  # N 17-32: only from 48 rows per SM
    assert auto(m, k, 65, m * k // 50) == "direct"  # direct from TC_MIN_N anyway
    big = gpu.DIRECT_LOW_N_MIN_ROWS_PER_SM * 132
    assert [auto(big, k, n, big * k // 50) for n in (16, 17, 32, 33)] == ["rowwarp", "direct", "direct", "direct"]
    assert auto(big, k, 24, big * k // 20) == "direct"  # 95%
    assert auto(big, k, 24, big * k // 10) == "bitmap"  # 90%
    assert auto(big - 1, k, 24, (big - 1) * k // 50) == "rowwarp"
    assert auto(big, k, 24, big * k // 50, torch.float32) == "rowwarp"
    rows = gpu.DIRECT_MID_N_MIN_ROWS_PER_SM * 132
    assert auto(rows, k, 64, rows * k // 50) == "direct"
    assert auto(rows - 1, k, 64, (rows - 1) * k // 50) == "rowwarp"
    assert auto(rows, k, 64, rows * k // 50, sms=133) == "rowwarp"
    half = torch.float16
    assert gpu.eager_spmm_code("auto", half, half, 48, tc_auto=False) is None  # the rule reads the density
    assert gpu.eager_spmm_code("auto", torch.float32, torch.float32, 48, tc_auto=False) == 0
    monkeypatch.setenv(gpu.DIRECT_MID_N_AUTO_ENV, "0")
    assert auto(m, k, 64, m * k // 50) == "rowwarp"
    monkeypatch.setenv(gpu.BITMAP_AUTO_ENV, "0")
    assert gpu.eager_spmm_code("auto", half, half, 48, tc_auto=False) == 0


def test_plan_spmm_bitmap_wide_rule(monkeypatch):
    """N 17-256 (the H100 rule, fourteenth to sixteenth sessions): bitmap at density >= 10% with K >= 768 (N 17-64
    with K >= 1024: >= 5%, and from N = 65 where M gives fewer than 16 rows per SM; from N = 65 with K < 1024: >= 1/6);
    rowwarp up to N = 64 and direct or tc above where it does not apply; never past N = 256, never for fp32."""
    monkeypatch.delenv(gpu.BITMAP_AUTO_ENV, raising=False)
    monkeypatch.setenv(gpu.DENSE_AUTO_ENV, "0")  # the dense rule, which takes over from N = 65: test_spmm_dense.py
    monkeypatch.delenv(gpu.TC_AUTO_ENV, raising=False)

    def auto(m, k, n, sparsity, dtype=torch.float16):
        return gpu.plan_spmm(m, k, n, int((1 - sparsity) * m * k * 1.01), 132, "auto", dtype).variant

    for m, k in ((4096, 4096), (11008, 4096), (4096, 11008), (768, 3072)):
        for n in (17, 32, 64, 65, 128, 256):
            assert [auto(m, k, n, s) for s in (0.5, 0.7, 0.8, 0.9)] == ["bitmap"] * 4, (m, k, n)
            # 95%: the mid-N direct rules (test_plan_spmm_direct_mid_n_rule) from N = 33 with M >= 16 rows per SM, from
            # N = 17 with 48 (6336 rows)
            low = n < gpu.DIRECT_MID_N_MIN_N and m < gpu.DIRECT_LOW_N_MIN_ROWS_PER_SM * 132
            assert (auto(m, k, n, 0.95) == "bitmap") == (low or m == 768), (m, k, n)
            assert auto(m, k, n, 0.98) != "bitmap", (m, k, n)
        assert auto(m, k, 257, 0.8) != "bitmap"
        assert auto(m, k, 64, 0.8, torch.float32) == "rowwarp"
        assert auto(m, k, 128, 0.8, torch.bfloat16) == "bitmap"
    # K = 768: at 90% up to N = 64 only, at 80% up to 256; K = 512: never
    assert [auto(3072, 768, n, 0.9) for n in (17, 64, 65, 256)] == ["bitmap"] * 2 + ["direct"] * 2
    assert [auto(3072, 768, n, 0.8) for n in (17, 64, 65, 256)] == ["bitmap"] * 4
    assert [auto(3072, 768, n, 0.95) for n in (17, 64)] == ["rowwarp", "direct"]
    pairs = ((64, 768), (65, 768), (65, 1024), (17, 1024), (64, 4096))
    assert [gpu.bitmap_wide_min_density_denominator(n, k) for n, k in pairs] == [10, 6, 10, 20, 20]
    assert auto(3072, 512, 32, 0.8) == "rowwarp"
    assert auto(4096, 4096, 32, 0.95) == "bitmap"
    assert auto(4096, 4096, 32, 0.98) == "rowwarp"
    assert auto(4096, 4096, 128, 0.95) == "direct"
    # few rows per SM (768 / 132): bitmap at 95% from TC_MIN_N too, not at 98%; K < BITMAP_MIN_K keeps its floor
    assert [auto(768, 3072, n, 0.95) for n in (128, 256)] == ["bitmap"] * 2
    assert auto(768, 3072, 128, 0.98) != "bitmap"
    assert gpu.bitmap_wide_min_density_denominator(128, 3072, 768) == 20
    assert gpu.bitmap_wide_min_density_denominator(128, 3072, 4096) == 10
    assert gpu.bitmap_wide_min_density_denominator(128, 768, 768) == 6
    monkeypatch.setenv(gpu.BITMAP_AUTO_ENV, "0")
    assert [auto(4096, 4096, n, 0.8) for n in (32, 128)] == ["rowwarp", "direct"]


def test_plan_spmm_bitmap_is_forced_only():
    plan = gpu.plan_spmm(4096, 4096, 16, 1 << 22, 132, "bitmap", torch.float16)
    assert plan.variant == "bitmap"
    assert gpu.spmm_plan_code(plan) == (gpu.SPMM_VARIANT_CODES["bitmap"], 32, 16, 8, 1, 1)
    assert gpu.eager_spmm_code("bitmap", torch.float16, torch.float16, 16, tc_auto=False) is None


# ----------------------------------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n,sparsity,empty_rows", SHAPES)
@pytest.mark.parametrize("layout", ["transposed", "row_major"])
def test_bitmap_kernel_matches_float64(dtype, m, k, n, sparsity, empty_rows, layout):
    _check_edge_case(dtype, m, k, n, sparsity, empty_rows, layout)


@pytest.mark.cuda
def test_lean_bitmap_kernel_default_rule(monkeypatch):
    """$PRUNEKIT_NM24_LEAN unset: the lean kernel takes bitmap calls with K <= nm24.LEAN_MAX_K at N <= 16 (not at
    larger K); "0" none. (An invalid $PRUNEKIT_NM24_LEAN_WARPS raises only in the lean kernels.) Then each
    call again with the launcher's warps, against float64."""
    for k in (nm24.LEAN_MAX_K - 24, nm24.LEAN_MAX_K + 76):
        dense, c, x2d, bias = random_spmm_case(96, k, 16, 0.85, 4, torch.float16, 9, "cuda")
        for setting in (None, "0"):
            if setting is None:
                monkeypatch.delenv(nm24.LEAN_ENV, raising=False)
            else:
                monkeypatch.setenv(nm24.LEAN_ENV, setting)
            for n in (2, 8, 9, 16):
                monkeypatch.setenv(nm24.LEAN_WARPS_ENV, "3")
                if setting is None and k <= nm24.LEAN_MAX_K:
                    with pytest.raises(RuntimeError, match="PRUNEKIT_NM24_LEAN_WARPS"):
                        _run(c, x2d[:n].t(), 96, bias, "relu")
                else:
                    _run(c, x2d[:n].t(), 96, bias, "relu")
                monkeypatch.delenv(nm24.LEAN_WARPS_ENV)
                y = _run(c, x2d[:n].t(), 96, bias, "relu")
                ref = spmm_reference64(dense, x2d[:n].t(), bias, "relu")
                assert relative_error(y, ref) <= TOLERANCE[torch.float16], (k, setting, n)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "warps"), [(torch.float16, None), (torch.bfloat16, None), (torch.float16, "1"), (torch.float16, "2"),
                         (torch.float16, "4"), (torch.float16, "6"), (torch.float16, "8")],
)  # fmt: skip
def test_lean_bitmap_kernel_matches_float64(dtype, warps, monkeypatch):
    """The lean decode kernel on bitmap plans ($PRUNEKIT_NM24_LEAN=1; warps per strip from the launcher's rule or
    forced): first that it takes the N <= 16 calls, through the op and the layer's C++ entry (an invalid warps
    setting, read only by the lean kernels, raises; so does a forced two strips per block, which it does not have),
    then the edge cases in both X layouts and an X whose base is 4- but not 8-byte aligned (NaN-poisoned outputs,
    bias + ReLU, the workspace left untouched), every N 1..16 at densities 1.0 / 0.2 / 0.02 / 0.0, and the runtime's
    layer."""
    monkeypatch.setenv(nm24.LEAN_ENV, "1")
    dense, c, x2d, bias = random_spmm_case(200, 1000, 16, 0.8, 3, dtype, 7, "cuda")
    layer = SparseLinear(formats.encode("csr", dense.cpu()), bias.cpu()).cuda()
    for bad in ("3", "4x2"):
        monkeypatch.setenv(nm24.LEAN_WARPS_ENV, bad)
        for n in (1, 16):
            with pytest.raises(RuntimeError, match="PRUNEKIT_NM24_LEAN_WARPS"):
                _run(c, x2d[:n].t(), 200, bias, "relu")
        with pytest.raises(RuntimeError, match="PRUNEKIT_NM24_LEAN_WARPS"), torch.inference_mode():
            layer(x2d[:8])  # the layer's bitmap entry (prunekit_nm24::bitmap_linear) at N = 8
        assert gpu.spmm_op_entries(layer.w_values)[(dtype, False, 200, 8)][0] == "bitmap"
    if warps is None:
        monkeypatch.delenv(nm24.LEAN_WARPS_ENV)
    else:
        monkeypatch.setenv(nm24.LEAN_WARPS_ENV, warps)
    for m, k, n, sparsity, empty_rows in SHAPES:
        for layout in ("transposed", "row_major"):
            _check_edge_case(dtype, m, k, n, sparsity, empty_rows, layout)
    x4 = torch.randn(16, 1000 + 4, device="cuda").to(dtype)[:, 2:1002]  # base 4 bytes past an 8-byte boundary
    assert x4.data_ptr() % 8 == 4
    out = torch.full((200, 16), float("nan"), dtype=dtype, device="cuda")
    y = _run(c, x4.t(), 200, bias, "relu", out)
    assert relative_error(y, spmm_reference64(dense, x4.t(), bias, "relu")) <= TOLERANCE[dtype]
    for i, density in enumerate((1.0, 0.2, 0.02, 0.0)):
        _check_every_n(dtype, density, seed=5 + i)
    dense = random_sparse_weight(300, 4100, 0.85, dtype, "cpu", torch.Generator().manual_seed(2))
    layer = SparseLinear(formats.encode("csr", dense), torch.randn(300).to(dtype)).cuda()
    for n in (2, 16):
        x = torch.randn(n, 4100, device="cuda").to(dtype)
        with torch.inference_mode():
            y = layer(x)
        ref = x.double() @ dense.double().cuda().t() + layer.bias.double()
        assert relative_error(y, ref) <= TOLERANCE[dtype], n
        assert gpu.spmm_op_entries(layer.w_values)[(dtype, False, 300, n)][0] == "bitmap", n


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", [1.0, 0.5, 0.2, 0.1, 0.02, 0.0])
def test_bitmap_kernel_every_n_and_density(dtype, density):
    _check_every_n(dtype, density, seed=3)


@pytest.mark.cuda
@pytest.mark.parametrize("ring", ["3", "5"])
@pytest.mark.parametrize(
    "chunk,cluster",
    [("8", None), ("8", "0"), ("8", "finish"), ("16", None), ("16", "0"), ("16", "finish"), ("64", None)],
)
def test_bitmap_kernel_k_chunks_in_clusters_and_atomics(chunk, cluster, ring, monkeypatch):
    """K = 2500 is 160 k-steps: chunk 8 gives 20 chunks (more than a cluster: atomics), 16 gives 10 (a non-portable
    cluster), 64 gives 3; $PRUNEKIT_NM24_CLUSTER=0 forces the atomics. Rings of 3 and 5 batches."""
    monkeypatch.setenv(gpu.BITMAP_RING_ENV, ring)
    dense, c, bias, g = _chunk_case(monkeypatch, chunk, cluster, 11)
    m, k = dense.shape
    for n in (1, 9, 16):
        x = torch.randn(n, k, generator=g, device="cuda").half().t()
        ref = spmm_reference64(dense, x, bias, "relu")
        out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
        for _ in range(2):
            out.fill_(float("nan"))
            y = _run(c, x, m, bias, "relu", out)
            torch.cuda.synchronize()
            assert relative_error(y, ref) <= TOLERANCE[torch.float16], (n, chunk, cluster)
            assert _clean(c, m, k)


@pytest.mark.cuda
@pytest.mark.parametrize("n,cluster", [(16, None), (16, "finish"), (100, None), (100, "0")])
def test_bitmap_kernel_replays_in_a_cuda_graph(n, cluster, monkeypatch):
    """N = 16, and N = 100 (64-token blocks; with $PRUNEKIT_NM24_CLUSTER=0 the per-call workspace is allocated and
    zeroed inside the capture); "finish": the atomics finished by the second kernel."""
    _set_cluster(monkeypatch, cluster)
    g = torch.Generator(device="cuda").manual_seed(5)
    m, k = 512, 1024
    dense = random_sparse_weight(m, k, 0.9, torch.float16, "cuda", g)
    c = encode_csr(dense)
    x2d = torch.randn(n, k, generator=g, device="cuda").half()
    y = _run(c, x2d.t(), m, None, "none")  # warm-up: plan and workspace exist before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = _run(c, x2d.t(), m, None, "none")
    for _ in range(3):
        x2d.copy_(torch.randn(n, k, generator=g, device="cuda").half())
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(yg, spmm_reference64(dense, x2d.t(), None, "none")) <= TOLERANCE[torch.float16]
    assert y.shape == yg.shape


def _set_wide_warps(monkeypatch, warps):
    """$PRUNEKIT_NM24_WIDE_WARPS: "8" or "16" strips per block at N > 16, None for the launcher's rule."""
    if warps is None:
        monkeypatch.delenv(nm24.WIDE_WARPS_ENV, raising=False)
    else:
        monkeypatch.setenv(nm24.WIDE_WARPS_ENV, warps)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n,sparsity,empty_rows", WIDE_SHAPES)
@pytest.mark.parametrize("layout", ["transposed", "row_major"])
@pytest.mark.parametrize("warps", ["8", "16"])
def test_bitmap_kernel_wide_n_matches_float64(dtype, m, k, n, sparsity, empty_rows, layout, warps, monkeypatch):
    """N > 16: one block of 32 tokens at N <= 32, else blocks of 64 tokens over grid z, the last group partial; blocks
    of 8 and of 16 strips; both X layouts, a contiguous (M, N) output and the launcher's own (transposed: Y's rows
    adjacent, written row-fastest by the cluster epilogue)."""
    _set_wide_warps(monkeypatch, warps)
    _check_edge_case(dtype, m, k, n, sparsity, empty_rows, layout)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "chunk,cluster",
    [(None, None), ("8", None), ("8", "0"), ("16", "0"), ("32", None), ("64", None), ("64", "0")],
)
@pytest.mark.parametrize("warps", [None, "8", "16"])
def test_bitmap_kernel_wide_n_k_chunks_in_clusters_and_atomics(chunk, cluster, warps, monkeypatch):
    """N > 16 with the k-chunks reduced in clusters and with atomics (chunk 8: 20 chunks, more than a cluster; or
    $PRUNEKIT_NM24_CLUSTER=0): the atomics add into a zeroed workspace of this call, so the plan's stays zero. Chunks
    of 64 k-steps (the rule's at N > 32 on large grids: 3 chunks here, the last partial). Blocks of 8 and 16 strips,
    and the launcher's choice."""
    _set_wide_warps(monkeypatch, warps)
    dense, c, bias, g = _chunk_case(monkeypatch, chunk, cluster, 13)
    m, k = dense.shape
    for n in (17, 24, 32, 33, 64, 65, 128, 200, 257):
        x = torch.randn(n, k, generator=g, device="cuda").half().t()
        ref = spmm_reference64(dense, x, bias, "relu")
        for out in (torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda"), None):
            y = _run(c, x, m, bias, "relu", out)
            torch.cuda.synchronize()
            assert relative_error(y, ref) <= TOLERANCE[torch.float16], (n, chunk, cluster)
            assert _clean(c, m, k)


@pytest.mark.cuda
def test_bitmap_variant_refuses_fp32():
    dense = random_sparse_weight(16, 64, 0.5, torch.float16, "cuda")
    c32 = encode_csr(dense.float())
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        _run(c32, torch.randn(64, 4, device="cuda"), 16, None, "none")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "k", "sparsity"), [(1000, 2100, 0.8), (300, 4100, 0.85), (4096, 4096, 0.7)])
def test_sparse_linear_bitmap_entry_matches_float64(dtype, m, k, sparsity, monkeypatch):
    """SparseLinear's eager route through prunekit_nm24::bitmap_linear (the rule takes bitmap at these N and
    densities, K >= 1024): every N up to 16 and some of the wide range up to 256, with and without bias, 2-D and 3-D inputs, calls in a row.
    The dense variant's rule, which takes over from N = 65 at these densities, is off here (test_spmm_dense.py)."""
    monkeypatch.setenv(gpu.DENSE_AUTO_ENV, "0")
    g = torch.Generator(device="cuda").manual_seed(m + k)
    dense = random_sparse_weight(m, k, sparsity, dtype, "cuda", g, empty_rows=7, single_rows=3)
    bias = torch.randn(m, generator=g, device="cuda").to(dtype)
    for b in (bias, None):
        layer = SparseLinear(formats.encode("csr", dense.cpu()), b).cuda()
        for n in (*range(gpu.BITMAP_MIN_N, gpu.BITMAP_MAX_N + 1), 17, 32, 33, 64, 100, gpu.BITMAP_WIDE_MAX_N):
            x = torch.randn(n, k, generator=g, device="cuda").to(dtype)
            with torch.inference_mode():
                y = layer(x)
                y3 = layer(x.view(1, n, k))
            ref = spmm_reference64(dense, x.t(), b, "none").t()
            assert relative_error(y, ref) <= TOLERANCE[dtype], n
            assert relative_error(y3.view(n, m), ref) <= TOLERANCE[dtype], n
            entries = gpu.spmm_op_entries(layer.w_values)
            assert entries[(dtype, b is None, m, n)][0] == "bitmap", n
        values = layer.w_values
        plan = get_bitmap_plan(values, layer.w_row_offsets, layer.w_column_indices, m, k)
        torch.cuda.synchronize()
        assert int(plan.counters.abs().sum()) == 0 and float(plan.ws.abs().sum()) == 0.0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_custom_op_takes_the_cpp_entries_once_per_n(dtype):
    """prunekit::spmm_csr on CUDA (gpu.spmm_csr_op): the bitmap entry at the N where "auto" takes bitmap, spmm_csr_auto
    or gpu.spmm_csr elsewhere, each matching float64 in both X layouts and the layout rule; one decision per (dtype,
    bias, M, N) kept on the values tensor, dropped by an in-place edit of the values."""
    g = torch.Generator(device="cuda").manual_seed(21)
    m, k = 1000, 2100
    dense = random_sparse_weight(m, k, 0.8, dtype, "cuda", g, empty_rows=5, single_rows=2)
    c = encode_csr(dense)
    bias = torch.randn(m, generator=g, device="cuda").to(dtype)
    for n in (1, 4, 9, 16, 40, 128, 300):
        x2d = torch.randn(n, k, generator=g, device="cuda").to(dtype)
        for x in (x2d.t(), x2d.t().contiguous()):
            for b, act in ((bias, "relu"), (None, "none")):
                with torch.inference_mode():
                    y = ops.spmm_csr(**c, x=x, m=m, bias=b, activation=act)
                assert relative_error(y, spmm_reference64(dense, x, b, act)) <= TOLERANCE[dtype], (n, act)
                assert y.stride() == new_spmm_output(x, m).stride(), n
        entries = gpu.spmm_op_entries(c["values"])
        kind = entries[(dtype, False, m, n if n <= gpu.BITMAP_WIDE_MAX_N else -gpu.eager_size_class(n))][0]
        takes_bitmap = gpu.plan_spmm(m, k, n, c["values"].numel(), 132, "auto", dtype).variant == "bitmap"
        assert (kind == "bitmap") == takes_bitmap, n
    x = torch.randn(16, k, generator=g, device="cuda").to(dtype).t()
    before = ops.spmm_csr(**c, x=x, m=m)
    c["values"].mul_(2)  # a new version: the decision and the bitmap plan are made again
    after = ops.spmm_csr(**c, x=x, m=m)
    assert relative_error(after, 2 * before.double()) <= TOLERANCE[dtype]


@pytest.mark.cuda
def test_bitmap_linear_entry_refuses_a_plan_of_another_shape():
    dense = random_sparse_weight(64, 2048, 0.8, torch.float16, "cuda")
    c = encode_csr(dense)
    plan = gpu.bitmap_linear_plan((c["values"], c["row_offsets"], c["column_indices"]), 64, 2048, dense.device)
    with pytest.raises(RuntimeError, match="the plan 2048"):
        gpu.bitmap_linear(plan, torch.randn(4, 4096, device="cuda").half())
    with pytest.raises(RuntimeError, match="does not match"):
        gpu.bitmap_linear((plan[0][:100], *plan[1:]), torch.randn(4, 2048, device="cuda").half())
