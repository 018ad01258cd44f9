"""CPU emulation of the index math of the sm_90a wgmma BSR variant (``csrc/structured/bsr_mm_wgmma.cu``), checked
against float64 without a GPU: the CTA grid over (schedule item or block row, N tile); the shared-memory ring
(``WgConfig``: stage offsets, A / X slab offsets, expect-tx bytes, the 1024-byte rounding of the dynamic base, the
mbarriers after the stages); the TMA box writes of each stage's A tile (block ``b``: rows ``64 b`` of ``blocks``
as 2-D) and X slab (``(col * C, n0)``, zero outside X) with the swizzle the host's tensor map picks from the box
width; the wgmma reads through the 64-bit shared-memory descriptors (``make_desc``'s bits decoded field by field,
the K-major canonical layout, the +32-byte k-steps, each consumer's 128-row half of the slab); the accumulator
fragment map ``acc_row`` / ``acc_col``; both epilogues (scalar stores, and Y^T staged through shared memory with
16-byte vectors), bias, ReLU, split rows' fp32 partial sums finished like ``bsr_finalize_kernel``; and the mbarrier
ring's parity protocol (no stage is overwritten before every consumer warp released it, and every wait sees the fill
it expects).

The address model (what the hardware does, taken from the PTX ISA's "Matrix Descriptor Format" / "Shared Memory
Matrix Layout" of wgmma, the CUDA driver API's ``cuTensorMapEncodeTiled`` and CuTe's canonical GMMA layouts, not
from a run): a TMA box is written densely, row after row of ``box_inner`` elements, and the 16-byte chunk bits
``[4, 4 + B)`` of every shared-memory byte address are XORed with its bits ``[7, 7 + B)`` (B = 3, 2, 1 for the
128-, 64-, 32-byte swizzles; CuTe's ``Swizzle<B, 4, 3>``); wgmma computes, for row ``r`` and k-element ``k`` of a
K-major operand, ``start + (r // 8) * SBO + (r % 8) * (16 << B) + 2 k`` and applies the same XOR to that absolute
address (the base-offset field stays 0 because every tile starts on a swizzle-pattern boundary, which the
emulation asserts). A layout bug on either side (descriptor fields, swizzle mode, k-step, stage or slab offsets)
reads the wrong elements or unwritten (NaN) bytes here.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from prunekit import formats
from prunekit.errors import KernelUnavailable
from prunekit.formats.bsr import static_schedule
from prunekit.kernels import structured
from prunekit.kernels.testing import relative_error, spmm_reference64

from .test_bsr_mm import block_sparse_weight

R = 64  # wgmma_bsr::R
WG_N = 128  # wgmma_bsr::WG_N
SWIZZLE_MODE = {64: 1, 32: 2, 16: 3}  # C -> descriptor bits 62-63 (128-, 64-, 32-byte swizzle)
MODE_BITS = {1: 3, 2: 2, 3: 1}  # descriptor mode -> B of Swizzle<B, 4, 3>
TMA_SWIZZLE_BITS = {128: 3, 64: 2, 32: 1}  # make_map: box row bytes -> CU_TENSOR_MAP_SWIZZLE_{128,64,32}B
# make_desc<C>(1024) exactly as the static_asserts in bsr_mm_wgmma.cuh pin them
DESC_AT_1024 = {64: 0x4000004000010040, 32: 0x8000002000010040, 16: 0xC000001000010040}


def acc_row(warp: int, lane: int, i: int) -> int:
    """Mirror of ``wgmma_bsr::acc_row`` (m64nNk16 fp32 accumulator fragment, PTX ISA)."""
    return 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1)


def acc_col(lane: int, i: int) -> int:
    """Mirror of ``wgmma_bsr::acc_col``."""
    return 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)


def stages(c: int) -> int:
    """Mirror of ``WgConfig::STAGES``."""
    return 4 if c == 64 else (6 if c == 32 else 8)


def wg_config(c: int, consumers: int) -> dict[str, int]:
    """Mirror of ``WgConfig<C, CONSUMERS>`` (bytes)."""
    bn = WG_N * consumers
    cfg = {"BN": bn, "STAGES": stages(c), "A_BYTES": R * c * 2, "B_BYTES": bn * c * 2, "OUT_LD": R + 8}
    cfg["STAGE_BYTES"] = cfg["A_BYTES"] + cfg["B_BYTES"]
    cfg["SMEM_BYTES"] = 1024 + cfg["STAGES"] * cfg["STAGE_BYTES"] + 2 * cfg["STAGES"] * 8
    return cfg


def make_desc(c: int, smem_addr: int) -> int:
    """Mirror of ``wgmma_bsr::make_desc<C>``: the 64-bit wgmma shared-memory descriptor of a K-major tile."""
    sbo = 8 * 2 * c
    return ((smem_addr & 0x3FFFF) >> 4) | (1 << 16) | ((sbo >> 4) << 32) | (SWIZZLE_MODE[c] << 62)


def decode_desc(desc: int) -> dict[str, int]:
    """The descriptor's fields (PTX ISA, wgmma "Matrix Descriptor Format"), byte units where the ISA stores >> 4."""
    return {
        "start": (desc & 0x3FFF) << 4,  # bits 0-13
        "lbo": ((desc >> 16) & 0x3FFF) << 4,  # bits 16-29
        "sbo": ((desc >> 32) & 0x3FFF) << 4,  # bits 32-45
        "base_offset": (desc >> 49) & 0x7,  # bits 49-51
        "mode": (desc >> 62) & 0x3,  # bits 62-63
        "reserved": desc & ((0x3 << 14) | (0x3 << 30) | (0x7 << 46) | (0x3FF << 52)),
    }


def swizzle(addr: torch.Tensor, bits: int) -> torch.Tensor:
    """Swizzle<bits, 4, 3> on shared-memory byte addresses (TMA and wgmma alike, see the module docstring)."""
    return addr ^ (((addr >> 7) & ((1 << bits) - 1)) << 4)


