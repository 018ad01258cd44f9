"""Decode tensor-core SpMM (``spmm_scatter_plan.py`` + ``csrc/spmm_scatter.cu``, variant ``"scatter"``).

CPU (CI): the plan's records decoded through the tile layout against float64, the layout's invariants, and a
lane-by-lane replay of the kernel (X staging in A-fragment order, scatter into the swizzled tile, ldmatrix.x4 row
addresses, the PTX m16n8k16 fragment tables, k-splits, epilogue) against float64. CUDA (``@pytest.mark.cuda``): the
kernel against float64 with NaN-poisoned outputs, N = 1..16, both X layouts, fp16/bf16, bias + ReLU, one and several
k-splits, repeated calls (the workspace must come back zero) and CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from prunekit.kernels import gpu
from prunekit.kernels.spmm_scatter_plan import (
    GROUP_COLS,
    STRIP_ROWS,
    build_scatter_plan,
    column_of_slot,
    get_scatter_plan,
    record_positions,
    record_values,
    scatter_plan_dense,
    scatter_plan_matmul,
    slot_of_column,
    tile_position,
)
from prunekit.kernels.spmm_tc_plan import _mma_a_coords, _mma_b_coords, _mma_c_coords
from prunekit.kernels.testing import (
    SPMM_EDGE_CASES,
    TOLERANCE,
    encode_csr,
    random_sparse_weight,
    random_spmm_case,
    relative_error,
    spmm_reference64,
)

DTYPES = [torch.float16, torch.bfloat16]
# testing.SPMM_EDGE_CASES, each with an N in 1 .. 16.
SHAPES = [(m, k, n, sp, e) for (m, k, sp, e), n in zip(SPMM_EDGE_CASES, (1, 5, 3, 16, 9, 16, 1, 8, 13), strict=True)]


ROWS = [8, 16]  # strip heights: 8 (the default, run on the H100) and 16 (opt-in, $PRUNEKIT_SCATTER_ROWS=16)


def _plan(c, m, k, rows=STRIP_ROWS):
    return build_scatter_plan(c["values"], c["row_offsets"], c["column_indices"], m, k, rows)


# ----------------------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("strip_rows", ROWS)
def test_tile_position_is_a_bijection_onto_the_tile(strip_rows):
    rows = torch.arange(strip_rows).repeat_interleave(GROUP_COLS)
    cols = torch.arange(GROUP_COLS).repeat(strip_rows)
    pos = tile_position(rows, cols)
    assert sorted(pos.tolist()) == list(range(strip_rows * GROUP_COLS))
    # Row r occupies halfwords r * 128 .. r * 128 + 127 (one 256-byte shared-memory row).
    assert torch.equal(pos // GROUP_COLS, rows)


def test_slot_order_gives_each_lane_four_adjacent_columns():
    # mma.m16n8k16 A fragment: lane 4 g + q holds k slots 2q, 2q+1, 2q+8, 2q+9 (PTX ISA fragment table).
    for q in range(4):
        slots = torch.tensor([2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9])
        assert column_of_slot(slots).tolist() == [4 * q, 4 * q + 1, 4 * q + 2, 4 * q + 3]
    cols = torch.arange(16)
    assert torch.equal(column_of_slot(slot_of_column(cols)), cols)


def test_ldmatrix_matrices_hit_distinct_banks():
    # One 8x8 matrix of ldmatrix.x4: 8 rows of the tile (rows 0-7, or 8-15 of a 16-row strip) at one logical 16-byte
    # column group. Their physical 16-byte groups (position // 8 within the 256-byte row) must differ mod 8: four
    # banks each, 32 banks in all.
    for first_row in (0, 8):
        for group16 in range(16):
            t, half = group16 // 2, group16 % 2
            col = t * 16 + column_of_slot(torch.tensor(half * 8))
            pos = tile_position(first_row + torch.arange(8), col.repeat(8))
            banks = ((pos % GROUP_COLS) // 8) % 8
            assert sorted(banks.tolist()) == list(range(8))


@pytest.mark.parametrize("strip_rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n,sparsity,empty_rows", SHAPES)
def test_scatter_plan_matches_float64_reference(dtype, m, k, n, sparsity, empty_rows, strip_rows):
    dense, c, x2d, bias = random_spmm_case(m, k, n, sparsity, empty_rows, dtype, m + k + n)
    plan = _plan(c, m, k, strip_rows)
    assert plan.nnz == int((dense != 0).sum())  # CSR padding dropped, every non-zero once
    assert plan.workspace.shape == (plan.strips * strip_rows * 16,)
    assert not plan.workspace.any() and not plan.counters.any()
    torch.testing.assert_close(scatter_plan_dense(plan), dense.double(), rtol=0, atol=0)
    for b, activation in ((bias, "relu"), (None, "none")):
        y = scatter_plan_matmul(plan, x2d.t(), b, activation)
        ref = spmm_reference64(dense, x2d.t(), b, activation)
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-9)


def test_scatter_plan_rejects_bad_input():
    dense = random_sparse_weight(16, 40, 0.5, torch.float32)
    c = encode_csr(dense)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        build_scatter_plan(c["values"], c["row_offsets"], c["column_indices"], 16, 40)
    c = encode_csr(dense.half())
    with pytest.raises(ValueError, match=r"column index outside \[0, 30\)"):
        build_scatter_plan(c["values"], c["row_offsets"], c["column_indices"], 16, 30)
    with pytest.raises(ValueError, match="CSR shapes disagree"):
        build_scatter_plan(c["values"], c["row_offsets"], c["column_indices"], 15, 40)
    with pytest.raises(ValueError, match="strip_rows must be 8 or 16"):
        build_scatter_plan(c["values"], c["row_offsets"], c["column_indices"], 16, 40, 32)


def test_get_scatter_plan_is_cached_and_rebuilt_after_an_in_place_edit():
    dense = random_sparse_weight(24, 300, 0.8, torch.float16)
    c = encode_csr(dense)
    p1 = get_scatter_plan(c["values"], c["row_offsets"], c["column_indices"], 24, 300)
    assert get_scatter_plan(c["values"], c["row_offsets"], c["column_indices"], 24, 300) is p1
    c["values"].mul_(2)
    p2 = get_scatter_plan(c["values"], c["row_offsets"], c["column_indices"], 24, 300)
    assert p2 is not p1
    torch.testing.assert_close(scatter_plan_dense(p2), 2 * dense.double())


class _WarpReplay:
    """One warp of ``spmm_scatter_kernel`` in float64: its shared-memory tile (``rows x 128``), the staged X items of
    its range (``stage[t, lane] = lo (4) + hi (4)``: tokens lane / 4 and lane / 4 + 8 at columns 16 t + 4 (lane % 4) +
    0..3) and its accumulator ``acc (token, strip row)``; ``scatter`` stores one record, ``flush`` multiplies and
    clears the tile the way the kernel's ROWS = 8 or 16 path does."""

    def __init__(self, stage: torch.Tensor, positions: list[int], values: list[float], rows: int, narrow: bool):
        self.stage, self.positions, self.values, self.rows, self.narrow = stage, positions, values, rows, narrow
        self.tile = torch.zeros(rows * GROUP_COLS, dtype=torch.float64)
        self.written = torch.zeros(rows * GROUP_COLS, dtype=torch.bool)
        self.acc = torch.zeros(16, rows, dtype=torch.float64)
        self.scattered: list[int] = []

    def scatter(self, i: int) -> None:
        pos = self.positions[i]
        assert not self.written[pos], "two records at one tile position before a flush"
        self.written[pos] = True
        self.tile[pos] = self.values[i]
        self.scattered.append(i)

    def _ldmatrix_x4(self, addr: list[int]) -> torch.Tensor:
        """ldmatrix.x4 (not transposed): lane l gives the row address of matrix l // 8, row l % 8; register i of lane
        l holds row l // 4 of matrix i, elements 2 (l % 4) and 2 (l % 4) + 1."""
        reg = torch.zeros(32, 4, 2, dtype=torch.float64)
        for lane in range(32):
            for mat in range(4):
                base = addr[8 * mat + lane // 4]
                reg[lane, mat] = self.tile[base + 2 * (lane % 4) : base + 2 * (lane % 4) + 2]
        return reg

    def flush(self, gi: int) -> None:
        if self.rows == 8:
            for jj in range(4):
                addr = [(ln % 8) * GROUP_COLS + (((4 * jj + ln // 8) ^ (ln % 8)) * 8) for ln in range(32)]
                breg = self._ldmatrix_x4(addr)
                for h in range(2):
                    a_mat = torch.zeros(16, 16, dtype=torch.float64)
                    b_mat = torch.zeros(16, 8, dtype=torch.float64)
                    t = gi * 8 + 2 * jj + h
                    for lane in range(32):
                        lo, hi = self.stage[t, lane, :4], self.stage[t, lane, 4:]
                        if self.narrow:
                            hi = torch.zeros(4, dtype=torch.float64)
                        regs = torch.cat([lo[:2], hi[:2], lo[2:], hi[2:]])  # A registers 0..3
                        for i in range(8):
                            a_mat[_mma_a_coords(lane, i)] = regs[i]
                        for i in range(4):
                            b_mat[_mma_b_coords(lane, i)] = breg[lane, 2 * h + i // 2, i % 2]
                    self.acc += a_mat @ b_mat  # (tokens, rows)
        else:
            for t8 in range(8):
                t = gi * 8 + t8
                rows_of = [(ln & 7) + ((ln >> 3) & 1) * 8 for ln in range(32)]
                addr = [r * GROUP_COLS + (((2 * t8 + ln // 16) ^ (r % 8)) * 8) for ln, r in enumerate(rows_of)]
                areg = self._ldmatrix_x4(addr)
                a_mat = torch.zeros(16, 16, dtype=torch.float64)  # (strip rows, k)
                for lane in range(32):
                    for i in range(8):
                        a_mat[_mma_a_coords(lane, i)] = areg[lane, i // 2, i % 2]
                for h in range(1 if self.narrow else 2):
                    b_mat = torch.zeros(16, 8, dtype=torch.float64)  # (k, tokens 8 h .. 8 h + 7)
                    for lane in range(32):
                        b = self.stage[t, lane, 4 * h : 4 * h + 4]  # registers (v.x, v.y) or (v.z, v.w)
                        for i in range(4):
                            b_mat[_mma_b_coords(lane, i)] = b[i]
                    self.acc[8 * h : 8 * h + 8] += (a_mat @ b_mat).t()
        self.tile.zero_()
        self.written.zero_()


def _epilogue_coords(rows: int) -> list[tuple[int, int, int, int]]:
    """(lane, element, token, strip row) of every output element as the kernel's token_of / row_of give them, checked
    against the PTX accumulator table."""
    out = []
    for lane in range(32):
        gid, tig = lane // 4, lane % 4
        for e in range(8 if rows == 16 else 4):
            if rows == 16:
                tok, row = 8 * (e >> 2) + 2 * tig + (e & 1), gid + 8 * ((e >> 1) & 1)
                assert _mma_c_coords(lane, e & 3) == (row, tok - 8 * (e >> 2))  # m = row, n = token in the half
            else:
                tok, row = gid + 8 * (e >> 1), 2 * tig + (e & 1)
                assert _mma_c_coords(lane, e) == (tok, row)  # m = token, n = row
            out.append((lane, e, tok, row))
    assert sorted((t, r) for _, _, t, r in out) == [(t, r) for t in range(16) for r in range(rows)]
    return out


def replay_scatter_kernel(plan, x: torch.Tensor, bias, relu: bool, kr_groups: int) -> torch.Tensor:
    """Replay ``spmm_scatter_kernel`` lane by lane in float64: returns ``(M, N)`` (NaN where nothing was stored).

    Follows the kernel's data layout and control flow: the X copy in A-fragment order (registers stored as 0, 2, 1,
    3; 8-byte reads for N <= 8), the warp's record stream in chunks of 32 with the fast path for chunks inside one
    group and the flush of a group's tile (ldmatrix.x4 row addresses, PTX fragment tables) as the stream passes its
    end, empty groups skipped, and the k-split sums.
    """
    k, n = x.shape
    m, groups = plan.m, plan.groups
    narrow = n <= 8
    xb = x.double()
    values = record_values(plan).tolist()
    positions = record_positions(plan).tolist()
    goff = plan.group_offsets.tolist()
    ksplit = -(-groups // kr_groups)

    def x4(col: int, j: int) -> list[float]:
        return [float(xb[col + c, j]) if (j < n and col + c < k) else 0.0 for c in range(4)]

    rows = plan.strip_rows
    y = torch.full((m, n), float("nan"), dtype=torch.float64)
    for strip in range(plan.strips):
        acc_total = torch.zeros(16, rows, dtype=torch.float64)  # (token, strip row)
        for kc in range(ksplit):
            g0, g1 = kc * kr_groups, min(groups, (kc + 1) * kr_groups)
            ng = g1 - g0
            # X copy: item (k-step t, lane L) = (lo, hi), lo = token L / 4, hi = token L / 4 + 8, columns
            # k0 + 16 t + 4 (L % 4) + 0..3 (hi is not copied for N <= 8).
            stage = torch.zeros(ng * 8, 32, 8, dtype=torch.float64)
            for t in range(ng * 8):
                for lane in range(32):
                    col = g0 * GROUP_COLS + t * 16 + 4 * (lane % 4)
                    lo = x4(col, lane // 4)
                    hi = [0.0] * 4 if narrow else x4(col, lane // 4 + 8)
                    stage[t, lane] = torch.tensor(lo + hi)
            bnd = goff[strip * groups + g0 : strip * groups + g1 + 1]
            r0, r1 = bnd[0], bnd[ng]
            warp = _WarpReplay(stage, positions, values, rows, narrow)
            gi, gbeg, gend = 0, r0, (bnd[1] if ng >= 1 else r0)
            for c in range(-(-(r1 - r0) // 32)):
                idxs = range(r0 + 32 * c, r0 + 32 * c + 32)
                cend = min(r0 + 32 * c + 32, r1)
                if cend < gend:  # fast path: the chunk lies in group gi
                    for i in idxs:
                        if i < cend:
                            warp.scatter(i)
                    continue
                while True:
                    for i in idxs:
                        if gbeg <= i < gend:
                            warp.scatter(i)
                    if gend > cend:
                        break
                    if gend > gbeg:
                        warp.flush(gi)
                    gi += 1
                    if gi >= ng:
                        break
                    gbeg, gend = gend, bnd[gi + 1]
            acc, scattered, written = warp.acc, warp.scattered, warp.written
            assert scattered == list(range(r0, r1)), "every record of the range scattered once, in order"
            assert not written.any(), "every scattered record flushed"
            # Per-lane accumulators -> workspace sums (or the direct store for one split).
            for _, _, tok, r in _epilogue_coords(rows):
                acc_total[tok, r] += acc[tok, r]
        for _, _, tok, r in _epilogue_coords(rows):
            row = strip * rows + r
            if tok < n and row < m:
                v = float(acc_total[tok, r]) + (float(bias[row]) if bias is not None else 0.0)
                y[row, tok] = max(v, 0.0) if relu else v
    return y


def _chunk_aligned_weight() -> torch.Tensor:
    """16 x 640 fp16 weight whose first strip has exactly 32 non-zeros in groups 0 and 2, none in groups 1 and 4 and
    5 in group 3 (group ends on chunk boundaries, empty groups at the start of a k-split, in the middle and at the
    end), and whose second strip is empty."""
    g = torch.Generator().manual_seed(11)
    w = torch.zeros(16, 640)
    for group, count in ((0, 32), (2, 32), (3, 5)):
        cells = torch.randperm(8 * 128, generator=g)[:count]
        w[cells // 128, group * 128 + cells % 128] = torch.randn(count, generator=g) + 3.0
    return w.half()


@pytest.mark.parametrize("strip_rows", ROWS)
@pytest.mark.parametrize("kr_groups", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [1, 16])
def test_kernel_replay_handles_chunk_aligned_and_empty_groups(kr_groups, n, strip_rows):
    dense = _chunk_aligned_weight()
    plan = _plan(encode_csr(dense), 16, 640, strip_rows)
    g = torch.Generator().manual_seed(kr_groups)
    x2d = torch.randn(n, 640, generator=g).half()
    y = replay_scatter_kernel(plan, x2d.t(), None, False, kr_groups)
    torch.testing.assert_close(y, spmm_reference64(dense, x2d.t(), None, "none"), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize(
    "m,k,n,sparsity,kr_groups,dtype",
    [
        (13, 300, 16, 0.8, 1, torch.float16),  # 3 k-splits, K residue inside a quad
        (9, 130, 1, 0.5, 2, torch.bfloat16),  # one split over 2 groups, N = 1
        (8, 45, 11, 0.0, 1, torch.float16),  # dense, one group
        (10, 700, 3, 0.98, 2, torch.float16),  # very sparse: empty groups, chunks spanning several groups
    ],
)
@pytest.mark.parametrize("strip_rows", ROWS)
def test_kernel_replay_matches_float64(m, k, n, sparsity, kr_groups, dtype, strip_rows):
    dense, c, x2d, bias = random_spmm_case(m, k, n, sparsity, 1, dtype, 7 * m + k)
    plan = _plan(c, m, k, strip_rows)
    y = replay_scatter_kernel(plan, x2d.t(), bias, True, kr_groups)
    ref = spmm_reference64(dense, x2d.t(), bias, "relu")
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-9)


def test_kr_groups_split_k_within_bounds():
    for m, k in [(4096, 4096), (11008, 4096), (4096, 11008), (768, 3072), (3072, 768), (1, 7), (100000, 64)]:
        kr = gpu.scatter_kr_groups(m, k, 132)
        groups = max(1, -(-k // 128))
        assert 1 <= kr <= min(groups, gpu.SCATTER_MAX_KR_GROUPS)
    # Few strips: split K more (768 x 3072: 96 strips, 24 groups -> one group per block).
    assert gpu.scatter_kr_groups(768, 3072, 132) == 1
    # Many strips: at most SCATTER_KR_CAP groups per block (measured), whatever the parallelism.
    assert gpu.scatter_kr_groups(100000, 4096, 132) == gpu.SCATTER_KR_CAP == 4
    assert gpu.scatter_kr_groups(11008, 4096, 132) == 4


def test_strip_rows_env(monkeypatch):
    monkeypatch.delenv(gpu.SCATTER_ROWS_ENV, raising=False)
    assert gpu.scatter_strip_rows() == 8
    monkeypatch.setenv(gpu.SCATTER_ROWS_ENV, "16")
    assert gpu.scatter_strip_rows() == 16
    plan = gpu.plan_spmm(4096, 4096, 16, 1 << 22, 132, "scatter", torch.float16)
    assert plan.strip_rows == 16 and plan.kr_groups == gpu.scatter_kr_groups(4096, 4096, 132, 16)
    monkeypatch.setenv(gpu.SCATTER_ROWS_ENV, "12")
    with pytest.raises(ValueError, match="must be 8 or 16"):
        gpu.scatter_strip_rows()


def test_kr_groups_override(monkeypatch):
    monkeypatch.setenv(gpu.SCATTER_KR_ENV, "12")
    assert gpu.scatter_kr_groups(4096, 4096, 132) == 12
    assert gpu.scatter_kr_groups(4096, 300, 132) == 3  # clamped to the groups
    monkeypatch.setenv(gpu.SCATTER_KR_ENV, "0")
    assert gpu.scatter_kr_groups(4096, 4096, 132) == 1


def test_plan_spmm_scatter_rule(monkeypatch):
    forced = gpu.plan_spmm(4096, 4096, 16, 1 << 20, 132, "scatter", torch.float16)
    assert forced.variant == "scatter" and forced.kr_groups == gpu.scatter_kr_groups(4096, 4096, 132)
    monkeypatch.setenv(gpu.SCATTER_AUTO_ENV, "1")
    monkeypatch.setenv(gpu.BITMAP_AUTO_ENV, "0")  # the scatter rule alone (the bitmap rule: test_spmm_bitmap.py)

    def auto(m, k, n, sparsity, dtype=torch.float16):
        # nnz_padded about 1% above the non-zeros, as the CSR padding makes it in the benchmark
        return gpu.plan_spmm(m, k, n, int((1 - sparsity) * m * k * 1.01), 132, "auto", dtype).variant

    # The H100 rule: scatter at 50-80% everywhere, at 90% on M * K <= 2^24 only, rowwarp at 95% and above.
    assert [auto(4096, 4096, 16, s) for s in (0.5, 0.8, 0.9, 0.95)] == ["scatter"] * 3 + ["rowwarp"]
    assert [auto(11008, 4096, 16, s) for s in (0.5, 0.8, 0.9, 0.98)] == ["scatter"] * 2 + ["rowwarp"] * 2
    assert auto(768, 3072, 9, 0.9) == "scatter" and auto(768, 3072, 8, 0.9) == "rowwarp"
    assert gpu.plan_spmm(4096, 4096, 16, 1 << 20, 132, "auto", torch.float16).variant == "rowwarp"  # 6.25% dense
    assert gpu.plan_spmm(4096, 4096, 17, 1 << 20, 132, "auto", torch.float16).variant != "scatter"
    assert gpu.plan_spmm(4096, 4096, 16, 1 << 20, 132, "auto", torch.float32).variant == "rowwarp"
    assert gpu.eager_spmm_code("auto", torch.float16, torch.float16, 16, True) is None
    monkeypatch.setenv(gpu.SCATTER_AUTO_ENV, "0")
    assert gpu.plan_spmm(4096, 4096, 16, 1 << 20, 132, "auto", torch.float16).variant == "rowwarp"


# ---------------------------------------------------------------------------------------------------------- CUDA


def _run(c, x, m, bias, activation, kr_groups=None, out=None, strip_rows=STRIP_ROWS):
    if kr_groups is None:
        assert gpu.scatter_strip_rows() == strip_rows  # the launcher reads $PRUNEKIT_SCATTER_ROWS
        return gpu.spmm_csr(
            c["values"],
            c["row_offsets"],
            c["column_indices"],
            c["row_indices"],
            x,
            m,
            bias,
            activation,
            variant="scatter",
            out=out,
        )
    plan = get_scatter_plan(c["values"], c["row_offsets"], c["column_indices"], m, x.shape[0], strip_rows)
    y = out
    gpu._ensure_loaded()
    b = None if bias is None else bias.contiguous()
    torch.ops.prunekit_ext.spmm_csr_scatter(
        plan.records,
        plan.group_offsets,
        x,
        y,
        b,
        activation == "relu",
        kr_groups,
        plan.workspace,
        plan.counters,
        strip_rows,
    )
    assert int(plan.counters.abs().sum()) == 0 and float(plan.workspace.abs().sum()) == 0.0  # left clean
    return y


@pytest.mark.cuda
@pytest.mark.parametrize("strip_rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n,sparsity,empty_rows", SHAPES)
@pytest.mark.parametrize("layout", ["transposed", "row_major"])
def test_scatter_kernel_matches_float64(dtype, m, k, n, sparsity, empty_rows, layout, strip_rows, monkeypatch):
    monkeypatch.setenv(gpu.SCATTER_ROWS_ENV, str(strip_rows))
    dense, c, x2d, bias = random_spmm_case(m, k, n, sparsity, empty_rows, dtype, m + k + n, "cuda")
    x = x2d.t() if layout == "transposed" else x2d.t().contiguous()
    for b, activation in ((bias, "relu"), (None, "none")):
        ref = spmm_reference64(dense, x, b, activation)
        groups = max(1, -(-k // 128))
        for kr in sorted({1, max(1, groups // 2), min(groups, gpu.SCATTER_MAX_KR_GROUPS)}):
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            for _ in range(2):  # the second call finds the workspace the first one left (must be zero again)
                out.fill_(float("nan"))
                y = _run(c, x, m, b, activation, kr, out, strip_rows)
                torch.cuda.synchronize()
                err = relative_error(y, ref)
                assert err <= TOLERANCE[dtype], (kr, err)
        y = _run(c, x, m, b, activation, strip_rows=strip_rows)  # the launcher's own k-split and output layout
        assert relative_error(y, ref) <= TOLERANCE[dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("strip_rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_kernel_large_random_weight_every_n(dtype, strip_rows, monkeypatch):
    monkeypatch.setenv(gpu.SCATTER_ROWS_ENV, str(strip_rows))
    g = torch.Generator(device="cuda").manual_seed(3)
    m, k = 1000, 2100
    dense = random_sparse_weight(m, k, 0.9, dtype, "cuda", g, empty_rows=9, single_rows=3)
    c = encode_csr(dense)
    bias = torch.randn(m, generator=g, device="cuda").to(dtype)
    for n in range(1, 17):
        x2d = torch.randn(n, k, generator=g, device="cuda").to(dtype)
        y = _run(c, x2d.t(), m, bias, "relu", strip_rows=strip_rows)
        assert relative_error(y, spmm_reference64(dense, x2d.t(), bias, "relu")) <= TOLERANCE[dtype], n


@pytest.mark.cuda
@pytest.mark.parametrize("strip_rows", ROWS)
def test_scatter_kernel_replays_in_a_cuda_graph(strip_rows, monkeypatch):
    monkeypatch.setenv(gpu.SCATTER_ROWS_ENV, str(strip_rows))
    g = torch.Generator(device="cuda").manual_seed(5)
    m, k, n = 512, 1024, 16
    dense = random_sparse_weight(m, k, 0.9, torch.float16, "cuda", g)
    c = encode_csr(dense)
    x2d = torch.randn(n, k, generator=g, device="cuda").half()
    y = _run(c, x2d.t(), m, None, "none", strip_rows=strip_rows)  # warm-up: plan and workspace exist before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = _run(c, x2d.t(), m, None, "none", strip_rows=strip_rows)
    for _ in range(3):
        x2d.copy_(torch.randn(n, k, generator=g, device="cuda").half())
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(yg, spmm_reference64(dense, x2d.t(), None, "none")) <= TOLERANCE[torch.float16]
    assert y.shape == yg.shape


@pytest.mark.cuda
@pytest.mark.parametrize("cluster", ["1", "0", None])
@pytest.mark.parametrize("strip_rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_kernel_cluster_reduction_matches_float64(dtype, strip_rows, cluster, monkeypatch):
    """k-splits reduced in a thread-block cluster (sm_90; $PRUNEKIT_SCATTER_CLUSTER=1 forces it, 0 forces the
    atomics, unset takes the launch rule: clusters at N > 8 with <= 6 splits). 17 groups of 128 columns: kr = 1 is 17
    splits (more than a cluster: atomics), kr = 2 nine (a non-portable cluster), kr = 4 five; M = 1000 leaves idle
    warps in the last strip block."""
    monkeypatch.setenv(gpu.SCATTER_ROWS_ENV, str(strip_rows))
    if cluster is None:
        monkeypatch.delenv("PRUNEKIT_SCATTER_CLUSTER", raising=False)
    else:
        monkeypatch.setenv("PRUNEKIT_SCATTER_CLUSTER", cluster)
    g = torch.Generator(device="cuda").manual_seed(11)
    m, k = 1000, 2100
    dense = random_sparse_weight(m, k, 0.8, dtype, "cuda", g, empty_rows=9, single_rows=3)
    c = encode_csr(dense)
    bias = torch.randn(m, generator=g, device="cuda").to(dtype)
    for n in (1, 9, 16):
        x = torch.randn(n, k, generator=g, device="cuda").to(dtype).t()
        ref = spmm_reference64(dense, x, bias, "relu")
        for kr in (1, 2, 4):
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            for _ in range(2):
                out.fill_(float("nan"))
                y = _run(c, x, m, bias, "relu", kr, out, strip_rows)
                torch.cuda.synchronize()
                assert relative_error(y, ref) <= TOLERANCE[dtype], (n, kr)


@pytest.mark.cuda
def test_scatter_variant_refuses_fp32_and_wide_x():
    dense = random_sparse_weight(16, 64, 0.5, torch.float16, "cuda")
    c = encode_csr(dense)
    with pytest.raises(ValueError, match="N <= 16"):
        _run(c, torch.randn(64, 17, device="cuda").half(), 16, None, "none")
    c32 = encode_csr(dense.float())
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        _run(c32, torch.randn(64, 4, device="cuda"), 16, None, "none")


@pytest.mark.parametrize("strip_rows", ROWS)
def test_record_order_cycles_through_the_banks_within_each_group(strip_rows):
    dense = random_sparse_weight(40, 700, 0.7, torch.float16, generator=torch.Generator().manual_seed(1))
    plan = _plan(encode_csr(dense), 40, 700, strip_rows)
    bank = (record_positions(plan) // 2) % 32
    offsets = plan.group_offsets.tolist()
    for s in range(len(offsets) - 1):
        b = bank[offsets[s] : offsets[s + 1]].tolist()
        # The first 32 records of a group use as many distinct banks as the group has banks at all.
        assert len(set(b[:32])) == min(32, len(set(b)))
