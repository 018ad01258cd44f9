"""CPU emulation of the index math of the sm_90a wgmma BSR variant (``csrc/structured/bsr_mm_wgmma.cu``), checked
against float64 without a GPU: the CTA grid over (schedule item or block row, N tile), the TMA box coordinates of
each stage's A tile (block ``b``: rows ``64 b``) and X slab (``(col * C, n0)``, zero outside X), the consumers' split
of the N tile, the wgmma accumulator fragment map ``acc_row`` / ``acc_col``, the epilogue (bias, ReLU, split rows'
fp32 partial sums finished like ``bsr_finalize_kernel``), and the mbarrier ring's parity protocol (no stage is
overwritten before every consumer warp released it, and every wait sees the fill it expects)."""

from __future__ import annotations

import pytest
import torch

from prunekit import formats
from prunekit.formats.bsr import static_schedule
from prunekit.kernels import structured
from prunekit.kernels.testing import relative_error, spmm_reference64

from .test_bsr_mm import block_sparse_weight

R = 64  # wgmma_bsr::R
WG_N = 128  # wgmma_bsr::WG_N


def acc_row(warp: int, lane: int, i: int) -> int:
    """Mirror of ``wgmma_bsr::acc_row`` (m64nNk16 fp32 accumulator fragment, PTX ISA)."""
    return 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1)


def acc_col(lane: int, i: int) -> int:
    """Mirror of ``wgmma_bsr::acc_col``."""
    return 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)


def stages(c: int) -> int:
    """Mirror of ``WgConfig::STAGES``."""
    return 4 if c == 64 else (6 if c == 32 else 8)


def test_wgmma_accumulator_map_is_a_bijection_onto_the_warpgroup_tile():
    seen = torch.zeros(R, WG_N, dtype=torch.int64)
    for warp in range(4):
        for lane in range(32):
            for i in range(WG_N // 2):  # 64 fp32 registers per thread
                seen[acc_row(warp, lane, i), acc_col(lane, i)] += 1
    assert bool((seen == 1).all())
    # the two bias values a thread loads (registers 0 and 2) are the only rows it touches
    for warp in range(4):
        for lane in range(32):
            rows = {acc_row(warp, lane, i) for i in range(64)}
            assert rows == {acc_row(warp, lane, 0), acc_row(warp, lane, 2)}


def fragment_index() -> tuple[torch.Tensor, torch.Tensor]:
    """``(4, 32, 64)`` row and column of every accumulator register of a consumer warpgroup (warp, lane, register)."""
    warp, lane, i = torch.meshgrid(torch.arange(4), torch.arange(32), torch.arange(64), indexing="ij")
    return 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)