def tma_box_addresses(dst: int, rows: int, box_inner: int) -> torch.Tensor:
    """``(rows, box_inner)`` byte addresses a 2-byte TMA box lands at, with the swizzle ``make_map`` picks."""
    bits = TMA_SWIZZLE_BITS[box_inner * 2]
    r, k = torch.meshgrid(torch.arange(rows), torch.arange(box_inner), indexing="ij")
    return swizzle(dst + r * (box_inner * 2) + 2 * k, bits)


def wgmma_operand_addresses(desc: int, rows: int) -> torch.Tensor:
    """``(rows, 16)`` byte addresses wgmma reads for a K-major operand (A: 64 rows of M; B: 128 rows of N) of one
    k16 step, from the descriptor's fields alone."""
    f = decode_desc(desc)
    assert f["reserved"] == 0 and f["base_offset"] == 0 and f["mode"] in MODE_BITS
    bits = MODE_BITS[f["mode"]]
    pitch = 16 << bits  # one swizzle row: the 8 rows of a core-matrix group are this far apart
    assert (f["start"] >> 7) & ((1 << bits) - 1) == 0, "start not on a swizzle-pattern boundary: base offset != 0"
    assert f["start"] % pitch + 32 <= pitch, "a k16 slice must not cross a swizzle row (LBO would be needed)"
    r, k = torch.meshgrid(torch.arange(rows), torch.arange(16), indexing="ij")
    return swizzle(f["start"] + (r // 8) * f["sbo"] + (r % 8) * pitch + 2 * k, bits)


def fragment_index() -> tuple[torch.Tensor, torch.Tensor]:
    """``(4, 32, 64)`` row and column of every accumulator register of a consumer warpgroup (warp, lane, register)."""
    warp, lane, i = torch.meshgrid(torch.arange(4), torch.arange(32), torch.arange(64), indexing="ij")
    return 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)


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
    frag_row, frag_col = fragment_index()
    assert int(frag_row[1, 5, 6]) == acc_row(1, 5, 6) and int(frag_col[1, 5, 6]) == acc_col(5, 6)


def test_wgmma_accumulator_map_matches_the_m16n8_layout_per_8_columns():
    """Per the PTX ISA, each warp's 16 x N slice of the m64nNk16 D fragment repeats mma.m16n8's C layout every 8
    columns: register 4 j + e holds (lane / 4 + 8 (e / 2), 8 j + 2 (lane % 4) + e % 2) of the warp's rows."""
    for lane in range(32):
        for j in range(WG_N // 8):
            for e in range(4):
                g, t = lane >> 2, lane & 3
                assert acc_row(0, lane, 4 * j + e) == g + 8 * (e >> 1)
                assert acc_col(lane, 4 * j + e) == 8 * j + 2 * t + (e & 1)


@pytest.mark.parametrize("c", [16, 32, 64])
def test_wgmma_descriptor_bits_match_the_kernel(c):
    """make_desc's literals (pinned by static_asserts in bsr_mm_wgmma.cuh) decode to the K-major canonical layout."""
    assert make_desc(c, 1024) == DESC_AT_1024[c]
    f = decode_desc(DESC_AT_1024[c])
    assert f == {"start": 1024, "lbo": 16, "sbo": 8 * 2 * c, "base_offset": 0, "mode": SWIZZLE_MODE[c], "reserved": 0}
    assert 16 << MODE_BITS[f["mode"]] == 2 * c  # the swizzle row is one block row of C halves: TMA's box width
    assert make_desc(c, 1024 + 32) == make_desc(c, 1024) + 2  # a k-step: +32 bytes in the start field


@pytest.mark.parametrize("c", [16, 32, 64])
@pytest.mark.parametrize("consumers", [1, 2])
def test_wgmma_reads_through_descriptors_what_tma_wrote(c, consumers):
    """Every (stage, consumer, k-step): the elements wgmma fetches through make_desc are exactly the block's and the
    X slab's (row, 16 kk + k) elements that the two TMA boxes wrote, and the boxes fill the stage byte for byte."""
    cfg = wg_config(c, consumers)
    base = 1024  # the kernel's 1024-rounded dynamic shared-memory base
    for s in range(cfg["STAGES"]):
        a_dst = base + s * cfg["STAGE_BYTES"]
        a_addr = tma_box_addresses(a_dst, R, c)
        x_addr = tma_box_addresses(a_dst + cfg["A_BYTES"], cfg["BN"], c)
        written = torch.cat([a_addr.reshape(-1), x_addr.reshape(-1)])
        assert written.unique().numel() == written.numel() == cfg["STAGE_BYTES"] // 2  # expect_tx == STAGE_BYTES
        assert int(written.min()) == a_dst and int(written.max()) == a_dst + cfg["STAGE_BYTES"] - 2
        for kk in range(c // 16):
            got_a = wgmma_operand_addresses(make_desc(c, a_dst + kk * 32), R)
            assert got_a.equal(a_addr[:, 16 * kk : 16 * kk + 16])
            for cw in range(consumers):
                b_start = a_dst + cfg["A_BYTES"] + cw * WG_N * c * 2
                got_b = wgmma_operand_addresses(make_desc(c, b_start + kk * 32), WG_N)
                assert got_b.equal(x_addr[cw * WG_N : (cw + 1) * WG_N, 16 * kk : 16 * kk + 16])


def test_wgmma_smem_budget_and_epilogue_tile_fit():
    for c in (16, 32, 64):
        for consumers in (1, 2):
            cfg = wg_config(c, consumers)
            assert cfg["STAGE_BYTES"] % 1024 == 0 and cfg["A_BYTES"] % 1024 == 0
            assert cfg["SMEM_BYTES"] <= 227 * 1024
            assert cfg["BN"] * cfg["OUT_LD"] * 2 <= cfg["STAGES"] * cfg["STAGE_BYTES"]  # before the mbarriers
            assert (cfg["OUT_LD"] * 2) % 16 == 0  # 16-byte vector reads of tile rows


class SharedMemory:
    """Byte-addressed shared memory of 2-byte elements (float64 values, NaN = never written) of one CTA."""

    def __init__(self, nbytes: int):
        self.data = torch.full((nbytes // 2,), float("nan"), dtype=torch.float64)

    def write(self, addr: torch.Tensor, values: torch.Tensor) -> None:
        assert bool((addr % 2 == 0).all()) and int(addr.max()) < 2 * self.data.numel()
        self.data[addr.reshape(-1) // 2] = values.reshape(-1).double()

    def read(self, addr: torch.Tensor) -> torch.Tensor:
        v = self.data[addr // 2]
        assert not bool(torch.isnan(v).any()), "read a shared-memory element this stage's TMA boxes did not write"
        return v


def emulate_wgmma_bsr(
    blocks, crow, cols, x, m, bias, relu, schedule=None, split_rows=None, tile_n=256, staged=False, raw_offset=16
):
    """The wgmma kernel's CTAs in float64, one at a time: the producer's TMA boxes into the shared-memory ring, the
    consumers' wgmmas through the descriptors, the accumulator fragments, and the epilogue (``staged``: Y^T through
    shared memory with 16-byte vectors, into a Y^T buffer of leading dimension ``m``; else scalar stores).
    ``raw_offset``: where the dynamic shared memory starts (the kernel rounds it up to 1024)."""
    c = blocks.shape[2]
    k, n = x.shape
    consumers = tile_n // WG_N
    cfg = wg_config(c, consumers)
    n_stages = cfg["STAGES"]
    base = (raw_offset + 1023) & ~1023
    bar_addr = base + n_stages * cfg["STAGE_BYTES"]
    assert bar_addr % 8 == 0 and bar_addr + 2 * n_stages * 8 <= raw_offset + cfg["SMEM_BYTES"]
    y = torch.full((m, n), float("nan"), dtype=torch.float64)
    yt_flat = torch.full((n * m,), float("nan"), dtype=torch.float64)  # Y^T storage: y(m, n) at n * m + m
    if schedule is None:
        items = [(row, int(crow[row]), int(crow[row + 1]), -1) for row in range(m // R)]
    else:
        items = [tuple(int(v) for v in item) for item in schedule]
    n_split = 0 if split_rows is None else split_rows.numel()
    frag_row, frag_col = fragment_index()
    ws = torch.zeros(n_split, R, n, dtype=torch.float64)
    xd = x.double()
    blocks_2d = blocks.double().reshape(-1, c)  # map_a: (C, capacity * 64) as a 2-D tensor
    for block_row, start, end, slot in items:
        for n_tile in range(-(-n // tile_n)):
            n0 = n_tile * tile_n
            smem = SharedMemory(raw_offset + cfg["SMEM_BYTES"])
            acc = torch.zeros(consumers, 4, 32, 64, dtype=torch.float64)  # [consumer][warp][lane][register]
            for it in range(end - start):
                s = it % n_stages
                b = start + it
                a_dst = base + s * cfg["STAGE_BYTES"]
                smem.data[a_dst // 2 : (a_dst + cfg["STAGE_BYTES"]) // 2] = float("nan")  # stale data would show
                smem.write(tma_box_addresses(a_dst, R, c), blocks_2d[b * R : b * R + R])  # box at (0, b * 64)
                k0 = int(cols[b]) * c  # box of map_x at (col * C, n0): (tile_n rows of n) x (C of k); zeros past N
                slab = torch.zeros(tile_n, c, dtype=torch.float64)
                width = max(0, min(tile_n, n - n0))
                slab[:width] = xd[k0 : k0 + c, n0 : n0 + width].t()
                smem.write(tma_box_addresses(a_dst + cfg["A_BYTES"], tile_n, c), slab)
                for cw in range(consumers):
                    b_addr = a_dst + cfg["A_BYTES"] + cw * WG_N * c * 2
                    part = torch.zeros(R, WG_N, dtype=torch.float64)
                    for kk in range(c // 16):  # Wgmma<T>::run(acc, make_desc<C>(a + 32 kk), make_desc<C>(b + 32 kk))
                        a_k = smem.read(wgmma_operand_addresses(make_desc(c, a_dst + kk * 32), R))
                        b_k = smem.read(wgmma_operand_addresses(make_desc(c, b_addr + kk * 32), WG_N))
                        part += a_k @ b_k.t()
                    acc[cw] += part[frag_row, frag_col]
            m0 = block_row * R
            if slot < 0 and staged:  # Y^T tile in the pipeline's memory, then 16-byte vectors along m
                tile = SharedMemory(raw_offset + cfg["SMEM_BYTES"])
                assert base + cfg["BN"] * cfg["OUT_LD"] * 2 <= bar_addr
            for cw in range(consumers):
                rows, cols_out = frag_row.reshape(-1), n0 + cw * WG_N + frag_col.reshape(-1)
                vals = acc[cw].reshape(-1)
                if slot >= 0:
                    keep = cols_out < n  # the kernel's `nn < args.n` guard
                    ws[slot].index_put_((rows[keep], cols_out[keep]), vals[keep], accumulate=True)  # atomicAdd
                    continue
                if bias is not None:
                    vals = vals + bias.double()[m0 + rows]
                vals = vals.clamp_min(0.0) if relu else vals
                if staged:
                    tile_idx = (cw * WG_N + frag_col.reshape(-1)) * cfg["OUT_LD"] + rows
                    tile.write(base + 2 * tile_idx, vals)  # every element, columns past N included
                    continue
                keep = cols_out < n
                rows, cols_out, vals = rows[keep], cols_out[keep], vals[keep]
                assert bool(torch.isnan(y[m0 + rows, cols_out]).all())  # each element written once
                y[m0 + rows, cols_out] = vals
            if slot < 0 and staged:
                per_row = R // 8
                for idx in range(cfg["BN"] * per_row):  # threads 128 .. of the consumers, strided
                    nl, ml = idx // per_row, (idx % per_row) * 8
                    if n0 + nl >= n:
                        continue
                    src = base + 2 * (nl * cfg["OUT_LD"] + ml)
                    dst = (n0 + nl) * m + m0 + ml  # y + (n0 + nl) * syn + m0 + ml, syn = m
                    assert src % 16 == 0 and (2 * dst) % 16 == 0  # int4 loads and stores
                    assert bool(torch.isnan(yt_flat[dst : dst + 8]).all())
                    yt_flat[dst : dst + 8] = tile.read(src + 2 * torch.arange(8))
    if staged:
        filled = yt_flat.reshape(n, m).t().clone()
        written = ~torch.isnan(filled)
        y[written] = filled[written]
    return finalize_split_rows(y, ws, split_rows, R, bias, relu)


def finalize_split_rows(y, ws, split_rows, r, bias, relu):
    """``bsr_finalize_kernel``: each split block row's fp32 partial sums ``ws[slot]`` plus bias, ReLU, into ``y``."""
    for slot in range(0 if split_rows is None else split_rows.numel()):
        m0 = int(split_rows[slot]) * r
        v = ws[slot] + (bias[m0 : m0 + r, None].double() if bias is not None else 0.0)
        y[m0 : m0 + r] = v.clamp_min(0.0) if relu else v
    return y


@pytest.mark.parametrize(
    ("c", "tile_n", "n", "static", "staged"),
    [(64, 256, 300, True, True), (32, 128, 5, False, True), (16, 256, 1, True, False), (32, 256, 130, False, False)],
)
def test_wgmma_schedule_emulation_matches_float64(c, tile_n, n, static, staged):
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
        comp["blocks"], comp["crow_indices"], comp["col_indices"], x2d.t(), m, bias, True, schedule, split_rows,
        tile_n, staged=staged, raw_offset=16 if static else 0,
    )  # fmt: skip
    assert not bool(torch.isnan(y).any())  # every output element written exactly by its owner (empty rows too)
    assert relative_error(y, spmm_reference64(dense, x2d.t(), bias, "relu")) < 1e-12


def _descriptor_reads_match(c, consumers, desc=make_desc, k_step=32, consumer_offset=None):
    """True when every wgmma read of stage 0 (all k-steps, all consumers) fetches the elements TMA wrote there."""
    cfg = wg_config(c, consumers)
    a_dst = 1024
    a_addr = tma_box_addresses(a_dst, R, c)
    x_addr = tma_box_addresses(a_dst + cfg["A_BYTES"], cfg["BN"], c)
    consumer_offset = WG_N * c * 2 if consumer_offset is None else consumer_offset
    for kk in range(c // 16):
        ks = slice(16 * kk, 16 * kk + 16)
        if not wgmma_operand_addresses(desc(c, a_dst + kk * k_step), R).equal(a_addr[:, ks]):
            return False
        for cw in range(consumers):
            got = wgmma_operand_addresses(desc(c, a_dst + cfg["A_BYTES"] + cw * consumer_offset + kk * k_step), WG_N)
            if not got.equal(x_addr[cw * WG_N : (cw + 1) * WG_N, ks]):
                return False
    return True


def _with_field(desc_fn, shift, width, value_fn):
    mask = ((1 << width) - 1) << shift
    return lambda c, addr: (desc_fn(c, addr) & ~mask) | (value_fn(c) << shift)


def test_wgmma_address_model_catches_layout_mutations():
    """The address model is sharp: each of these plausible mistakes reads other elements than TMA wrote."""
    assert all(_descriptor_reads_match(c, 2) for c in (16, 32, 64))
    sbo_doubled = _with_field(make_desc, 32, 14, lambda c: (8 * 4 * c) >> 4)
    assert not any(_descriptor_reads_match(c, 1, desc=sbo_doubled) for c in (16, 32, 64))
    mode_128b = _with_field(make_desc, 62, 2, lambda c: 1)
    assert not any(_descriptor_reads_match(c, 1, desc=mode_128b) for c in (16, 32))
    modes_swapped = _with_field(make_desc, 62, 2, lambda c: {64: 1, 32: 3, 16: 2}[c])
    assert not any(_descriptor_reads_match(c, 1, desc=modes_swapped) for c in (16, 32))
    assert not any(_descriptor_reads_match(c, 1, k_step=16) for c in (32, 64))  # k-step in halves, not bytes
    assert not any(_descriptor_reads_match(c, 2, consumer_offset=WG_N * c) for c in (16, 32, 64))


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
    # 64-row blocks, fewer than WIDE_TILE_MIN_BLOCKS_PER_ROW blocks per block row: the 128 tile (two CTAs an SM)
    rows = 11008 // 64
    assert structured.plan_tile_n_wgmma(11008, 64, 2048, 132, nblocks=rows * 3) == 128
    assert structured.plan_tile_n_wgmma(11008, 64, 2048, 132, nblocks=rows * 9) == 128
    assert structured.plan_tile_n_wgmma(11008, 64, 2048, 132, nblocks=rows * 10) == 256
    assert structured.plan_tile_n_wgmma(16384, 64, 8192, 132, nblocks=256 * 13) == 256
    # 32-row blocks in short rows (at most SHORT_ROWS_MAX_BLOCKS_PER_ROW per block row): 128, which the launcher runs
    # with 3 stages; above that, and 16-row blocks however short their rows, the 256 tile
    assert structured.SHORT_ROWS_MAX_BLOCKS_PER_ROW == 4
    assert structured.plan_tile_n_wgmma(11008, 32, 2048, 132, nblocks=344 * 3) == 128
    assert structured.plan_tile_n_wgmma(11008, 32, 2048, 132, nblocks=344 * 4) == 128
    assert structured.plan_tile_n_wgmma(11008, 32, 2048, 132, nblocks=344 * 4 + 1) == 256
    assert structured.plan_tile_n_wgmma(11008, 16, 2048, 132, nblocks=688 * 3) == 256
    assert [structured.short_rows(3072, 64, n) for n in (0, 192, 193)] == [True, True, False]
    assert structured.short_rows(16, 32, 4)  # fewer rows than one block row: counted as one
    # the producer warp of the 64-row kernel: short rows and at least 4 CTAs per SM per block per block row
    assert structured.WARP_PRODUCER_MIN_CTAS_PER_SM == 4
    wp = structured.warp_producer_rule
    assert wp(3072, 64, 4096, 29, 128, 132) and wp(3072, 64, 2048, 25, 128, 132)  # 48 x 32 / 16 CTAs, 0.5 per row
    assert not wp(3072, 64, 128, 29, 128, 132)  # 48 CTAs: too few
    assert not wp(3072, 32, 4096, 29, 128, 132) and not wp(3072, 64, 4096, 193, 128, 132)  # 32-row; long rows
    # 48 rows x 16 tiles = 768 CTAs: up to 768 * 48 / (4 * 132) = 69.8 blocks (1.45 per row)
    assert wp(3072, 64, 2048, 69, 128, 132) and not wp(3072, 64, 2048, 70, 128, 132)
    assert wp(3072, 64, 2048, 0, 128, 132) and not wp(3072, 64, 2048, 0, 256, 132)  # fewer than one block per row
    assert not wp(3072, 64, 2048, 10, 128, 0) and not wp(3072, 64, 2048, 10, 0, 132)
    # its 64-token tile: at most 1.5 blocks per block row (48 rows: 72 blocks)
    wt = structured.warp_tile_n_rule
    assert wt(3072, 64, 72) and not wt(3072, 64, 73) and wt(3072, 64, 0) and not wt(3072, 32, 10)
    assert wt(32, 64, 1) and not wt(32, 64, 2)  # fewer rows than one block row: counted as one
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
    # the runtime layer's default is the view (no transposing copy); the custom op keeps the layout rule's "row"
    assert structured.cslt_output(default=structured.CSLT_LAYER_DEFAULT_OUTPUT) == "view"
    assert structured.CSLT_OUTPUTS == {"col": 0, "row": 1, "view": 2}  # prunekit_cslt::linear's output codes
    monkeypatch.setenv(structured.CSLT_OUTPUT_ENV, "row")
    assert structured.cslt_output(default=structured.CSLT_LAYER_DEFAULT_OUTPUT) == "row"


def test_wgmma_env_default_falls_back_to_mma_but_an_explicit_request_raises(monkeypatch, caplog):
    """``$PRUNEKIT_BSR_VARIANT=wgmma`` must not break layers the variant does not take (block shape, GPU/build)."""
    monkeypatch.setattr(structured, "_wgmma_fallback_warned", set())
    blocks8 = torch.zeros(2, 8, 16, dtype=torch.float16)  # no kernel takes 8-row blocks
    blocks64 = torch.zeros(2, 64, 32, dtype=torch.float16)
    with caplog.at_level("WARNING", logger=structured.__name__):
        assert structured._wgmma_or_fallback(blocks8, None, explicit=False) == "mma"
        assert structured._wgmma_or_fallback(blocks8, None, explicit=False) == "mma"
    assert sum("wgmma does not apply" in r.getMessage() for r in caplog.records) == 1  # once per block shape
    with pytest.raises(ValueError, match="wgmma variant takes blocks"):
        structured._wgmma_or_fallback(blocks8, None, explicit=True)
    monkeypatch.setattr(structured, "wgmma_available", lambda: False)
    assert structured._wgmma_or_fallback(blocks64, 256, explicit=False) == "mma"
    with pytest.raises(KernelUnavailable, match="sm_90a"):
        structured._wgmma_or_fallback(blocks64, None, explicit=True)
    monkeypatch.setattr(structured, "wgmma_available", lambda: True)
    assert structured._wgmma_or_fallback(blocks64, 256, explicit=True) == "wgmma"
    with pytest.raises(ValueError, match="tile_n"):
        structured._wgmma_or_fallback(blocks64, 32, explicit=True)


def test_weight_caches_accept_inference_tensors():
    """The 2:4 weight caches key on the version counter, which inference tensors lack (the runtime's run and the
    benchmarks work under torch.inference_mode)."""
    from prunekit.kernels import structured

    plain = torch.zeros(4)
    assert structured.tensor_version(plain) == 0
    plain.add_(1)
    assert structured.tensor_version(plain) == 1
    with torch.inference_mode():
        made_inside = torch.zeros(4)
    assert structured.tensor_version(made_inside) == -1


# --- 16- and 32-row blocks: bsr_wgmma_t_kernel (the roles swapped) -------------------------------------------------

WG_M = 128  # wgmma_bsr::WG_M: tokens per consumer warpgroup
T_SMEM_BUDGET = 110 * 1024  # wgmma_bsr::T_SMEM_BUDGET


def wgt_config(r: int, c: int, consumers: int) -> dict[str, int]:
    """Mirror of ``WgtConfig<RB, C, CONSUMERS>`` (bytes)."""
    bn = WG_M * consumers
    cfg = {"BN": bn, "X_BYTES": bn * c * 2, "BLOCK_TX": r * c * 2, "NACC": r // 2}
    cfg["BLOCK_BYTES"] = -(-cfg["BLOCK_TX"] // 1024) * 1024
    cfg["STAGE_BYTES"] = cfg["X_BYTES"] + cfg["BLOCK_BYTES"]
    cfg["STAGES"] = min(12, max(2, T_SMEM_BUDGET // cfg["STAGE_BYTES"]))
    cfg["SMEM_BYTES"] = 1024 + cfg["STAGES"] * cfg["STAGE_BYTES"] + 2 * cfg["STAGES"] * 8
    return cfg


@pytest.mark.parametrize("r", [16, 32])
@pytest.mark.parametrize("c", [16, 32, 64])
@pytest.mark.parametrize("consumers", [1, 2])
def test_wgmma_t_reads_through_descriptors_what_tma_wrote(r, c, consumers):
    """Every (stage, consumer, m64 tile, k-step): wgmma's A reads through make_desc are the X slab's 64 tokens x 16
    k that the X box wrote, its B reads the block's r rows x 16 k, and the boxes stay inside their stage."""
    cfg = wgt_config(r, c, consumers)
    assert cfg["SMEM_BYTES"] <= 227 * 1024 and 2 * cfg["SMEM_BYTES"] <= 228 * 1024  # two CTAs per SM
    assert cfg["STAGE_BYTES"] % 1024 == 0 and cfg["X_BYTES"] % 1024 == 0
    base = 1024
    for s in range(cfg["STAGES"]):
        dst = base + s * cfg["STAGE_BYTES"]
        x_addr = tma_box_addresses(dst, cfg["BN"], c)
        b_addr = tma_box_addresses(dst + cfg["X_BYTES"], r, c)
        written = torch.cat([x_addr.reshape(-1), b_addr.reshape(-1)])
        assert written.unique().numel() == written.numel() == (cfg["X_BYTES"] + cfg["BLOCK_TX"]) // 2  # expect_tx
        assert int(written.min()) == dst and int(written.max()) < dst + cfg["STAGE_BYTES"]
        for kk in range(c // 16):
            ks = slice(16 * kk, 16 * kk + 16)
            assert wgmma_operand_addresses(make_desc(c, dst + cfg["X_BYTES"] + kk * 32), r).equal(b_addr[:, ks])
            for cw in range(consumers):
                for t in range(2):
                    start = dst + cw * WG_M * c * 2 + t * 64 * c * 2 + kk * 32
                    rows = slice(cw * WG_M + 64 * t, cw * WG_M + 64 * t + 64)
                    assert wgmma_operand_addresses(make_desc(c, start), 64).equal(x_addr[rows, ks])


def test_wgmma_t_accumulator_map_covers_the_m64_by_r_tile():
    for r in (16, 32):
        seen = torch.zeros(64, r, dtype=torch.int64)
        for warp in range(4):
            for lane in range(32):
                for i in range(r // 2):
                    seen[acc_row(warp, lane, i), acc_col(lane, i)] += 1
                    if i % 2 == 0:  # the epilogue's pairs: one token, columns m and m + 1 (one 4-byte store)
                        assert acc_row(warp, lane, i + 1) == acc_row(warp, lane, i)
                        assert acc_col(lane, i + 1) == acc_col(lane, i) + 1 and acc_col(lane, i) % 2 == 0
        assert bool((seen == 1).all())


def emulate_wgmma_t_bsr(
    blocks, crow, cols, x, m, bias, relu, schedule=None, split_rows=None, tile_n=256, staged=False, xslabs=False
):
    """bsr_wgmma_t_kernel's CTAs in float64: TMA boxes of the X slab (tokens x C) and of the block (r x C) into each
    stage (``xslabs``: the XR kernel, the slab a bulk copy of ``bsr_x_slabs_kernel``'s buffer at ``(col * npad + n0) *
    C``), two m64 wgmmas per consumer and k-step through the descriptors (D = slab @ block^T: tokens x r), the
    accumulator map, and the epilogue (``staged``: 4-byte pairs into a Y^T buffer of leading dimension ``m``; else
    scalar stores; split rows: fp32 partial sums finished like ``bsr_finalize_kernel``)."""
    r, c = blocks.shape[1], blocks.shape[2]
    k, n = x.shape
    consumers = tile_n // WG_M
    cfg = wgt_config(r, c, consumers)
    base = 1024
    y = torch.full((m, n), float("nan"), dtype=torch.float64)
    if schedule is None:
        items = [(row, int(crow[row]), int(crow[row + 1]), -1) for row in range(m // r)]
    else:
        items = [tuple(int(v) for v in item) for item in schedule]
    n_split = 0 if split_rows is None else split_rows.numel()
    ws = torch.zeros(n_split, r, n, dtype=torch.float64)
    xd = x.double()
    npad = -(-n // 256) * 256
    slabs = x_slabs(x.t(), c, npad) if xslabs else None
    blocks_2d = blocks.double().reshape(-1, c)  # map_a: (C, capacity * r), box (C, r)
    warp, lane, i = torch.meshgrid(torch.arange(4), torch.arange(32), torch.arange(r // 2), indexing="ij")
    frag_row = (16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1)).reshape(-1)
    frag_col = (8 * (i >> 2) + 2 * (lane & 3) + (i & 1)).reshape(-1)
    for block_row, start, end, slot in items:
        for n_tile in range(-(-n // tile_n)):
            n0 = n_tile * tile_n
            smem = SharedMemory(cfg["SMEM_BYTES"] + 1024)
            acc = torch.zeros(consumers, 2, 64, r, dtype=torch.float64)  # [consumer][m64 tile] D tiles
            for it in range(end - start):
                b = start + it
                dst = base + (it % cfg["STAGES"]) * cfg["STAGE_BYTES"]
                smem.data[dst // 2 : (dst + cfg["STAGE_BYTES"]) // 2] = float("nan")
                k0 = int(cols[b]) * c  # box of map_x at (col * C, n0); zeros past N
                slab = torch.zeros(tile_n, c, dtype=torch.float64)
                width = max(0, min(tile_n, n - n0))
                slab[:width] = xd[k0 : k0 + c, n0 : n0 + width].t()
                if xslabs:  # bulk_load: the bytes as they are, at dst
                    src = (int(cols[b]) * npad + n0) * c
                    smem.data[dst // 2 : dst // 2 + tile_n * c] = slabs[src : src + tile_n * c]
                else:
                    smem.write(tma_box_addresses(dst, tile_n, c), slab)
                smem.write(tma_box_addresses(dst + cfg["X_BYTES"], r, c), blocks_2d[b * r : b * r + r])
                for cw in range(consumers):
                    for t in range(2):
                        for kk in range(c // 16):
                            a_start = dst + cw * WG_M * c * 2 + t * 64 * c * 2 + kk * 32
                            a_k = smem.read(wgmma_operand_addresses(make_desc(c, a_start), 64))
                            b_k = smem.read(wgmma_operand_addresses(make_desc(c, dst + cfg["X_BYTES"] + kk * 32), r))
                            acc[cw, t] += a_k @ b_k.t()
            m0 = block_row * r
            for cw in range(consumers):
                for t in range(2):
                    vals = acc[cw, t][frag_row, frag_col]
                    tok = n0 + cw * WG_M + 64 * t + frag_row
                    keep = tok < n
                    mm, tok, vals = frag_col[keep], tok[keep], vals[keep]
                    if slot >= 0:
                        ws[slot].index_put_((mm, tok), vals, accumulate=True)  # atomicAdd
                        continue
                    if bias is not None:
                        vals = vals + bias.double()[m0 + mm]
                    vals = vals.clamp_min(0.0) if relu else vals
                    if staged:  # the pair (mm, mm + 1) of token tok: one 4-byte store at y + tok * m + m0 + mm
                        assert bool(((tok * m + m0 + mm)[mm % 2 == 0] % 2 == 0).all())
                    assert bool(torch.isnan(y[m0 + mm, tok]).all())  # each element written once
                    y[m0 + mm, tok] = vals
    return finalize_split_rows(y, ws, split_rows, r, bias, relu)


@pytest.mark.parametrize(
    ("r", "c", "tile_n", "n", "static", "staged", "xslabs"),
    [
        (32, 32, 256, 300, True, True, False),
        (16, 64, 128, 5, False, True, False),
        (32, 16, 256, 1, True, False, False),
        (16, 16, 256, 130, False, False, False),
        (16, 16, 256, 300, True, True, True),
        (32, 64, 128, 130, False, False, True),
    ],
)
def test_wgmma_t_schedule_emulation_matches_float64(r, c, tile_n, n, static, staged, xslabs):
    m, k = 6 * r, 6 * c
    dense = block_sparse_weight(m, k, r, c, 0.4, torch.float32, seed=r + c + n, heavy_rows=1)
    comp = formats.encode("bsr", dense, {"block_rows": r, "block_cols": c}).components
    x2d = torch.randn(n, k)
    bias = torch.randn(m)
    schedule = split_rows = None
    if static:
        schedule, split_rows = static_schedule(comp["crow_indices"], chunk=2)
        assert split_rows.numel() > 0
    y = emulate_wgmma_t_bsr(
        comp["blocks"], comp["crow_indices"], comp["col_indices"], x2d.t(), m, bias, True, schedule, split_rows,
        tile_n, staged=staged, xslabs=xslabs,
    )  # fmt: skip
    assert not bool(torch.isnan(y).any())
    assert relative_error(y, spmm_reference64(dense, x2d.t(), bias, "relu")) < 1e-12


def test_auto_takes_wgmma_only_for_the_measured_block_rows_and_n(monkeypatch):
    """32- and 64-row blocks at every N; 16-row blocks from N = 33 (the C++ entry's rule), so the runtime leaves "auto"
    unresolved for them."""
    monkeypatch.setattr(structured, "_wgmma_state", True)
    lo = structured.AUTO_WGMMA_16_MIN_N
    assert structured.AUTO_WGMMA_ROWS == (32, 64) and lo == 33
    for r, c in structured.WGMMA_BLOCKS:
        blocks = torch.zeros(1, r, c, dtype=torch.float16)
        assert structured.wgmma_supports(blocks)
        assert structured.auto_takes_wgmma(blocks) == (r in structured.AUTO_WGMMA_ROWS)
        for n in (lo - 1, lo, 2048, 8192):
            assert structured.auto_takes_wgmma(blocks, n=n) == (r != 16 or n >= lo)
        assert not structured.auto_takes_wgmma(blocks, tile_n=32, n=lo)  # a tile only the mma.sync kernel has
    monkeypatch.setattr(structured, "_wgmma_state", False)
    assert not structured.auto_takes_wgmma(torch.zeros(1, 32, 32, dtype=torch.float16))


def x_slabs(x2d: torch.Tensor, c: int, npad: int) -> torch.Tensor:
    """Mirror of ``bsr_x_slabs_kernel``: ``x2d (N, K)`` into ``(K / C) * npad * C`` elements, thread by thread (one per
    16-byte chunk of the output, in output order)."""
    n, k = x2d.shape
    h_per = c // 8
    out = torch.full(((k // c) * npad * c,), float("nan"), dtype=torch.float64)
    for i in range((k // c) * npad * h_per):
        h, rest = i % h_per, i // h_per
        t, j = rest % npad, rest // npad
        hs = h ^ ((t * c // 64) & (h_per - 1))
        chunk = x2d[t, j * c + 8 * hs : j * c + 8 * hs + 8].double() if t < n else torch.zeros(8, dtype=torch.float64)
        out[8 * i : 8 * i + 8] = chunk
    return out


@pytest.mark.parametrize("c", [16, 32, 64])
@pytest.mark.parametrize("tile_n", [128, 256])
def test_x_slabs_bulk_copy_lands_where_the_tma_box_would(c, tile_n):
    """The XR kernels' bulk copy of X-slab bytes ``[(col * npad + n0) * C, + BN * C)`` into a 1024-aligned stage writes
    every shared-memory element the TMA box of ``(col * C, n0)`` (with the swizzle make_map picks) would, with the same
    value: token t's k-th element of block column col, zero past N."""
    n, k = 300, 3 * c
    npad = -(-n // 256) * 256
    x2d = torch.randn(n, k)
    slabs = x_slabs(x2d, c, npad)
    assert not bool(torch.isnan(slabs).any())
    dst = 2048
    for col in range(k // c):
        for n0 in range(0, npad, tile_n):
            tma = SharedMemory(dst + tile_n * c * 2)
            box = torch.zeros(tile_n, c, dtype=torch.float64)
            width = max(0, min(tile_n, n - n0))
            box[:width] = x2d[n0 : n0 + width, col * c : (col + 1) * c].double()
            tma.write(tma_box_addresses(dst, tile_n, c), box)
            start = (col * npad + n0) * c
            bulk = slabs[start : start + tile_n * c]
            assert torch.equal(tma.data[dst // 2 : dst // 2 + tile_n * c], bulk), (col, n0)


def test_x_slabs_rule_follows_the_reuse_thresholds():
    """Blocks per block column at least 12 (16-row) / 24 (32-row) at N >= 1024, 48 below; never for 64-row blocks."""
    k = 4096
    for r, c in ((16, 16), (32, 32), (16, 64), (32, 16)):
        cols = k // c
        lo = structured.XSLABS_MIN_REUSE[r]
        assert structured.x_slabs_rule(r, c, k, lo * cols, 2048)
        assert not structured.x_slabs_rule(r, c, k, lo * cols - 1, 2048)
        assert not structured.x_slabs_rule(r, c, k, lo * cols, 128)
        assert not structured.x_slabs_rule(r, c, k, lo * cols, structured.XSLABS_SMALL_N - 1)
        assert structured.x_slabs_rule(r, c, k, lo * cols, structured.XSLABS_SMALL_N)  # N = 256: large-N thresholds
        assert structured.x_slabs_rule(r, c, k, structured.XSLABS_MIN_REUSE_SMALL_N * cols, 128)
    assert not structured.x_slabs_rule(64, 64, k, 10**6, 4096)
    # the measured points: 16384 x 16384 at 90% keeps about 0.1 of its blocks
    assert structured.x_slabs_rule(16, 16, 16384, 104858, 8192) and structured.x_slabs_rule(32, 32, 16384, 26214, 8192)
    assert not structured.x_slabs_rule(32, 32, 4096, 1638, 4096)  # 4096 x 4096 at 90%: reuse 12.8, a tie measured


# --- bsr_wgmma_t_kernel's launch plan (plan_launch), compiled alone on the CPU ---------------------------------------

WGMMA_HEADER = Path(structured.__file__).parent / "csrc" / "structured" / "bsr_mm_wgmma.cuh"
PLAN_LAUNCH_DRIVER = r"""
#include <algorithm>
#include <cstdio>
#include <iostream>
#define PRUNEKIT_CHECK(cond, ...) \
  if (!(cond)) throw 1
struct BsrArgs {
  int n, staged;
};
%s
int main() {
  int grid_rows, n, tpc, bn, single, multi, wanted, epi, stage_bytes, wave;
  while (std::cin >> grid_rows >> n >> tpc >> bn >> single >> multi >> wanted >> epi >> stage_bytes >> wave) {
    BsrTArgs args{};
    args.n = n;
    const auto resident = [&](int smem) { return smem >= 100000 ? wave / 2 : wave; };  // a bigger CTA: half the wave
    const auto smem_of = [&](int stages, bool own) { return stages * stage_bytes + (own ? epi : 0); };
    const WgLaunch plan = plan_launch(args, tpc, grid_rows, bn, single, multi, wanted, epi, stage_bytes, resident,
                                      smem_of);
    std::printf("%%d %%d %%d %%d %%d\n", plan.ctas, plan.smem, args.n_items, args.stages, args.own_tile);
  }
}
"""


def _plan_launch_source() -> str:
    """bsr_mm_wgmma.cuh's BsrTArgs, then the header from TILES_WAVE to the end of plan_launch (WgLaunch included), as
    they are."""
    text = WGMMA_HEADER.read_text()
    args_start = text.index("struct BsrTArgs : BsrArgs {")
    args_end = text.index("};\n", args_start) + 3
    start = text.index("constexpr int TILES_WAVE")
    end = text.index("\n}\n", text.index("WgLaunch plan_launch(")) + 3
    return text[args_start:args_end] + text[start:end]


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a host C++ compiler")
def test_plan_launch_on_the_cpu(tmp_path):
    """The 16/32-row kernel's launch plan, cut out of the header and compiled with the host compiler: CTAs, dynamic
    shared memory, stages and the own staging tile for one tile per CTA, groups of tiles, one wave (only where every
    CTA gets WAVE_MIN_TILES tiles), the stage cap and floor, and the staging tile where the stages cannot hold it."""
    source = tmp_path / "plan.cpp"
    source.write_text(PLAN_LAUNCH_DRIVER % _plan_launch_source())
    exe = tmp_path / "plan"
    subprocess.run(["c++", "-std=c++17", "-O1", str(source), "-o", str(exe)], check=True, capture_output=True)
    # (grid_rows, n, tiles_per_cta, bn, single, multi, wanted, epi, stage_bytes, wave) -> (ctas, smem, n_items,
    # stages, own_tile); smem_of = stages * stage_bytes (+ epi with an own tile); a wave of 264 CTAs, 132 from 100 KB
    cases = {
        # one tile per CTA: 96 rows x 16 tiles; 6 stages hold the 20 KB tile
        (96, 4096, 1, 256, 6, 5, 0, 20480, 18432, 264): (1536, 6 * 18432, 96, 6, 0),
        # 2 stages of 9 KB cannot hold it: a tile of its own, one tile per CTA still
        (96, 4096, 1, 256, 6, 5, 2, 20480, 9216, 264): (1536, 2 * 9216 + 20480, 96, 2, 1),
        # groups of 3 over 10 tiles: 4 CTAs with the multi-tile stages and their own tile
        (5, 256, 3, 128, 6, 5, 0, 20480, 18432, 264): (4, 5 * 18432 + 20480, 5, 5, 1),
        # more tiles per CTA than tiles: one CTA
        (5, 256, 64, 128, 6, 5, 0, 20480, 18432, 264): (1, 5 * 18432 + 20480, 5, 5, 1),
        # a wave where it gives fewer than 2 tiles a CTA (384 tiles, a wave of 264 with 3 stages): one tile per CTA,
        # as with 1; and where it gives 2 or more (768 tiles, a wave of 132 with 5 stages and the tile): the wave
        (96, 1024, -1, 256, 6, 5, 3, 20480, 18432, 264): (384, 3 * 18432, 96, 3, 0),
        (96, 2048, -1, 256, 6, 5, 0, 20480, 18432, 264): (132, 5 * 18432 + 20480, 96, 5, 1),
        # a wave of 132 (the multi-tile CTA is over 100 KB) over 1536 tiles
        (96, 4096, -1, 256, 6, 5, 0, 20480, 18432, 264): (132, 5 * 18432 + 20480, 96, 5, 1),
        # the same with 3 stages: 75 KB, a wave of 264
        (96, 4096, -1, 256, 6, 5, 3, 20480, 18432, 264): (264, 3 * 18432 + 20480, 96, 3, 1),
        # no staging tile (another epilogue): never an own tile
        (96, 4096, 2, 256, 6, 6, 0, 0, 18432, 264): (768, 6 * 18432, 96, 6, 0),
        # stages wanted over the most: capped; under 2: 2
        (8, 300, 1, 128, 6, 5, 12, 20480, 18432, 264): (24, 6 * 18432, 8, 6, 0),
        (8, 300, 1, 128, 6, 5, 1, 20480, 18432, 264): (24, 2 * 18432, 8, 2, 0),
    }
    lines = "\n".join(" ".join(map(str, case)) for case in cases)
    out = subprocess.run([str(exe)], input=lines, capture_output=True, text=True, check=True).stdout
    got = [tuple(map(int, line.split())) for line in out.splitlines()]
    assert got == list(cases.values())
