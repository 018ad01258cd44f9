"""BSR matmul (``prunekit::bsr_mm`` dynamic, ``prunekit::bsr_mm_static``): the static schedule's invariants, the CPU
reference and opcheck on CPU, and the CUDA tensor-core kernel against float64 on fresh random inputs with the output
poisoned with NaN first (empty block rows, single-block rows, heavy rows that the schedule splits, odd N)."""

from __future__ import annotations

import pytest
import torch

from prunekit import formats
from prunekit.formats.bsr import SCHEDULE_MIN_CHUNK, schedule_chunk, static_schedule
from prunekit.kernels import fastcall, ops, reference, structured
from prunekit.kernels.testing import TOLERANCE, relative_error, spmm_reference64

pytestmark = pytest.mark.usefixtures("tiled_bsr_kernel")  # conftest.py: the lean kernel only where a test sets it

BLOCKS = [(16, 16), (32, 32), (64, 64), (16, 64), (64, 16), (32, 16)]


def block_sparse_weight(
    m: int,
    k: int,
    r: int,
    c: int,
    density: float,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
    heavy_rows: int = 0,
) -> torch.Tensor:
    """``(m, k)`` weight whose ``r x c`` tiles are kept with probability ``density`` (N(0, 1) inside kept tiles).

    Block row 0 is empty, block row 1 (when it exists) keeps exactly one block, and the next ``heavy_rows`` block
    rows are dense, so a static schedule has to split them.
    """
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(m // r, k // c, generator=g) < density
    keep[0] = False
    if m // r > 1:
        keep[1] = False
        keep[1, int(torch.randint(k // c, (1,), generator=g))] = True
    keep[2 : 2 + heavy_rows] = True
    tile_mask = keep.repeat_interleave(r, 0).repeat_interleave(c, 1)
    w = torch.randn(m, k, generator=g) * tile_mask
    return w.to(dtype).to(device)


# --- static schedule -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["length", "row", "mix"])
@pytest.mark.parametrize("seed", range(6))
def test_static_schedule_covers_every_block_exactly_once(seed, order):
    g = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 60, (1,), generator=g))
    counts = torch.randint(0, 5, (rows,), generator=g)
    counts[torch.randint(rows, (2,), generator=g)] = torch.randint(20, 200, (2,), generator=g)  # skewed rows
    crow = torch.zeros(rows + 1, dtype=torch.int32)
    crow[1:] = torch.cumsum(counts, 0)
    schedule, split_rows = static_schedule(crow, order=order)
    chunk = schedule_chunk(counts)
    assert schedule.dtype == torch.int32 and schedule.shape[1] == 4
    covered = torch.zeros(int(crow[-1]), dtype=torch.int64)
    for row, start, end, slot in schedule.tolist():
        assert crow[row] <= start <= end <= crow[row + 1]
        assert end - start <= chunk
        covered[start:end] += 1
        if slot >= 0:
            assert int(split_rows[slot]) == row
        else:
            assert (start, end) == (int(crow[row]), int(crow[row + 1]))
    assert bool((covered == 1).all())
    assert sorted(set(schedule[:, 0].tolist())) == list(range(rows))  # empty rows keep an item (bias/activation)
    work = (schedule[:, 2] - schedule[:, 1]).tolist()
    longest_first = sorted(work, reverse=True)
    if order == "length":
        assert work == longest_first
    elif order == "row":  # the block rows in order, a split row's items side by side, its blocks in order
        assert schedule[:, 0].tolist() == sorted(schedule[:, 0].tolist())
        assert schedule[:, 1].tolist() == sorted(schedule[:, 1].tolist())
    else:  # longest, shortest, second longest, ...: the "length" order's items from both ends in turn
        length_order = static_schedule(crow)[0].tolist()
        ends = [length_order[i // 2] if i % 2 == 0 else length_order[-1 - i // 2] for i in range(len(length_order))]
        assert schedule.tolist() == ends
        assert work[0] == longest_first[0] and work[1] == longest_first[-1]
    assert split_rows.tolist() == sorted({r for r, *_, s in schedule.tolist() if s >= 0})


def test_static_schedule_rejects_an_unknown_order():
    with pytest.raises(ValueError, match="schedule order"):
        static_schedule(torch.tensor([0, 1, 2], dtype=torch.int32), order="random")


def test_static_schedule_splits_only_rows_over_the_chunk():
    counts = torch.tensor([3, 3, 3, 3, 40, 0])
    crow = torch.zeros(7, dtype=torch.int32)
    crow[1:] = torch.cumsum(counts, 0)
    schedule, split_rows = static_schedule(crow)
    assert schedule_chunk(counts) == SCHEDULE_MIN_CHUNK
    assert split_rows.tolist() == [4]
    pieces = schedule[schedule[:, 0] == 4]
    assert len(pieces) == 5 and set((pieces[:, 2] - pieces[:, 1]).tolist()) == {8}


def test_bsr_format_stores_schedule_and_still_round_trips():
    dense = block_sparse_weight(96, 128, 16, 32, 0.3, torch.float16, heavy_rows=1)
    enc = formats.encode("bsr", dense, {"block_rows": 16, "block_cols": 32})
    assert {"schedule", "split_rows"} <= set(enc.components)
    schedule, split_rows = static_schedule(enc.components["crow_indices"])
    assert torch.equal(enc.components["schedule"], schedule) and torch.equal(enc.components["split_rows"], split_rows)
    assert torch.equal(formats.decode(enc), dense)
    assert enc.nbytes == sum(t.numel() * t.element_size() for t in enc.components.values())


def _pattern_with_long_row(long_blocks: int, r: int = 64, rows: int = 24, cols: int = 160) -> dict:
    """BSR components (r x r blocks) with block row 5 holding ``long_blocks`` blocks and the others 1-3: the stored
    schedule splits row 5 (over SCHEDULE_MIN_CHUNK and twice the median)."""
    present = torch.zeros(rows, cols, dtype=torch.bool)
    for i in range(rows):
        present[i, (i * 7 + torch.arange(1 + i % 3)) % cols] = True
    present[5] = False
    present[5, :long_blocks] = True
    dense = present.repeat_interleave(r, 0).repeat_interleave(r, 1).to(torch.float16)
    return formats.encode("bsr", dense, {"block_rows": r, "block_cols": r}).components


def test_split_pays_by_the_longest_rows_columns(monkeypatch):
    """structured.split_pays: the stored split rows are kept where the longest block row spans at least the columns
    SPLIT_MIN_COLS gives for the call's N (2048 up to N = 256, 4096 up to 1024, 8192 above); $PRUNEKIT_BSR_SPLIT
    forces it."""
    monkeypatch.delenv(structured.SPLIT_ENV, raising=False)
    assert structured.SPLIT_MIN_COLS == ((256, 2048), (1024, 4096), (None, 8192))
    assert [structured.split_n_class(n) for n in (33, 256, 257, 1024, 1025, 8192)] == [0, 0, 1, 1, 2, 2]
    r = 64
    rows = {blocks: _pattern_with_long_row(blocks, r) for blocks in (31, 32, 63, 64, 127, 128)}  # 1984 ... 8192 cols
    for comp in rows.values():
        assert comp["split_rows"].tolist() == [5]

    def pays(blocks: int, n: int) -> bool:
        return structured.split_pays(rows[blocks]["blocks"], rows[blocks]["crow_indices"], n)

    assert not pays(31, 256) and pays(32, 256)
    assert not pays(32, 257) and not pays(63, 1024) and pays(64, 257) and pays(64, 1024)
    assert not pays(64, 1025) and not pays(127, 8192) and pays(128, 1025) and pays(128, 8192)
    monkeypatch.setenv(structured.SPLIT_ENV, "1")
    assert pays(31, 8192)
    monkeypatch.setenv(structured.SPLIT_ENV, "0")
    assert not pays(128, 128)
    monkeypatch.setenv(structured.SPLIT_ENV, "sometimes")
    with pytest.raises(ValueError, match="PRUNEKIT_BSR_SPLIT"):
        pays(128, 128)


def test_decode_schedule_unsplits_where_the_split_does_not_pay(monkeypatch):
    """Static mode at N above DECODE_MAX_N: the stored schedule where split_pays, else every block row in one item
    (every block once, longest first, no split rows), built once per crow_indices version."""
    monkeypatch.delenv(structured.SPLIT_ENV, raising=False)
    monkeypatch.delenv(structured.DECODE_SCHEDULE_ENV, raising=False)
    comp = _pattern_with_long_row(40)  # 2560 columns: pays up to N = 256 only
    blocks, crow, sched, split = comp["blocks"], comp["crow_indices"], comp["schedule"], comp["split_rows"]
    n_small, n_large = 256, 2048
    assert structured.decode_schedule(blocks, crow, sched, split, n_small, True) == (sched, split)
    items, rows = structured.decode_schedule(blocks, crow, sched, split, n_large, True)
    assert rows.numel() == 0 and items.dtype == torch.int32 and items.shape[0] == crow.numel() - 1
    assert (items[:, 3] == -1).all()
    for row, start, end, _ in items.tolist():
        assert (start, end) == (int(crow[row]), int(crow[row + 1]))
    work = (items[:, 2] - items[:, 1]).tolist()
    assert work == sorted(work, reverse=True)
    assert structured.decode_schedule(blocks, crow, sched, split, n_large, False)[0] is items  # kept on crow_indices
    assert structured.unsplit_schedule(crow)[0] is items
    unsplit_free = _pattern_with_long_row(3)  # no split rows: the stored schedule, no host copy needed
    assert unsplit_free["split_rows"].numel() == 0
    given = (unsplit_free["schedule"], unsplit_free["split_rows"])
    assert structured.decode_schedule(unsplit_free["blocks"], unsplit_free["crow_indices"], *given, n_large) == given
    crow.add_(0)  # a new version: built again
    again = structured.decode_schedule(blocks, crow, sched, split, n_large)[0]
    assert again is not items and torch.equal(again, items)


def test_decode_schedule_splits_32_row_blocks_at_decode_n(monkeypatch):
    """structured.decode_schedule: static mode, 32-row blocks, N <= DECODE_MAX_N: every block row in items of at most
    DECODE_SCHEDULE_CHUNK blocks (every block once), built once per crow_indices version; the given schedule
    elsewhere (larger N, 64-row blocks, dynamic mode, $PRUNEKIT_BSR_DECODE_SCHEDULE=0); the stored split rows kept
    ($PRUNEKIT_BSR_SPLIT=1: split_pays' own test is below)."""
    monkeypatch.delenv(structured.DECODE_SCHEDULE_ENV, raising=False)
    monkeypatch.setenv(structured.SPLIT_ENV, "1")
    dense = block_sparse_weight(512, 512, 32, 32, 0.5, torch.float16, seed=3, heavy_rows=1)
    comp = formats.encode("bsr", dense, {"block_rows": 32, "block_cols": 32}).components
    blocks, crow, sched, split = comp["blocks"], comp["crow_indices"], comp["schedule"], comp["split_rows"]
    items, rows = structured.decode_schedule(blocks, crow, sched, split, 16)
    assert items.dtype == torch.int32 and rows.dtype == torch.int32 and items.shape[0] > sched.shape[0]
    covered = torch.zeros(int(crow[-1]), dtype=torch.int64)
    for row, start, end, slot in items.tolist():
        assert int(crow[row]) <= start <= end <= int(crow[row + 1]) and end - start <= structured.DECODE_SCHEDULE_CHUNK
        covered[start:end] += 1
        assert (slot >= 0) == (int(crow[row + 1] - crow[row]) > structured.DECODE_SCHEDULE_CHUNK)
    assert bool((covered == 1).all())
    assert structured.decode_schedule(blocks, crow, sched, split, 1)[0] is items  # kept on crow_indices
    for n in (structured.DECODE_MAX_N + 1, 4096):
        assert structured.decode_schedule(blocks, crow, sched, split, n) == (sched, split)
    assert structured.decode_schedule(blocks, crow, None, None, 16) == (None, None)  # dynamic mode
    wide = formats.encode("bsr", dense, {"block_rows": 64, "block_cols": 64}).components
    given = (wide["schedule"], wide["split_rows"])
    assert structured.decode_schedule(wide["blocks"], wide["crow_indices"], *given, 16) == given
    crow.add_(0)  # a new version: built again
    again = structured.decode_schedule(blocks, crow, sched, split, 16)[0]
    assert again is not items and torch.equal(again, items)
    monkeypatch.setenv(structured.DECODE_SCHEDULE_ENV, "0")
    assert structured.decode_schedule(blocks, crow, sched, split, 16) == (sched, split)
    monkeypatch.setenv(structured.DECODE_SCHEDULE_ENV, "1")
    monkeypatch.setenv(structured.LEAN_ENV, "1")  # the lean kernel takes N <= lean_max_n and reads no schedule
    assert structured.decode_schedule(blocks, crow, sched, split, 16) == (sched, split)
    assert structured.decode_schedule(blocks, crow, sched, split, 32) == (sched, split)  # 32-row blocks: to N = 32
    monkeypatch.setenv(structured.LEAN_MAX_N_ENV, "16")
    assert structured.decode_schedule(blocks, crow, sched, split, 17)[0].shape[0] > sched.shape[0]
    # a call the wgmma kernel runs keeps the stored schedule (measured faster with it)
    assert structured.decode_schedule(blocks, crow, sched, split, 17, wgmma=True) == (sched, split)


def test_eager_calls_know_when_the_wgmma_kernel_runs(monkeypatch):
    """structured._runs_wgmma, which keeps the finer decode schedule off wgmma calls: a resolved wgmma number; an
    unresolved "auto" (16-row blocks) by the C++ entry's N range; the Python path's own resolution."""
    monkeypatch.delenv(structured.BSR_VARIANT_ENV, raising=False)
    b16 = torch.zeros(1, 16, 16, dtype=torch.float16)
    b32 = torch.zeros(1, 32, 32, dtype=torch.float16)
    auto, mma, wgmma = (structured.VARIANTS[k] for k in ("auto", "mma", "wgmma"))
    assert structured._runs_wgmma(b32, 20, wgmma, None) and not structured._runs_wgmma(b32, 20, mma, None)
    lo = structured.AUTO_WGMMA_16_MIN_N
    assert [structured._runs_wgmma(b16, n, auto, None) for n in (lo - 1, lo, 8192)] == [False, True, True]
    monkeypatch.setattr(structured, "_wgmma_state", True)
    monkeypatch.setattr(structured, "wgmma_available", lambda: True)
    assert structured._runs_wgmma(b32, 20, None, None) and not structured._runs_wgmma(b16, 20, None, None)
    assert structured._runs_wgmma(b16, 20, None, "wgmma") and not structured._runs_wgmma(b32, 20, None, "mma")


def test_lean_takes_rule(monkeypatch):
    """structured.lean_takes (the C++ bsr_lean_run's rule): on unless $PRUNEKIT_BSR_LEAN=0, 1 <= N <= lean_max_n
    (32 for blocks of 16 or 32 rows, 16 for 64; $PRUNEKIT_BSR_LEAN_MAX_N: 16 or 32), fp16/bf16 blocks with r and c in
    (16, 32, 64)."""
    blocks = torch.zeros(3, 32, 16, dtype=torch.float16)
    tall = torch.zeros(3, 64, 16, dtype=torch.float16)
    monkeypatch.delenv(structured.LEAN_ENV, raising=False)
    monkeypatch.delenv(structured.LEAN_MAX_N_ENV, raising=False)
    assert structured.lean_takes(blocks, 16) and structured.lean_takes(blocks, 32)
    assert structured.lean_takes(tall, 16) and not structured.lean_takes(tall, 17)
    for on in ("", "1"):
        monkeypatch.setenv(structured.LEAN_ENV, on)
        assert structured.lean_takes(blocks, 1) and structured.lean_takes(blocks, 32)
    assert structured.lean_takes(blocks.bfloat16(), 8)
    assert not structured.lean_takes(blocks, 0) and not structured.lean_takes(blocks, 33)
    for setting, top in (("16", 16), ("32", 32), ("auto", 32)):
        monkeypatch.setenv(structured.LEAN_MAX_N_ENV, setting)
        assert structured.lean_takes(blocks, top) and not structured.lean_takes(blocks, top + 1)
        assert structured.lean_takes(tall, top if setting != "auto" else 16)
    monkeypatch.setenv(structured.LEAN_MAX_N_ENV, "24")
    with pytest.raises(ValueError, match="PRUNEKIT_BSR_LEAN_MAX_N"):
        structured.lean_takes(blocks, 8)
    monkeypatch.delenv(structured.LEAN_MAX_N_ENV)
    assert not structured.lean_takes(blocks.float(), 8)
    assert not structured.lean_takes(torch.zeros(3, 8, 16, dtype=torch.float16), 8)
    monkeypatch.setenv(structured.LEAN_ENV, "0")
    assert not structured.lean_takes(blocks, 8)


def test_sparse_linear_bsr_eager_calls_the_cpp_entry_with_rows(monkeypatch):
    """SparseLinear's eager CUDA BSR call (faked on the CPU): the C++ entry gets the activations (N, K) as given and
    the variant with structured.ROWS, and its result (N, M) is returned as it is; the decision (the op, the variant,
    the finer decode schedule in static mode) is made once per x dtype, weight dtype and N class. The finer schedule
    is taken only where the lean kernel does not take the call; dynamic mode passes no schedule; a layer the entry
    does not take goes to the Python launcher."""
    from prunekit.deploy.runtime import sparse_linear
    from prunekit.formats.base import EncodedTensor

    asked, calls, launched = [], [], []

    def variant(blocks, x, name=None):
        asked.append(tuple(x.shape))
        return structured.VARIANTS["mma"]

    def entry(blocks, crow, cols, sched, split, x, m, bias, relu, number):
        calls.append((x, sched, number))
        assert not relu
        return reference.bsr_mm(blocks, crow, cols, x.t(), m, bias).t().contiguous()

    def launcher(blocks, crow, cols, x, m, bias, activation, sched=None, split=None):
        launched.append(tuple(x.shape))
        return reference.bsr_mm(blocks, crow, cols, x, m, bias, activation)

    monkeypatch.setattr(sparse_linear, "_eager_cuda", lambda x: True)
    monkeypatch.setattr(structured, "eager_bsr_variant", variant)
    monkeypatch.setattr(structured, "bsr_mm_entry", lambda: entry)
    monkeypatch.setattr(structured, "bsr_mm_cuda", launcher)
    monkeypatch.delenv(structured.DECODE_SCHEDULE_ENV, raising=False)
    monkeypatch.setenv(structured.LEAN_ENV, "0")
    dense = block_sparse_weight(128, 96, 32, 32, 0.5, torch.float16, seed=5, heavy_rows=1)
    bias = torch.randn(128, dtype=torch.float16)
    enc = formats.encode("bsr", dense, {"block_rows": 32, "block_cols": 32})
    stored = enc.components["schedule"]
    layer = sparse_linear.SparseLinear(enc, bias)
    for n in (16, 16, 33, 33):
        x = torch.randn(n, 96, dtype=torch.float16)
        y = layer(x)
        assert y.shape == (n, 128)
        assert relative_error(y, spmm_reference64(dense, x.t(), bias, "none").t()) < TOLERANCE[torch.float16]
        assert calls[-1][0] is x and calls[-1][2] == structured.VARIANTS["mma"] | structured.ROWS
        # N = 16 with the lean kernel off: the finer decode schedule; N = 33: the stored one
        assert (calls[-1][1] is stored) == (n == 33), n
    assert asked == [(96, 16), (96, 33)]  # one decision per N class
    y = layer(torch.randn(2, 5, 96, dtype=torch.float16))  # leading dimensions: 10 tokens
    assert y.shape == (2, 5, 128) and calls[-1][0].shape == (10, 96)
    monkeypatch.setenv(structured.LEAN_ENV, "1")
    lean = sparse_linear.SparseLinear(enc, bias)
    lean(torch.randn(16, 96, dtype=torch.float16))
    assert calls[-1][1] is None  # the lean kernel takes N = 16 and reads no schedule: none is passed
    lean(torch.randn(32, 96, dtype=torch.float16))
    assert calls[-1][1] is None  # 32-row blocks: the lean kernel takes N up to 32 too
    monkeypatch.setenv(structured.LEAN_MAX_N_ENV, "16")
    lean16 = sparse_linear.SparseLinear(enc, bias)
    lean16(torch.randn(17, 96, dtype=torch.float16))
    assert calls[-1][1] is not None and calls[-1][1] is not stored  # N = 17: the tiled kernel, the finer schedule
    monkeypatch.delenv(structured.LEAN_MAX_N_ENV)
    comps = {k: v for k, v in enc.components.items() if k not in ("schedule", "split_rows")}
    dynamic = sparse_linear.SparseLinear(EncodedTensor("bsr", enc.shape, enc.dtype, enc.params, comps), bias)
    dynamic(torch.randn(16, 96, dtype=torch.float16))
    assert calls[-1][1] is None
    assert not launched
    plain = sparse_linear.SparseLinear(enc)  # built without a bias ...
    plain.bias = bias  # ... which is then a plain attribute, not a parameter: the eager call still adds it
    x = torch.randn(4, 96, dtype=torch.float16)
    assert relative_error(plain(x), spmm_reference64(dense, x.t(), bias, "none").t()) < TOLERANCE[torch.float16]
    monkeypatch.setattr(structured, "eager_bsr_variant", lambda blocks, x, name=None: None)
    other = sparse_linear.SparseLinear(enc, bias)
    x = torch.randn(3, 96, dtype=torch.float16)
    assert relative_error(other(x), spmm_reference64(dense, x.t(), bias, "none").t()) < TOLERANCE[torch.float16]
    assert launched == [(96, 3)]


# --- CPU reference and opcheck -------------------------------------------------------------------------------------


def _components(dense, r, c):
    return formats.encode("bsr", dense, {"block_rows": r, "block_cols": c}).components


@pytest.mark.parametrize(("r", "c"), [(4, 4), (8, 4), (16, 16)])
@pytest.mark.parametrize("static", [False, True])
def test_bsr_reference_matches_float64(r, c, static):
    dense = block_sparse_weight(64, 96, r, c, 0.4, torch.float32, heavy_rows=1)
    comp = _components(dense, r, c)
    x2d = torch.randn(9, 96)
    bias = torch.randn(64)
    if static:
        y = structured.bsr_mm_static(
            comp["blocks"], comp["crow_indices"], comp["col_indices"], comp["schedule"], comp["split_rows"],
            x2d.t(), 64, bias, "relu",
        )  # fmt: skip
    else:
        y = ops.bsr_mm(comp["blocks"], comp["crow_indices"], comp["col_indices"], x2d.t(), 64, bias, "relu")
    assert y.stride() == (1, 64)  # layout rule: x2d.t() gives a column-major Y, so Y.t() is contiguous
    assert relative_error(y, spmm_reference64(dense, x2d.t(), bias, "relu")) < 1e-6


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_bsr_mm_and_static(transposed, with_bias):
    dense = block_sparse_weight(32, 48, 8, 8, 0.5, torch.float32, heavy_rows=1)
    comp = _components(dense, 8, 8)
    x2d = torch.randn(5, 48)
    x = x2d.t() if transposed else x2d.t().contiguous()
    bias = torch.randn(32) if with_bias else None
    base = (comp["blocks"], comp["crow_indices"], comp["col_indices"])
    torch.library.opcheck(ops.bsr_mm, (*base, x, 32, bias, "relu"))
    torch.library.opcheck(structured.bsr_mm_static, (*base, comp["schedule"], comp["split_rows"], x, 32, bias, "relu"))


def test_plan_tile_n_follows_the_h100_sweep():
    assert structured.plan_tile_n(4096, 64, 16) == 32  # decode shapes: the 32-wide tile
    assert structured.plan_tile_n(16384, 64, 8192, 132, nblocks=256 * 26) == 256  # long rows: wide tile
    assert structured.plan_tile_n(4096, 64, 4096, 132, nblocks=64 * 6) == 128  # short 64-row block rows
    assert structured.plan_tile_n(4096, 16, 4096, 132, nblocks=256 * 13) == 256
    assert structured.plan_tile_n(256, 64, 300, 132) == 128  # too few CTAs for the wide tile
    assert all(
        structured.plan_tile_n(m, r, n) in structured.TILE_NS
        for m in (64, 4096)
        for r in (16, 64)
        for n in (1, 33, 9000)
    )


def test_cuda_entry_raises_kernel_unavailable_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    from prunekit.errors import KernelUnavailable

    with pytest.raises(KernelUnavailable):
        structured.load()


# --- CUDA ---------------------------------------------------------------------------------------------------------

CUDA_SHAPES = [(128, 192, 1), (192, 256, 7), (256, 128, 130), (64, 512, 33)]  # (M, K, N): odd N, N < one tile


def _poisoned(m, n, dtype, transposed):
    if transposed:
        return torch.full((n, m), float("nan"), dtype=dtype, device="cuda").t()
    return torch.full((m, n), float("nan"), dtype=dtype, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("r", "c"), BLOCKS)
@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_bsr_cuda_matches_float64(dtype, r, c, mode):
    for i, (m, k, n) in enumerate(CUDA_SHAPES):
        dense = block_sparse_weight(m, k, r, c, 0.35, dtype, "cuda", seed=i, heavy_rows=1 if m // r > 3 else 0)
        comp = {key: t.cuda() for key, t in _components(dense.cpu(), r, c).items()}
        if mode == "static" and m // r > 3:
            comp["schedule"], comp["split_rows"] = (t.cuda() for t in static_schedule(comp["crow_indices"], chunk=1))
            assert comp["split_rows"].numel() > 0  # the heavy row is split: exercises the fp32 reduction
        for transposed in (True, False):
            x2d = torch.randn(n, k, device="cuda").to(dtype)
            x = x2d.t() if transposed else x2d.t().contiguous()
            bias = torch.randn(m, device="cuda").to(dtype)
            for activation in ("none", "relu"):
                extra = (comp["schedule"], comp["split_rows"]) if mode == "static" else (None, None)
                ref = spmm_reference64(dense, x, bias, activation)
                for tile_n in structured.TILE_NS:
                    for staged in (True, False):
                        out = _poisoned(m, n, dtype, transposed)
                        structured.bsr_mm_cuda(
                            comp["blocks"], comp["crow_indices"], comp["col_indices"], x, m, bias, activation,
                            *extra, out=out, tile_n=tile_n, staged_epilogue=staged,
                        )  # fmt: skip
                        torch.cuda.synchronize()
                        err = relative_error(out, ref)
                        assert err < TOLERANCE[dtype], (m, k, n, transposed, activation, tile_n, staged, err)


def _declared_maximum_case():
    """Dynamic mode with a declared maximum: a (128, 256) weight of 32 x 32 blocks whose blocks and col_indices buffers
    are 7 entries longer than the pattern, the tail NaN blocks and out-of-range columns. Returns (dense, blocks,
    crow_indices, col_indices) on the GPU."""
    dense = block_sparse_weight(128, 256, 32, 32, 0.4, torch.float16, "cuda", seed=3)
    comp = _components(dense.cpu(), 32, 32)
    cap = comp["blocks"].shape[0] + 7
    blocks = torch.full((cap, 32, 32), float("nan"), dtype=torch.float16, device="cuda")
    blocks[: comp["blocks"].shape[0]] = comp["blocks"].cuda()
    cols = torch.full((cap,), 10**6, dtype=torch.int32, device="cuda")
    cols[: comp["col_indices"].numel()] = comp["col_indices"].cuda()
    return dense, blocks, comp["crow_indices"].cuda(), cols


LEAN_SHAPES = [(128, 192), (192, 256), (256, 128), (64, 512)]  # (M, K): divisible by every block of BLOCKS


def _set_lean(monkeypatch, warps: str | None, max_n: str = "32") -> None:
    """The lean decode kernel ($PRUNEKIT_BSR_LEAN=1) with its warps per CTA forced, or the launcher's choice, taking
    calls up to ``max_n`` tokens ($PRUNEKIT_BSR_LEAN_MAX_N; default: the kernel's whole range)."""
    monkeypatch.setenv(structured.LEAN_ENV, "1")
    monkeypatch.setenv(structured.LEAN_MAX_N_ENV, max_n)
    if warps is None:
        monkeypatch.delenv(structured.LEAN_WARPS_ENV, raising=False)
    else:
        monkeypatch.setenv(structured.LEAN_WARPS_ENV, warps)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "warps"), [(torch.float16, None), (torch.bfloat16, None), (torch.float16, "4"), (torch.float16, "8")]
)
@pytest.mark.parametrize(("r", "c"), BLOCKS)
def test_bsr_lean_decode_matches_float64(dtype, r, c, warps, monkeypatch):
    """The lean decode kernel at N = 1, 5, 9, 16, 17, 24, 32 ($PRUNEKIT_BSR_LEAN_MAX_N=32), dynamic and static mode
    (it ignores the schedule), both X and Y layouts, bias + ReLU, empty / single-block / dense block rows (one of 300
    blocks), NaN-poisoned outputs; and the other kernels again at N = 33 with the switch on (N over 32 is not the
    lean kernel's). First, that the lean kernel does take the N <= 32 calls of this block shape and dtype, and not
    N = 33, and with $PRUNEKIT_BSR_LEAN_MAX_N=16 not N = 17 (an invalid warps setting raises only in it)."""
    for max_n in ("16", "32"):
        _set_lean(monkeypatch, "6", max_n)  # an invalid setting, read only by the lean kernel: which calls it takes
        dense = block_sparse_weight(64, 256, r, c, 0.5, dtype, "cuda", seed=1)
        comp = {key: t.cuda() for key, t in _components(dense.cpu(), r, c).items()}
        for n in (1, 16, 17, 32, 33):
            x = torch.randn(n, 256, device="cuda").to(dtype).t()
            if n <= int(max_n):
                with pytest.raises(RuntimeError, match="PRUNEKIT_BSR_LEAN_WARPS"):
                    structured.bsr_mm_cuda(comp["blocks"], comp["crow_indices"], comp["col_indices"], x, 64)
            else:
                structured.bsr_mm_cuda(comp["blocks"], comp["crow_indices"], comp["col_indices"], x, 64)
    _set_lean(monkeypatch, warps)
    # LEAN_SHAPES, then one whose dense block row has 300 blocks (K = 300 c): over 32 blocks per warp, so the column
    # indices are fetched in several batches of 32
    for i, (m, k) in enumerate(LEAN_SHAPES + [(256, 300 * c)]):
        long_row = k == 300 * c
        density = 0.05 if long_row else 0.35
        heavy = 1 if long_row or m // r > 3 else 0
        dense = block_sparse_weight(m, k, r, c, density, dtype, "cuda", seed=20 + i, heavy_rows=heavy)
        comp = {key: t.cuda() for key, t in _components(dense.cpu(), r, c).items()}
        bias = torch.randn(m, device="cuda").to(dtype)
        for n in (1, 5, 9, 16, 17, 24, 32, 33):
            for transposed in (True, False):
                x2d = torch.randn(n, k, device="cuda").to(dtype)
                x = x2d.t() if transposed else x2d.t().contiguous()
                for activation, b in (("none", None), ("relu", bias)):
                    ref = spmm_reference64(dense, x, b, activation)
                    for sched in ((None, None), (comp["schedule"], comp["split_rows"])):
                        out = _poisoned(m, n, dtype, transposed)
                        structured.bsr_mm_cuda(
                            comp["blocks"], comp["crow_indices"], comp["col_indices"], x, m, b, activation, *sched,
                            out=out,
                        )  # fmt: skip
                        torch.cuda.synchronize()
                        err = relative_error(out, ref)
                        assert err < TOLERANCE[dtype], (m, k, n, transposed, activation, sched[0] is None, err)


@pytest.mark.cuda
@pytest.mark.parametrize("static", [True, False])
def test_bsr_lean_decode_is_the_default(static, monkeypatch):
    """$PRUNEKIT_BSR_LEAN unset, "" or "1": the lean kernel takes the calls at N <= lean_max_n (the rule, this block
    shape; not one more), in both modes; "0" none; another value raises. (An invalid $PRUNEKIT_BSR_LEAN_WARPS raises
    only in the lean kernel.) The C++ rule lean_max_n is the Python one, with $PRUNEKIT_BSR_LEAN_MAX_N unset, 16, 32
    and "auto"; another value raises in both."""
    structured.load()
    for max_n in (None, "16", "32", "auto"):
        if max_n is None:
            monkeypatch.delenv(structured.LEAN_MAX_N_ENV, raising=False)
        else:
            monkeypatch.setenv(structured.LEAN_MAX_N_ENV, max_n)
        for r in (16, 32, 64):
            for c in (16, 32, 64):
                assert torch.ops.prunekit_structured.lean_max_n(r, c) == structured.lean_max_n(r, c), (max_n, r, c)
    monkeypatch.setenv(structured.LEAN_MAX_N_ENV, "8")
    with pytest.raises(ValueError, match="PRUNEKIT_BSR_LEAN_MAX_N"):
        structured.lean_max_n(16, 16)
    with pytest.raises(RuntimeError, match="PRUNEKIT_BSR_LEAN_MAX_N"):
        torch.ops.prunekit_structured.lean_max_n(16, 16)
    monkeypatch.delenv(structured.LEAN_MAX_N_ENV)
    top = structured.lean_max_n(32, 32)
    dense = block_sparse_weight(128, 256, 32, 32, 0.5, torch.float16, "cuda", seed=4)
    comp = {key: t.cuda() for key, t in _components(dense.cpu(), 32, 32).items()}
    sched = (comp["schedule"], comp["split_rows"]) if static else (None, None)

    def call(n):
        x = torch.randn(n, 256, device="cuda", dtype=torch.float16).t()
        return structured.bsr_mm_cuda(comp["blocks"], comp["crow_indices"], comp["col_indices"], x, 128, None,
                                      "none", *sched)  # fmt: skip

    monkeypatch.setenv(structured.LEAN_WARPS_ENV, "6")
    for setting in (None, "", "1", "0"):
        if setting is None:
            monkeypatch.delenv(structured.LEAN_ENV, raising=False)
        else:
            monkeypatch.setenv(structured.LEAN_ENV, setting)
        for n in (1, top, top + 1):
            if setting != "0" and n <= top:
                with pytest.raises(RuntimeError, match="PRUNEKIT_BSR_LEAN_WARPS"):
                    call(n)
            else:
                call(n)
    monkeypatch.setenv(structured.LEAN_ENV, "yes")
    with pytest.raises(RuntimeError, match="PRUNEKIT_BSR_LEAN must"):
        call(8)


@pytest.mark.cuda
def test_bsr_lean_decode_dynamic_reads_only_up_to_crow_end_and_rejects_bad_warps(monkeypatch):
    """Dynamic mode with a declared maximum (tail of NaN blocks and out-of-range columns) on the lean kernel; the eager
    entry and SparseLinear (static) on it; a bad $PRUNEKIT_BSR_LEAN_WARPS raises."""
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    _set_lean(monkeypatch, None)
    dense, blocks, crow, cols = _declared_maximum_case()
    for n in (1, 16):
        x2d = torch.randn(n, 256, device="cuda", dtype=torch.float16)
        ref = spmm_reference64(dense, x2d.t(), None, "none")
        assert relative_error(ops.bsr_mm(blocks, crow, cols, x2d.t(), 128), ref) < TOLERANCE[torch.float16], n
        y = structured.bsr_mm_eager(blocks, crow, cols, x2d.t(), 128)
        assert relative_error(y, ref) < TOLERANCE[torch.float16], n
    bias = torch.randn(128, dtype=torch.float16)
    layer = SparseLinear(formats.encode("bsr", dense.cpu(), {"block_rows": 32, "block_cols": 32}), bias).cuda()
    x = torch.randn(2, 5, 256, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        y = layer(x)
    ref = x.double().reshape(-1, 256) @ dense.double().t() + bias.double().cuda()
    assert relative_error(y.reshape(-1, 128), ref) < TOLERANCE[torch.float16]
    for bad in ("6", "4junk", "x"):
        monkeypatch.setenv(structured.LEAN_WARPS_ENV, bad)
        with pytest.raises(RuntimeError, match="PRUNEKIT_BSR_LEAN_WARPS"):
            ops.bsr_mm(blocks, crow, cols, torch.randn(256, 4, device="cuda", dtype=torch.float16), 128)


@pytest.mark.cuda
def test_bsr_cuda_dynamic_reads_only_up_to_crow_end():
    """Dynamic mode with a declared maximum: buffers larger than the pattern, tail filled with garbage."""
    dense, blocks, crow, cols = _declared_maximum_case()
    x2d = torch.randn(40, 256, device="cuda", dtype=torch.float16)
    y = ops.bsr_mm(blocks, crow, cols, x2d.t(), 128)
    assert relative_error(y, spmm_reference64(dense, x2d.t(), None, "none")) < TOLERANCE[torch.float16]


@pytest.mark.cuda
@pytest.mark.parametrize("transposed", [False, True])
def test_opcheck_bsr_cuda(transposed):
    dense = block_sparse_weight(64, 128, 16, 32, 0.4, torch.float16, "cuda", heavy_rows=1)
    comp = {key: t.cuda() for key, t in _components(dense.cpu(), 16, 32).items()}
    x2d = torch.randn(24, 128, device="cuda", dtype=torch.float16)
    x = x2d.t() if transposed else x2d.t().contiguous()
    bias = torch.randn(64, device="cuda", dtype=torch.float16)
    base = (comp["blocks"], comp["crow_indices"], comp["col_indices"])
    torch.library.opcheck(ops.bsr_mm, (*base, x, 64, bias, "relu"))
    torch.library.opcheck(structured.bsr_mm_static, (*base, comp["schedule"], comp["split_rows"], x, 64, bias, "relu"))


@pytest.mark.cuda
def test_sparse_linear_uses_static_bsr_on_cuda():
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    dense = block_sparse_weight(128, 256, 64, 64, 0.5, torch.float16, seed=5)
    layer = SparseLinear(formats.encode("bsr", dense, {"block_rows": 64, "block_cols": 64})).cuda()
    x = torch.randn(3, 5, 256, device="cuda", dtype=torch.float16)
    y = layer(x)
    assert y.shape == (3, 5, 128) and y.is_contiguous()
    ref = x.double().reshape(-1, 256) @ dense.double().cuda().t()
    assert relative_error(y.reshape(-1, 128), ref) < TOLERANCE[torch.float16]


# --- variants and the C++ eager entry -------------------------------------------------------------------------------

WGMMA_SHAPES = [(128, 3, 1), (192, 4, 7), (256, 2, 130), (320, 5, 300)]  # (M, K / c, N): odd N, N < and > one tile


def _single_block_weight(m, k, r, c, dtype):
    """``(m, k)`` with exactly one stored block, at block row 1, block column 1 (``m >= 2r``, ``k >= 2c``)."""
    dense = torch.zeros(m, k)
    dense[r : 2 * r, c : 2 * c] = torch.randn(r, c)
    return dense.to(dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("r", "xslabs"), [(16, "0"), (16, "1"), (32, "0"), (32, "1"), (64, "0"), (64, "1")])
# (64-row blocks with $PRUNEKIT_BSR_XSLABS=1: the launcher keeps TMA boxes for them)
@pytest.mark.parametrize("c", [16, 32, 64])
@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_bsr_wgmma_matches_float64(dtype, r, xslabs, c, mode, monkeypatch):
    """The sm_90a wgmma + TMA variant (64-row blocks as wgmma's A operand, 16 / 32 rows as its B operand, those with
    X through TMA boxes or through the X-slab copy, $PRUNEKIT_BSR_XSLABS): every tile, both epilogues, bias + ReLU,
    split rows, poisoned Y, and three X layouts: x2d.t(), a contiguous (K, N) (copied) and x2d.t() of a row-padded
    buffer (the TMA row stride > K)."""
    if not structured.wgmma_available():
        pytest.skip("needs an sm_90 GPU and a library built for sm_90a")
    monkeypatch.setenv(structured.XSLABS_ENV, xslabs)
    cases = [(m, kc * c, n, i) for i, (m, kc, n) in enumerate(WGMMA_SHAPES)]
    for m, k, n, i in cases + [(128, 2 * c, 9, -1)]:
        if i < 0:
            dense = _single_block_weight(m, k, r, c, dtype).cuda()  # one stored block in the whole matrix
        else:
            dense = block_sparse_weight(m, k, r, c, 0.35, dtype, "cuda", seed=i, heavy_rows=1 if m // r > 3 else 0)
        comp = {key: t.cuda() for key, t in _components(dense.cpu(), r, c).items()}
        extra = (None, None)
        if mode == "static":
            sched, split = (t.cuda() for t in static_schedule(comp["crow_indices"], chunk=1))
            extra = (sched, split)
        for x_layout in ("transposed", "contiguous", "padded"):
            transposed = x_layout != "contiguous"
            x2d = torch.randn(n, k + (8 if x_layout == "padded" else 0), device="cuda").to(dtype)[:, :k]
            x = x2d.t() if transposed else x2d.t().contiguous()
            bias = torch.randn(m, device="cuda").to(dtype)
            for activation, b in (("none", None), ("relu", bias)):
                ref = spmm_reference64(dense, x, b, activation)
                for tile_n in structured.WGMMA_TILE_NS:
                    for staged in (True, False):
                        out = _poisoned(m, n, dtype, transposed)
                        structured.bsr_mm_cuda(
                            comp["blocks"], comp["crow_indices"], comp["col_indices"], x, m, b, activation,
                            *extra, out=out, tile_n=tile_n, staged_epilogue=staged, variant="wgmma",
                        )  # fmt: skip
                        torch.cuda.synchronize()
                        err = relative_error(out, ref)
                        assert err < TOLERANCE[dtype], (m, k, n, x_layout, activation, tile_n, staged, err)


def _check_launch_settings(dtype, r, c, block_rows, empty, mode, names, settings, monkeypatch):
    """The wgmma kernel under each launch setting of ``settings`` (values of the environment variables ``names``; None
    unsets one) gives the output of the first setting bit for bit outside split rows (whose fp32 partial sums are added
    by atomics in any order), and matches float64 everywhere: a weight of ``block_rows`` block rows of ``r x c`` blocks
    with a heavy (split in static mode) row and the block rows ``empty`` (a range) zeroed besides row 0; N of 1 to 8
    tiles with a partial last one, X transposed or not, with and without bias + ReLU, both N tiles, both epilogues,
    Y poisoned first."""
    m, k = block_rows * r, 6 * c
    dense = block_sparse_weight(m, k, r, c, 0.3, dtype, "cuda", seed=r + c, heavy_rows=1)
    dense[empty.start * r : empty.stop * r] = 0
    comp = {key: t.cuda() for key, t in _components(dense.cpu(), r, c).items()}
    extra = (None, None)
    exact_rows = torch.ones(m, dtype=torch.bool, device="cuda")
    if mode == "static":
        extra = tuple(t.cuda() for t in static_schedule(comp["crow_indices"], chunk=2))
        assert extra[1].numel() > 0  # the heavy row is split
        for row in extra[1].tolist():
            exact_rows[row * r : (row + 1) * r] = False
    bias = torch.randn(m, device="cuda").to(dtype)
    for n in (1000, 130, 2):
        x2d = torch.randn(n, k, device="cuda").to(dtype)
        for transposed in (True, False):
            x = x2d.t() if transposed else x2d.t().contiguous()
            for activation, b in (("relu", bias), ("none", None)):
                ref = spmm_reference64(dense, x, b, activation)
                for tile_n in structured.WGMMA_TILE_NS:
                    for staged in (True, False):
                        outs = []
                        for setting in settings:
                            for name, value in zip(names, setting, strict=True):
                                if value is None:
                                    monkeypatch.delenv(name, raising=False)
                                else:
                                    monkeypatch.setenv(name, value)
                            out = _poisoned(m, n, dtype, transposed)
                            structured.bsr_mm_cuda(
                                comp["blocks"], comp["crow_indices"], comp["col_indices"], x, m, b, activation,
                                *extra, out=out, tile_n=tile_n, staged_epilogue=staged, variant="wgmma",
                            )  # fmt: skip
                            torch.cuda.synchronize()
                            outs.append(out)
                        for setting, out in zip(settings, outs, strict=True):
                            case = (n, transposed, activation, tile_n, staged, setting)
                            assert relative_error(out, ref) < TOLERANCE[dtype], case
                            assert torch.equal(out[exact_rows], outs[0][exact_rows]), case


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "r", "c", "xslabs"), [
    (torch.float16, 32, 32, "0"), (torch.float16, 32, 64, "1"), (torch.bfloat16, 32, 16, "0"),
    (torch.bfloat16, 16, 16, "1"), (torch.float16, 16, 32, "0"), (torch.float16, 16, 64, "0"),
])  # fmt: skip
@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_bsr_wgmma_tiles_per_cta_match_one_tile_per_cta(dtype, r, c, xslabs, mode, monkeypatch):
    """$PRUNEKIT_BSR_TILES_PER_CTA and $PRUNEKIT_BSR_STAGES (the 16- and 32-row kernel): CTAs of several output tiles
    (their pipeline running on across tiles, the Y^T staging tile of their own, empty block rows written straight from
    the bias), one wave of CTAs, and rings of two stages give the output of one tile per CTA bit for bit (split rows:
    within tolerance), and match float64 (_check_launch_settings). Tiles per CTA that divide the tiles, that do not,
    and more than there are."""
    if not (structured.wgmma_available() and (r, c) in structured.WGMMA_BLOCKS):
        pytest.skip("needs an sm_90 GPU, a library built for sm_90a and a block the wgmma kernels take")
    monkeypatch.setenv(structured.XSLABS_ENV, xslabs)
    settings = [("1", None), ("2", None), ("3", None), ("64", None), ("wave", None), ("3", "2"), ("1", "2")]
    names = (structured.TILES_PER_CTA_ENV, structured.STAGES_ENV)
    _check_launch_settings(dtype, r, c, 12, range(5, 8), mode, names, settings, monkeypatch)


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "c"), [(torch.float16, 64), (torch.float16, 32), (torch.bfloat16, 16)])
@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_bsr_wgmma_warp_producer_matches_warpgroup(dtype, c, mode, monkeypatch):
    """$PRUNEKIT_BSR_WARP_PRODUCER=1 (the 64-row kernel with a producer warp after its consumers, the launcher's stage
    count, empty block rows written straight from the bias) gives the output of the producer warpgroup bit for bit
    (split rows: within tolerance), and matches float64 (_check_launch_settings), at stages auto / 2 / 3 / 12 (raised
    to the fewest that hold the epilogue tile, capped at the most), and with $PRUNEKIT_BSR_WARP_TILE_N=64 (consumers
    of 64 tokens where the plan gives the 128 tile; no effect on the warpgroup or the 256 tile)."""
    if not (structured.wgmma_available() and (64, c) in structured.WGMMA_BLOCKS):
        pytest.skip("needs an sm_90 GPU, a library built for sm_90a and a block the wgmma kernels take")
    settings = [("0", None, None), ("1", None, None), ("1", "2", None), ("1", "3", None), ("1", "12", None)]
    settings += [("1", None, "64"), ("1", "3", "64"), ("1", "12", "64"), ("0", None, "64")]
    names = (structured.WARP_PRODUCER_ENV, structured.STAGES_ENV, structured.WARP_TILE_N_ENV)
    _check_launch_settings(dtype, 64, c, 10, range(4, 7), mode, names, settings, monkeypatch)


def test_tiles_per_cta_setting_is_checked(monkeypatch):
    """A $PRUNEKIT_BSR_TILES_PER_CTA outside auto / wave / 1-64, a $PRUNEKIT_BSR_STAGES outside auto / 2-12, a
    $PRUNEKIT_BSR_WARP_PRODUCER outside auto / 0 / 1, or a $PRUNEKIT_BSR_WARP_TILE_N outside auto / 64 / 128, is
    refused with one sentence that names it (by the C++ launcher, so only on a GPU with the wgmma kernels)."""
    assert (
        structured.TILES_PER_CTA_ENV,
        structured.STAGES_ENV,
        structured.WARP_PRODUCER_ENV,
        structured.WARP_TILE_N_ENV,
    ) == ("PRUNEKIT_BSR_TILES_PER_CTA", "PRUNEKIT_BSR_STAGES", "PRUNEKIT_BSR_WARP_PRODUCER", "PRUNEKIT_BSR_WARP_TILE_N")
    if not (torch.cuda.is_available() and structured.wgmma_available()):
        pytest.skip("the launcher's check needs the wgmma kernels")
    dense = block_sparse_weight(128, 128, 64, 64, 0.5, torch.float16, "cuda", seed=1)
    comp = {key: t.cuda() for key, t in _components(dense.cpu(), 64, 64).items()}
    x = torch.randn(300, 128, device="cuda", dtype=torch.float16).t()
    for env, bad in (
        (structured.TILES_PER_CTA_ENV, ("0", "65", "two", "1.5", "")),
        (structured.STAGES_ENV, ("1", "13")),
        (structured.WARP_PRODUCER_ENV, ("2", "yes")),
        (structured.WARP_TILE_N_ENV, ("32", "256")),
    ):
        for value in bad:
            if not value:  # "" is "auto": accepted
                continue
            monkeypatch.setenv(env, value)
            with pytest.raises(RuntimeError, match=env):
                structured.bsr_mm_cuda(
                    comp["blocks"], comp["crow_indices"], comp["col_indices"], x, 128, variant="wgmma"
                )
            monkeypatch.delenv(env)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["mma", "wgmma"])