def emulate_wgmma_bsr(blocks, crow, cols, x, m, bias, relu, schedule=None, split_rows=None, tile_n=256):
    """The wgmma kernel's CTAs, stage loads, consumer split and epilogue, in float64 (one CTA at a time)."""
    c = blocks.shape[2]
    k, n = x.shape
    consumers = tile_n // WG_N
    y = torch.full((m, n), float("nan"), dtype=torch.float64)
    if schedule is None:
        items = [(row, int(crow[row]), int(crow[row + 1]), -1) for row in range(m // R)]
    else:
        items = [tuple(int(v) for v in item) for item in schedule]
    n_split = 0 if split_rows is None else split_rows.numel()
    frag_row, frag_col = fragment_index()
    ws = torch.zeros(n_split, R, n, dtype=torch.float64)
    xd = x.double()
    for block_row, start, end, slot in items:
        for n_tile in range(-(-n // tile_n)):
            n0 = n_tile * tile_n
            acc = torch.zeros(consumers, 4, 32, 64, dtype=torch.float64)  # [consumer][warp][lane][register]
            for it in range(end - start):
                b = start + it
                a_tile = blocks[b].double()  # TMA box (C, 64) of map_a at (0, b * 64): the block itself
                assert blocks.reshape(-1, c)[b * R : b * R + R].equal(blocks[b])
                k0 = int(cols[b]) * c  # TMA box (C, tile_n) of map_x at (col * C, n0); zeros outside X
                slab = torch.zeros(tile_n, c, dtype=torch.float64)
                width = max(0, min(tile_n, n - n0))
                slab[:width] = xd[k0 : k0 + c, n0 : n0 + width].t()
                for cw in range(consumers):
                    part = torch.zeros(R, WG_N, dtype=torch.float64)
                    for kk in range(c // 16):  # the C / 16 wgmma k-steps (descriptor start + 32 bytes each)
                        ks = slice(16 * kk, 16 * kk + 16)
                        part += a_tile[:, ks] @ slab[cw * WG_N : (cw + 1) * WG_N, ks].t()
                    acc[cw] += part[frag_row, frag_col]
            m0 = block_row * R
            for cw in range(consumers):
                rows, cols_out = frag_row.reshape(-1), n0 + cw * WG_N + frag_col.reshape(-1)
                vals = acc[cw].reshape(-1)
                keep = cols_out < n  # the kernel's `nn < args.n` guard
                rows, cols_out, vals = rows[keep], cols_out[keep], vals[keep]
                if slot >= 0:
                    ws[slot].index_put_((rows, cols_out), vals, accumulate=True)  # atomicAdd
                    continue
                if bias is not None:
                    vals = vals + bias.double()[m0 + rows]
                assert bool(torch.isnan(y[m0 + rows, cols_out]).all())  # each element written once
                y[m0 + rows, cols_out] = vals.clamp_min(0.0) if relu else vals
    for slot in range(n_split):  # bsr_finalize_kernel
        m0 = int(split_rows[slot]) * R
        v = ws[slot] + (bias[m0 : m0 + R, None].double() if bias is not None else 0.0)
        y[m0 : m0 + R] = v.clamp_min(0.0) if relu else v
    return y


@pytest.mark.parametrize(
    ("c", "tile_n", "n", "static"), [(64, 256, 300, True), (32, 128, 5, False), (16, 256, 1, True)]
)
def test_wgmma_schedule_emulation_matches_float64(c, tile_n, n, static):
    m, k = 4 * R, 6 * c
    dense = block_sparse_weight(m, k, R, c, 0.4, torch.float32, seed=c + n, heavy_rows=1)
    comp = formats.encode("bsr", dense, {"block_rows": R, "block_cols": c}).components
    x2d = torch.randn(n, k)
    bias = torch.randn(m)
    schedule = split_rows = None
    if static:
        schedule, split_rows = static_schedule(comp["crow_indices"], chunk=2)
        assert split_rows.numel() > 0  # the dense row is cut: exercises the fp32 partial sums
    y = emulate_wgmma_bsr(
        comp["blocks"], comp["crow_indices"], comp["col_indices"], x2d.t(), m, bias, True, schedule, split_rows, tile_n
    )
    assert not bool(torch.isnan(y).any())  # every output element written exactly by its owner (empty rows too)
    assert relative_error(y, spmm_reference64(dense, x2d.t(), bias, "relu")) < 1e-12


@pytest.mark.parametrize("c", [16, 32, 64])
@pytest.mark.parametrize("count", [0, 1, 3, 9, 17])
@pytest.mark.parametrize("consumers", [1, 2])
def test_wgmma_mbarrier_ring_protocol(c, count, consumers):
    """Simulation of the producer thread and the consumer warps on the ring of ``stages(c)`` stages with the kernel's
    parity rules under the hardware's: ``try_wait.parity(p)`` passes when the barrier's current phase parity is not
    ``p`` (full[s] completes a phase per fill, empty[s] once all 4 * CONSUMERS warps arrived). Consumer warps run at
    different speeds; every wait must see the fill it expects and no stage may be refilled while a warp reads it."""
    n_stages, warps = stages(c), 4 * consumers
    full_phase = [0] * n_stages  # completed phases per barrier
    empty_phase = [0] * n_stages
    empty_arrivals = [0] * n_stages
    stage_fill = [-1] * n_stages
    readers: list[set[int]] = [set() for _ in range(n_stages)]
    producer_it = 0
    consumer_it = [0] * warps
    g = torch.Generator().manual_seed(count * 7 + c)
    for _ in range(200 * (count + 1)):
        if producer_it < count:
            s = producer_it % n_stages
            parity = ((producer_it // n_stages) + 1) & 1
            if producer_it < n_stages or (empty_phase[s] & 1) != parity:
                assert not readers[s], "stage refilled before every consumer warp released it"
                stage_fill[s] = producer_it
                readers[s] = set(range(warps))
                full_phase[s] += 1  # expect_tx + the two TMA boxes complete the phase
                producer_it += 1
        for w in range(warps):
            if float(torch.rand(1, generator=g)) < 0.5:  # warps progress at different rates
                continue
            it = consumer_it[w]
            if it >= count:
                continue
            s = it % n_stages
            if (full_phase[s] & 1) != ((it // n_stages) & 1):
                assert stage_fill[s] == it, "a wait passed on a stage holding another block"
                consumer_it[w] += 1
                if it > 0:  # after wgmma_wait<1>: lane 0 releases the previous stage
                    prev = (it - 1) % n_stages
                    readers[prev].discard(w)
                    empty_arrivals[prev] += 1
                    if empty_arrivals[prev] == warps:
                        empty_arrivals[prev] = 0
                        empty_phase[prev] += 1
        if producer_it == count and all(i == count for i in consumer_it):
            break
    assert producer_it == count and all(i == count for i in consumer_it), "deadlock"


def test_wgmma_tile_rule_matches_its_docstring():
    assert structured.plan_tile_n_wgmma(16384, 64, 8192) == 256
    assert structured.plan_tile_n_wgmma(4096, 64, 16) == 128  # N <= 128: one consumer warpgroup
    assert structured.plan_tile_n_wgmma(256, 64, 300, 132) == 128  # 4 rows x 2 tiles < 132 SMs
    assert structured.WGMMA_TILE_NS == (128, 256)


def test_variant_names_resolve_and_unknown_names_raise(monkeypatch):
    monkeypatch.delenv(structured.BSR_VARIANT_ENV, raising=False)
    assert structured.bsr_variant() == "auto"
    monkeypatch.setenv(structured.BSR_VARIANT_ENV, "wgmma")
    assert structured.bsr_variant() == "wgmma"
    assert structured.bsr_variant("mma") == "mma"
    with pytest.raises(ValueError, match="unknown BSR kernel variant"):
        structured.bsr_variant("tcgen05")
    monkeypatch.delenv(structured.CSLT_OUTPUT_ENV, raising=False)
    assert structured.cslt_output() == structured.CSLT_DEFAULT_OUTPUT
    with pytest.raises(ValueError, match="row"):
        structured.cslt_output("diagonal")
