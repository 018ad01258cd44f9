"""Tensor-core SpMM (``spmm_tc_plan.py`` + ``csrc/spmm_tc.cu``).

CPU (CI): the condensed-window plan multiplied by its pure-torch emulation (fragment order decoded, gathered slot
rows, padding, row order) against float64, plus the plan's invariants; and ``replay_tc_kernel``, which replays the
kernel lane by lane (swizzled staging, ldmatrix.trans row addresses, PTX fragment tables, grid, epilogue stores)
against float64 with every output element stored exactly once. CUDA (``@pytest.mark.cuda``): the kernel against
float64 with NaN-poisoned outputs, every tile, both X layouts, fp16/bf16, bias + ReLU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prunekit.kernels import gpu
from prunekit.kernels.spmm_tc_plan import (
    K_CHUNK,
    K_STEP,
    WINDOW_ROWS,
    _mma_a_coords,
    _mma_b_coords,
    _mma_c_coords,
    build_tc_plan,
    fragment_index,
    get_tc_plan,
    replay_tc_kernel,
    spectral_row_order,
    tc_plan_matmul,
)
from prunekit.kernels.testing import (
    SPMM_EDGE_CASES,
    TOLERANCE,
    encode_csr,
    random_spmm_case,
    relative_error,
    spmm_reference64,
)

DTYPES = [torch.float16, torch.bfloat16]
# testing.SPMM_EDGE_CASES, each with an N: 1, odd, not multiples of 8 / 16 / 128, up to 512.
SHAPES = [
    (m, k, n, sp, e) for (m, k, sp, e), n in zip(SPMM_EDGE_CASES, (1, 5, 3, 17, 129, 260, 72, 33, 512), strict=True)
]


def _plan(c, m, k, row_order=None):
    return build_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k, row_order)


# ----------------------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n,sparsity,empty_rows", SHAPES)
def test_tc_plan_emulation_matches_float64_reference(dtype, m, k, n, sparsity, empty_rows):
    dense, c, x2d, bias = random_spmm_case(m, k, n, sparsity, empty_rows, dtype, m + k + n)
    plan = _plan(c, m, k)
    for b, activation in ((bias, "relu"), (None, "none")):
        y = tc_plan_matmul(plan, x2d.t(), b, activation)
        ref = spmm_reference64(dense, x2d.t(), b, activation)
        # Products of fp16/bf16 values summed in float64: only the summation order differs from the reference.
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("m,k,n,sparsity,empty_rows", [(77, 203, 17, 0.8, 2), (130, 600, 9, 0.95, 20)])
def test_tc_plan_row_order_permutes_windows_and_keeps_the_product(m, k, n, sparsity, empty_rows):
    dense, c, x2d, bias = random_spmm_case(m, k, n, sparsity, empty_rows, torch.float16, 7)
    order = torch.randperm(m, generator=torch.Generator().manual_seed(3))
    plan = _plan(c, m, k, order)
    assert torch.equal(plan.window_rows[:m].long(), order)
    assert (plan.window_rows[m:] == -1).all()
    y = tc_plan_matmul(plan, x2d.t(), bias, "relu")
    torch.testing.assert_close(y, spmm_reference64(dense, x2d.t(), bias, "relu"), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("m,k,empty_rows", [(1, 30, 0), (17, 40, 2), (130, 600, 20), (77, 203, 2)])
def test_spectral_row_order_is_a_permutation(m, k, empty_rows):
    _, c, _, _ = random_spmm_case(m, k, 1, 0.9, empty_rows, torch.float16, 5)
    order = spectral_row_order(c["row_offsets"], c["column_indices"], m, k)
    assert order.dtype == torch.int64 and torch.equal(torch.sort(order).values, torch.arange(m))


def _planted_groups(groups=8, per_group=WINDOW_ROWS, k=512, used=24, seed=0):
    """Rows in ``groups`` groups of identical column sets, shuffled: identity windows mix groups."""
    g = torch.Generator().manual_seed(seed)
    m = groups * per_group
    sets = torch.stack([torch.randperm(k, generator=g)[:used] for _ in range(groups)])
    pattern = torch.zeros(m, k, dtype=torch.bool)
    pattern[torch.arange(m)[:, None], sets.repeat_interleave(per_group, 0)] = True
    shuffle = torch.randperm(m, generator=g)
    dense = (torch.randn(m, k, generator=g) * pattern[shuffle]).half()
    return dense, m, k


def test_spectral_row_order_recovers_planted_windows_and_get_tc_plan_keeps_it():
    dense, m, k = _planted_groups()
    c = encode_csr(dense)
    identity = _plan(c, m, k)
    order = spectral_row_order(c["row_offsets"], c["column_indices"], m, k)
    windows = (dense[order] != 0).view(m // WINDOW_ROWS, WINDOW_ROWS, k)
    assert (windows == windows[:, :1]).all()  # every window holds one group: its rows share one column set
    reordered = _plan(c, m, k, order)
    assert reordered.ksteps < identity.ksteps
    chosen = get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k, reorder=True)
    assert chosen.ksteps == reordered.ksteps and torch.equal(chosen.window_rows, reordered.window_rows)
    g = torch.Generator().manual_seed(1)
    x2d, bias = torch.randn(9, k, generator=g).half(), torch.randn(m, generator=g).half()
    y = tc_plan_matmul(chosen, x2d.t(), bias, "relu")
    torch.testing.assert_close(y, spmm_reference64(dense, x2d.t(), bias, "relu"), rtol=1e-12, atol=1e-9)


def test_greedy_window_order_recovers_planted_windows_from_any_start_and_is_a_permutation():
    from prunekit.kernels.spmm_tc_plan import greedy_window_order

    dense, m, k = _planted_groups(seed=3)
    c = encode_csr(dense)
    for start in (torch.arange(m), torch.randperm(m, generator=torch.Generator().manual_seed(4))):
        order = greedy_window_order(c["row_offsets"], c["column_indices"], m, k, start)
        assert torch.equal(torch.sort(order).values, torch.arange(m))
        windows = (dense[order] != 0).view(m // WINDOW_ROWS, WINDOW_ROWS, k)
        assert (windows == windows[:, :1]).all()  # a window's seed pulls in the 15 rows that add no column
    # ragged M over several blocks (the last one partly padding): still a permutation
    _, c2, _, _ = random_spmm_case(45, 300, 1, 0.9, 0, torch.float16, 6)
    for block in (16, 32, 256):
        order = greedy_window_order(c2["row_offsets"], c2["column_indices"], 45, 300, torch.arange(45), block=block)
        assert torch.equal(torch.sort(order).values, torch.arange(45)), block
    # windows never straddle blocks: block 16 keeps each window's rows inside its own 16 rows of the start order
    order = greedy_window_order(c2["row_offsets"], c2["column_indices"], 45, 300, torch.arange(45), block=16)
    assert torch.equal(torch.sort(order[:16]).values, torch.arange(16))
    with pytest.raises(ValueError, match="multiple"):
        greedy_window_order(c2["row_offsets"], c2["column_indices"], 45, 300, torch.arange(45), block=24)


def test_greedy_refinement_never_loses_k_steps_in_get_tc_plan_on_random_patterns():
    from prunekit.kernels.spmm_tc_plan import greedy_window_order

    _, c, _, _ = random_spmm_case(256, 1024, 1, 0.9, 0, torch.float16, 8)
    spectral = spectral_row_order(c["row_offsets"], c["column_indices"], 256, 1024)
    refined = greedy_window_order(c["row_offsets"], c["column_indices"], 256, 1024, spectral)
    best = min(_plan(c, 256, 1024, o).ksteps for o in (None, spectral, refined))
    chosen = get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], 256, 1024, reorder=True)
    assert chosen.ksteps == best


def test_get_tc_plan_reorder_off_keeps_the_identity_order(monkeypatch):
    dense, m, k = _planted_groups(seed=2)
    c = encode_csr(dense)
    off = get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k, reorder=False)
    assert torch.equal(off.window_rows[:m].long(), torch.arange(m))
    c2 = encode_csr(dense)
    monkeypatch.setenv("PRUNEKIT_TC_REORDER", "0")
    by_env = get_tc_plan(c2["values"], c2["row_offsets"], c2["column_indices"], m, k)
    assert torch.equal(by_env.window_rows[:m].long(), torch.arange(m))
    monkeypatch.setenv("PRUNEKIT_TC_REORDER", "1")
    on = get_tc_plan(c2["values"], c2["row_offsets"], c2["column_indices"], m, k)
    assert on.ksteps < by_env.ksteps  # a new key (reorder flag): rebuilt, reordered


def test_spectral_row_order_refuses_patterns_too_large(monkeypatch):
    from prunekit.kernels import spmm_tc_plan

    _, c, _, _ = random_spmm_case(40, 100, 1, 0.9, 0, torch.float16, 5)
    monkeypatch.setattr(spmm_tc_plan, "REORDER_MAX_ELEMENTS", 40 * 100 - 1)
    with pytest.raises(ValueError, match="above"):
        spectral_row_order(c["row_offsets"], c["column_indices"], 40, 100)


def test_tc_plan_shapes_and_segment_offsets():
    m, k = 45, 700
    _, c, _, _ = random_spmm_case(m, k, 1, 0.9, 2, torch.float16, 1)
    plan = _plan(c, m, k)
    windows, chunks = -(-m // WINDOW_ROWS), -(-k // K_CHUNK)
    assert (plan.num_windows, plan.num_chunks) == (windows, chunks)
    assert plan.kstep_offsets.shape == (windows * chunks + 1,) and plan.kstep_offsets.dtype == torch.int32
    assert int(plan.kstep_offsets[0]) == 0 and int(plan.kstep_offsets[-1]) == plan.ksteps
    assert (plan.kstep_offsets[1:] >= plan.kstep_offsets[:-1]).all()
    assert plan.frag_values.shape == (plan.ksteps, 32, 8) and plan.frag_values.dtype == torch.float16
    assert plan.slot_rows.shape == (plan.ksteps, K_STEP) and plan.slot_rows.dtype == torch.uint8
    assert plan.window_rows.shape == (windows * WINDOW_ROWS,)
    # Stored weights: exactly the real non-zeros (padding entries of the CSR are dropped).
    assert int((plan.frag_values != 0).sum()) == int((c["values"] != 0).sum())


def test_tc_plan_slots_of_a_segment_are_distinct_rows_of_its_union():
    m, k = 32, 512
    dense, c, _, _ = random_spmm_case(m, k, 1, 0.95, 0, torch.float16, 2)
    plan = _plan(c, m, k)
    for seg in range(plan.num_windows * plan.num_chunks):
        w, ch = divmod(seg, plan.num_chunks)
        t0, t1 = int(plan.kstep_offsets[seg]), int(plan.kstep_offsets[seg + 1])
        used = (dense[w * 16 : (w + 1) * 16, ch * K_CHUNK : (ch + 1) * K_CHUNK] != 0).any(0)
        union = set(torch.nonzero(used).squeeze(1).tolist())
        assert t1 - t0 == -(-len(union) // K_STEP)
        rows = plan.slot_rows[t0:t1].flatten().tolist()
        assert union <= set(rows)  # every union column has a slot (padding slots may repeat rows)
        assert len([r for r in rows if r in union]) >= len(union)


def test_tc_plan_dense_chunks_are_conflict_free():
    m, k = 48, 512
    _, c, _, _ = random_spmm_case(m, k, 1, 0.0, 0, torch.float16, 4)
    plan = _plan(c, m, k)
    assert plan.compute_fraction == 1.0
    assert plan.conflict_factor == 1.0
    groups = (plan.slot_rows.long() % 8).view(-1, 8)
    assert (groups.sort(1).values == torch.arange(8)).all()


@pytest.mark.parametrize("sparsity", [0.7, 0.9, 0.95, 0.98])
def test_tc_plan_slot_order_conflicts_only_where_a_residue_outnumbers_the_groups(sparsity):
    # Per segment: G = 2 k-steps groups of 8 slots; a residue with c > G columns cannot avoid c - G repeats. The slot
    # order must keep every other group conflict-free and add at most one wavefront per excess column.
    m, k = 64, 1000
    dense, c, _, _ = random_spmm_case(m, k, 1, sparsity, 0, torch.float16, 7)
    plan = _plan(c, m, k)
    for seg in range(plan.num_windows * plan.num_chunks):
        w, ch = divmod(seg, plan.num_chunks)
        t0, t1 = int(plan.kstep_offsets[seg]), int(plan.kstep_offsets[seg + 1])
        used = (dense[w * 16 : (w + 1) * 16, ch * K_CHUNK : (ch + 1) * K_CHUNK] != 0).any(0)
        residue_counts = torch.bincount(torch.nonzero(used).squeeze(1) % 8, minlength=8)
        groups = 2 * (t1 - t0)
        excess = int((residue_counts - groups).clamp_min(0).sum())
        rows = plan.slot_rows[t0:t1].long().view(-1, 8) % 8
        per_group = torch.zeros(rows.shape[0], 8, dtype=torch.long).scatter_add_(1, rows, torch.ones_like(rows))
        extra = int((per_group.max(1).values - 1).sum())
        assert extra <= excess, (seg, extra, excess)
        if excess == 0:
            assert extra == 0


def test_tc_plan_compute_fraction_follows_the_union_density():
    m, k, sparsity = 256, 2048, 0.95
    _, c, _, _ = random_spmm_case(m, k, 1, sparsity, 0, torch.float16, 5)
    plan = _plan(c, m, k)
    union = 1 - sparsity**WINDOW_ROWS  # random pattern: expected union fraction of a 16-row window
    # Padding adds less than one k-step (16 of 256 columns) per segment.
    assert union - 0.02 <= plan.compute_fraction <= union + K_STEP / K_CHUNK + 0.02
    assert 1.0 <= plan.conflict_factor < 2.0


def test_fragment_index_is_a_bijection_onto_lanes_and_elements():
    r = torch.arange(16)
    lane, elem = fragment_index(r[:, None], r[None, :])
    flat = (lane * 8 + elem).flatten()
    assert torch.equal(flat.sort().values, torch.arange(256))
    # PTX m16n8k16 A fragment: a0/a1 hold row groupID, columns 2 * (lane % 4) + {0, 1}.
    assert lane[5, 3].item() == 5 * 4 + 1 and elem[5, 3].item() == 1
    assert lane[13, 10].item() == 5 * 4 + 1 and elem[13, 10].item() == 6


def test_get_tc_plan_caches_per_weight_and_rebuilds_after_in_place_change():
    m, k = 40, 300
    _, c, _, _ = random_spmm_case(m, k, 1, 0.9, 0, torch.float16, 6)
    first = get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k)
    assert get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k) is first
    c["values"].mul_(2)
    second = get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k)
    assert second is not first
    assert torch.equal(second.frag_values, first.frag_values * 2)


def test_tc_plan_rejects_bad_inputs():
    _, c, _, _ = random_spmm_case(10, 20, 1, 0.5, 0, torch.float16, 8)
    with pytest.raises(ValueError, match="permutation"):
        _plan(c, 10, 20, torch.zeros(10, dtype=torch.int64))
    with pytest.raises(ValueError, match="M \\+ 1"):
        _plan(c, 11, 20)
    with pytest.raises(ValueError, match="out of range"):
        _plan(c, 10, 3)


def test_get_tc_plan_rebuilds_after_in_place_row_offsets_change():
    m, k = 20, 64
    dense = torch.zeros(m, k, dtype=torch.float16)
    dense[0, :4] = 1.0
    c = encode_csr(dense)
    first = get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k)
    # Move row 0's entries to row 1 in place (same values, same column indices, same pointers).
    c["row_offsets"][1] = 0
    second = get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k)
    assert second is not first
    moved = dense.roll(1, 0)
    torch.testing.assert_close(tc_plan_matmul(second, torch.eye(k)), moved.double())


def test_get_tc_plan_rebuilds_after_the_values_storage_is_swapped():
    m, k = 40, 300
    _, c, _, _ = random_spmm_case(m, k, 1, 0.9, 0, torch.float16, 10)
    values = c["values"]
    first = get_tc_plan(values, c["row_offsets"], c["column_indices"], m, k)
    values.data = values.detach() * 3  # new storage, same tensor object (and so the same cache attribute)
    second = get_tc_plan(values, c["row_offsets"], c["column_indices"], m, k)
    assert second is not first and torch.equal(second.frag_values, first.frag_values * 3)


def test_get_tc_plan_takes_inference_tensors():
    m, k = 24, 100
    with torch.inference_mode():
        _, c, x2d, _ = random_spmm_case(m, k, 5, 0.8, 0, torch.float16, 9)
        plan = get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k)
        assert get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k) is plan
    assert plan.num_windows == 2


# ------------------------------------------------------------------------------------ lane-by-lane kernel replay


def test_mma_fragment_tables_are_bijections_and_fragment_index_inverts_the_a_table():
    lane = torch.arange(32)[:, None]
    for coords, regs, shape in ((_mma_a_coords, 8, (16, 16)), (_mma_b_coords, 4, (16, 8)), (_mma_c_coords, 4, (16, 8))):
        row, col = coords(lane, torch.arange(regs)[None, :])
        flat = (row * shape[1] + col).flatten()
        assert torch.equal(flat.sort().values, torch.arange(shape[0] * shape[1])), coords.__name__
    # PTX ISA figure values: lane 5 (groupID 1, tig 1) holds a0 at (1, 2), a3 at (9, 3), a6 at (9, 10); b2 at
    # (k 10, n 1); c3 at (9, 3).
    a_row, a_col = _mma_a_coords(torch.tensor(5), torch.tensor([0, 3, 6]))
    assert a_row.tolist() == [1, 9, 9] and a_col.tolist() == [2, 3, 10]
    assert [int(v) for v in _mma_b_coords(torch.tensor(5), torch.tensor(2))] == [10, 1]
    assert [int(v) for v in _mma_c_coords(torch.tensor(5), torch.tensor(3))] == [9, 3]
    # The plan's encoder (fragment_index: (row, slot) -> (lane, element)) is the inverse of the PTX A table.
    r = torch.arange(16)
    f_lane, f_elem = fragment_index(r[:, None].expand(16, 16), r[None, :].expand(16, 16))
    row, col = _mma_a_coords(f_lane, f_elem)
    assert torch.equal(row, r[:, None].expand(16, 16)) and torch.equal(col, r[None, :].expand(16, 16))


def _check_replay(plan, dense, x, bias, activation, tile):
    replay = replay_tc_kernel(plan, x, bias, activation, *tile)
    assert (replay.writes == 1).all(), f"tile {tile}: some outputs stored {replay.writes.min()}..{replay.writes.max()}"
    torch.testing.assert_close(replay.y, spmm_reference64(dense, x, bias, activation), rtol=1e-12, atol=1e-9)
    return replay


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_tc_kernel_replay_matches_float64_and_stores_every_output_once(dtype, case):
    m, k, n, sparsity, empty_rows = SHAPES[case]
    tile = gpu.TC_TILES[case % len(gpu.TC_TILES)]
    dense, c, x2d, bias = random_spmm_case(m, k, n, sparsity, empty_rows, dtype, m + k + n)
    plan = _plan(c, m, k)
    replay = _check_replay(plan, dense, x2d.t(), bias if case % 2 else None, "relu" if case % 2 else "none", tile)
    # Distinct rows in one bank line position serialise; equal addresses broadcast, so the replay's count is at
    # most the plan's (which counts repeated residues).
    assert 1.0 <= replay.wavefronts <= plan.conflict_factor + 1e-12


@pytest.mark.parametrize("tile", gpu.TC_TILES)
def test_tc_kernel_replay_every_tile_with_row_order_and_k_zero(tile):
    m, k, n = 70, 530, 150  # partial last window, three chunks (last partial), N not a multiple of 8 or of NT
    dense, c, x2d, bias = random_spmm_case(m, k, n, 0.9, 18, torch.float16, 21)
    order = torch.randperm(m, generator=torch.Generator().manual_seed(1))
    _check_replay(_plan(c, m, k, order), dense, x2d.t(), bias, "relu", tile)
    empty = encode_csr(torch.zeros(m, 0, dtype=torch.float16))
    plan = build_tc_plan(empty["values"], empty["row_offsets"], empty["column_indices"], m, 0)
    _check_replay(plan, torch.zeros(m, 0, dtype=torch.float16), torch.zeros(0, 9), bias, "relu", tile)


def test_tc_kernel_replay_dense_weight_is_conflict_free():
    m, k = 48, 512
    dense, c, x2d, _ = random_spmm_case(m, k, 64, 0.0, 0, torch.float16, 4)
    assert _check_replay(_plan(c, m, k), dense, x2d.t(), None, "none", (1, 64)).wavefronts == 1.0


def test_tc_kernel_replay_detects_register_and_gather_mixups():
    m, k, n = 40, 300, 24
    dense, c, x2d, bias = random_spmm_case(m, k, n, 0.7, 0, torch.float16, 5)
    plan = _plan(c, m, k)
    ref = spmm_reference64(dense, x2d.t(), None, "none")
    # A registers a.y and a.z swapped (rows 8-15 / k 0-7 exchanged with rows 0-7 / k 8-15).
    swapped = plan.frag_values[:, :, [0, 1, 4, 5, 2, 3, 6, 7]].contiguous()
    bad = replay_tc_kernel(dataclasses.replace(plan, frag_values=swapped), x2d.t())
    assert relative_error(bad.y, ref) > 0.1
    # ldmatrix matrices 0/1 addressed with the other half's slots (lanes 0-7 <-> 8-15).
    halves = plan.slot_rows[:, list(range(8, 16)) + list(range(8))].contiguous()
    bad = replay_tc_kernel(dataclasses.replace(plan, slot_rows=halves), x2d.t())
    assert relative_error(bad.y, ref) > 0.1


def test_tc_kernel_replay_rejects_tiles_the_kernel_cannot_have():
    _, c, x2d, _ = random_spmm_case(16, 20, 4, 0.5, 0, torch.float16, 8)
    with pytest.raises(ValueError, match="multiple of 64"):
        replay_tc_kernel(_plan(c, 16, 20), x2d.t(), ntile=32)
    with pytest.raises(ValueError, match="K = 20"):
        replay_tc_kernel(_plan(c, 16, 20), torch.zeros(21, 4))


def test_plan_spmm_takes_tensor_cores_only_for_16_bit_large_n(monkeypatch):
    monkeypatch.setenv(gpu.TC_AUTO_ENV, "1")
    monkeypatch.setenv(gpu.DENSE_AUTO_ENV, "0")  # the dense rule over tc's range: test_spmm_dense.py
    monkeypatch.setenv(gpu.BITMAP_AUTO_ENV, "0")  # the bitmap rule up to N = 256: test_spmm_bitmap.py
    assert gpu.plan_spmm(4096, 4096, 4096, 2 * 10**6, 132, "auto", torch.float16) == gpu.SpmmPlan(
        "tc", ntile=128, windows_per_warp=2
    )
    assert gpu.plan_spmm(768, 3072, 128, 10**6, 132, "auto", torch.bfloat16) == gpu.SpmmPlan(
        "tc", ntile=64, windows_per_warp=1
    )
    assert gpu.plan_spmm(4096, 4096, 4096, 10**6, 132, "auto", torch.float32).variant == "direct"
    assert gpu.plan_spmm(4096, 4096, 4096, 10**6, 132, "auto").variant == "direct"  # dtype unknown
    assert gpu.plan_spmm(4096, 4096, 16, 6 * 10**5, 132, "auto", torch.float16).variant == "rowwarp"  # 3.6% dense
    assert gpu.plan_spmm(4096, 4096, 8, 10**6, 132, "auto", torch.float16).variant == "rowwarp"
    assert gpu.plan_spmm(4096, 4096, 16, 10**6, 132, "tc").variant == "tc"


def test_auto_takes_tc_by_the_density_rule_read_from_the_h100_grid(monkeypatch):
    """tc from 25% density at N <= 128, 12.5% for K <= 1024, 6.25% otherwise (gpu.tc_min_density_denominator);
    below, `direct`. Points from benchmarks/results/spmm-h100-2026-11-25.json (nnz_padded as the benchmark stored it)."""
    monkeypatch.setenv(gpu.TC_AUTO_ENV, "1")
    monkeypatch.setenv(gpu.DENSE_AUTO_ENV, "0")  # the dense rule over tc's range: test_spmm_dense.py
    monkeypatch.setenv(gpu.BITMAP_AUTO_ENV, "0")  # the bitmap rule up to N = 256: test_spmm_bitmap.py

    def variant(m, k, n, density):
        return gpu.plan_spmm(m, k, n, int(density * m * k), 132, "auto", torch.float16).variant

    # N = 128: direct won at 20% on 4 of 5 shapes (e.g. 4096 x 4096: 0.103 vs 0.149 ms), tc at 50%
    assert variant(4096, 4096, 128, 0.201) == "direct" and variant(4096, 4096, 128, 0.301) == "tc"
    assert variant(768, 3072, 128, 0.101) == "direct" and variant(768, 3072, 128, 0.501) == "tc"
    # N >= 2048, K > 1024: direct at 5% (4096 x 4096: 0.417 vs 0.443 ms), tc at 10% (0.724 vs 0.545 ms for tc)
    assert variant(4096, 4096, 2048, 0.051) == "direct" and variant(4096, 4096, 2048, 0.101) == "tc"
    assert variant(11008, 4096, 4096, 0.051) == "direct" and variant(11008, 4096, 4096, 0.101) == "tc"
    # K = 768: direct also at 10% (3072 x 768, N = 2048: 0.103 vs 0.167 ms), tc at 20%
    assert variant(3072, 768, 2048, 0.104) == "direct" and variant(3072, 768, 2048, 0.204) == "tc"
    assert [gpu.tc_min_density_denominator(n, k) for n, k in ((65, 4096), (128, 768), (129, 1024), (129, 1025))] == [
        4,
        4,
        8,
        16,
    ]


# ---------------------------------------------------------------------------------------------------------- CUDA


def _poisoned(m, n, dtype, transposed):
    if transposed:
        return torch.full((n, m), float("nan"), dtype=dtype, device="cuda").t()
    return torch.full((m, n), float("nan"), dtype=dtype, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("transposed", [False, True], ids=["xrow", "xT"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k,n,sparsity,empty_rows", SHAPES)
def test_tc_kernel_matches_float64_reference(transposed, dtype, m, k, n, sparsity, empty_rows):
    for seed, activation in ((0, "relu"), (1, "none")):
        dense, c, x2d, bias = random_spmm_case(m, k, n, sparsity, empty_rows, dtype, seed + m + n, "cuda")
        x = x2d.t() if transposed else x2d.t().contiguous()
        y = _poisoned(m, n, dtype, transposed)
        b = bias if activation == "relu" else None
        gpu.spmm_csr(**c, x=x, m=m, bias=b, activation=activation, variant="tc", out=y)
        err = relative_error(y, spmm_reference64(dense, x, b, activation))
        assert err <= TOLERANCE[dtype], f"tc {dtype} {m}x{k}x{n}: rel err {err:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("tile", gpu.TC_TILES)
@pytest.mark.parametrize("y_transposed", [False, True])
def test_tc_kernel_every_tile(tile, y_transposed):
    wpw, ntile = tile
    m, k, n = 300, 700, 333  # several blocks along both axes, partial windows, chunks and tiles
    dense, c, x2d, bias = random_spmm_case(m, k, n, 0.9, 20, torch.float16, 12, "cuda")
    plan = get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k)
    x = gpu._tc_operand(x2d.t())
    y = _poisoned(m, n, torch.float16, y_transposed)
    torch.ops.prunekit_ext.spmm_csr_tc(
        plan.frag_values, plan.slot_rows, plan.kstep_offsets, plan.window_rows, x, y, bias, True, wpw, ntile
    )
    assert relative_error(y, spmm_reference64(dense, x, bias, "relu")) <= TOLERANCE[torch.float16]


@pytest.mark.cuda
def test_tc_kernel_matches_its_cpu_emulation():
    m, k, n = 130, 600, 96
    dense, c, x2d, bias = random_spmm_case(m, k, n, 0.95, 20, torch.bfloat16, 13, "cuda")
    y = gpu.spmm_csr(**c, x=x2d.t(), m=m, bias=bias, activation="relu", variant="tc")
    plan = get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k)
    emulated = tc_plan_matmul(plan, x2d.t(), bias, "relu")
    assert relative_error(y, emulated) <= TOLERANCE[torch.bfloat16]
    tile = gpu.plan_spmm(m, k, n, c["values"].numel(), gpu._sm_count(y.device), "tc", torch.bfloat16)
    replay = replay_tc_kernel(plan, x2d.t(), bias, "relu", tile.windows_per_warp, tile.ntile)
    assert (replay.writes == 1).all()
    assert relative_error(y, replay.y) <= TOLERANCE[torch.bfloat16]


@pytest.mark.cuda
def test_tc_kernel_row_order_plan():
    m, k, n = 77, 400, 40
    dense, c, x2d, bias = random_spmm_case(m, k, n, 0.9, 2, torch.float16, 14, "cuda")
    order = torch.randperm(m, device="cuda")
    plan = build_tc_plan(c["values"], c["row_offsets"], c["column_indices"], m, k, order)
    x = x2d.t().contiguous()
    y = _poisoned(m, n, torch.float16, False)
    torch.ops.prunekit_ext.spmm_csr_tc(
        plan.frag_values, plan.slot_rows, plan.kstep_offsets, plan.window_rows, x, y, bias, True, 1, 64
    )
    assert relative_error(y, spmm_reference64(dense, x, bias, "relu")) <= TOLERANCE[torch.float16]


@pytest.mark.cuda
def test_tc_int32_column_indices_and_all_zero_weight():
    m, k, n = 9, 33000, 20
    dense, c, x2d, bias = random_spmm_case(m, k, n, 0.99, 0, torch.float16, 5, "cuda")
    assert c["column_indices"].dtype == torch.int32
    y = gpu.spmm_csr(**c, x=x2d.t(), m=m, bias=bias, activation="relu", variant="tc")
    assert relative_error(y, spmm_reference64(dense, x2d.t(), bias, "relu")) <= TOLERANCE[torch.float16]
    zero = encode_csr(torch.zeros(20, 50, dtype=torch.float16, device="cuda"))
    x = torch.randn(50, 7, device="cuda").half()
    b = torch.randn(20, device="cuda").half()
    y = gpu.spmm_csr(**zero, x=x, m=20, bias=b, variant="tc", out=_poisoned(20, 7, torch.float16, False))
    torch.testing.assert_close(y, b[:, None].expand(20, 7))


@pytest.mark.cuda
def test_tc_rejects_fp32_and_auto_uses_it_for_fp16(monkeypatch):
    monkeypatch.setenv(gpu.TC_AUTO_ENV, "1")
    monkeypatch.setenv(gpu.DENSE_AUTO_ENV, "0")  # the dense rule over tc's range: test_spmm_dense.py
    dense, c, x2d, bias = random_spmm_case(64, 128, 200, 0.9, 0, torch.float32, 15, "cuda")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gpu.spmm_csr(**c, x=x2d.t(), m=64, variant="tc")
    # 80% sparse: K = 128 <= TC_SMALL_K, so auto takes tc from 12.5% padded density (90% pads to 12.1% here)
    dense, c, x2d, bias = random_spmm_case(64, 128, 200, 0.8, 0, torch.float16, 15, "cuda")
    assert gpu.plan_spmm(64, 128, 200, c["values"].numel(), 132, "auto", torch.float16).variant == "tc"
    from prunekit.kernels import ops

    y = ops.spmm_csr(c["values"], c["row_offsets"], c["column_indices"], c["row_indices"], x2d.t(), 64, bias, "relu")
    assert y.t().is_contiguous()
    assert relative_error(y, spmm_reference64(dense, x2d.t(), bias, "relu")) <= TOLERANCE[torch.float16]


@pytest.mark.cuda
def test_tc_plan_is_cached_on_a_misaligned_stored_weight():
    m, k, n = 48, 200, 80
    dense, c, x2d, bias = random_spmm_case(m, k, n, 0.9, 0, torch.float16, 16, "cuda")
    # Stored values at an odd element offset (as in a packed buffer): the kernels' path copies them per call.
    values = torch.cat([torch.zeros(1, dtype=torch.float16, device="cuda"), c["values"]])[1:]
    assert values.data_ptr() % 16 != 0
    csr = {**c, "values": values}
    first = gpu.spmm_csr(**csr, x=x2d.t(), m=m, bias=bias, variant="tc")
    plan = get_tc_plan(values, c["row_offsets"], c["column_indices"], m, k)
    assert torch.equal(gpu.spmm_csr(**csr, x=x2d.t(), m=m, bias=bias, variant="tc"), first)
    assert get_tc_plan(values, c["row_offsets"], c["column_indices"], m, k) is plan
    assert relative_error(first, spmm_reference64(dense, x2d.t(), bias, "none")) <= TOLERANCE[torch.float16]


@pytest.mark.cuda
def test_tc_repeated_runs_are_bitwise_identical():
    _, c, x2d, bias = random_spmm_case(300, 900, 200, 0.9, 0, torch.bfloat16, 11, "cuda")
    first = gpu.spmm_csr(**c, x=x2d.t(), m=300, bias=bias, variant="tc")
    for _ in range(3):
        assert torch.equal(gpu.spmm_csr(**c, x=x2d.t(), m=300, bias=bias, variant="tc"), first)


def test_auto_takes_tc_only_when_enabled_for_fp16_bf16_at_large_n_and_density(monkeypatch):
    monkeypatch.delenv(gpu.TC_AUTO_ENV, raising=False)
    monkeypatch.setenv(gpu.DENSE_AUTO_ENV, "0")  # the dense rule over tc's range: test_spmm_dense.py
    dense10 = 4096 * 4096 // 10  # 90% sparsity: tc (measured 1.5x faster than direct on the H100)
    assert gpu.TC_AUTO_DEFAULT is True
    assert gpu.plan_spmm(4096, 4096, 4096, dense10, 132, "auto", torch.float16).variant == "tc"
    monkeypatch.setenv(gpu.TC_AUTO_ENV, "1")
    assert gpu.plan_spmm(4096, 4096, 4096, dense10, 132, "auto", torch.float16).variant == "tc"
    assert gpu.plan_spmm(4096, 4096, 4096, dense10, 132, "auto", torch.bfloat16).variant == "tc"
    assert gpu.plan_spmm(4096, 4096, 4096, dense10, 132, "auto", torch.float32).variant == "direct"
    assert gpu.plan_spmm(4096, 4096, 8, dense10, 132, "auto", torch.float16).variant == "rowwarp"
    # 98% and 95% sparsity: below the density threshold (1/16 here), direct (faster at 4 of 5 shapes at 95%)
    assert gpu.plan_spmm(4096, 4096, 4096, 4096 * 4096 // 50, 132, "auto", torch.float16).variant == "direct"
    assert gpu.plan_spmm(4096, 4096, 4096, 4096 * 4096 // 20, 132, "auto", torch.float16).variant == "direct"
    assert gpu.plan_spmm(4096, 4096, 4096, -(-4096 * 4096 // 16), 132, "auto", torch.float16).variant == "tc"
    monkeypatch.setenv(gpu.TC_AUTO_ENV, "0")
    assert gpu.plan_spmm(4096, 4096, 4096, dense10, 132, "auto", torch.float16).variant == "direct"