@pytest.mark.parametrize(("r", "c"), [(16, 16), (32, 64), (64, 32), (64, 64)])
def test_bsr_eager_entry_matches_float64_and_layout_rule(variant, r, c, monkeypatch):
    """prunekit_structured::bsr_mm (the runtime's eager call): output strides by layout.py, X copied when needed."""
    monkeypatch.setenv(structured.EAGER_CPP_ENV, "1")
    if variant == "wgmma" and not (structured.wgmma_available() and (r, c) in structured.WGMMA_BLOCKS):
        pytest.skip("wgmma variant not available for this GPU/build/block")
    from prunekit.kernels.layout import new_spmm_output

    for i, (m, k, n) in enumerate([(4 * r, 3 * c, 1), (6 * r, 4 * c, 37), (4 * r, 2 * c, 300)]):
        dense = block_sparse_weight(m, k, r, c, 0.4, torch.float16, "cuda", seed=20 + i, heavy_rows=1)
        comp = {key: t.cuda() for key, t in _components(dense.cpu(), r, c).items()}
        x2d = torch.randn(n, k, device="cuda", dtype=torch.float16)
        bias = torch.randn(m, device="cuda", dtype=torch.float32)  # another dtype: converted in C++
        for x in (x2d.t(), x2d.t().contiguous(), torch.randn(k, 2 * n, device="cuda").half()[:, ::2]):
            for sched in ((None, None), (comp["schedule"], comp["split_rows"])):
                y = structured.bsr_mm_eager(
                    comp["blocks"], comp["crow_indices"], comp["col_indices"], x, m, bias, "relu", *sched,
                    variant=variant,
                )  # fmt: skip
                torch.cuda.synchronize()
                assert y.stride() == new_spmm_output(x, m).stride()
                err = relative_error(y, spmm_reference64(dense, x, bias.half(), "relu"))
                assert err < TOLERANCE[torch.float16], (m, k, n, x.stride(), err)


