"""Bitmap plan of the decode tensor-core SpMM (``spmm_bitmap_plan.py``, variant ``"bitmap"``), on the CPU.

The plan decoded with the kernel's per-lane index arithmetic (``bitmap_plan_dense``) against the CSR's dense matrix,
exactly, over random weights (densities 0.5 / 0.1 / 0.02, empty rows and strips, 1-nnz rows, M and K off the tile
sizes, M = 1, all-zero, all-dense); hand-checked tiles (mask bits, count bytes, words, offsets); the pair registers
against the PTX m16n8k16 A-fragment table; the header, offset and slot invariants the kernel relies on; the float64
matmul emulation; bad input.
"""

from __future__ import annotations

import pytest
import torch

from prunekit.formats.csr import csr_rows
from prunekit.kernels.spmm_bitmap_plan import (
    BATCH,
    HEADER_WORDS,
    K_STEP,
    STRIP_ROWS,
    bitmap_bytes,
    bitmap_plan_dense,
    bitmap_plan_matmul,
    bitmap_plan_nbytes,
    buffer_layout,
    build_bitmap_plan,
    get_bitmap_plan,
    pair_coords,
)
from prunekit.kernels.spmm_scatter_plan import column_of_slot
from prunekit.kernels.spmm_tc_plan import _mma_a_coords
from prunekit.kernels.testing import encode_csr, random_sparse_weight, random_spmm_case, spmm_reference64

DTYPES = [torch.float16, torch.bfloat16]
# (M, K, sparsity, empty_rows, single_rows): densities 0.5 / 0.1 / 0.02, M and K off 16 and 128, M = 1, a whole empty
# strip (20 empty rows), all-dense.
CASES = [
    (40, 200, 0.5, 3, 1),
    (40, 200, 0.9, 3, 1),
    (40, 200, 0.98, 3, 1),
    (16, 128, 0.5, 0, 1),
    (1, 17, 0.5, 0, 0),
    (1, 300, 0.9, 0, 0),
    (300, 1000, 0.9, 20, 2),
    (300, 1000, 0.98, 20, 2),
    (33, 45, 0.0, 0, 0),
    (19, 1031, 0.0, 0, 0),
]


def _plan(c, m, k):
    return build_bitmap_plan(c["values"], c["row_offsets"], c["column_indices"], m, k)


