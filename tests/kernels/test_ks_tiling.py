"""CPU emulation of the ``prunekit::ks_mm`` CUDA kernels' tiling and index math (``csrc/ks/ks_mm.cuh``, ``ks_mm.cu``).

Written before any GPU ran these kernels (issue 8; the one-group kernels have since passed their CUDA tests and the
sweep on the H100, the delta-block kernel has not run on a GPU yet), this file replays, in pure torch, what every
CTA of the tensor-core kernel (``ks_mm_tc_kernel``: BM x 128 tiles, BK = 32, eight warps of 2 x FRAG_N WMMA
16x16x16 fragments), of the batch-first delta-block kernel (``ks_mm_tc_dblock_kernel``: 8, 4 or 2 deltas per CTA)
and of the fp32 kernel (``ks_mm_f32_kernel``: 128 x 128 x 8, 8 x 8 outputs per thread) computes: the host's choice of load
path (``ks_mm_out``: vec_w, vec_x), each load path's index expressions over flat storage (the strides of X as
given, zero fill outside b, c and N, the cp.async partial-byte fill), the shared-memory tile addressing with its
padded leading dimensions, the WMMA fragment addressing (pointer + row * ldm), the k loop, and the epilogue's
lane -> (row, column) map with bias and ReLU. Each emulated output is compared with a float64 reference, every
output element must be written exactly once, every read must fall inside X's storage, and every 16-byte access
must be 16-byte aligned. The expressions below mirror the CUDA source line by line; a change to the kernel's index
math must be mirrored here.
"""

from __future__ import annotations

import pytest
import torch

from prunekit.formats.ks import blocks_to_dense

# ks_mm.cuh constants
TC_BN, TC_BK, TC_THREADS, TC_PAD = 128, 32, 256, 8
VEC = 8  # elements of fp16/bf16 in one 16-byte access
# ks_mm.cu constants (fp32 kernel)
F_BM, F_BN, F_BK, F_THREADS = 128, 128, 8, 256


class Strided:
    """X (K, N) or Y (M, N) as flat storage + (stride_row, stride_col, offset), like the kernel's pointer + strides."""

    def __init__(self, flat: torch.Tensor, rows: int, cols: int, s_row: int, s_col: int, offset: int = 0):
        self.flat, self.rows, self.cols, self.s_row, self.s_col, self.offset = flat, rows, cols, s_row, s_col, offset

    def view(self) -> torch.Tensor:
        return self.flat.as_strided((self.rows, self.cols), (self.s_row, self.s_col), self.offset)

    def read(self, elem: torch.Tensor) -> torch.Tensor:
        """Values at element offsets (relative to the data pointer); asserts they lie inside the storage."""
        absolute = elem + self.offset
        if absolute.numel():
            assert int(absolute.min()) >= 0 and int(absolute.max()) < self.flat.numel(), "read outside X's storage"
        return self.flat[absolute]


def host_paths(c: int, d: int, x: Strided) -> tuple[int, int]:
    """``ks_mm_out``'s vec_w / vec_x choice (blocks contiguous and 16-byte aligned; X aligned iff offset % 8 == 0)."""
    vec_w = 1 if c % 8 == 0 else 0
    aligned = x.offset % VEC == 0
    if x.s_col == 1 and x.s_row % 8 == 0 and aligned:
        return vec_w, 1
    if x.s_row == 1 and x.s_col % 8 == 0 and d == 1 and c % 8 == 0 and aligned:
        return vec_w, 2
    return vec_w, 0


