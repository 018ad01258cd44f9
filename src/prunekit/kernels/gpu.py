"""CUDA launchers for prunekit's sparse ops: variant choice per shape, argument checks, output allocation.

These are the CUDA implementations behind ``prunekit::spmm_csr`` and ``prunekit::sddmm_csr`` (see ``ops.py``); they
build or load the extension on first use (``build.load``). Tests and benchmarks call them directly to force a variant
or to write into a poisoned ``out``. torch only.

SpMM variants (Sputnik, Gale et al. SC 2020; see ``csrc/`` and docs/KERNELS.md):

- ``rowwarp``: one subwarp per row in row-swizzle order, weights streamed once per 16 output columns, X gathered
  from a per-block shared-memory copy when it fits (``rowwarp_global`` forces gathers from global memory).
  Memory-bound path for decode shapes.
- ``direct``: Sputnik's design, one warp per row times 256 (fp16) columns, 16-byte loads of X's rows straight from
  L2. Path for N > ROWWARP_MAX_N.
- ``tiled``: X tiles staged in shared memory and shared by 16 or 64 rows; measured slower than ``direct`` on the
  H100 at every shape, so ``auto`` never picks it (kept for experiments, forced with ``variant="tiled"``).
- ``scatter``: tensor cores for N <= 16 (decode): each warp scatters a strip's non-zeros (4-byte records of value and
  tile position, ``spmm_scatter_plan.py``) into a dense 8 x 128 shared-memory tile and multiplies it with X on
  ``mma.sync``; fp16/bf16 only. Decode path at N 9-16 and moderate sparsity (bound by instruction issue, not yet by
  memory: docs/KERNELS.md).
- ``bitmap``: tensor cores for N <= 16 (decode) on a bitmap-compressed copy of the weight (``spmm_bitmap_plan.py``:
  per 16 x 16 tile a mask of the present pairs of the mma's A registers and the pairs' words), expanded in registers
  by the 2:4 decode kernel's skeleton (``csrc/structured/nm24/nm24_decode.cu``, variant 2: k-chunks reduced in
  thread-block clusters); fp16/bf16 only. Any N > 16 in blocks of 32 or 64 tokens (grid z over token groups); ``auto``
  takes it up to N = 256.
- ``tc``: tensor cores on condensed 16-row windows ("load sparse, compute dense", ``spmm_tc.cu`` with the plan of
  ``spmm_tc_plan.py``, built once per weight and cached on its values tensor); fp16/bf16 only. Large-N path.

The C++ operator ``prunekit_ext::spmm_csr_auto`` (``csrc/spmm_entry.cu``) repeats :func:`spmm_csr` for the
CUDA-core variants in one dispatcher call (its plan is :func:`plan_spmm` ported to C++); the runtime's eager CSR
layers take it when :func:`eager_spmm_variant` says so (on by default since its H100 tests passed; ``$PRUNEKIT_SPMM_CPP=0``
turns it off).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from . import build, fastcall, nm24
from .layout import new_spmm_output, transposed_io
from .reference import ACTIVATIONS
from .spmm_bitmap_plan import MAX_TOKENS as BITMAP_MAX_N
from .spmm_bitmap_plan import get_bitmap_plan
from .spmm_scatter_plan import MAX_TOKENS as SCATTER_MAX_N
from .spmm_scatter_plan import get_scatter_plan
from .spmm_tc_plan import get_tc_plan
from .tensor_cache import cached_stamped, stamp

log = logging.getLogger(__name__)

SPMM_VARIANTS = ("auto", "rowwarp", "rowwarp_global", "direct", "tiled", "tc", "scatter", "bitmap", "dense")
TC_DTYPES = (torch.float16, torch.bfloat16)
# Smallest N sent to the tensor-core kernel by "auto" (fp16/bf16).
TC_MIN_N = 65  # = ROWWARP_MAX_N + 1
# Lowest density (nnz_padded / (M K)) sent to the tensor-core kernel by "auto": tc when nnz_padded * D >= M * K, with
# D from :func:`tc_min_density_denominator` (integer rule, the same in csrc/spmm_entry.cu). Read from the H100 grid of
# 2026-11-25 (benchmarks/results/spmm-h100-2026-11-25.json: 75 configurations where the former rule, D = 25, took tc
# and `direct` was timed beside it; 5 shapes, N = 128 / 2048 / 4096, 50-95%): `direct` won 27 of them. At N = 128 it
# won at 20% density on 4 of 5 shapes and at 10% and 5% on all; at N >= 2048 it won at 5% density on 4 of 5 shapes,
# and on K = 768 (3072 x 768) also at 10% (1.5-1.6x). With the rule below the chosen kernel's time is 1.014x the
# faster of the two (geometric mean over the 75) instead of 1.192x; 24 configurations get faster (up to 3.2x), 3
# slower (1.22-1.45x). In-sample: the rule was read from these same rows.
TC_MIN_DENSITY_DENOMINATOR = 16  # N > TC_SMALL_N and K > TC_SMALL_K: tc from 6.25% density
TC_SMALL_N = 128  # N <= this: tc only from 25% density (TC_MIN_DENSITY_DENOMINATOR_SMALL_N)
TC_MIN_DENSITY_DENOMINATOR_SMALL_N = 4
TC_SMALL_K = 1024  # K <= this (and N > TC_SMALL_N): tc from 12.5% density
TC_MIN_DENSITY_DENOMINATOR_SMALL_K = 8
# Whether "auto" may pick `tc` at all: on since the H100 run of 2026-11-25 (tests, memcheck and racecheck clean);
# $PRUNEKIT_SPMM_TC=0 turns it off.
TC_AUTO_ENV = "PRUNEKIT_SPMM_TC"
TC_AUTO_DEFAULT = True
# (windows_per_warp, ntile) tiles of spmm_tc.cu, largest first; the first giving >= one block per SM is used.
TC_TILES = ((2, 128), (1, 128), (1, 64))
TC_WARPS = 8  # warps per tensor-core block
# Scatter kernel (spmm_scatter.cu): N <= SCATTER_MAX_N (16), fp16/bf16. Whether "auto" takes it for such N instead of
# rowwarp: $PRUNEKIT_SPMM_SCATTER (1/0), else SCATTER_AUTO_DEFAULT.
SCATTER_AUTO_ENV = "PRUNEKIT_SPMM_SCATTER"
SCATTER_AUTO_DEFAULT = True
# "auto" takes scatter for fp16/bf16 with SCATTER_MIN_N <= N <= 16 when the padded density is >= 1/5, or >= 1/10 with
# M * K <= SCATTER_SMALL_ELEMENTS; rowwarp (X gathered from global memory, as "auto" runs it at these N) otherwise.
# Read in-sample on the H100 (2026-11-25) from the full grid with scatter in "auto" (spmm-h100-2026-11-25-scatter.json)
# against the grid before it (spmm-h100-2026-11-25.json, rowwarp) and the decode grid timing both forced
# (spmm-scatter-h100-2026-11-25-final.json): at N = 16 scatter is faster from 50% to 80% sparsity on all 5 shapes, at
# 90% on 4096 x 4096 and 768 x 3072 (equal on 3072 x 768), and slower at 90% on the two 11008 shapes and at 95-98%
# everywhere. At N = 1 rowwarp was faster everywhere, and N = 2..15 were not measured, so N <= 8 keeps rowwarp.
SCATTER_MIN_N = 9
SCATTER_MIN_DENSITY_DENOMINATOR = 5
SCATTER_SMALL_MIN_DENSITY_DENOMINATOR = 10
SCATTER_SMALL_ELEMENTS = 1 << 24
SCATTER_WARPS_PER_SM = 32  # resident warps per SM the k-split aims for (one warp per (strip, k-split))
SCATTER_KR_ENV = "PRUNEKIT_SCATTER_KR"
# At most 4 groups per block: the H100 sweep (benchmarks/results/spmm-scatter-kr{1,2,4,8,12}-h100-2026-11-25.json,
# 4096 x 4096 and 11008 x 4096, N = 16, 80 / 90%) was fastest at 4 on both shapes; 11008 x 4096 took 11 before
# (42.2 / 37.4 us at 4 against 45.8 / 38.4 at 12).
SCATTER_KR_CAP = 4
# Rows per strip of the scatter kernel: 8 (the default) or 16 ($PRUNEKIT_SCATTER_ROWS=16: the strip is the mma's m
# operand). 16 passed the H100 tests but was slower at most decode points, by up to 1.6x
# (spmm-scatter16-h100-2026-11-25-s8.json against spmm-scatter-h100-2026-11-25-s8.json; docs/KERNELS.md).
SCATTER_ROWS_ENV = "PRUNEKIT_SCATTER_ROWS"
SCATTER_MAX_KR_GROUPS = 12  # = kScMaxKrGroups in spmm_scatter.cu (shared memory: 4 KB of X per group)
# Largest N sent to the rowwarp kernel by "auto". Measured on the H100 (benchmarks/results/spmm-variants-h100-*.json):
# rowwarp is fastest up to N = 32 everywhere and at N = 64 for most shapes; direct from N = 128 up (or equal).
ROWWARP_MAX_N = 64
# 32 < N <= ROWWARP_MAX_N (thirty-first session): "auto" takes `direct` (8 lanes per row, its default there) for
# fp16/bf16 where the padded density is at most 1 / DIRECT_MID_N_MIN_SPARSITY_DENOMINATOR and M gives at least
# DIRECT_MID_N_MIN_ROWS_PER_SM rows per SM, instead of rowwarp / bitmap. Measured on the H100
# (benchmarks/results/spmm-n32to64-h100-2026-11-27-s31b.json: 5 shapes, N = 32 / 48 / 64, 90 / 95 / 98%, fp16,
# direct, bitmap, rowwarp and dense forced in one run; in-sample): at N = 48 / 64 and 95 / 98% (padded density
# 2.0-5.5%) on the four shapes with M >= 3072, direct was faster than what "auto" ran at 14 of 16 points (11008 x
# 4096, 98%, N = 64: 21.8 against rowwarp's 50.3 us; 4096 x 11008, 95%, N = 64: 52.5 against bitmap's 73.4); the two
# others 1.01x / 1.07x slower (4096 x 4096, 98%, N = 48: 14.4 against 14.2; 3072 x 768, 95%, N = 48: 8.8 against
# 8.2). At 90% (density ~10%) bitmap or the dense variant was faster everywhere; on 768 x 3072 (5.8 rows per SM)
# rowwarp / bitmap were (6.5-10.0 against direct's 12.0-27.9 us); at N = 32 rowwarp / bitmap won 3 of 4 shapes at 98%.
DIRECT_MID_N_MIN_N = 33
DIRECT_MID_N_MIN_SPARSITY_DENOMINATOR = 16  # padded density <= 6.25%
DIRECT_MID_N_MIN_ROWS_PER_SM = 16
# 16 < N <= 32, the same density floor, and only where M gives at least DIRECT_LOW_N_MIN_ROWS_PER_SM rows per SM
# (`direct` at 4 lanes per row there, its default up to 32 fp16 columns). Measured on the H100
# (benchmarks/results/direct-lpr4-h100-2026-11-27-s31e.json: 5 shapes, N = 16 / 24 / 32, 90-98%, fp16, "auto" and
# direct at 4 / 8 lanes in one run; in-sample, one shape): on 11008 x 4096 (83 rows per SM) at 95 / 98% and N = 24 /
# 32, direct took 0.86-0.95 / 0.65-0.67 of what "auto" ran (bitmap / rowwarp: 28.7-35.9 us) in nn.Linear's layout; on
# the four shapes with M <= 4096 "auto" was faster at every point (4096 x 4096, 98%, N = 32: 11.8 against 13.3-14.1
# us), and at N = 16 everywhere. "auto"'s own time jumps from N = 16 to N = 24 there (13.2 to 28.7 us at 98%:
# rowwarp's 16-token tiles). Thirty-second session (benchmarks/results/spmm-lown-h100-2026-11-27-s32a.json: 16384 x
# 4096, 14336 x 4096, 11008 x 4096 and 8192 x 8192, N = 17 / 20 / 24 / 32, 95 / 98%, fp16 and bf16, direct, bitmap and
# rowwarp forced in one run): at N = 24 / 32 direct was the fastest at every point, 1.07-1.45x ahead of the next on
# the three M >= 11008 shapes and 1.13-1.33x on 8192 x 8192 (62 rows per SM, where the former floor of 64 kept
# bitmap / rowwarp). At N = 17 / 20 it took 1.57-2.50x the time of the best: its X loads fell back to element loads
# where N is not a multiple of 8, which csrc/spmm_direct.cu now avoids by padding the copy of X. Between 4096 x 4096
# (31 rows per SM, "auto" faster in -s31f) and 8192 x 8192 (62) the floor is not measured; 48 lies between.
DIRECT_LOW_N_MIN_N = 17
DIRECT_LOW_N_MIN_ROWS_PER_SM = 48
DIRECT_MID_N_AUTO_ENV = "PRUNEKIT_SPMM_DIRECT_MID"  # "0": the rule off
TILED_ROWS_PER_BLOCK = {2: 16, 8: 64}  # rows_per_warp -> rows per block (8 warps)
TILED_N_TILE = 128  # output columns per tiled block
SUBWARP_MIN_NNZ = 128  # rows averaging fewer padded non-zeros use 8-lane subwarps (Sputnik sec. 5.1)
STAGE_X_MIN_N = 32  # auto: rowwarp stages X in shared memory only from this N ...
STAGE_X_MIN_ROWS_PER_SM = 16  # ... with at least this many rows per SM
# Decode, N = 9-16, fp16 / bf16 (thirty-second session): rowwarp's shared-memory copy of X, with the XOR-swizzled rows
# and the reduce-scatter epilogue of csrc/spmm_rowwarp.cu, beats bitmap at 95% on the shapes where X (K x 16 tokens)
# fits in shared memory and M gives enough rows per SM. Measured on the H100
# (benchmarks/results/spmm-n16smem-h100-2026-11-27-s32d.json: 5 shapes, N = 12 / 16, 90 / 95 / 98%, fp16, rowwarp with
# and without the shared copy and bitmap forced in one run; in-sample): on 4096 x 4096 and 11008 x 4096 at 95% the
# shared copy took 10.1-10.5 / 18.1-18.3 us against bitmap's 11.3-11.5 / 21.1-21.6 and the global gathers'
# 13.0-13.3 / 21.7-22.2; at 90% bitmap was faster (11.9-12.1 against 12.8-12.9; 22.5-22.7 against 25.4-25.6); at 98%
# the global gathers were (7.1-7.9 against 11.7-12.4 shared, 11.1-11.4 bitmap; 12.4-12.5 against 13.2-13.8 and
# 20.5-21.0). At N = 12 rowwarp ran as at N = 16 (its copy of X pads to 16 tokens since the twenty-second session), so
# N = 9-15 now share N = 16's bitmap floor (5%, was 2%): at 98% on 4096 x 11008 (no shared copy: K x 16 x 2 bytes >
# 227 KB) the global gathers took 14.7 against bitmap's 20.9 us. The small shapes (BITMAP_SMALL_ELEMENTS) keep bitmap.
# So where X fits (DECODE_STAGE_X_MAX_BYTES, the H100's opt-in shared memory per block; the launcher falls back to the
# global gathers where the device has less) and M >= DECODE_STAGE_X_MIN_ROWS_PER_SM rows per SM: bitmap from padded
# density 1 / BITMAP_MIN_DENSITY_DENOMINATOR_STAGED (between the 5.1% and 10.1% measured), rowwarp with the shared
# copy from 1 / DECODE_STAGE_X_MIN_DENSITY_DENOMINATOR (between 2.1% and 5.1%), global gathers below. At 98% the rows
# (85 padded entries) take 8-lane subwarps, and there the copy paid on 14336 x 4096 (14.3-14.8 against 17.8-17.9 us,
# spmm-rot{0,1}-h100-2026-11-27-s32h.json), where the non-zeros are 2.3 K per SM, but not on 11008 x 4096 (1.7 K per
# SM: 13.9-14.3 against 12.6) nor 4096 x 4096 (0.65 K): for such rows the copy is made where the padded non-zeros
# reach 2 K per SM, the N >= 32 rule's measure (in-sample, three points). Checked out of sample at 97 / 98 / 99% on
# 16384, 14336, 12288 and 8192 x 4096 (spmm-decode98-h100-2026-11-27-s32i.json): right at 9 of 12 points; the three
# misses cost 1.09-1.16x (16384 and 14336 x 4096 at 99%, where the copy still paid; 12288 x 4096 at 97%, where it did
# not). In that run the copy paid at every sparsity from 108 rows per SM (14336) and at none up to 93 (12288), whatever
# the non-zeros per row (41-123 padded). So since the thirty-third session such rows get the copy from
# DECODE_STAGE_X_SHORT_ROWS_MIN_ROWS_PER_SM rows per SM instead (right at all 12 points of -s32i and the three of
# -s32h; in-sample, all at K = 4096), in the C++ entry's plan (csrc/spmm_entry.cu) too. Out of sample
# (spmm-decode100-h100-2026-11-27-s33f.json: 13312 / 12800 / 15360 / 11520 x 4096 and 16384 / 10240 x 2048, 97-99%) it
# picked the faster of the two at 15 of 18 points, the former rule at 12; the misses are 12800 x 4096 (97 rows per SM),
# where the copy was 1.02-1.12x faster (floor left at 100: moving it to fit that run would make it in-sample too).
DECODE_STAGE_X_MAX_BYTES = 227 * 1024
DECODE_STAGE_X_MIN_ROWS_PER_SM = 31  # 4096 rows on 132 SMs
DECODE_STAGE_X_SHORT_ROWS_MIN_ROWS_PER_SM = 100  # between 93 (12288 x 4096: no gain) and 108 (14336 x 4096: gain)
BITMAP_MIN_DENSITY_DENOMINATOR_STAGED = 14  # padded density >= 7.1%
DECODE_STAGE_X_MIN_DENSITY_DENOMINATOR = 30  # padded density >= 3.3%
# Variant codes of the C++ entry prunekit_ext::spmm_csr_auto and of prunekit_ext::plan_spmm_code (csrc/spmm_entry.cu
# kAuto ... kBitmap hold the same numbers; the entry takes 0-4, tc, scatter and bitmap stay on this module's launcher).
SPMM_VARIANT_CODES = {
    "auto": 0,
    "rowwarp": 1,
    "rowwarp_global": 2,
    "direct": 3,
    "tiled": 4,
    "tc": 5,
    "scatter": 6,
    "bitmap": 7,
    "dense": 8,
}
# Flag or-ed into a variant code of prunekit_ext::spmm_csr_auto (spmm_entry.cu kRowsFlag): x is the activations (N, K)
# and the result Y^T (N, M), nn.Linear's layout, with the transposes made in C++ (spmm_rows_call)
SPMM_ROWS = 1 << 8
# Bitmap decode kernel (nm24_decode.cu variant 2). "auto" takes it for fp16/bf16 at BITMAP_MIN_N <= N <= 16 when the
# padded density is >= 1 / bitmap_min_density_denominator(N) and K >= BITMAP_MIN_K (BITMAP_MIN_K_SMALL_N at N = 5-16).
# Twelfth session (spmm-bitmap-grid-h100-2026-11-25-s12.json: 5 shapes, N = 1 / 2 / 4 / 8 / 12 / 16, 70-98%, one run;
# in-sample): rowwarp falls back to element loads where N is not its tile width, and at N = 2-8 it was slower than
# bitmap on every K >= 1024 shape at 70-80% (4096 x 4096, 70%, N = 4: 33.0 against 15.6 us), about even at 90%
# (4096 x 11008 at N = 2 / 8 faster with rowwarp, the others with bitmap), faster at 95-98%. At N = 12 bitmap was the
# faster at every sparsity up to 98% (11008 x 4096, 95%: 22.1 against 54.0 us); at N = 16 also at 95% on three of four
# shapes (the fourth even), and rowwarp from 98%. Hence the density floor by N: 10% at N = 2-8, 2% at N = 9-15, 5% at
# N = 16. Earlier (eleventh session), from
# benchmarks/results/spmm-bitmap-masked-h100-2026-11-25-s11.json (a version 5-10% slower than the shipped one) and
# checked with the shipped kernel in spmm-bitmap-h100-2026-11-25-s11final.json (5 shapes, N = 1 / 8 / 16, 50-98%): at
# N = 16 it is the fastest prunekit kernel at 50-90% on the four shapes with K >= 3072 (4096 x 4096 at 90%: 13.4 us
# against scatter's 16.3 and rowwarp's 18.0; dense 16.7), close to rowwarp at 95% and slower from 98%; on 3072 x 768
# scatter is faster at 80-98%. At N = 1 rowwarp is faster everywhere. At N = 8 bitmap was the fastest at 50-90% on most
# shapes but not all (4096 x 11008 at 90%: 25.1 against rowwarp's 21.5 us), so the rule starts at N = 9 as scatter's.
# N = 9 / 12 / 15 at 70 / 90% on 4096 x 4096 and 11008 x 4096 (spmm-bitmap-n9to15-h100-2026-11-25-s11.json): bitmap
# was the fastest at every point (4096 x 4096, 90%: 13.0-13.5 us against scatter's 15.6-16.9 us).
BITMAP_AUTO_ENV = "PRUNEKIT_SPMM_BITMAP"
BITMAP_AUTO_DEFAULT = True
BITMAP_MIN_N = 2
BITMAP_MIN_DENSITY_DENOMINATOR = 10  # N = 2..8
BITMAP_MIN_DENSITY_DENOMINATOR_16 = 20  # N = 9..16 (N = 9-15: 2% until the thirty-second session, below)
BITMAP_MIN_K = 1024
# At N = 5-8, where scatter is not a candidate, K from 768: at 3072 x 768, N = 4 / 8, bitmap took 4.7-6.5 us against
# rowwarp's 6.1-10.4 at 70-90% in both twelfth-session grids (spmm-bitmap-grid-...-s12.json,
# spmm-h100-2026-11-26-s12final.json; dense 4.7 us: both slower than dense there). Not at N = 2-4 since the SpMV
# kernel's 4-token tile (thirteenth session, spmm-n248-tiles2-h100-2026-11-26-s13.json): at 3072 x 768 it took 2.7-4.2
# us against bitmap's 4.7-5.3 at 70-95% (dense 4.7). At N = 9-16 too since the nineteenth session, where the lean decode
# kernel takes bitmap plans with K <= 1024 (nm24_decode.cu, lean_takes): at 3072 x 768, N = 16, 80 / 90% it took 3.89 /
# 3.53 us (spmm-bitmap6-lean1-6-h100-2026-11-26-s19.json) against scatter's 6.08 / 5.68, what "auto" ran there
# (spmm-decode3072-h100-2026-11-26-s19.json; dense 4.8-5.0 us). One shape, two sparsities: in-sample. With the lean
# kernel's 6 warps, at 3072 x 768 and 70-95% (spmm-decode3072-lean6-h100-2026-11-26-s19.json, the bitmap column timed
# forced beside "auto"), bitmap took 3.17-4.06 us at N = 8-16 (1.19-1.50x of dense) and 3.18 against rowwarp's 5.71 at
# N = 8, 95%; so at N = 5-8 with K < BITMAP_MIN_K its density floor is 5% (bitmap_min_density_denominator).
BITMAP_MIN_K_SMALL_N = 768
# Small weights at N = 9-16 (twenty-second session): since rowwarp transposes column-major X itself (one more kernel,
# about 1.4 us on the H100, csrc/spmm_rowwarp.cu), bitmap was faster on the device at 98-99% too where M * K <=
# BITMAP_SMALL_ELEMENTS (spmm-smallshapes-h100-2026-11-26-s22e.json; 7 shapes, N = 2-16, 95-99%, one run, in-sample):
# 3072 x 768 at N = 12 / 16, 99%: 3.31 / 3.50 us against rowwarp's 4.50 / 4.58, and N = 16, 98%: 3.45 against 4.75;
# 768 x 3072 at N = 16, 98%: 5.04 against 6.44, and 99%: 4.91 / 5.03 against 5.04 / 5.21 at N = 12 / 16; 1024 x 1024
# even (4.78 against 4.87 at N = 16, 98%; 4.77 against 4.52 at N = 12, 99%, the one loss). From 2048 x 2048 (4.2M
# elements) rowwarp was faster (N = 16, 98%: 5.52 against 5.94), as on every larger shape. Eagerly the bitmap layer also
# issues one launch instead of two: 11.1-13.1 us of wall time against rowwarp's 16.0-18.2 at the 98%, N = 16 points of
# these shapes (layer-host-csrfloor-h100-2026-11-26-s22d-0.98.json). A second run with N = 9 / 12 / 16 at 98 / 99%
# (spmm-rule-h100-2026-11-26-s22f.json) kept both wins (3072 x 768: 3.28-3.49 us against rowwarp's 4.16-4.62; 768 x
# 3072: 4.98-5.03 against 5.06-6.36, one tie at N = 9, 99%: 5.02 against 4.92) but found rowwarp faster where neither
# side is 768: 1024 x 1024 (4.37-4.69 against bitmap's 4.71-4.76) and 2048 x 1536 (4.46-5.02 against 5.16-5.32). So at
# N = 9-16 the floor is 1% where M * K <= BITMAP_SMALL_ELEMENTS and M or K is at most BITMAP_SMALL_MAX_SIDE (BERT-base's
# 768 x 3072 and 3072 x 768 MLP shapes): two shapes, in-sample. Not at N <= 8, where it was mixed (768 x 3072, N = 8,
# 99%: 4.69 against rowwarp's 4.16).
BITMAP_SMALL_ELEMENTS = 3 << 20
BITMAP_SMALL_MAX_SIDE = 768
BITMAP_SMALL_MIN_DENSITY_DENOMINATOR = 100
# N > 16 (fourteenth session): the kernel runs blocks of 32 tokens (N 17-32) or 64 (grid z over token groups), each
# decoding the weight again. "auto" takes it for fp16/bf16 at BITMAP_MAX_N < N <= BITMAP_WIDE_MAX_N with K >=
# BITMAP_MIN_K_SMALL_N when the padded density is >= 1 / BITMAP_WIDE_MIN_DENSITY_DENOMINATOR, or from TC_MIN_N with K <
# BITMAP_MIN_K >= 1 / BITMAP_WIDE_SMALL_K_MIN_DENSITY_DENOMINATOR. Measured on the H100
# (benchmarks/results/spmm-widegrid-h100-2026-11-26-s14.json: 5 shapes, N = 16 / 32 / 64 / 128 / 256, 70-95%, one run,
# in-sample): at 70-90% bitmap was faster than direct and tc (both forced in the same run) and than what "auto" ran at
# 53 of 60 points with N >= 32 (4096 x 4096, 80%: 23.0 / 33.6 / 55.9 / 92.9 us at N = 32 / 64 / 128 / 256 against
# direct's 100.0 / 100.9 / 102.9 / 170.9 and tc's 148.7 / 148.6 at N = 128 / 256; dense 14.5-18.5; rowwarp, "auto"'s
# kernel up to N = 64 before, took 43.4 / 85.3 us at N = 32 / 64 in spmm-wide-h100-2026-11-26-s14b.json). The seven
# exceptions: 11008 x 4096 at 70% from N = 128 (tc 145.6 / 277.4 against 179.9 / 358.3 us), 3072 x 768 at 90% from
# N = 128 (direct 14.4 / 17.3 against 15.6 / 23.5; at 70%, and 80% at N = 128, bitmap took 17.6-30.7 us against
# 23.4-37.9) and at 80%, N = 256 (27.9 against 29.2), and two even points (4096 x 4096 at 70%, 4096 x 11008 at 90%, N = 256). At 95% direct was
# faster from N = 128 (4096 x 4096: 54.6 against 36.3 us); at N = 32 / 64 bitmap was (below). Slower than dense cuBLAS from
# N = 64 everywhere (0.11-0.81x) and at N = 32 on four of five shapes (faster on 768 x 3072: 1.11-1.17x). About 15 us of
# the 33.6 at 4096 x 4096, N = 64, 90% go to staging X in shared memory (each 128-row block reads its 64 tokens of X),
# 9 to the loop and 9 to the cluster reduction (probes, spmm-bitmap-wide-{base,p1,p2}-h100-2026-11-26-s14.json). Not
# measured above N = 256.
BITMAP_WIDE_MAX_N = 256
BITMAP_WIDE_MIN_DENSITY_DENOMINATOR = 10
BITMAP_WIDE_SMALL_K_MIN_DENSITY_DENOMINATOR = 6
# At 95% and N = 32 / 64 with K >= BITMAP_MIN_K, bitmap (forced) was faster than rowwarp ("auto"'s kernel there) at 7 of
# 8 points of the same grid and even at the eighth (4096 x 4096: 19.4 / 33.2 against 23.4 / 43.0 us; 11008 x 4096:
# 38.4 / 64.2 against 47.6 / 89.0; 4096 x 11008: 46.4 / 74.2 against 46.3 / 94.2; 768 x 3072: 6.8 / 10.0 against 7.9 /
# 10.8), so there the floor is 5% (fifteenth session). At 3072 x 768 (K < BITMAP_MIN_K), N = 64, rowwarp was faster
# (10.8 against 11.4 us), and from N = 128 direct was faster except on 768 x 3072: 10% stays. Not measured at 98%.
BITMAP_WIDE_LOW_N_MIN_DENSITY_DENOMINATOR = 20
# From TC_MIN_N with K >= BITMAP_MIN_K, the same 5% floor where M gives fewer than BITMAP_WIDE_FEW_ROWS_PER_SM rows per
# SM: `direct` parallelizes over rows only, and at 768 x 3072 (5.8 rows per SM), 95% it took 23.6 / 26.6 us at N = 128 /
# 256 (spmm-eager-direct-h100-2026-11-26-s16.json) against bitmap's 13.2 / 20.1 forced with the sixteenth session's
# k-chunk (spmm-bitmap-c32-h100-2026-11-26-s16.json; another call, same machine kind). The other shapes (31+ rows per
# SM) keep direct there: at 4096 x 4096, 95%, N = 128 it took 36.3 us against bitmap's 48.4 (s15 grid). One shape,
# in-sample.
BITMAP_WIDE_FEW_ROWS_PER_SM = 16
# Batches of 8 k-steps per warp in the bitmap kernel's shared-memory ring: 3 (two in flight while one is multiplied), or
# 5 (all four batches of a 32-k-step chunk in flight at once; from 3% faster to 30% slower on the H100, docs/KERNELS.md).
BITMAP_RING_ENV = "PRUNEKIT_BITMAP_RING"
BITMAP_RING = 3
SPMV_ENV = "PRUNEKIT_SPMV"  # "0": rowwarp's own kernel at N <= 4 instead of the SpMV kernel (csrc/spmv_csr.cu)
SPMV_MAX_N = 4  # the SpMV kernel's token tile (kSpmvMaxTile)
SPMV_MAX_SMEM = 96 * 1024  # bytes of X it copies into shared memory per block at N = 1 (kSpmvMaxSmem)
# N = 2-4 (kSpmvTileMaxSmem, kSpmvTileMinRowsPerSm): X within 48 KB (4 blocks per SM) and 8 rows per SM; measured in
# benchmarks/results/spmm-n248-tiles2-h100-2026-11-26-s13.json against -rowwarp-... (csrc/spmv_csr.cu has the figures).
SPMV_TILE_MAX_SMEM = 48 * 1024
SPMV_TILE_MIN_ROWS_PER_SM = 8
EAGER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # dtypes the C++ entry takes (values and x alike)
# The `dense` variant (csrc/spmm_dense.cu, twenty-fifth session): the weight decompressed into a dense (M, K) scratch
# buffer by one kernel, then one cuBLAS GEMM. "auto" takes it for fp16/bf16 from DENSE_MIN_N tokens when the padded
# density is >= 1 / dense_min_density_denominator(N, K); $PRUNEKIT_SPMM_DENSE=0 turns that off (forcing
# variant="dense" still works). The scratch buffer is M * K elements of the call's dtype, from the caching allocator.
# The floors are read from benchmarks/results/spmm-dense-h100-2026-11-26-s25c.json (H100, fp16, the shipped
# decompression kernel; 5 shapes, 80-98%, N = 80 / 128 / 256 / 512 / 4096; tc, direct, bitmap and dense forced in the
# same run; in-sample). Against the fastest of the other three: at N = 512 and 4096 dense was faster at every point
# (1.17-5.81x, 98% included); at N = 256 at 80-95% everywhere (1.31-2.74x) and mixed at 98% (0.81-1.58x); at N = 80 /
# 128 at 80-90% everywhere (1.12-1.82x), at 95% on three of four shapes (1.18-1.41x; 11008 x 4096: 0.94-0.98x), and at
# 98% on one (768 x 3072; 0.47-0.87x on the others). Padded densities there: 95% ~5.1%, 98% ~2.1-2.5%. At N = 300
# (spmm-dense-n300-h100-2026-11-26-s25e.json, 95 / 98%, 5 shapes) dense was faster at every point, 98% included
# (1.90-2.86x): `direct` takes two passes over X's columns above 256. Hence: from 5% at N = 65-128, 3.125% at N =
# 129-256, 1.5625% above. Over s25c's 90 points the rule's choice is within 6% of the fastest variant at 87; the
# exceptions are 768 x 3072 at 98%, N = 80-256, where dense was 1.37-1.63x faster than the `direct` the rule keeps.
# bf16 (spmm-dense-bf16-h100-2026-11-26-s25e.json: 3 shapes, 90-98%, N = 80 / 128 / 300 / 4096) gave the same
# picture: the rule's choice within 4% of the fastest at all 36 points (the recorded "auto" time where the rule's
# choice is not dense: the same kernel as the forced one, timed separately).
# (spmm-dense-...-s25a.json and -s25b.json hold the two earlier versions of the decompression kernel: atomics.)
DENSE_AUTO_ENV = "PRUNEKIT_SPMM_DENSE"
DENSE_AUTO_DEFAULT = True
DENSE_MIN_N = TC_MIN_N
DENSE_MIN_DENSITY_DENOMINATOR_SMALL_N = 20  # N <= TC_SMALL_N (128): from 5% density
DENSE_MIN_DENSITY_DENOMINATOR_MID_N = 32  # N <= BITMAP_WIDE_MAX_N (256): from 3.125%
DENSE_MIN_DENSITY_DENOMINATOR = 64  # N > 256: from 1.5625%
# The C++ eager entry: on since its GPU tests (tests/kernels/test_spmm_entry.py) passed on the H100 on 2026-11-26, once
# the C++ checks stopped building their messages with iostreams (csrc/check.h); 9.7 us per call on the host against the
# Python launcher's 21.3 (benchmarks/results/spmm-h100-2026-11-26-s12final.json, "overhead"). $PRUNEKIT_SPMM_CPP=0: off.
EAGER_CPP_ENV = "PRUNEKIT_SPMM_CPP"
EAGER_CPP_DEFAULT = True


@dataclass(frozen=True)
class SpmmPlan:
    """Kernel choice for one SpMM call: ``variant`` plus its tiling parameters."""

    variant: str
    subwarp: int = 32
    ntile: int = 16
    rows_per_warp: int = 8
    stage_x: bool = True  # rowwarp: copy X[:, tile] to shared memory per block when it fits
    windows_per_warp: int = 1  # tc: 16-row windows per warp (a block holds 8 warps); ntile: columns per block
    kr_groups: int = 0  # scatter: 128-column groups per block (K / (128 kr_groups) k-splits)
    strip_rows: int = 8  # scatter: rows per strip (8 or 16)


def _env_switch(name: str, default: bool) -> bool:
    """An on/off setting read now: ``default`` where ``$name`` is unset, off where it is empty, ``0`` or ``false``."""
    env = os.environ.get(name)
    return default if env is None else env.strip() not in ("", "0", "false", "False")


def tc_auto_enabled() -> bool:
    """Whether ``auto`` may choose the tensor-core kernel: ``$PRUNEKIT_SPMM_TC`` (``1``/``0``) or
    :data:`TC_AUTO_DEFAULT`."""
    return _env_switch(TC_AUTO_ENV, TC_AUTO_DEFAULT)


def scatter_auto_enabled() -> bool:
    """Whether ``auto`` may choose the scatter kernel for N <= 16: ``$PRUNEKIT_SPMM_SCATTER`` (``1``/``0``) or
    :data:`SCATTER_AUTO_DEFAULT`."""
    return _env_switch(SCATTER_AUTO_ENV, SCATTER_AUTO_DEFAULT)


def decode_stages_x(n: int, k: int, m: int, num_sms: int = 132, esize: int = 2) -> bool:
    """Whether rowwarp's shared-memory copy of X can pay at decode ``N`` (9..16, one 16-token tile): X (``k`` x 16
    elements of ``esize`` bytes) fits in :data:`DECODE_STAGE_X_MAX_BYTES` and ``m`` gives at least
    :data:`DECODE_STAGE_X_MIN_ROWS_PER_SM` rows per SM (the thirty-second session's H100 rule; the density window is
    :func:`plan_spmm`'s)."""
    return (
        SCATTER_MIN_N <= n <= BITMAP_MAX_N
        and k * BITMAP_MAX_N * esize <= DECODE_STAGE_X_MAX_BYTES
        and m >= DECODE_STAGE_X_MIN_ROWS_PER_SM * num_sms
    )


def bitmap_min_density_denominator(n: int, k: int | None = None, m: int | None = None, num_sms: int = 132) -> int:
    """``auto`` takes the bitmap kernel at ``N`` (2..16) when the padded density is at least one over this (measured on
    the H100, see the constants): 10% at N <= 8 (5% at N 5-8 with ``k`` below BITMAP_MIN_K, where the lean decode
    kernel runs it), 5% at N 9-16, or 7.1% where rowwarp's shared copy of X can pay (:func:`decode_stages_x`, ``k``
    and ``m`` given); 1% at N 9-16 where ``m * k`` (both given) is at most BITMAP_SMALL_ELEMENTS and ``min(m, k)`` at
    most BITMAP_SMALL_MAX_SIDE."""
    if n <= 8:
        if k is not None and k < BITMAP_MIN_K and n > SPMV_MAX_N:
            return BITMAP_MIN_DENSITY_DENOMINATOR_16
        return BITMAP_MIN_DENSITY_DENOMINATOR
    if m is not None and k is not None and m * k <= BITMAP_SMALL_ELEMENTS and min(m, k) <= BITMAP_SMALL_MAX_SIDE:
        return BITMAP_SMALL_MIN_DENSITY_DENOMINATOR
    if m is not None and k is not None and decode_stages_x(n, k, m, num_sms):
        return BITMAP_MIN_DENSITY_DENOMINATOR_STAGED
    return BITMAP_MIN_DENSITY_DENOMINATOR_16


def bitmap_wide_min_density_denominator(n: int, k: int, m: int | None = None, num_sms: int = 132) -> int:
    """``auto`` takes the bitmap kernel at ``16 < N <= BITMAP_WIDE_MAX_N`` (K >= BITMAP_MIN_K_SMALL_N) when the padded
    density is at least one over this: 10%; 5% with K >= BITMAP_MIN_K below TC_MIN_N, or from TC_MIN_N where ``m``
    (when given) leaves fewer than BITMAP_WIDE_FEW_ROWS_PER_SM rows per SM; 1/6 from TC_MIN_N with K < BITMAP_MIN_K
    (measured on the H100, see the constants)."""
    if n >= TC_MIN_N and k < BITMAP_MIN_K:
        return BITMAP_WIDE_SMALL_K_MIN_DENSITY_DENOMINATOR
    if k >= BITMAP_MIN_K and (n < TC_MIN_N or (m is not None and m < BITMAP_WIDE_FEW_ROWS_PER_SM * num_sms)):
        return BITMAP_WIDE_LOW_N_MIN_DENSITY_DENOMINATOR
    return BITMAP_WIDE_MIN_DENSITY_DENOMINATOR


def direct_mid_auto_enabled() -> bool:
    """Whether ``auto`` may choose ``direct`` at ``DIRECT_LOW_N_MIN_N <= N <= ROWWARP_MAX_N`` (the thirty-first
    session's rules, see the constants): ``$PRUNEKIT_SPMM_DIRECT_MID`` (``1``/``0``), on by default."""
    return _env_switch(DIRECT_MID_N_AUTO_ENV, True)


def dense_auto_enabled() -> bool:
    """Whether ``auto`` may choose the ``dense`` variant (decompression + cuBLAS): ``$PRUNEKIT_SPMM_DENSE``
    (``1``/``0``), else :data:`DENSE_AUTO_DEFAULT`."""
    return _env_switch(DENSE_AUTO_ENV, DENSE_AUTO_DEFAULT)


def dense_min_density_denominator(n: int, k: int) -> int:
    """D such that ``"auto"`` takes the ``dense`` variant when ``nnz_padded * D >= M * K`` (fp16/bf16, N >=
    :data:`DENSE_MIN_N`, :func:`dense_auto_enabled`): 20 for N <= :data:`TC_SMALL_N`, 32 for N <=
    :data:`BITMAP_WIDE_MAX_N`, else 64 (floors that change only between :func:`eager_size_class` classes).

    Args:
        n: N, columns of X (tokens). k: K, the weight's in_features.
    """
    if n <= TC_SMALL_N:
        return DENSE_MIN_DENSITY_DENOMINATOR_SMALL_N
    if n <= BITMAP_WIDE_MAX_N:
        return DENSE_MIN_DENSITY_DENOMINATOR_MID_N
    return DENSE_MIN_DENSITY_DENOMINATOR


def bitmap_auto_enabled() -> bool:
    """Whether ``auto`` may choose the bitmap kernel for 2 <= N <= BITMAP_WIDE_MAX_N: ``$PRUNEKIT_SPMM_BITMAP`` (``1``/``0``) or
    :data:`BITMAP_AUTO_DEFAULT`."""
    return _env_switch(BITMAP_AUTO_ENV, BITMAP_AUTO_DEFAULT)


def scatter_strip_rows() -> int:
    """Rows per strip of the scatter kernel: ``$PRUNEKIT_SCATTER_ROWS`` (8 or 16), else 8.

    Raises:
        ValueError: the variable holds anything else.
    """
    value = os.environ.get(SCATTER_ROWS_ENV, "").strip() or "8"
    if value not in ("8", "16"):
        raise ValueError(f"${SCATTER_ROWS_ENV} must be 8 or 16, got {value!r}")
    return int(value)


def scatter_kr_groups(m: int, k: int, num_sms: int = 132, strip_rows: int = 8) -> int:
    """128-column groups per block of the scatter kernel for ``A (m, k)``: the k-split count (``ceil(groups /
    kr_groups)``) is chosen so that ``ceil(m / strip_rows)`` strips times the splits give about :data:`SCATTER_WARPS_PER_SM`
    warps per SM, with at most :data:`SCATTER_KR_CAP` (4, measured) groups per block.
    ``$PRUNEKIT_SCATTER_KR`` forces the value (clamped to ``[1, min(12, groups)]``) for tuning runs."""
    strips = max(1, -(-m // strip_rows))
    groups = max(1, -(-k // 128))
    forced = os.environ.get(SCATTER_KR_ENV, "").strip()
    if forced:  # tuning runs (scripts/gpu_run.sh scatterkr)
        return max(1, min(SCATTER_MAX_KR_GROUPS, groups, int(forced)))
    ksplit = min(groups, max(1, round(num_sms * SCATTER_WARPS_PER_SM / strips)))
    return min(SCATTER_KR_CAP, -(-groups // ksplit))


def tc_min_density_denominator(n: int, k: int) -> int:
    """D such that ``"auto"`` takes the tensor-core kernel when ``nnz_padded * D >= M * K`` (and N >= TC_MIN_N):
    4 for N <= :data:`TC_SMALL_N`, else 8 for K <= :data:`TC_SMALL_K`, else :data:`TC_MIN_DENSITY_DENOMINATOR` (16).

    Args:
        n: N, columns of X (tokens). k: K, the weight's in_features.
    """
    if n <= TC_SMALL_N:
        return TC_MIN_DENSITY_DENOMINATOR_SMALL_N
    if k <= TC_SMALL_K:
        return TC_MIN_DENSITY_DENOMINATOR_SMALL_K
    return TC_MIN_DENSITY_DENOMINATOR


def plan_spmm(
    m: int,
    k: int,
    n: int,
    nnz_padded: int,
    num_sms: int = 132,
    variant: str = "auto",
    dtype: torch.dtype | None = None,
) -> SpmmPlan:
    """Choose the SpMM kernel and tiling (see :func:`_plan_spmm`, which caches the choice per shape)."""
    return _plan_spmm(
        m,
        k,
        n,
        nnz_padded,
        num_sms,
        variant,
        dtype,
        tc_auto_enabled(),
        scatter_auto_enabled(),
        scatter_strip_rows(),
        bitmap_auto_enabled(),
        dense_auto_enabled(),
        direct_mid_auto_enabled(),
    )


@functools.lru_cache(maxsize=4096)
def _plan_spmm(
    m: int,
    k: int,
    n: int,
    nnz_padded: int,
    num_sms: int = 132,
    variant: str = "auto",
    dtype: torch.dtype | None = None,
    tc_auto: bool = False,
    scatter_auto: bool = False,
    scatter_rows: int = 8,
    bitmap_auto: bool = False,
    dense_auto: bool = False,
    direct_mid_auto: bool = False,
) -> SpmmPlan:
    """Choose the SpMM kernel and tiling for ``A (m, k)`` with ``nnz_padded`` stored entries times ``X (k, n)``.

    ``auto`` takes ``rowwarp`` for ``n <= ROWWARP_MAX_N`` (weights dominate the bytes) and ``direct`` above (the
    H100 variant sweep found ``tiled`` slower than ``direct`` at every measured shape; it stays available when
    forced). The tiled kernel uses 64-row blocks when that still gives at least two blocks per SM, else 16-row
    blocks. ``rowwarp`` copies X to shared memory (``stage_x``) only for ``n >= STAGE_X_MIN_N``, at least
    ``STAGE_X_MIN_ROWS_PER_SM`` rows per SM and ``nnz_padded >= 2 * k * num_sms``, and in fp16 / bf16 at N 9-16 where
    :func:`decode_stages_x` and the padded density is at least ``1 / DECODE_STAGE_X_MIN_DENSITY_DENOMINATOR``.

    With ``dtype`` fp16 or bf16 and ``tc_auto`` (:func:`tc_auto_enabled`), ``auto`` takes the tensor-core ``tc`` kernel for
    ``n >= TC_MIN_N`` and density ``>= 1 / tc_min_density_denominator(n, k)`` instead of ``direct`` (measured on the
    H100, see the constants); with ``dtype=None`` (unknown) or fp32 it never does. ``tc`` uses the largest tile of :data:`TC_TILES` that still gives
    at least one block per SM. With ``scatter_auto`` (:func:`scatter_auto_enabled`) and fp16/bf16, ``auto`` takes
    ``scatter`` instead of ``rowwarp`` for ``SCATTER_MIN_N <= n <= SCATTER_MAX_N`` (9-16) at density >= 20%, or
    >= 10% when ``m * k <= 2^24`` (measured on the H100, see the constants); its k-split is
    :func:`scatter_kr_groups`, its strip height ``scatter_rows`` (:func:`scatter_strip_rows`). With ``bitmap_auto``
    (:func:`bitmap_auto_enabled`) it takes ``bitmap`` instead for ``2 <= n <= 16`` when ``k >= BITMAP_MIN_K`` (``k >=
    BITMAP_MIN_K_SMALL_N`` for ``n > SPMV_MAX_N``) and the density is at least ``1 /
    bitmap_min_density_denominator(n, k, m, num_sms)`` (10% at N <= 8, 5% at N 5-8 with K < BITMAP_MIN_K, 5% at N
    9-16, 7.1% where :func:`decode_stages_x`; 1% at N 9-16 where M * K <= BITMAP_SMALL_ELEMENTS and M or K <=
    BITMAP_SMALL_MAX_SIDE), and for ``16 < n <=
    BITMAP_WIDE_MAX_N`` with ``k >= BITMAP_MIN_K_SMALL_N`` at density >= ``1 / bitmap_wide_min_density_denominator(n,
    k, m, num_sms)``; measured on the H100, see the constants. ``rowwarp`` runs the SpMV kernel at N <= 4 where :func:`spmv_takes`.
    With ``direct_mid_auto`` (:func:`direct_mid_auto_enabled`), for fp16/bf16 at ``DIRECT_MID_N_MIN_N <= n <=
    ROWWARP_MAX_N`` it takes ``direct`` over rowwarp and bitmap where the
    padded density is at most ``1 / DIRECT_MID_N_MIN_SPARSITY_DENOMINATOR`` and ``m >= DIRECT_MID_N_MIN_ROWS_PER_SM *
    num_sms``, and at ``DIRECT_LOW_N_MIN_N <= n < DIRECT_MID_N_MIN_N`` where ``m >= DIRECT_LOW_N_MIN_ROWS_PER_SM *
    num_sms``.
    With ``dense_auto`` (:func:`dense_auto_enabled`) and fp16/bf16, ``auto`` takes ``dense`` (the weight decompressed,
    then cuBLAS) over all of these for ``n >= DENSE_MIN_N`` at density >= ``1 / dense_min_density_denominator(n, k)``.

    Raises:
        ValueError: unknown ``variant``.
    """
    if variant not in SPMM_VARIANTS:
        raise ValueError(f"unknown spmm variant {variant!r}; known: {', '.join(SPMM_VARIANTS)}")
    if variant == "auto":
        variant = "rowwarp" if n <= ROWWARP_MAX_N else "direct"
        if dtype in TC_DTYPES and n >= TC_MIN_N and tc_auto and nnz_padded * tc_min_density_denominator(n, k) >= m * k:
            variant = "tc"
        if (
            dtype in TC_DTYPES
            and SCATTER_MIN_N <= n <= SCATTER_MAX_N
            and scatter_auto
            and (
                nnz_padded * SCATTER_MIN_DENSITY_DENOMINATOR >= m * k
                or (m * k <= SCATTER_SMALL_ELEMENTS and nnz_padded * SCATTER_SMALL_MIN_DENSITY_DENOMINATOR >= m * k)
            )
        ):
            variant = "scatter"
        if (
            dtype in TC_DTYPES
            and BITMAP_MIN_N <= n <= BITMAP_MAX_N
            and bitmap_auto
            and k >= (BITMAP_MIN_K_SMALL_N if SPMV_MAX_N < n else BITMAP_MIN_K)
            and nnz_padded * bitmap_min_density_denominator(n, k, m, num_sms) >= m * k
        ):
            variant = "bitmap"
        if (
            dtype in TC_DTYPES
            and BITMAP_MAX_N < n <= BITMAP_WIDE_MAX_N
            and bitmap_auto
            and k >= BITMAP_MIN_K_SMALL_N
            and nnz_padded * bitmap_wide_min_density_denominator(n, k, m, num_sms) >= m * k
        ):
            variant = "bitmap"
        if (
            dtype in TC_DTYPES
            and DIRECT_LOW_N_MIN_N <= n <= ROWWARP_MAX_N
            and direct_mid_auto
            and m
            >= (DIRECT_MID_N_MIN_ROWS_PER_SM if n >= DIRECT_MID_N_MIN_N else DIRECT_LOW_N_MIN_ROWS_PER_SM) * num_sms
            and nnz_padded * DIRECT_MID_N_MIN_SPARSITY_DENOMINATOR <= m * k
        ):
            variant = "direct"
        if (
            dtype in TC_DTYPES
            and n >= DENSE_MIN_N
            and dense_auto
            and nnz_padded * dense_min_density_denominator(n, k) >= m * k
        ):
            variant = "dense"
        # Shared-memory copy of X only where the H100 sweep (spmm-variants-v3) found it faster: N >= 32, enough rows
        # per SM and enough non-zeros per staged X element; otherwise gathers from L2 win.
        stage_x = n >= STAGE_X_MIN_N and m >= STAGE_X_MIN_ROWS_PER_SM * num_sms and nnz_padded >= 2 * k * num_sms
        if dtype in TC_DTYPES and decode_stages_x(n, k, m, num_sms):
            # rows of 32-lane subwarps from density 1/30; any rows from DECODE_STAGE_X_SHORT_ROWS_MIN_ROWS_PER_SM rows
            # per SM (see DECODE_STAGE_X_MIN_DENSITY_DENOMINATOR)
            stage_x = m >= DECODE_STAGE_X_SHORT_ROWS_MIN_ROWS_PER_SM * num_sms or (
                nnz_padded * DECODE_STAGE_X_MIN_DENSITY_DENOMINATOR >= m * k
                and nnz_padded >= SUBWARP_MIN_NNZ * max(1, m)
            )
    else:
        stage_x = variant != "rowwarp_global"
    if variant in ("direct", "dense"):
        return SpmmPlan(variant)
    if variant == "scatter":
        return SpmmPlan("scatter", kr_groups=scatter_kr_groups(m, k, num_sms, scatter_rows), strip_rows=scatter_rows)
    if variant == "bitmap":
        return SpmmPlan("bitmap")
    if variant == "tc":
        windows = -(-m // 16)
        for wpw, ntile in TC_TILES:
            if -(-windows // (TC_WARPS * wpw)) * -(-n // ntile) >= num_sms:
                break
        return SpmmPlan("tc", ntile=ntile, windows_per_warp=wpw)
    if variant in ("rowwarp", "rowwarp_global"):
        avg_nnz = nnz_padded / max(1, m)
        subwarp = 32 if avg_nnz >= SUBWARP_MIN_NNZ else 8
        ntile = 1 if n <= 1 else 4 if n <= 4 else 8 if n <= 8 else 16
        return SpmmPlan("rowwarp", subwarp=subwarp, ntile=ntile, stage_x=stage_x)
    n_tiles = -(-n // TILED_N_TILE)
    big_blocks = -(-m // TILED_ROWS_PER_BLOCK[8]) * n_tiles
    return SpmmPlan("tiled", rows_per_warp=8 if big_blocks >= 2 * num_sms else 2)


_SM_COUNT: dict[int, int] = {}
_OPS: dict[str, object] = {}


def _ensure_loaded() -> None:
    """Build/load the extension once and cache its operator handles (keeps per-call host overhead low)."""
    if _OPS:
        return
    build.load()
    ext = torch.ops.prunekit_ext
    _OPS.update(
        rowwarp=ext.spmm_csr_rowwarp.default,
        direct=ext.spmm_csr_direct.default,
        tiled=ext.spmm_csr_tiled.default,
        tc=ext.spmm_csr_tc.default,
        scatter=ext.spmm_csr_scatter.default,
        dense=ext.spmm_csr_dense.default,
        csr_to_dense=ext.csr_to_dense.default,
        sddmm=ext.sddmm_csr.default,
    )


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _aligned16(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _tc_operand(x: torch.Tensor) -> torch.Tensor:
    """``x (K, N)`` as spmm_tc.cu takes it: row-major, leading dimension a multiple of 8, 16-byte aligned base.

    Anything else (the runtime's transposed activations, odd N) is copied once into a buffer whose rows are padded
    to a multiple of 8 elements (2 * N * K elements moved; the benchmark's time includes it).
    """
    k, n = x.shape
    if (x.stride(1) == 1 or n == 1) and x.stride(0) % 8 == 0 and x.stride(0) >= n and _aligned16(x):
        return x
    ld = -(-n // 8) * 8
    buf = torch.empty((k, ld), dtype=x.dtype, device=x.device)
    buf[:, :n].copy_(x)
    return buf[:, :n]


def spmm_csr(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    row_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    variant: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """CUDA SpMM ``Y (M, N) = act(A @ X + bias[:, None])``, A in prunekit CSR as stored (see ``formats/csr.py``).

    Args:
        values: ``(nnz_padded,)`` fp16/bf16/fp32, same dtype as ``x``; row_offsets: ``(M + 1,)`` int32;
            column_indices: ``(nnz_padded,)`` int16/int32; row_indices: ``(M,)`` int32 row swizzle;
            x: ``(K, N)``, any strides (column-major X gives a column-major Y, see ``layout.py``);
            m: M; bias: ``(M,)`` or None; activation: ``"none"`` or ``"relu"``;
            variant: one of :data:`SPMM_VARIANTS` (``"tc"``, ``"scatter"``: tensor cores, fp16/bf16 only;
            ``"scatter"``: N <= 16); out: optional
            ``(M, N)`` output to write into (unit stride along M or N).

    Returns:
        ``Y (M, N)`` in ``x.dtype`` (``out`` when given), accumulated in fp32.

    Raises:
        KernelUnavailable: no GPU/compiler (see ``build.load``). ValueError: bad dtypes, shapes or activation, or
        ``variant="tc"`` or ``"scatter"`` with fp32, ``variant="scatter"`` with N > 16.
    """
    _ensure_loaded()
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (K, N), got shape {tuple(x.shape)}")
    if values.dtype != x.dtype and out is None:
        # Mixed precision (e.g. fp32 activations, fp16 weights): compute in the weights' dtype, return x's dtype.
        y = spmm_csr(
            values, row_offsets, column_indices, row_indices, x.to(values.dtype), m, bias, activation, variant=variant
        )
        return y.to(x.dtype)
    if values.dtype != x.dtype:
        raise ValueError(f"values ({values.dtype}) and x ({x.dtype}) must have one dtype when out is given")
    if row_offsets.numel() != m + 1:
        raise ValueError(f"row_offsets has {row_offsets.numel()} entries, expected M + 1 = {m + 1}")
    n = x.shape[1]
    if out is None:
        y = new_spmm_output(x, m)
    else:
        y = out
        if y.shape != (m, n) or y.dtype != x.dtype or y.device != x.device:
            raise ValueError(f"out must be a ({m}, {n}) {x.dtype} tensor on {x.device}")
    if m == 0 or n == 0:
        return y
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        bias = bias.to(dtype=x.dtype).contiguous()
    # The tc plan is cached on the stored tensors themselves (keyed on their pointers): it takes them as passed, not
    # the per-call copies below, or a misaligned or strided weight would rebuild its plan on every call.
    csr_as_stored = (values, row_offsets, column_indices)
    # Only copy what the kernels cannot take as is (each call here costs host time on every eager call).
    if not values.is_contiguous() or not _aligned16(values):
        values = values.contiguous().clone()
    if not column_indices.is_contiguous() or not _aligned16(column_indices):
        column_indices = column_indices.contiguous().clone()
    if not row_offsets.is_contiguous():
        row_offsets = row_offsets.contiguous()
    if not row_indices.is_contiguous():
        row_indices = row_indices.contiguous()
    plan = plan_spmm(m, x.shape[0], n, values.numel(), _sm_count(x.device), variant, x.dtype)
    if plan.variant == "bitmap" and variant == "auto" and not nm24.available():
        # the bitmap kernel's library does not build here (logged once): the rule without it
        plan = _plan_spmm(
            m, x.shape[0], n, values.numel(), _sm_count(x.device), variant, x.dtype, tc_auto_enabled(),
            scatter_auto_enabled(), scatter_strip_rows(), False, dense_auto_enabled(),
        )  # fmt: skip
    relu = activation == "relu"
    if plan.variant == "tc":
        if x.dtype not in TC_DTYPES:
            raise ValueError(f"the tensor-core SpMM (variant='tc') takes float16 or bfloat16, got {x.dtype}")
        tc = get_tc_plan(*csr_as_stored, m, x.shape[0])
        _OPS["tc"](
            tc.frag_values,
            tc.slot_rows,
            tc.kstep_offsets,
            tc.window_rows,
            _tc_operand(x),
            y,
            bias,
            relu,
            plan.windows_per_warp,
            plan.ntile,
        )
    elif plan.variant == "scatter":
        if x.dtype not in TC_DTYPES:
            raise ValueError(f"the tensor-core SpMM (variant='scatter') takes float16 or bfloat16, got {x.dtype}")
        if n > SCATTER_MAX_N:
            raise ValueError(f"variant='scatter' takes N <= {SCATTER_MAX_N} columns of x, got {n}")
        sp = get_scatter_plan(*csr_as_stored, m, x.shape[0], plan.strip_rows)
        _OPS["scatter"](
            sp.records, sp.group_offsets, x, y, bias, relu, plan.kr_groups, sp.workspace, sp.counters, sp.strip_rows
        )
    elif plan.variant == "bitmap":
        _bitmap_mm(csr_as_stored, x, y, m, bias, relu)
    elif plan.variant == "rowwarp":
        # x as it is: for X that is not row-major the launcher makes a row-major (K, N) copy itself (one small
        # transpose kernel, N * K elements, that turns N scattered loads per non-zero into one vector load;
        # csrc/spmm_rowwarp.cu), except where the SpMV kernel (N <= 4) takes X as it is.
        _OPS["rowwarp"](
            values, row_offsets, column_indices, row_indices, x, y, bias, relu, plan.subwarp, plan.ntile, plan.stage_x
        )
    elif plan.variant == "dense":
        # X as it is: cuBLAS reads either layout (the GEMM's operand transposes)
        _OPS["dense"](values, row_offsets, column_indices, x, y, bias, relu)
    elif plan.variant == "direct":
        # X as it is: the op copies transposed activations to row-major itself with a coalescing transpose kernel
        # (csrc/spmm_rowwarp.cu, row_major_copy; one extra pass over X, 2 * N * K elements moved).
        _OPS["direct"](values, row_offsets, column_indices, row_indices, x, y, bias, relu)
    else:
        if not (x.stride(1) == 1 or transposed_io(x)):
            x = x.contiguous()
        _OPS["tiled"](values, row_offsets, column_indices, x, y, bias, relu, plan.rows_per_warp)
    return y


def spmv_takes(m: int, k: int, n: int, esize: int, num_sms: int = 132) -> bool:
    """Whether rowwarp runs the SpMV kernel (``csrc/spmv_csr.cu``) for ``A (m, k)`` and ``X (k, n)`` of ``esize``-byte
    elements, as the C++ ``spmv_takes`` decides: N = 1 with X within :data:`SPMV_MAX_SMEM`, or its 4-token tile at N =
    2-4 with ``k * 4 * esize <= SPMV_TILE_MAX_SMEM`` and ``m >= SPMV_TILE_MIN_ROWS_PER_SM * num_sms``; and
    ``$PRUNEKIT_SPMV`` not ``0`` (the C++ side also checks the GPU's shared-memory limit, higher than these on sm_80
    and newer)."""
    if os.environ.get(SPMV_ENV, "").strip() == "0" or k <= 0 or not 1 <= n <= SPMV_MAX_N:
        return False
    if n == 1:
        return k * esize <= SPMV_MAX_SMEM
    return k * SPMV_MAX_N * esize <= SPMV_TILE_MAX_SMEM and m >= SPMV_TILE_MIN_ROWS_PER_SM * num_sms


def bitmap_ring() -> int:
    """Batches of 8 k-steps per warp in the bitmap kernel's shared-memory ring: ``$PRUNEKIT_BITMAP_RING`` (3 or 5),
    else :data:`BITMAP_RING`.

    Raises:
        ValueError: another value."""
    return int(build.setting(None, BITMAP_RING_ENV, str(BITMAP_RING), ("3", "5"), "bitmap decode ring"))


def _bitmap_mm(
    csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    m: int,
    bias: torch.Tensor | None,
    relu: bool,
) -> None:
    """``y (M, N) = act(A @ x + bias)`` with the bitmap decode kernel (``prunekit_nm24::bitmap_mm``, loaded on first
    use); the plan is built once per weight and cached on its values tensor. ``csr``: (values, row_offsets,
    column_indices) as stored; ``x``: ``(K, N)``, any strides. N <= 16 runs one block per (row block, k-chunk); N 17-32
    blocks of 32 tokens; above, blocks of 64 tokens (grid z over token groups), each decoding the weight again.

    Raises:
        ValueError: not fp16/bf16. KernelUnavailable: the library does not build or load here.
    """
    if x.dtype not in TC_DTYPES:
        raise ValueError(f"the bitmap SpMM (variant='bitmap') takes float16 or bfloat16, got {x.dtype}")
    nm24.load()
    bp = get_bitmap_plan(*csr, m, x.shape[0])
    chunk = nm24.plan_chunk(bp.strips, bp.ksteps, _sm_count(x.device), x.shape[1])
    torch.ops.prunekit_nm24.bitmap_mm(
        bp.vals, bp.hdr, bp.boff, bp.ws, bp.counters, x, y, bias, relu, m, chunk, bp.slot_words, bitmap_ring()
    )


def eager_bitmap_takes(
    values: torch.Tensor, x2d: torch.Tensor, m: int, k: int, bias: torch.Tensor | None = None
) -> bool:
    """Whether an eager call of a CSR layer with activations ``x2d (N, K)`` runs the bitmap kernel through its C++
    entry (:func:`bitmap_linear`): what ``"auto"`` would choose (:func:`plan_spmm` with the stored values' count),
    values and x of one fp16/bf16 dtype on the GPU, a bias of that dtype and contiguous (or none), and the library
    available here (:func:`nm24.available`). Depends on N through the rule's density floor."""
    n = x2d.shape[0] if x2d.dim() == 2 else 0
    if not (
        BITMAP_MIN_N <= n <= BITMAP_WIDE_MAX_N and x2d.is_cuda and x2d.dtype in TC_DTYPES and values.dtype == x2d.dtype
    ):
        return False
    if bias is not None and (bias.dtype != x2d.dtype or not bias.is_contiguous()):
        return False
    plan = plan_spmm(m, k, n, values.numel(), _sm_count(x2d.device), "auto", x2d.dtype)
    return plan.variant == "bitmap" and nm24.available()


def bitmap_linear_plan(
    csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor], m: int, k: int, device: torch.device, n: int = 1
) -> tuple[torch.Tensor, int, int]:
    """What the runtime keeps per CSR layer and N for the eager bitmap entry (:func:`bitmap_linear`): the plan's one
    buffer (``spmm_bitmap_plan.BitmapPlan.buffer``; the plan is built once and cached on the values tensor), its packed
    settings (M, the k-chunk :func:`nm24.plan_chunk` for this device's SMs and ``n`` tokens, the ring
    :func:`bitmap_ring`; the layout of ``nm24.plan_cfg``) and its slot size in words with K in bits 32-62 (checked
    against x by the entry).

    Args:
        csr: (values, row_offsets, column_indices) as stored, fp16/bf16 on ``device``; m, k: the weight's shape;
            n: the tokens of the calls it serves (the k-chunk depends on their groups of 64 above 32).

    Raises:
        KernelUnavailable: the library does not build or load here. ValueError: as :func:`build_bitmap_plan`."""
    nm24.load()
    bp = get_bitmap_plan(*csr, m, k)
    chunk = nm24.plan_chunk(bp.strips, bp.ksteps, _sm_count(device), n)
    return bp.buffer, nm24.plan_cfg(m, chunk, 0, bitmap_ring(), 8), bp.slot_words | k << 32


def bitmap_linear(
    plan: tuple[torch.Tensor, int, int], x: torch.Tensor, bias: torch.Tensor | None = None, relu: bool = False
) -> torch.Tensor:
    """One launch of the bitmap kernel through its eager C++ entry ``prunekit_nm24::bitmap_linear``: ``x (N, K)`` (the
    activations as ``nn.Linear`` takes them, CUDA, the plan's dtype, N >= 1) gives ``Y^T (N, M) = act(x A^T +
    bias)``, the transposes made in C++. ``plan``: from :func:`bitmap_linear_plan`; ``bias``: contiguous ``(M,)`` of
    x's dtype or None.

    Raises:
        RuntimeError: shapes, dtypes or devices that do not match the plan (C++ checks)."""
    buffer, cfg, shape = plan
    return fastcall.entry("bitmap_linear")(buffer, x, bias, relu, cfg | nm24.ROWS, shape)


# --- eager entry: one C++ operator call per layer call (the CUDA-core variants) ------------------------------------


def eager_cpp_enabled() -> bool:
    """Whether eager CUDA calls of the runtime take the C++ entry ``prunekit_ext::spmm_csr_auto``:
    ``$PRUNEKIT_SPMM_CPP`` (``1``/``0``), else :data:`EAGER_CPP_DEFAULT` (True since its H100 run)."""
    return _env_switch(EAGER_CPP_ENV, EAGER_CPP_DEFAULT)


def spmm_plan_code(plan: SpmmPlan) -> tuple[int, int, int, int, int, int]:
    """``plan`` as ``prunekit_ext::plan_spmm_code`` returns it: ``(variant code, subwarp, ntile, rows_per_warp,
    stage_x, windows_per_warp)`` with :data:`SPMM_VARIANT_CODES` (a GPU test compares the two plans with this)."""
    return (
        SPMM_VARIANT_CODES[plan.variant],
        plan.subwarp,
        plan.ntile,
        plan.rows_per_warp,
        int(plan.stage_x),
        plan.windows_per_warp,
    )


def eager_spmm_code(variant: str, x_dtype: torch.dtype, values_dtype: torch.dtype, n: int, tc_auto: bool) -> int | None:
    """Variant code for ``prunekit_ext::spmm_csr_auto``, or None when :func:`spmm_csr` must run the call.

    None when the call would use the tensor-core kernel (``variant="tc"``, or ``"auto"`` with ``tc_auto``, fp16/bf16
    and ``n >= TC_MIN_N``: the rule of :func:`plan_spmm`, whose ``tc`` plan is a Python object), when the dtypes differ
    (mixed precision converts in Python) or are not in :data:`EAGER_DTYPES`. Pure function of its arguments.

    Args:
        variant: one of :data:`SPMM_VARIANTS`; x_dtype / values_dtype: the activations' and weights' dtypes;
            n: N (tokens); tc_auto: :func:`tc_auto_enabled`.

    Raises:
        ValueError: unknown ``variant``.
    """
    if variant not in SPMM_VARIANTS:
        raise ValueError(f"unknown spmm variant {variant!r}; known: {', '.join(SPMM_VARIANTS)}")
    if variant in ("tc", "scatter", "bitmap") or (
        variant == "auto" and tc_auto and x_dtype in TC_DTYPES and n >= TC_MIN_N
    ):
        return None
    if variant == "auto" and dense_auto_enabled() and x_dtype in TC_DTYPES and n >= DENSE_MIN_N:
        return None  # the dense rule reads the density: eager_spmm_variant plans it (code "dense" for the entry)
    if (
        variant == "auto"
        and x_dtype in TC_DTYPES
        and (
            (scatter_auto_enabled() and SCATTER_MIN_N <= n <= SCATTER_MAX_N)
            or (bitmap_auto_enabled() and BITMAP_MIN_N <= n <= BITMAP_WIDE_MAX_N)
            or (direct_mid_auto_enabled() and DIRECT_LOW_N_MIN_N <= n <= ROWWARP_MAX_N)
        )
    ):
        return None  # the scatter, bitmap and mid-N direct rules also read the density: gpu.spmm_csr decides
    if x_dtype != values_dtype or x_dtype not in EAGER_DTYPES:
        return None
    return SPMM_VARIANT_CODES[variant]


def eager_size_class(n: int) -> int:
    """The classes of N between which :func:`eager_spmm_variant`'s answer can change: 0 for N < BITMAP_MIN_N, 1 up to
    SPMV_MAX_N (bitmap's range, K >= BITMAP_MIN_K only), 2 below SCATTER_MIN_N (bitmap's range from
    BITMAP_MIN_K_SMALL_N, no scatter), 3 below BITMAP_MAX_N (the scatter kernel's range too), 4 for N = BITMAP_MAX_N (its own bitmap
    density floor), 5 below DIRECT_MID_N_MIN_N (bitmap's wide range from BITMAP_MIN_K_SMALL_N, and ``direct`` from
    DIRECT_LOW_N_MIN_ROWS_PER_SM rows per SM), 6 below TC_MIN_N (``direct`` from DIRECT_MID_N_MIN_ROWS_PER_SM rows per
    SM), 7 up to TC_SMALL_N (the tensor-core ``tc`` range at its N <= TC_SMALL_N density floor,
    and bitmap's from BITMAP_MIN_K), 8 up to BITMAP_WIDE_MAX_N (``tc``'s other floors), 9 above. Within a class, the
    rules' density floors do not change. The runtime caches one answer per layer, dtype pair and class."""
    if n < BITMAP_MIN_N:
        return 0
    if n <= SPMV_MAX_N:
        return 1
    if n < SCATTER_MIN_N:
        return 2
    if n <= BITMAP_MAX_N:
        return 3 if n < BITMAP_MAX_N else 4
    if n < DIRECT_MID_N_MIN_N:
        return 5
    if n < TC_MIN_N:
        return 6
    if n <= TC_SMALL_N:
        return 7
    return 8 if n <= BITMAP_WIDE_MAX_N else 9


def eager_spmm_variant(
    values: torch.Tensor, x: torch.Tensor, variant: str = "auto", m: int | None = None
) -> int | None:
    """Variant code for the C++ eager entry ``prunekit_ext::spmm_csr_auto`` (loading the library on first use), or
    None when :func:`spmm_csr` must run: :func:`eager_cpp_enabled` False, ``x`` not a 2-D CUDA tensor, or
    :func:`eager_spmm_code` None (a possible tensor-core plan, mixed or unsupported dtypes, the N where the scatter and
    bitmap rules read the density) unless ``m`` is given and :func:`plan_spmm` on this weight's stored entries chooses
    a CUDA-core kernel, which the entry's own rule then chooses too. Within a size class the tc, scatter and bitmap
    density floors do not change, so the answer holds for the whole class (since the fifteenth session also where
    ``tc`` is possible but not chosen: ``direct`` from TC_MIN_N through the entry).

    The answer depends on ``x`` only through its dtype, its device and :func:`eager_size_class` of N (and on
    ``$PRUNEKIT_SPMM_CPP`` / ``$PRUNEKIT_SPMM_TC`` / ``$PRUNEKIT_SPMM_SCATTER`` / ``$PRUNEKIT_SPMM_BITMAP`` /
    ``$PRUNEKIT_SPMM_DIRECT_MID``, read now):
    :func:`spmm_op_entry` asks once per weight, dtype, bias, M and N (size class above BITMAP_WIDE_MAX_N) and keeps
    the answer on the weight's values.

    Args:
        values: ``(nnz_padded,)`` the weight's stored values; x: ``(K, N)`` activations; variant: one of
            :data:`SPMM_VARIANTS`; m: the weight's rows (``out_features``), or None.

    Raises:
        KernelUnavailable: enabled, but no GPU/compiler. ValueError: unknown ``variant``.
    """
    if not eager_cpp_enabled() or x.dim() != 2 or not x.is_cuda:
        return None
    n = x.shape[1]
    code = eager_spmm_code(variant, x.dtype, values.dtype, n, tc_auto_enabled())
    if code is None and m is not None and variant == "auto" and x.dtype == values.dtype and x.dtype in EAGER_DTYPES:
        plan = plan_spmm(m, x.shape[0], n, values.numel(), _sm_count(x.device), "auto", x.dtype)
        if plan.variant == "dense" or (plan.variant == "direct" and n <= ROWWARP_MAX_N):
            code = SPMM_VARIANT_CODES[plan.variant]  # the entry runs it forced: its own rule takes neither here
        elif plan.variant not in ("tc", "scatter", "bitmap"):
            code = SPMM_VARIANT_CODES["auto"]
    if code is not None:
        _ensure_loaded()
    return code


# prunekit::spmm_csr's CUDA implementation keeps its per-weight eager decisions on the values tensor under this name
OP_ENTRY_ATTR = "_prunekit_spmm_op_entries"


def spmm_csr_op(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    row_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """The CUDA implementation of ``prunekit::spmm_csr`` (``ops.spmm_csr``): :func:`spmm_csr`'s ``"auto"`` result and
    layout, through a C++ entry where one applies. The bitmap kernel's ``prunekit_nm24::bitmap_linear`` where ``"auto"``
    takes it (:func:`eager_bitmap_takes`), else ``prunekit_ext::spmm_csr_auto`` where :func:`eager_spmm_variant` gives a
    code, else :func:`spmm_csr` (always with ``$PRUNEKIT_SPMM_CPP=0``). Decided once per weight, dtype and N
    (:func:`spmm_op_entry`), so an eager call skips :func:`spmm_csr`'s checks, rule and plan lookups: those cost 29-76
    us per eager call on the H100 host at small kernels (docs/PERFORMANCE.md, "Fifteenth session"). The runtime's
    ``SparseLinear`` calls this function directly in eager CUDA inference (no custom-op dispatch).

    Args and result: as :func:`spmm_csr` with ``variant="auto"`` (values ``(nnz_padded,)``, x ``(K, N)``, Y ``(M,
    N)`` in ``x.dtype``). Mixed dtypes, a bias of another dtype or not contiguous, and 0-sized calls go to
    :func:`spmm_csr` unchanged. (``SparseLinear``'s eager call takes the same decisions with the activations ``(N,
    K)`` as they are: :func:`spmm_rows_call`.)

    Raises:
        As :func:`spmm_csr`; shape errors found by a C++ entry raise RuntimeError.
    """
    n = x.shape[1] if x.dim() == 2 else 0
    if not (activation in ACTIVATIONS and _entry_takes(values, x, n, m, bias)):
        return spmm_csr(values, row_offsets, column_indices, row_indices, x, m, bias, activation)
    kind, plan = spmm_op_entry(values, row_offsets, column_indices, x, m, bias)
    relu = activation == "relu"
    if kind == "bitmap":  # the entries through the fast-call module where it loads (fastcall.entry)
        buffer, cfg, shape = plan
        return fastcall.entry("bitmap_linear")(buffer, x, bias, relu, cfg, shape)
    if plan is not None:
        return fastcall.entry("spmm_csr_auto")(values, row_offsets, column_indices, row_indices, x, m, bias, relu, plan)
    return spmm_csr(values, row_offsets, column_indices, row_indices, x, m, bias, activation)


def _entry_takes(values: torch.Tensor, x: torch.Tensor, n: int, m: int, bias: torch.Tensor | None) -> bool:
    """Whether a call with ``n`` tokens can go to a C++ entry as :func:`spmm_op_entry` decides: non-empty, CUDA, x in
    the values' dtype, and a bias (if any) of that dtype and contiguous."""
    return (
        n > 0
        and m > 0
        and x.is_cuda
        and x.dtype == values.dtype
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )


def spmm_rows_call(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    row_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
) -> tuple | None:
    """What :func:`spmm_csr_op` runs for this weight and bias, for the activations ``x (N, K)`` (its ``x.t()``), as
    parts a caller can keep and call without it (the runtime's ``SparseLinear`` keeps them per layer, dtype and N: a call then
    skips this module's checks and decision lookup, about 2.6 us of host time per eager call on the H100 host):
    ``(True, op, plan buffer, cfg, shape)`` for ``op(buffer, x, bias, False, cfg, shape)`` (the bitmap entry),
    ``(False, op, code)`` for ``op(values, row_offsets, column_indices, row_indices, x, m, bias, False, code)``
    (``prunekit_ext::spmm_csr_auto``), both with the ``ROWS`` flag set and ``op`` from :func:`fastcall.entry` (the
    operator called without its Python-side argument parsing); or None where :func:`spmm_csr` runs the call
    (not CUDA, mixed dtypes, a bias of another dtype or not contiguous, empty sizes, or no C++ entry for the call).
    The decision is :func:`spmm_op_entry`'s (kept on ``values`` as well).

    Raises:
        KernelUnavailable: a C++ entry is chosen but its library cannot be built or loaded.
    """
    if not _entry_takes(values, x, x.shape[0] if x.dim() == 2 else 0, m, bias):
        return None
    kind, plan = spmm_op_entry(values, row_offsets, column_indices, x, m, bias, rows=True)
    if kind == "bitmap":
        buffer, cfg, shape = plan
        return (True, fastcall.entry("bitmap_linear"), buffer, cfg | nm24.ROWS, shape)
    if plan is not None:
        return (False, fastcall.entry("spmm_csr_auto"), plan | SPMM_ROWS)
    return None


def spmm_op_entries(values: torch.Tensor) -> dict:
    """The decisions :func:`spmm_op_entry` keeps on ``values`` (key ``(x dtype, bias is None, M, N)``, N replaced by
    minus its :func:`eager_size_class` above :data:`BITMAP_WIDE_MAX_N`; value as :func:`spmm_op_entry` returns), or
    an empty dict when none were made; for tests and diagnostics."""
    hit = getattr(values, OP_ENTRY_ATTR, None)
    return {} if hit is None else hit[2]  # tensor_cache.cached keeps (key, storages, value)


def spmm_op_entry(
    values: torch.Tensor,
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    *,
    rows: bool = False,
) -> tuple[str, object]:
    """:func:`spmm_csr_op`'s decision for this weight and call: ``("bitmap", plan)`` (the bitmap kernel's C++ entry
    with its :func:`bitmap_linear_plan`), ``("auto", code)`` (``prunekit_ext::spmm_csr_auto`` with this variant code)
    or ``("auto", None)`` (:func:`spmm_csr`). Made once per (x dtype, bias or not, M, N) and kept on ``values`` (a dict under
    :data:`OP_ENTRY_ATTR`, ``tensor_cache.cached``) while the data pointers and versions of the values, column indices
    and row offsets stay the same; ``$PRUNEKIT_SPMM_CPP=0`` (read per decision) gives ``("auto", None)``.

    Args: as :func:`spmm_csr_op` (``x (K, N)`` with N >= 1, of the values' dtype; ``(N, K)`` with ``rows``).

    Raises:
        KernelUnavailable: a C++ entry is chosen but its library cannot be built or loaded.
    """
    inputs = (values, column_indices, row_offsets)
    try:  # their stamp (tensor_cache.stamp) written out: this runs on every eager call of the op
        now = (
            (values.data_ptr(), values._version),
            (column_indices.data_ptr(), column_indices._version),
            (row_offsets.data_ptr(), row_offsets._version),
        )
    except RuntimeError:  # an inference tensor keeps no version counter
        now = stamp(inputs)
    decisions = cached_stamped(values, OP_ENTRY_ATTR, now, inputs, None, dict)
    if rows:
        n, k = x.shape
    else:
        k, n = x.shape  # unpacked as it is: reversing the Size first cost 0.4 us
    # bitmap's density floor depends on N itself up to BITMAP_WIDE_MAX_N; above, the size class decides
    key = (x.dtype, bias is None, m, n if n <= BITMAP_WIDE_MAX_N else -eager_size_class(n))
    entry = decisions.get(key)
    if entry is None:
        x = x.t() if rows else x  # (K, N)
        if not eager_cpp_enabled():  # $PRUNEKIT_SPMM_CPP=0: the Python launcher for every call
            entry = ("auto", None)
        elif eager_bitmap_takes(values, x.t(), m, k, bias):
            entry = ("bitmap", bitmap_linear_plan((values, row_offsets, column_indices), m, k, x.device, n))
        else:
            entry = ("auto", eager_spmm_variant(values, x, "auto", m))
        decisions[key] = entry
    return entry


def csr_to_dense(
    values: torch.Tensor, row_offsets: torch.Tensor, column_indices: torch.Tensor, m: int, k: int
) -> torch.Tensor:
    """CUDA decompression of a prunekit CSR weight into a dense matrix, the first step of the ``dense`` SpMM variant:
    Flash-LLM's "load as sparse, compute as dense" (Xia et al., VLDB 2024), here for a whole layer before one cuBLAS
    GEMM instead of per tile inside the GEMM (``csrc/spmm_dense.cu``: each row assembled in shared memory by a block,
    or by a warp where rows are at most 4 KB, and written with 16-byte stores; the written bytes are M * K elements).

    Args:
        values: ``(nnz_padded,)`` fp16/bf16/fp32; row_offsets: ``(M + 1,)`` int32; column_indices: ``(nnz_padded,)``
            int16/int32; m: M; k: K.

    Returns:
        ``(M, K)`` contiguous, in ``values.dtype``. The columns of a row must be unique apart from entries holding
        zero (the format's padding, ``formats/csr.py``): zeros are skipped, and of two non-zeros on one column either
        may be kept (``reference.csr_to_dense`` adds them).

    Raises:
        KernelUnavailable: no GPU/compiler. RuntimeError: bad shapes or dtypes (the kernel's checks).
    """
    _ensure_loaded()
    if not values.is_contiguous():
        values = values.contiguous()
    if not column_indices.is_contiguous() or not _aligned16(column_indices):
        column_indices = column_indices.contiguous().clone()
    dense = _OPS["csr_to_dense"](values, row_offsets.contiguous(), column_indices, m, k)
    return dense if dense.is_contiguous() else dense.contiguous()  # rows padded to 16 bytes where K is odd


def sddmm_csr(
    row_offsets: torch.Tensor,
    column_indices: torch.Tensor,
    row_indices: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """CUDA SDDMM: ``out[j] = a[row(j)] . b[col(j)]`` at every stored entry of a prunekit CSR pattern.

    Sputnik's SDDMM (Gale et al. SC 2020, sec. 6): ``(A @ B^T)`` sampled at the pattern; padding entries give 0.

    Args:
        row_offsets: ``(M + 1,)`` int32; column_indices: ``(nnz_padded,)`` int16/int32; row_indices: ``(M,)``
            int32; a: ``(M, K_inner)``; b: ``(N, K_inner)`` of a's dtype (fp16/bf16/fp32; non-contiguous inputs are
            copied to contiguous first); out: optional ``(nnz_padded,)`` output.

    Returns:
        ``(nnz_padded,)`` values aligned with the CSR's ``values`` array, in ``a.dtype`` (fp32 accumulation).

    Raises:
        KernelUnavailable: no GPU/compiler. ValueError: bad dtypes or shapes.
    """
    _ensure_loaded()
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a (M, K) and b (N, K) expected, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a ({a.dtype}) and b ({b.dtype}) must have one dtype")
    if row_offsets.numel() != a.shape[0] + 1:
        raise ValueError(f"row_offsets has {row_offsets.numel()} entries, expected M + 1 = {a.shape[0] + 1}")
    nnz = column_indices.numel()
    y = torch.empty(nnz, dtype=a.dtype, device=a.device) if out is None else out
    if y.shape != (nnz,) or y.dtype != a.dtype:
        raise ValueError(f"out must be a ({nnz},) {a.dtype} tensor")
    if not column_indices.is_contiguous() or not _aligned16(column_indices):
        column_indices = column_indices.contiguous().clone()
    _OPS["sddmm"](row_offsets.contiguous(), column_indices, row_indices.contiguous(), a.contiguous(), b.contiguous(), y)
    return y