def _weight(m, k, sparsity, empty_rows, single_rows, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return random_sparse_weight(m, k, sparsity, dtype, generator=g, empty_rows=empty_rows, single_rows=single_rows)


def _bits(value: float, dtype: torch.dtype) -> int:
    return int(torch.tensor(value, dtype=dtype).view(torch.int16)) & 0xFFFF


def _u32(x: int) -> int:
    return x & 0xFFFFFFFF


def _padded(dense: torch.Tensor, strips: int, ksteps: int) -> torch.Tensor:
    out = torch.zeros(strips * STRIP_ROWS, ksteps * K_STEP, dtype=dense.dtype)
    out[: dense.shape[0], : dense.shape[1]] = dense
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,sparsity,empty_rows,single_rows", CASES)
def test_bitmap_plan_decodes_to_the_csr_dense_matrix(dtype, m, k, sparsity, empty_rows, single_rows):
    dense = _weight(m, k, sparsity, empty_rows, single_rows, dtype, m + k)
    plan = _plan(encode_csr(dense), m, k)
    assert (plan.strips, plan.ksteps) == (-(-m // 16), -(-k // 128) * 8)
    assert plan.hdr.shape == (plan.strips, plan.ksteps, HEADER_WORDS) and plan.hdr.dtype == torch.int32
    assert plan.boff.shape == (plan.strips, plan.ksteps // BATCH + 1) and plan.boff.dtype == torch.int32
    assert plan.vals.dim() == 1 and plan.vals.dtype == torch.int32
    assert plan.ws.shape == (plan.strips * 256,) and plan.ws.dtype == torch.float32 and not plan.ws.any()
    assert plan.counters.shape == (-(-plan.strips // 8),) and plan.counters.dtype == torch.int32
    assert not plan.counters.any()
    pairs = _padded(dense, plan.strips, plan.ksteps).view(-1, 2) != 0
    assert plan.pairs == int(pairs.any(-1).sum())  # one word per present pair
    torch.testing.assert_close(bitmap_plan_dense(plan), dense.double(), rtol=0, atol=0)
    decoded = bitmap_plan_dense(plan, dtype)
    assert torch.equal(decoded.view(torch.int16), dense.view(torch.int16))  # bit-exact in the weight's dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bitmap_plan_of_an_all_zero_weight_is_headers_and_tail_only(dtype):
    plan = _plan(encode_csr(torch.zeros(20, 50, dtype=dtype)), 20, 50)
    assert plan.pairs == 0 and plan.vals.tolist() == [0, 0, 0, 0]
    assert not plan.hdr.any() and not plan.boff.any() and plan.slot_words == 4
    assert bitmap_bytes(plan) == (2 * 8 * 5 + 2 * 2) * 4
    assert not bitmap_plan_dense(plan).any()


def test_pair_registers_are_the_mma_a_fragment_with_columns_permuted():
    # PTX m16n8k16 A fragment: registers {a0, a1}, {a2, a3}, {a4, a5}, {a6, a7} of a lane are pairs r = 0..3; k slot
    # 2t (+ 8) holds column 4t (+ 2) under the permutation prunekit's nm24 / scatter kernels use.
    lane = torch.arange(32).repeat_interleave(4)
    r = torch.arange(4).repeat(32)
    row, col = pair_coords(lane, r)
    for half in range(2):
        arow, aslot = _mma_a_coords(lane, 2 * r + half)
        assert torch.equal(row, arow)
        assert torch.equal(col + half, column_of_slot(aslot))
    element = torch.cat([16 * row + col, 16 * row + col + 1])
    assert sorted(element.tolist()) == list(range(256))  # every element of the tile exactly once


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_tile_stores_words_by_lane_then_r(dtype):
    dense = (torch.arange(256, dtype=torch.float32).view(16, 16) + 1).to(dtype)  # distinct, exact in bf16 too
    plan = _plan(encode_csr(dense), 16, 16)
    assert plan.pairs == 128 and plan.vals[128:].tolist() == [0, 0, 0, 0]
    for lane in range(32):
        for r in range(4):
            row, col = lane // 4 + 8 * (r % 2), 4 * (lane % 4) + 2 * (r // 2)
            word = _bits(float(dense[row, col]), dtype) | _bits(float(dense[row, col + 1]), dtype) << 16
            assert _u32(int(plan.vals[4 * lane + r])) == word
    assert [_u32(x) for x in plan.hdr[0, 0].tolist()] == [0xFFFFFFFF] * 4 + [128 | 32 << 8 | 64 << 16 | 96 << 24]
    assert not plan.hdr[0, 1:].any()
    assert plan.boff.tolist() == [[0, 128]] and plan.slot_words == 128


# (row, col) of the only non-zero of a 16 x 16 weight -> (lane, r, high half, mask word, bit, p1, p2, p3)
SINGLE = [
    ((0, 0), (0, 0, False, 0, 0, 1, 1, 1)),
    ((10, 7), (9, 3, True, 1, 7, 0, 1, 1)),  # g 2 + 8, t 1, columns 6-7: r 3, lane 9 = bit 4 * 1 + 3 of word 1
    ((3, 12), (15, 0, False, 1, 28, 0, 1, 1)),  # g 3, t 3, columns 12-13: r 0, lane 15 = bit 4 * 7 of word 1
    ((15, 15), (31, 3, True, 3, 31, 0, 0, 0)),  # lane 31, r 3: bit 31 of word 3, the int32 sign bit
    ((2, 6), (9, 2, False, 1, 6, 0, 1, 1)),  # g 2, t 1, columns 6-7: r 2, lane 9 = bit 4 * 1 + 2 of word 1
    ((9, 16), (4, 1, False, 0, 17, 1, 1, 1)),  # tile (0, 1), column 0: g 1 + 8, t 0, r 1, lane 4 = bit 4 * 4 + 1
    ((9, 18), (4, 3, False, 0, 19, 1, 1, 1)),  # tile (0, 1), column 2: g 1 + 8, t 0, r 3, lane 4 = bit 4 * 4 + 3
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pos,expected", SINGLE)
def test_single_non_zero_sets_one_mask_bit_and_one_word(dtype, pos, expected):
    lane, r, high, word, bit, p1, p2, p3 = expected
    m, k = 16, 32
    dense = torch.zeros(m, k, dtype=dtype)
    dense[pos] = -1.5
    plan = _plan(encode_csr(dense), m, k)
    row, col = pair_coords(torch.tensor(lane), torch.tensor(r))
    assert (int(row), int(col) + high) == (pos[0], pos[1] % 16)
    tile = pos[1] // 16
    hdr = [_u32(x) for x in plan.hdr[0, tile].tolist()]
    assert hdr[:4] == [(1 << bit) if w == word else 0 for w in range(4)]
    assert hdr[4] == 1 | p1 << 8 | p2 << 16 | p3 << 24
    assert not plan.hdr[0, 1 - tile].any()
    assert [_u32(x) for x in plan.vals.tolist()] == [_bits(-1.5, dtype) << (16 if high else 0), 0, 0, 0, 0]
    assert plan.boff.tolist() == [[0, 1]] and plan.slot_words == 4
    assert bitmap_bytes(plan) == 4 + 8 * 5 * 4 + 2 * 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_negative_zero_counts_as_zero(dtype):
    dense = torch.zeros(16, 16, dtype=dtype)
    dense[0, 0], dense[0, 1], dense[5, 2], dense[5, 3] = 1.0, 2.0, 3.0, 4.0
    c = encode_csr(dense)
    rows, cols = csr_rows(c["row_offsets"]), c["column_indices"].long()
    real = torch.ones_like(cols, dtype=torch.bool)
    real[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1])
    negzero = real & (((rows == 0) & (cols == 1)) | (rows == 5))
    c["values"][negzero] = -0.0
    plan = _plan(c, 16, 16)
    # (0, 0..1) is lane 0's pair 0 with a -0.0 high half stored as 0x0000; (5, 2..3) (lane 20, pair 2) is absent.
    assert plan.vals.tolist() == [_bits(1.0, dtype), 0, 0, 0, 0]
    assert [_u32(x) for x in plan.hdr[0, 0].tolist()] == [1, 0, 0, 0, 1 | 1 << 8 | 1 << 16 | 1 << 24]


@pytest.mark.parametrize("m,k,sparsity,empty_rows,single_rows", CASES)
def test_headers_offsets_and_slot_cover_every_batch(m, k, sparsity, empty_rows, single_rows):
    dense = _weight(m, k, sparsity, empty_rows, single_rows, torch.float16, 7 * m + k)
    plan = _plan(encode_csr(dense), m, k)
    batches = plan.ksteps // BATCH
    # boff against pair counts of the padded dense weight, independent of the lane order.
    present = (_padded(dense, plan.strips, plan.ksteps).view(-1, 2) != 0).any(-1)
    per_batch = present.view(plan.strips, 16, batches, 64).sum((1, 3))  # 64 pairs = 128 columns per row
    expected = torch.zeros(plan.strips * batches + 1, dtype=torch.int64)
    expected[1:] = torch.cumsum(per_batch.reshape(-1), 0)
    boff = plan.boff.long()
    for s in range(plan.strips):
        assert boff[s].tolist() == expected[s * batches : (s + 1) * batches + 1].tolist()
        assert (boff[s, 1:] >= boff[s, :-1]).all()
        if s + 1 < plan.strips:
            assert boff[s, -1] == boff[s + 1, 0]
    assert boff[0, 0] == 0 and boff[-1, -1] == plan.pairs
    # vals: at least 4 zero words after the last pair; the kernel's 16-byte copies of any batch fit the slot.
    assert plan.vals.numel() >= plan.pairs + 4 and not plan.vals[plan.pairs :].any()
    span = (boff[:, 1:] + 3) // 4 * 4 - (boff[:, :-1] - boff[:, :-1] % 4)
    assert plan.slot_words >= 4 and plan.slot_words >= int(span.max())
    assert plan.slot_words in (4, int(span.max()))
    assert ((boff[:, 1:] + 3) // 4 * 4 <= plan.vals.numel()).all()  # the last copy stays inside vals
    # Headers: byte 0 = popcount of the masks, bytes 1-3 = pairs of the mask words before.
    hdr = plan.hdr.long() & 0xFFFFFFFF
    pops = torch.stack([((hdr[..., w, None] >> torch.arange(32)) & 1).sum(-1) for w in range(4)], -1)
    counts = hdr[..., 4]
    assert torch.equal(counts & 0xFF, pops.sum(-1))
    for w in (1, 2, 3):
        assert torch.equal((counts >> (8 * w)) & 0xFF, pops[..., :w].sum(-1))
    totals = (counts & 0xFF).view(plan.strips, batches, BATCH).sum(-1)
    assert torch.equal(totals, boff[:, 1:] - boff[:, :-1])
    assert bitmap_bytes(plan) == 4 * (plan.pairs + plan.hdr.numel() + plan.boff.numel())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n", [(40, 200, 1), (33, 45, 16), (300, 1000, 9), (1, 17, 5)])
def test_bitmap_plan_matmul_matches_float64_reference(dtype, m, k, n):
    dense, c, x2d, bias = random_spmm_case(m, k, n, 0.8, 3, dtype, m + k + n)
    plan = _plan(c, m, k)
    for b, activation in ((bias, "relu"), (None, "none")):
        y = bitmap_plan_matmul(plan, x2d.t(), b, activation)
        ref = spmm_reference64(dense, x2d.t(), b, activation)
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-9)
    with pytest.raises(ValueError, match="unknown activation"):
        bitmap_plan_matmul(plan, x2d.t(), None, "gelu")
    with pytest.raises(ValueError, match=r"x must be \(K, N\)"):
        bitmap_plan_matmul(plan, x2d, None)


@pytest.mark.parametrize(("m", "k"), [(1, 1), (45, 301), (300, 2500), (4096, 4096)])
def test_plan_tensors_are_aligned_views_of_one_buffer_laid_out_from_m_and_k(m, k):
    """The eager entry finds every piece in the one buffer from M and K alone (buffer_layout, as its C++ computes):
    hdr, boff, ws, counters, each padded to 16 bytes, then vals; the workspace and counters start zero."""
    plan = _plan(encode_csr(random_sparse_weight(m, k, 0.9, torch.float16, "cpu", empty_rows=min(m, 3))), m, k)
    n_hdr, n_boff, n_ws, n_cnt = buffer_layout(m, k)
    assert all(words % 4 == 0 for words in (n_hdr, n_boff, n_ws, n_cnt))
    base = plan.buffer.data_ptr()
    offsets = {"hdr": 0, "boff": n_hdr, "ws": n_hdr + n_boff, "counters": n_hdr + n_boff + n_ws}
    offsets["vals"] = n_hdr + n_boff + n_ws + n_cnt
    for name, offset in offsets.items():
        t = getattr(plan, name)
        assert t.is_contiguous() and t.untyped_storage().data_ptr() == plan.buffer.untyped_storage().data_ptr(), name
        assert t.data_ptr() == base + 4 * offset, name
    assert plan.buffer.numel() == offsets["vals"] + plan.vals.numel()
    assert plan.hdr.numel() == n_hdr and plan.boff.numel() <= n_boff and plan.ws.numel() == n_ws
    assert plan.counters.numel() <= n_cnt and plan.ws.dtype == torch.float32
    assert not plan.buffer[offsets["ws"] : offsets["vals"]].any()


@pytest.mark.parametrize(("m", "k", "sparsity"), [(1, 1, 0.0), (45, 301, 0.9), (300, 2500, 0.5), (64, 4096, 1.0)])
def test_bitmap_plan_nbytes_is_the_built_buffer(m, k, sparsity):
    """The memory report's count (one sort, no plan built) equals the plan's buffer, with padding entries, empty rows
    and explicit zeros among the stored values."""
    dense = random_sparse_weight(m, k, sparsity, torch.float16, "cpu", empty_rows=min(m, 3))
    c = encode_csr(dense)
    c["values"][::7] = 0  # stored zeros are not present pairs
    plan = build_bitmap_plan(c["values"], c["row_offsets"], c["column_indices"], m, k)
    assert bitmap_plan_nbytes(c["values"], c["row_offsets"], c["column_indices"], m, k) == plan.buffer.numel() * 4


def test_bitmap_plan_rejects_bad_input():
    dense = random_sparse_weight(16, 40, 0.5, torch.float32)
    c = encode_csr(dense)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        build_bitmap_plan(c["values"], c["row_offsets"], c["column_indices"], 16, 40)
    c = encode_csr(dense.half())
    with pytest.raises(ValueError, match=r"column index outside \[0, 30\)"):
        build_bitmap_plan(c["values"], c["row_offsets"], c["column_indices"], 16, 30)
    with pytest.raises(ValueError, match="CSR shapes disagree"):
        build_bitmap_plan(c["values"], c["row_offsets"], c["column_indices"], 15, 40)


def test_get_bitmap_plan_is_cached_and_rebuilt_after_an_in_place_edit():
    dense = random_sparse_weight(24, 300, 0.8, torch.float16)
    c = encode_csr(dense)
    p1 = get_bitmap_plan(c["values"], c["row_offsets"], c["column_indices"], 24, 300)
    assert get_bitmap_plan(c["values"], c["row_offsets"], c["column_indices"], 24, 300) is p1
    c["values"].mul_(2)
    p2 = get_bitmap_plan(c["values"], c["row_offsets"], c["column_indices"], 24, 300)
    assert p2 is not p1
    torch.testing.assert_close(bitmap_plan_dense(p2), 2 * dense.double(), rtol=0, atol=0)