def tc_load_tile(bm, a_dst, b_dst, w_flat, w_g_off, x: Strided, x_row0, beta0, n0, k0, b, c, d, n_total, vec_w, vec_x):
    """``tc_load_tile``: fills the flat shared-memory tiles a_dst (BM x LDA) and b_dst (BK x LDB); returns the path
    taken for X ("vec1", "vec2", "scalar_last" or "scalar_any")."""
    lda, ldb = TC_BK + TC_PAD, TC_BN + TC_PAD
    if vec_w:
        v = torch.arange(bm * TC_BK // 8)
        r, kv = v // (TC_BK // 8), (v % (TC_BK // 8)) * 8
        beta, gamma = beta0 + r, k0 + kv
        inside = (beta < b) & (gamma < c)
        src = torch.where(inside, w_g_off + beta * c + gamma, w_g_off)
        assert bool((src[inside] % VEC == 0).all()), "unaligned 16-byte W load"
        for t in range(8):
            a_dst[r * lda + kv + t] = torch.where(inside, w_flat[torch.where(inside, src + t, 0)], 0.0)
    else:
        e = torch.arange(bm * TC_BK)
        r, kk = e // TC_BK, e % TC_BK
        beta, gamma = beta0 + r, k0 + kk
        inside = (beta < b) & (gamma < c)
        a_dst[r * lda + kk] = torch.where(inside, w_flat[torch.where(inside, w_g_off + beta * c + gamma, 0)], 0.0)
    if vec_x == 1:
        v = torch.arange(TC_BK * TC_BN // 8)
        kk, nv = v // (TC_BN // 8), (v % (TC_BN // 8)) * 8
        gamma, n = k0 + kk, n0 + nv
        valid = torch.where(gamma < c, (n_total - n).clamp(0, 8), 0)
        src = torch.where(valid > 0, (x_row0 + gamma * d) * x.s_row + n, 0)
        assert bool(((src[valid > 0] + x.offset) % VEC == 0).all()), "unaligned 16-byte X load"
        for t in range(8):
            take = t < valid  # cp.async with src_bytes = valid * 2: the rest of the 16 bytes is zero-filled
            b_dst[kk * ldb + nv + t] = torch.where(take, x.read(torch.where(take, src + t, 0)), 0.0)
        return "vec1"
    if vec_x == 2:
        v = torch.arange(TC_BK * TC_BN // 8)
        nn, kv = v // (TC_BK // 8), (v % (TC_BK // 8)) * 8
        gamma, n = k0 + kv, n0 + nn
        inside = (gamma < c) & (n < n_total)
        src = x_row0 + gamma + n * x.s_col
        assert bool(((src[inside] + x.offset) % VEC == 0).all()), "unaligned 16-byte X load"
        for t in range(8):
            b_dst[(kv + t) * ldb + nn] = torch.where(inside, x.read(torch.where(inside, src + t, 0)), 0.0)
        return "vec2"
    e = torch.arange(TC_BK * TC_BN)
    if x.s_col == 1:
        kk, nn = e // TC_BN, e % TC_BN
        path = "scalar_last"
    else:
        kk, nn = e % TC_BK, e // TC_BK
        path = "scalar_any"
    gamma, n = k0 + kk, n0 + nn
    inside = (gamma < c) & (n < n_total)
    src = (x_row0 + gamma * d) * x.s_row + n * x.s_col
    b_dst[kk * ldb + nn] = torch.where(inside, x.read(torch.where(inside, src, 0)), 0.0)
    return path


def frag(base: int, ldm: int) -> torch.Tensor:
    """``wmma::load_matrix_sync`` addressing of a row-major 16 x 16 fragment: flat indices ``base + row * ldm +
    col``; checks the 32-byte pointer alignment and ldm % 8 that WMMA requires for 16-bit types."""
    assert base % 16 == 0 and ldm % 8 == 0, "WMMA pointer not 32-byte aligned or ldm not a multiple of 8"
    return base + torch.arange(16)[:, None] * ldm + torch.arange(16)[None, :]


def emulate_tc(blocks, x: Strided, y: Strided, bias, relu, bm, pipelined, writes, paths, scalar_only=False):
    """Every CTA of ``ks_mm_tc_kernel<T, BM, PIPE>`` in float64. ``writes`` counts stores per Y element.
    ``scalar_only``: T = float (3xTF32), whose loads never take the 16-byte paths."""
    a, d, b, c = blocks.shape
    n_total = x.cols
    w_flat = blocks.reshape(-1)
    vec_w, vec_x = (0, 0) if scalar_only else host_paths(c, d, x)
    warps_m = bm // 32
    warps_n = 8 // warps_m
    wn = TC_BN // warps_n
    frag_m, frag_n = 2, wn // 16
    lda, ldb = TC_BK + TC_PAD, TC_BN + TC_PAD
    stages = 2 if pipelined else 1
    k_steps = (c + TC_BK - 1) // TC_BK
    rows_contiguous = y.s_row == 1
    a_idx, b_idx, ep_row, ep_col, ep_st = fragment_indices(bm, rows_contiguous)
    for g in range(a * d):
        alpha, delta = g // d, g % d
        w_g_off = g * b * c
        x_row0 = alpha * c * d + delta
        for by in range((n_total + TC_BN - 1) // TC_BN):
            n0 = by * TC_BN
            for bz in range((b + bm - 1) // bm):
                beta0 = bz * bm
                a_s = torch.full((stages, bm * lda), float("nan"), dtype=torch.float64)
                b_s = torch.full((stages, TC_BK * ldb), float("nan"), dtype=torch.float64)
                acc = torch.zeros(8, frag_m, frag_n, 16, 16, dtype=torch.float64)
                for kt in range(k_steps):
                    cur = kt & 1 if pipelined else 0
                    paths.add(
                        tc_load_tile(bm, a_s[cur], b_s[cur], w_flat, w_g_off, x, x_row0, beta0, n0, kt * TC_BK,
                                     b, c, d, n_total, vec_w, vec_x)
                    )  # fmt: skip
                    fa = a_s[cur][a_idx]  # (warp, i, kk, 16, 16)
                    fb = b_s[cur][b_idx]  # (warp, j, kk, 16, 16)
                    acc += torch.einsum("wiqrk,wjqkc->wijrc", fa, fb)
                assert not torch.isnan(acc).any(), "an mma read a shared-memory element no load wrote"
                st = acc.reshape(8, frag_m, frag_n, 256)  # store_matrix_sync(st, acc, 16, mem_row_major) per warp
                beta = beta0 + ep_row
                n = n0 + ep_col
                keep = (beta < b) & (n < n_total)
                m = (alpha * b + beta) * d + delta
                v = st.gather(3, ep_st.expand(8, frag_m, frag_n, 256))
                if bias is not None:
                    v = v + bias[torch.where(keep, m, 0)]
                if relu:
                    v = v.clamp_min(0.0)
                off = (y.offset + m * y.s_row + n * y.s_col)[keep]
                y.flat[off] = v[keep]
                writes.index_add_(0, off, torch.ones_like(off))


def fragment_indices(bm: int, rows_contiguous: bool):
    """Flat shared-memory indices of every warp's WMMA fragments (load_matrix_sync at pointer + row * ldm) and the
    epilogue's (row, column, stage index) of every (warp, i, j, lane + t * 32)."""
    warps_m = bm // 32
    warps_n = 8 // warps_m
    wn = TC_BN // warps_n
    frag_m, frag_n = 2, wn // 16
    lda, ldb = TC_BK + TC_PAD, TC_BN + TC_PAD
    a_idx = torch.empty(8, frag_m, TC_BK // 16, 16, 16, dtype=torch.int64)
    b_idx = torch.empty(8, frag_n, TC_BK // 16, 16, 16, dtype=torch.int64)
    ep_row = torch.empty(8, frag_m, frag_n, 256, dtype=torch.int64)
    ep_col = torch.empty_like(ep_row)
    e = torch.arange(32)[:, None] + torch.arange(8)[None, :] * 32  # lane + t * 32, t < 8
    r = (e % 16 if rows_contiguous else e // 16).reshape(-1)
    cc = (e // 16 if rows_contiguous else e % 16).reshape(-1)
    for warp in range(8):
        warp_m, warp_n = warp // warps_n, warp % warps_n
        for q, kk in enumerate(range(0, TC_BK, 16)):
            for i in range(frag_m):
                a_idx[warp, i, q] = frag((warp_m * 32 + i * 16) * lda + kk, lda)
            for j in range(frag_n):
                b_idx[warp, j, q] = frag(kk * ldb + warp_n * wn + j * 16, ldb)
        for i in range(frag_m):
            for j in range(frag_n):
                ep_row[warp, i, j] = warp_m * 32 + i * 16 + r
                ep_col[warp, i, j] = warp_n * wn + j * 16 + cc
    return a_idx, b_idx, ep_row, ep_col, (r * 16 + cc).reshape(1, 1, 1, 256)


def emulate_f32(blocks, x: Strided, y: Strided, bias, relu, writes):
    """Every CTA of ``ks_mm_f32_kernel`` (128 x 128 x 8 tiles, thread (ty, tx) owns 8 x 8 outputs) in float64."""
    a, d, b, c = blocks.shape
    n_total = x.cols
    w_flat = blocks.reshape(-1)
    batch_last = x.s_col == 1
    tid = torch.arange(F_THREADS)
    ty, tx = tid // 16, tid % 16
    quarter = torch.arange(4)
    rows = torch.cat([ty[:, None] * 4 + quarter, 64 + ty[:, None] * 4 + quarter], 1)  # (256, 8): ra[i]
    cols = torch.cat([tx[:, None] * 4 + quarter, 64 + tx[:, None] * 4 + quarter], 1)  # (256, 8): rb[j]
    for g in range(a * d):
        alpha, delta = g // d, g % d
        x_row0 = alpha * c * d + delta
        for by in range((n_total + F_BN - 1) // F_BN):
            n0 = by * F_BN
            for bz in range((b + F_BM - 1) // F_BM):
                beta0 = bz * F_BM
                acc = torch.zeros(F_THREADS, 8, 8, dtype=torch.float64)
                for k0 in range(0, c, F_BK):
                    a_s = torch.full((F_BK, F_BM + 4), float("nan"), dtype=torch.float64)
                    b_s = torch.full((F_BK, F_BN + 4), float("nan"), dtype=torch.float64)
                    e = (tid[:, None] + torch.arange((F_BM * F_BK) // F_THREADS)[None, :] * F_THREADS).reshape(-1)
                    kk, r = e % F_BK, e // F_BK
                    beta, gamma = beta0 + r, k0 + kk
                    inside = (beta < b) & (gamma < c)
                    a_s[kk, r] = torch.where(inside, w_flat[torch.where(inside, g * b * c + beta * c + gamma, 0)], 0.0)
                    e = (tid[:, None] + torch.arange((F_BK * F_BN) // F_THREADS)[None, :] * F_THREADS).reshape(-1)
                    kk = e // F_BN if batch_last else e % F_BK
                    nn = e % F_BN if batch_last else e // F_BK
                    gamma, n = k0 + kk, n0 + nn
                    inside = (gamma < c) & (n < n_total)
                    src = (x_row0 + gamma * d) * x.s_row + n * x.s_col
                    b_s[kk, nn] = torch.where(inside, x.read(torch.where(inside, src, 0)), 0.0)
                    assert not torch.isnan(a_s[:, :F_BM]).any() and not torch.isnan(b_s[:, :F_BN]).any()
                    for kq in range(F_BK):
                        acc += a_s[kq][rows][:, :, None] * b_s[kq][cols][:, None, :]
                beta = beta0 + rows[:, :, None].expand(-1, -1, 8)
                n = n0 + cols[:, None, :].expand(-1, 8, -1)
                keep = (beta < b) & (n < n_total)
                m = (alpha * b + beta) * d + delta
                v = acc.clone()
                if bias is not None:
                    v = v + bias[torch.where(keep, m, 0)]
                if relu:
                    v = v.clamp_min(0.0)
                off = (y.offset + m * y.s_row + n * y.s_col)[keep]
                y.flat[off] = v[keep]
                writes.index_add_(0, off, torch.ones_like(off))


def make_x(k: int, n: int, layout: str, g: torch.Generator) -> Strided:
    """X (k, n) over flat storage: batch_last (row-major), batch_first (x2d.t()), and padded / offset variants that
    force the scalar paths (unaligned leading dimensions or data pointer)."""
    if layout == "batch_last":
        return Strided(torch.randn(k * n, generator=g, dtype=torch.float64), k, n, n, 1)
    if layout == "batch_first":
        return Strided(torch.randn(n * k, generator=g, dtype=torch.float64), k, n, 1, k)
    if layout == "batch_last_padded":  # row stride n + 3, data pointer 1 element in
        return Strided(torch.randn(k * (n + 3) + 1, generator=g, dtype=torch.float64), k, n, n + 3, 1, 1)
    if layout == "batch_first_offset":  # x2d rows of k + 8, data pointer 8 elements in (aligned)
        return Strided(torch.randn(n * (k + 8) + 8, generator=g, dtype=torch.float64), k, n, 1, k + 8, 8)
    if layout == "batch_first_stride2":  # x2d rows of k + 2, data pointer 2 elements in (4-byte aligned only)
        return Strided(torch.randn(n * (k + 2) + 2, generator=g, dtype=torch.float64), k, n, 1, k + 2, 2)
    raise ValueError(layout)


def make_y(m: int, n: int, x: Strided) -> Strided:
    """``layout.new_spmm_output``: column-major Y for a column-major X, else row-major."""
    flat = torch.full((m * n,), float("nan"), dtype=torch.float64)
    if x.s_row == 1 and x.s_col != 1:
        return Strided(flat, m, n, 1, m)
    return Strided(flat, m, n, n, 1)


def reference(blocks, x: Strided, bias, relu):
    y = blocks_to_dense(blocks) @ x.view()
    if bias is not None:
        y = y + bias[:, None]
    return y.clamp_min(0.0) if relu else y


def run_case(quad, n, layout, kernel, seed=0):
    a, b, c, d = quad
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(a, d, b, c, generator=g, dtype=torch.float64)
    x = make_x(a * c * d, n, layout, g)
    bias = torch.randn(a * b * d, generator=g, dtype=torch.float64) if seed % 2 == 0 else None
    relu = seed % 3 == 0
    y = make_y(a * b * d, n, x)
    writes = torch.zeros(y.flat.numel(), dtype=torch.int64)
    paths: set[str] = set()
    if kernel == "f32":
        emulate_f32(blocks, x, y, bias, relu, writes)
    elif kernel == "tf32x3":  # ks_mm_tc_kernel<float, 64, one stage>, scalar load paths (launch_tf32x3)
        emulate_tc(blocks, x, y, bias, relu, 64, False, writes, paths, scalar_only=True)
    elif kernel == "dblock":  # the width the host would pick (8, 4 or 2 deltas per CTA)
        dt = dblock_width(d, x, y)
        assert dt in (2, 4, 8) and d % dt == 0
        emulate_dblock(blocks, x, y, bias, relu, writes, dt)
        paths.add(f"dblock{dt}")
    else:
        bm, pipelined = kernel
        emulate_tc(blocks, x, y, bias, relu, bm, pipelined, writes, paths)
    assert bool((writes == 1).all()), "an output element was written zero or several times"
    ref = reference(blocks, x, bias, relu)
    err = float((y.view() - ref).norm() / ref.norm().clamp_min(1e-30))
    assert err < 1e-12, (quad, n, layout, kernel, err)
    return paths


# Odd shapes: b, c not multiples of 16 (or 8), c spanning several k-steps with a ragged last one, N not a multiple
# of 128, b above one tile of 64 rows, d > 1 strided gathers, a > 1 groups.
TC_CASES = [
    ((1, 1, 1, 1), 1),
    ((2, 3, 5, 7), 40),
    ((3, 70, 40, 2), 130),
    ((1, 130, 72, 1), 129),
    ((2, 24, 48, 3), 17),
    ((1, 20, 33, 1), 136),
    ((2, 16, 16, 2), 37),
]


@pytest.mark.parametrize("layout", ["batch_last", "batch_first", "batch_last_padded", "batch_first_offset"])
def test_tc_kernel_tiling_emulation_matches_float64(layout):
    paths: set[str] = set()
    for seed, (quad, n) in enumerate(TC_CASES):
        kernels = [(64, False), (128, True)] if seed % 2 else [(64, True), (128, False)]
        for kernel in kernels:
            paths |= run_case(quad, n, layout, kernel, seed)
    expected = {
        "batch_last": {"vec1", "scalar_last"},  # vec1 needs N % 8 == 0 (16-byte rows)
        "batch_first": {"vec2", "scalar_any", "scalar_last"},  # N = 1: X is (K, 1) with unit strides
        "batch_last_padded": {"scalar_last"},
        "batch_first_offset": {"vec2", "scalar_any"},
    }[layout]
    assert paths == expected  # every X load path of the kernel is exercised by some layout


# fp32 kernels: c over several k-steps, b over one tile, N ragged, d > 1
F32_CASES = [((2, 3, 5, 7), 37), ((1, 130, 20, 1), 129), ((3, 9, 17, 2), 140)]


@pytest.mark.parametrize("layout", ["batch_last", "batch_first", "batch_last_padded"])
def test_f32_kernel_tiling_emulation_matches_float64(layout):
    for seed, (quad, n) in enumerate(F32_CASES):
        run_case(quad, n, layout, "f32", seed)


def test_host_path_choice_matches_layouts():
    g = torch.Generator().manual_seed(0)
    assert host_paths(16, 1, make_x(32, 16, "batch_last", g)) == (1, 1)
    assert host_paths(16, 1, make_x(32, 16, "batch_first", g)) == (1, 2)
    assert host_paths(16, 2, make_x(64, 16, "batch_first", g)) == (1, 0)  # d > 1: strided gather, scalar
    assert host_paths(12, 1, make_x(24, 16, "batch_first", g)) == (0, 0)
    assert host_paths(16, 1, make_x(32, 16, "batch_last_padded", g)) == (1, 0)


# ks_mm.cuh constants of the batch-first delta-block kernel (ks_mm_tc_dblock_kernel)
DB_BM, DB_BN, DB_BK = 64, 64, 16
DB_LDA, DB_LDB = DB_BK + 8, DB_BN + 8


def dblock_width(d: int, x: Strided, y: Strided) -> int:
    """``dblock_width`` of ks_mm.cuh (pointer alignment in elements: the offset's largest power of two up to 8)."""

    def align(offset: int) -> int:
        return 8 if offset % 8 == 0 else 4 if offset % 4 == 0 else 2 if offset % 2 == 0 else 1

    if x.s_row != 1 or y.s_row != 1:
        return 0
    for dt in (8, 4, 2):
        if d % dt == 0 and x.s_col % dt == 0 and y.s_col % dt == 0 and align(x.offset) % dt == 0:
            if align(y.offset) % dt == 0:
                return dt
    return 0


def emulate_dblock(blocks, x: Strided, y: Strided, bias, relu, writes, dt: int):
    """Every CTA of ``ks_mm_tc_dblock_kernel<T, dt>``: dt deltas of one alpha per CTA, warp w = (delta0 + w % dt,
    token columns (w / dt) * WN ...), dt-element X vectors of a (token, gamma), W tiles of the dt groups, WMMA tiles of
    64 x WN per warp, and the epilogue's dt-element Y vectors of a (beta, n). Mirrors the CUDA index expressions."""
    a, d, b, c = blocks.shape
    assert d % dt == 0 and x.s_row == 1 and x.s_col % dt == 0 and y.s_row == 1 and y.s_col % dt == 0
    wpd = 8 // dt
    wn = DB_BN // wpd
    frag_n = wn // 16
    w_flat = blocks.reshape(-1)
    n_total = x.cols
    vec_w = 1 if c % 8 == 0 else 0
    blocks_per_alpha = d // dt
    lanes = torch.arange(dt)
    a_elems = dt * DB_BM * DB_LDA
    for bx in range(a * blocks_per_alpha):
        alpha, delta0 = bx // blocks_per_alpha, (bx % blocks_per_alpha) * dt
        g0 = alpha * d + delta0
        for by in range((n_total + DB_BN - 1) // DB_BN):
            n0 = by * DB_BN
            for bz in range((b + DB_BM - 1) // DB_BM):
                beta0 = bz * DB_BM
                acc = torch.zeros(8, DB_BM, wn, dtype=torch.float64)  # per warp
                for kt in range((c + DB_BK - 1) // DB_BK):
                    k0 = kt * DB_BK
                    smem = torch.full((a_elems + dt * DB_BK * DB_LDB,), float("nan"), dtype=torch.float64)
                    # X: v -> (kk = v % BK, nn = v / BK), one vector of the dt deltas
                    v = torch.arange(DB_BN * DB_BK)
                    kk, nn = v % DB_BK, v // DB_BK
                    gamma, n = k0 + kk, n0 + nn
                    valid = (gamma < c) & (n < n_total)
                    src = n * x.s_col + (alpha * c + gamma) * d + delta0
                    assert bool(((src[valid] + x.offset) % dt == 0).all()), "unaligned X vector load"
                    vals = torch.zeros(v.numel(), dt, dtype=torch.float64)
                    vals[valid] = x.read(src[valid, None] + lanes)
                    for i in range(dt):
                        smem[a_elems + (i * DB_BK + kk) * DB_LDB + nn] = vals[:, i]
                    # W: the dt groups' BM x BK tiles
                    if vec_w:
                        v = torch.arange(dt * DB_BM * (DB_BK // 8))
                        kv, r, i = (v % (DB_BK // 8)) * 8, (v // (DB_BK // 8)) % DB_BM, v // (DB_BM * (DB_BK // 8))
                        beta, gamma = beta0 + r, k0 + kv
                        inside = (beta < b) & (gamma < c)
                        src = (g0 + i) * b * c + beta * c + gamma
                        assert bool((src[inside] % VEC == 0).all()), "unaligned 16-byte W load"
                        vals = torch.zeros(v.numel(), VEC, dtype=torch.float64)
                        vals[inside] = w_flat[src[inside, None] + torch.arange(VEC)]
                        dst = (i * DB_BM + r) * DB_LDA + kv
                        assert bool((dst % VEC == 0).all()), "unaligned 16-byte shared-memory store"
                        for t in range(VEC):
                            smem[dst + t] = vals[:, t]
                    else:
                        e = torch.arange(dt * DB_BM * DB_BK)
                        kk, r, i = e % DB_BK, (e // DB_BK) % DB_BM, e // (DB_BM * DB_BK)
                        beta, gamma = beta0 + r, k0 + kk
                        inside = (beta < b) & (gamma < c)
                        vals = torch.zeros(e.numel(), dtype=torch.float64)
                        vals[inside] = w_flat[((g0 + i) * b * c + beta * c + gamma)[inside]]
                        smem[(i * DB_BM + r) * DB_LDA + kk] = vals
                    for warp in range(8):
                        di, sub = warp % dt, warp // dt
                        for i in range(DB_BM // 16):
                            fa = smem[frag((di * DB_BM + i * 16) * DB_LDA, DB_LDA)]
                            for j in range(frag_n):
                                fb = smem[frag(a_elems + (di * DB_BK) * DB_LDB + sub * wn + j * 16, DB_LDB)]
                                acc[warp, i * 16 : i * 16 + 16, j * 16 : j * 16 + 16] += fa @ fb
                # epilogue: stage (8 warps, 16, 16) per fragment; idx = tid + q * 256 -> (s_blk, r, cc)
                idx_all = torch.arange(wpd * TC_THREADS)
                s_blk, r, cc = idx_all // 256, (idx_all % 256) // 16, idx_all % 16
                for i in range(DB_BM // 16):
                    for j in range(frag_n):
                        stage = acc[:, i * 16 : i * 16 + 16, j * 16 : j * 16 + 16]  # (8, 16, 16)
                        beta, n = beta0 + i * 16 + r, n0 + s_blk * wn + j * 16 + cc
                        valid = (beta < b) & (n < n_total)
                        m0 = (alpha * b + beta) * d + delta0
                        out = torch.stack([stage[s_blk * dt + k, r, cc] for k in range(dt)], dim=1)
                        if bias is not None:
                            out = out + bias[(m0[:, None] + lanes).clamp_max(bias.numel() - 1)]
                        if relu:
                            out = out.clamp_min(0.0)
                        dst = m0 + n * y.s_col + y.offset
                        assert bool((dst[valid] % dt == 0).all()), "unaligned Y vector store"
                        idx = dst[valid, None] + lanes
                        if idx.numel():
                            assert int(idx.max()) < y.flat.numel(), "write outside Y's storage"
                        y.flat[idx.reshape(-1)] = out[valid].reshape(-1)
                        writes.index_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.int64))


@pytest.mark.parametrize("layout", ["batch_last", "batch_first", "batch_last_padded"])
def test_tf32x3_kernel_tiling_emulation_matches_float64(layout):
    paths: set[str] = set()
    for seed, (quad, n) in enumerate(F32_CASES):
        paths |= run_case(quad, n, layout, "tf32x3", seed)
    assert paths == {"scalar_any" if layout == "batch_first" else "scalar_last"}
    # tf32 fragments are 16 x 8 (A) and 8 x 16 (B) at k offsets 0, 8, 16, 24 of the 32-deep tile: every fragment
    # pointer must be 32-byte aligned (8 floats) and ldm a multiple of 4 floats
    lda, ldb = TC_BK + TC_PAD, TC_BN + TC_PAD
    assert lda % 4 == 0 and ldb % 4 == 0
    for kk in range(0, TC_BK, 8):
        for row in range(0, 64, 16):
            assert (row * lda + kk) % 8 == 0
        for col in range(0, TC_BN, 16):
            assert (kk * ldb + col) % 8 == 0


# (quad, N): d = 8, 16 (8 deltas per CTA), 4, 12 (4), 2, 6 (2); b over one 64-row tile and ragged, c over several
# 16-gamma steps with a ragged last one and not a multiple of 8 (scalar W loads), N ragged and N = 1, a > 1
DBLOCK_CASES = [(q, n) for q, n in zip([(1, 3, 5, 8), (2, 20, 33, 8), (1, 70, 16, 16), (3, 8, 24, 4), (2, 9, 40, 12),
                                        (1, 66, 17, 2), (2, 5, 24, 6)], [40, 70, 65, 1, 130, 67, 33])]  # fmt: skip


@pytest.mark.parametrize("layout", ["batch_first", "batch_first_offset", "batch_first_stride2"])
def test_delta_block_kernel_tiling_emulation_matches_float64(layout):
    widths: set[str] = set()
    for seed, (quad, n) in enumerate(DBLOCK_CASES):
        widths |= run_case(quad, n, layout, "dblock", seed)
    assert widths == ({"dblock2"} if layout == "batch_first_stride2" else {"dblock2", "dblock4", "dblock8"})


def test_delta_block_fits_names_what_is_missing():
    from prunekit.kernels.ks import delta_block_fits, delta_block_width

    blocks = torch.zeros(2, 8, 3, 4, dtype=torch.float16)
    x2d = torch.zeros(5, 2 * 4 * 8, dtype=torch.float16)
    y2d = torch.zeros(5, 2 * 3 * 8, dtype=torch.float16)
    assert delta_block_fits(blocks, x2d.t(), y2d.t()) is None and delta_block_width(blocks, x2d.t(), y2d.t()) == 8
    b4 = torch.zeros(2, 4, 3, 4, dtype=torch.float16)
    assert delta_block_width(b4, torch.zeros(5, 32, dtype=torch.float16).t(), torch.zeros(5, 24).half().t()) == 4
    shifted = torch.zeros(5 * 64 + 1, dtype=torch.float16)[1:].view(5, 64).t()  # data pointer 2 bytes in
    assert delta_block_width(blocks, shifted, y2d.t()) == 0 and "divisible" in delta_block_fits(
        blocks, shifted, y2d.t()
    )
    assert "even d" in delta_block_fits(torch.zeros(2, 3, 3, 4, dtype=torch.float16), x2d.t(), y2d.t())
    assert "batch-first x" in delta_block_fits(blocks, x2d.t().contiguous(), y2d.t())
    assert "float16 or bfloat16" in delta_block_fits(blocks.float(), x2d.t().float(), y2d.t().float())
    # one column (N = 1): the column strides never matter (a fresh (m, 1) output has strides (1, 1); seen on the H100)
    x1, y1 = torch.zeros(1, 64, dtype=torch.float16).t(), torch.zeros(48, 1, dtype=torch.float16)
    assert delta_block_fits(blocks, x1, y1) is None and delta_block_width(blocks, x1, y1) == 8


def test_delta_block_rule_is_the_measured_one_and_needs_a_fitting_batch_first_layout():
    from prunekit.kernels.ks import pick_delta_block, uses_delta_block

    # H100 sweep: width 8 wins unless c > 64 is ragged; width 4 wins where min(b, c) <= 64; width 2 never
    assert pick_delta_block(1024, 1024, 8) and pick_delta_block(7, 14, 8) and not pick_delta_block(448, 910, 8)
    assert pick_delta_block(48, 192, 4) and pick_delta_block(192, 48, 4) and not pick_delta_block(96, 96, 4)
    assert not pick_delta_block(64, 64, 2) and not pick_delta_block(64, 64, 0)
    blocks = torch.zeros(2, 16, 64, 64, dtype=torch.float16)
    x2d = torch.zeros(5, 2 * 64 * 16, dtype=torch.float16)
    y2d = torch.zeros(5, 2 * 64 * 16, dtype=torch.float16)
    assert uses_delta_block(blocks, x2d.t(), y2d.t())
    assert not uses_delta_block(blocks, x2d.t().contiguous(), y2d.t().contiguous())  # batch-last
    assert not uses_delta_block(blocks.float(), x2d.float().t(), y2d.float().t())  # fp32: CUDA-core kernel
    shifted = torch.zeros(5 * 2048 + 1, dtype=torch.float16)[1:].view(5, 2048).t()  # misaligned: cannot run
    assert not uses_delta_block(blocks, shifted, y2d.t())


def _rz_to_float32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded toward zero (the tensor cores' fp32 accumulation, as modelled here)."""
    x32 = x.float()
    over = x32.double().abs() > x.abs()
    x32[over] = torch.nextafter(x32[over], torch.zeros_like(x32[over]))
    return x32


def _to_tf32(v: torch.Tensor) -> torch.Tensor:
    """float32 rounded to nearest at 10 mantissa bits (``__float_to_tf32``)."""
    bits = v.float().contiguous().view(torch.int32).to(torch.int64)
    return ((bits + 0x1000) & 0xFFFFE000).to(torch.int32).view(torch.float32)


def _tf32x3_model(w: torch.Tensor, x: torch.Tensor, partial_sums: bool) -> torch.Tensor:
    """3xTF32 product of ``w (b, c)`` and ``x (c, n)`` in 8-deep mma steps, each mma summing exactly and truncating
    into its fp32 accumulator: into the running sum (``partial_sums=False``, the first kernel) or into a zeroed
    partial sum added with a round-to-nearest fp32 add (the kernel since the H100 test, ks_mm.cuh ``mma_tile``)."""
    wh, xh = _to_tf32(w), _to_tf32(x)
    wl, xl = _to_tf32(w - wh), _to_tf32(x - xh)
    acc = torch.zeros(w.shape[0], x.shape[1])
    for k in range(0, w.shape[1], 8):
        s = slice(k, k + 8)
        terms = [
            wl[:, s].double() @ xh[s].double(),
            wh[:, s].double() @ xl[s].double(),
            wh[:, s].double() @ xh[s].double(),
        ]
        if partial_sums:
            part = torch.zeros_like(acc)
            for t in terms:
                part = _rz_to_float32(part.double() + t)
            acc = acc + part  # fp32 add, round to nearest
        else:
            for t in terms:
                acc = _rz_to_float32(acc.double() + t)
    return acc


def test_tf32x3_partial_sums_remove_the_truncation_bias_of_long_reductions():
    # The H100 test of the first 3xTF32 kernel measured 1.35e-5 relative error for c = 903; this rounding model gives
    # the same order, and the round-to-nearest partial sums bring it to fp32 level (below torch's own fp32 matmul x2).
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(32, 903, generator=g), torch.randn(903, 64, generator=g)
    ref = w.double() @ x.double()

    def err(y):
        return float((y.double() - ref).norm() / ref.norm())

    old, new, fp32 = err(_tf32x3_model(w, x, False)), err(_tf32x3_model(w, x, True)), err(w @ x)
    assert old > 3e-6 and new < 1e-6 and new < 2 * fp32 + 1e-7, (old, new, fp32)


@pytest.mark.parametrize("layout", ["batch_last", "batch_first"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_diagonal_mm_matches_float64_in_both_layouts_on_poisoned_outputs(layout, dtype):
    # d = 1: ks_mm_cuda's default path (cuBLAS batched GEMM on CUDA); the same torch calls run here on the CPU
    from prunekit.kernels.ks import block_diagonal_mm
    from prunekit.kernels.ks_reference import ks_mm as ks_mm_ref
    from prunekit.kernels.layout import new_spmm_output

    g = torch.Generator().manual_seed(3)
    for a, b, c, n in ((1, 1, 1, 1), (3, 5, 7, 9), (4, 16, 8, 1), (2, 33, 17, 40)):
        blocks = torch.randn(a, 1, b, c, generator=g, dtype=dtype)
        x2d = torch.randn(n, a * c, generator=g, dtype=dtype)
        x = x2d.t() if layout == "batch_first" else x2d.t().contiguous()
        bias = torch.randn(a * b, generator=g, dtype=dtype)
        ref = ks_mm_ref(blocks.double(), x.double(), bias.double(), "relu")
        for y in (
            new_spmm_output(x, a * b),
            torch.empty(n, a * b, dtype=dtype).t(),
            torch.empty(a * b, n, dtype=dtype),
        ):
            y.fill_(float("nan"))
            out = block_diagonal_mm(blocks, x, y, bias, "relu")
            assert out is y and not torch.isnan(y).any()
            assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5), (a, b, c, n, tuple(y.stride()))
    with pytest.raises(ValueError, match="d = 1"):
        block_diagonal_mm(torch.zeros(1, 2, 3, 4), torch.zeros(8, 5), torch.zeros(6, 5))