@pytest.mark.cuda
def test_plan_tile_n_cpp_matches_python():
    structured.load()
    for m in (64, 4096, 16384):
        for r in (16, 32, 64):
            for n in (1, 32, 33, 2048, 8192):
                for nblocks in (m // r * 3, m // r * 26):
                    assert torch.ops.prunekit_structured.plan_tile_n(m, r, n, 132, nblocks) == structured.plan_tile_n(
                        m, r, n, 132, nblocks
                    )


def test_lean_warps_by_strips_per_sm():
    assert structured.lean_warps(4096, 132) == 8  # 256 strips: under two per SM
    assert structured.lean_warps(11008, 132) == 4  # 688 strips
    assert structured.lean_warps(16 * 264, 132) == 8 and structured.lean_warps(16 * 265, 132) == 4
    assert structured.lean_warps(4096, 132, 16) == 8 and structured.lean_warps(4096, 132, 17) == 4  # N > 16: 4


@pytest.mark.cuda
def test_lean_warps_cpp_matches_python():
    structured.load()
    for m in (16, 64, 4096, 4224, 4240, 11008, 16384):
        for sms in (1, 78, 132):
            assert torch.ops.prunekit_structured.lean_warps(m, sms) == structured.lean_warps(m, sms), (m, sms)
            for n in (1, 16, 17, 32):
                cpp = torch.ops.prunekit_structured.lean_warps(m, sms, n)
                assert cpp == structured.lean_warps(m, sms, n), (m, sms, n)


@pytest.mark.cuda
def test_plan_tile_n_wgmma_cpp_matches_python():
    structured.load()
    for m in (64, 3072, 4096, 11008, 16384):
        for r in (16, 32, 64):
            for n in (1, 128, 129, 2048, 4096, 8192):
                rows = m // r
                for nblocks in (0, rows // 2, rows, rows * 3, rows * 4, rows * 4 + 1, rows * 9, rows * 10, rows * 26):
                    cpp = torch.ops.prunekit_structured.plan_tile_n_wgmma(m, r, n, 132, nblocks)
                    assert cpp == structured.plan_tile_n_wgmma(m, r, n, 132, nblocks), (m, r, n, nblocks)
                    cpp = torch.ops.prunekit_structured.short_rows(m, r, nblocks)
                    assert cpp == structured.short_rows(m, r, nblocks), (m, r, nblocks)
                    cpp = torch.ops.prunekit_structured.warp_tile_n_rule(m, r, nblocks)
                    assert cpp == structured.warp_tile_n_rule(m, r, nblocks), (m, r, nblocks)
                    for tile_n in (128, 256):
                        cpp = torch.ops.prunekit_structured.warp_producer_rule(m, r, n, nblocks, tile_n, 132)
                        py = structured.warp_producer_rule(m, r, n, nblocks, tile_n, 132)
                        assert cpp == py, (m, r, n, nblocks, tile_n)


@pytest.mark.cuda
def test_sparse_linear_16_row_blocks_leave_auto_to_the_cpp_entry(monkeypatch):
    """16-row blocks: where the wgmma variant is available the runtime keeps "auto" unresolved (the C++ entry takes
    wgmma from N = AUTO_WGMMA_16_MIN_N), and the layer matches float64 on both sides of that N."""
    monkeypatch.delenv(structured.BSR_VARIANT_ENV, raising=False)
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    dense = block_sparse_weight(256, 192, 16, 16, 0.5, torch.float16, seed=5, heavy_rows=1)
    enc = formats.encode("bsr", dense, {"block_rows": 16, "block_cols": 16})
    bias = torch.randn(256).half()
    layer = SparseLinear(enc, bias).cuda()
    lo = structured.AUTO_WGMMA_16_MIN_N
    for tokens in (5, lo - 1, lo, 300):
        x = torch.randn(tokens, 192, device="cuda", dtype=torch.float16)
        ref = x.double() @ dense.double().cuda().t() + bias.double().cuda()
        assert relative_error(layer(x), ref) < TOLERANCE[torch.float16], tokens
    want = structured.VARIANTS["auto"] if structured.wgmma_available() else structured.VARIANTS["mma"]
    assert layer._eager_plans and all(
        entry is not None and entry[1] == want | structured.ROWS for entry in layer._eager_plans.values()
    )


@pytest.mark.cuda
@pytest.mark.parametrize("static", [True, False])
def test_sparse_linear_eager_bsr_goes_through_the_cpp_entry(static, monkeypatch):
    monkeypatch.setenv(structured.EAGER_CPP_ENV, "1")
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    # a heavy block row of 12 blocks, the others about 2: the stored schedule splits it (384 columns: it does not pay)
    dense = block_sparse_weight(256, 384, 32, 32, 0.2, torch.float16, seed=7, heavy_rows=1)
    enc = formats.encode("bsr", dense, {"block_rows": 32, "block_cols": 32})
    assert enc.components["split_rows"].numel() > 0
    if not static:
        enc = formats.EncodedTensor(
            enc.format, enc.shape, enc.dtype, enc.params,
            {k: v for k, v in enc.components.items() if k not in ("schedule", "split_rows")},
        )  # fmt: skip
    bias = torch.randn(256).half()
    layer = SparseLinear(enc, bias).cuda()
    for tokens in (1, 5, 70, 300, 1100):
        x = torch.randn(tokens, 384, device="cuda", dtype=torch.float16)
        y = layer(x)
        assert y.shape == (tokens, 256) and y.is_contiguous()
        ref = x.double() @ dense.double().cuda().t() + bias.double().cuda()
        assert relative_error(y, ref) < TOLERANCE[torch.float16]
    # the C++ entry was taken (a None plan would mean the Python fallback), with the variant "auto" resolves to
    # for these blocks: the runtime stores the resolved number (mma or wgmma), never VARIANTS["auto"]
    blocks = layer._buffers["w_blocks"]
    auto = structured.VARIANTS["wgmma"] if structured.auto_takes_wgmma(blocks) else structured.VARIANTS["mma"]
    expected = auto if structured.bsr_variant() == "auto" else structured.VARIANTS[structured.bsr_variant()]
    wgmma = expected == structured.VARIANTS["wgmma"]  # the wgmma kernel keeps the stored schedule
    # one decision per N class, each the entry, the variant with ROWS, and which schedule goes with the call (this file
    # turns the lean kernel off, conftest.tiled_bsr_kernel: the finer one in static mode at N <= DECODE_MAX_N)
    # N = 70, 300 and 1100: split_n_class's three classes above DECODE_MAX_N (keys 0, -1, -2)
    assert sorted(key[2] for key in layer._eager_plans) == [-2, -1, 0, 1, 5]
    for key, (op, variant, sched) in layer._eager_plans.items():
        assert (
            op is fastcall.entry("bsr_mm") and variant == expected | structured.ROWS
        )  # the fast entry where it builds
        # 0: the stored schedule (or none in dynamic mode), 1: the finer decode schedule, 2: none (the lean kernel),
        # 3: the stored items unsplit (static mode: the split does not pay for a row of 384 columns)
        n = key[2]
        if structured.lean_takes(blocks, n):
            want = 2
        elif static and 0 < n and structured.finer_decode_schedule(blocks, n, wgmma):
            want = 1
        else:
            want = 3 if static else 0
        assert sched == want, (key, sched)
    assert expected != structured.VARIANTS["auto"]


@pytest.mark.cuda
@pytest.mark.parametrize("decode_schedule", ["1", "0"])
def test_static_bsr_decode_schedule_matches_float64(decode_schedule, monkeypatch):
    """Static mode with 32-row blocks at N <= 32 (the decode schedule: block rows split, an fp32 reduction and the
    finishing kernel) and above, through the static op (bias + ReLU) and SparseLinear (bias); N = 1, 5, 16, 32, 33.
    (The kernel's split rows on NaN-poisoned outputs: test_bsr_cuda_matches_float64's chunk-1 schedules.) The finer
    schedule goes with the mma.sync kernel only (the wgmma one keeps the stored schedule), so mma is forced here."""
    monkeypatch.setenv(structured.DECODE_SCHEDULE_ENV, decode_schedule)
    monkeypatch.setenv(structured.BSR_VARIANT_ENV, "mma")
    from prunekit.deploy.runtime.sparse_linear import SparseLinear

    dense = block_sparse_weight(640, 384, 32, 32, 0.4, torch.float16, seed=11, heavy_rows=2)
    enc = formats.encode("bsr", dense, {"block_rows": 32, "block_cols": 32})
    comp = {k: v.cuda() for k, v in enc.components.items()}
    bias = torch.randn(640, device="cuda").half()
    layer = SparseLinear(enc, bias.cpu()).cuda()
    for n in (1, 5, 16, 32, 33):
        x2d = torch.randn(n, 384, device="cuda").half()
        y = structured.bsr_mm_static(
            comp["blocks"], comp["crow_indices"], comp["col_indices"], comp["schedule"], comp["split_rows"],
            x2d.t(), 640, bias, "relu",
        )  # fmt: skip
        assert relative_error(y, spmm_reference64(dense.cuda(), x2d.t(), bias, "relu")) < TOLERANCE[torch.float16], n
        ref = x2d.double() @ dense.double().cuda().t() + bias.double()
        assert relative_error(layer(x2d), ref) < TOLERANCE[torch.float16], n
    kept = hasattr(comp["crow_indices"], "_prunekit_bsr_decode_schedule")
    assert kept == (decode_schedule == "1")


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["mma", "wgmma"])
@pytest.mark.parametrize(("r", "c"), BLOCKS)
def test_bsr_cuda_single_block_matrix(variant, r, c):
    """One stored block in the whole weight (every other block row empty: bias + ReLU only), poisoned outputs."""
    if variant == "wgmma" and not (structured.wgmma_available() and (r, c) in structured.WGMMA_BLOCKS):
        pytest.skip("wgmma variant not available for this GPU/build/block")
    m, k = 3 * r, 3 * c
    dense = _single_block_weight(m, k, r, c, torch.float16).cuda()
    comp = {key: t.cuda() for key, t in _components(dense.cpu(), r, c).items()}
    assert comp["blocks"].shape[0] == 1
    bias = torch.randn(m, device="cuda", dtype=torch.float16)
    for n in (1, 9, 257):
        x2d = torch.randn(n, k, device="cuda", dtype=torch.float16)
        ref = spmm_reference64(dense, x2d.t(), bias, "relu")
        for sched in ((None, None), (comp["schedule"], comp["split_rows"])):
            out = _poisoned(m, n, torch.float16, True)
            structured.bsr_mm_cuda(
                comp["blocks"], comp["crow_indices"], comp["col_indices"], x2d.t(), m, bias, "relu", *sched,
                out=out, variant=variant,
            )  # fmt: skip
            torch.cuda.synchronize()
            assert relative_error(out, ref) < TOLERANCE[torch.float16], (n, sched[0] is None)


@pytest.mark.cuda
def test_x_slabs_rule_is_the_launchers():
    """structured.x_slabs_rule against the C++ launcher's rule (prunekit_structured::x_slabs_rule)."""
    structured.load()
    for r, c in ((16, 16), (32, 32), (32, 64), (64, 64)):
        for k in (768, 4096, 16384):
            for nblocks in (0, 100, 1638, 3277, 26214, 104858):
                for n in (17, 128, 1023, 1024, 8192):
                    want = structured.x_slabs_rule(r, c, k, nblocks, n)
                    assert torch.ops.prunekit_structured.x_slabs_rule(r, c, k, nblocks, n) == want, (
                        r,
                        c,
                        k,
                        nblocks,
                        n,
                    )
