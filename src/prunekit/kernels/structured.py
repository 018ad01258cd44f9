"""CUDA implementations of the structured-sparse matmuls ``prunekit::bsr_mm``, ``prunekit::bsr_mm_static`` and
``prunekit::nm_mm``.

Block-sparse (BSR) matmul on tensor cores, in PopSparse's two modes (Li et al., "PopSparse: accelerated block
sparse matrix multiplication on IPU", 2023):

- dynamic (``bsr_mm``): the pattern arrives at run time as device tensors; one CTA per (block row, 128 columns of
  N) reads its block range from ``crow_indices`` on the device, so a call needs no host sync and the buffers can be
  allocated once at a declared maximum number of blocks (``blocks.shape[0]``; only ``crow_indices[-1]`` are read)
  and reused under CUDA graphs.
- static (``bsr_mm_static``, defined here): the pattern is fixed at export, which stores a load-balanced schedule
  (``formats/bsr.py``: long block rows split evenly, items in descending-work order). The runtime uses it whenever
  the stored weight has one.

Kernels (``variant``): ``"mma"``, ``csrc/structured/bsr_mm.cuh`` (cp.async pipeline over blocks, ldmatrix,
``mma.sync.m16n8k16`` fp16/bf16 with fp32 accumulation, fused bias + ReLU), blocks of 16, 32 or 64 rows and columns;
``"wgmma"``, ``csrc/structured/bsr_mm_wgmma.cuh`` (sm_90a only: TMA box loads of each block and of the X slab at its
column into a swizzled mbarrier ring, ``wgmma.mma_async`` from shared memory; blocks of 16, 32 or 64 rows and
columns, 64-row blocks as wgmma's A operand, 16- and 32-row ones as its B operand with the X slab as A; measured on
the H100 for 64-row blocks: 1.3-2.1x faster than mma.sync at N >= 2048); ``"auto"`` takes ``"wgmma"`` where it pays
(:func:`auto_takes_wgmma`), else ``"mma"``. Other block shapes and dtypes run the
pure-torch reference on the GPU. Eager calls go through one C++ operator, ``prunekit_structured::bsr_mm``, which
allocates the output, picks the N tile and launches (:func:`bsr_mm_eager`, the runtime's SparseLinear).

2:4 matmul (NVIDIA's 2:4 structured sparsity, Mishra et al., "Accelerating Sparse Deep Neural Networks", 2021) on
Hopper's sparse tensor cores through cuSPARSELt: prunekit's own binding (``csrc/structured/cslt/``, C++ entry
``prunekit_cslt::linear``; weight compressed and plan built once) or ``torch._cslt_sparse_mm`` on a cached
compressed copy; no per-call search or compression. The binding writes a row-major output and transposes it into the
layout rule's order for the custom op (:data:`CSLT_DEFAULT_OUTPUT`, measured, see docs/PERFORMANCE_STRUCTURED.md);
the runtime's eager layer returns that row-major output as a view instead (:data:`CSLT_LAYER_DEFAULT_OUTPUT`). Other
N:M patterns run the reference on the GPU.

The extension (``prunekit_structured`` operator namespace) is separate from ``build.py``'s ``prunekit_ext`` and is
built lazily on the first CUDA call into the same cache root, in a folder keyed by the sources' sha256, torch and
CUDA versions and the target archs. Importing this module never fails; CUDA calls without a usable GPU/compiler raise
:class:`KernelUnavailable`. torch + stdlib only (copied into exported packages).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import KernelUnavailable
from . import build, fastcall, nm24, ops, reference
from .layout import as_spmm_output, new_spmm_output
from .tensor_cache import cached, peek, tensor_version

log = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parent / "csrc" / "structured"
SOURCES = (
    ("bsr_mm.cu",)
    + tuple(f"bsr_mm_{t}_n{bn}.cu" for t in ("f16", "bf16") for bn in (32, 128, 256))
    # sm_90a wgmma + TMA variant: kernel bodies only in an sm_90a image (else its probe reports it unavailable)
    + (
        "bsr_mm_wgmma.cu",
        "bsr_mm_wgmma_f16.cu",
        "bsr_mm_wgmma_bf16.cu",
        "bsr_mm_wgmma_wp_f16.cu",
        "bsr_mm_wgmma_wp_bf16.cu",
        "bsr_mm_wgmma_t_f16.cu",
        "bsr_mm_wgmma_t_bf16.cu",
        "bsr_mm_wgmma_tx_f16.cu",
        "bsr_mm_wgmma_tx_bf16.cu",
    )
    + ("bsr_decode_lean.cu",)
)
HEADERS = ("bsr_mm.cuh", "bsr_mm_wgmma.cuh", "../check.h", "../launch.cuh", "../views.h")
NAMESPACE = "prunekit_structured"
KERNEL_BLOCK_SIZES = (16, 32, 64)  # r and c the tensor-core kernel is instantiated for
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
TILE_NS = (32, 128, 256)  # N tiles the kernel is instantiated for (csrc/structured/bsr_mm.cuh, BsrConfig)
DECODE_MAX_N = 32  # N up to this takes the 32-wide tile: less wasted tensor-core work at decode shapes
WIDE_TILE_MIN_BLOCKS_PER_ROW = 10  # 64-row blocks: the 256 tile paid off from ~13 blocks per row, lost at <= 6.4
SHORT_ROWS_MAX_BLOCKS_PER_ROW = 4  # short_rows: the launch settings for block rows of a block or two
VARIANTS = {"auto": 0, "mma": 1, "wgmma": 2}  # csrc/structured/bsr_mm.cu VARIANT_*; "auto": wgmma where it applies
# Flag or-ed into a variant number of prunekit_structured::bsr_mm (bsr_mm.cu ROWS_FLAG): x is the activations (N, K) and
# the result Y^T (N, M), nn.Linear's layout, with the transposes made in C++ (the runtime's SparseLinear call)
ROWS = 1 << 8
# r x c the wgmma variant takes (c = the swizzle width). 64-row blocks are wgmma's A operand (M = 64); 16- and 32-row
# blocks its B operand (N = r), with the X slab as A (csrc/structured/bsr_mm_wgmma.cuh, bsr_wgmma_t_kernel).
WGMMA_BLOCKS = tuple((r, c) for r in (16, 32, 64) for c in (16, 32, 64))
# "auto" takes the wgmma variant (auto_takes_wgmma) for blocks of these rows at every N (calls at N <= lean_max_n run
# the lean decode kernel first), and for 16-row blocks from N = AUTO_WGMMA_16_MIN_N (the C++ entry bsr_mm applies the
# same rule). Measured on the H100 against mma.sync (fp16, 90 / 95%, 4096 x 4096 and 11008 x 4096 at N = 32-4096,
# 16384 x 16384 at N = 8192; benchmarks/results/bsr-wgmma-t-h100-2026-11-26-s26a.json and
# bsr-wgmma-t-ns-h100-2026-11-26-s26b.json), X through TMA boxes: 32-row blocks 1.02-2.55x faster at N >= 64 (1.3x at
# 16384 x 16384, 90%) and 1.4-1.5x at N = 32 with the stored schedule; 16-row blocks 1.00-1.66x at N = 64-1024,
# 0.98-1.11x at N = 2048, 0.96-1.07x at N = 4096-8192 and 0.57-1.06x at N = 32 (the mma.sync kernel's 32-wide tile).
# With the X-slab copy where x_slabs_rule takes it, 16-row blocks at N >= 2048 are 1.27-1.85x faster again
# (bsr-xslabs-h100-2026-11-26-s26c.json), hence no upper N bound.
AUTO_WGMMA_ROWS = (32, 64)
AUTO_WGMMA_16_MIN_N = 33
# $PRUNEKIT_BSR_XSLABS (read by the C++ launcher, csrc/structured/bsr_mm_wgmma.cu use_x_slabs, at every call): "1" the
# wgmma kernel for 16- and 32-row blocks reads X from a copy made per call in which each block column's slab is
# contiguous and pre-swizzled (one bulk copy per block instead of a TMA box of 32- or 64-byte rows); "0" never; unset
# or "auto": the launcher's rule.
XSLABS_ENV = "PRUNEKIT_BSR_XSLABS"
# The launcher's rule (x_slabs_rule; csrc/structured/bsr_mm_wgmma.cu, same constants): the copy pays where each X slab
# is read often enough, reuse = stored blocks * c / K (blocks per block column): at least XSLABS_MIN_REUSE[r] at
# N >= XSLABS_SMALL_N, XSLABS_MIN_REUSE_SMALL_N below. Measured on the H100 (fp16, 90 / 95%, 4096 x 4096, 11008 x 4096
# and 16384 x 16384 at N = 128 and 2048-8192, benchmarks/results/bsr-xslabs-h100-2026-11-26-s26c.json): 16-row blocks
# 1.27-1.85x faster with the copy at N >= 2048 (reuse 12.8-102), 32-row blocks 1.08-1.23x from a reuse of 25.6 and
# 0.87-1.05x at 6.4-17.2; at N = 128, 16-row blocks 1.21-1.52x at a reuse of 34-102 and 0.87-0.96x at 12.8-25.6,
# 32-row blocks 1.17x at 51, 1.02x at 25.6, 0.74-0.94x at 6.4-34.4. At N = 256 / 512 (bsr-xslabs-mid-h100-2026-11-26-
# s27a.json) the large-N thresholds held: 16-row blocks 1.16-1.62x faster at every reuse timed (12.7-69), 32-row blocks
# 1.04-1.13x at 34, a tie at 17.8, 0.87-0.91x at 6.2-13; and at N = 160 / 192 / 224
# (bsr-xslabs-lown-h100-2026-11-26-s27h.json) 16-row blocks 1.15-2.05x at 12.7-69, 32-row blocks 1.05-1.12x at 34-35,
# 0.81-0.98x at 6.2-17.7. Hence XSLABS_SMALL_N = 160 (1024 until the twenty-seventh session, from N = 128 data only);
# N = 129-159 not measured.
XSLABS_SMALL_N = 160
XSLABS_MIN_REUSE = {16: 12, 32: 24}
XSLABS_MIN_REUSE_SMALL_N = 48
WGMMA_TILE_NS = (128, 256)  # one or two consumer warpgroups of 64 x 128
BSR_VARIANT_ENV = "PRUNEKIT_BSR_VARIANT"  # default variant of bsr_mm_cuda and the runtime ("auto", "mma", "wgmma")
# Static mode at decode N (up to DECODE_MAX_N, the 32-wide tile) with 32-row blocks: the stored schedule gives one CTA
# per block row (split only past twice the median row), too few to keep the SMs' loads in flight. decode_schedule cuts
# every block row into items of at most DECODE_SCHEDULE_CHUNK blocks instead (fp32 reduction of the split rows). On the
# H100, N = 16, fp16 (benchmarks/results/bsr-decode-c{default,1,2,4}-h100-2026-11-26-s17.json; chunks 1, 2, 4 against
# the stored schedule): 32-row blocks at 4096 x 4096 90 / 95% 11.0 / 9.9 -> 8.0 / 7.2 us with 4, 11008 x 4096 14.2 /
# 11.1 -> 13.7 / 9.5 us; 64-row blocks (the wgmma variant) were slower with every chunk (8.2 -> 9.1-11.1 us at 4096 x
# 4096, 90%), so they keep the stored schedule. In-sample: two shapes, two sparsities, one run.
DECODE_SCHEDULE_CHUNK = 4
DECODE_SCHEDULE_BLOCK_ROWS = (32,)
DECODE_SCHEDULE_ENV = "PRUNEKIT_BSR_DECODE_SCHEDULE"  # "0": the stored schedule at every N
# Calls at 1 <= N <= lean_max_n(r, c) (at most LEAN_MAX_N; static and dynamic, blocks 16 / 32 / 64, fp16 / bf16) run
# the lean decode kernel (csrc/structured/bsr_decode_lean.cu: a CTA per 16-row strip, its warps taking the block
# row's blocks in turn, blocks and X loaded straight into mma fragments; one launch, no schedule or workspace) instead
# of the tiled kernel, unless $PRUNEKIT_BSR_LEAN=0. On by default since the nineteenth session: on the H100 at N = 16,
# static mode, 0.26-0.93x of the tiled kernel's time at all 12 points of 4096 x 4096 and 11008 x 4096 (blocks 16 /
# 32 / 64, 90 / 95%), and ahead of torch's Triton BSR at all 12 (1.00-3.09x; a tie, 7.62 against 7.63 us, at
# 11008 x 4096 b64 95%): benchmarks/results/bsr-decode-{lean,tiled}-h100-2026-11-26-s19.json. LEAN_WARPS_ENV forces
# its warps per CTA (4 or 8).
LEAN_ENV = "PRUNEKIT_BSR_LEAN"
LEAN_WARPS_ENV = "PRUNEKIT_BSR_LEAN_WARPS"
LEAN_WIDE_MAX_STRIPS_PER_SM = 2  # lean_warps: 8 warps per CTA up to this many 16-row strips per SM, else 4
LEAN_MAX_N = 32  # the lean kernel's capacity (4 n-tiles of 8 tokens); lean_max_n: the N it takes
# "16" / "32": the most tokens the lean kernel takes; unset / "auto": the rule (lean_max_n)
LEAN_MAX_N_ENV = "PRUNEKIT_BSR_LEAN_MAX_N"
# lean_max_n's rule (csrc/structured/bsr_decode_lean.cu, the same): N up to LEAN_MAX_N for blocks of at most
# LEAN_WIDE_MAX_ROWS rows, else up to LEAN_NARROW_MAX_N. On the H100 at N = 17 / 32 (4096 x 4096, 11008 x 4096, square
# blocks, 90 / 95%; benchmarks/results/bsr-lmax{16,32}-h100-2026-11-26-s28c.json) the lean kernel took 0.26-0.99x the
# time of the other kernels at all 16 points with 16- and 32-row blocks, and 1.15-1.41x at all 8 with 64-row blocks.
LEAN_WIDE_MAX_ROWS = 32
LEAN_NARROW_MAX_N = 16  # also lean_warps' bound: above this many tokens (the 4-n-tile instances) 4 warps
# Programmatic dependent launch of the lean and wgmma kernels (sm_90; "0": off, "1" / unset: on; read by the C++
# launcher at each call, csrc/structured/bsr_mm.cuh bsr_pdl): a kernel may start while the preceding kernel in the
# stream finishes, and waits for it before it reads or writes anything.
PDL_ENV = "PRUNEKIT_BSR_PDL"
# Output tiles per CTA of the wgmma kernel for 16- and 32-row blocks (read by the C++ launcher at each call,
# csrc/structured/bsr_mm_wgmma.cu bsr_tiles_per_cta): "1"-"64" forces the count, "wave" launches one wave of resident
# CTAs, unset / "auto": one. A CTA of several tiles takes tiles x, x + gridDim.x, ... and runs its TMA pipeline on
# across them, so the next tile's loads overlap this one's epilogue and the CTA's set-up is paid once. Not the default:
# with 32-row blocks, 3 stages and the 128 tile, a wave took 0.93-1.09x of the time of one tile per CTA (faster at
# 3072 x 768 @ 4096, slower @ 2048 and on 11008 x 4096; benchmarks/results/bsr-tiles-h100-2026-11-27-s34d.json).
TILES_PER_CTA_ENV = "PRUNEKIT_BSR_TILES_PER_CTA"
# Pipeline stages of the same kernel (same launcher, bsr_stages): "2"-"12", capped at the kernel's most; unset /
# "auto": 3 for 32-row blocks in short_rows, else the most (fewer stages: less shared memory per CTA).
STAGES_ENV = "PRUNEKIT_BSR_STAGES"
# The producer of the wgmma kernel for 64-row blocks (csrc/structured/bsr_mm_wgmma.cu bsr_warp_producer): "1" one warp
# after the consumer warpgroups, whose CTAs have 96 fewer threads and take their stage count from $PRUNEKIT_BSR_STAGES
# (auto: 2 in short_rows, else the most), and write empty block rows straight from the bias; "0" a warpgroup before
# them, with the kernel's fixed stages; unset / "auto": warp_producer_rule.
WARP_PRODUCER_ENV = "PRUNEKIT_BSR_WARP_PRODUCER"
WARP_PRODUCER_MIN_CTAS_PER_SM = 4  # warp_producer_rule: CTAs per SM per stored block per block row
# The N tile of the 64-row kernel with a producer warp where the plan gives 128 (csrc/structured/bsr_mm_wgmma.cu
# bsr_warp_tile_n): "64" consumers of 64 tokens (m64n64k16, 32 accumulators, six CTAs per SM), "128"; unset / "auto":
# warp_tile_n_rule.
WARP_TILE_N_ENV = "PRUNEKIT_BSR_WARP_TILE_N"
_DECODE_SCHEDULE_ATTR = "_prunekit_bsr_decode_schedule"  # on crow_indices (tensor_cache.cached)
# Split rows of the stored static schedule (formats.bsr.static_schedule: rows over twice the median, in slices of the
# chunk) cost a zeroed fp32 workspace, atomic adds and a finalize kernel per call. On the H100 (fp16, graph time,
# benchmarks/results/bsr-static-probe-h100-2026-11-26-s27c.log, -s27b-*.json and -s27h-*.json; random 95% patterns with
# one to eight dense block rows) they paid only where the longest block row spans enough columns, more as N grows:
# - N = 128: from 33 blocks of 64 columns (10.0 against 12.2 us unsplit); 18 blocks lost (10.0 against 8.5);
# - N = 512 / 1024: 64 blocks of 64 columns won (19.3 against 25.2, 31.1 against 35.0), 136 of 32 won (20.0 against
#   43.7), 34 of 64 lost (18.9 against 17.6, 30.3 against 27.5);
# - N = 2048: rows of 8192-16384 columns won (66 against 117 us, 216 against 446, 339 against 391), 2112-4096 lost
#   (53.0 against 46.1, 56.2 against 55.2, 116.1 against 70.7 with eight such rows).
# Random patterns' splits (rows of 7-14 blocks) cost 3-7 us per call. split_pays keeps the stored splits where the
# longest row has at least the SPLIT_MIN_COLS columns of the call's N class; elsewhere the call runs the same items
# unsplit. In-sample: 18 patterns.
SPLIT_MIN_COLS = ((256, 2048), (1024, 4096), (None, 8192))  # (N up to, or None: any N; least columns of blocks)
SPLIT_ENV = "PRUNEKIT_BSR_SPLIT"  # "1": the stored splits at every N; "0": never; unset / "auto": split_pays
_UNSPLIT_ATTR = "_prunekit_bsr_unsplit"  # on crow_indices (tensor_cache.cached): (longest row, unsplit schedule)
CSLT_SOURCES = ("cslt/cslt_mm.cpp",)
CSLT_BACKEND_ENV = "PRUNEKIT_CSLT_BACKEND"  # "torch" forces torch._cslt_sparse_mm instead of prunekit's own binding
CSLT_OUTPUT_ENV = "PRUNEKIT_CSLT_OUTPUT"  # the binding's output layout: "row", "col" or "view" (CSLT_OUTPUTS)
# prunekit_cslt::linear's `output` argument (csrc/structured/cslt/cslt_mm.cpp): "col" cuSPARSELt writes the layout
# rule's Y directly; "row" it writes a row-major Y, then the rule's transposing copy; "view" the row-major Y is
# returned as it is (no copy: the layer's output is then a non-contiguous (tokens, out_features) view, as torch's own
# 2:4 F.linear returns; it breaks the layout rule, so the custom op never takes it).
CSLT_OUTPUTS = {"col": 0, "row": 1, "view": 2}
# Row-major output measured faster on the H100 at 10 of 12 points (1.9x at 16384 x 16384 x 8192, 2x at decode shapes;
# col faster only at N = 128 on 768 x 3072 and 3072 x 768): benchmarks/results/nm-h100-2026-11-25.json.
CSLT_DEFAULT_OUTPUT = "row"
# SparseLinear's eager 2:4 calls: the transposing copy took 1.0 ms of 5.0 at 16384 x 16384 x 8192 and 0.18 of 0.36 at
# 11008 x 4096 x 2048 (benchmarks/results/nm-configs-h100-2026-11-26-s16.json, `copy_t`), so the layer returns the
# view.
CSLT_LAYER_DEFAULT_OUTPUT = "view"
# The C++ eager entries (prunekit_structured::bsr_mm, prunekit_cslt::linear) passed their H100 tests (2026-11-25) and
# cost 13-23 us less per decode-shaped call than the custom-op path (bsr-h100-2026-11-25.json: static_eager_ms vs
# static_op_eager_ms): CUDA calls take them unless $PRUNEKIT_STRUCTURED_CPP=0.
EAGER_CPP_ENV = "PRUNEKIT_STRUCTURED_CPP"
EAGER_CPP_DEFAULT = True
CUSPARSELT_DIR_ENV = "PRUNEKIT_CUSPARSELT_DIR"  # folder holding include/cusparseLt.h and lib/libcusparseLt.so.0
CSLT_ALIGN_N = 16  # cuSPARSELt's dense operand: N padded to a multiple of 16 (torch pads the same way)
CSLT_ALIGN_MK = (32, 64)  # M and K the 2:4 path takes (cuSPARSELt fp16/bf16 structured-operand alignment)

__all__ = [
    "bsr_mm",
    "bsr_mm_static",
    "nm_mm_cuda",
    "bsr_mm_cuda",
    "bsr_variant",
    "load",
    "is_loaded",
    "kernel_supports_bsr",
    "wgmma_available",
]

_SM_COUNT: dict[int, int] = {}


EXTENSION = build.Extension(
    namespace=NAMESPACE,
    prefix=NAMESPACE,
    csrc_dir=CSRC_DIR,
    sources=SOURCES,
    headers=HEADERS,
    probe="bsr_mm_out",
    description="structured-sparse CUDA kernels",
    cuda_cflags=("-O3", "-lineinfo", "--expt-relaxed-constexpr"),
    arch_specific=True,  # sm_90a: the wgmma + TMA BSR variant (bsr_mm_wgmma*.cu)
)


def is_loaded() -> bool:
    """True when the ``prunekit_structured`` operators are registered in this process."""
    return build.extension_loaded(EXTENSION)


def load(verbose: bool = False) -> Path | None:
    """Make the ``prunekit_structured`` operators available, compiling them on first use (about a minute).

    Returns:
        Path of the loaded library, or None when another copy registered the operators first.

    Raises:
        KernelUnavailable: no CUDA torch, no GPU of sm_80 or newer, no nvcc/ninja, or the compilation failed.
    """
    return build.load_extension(EXTENSION, verbose)


def _check_activation(activation: str) -> None:
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; known: {', '.join(reference.ACTIVATIONS)}")


def kernel_supports_bsr(blocks: torch.Tensor, x: torch.Tensor) -> bool:
    """True when the tensor-core kernel takes these blocks and X (else the CUDA op runs the reference on the GPU)."""
    return (
        blocks.dim() == 3
        and int(blocks.shape[1]) in KERNEL_BLOCK_SIZES
        and int(blocks.shape[2]) in KERNEL_BLOCK_SIZES
        and x.dtype in KERNEL_DTYPES
        and blocks.dtype == x.dtype
    )


def plan_tile_n(m: int, r: int, n: int, num_sms: int = 132, nblocks: int | None = None) -> int:
    """N tile (32, 128 or 256) of the BSR kernel for ``M = m``, block rows of ``r``, ``N = n`` and ``nblocks`` stored
    blocks (the H100 sweep in docs/PERFORMANCE_STRUCTURED.md).

    ``n <= DECODE_MAX_N``: 32. Otherwise 256 when that still gives at least two CTAs per SM (``M / r`` block rows
    times the N tiles), since a wider tile re-reads each A block fewer times; except for 64-row blocks with fewer than
    :data:`WIDE_TILE_MIN_BLOCKS_PER_ROW` blocks per block row on average, where the shorter CTAs of the 128 tile won
    (by 3-7% in the sweep); else 128. ``csrc/structured/bsr_mm.cu`` ``plan_tile_n`` is the same rule for the eager
    C++ entry (a CUDA test compares them).
    """
    if n <= DECODE_MAX_N:
        return 32
    rows = max(1, m // r)
    if r == 64 and nblocks is not None and nblocks / rows < WIDE_TILE_MIN_BLOCKS_PER_ROW:
        return 128
    return 256 if rows * -(-n // 256) >= 2 * num_sms else 128


def plan_tile_n_wgmma(m: int, r: int, n: int, num_sms: int = 132, nblocks: int | None = None) -> int:
    """N tile (128 or 256) of the wgmma variant for ``M = m``, block rows of ``r``, ``N = n`` and ``nblocks`` stored
    blocks: 256 (two consumer warpgroups sharing each A block) when ``n > 128`` and that still gives every SM a CTA,
    else 128; except for 64-row blocks with fewer than :data:`WIDE_TILE_MIN_BLOCKS_PER_ROW` blocks per block row on
    average: 128, whose smaller CTAs fit two to an SM. On the H100 (fp16, 90 / 95%,
    benchmarks/results/bsr-h100-2026-11-26-s26e.json and bsr-xslabs64-h100-2026-11-26-s26f.json) the 128 tile took
    0.84-1.00x of the 256 tile's time at all 12 points with 3.0-6.8 blocks per row (11008 x 4096 at 95%, N = 2048:
    46.1 against 53.2 us), and 1.07-1.22x at the 6 points with 12.6-25.6. 16- and 32-row blocks: the 128 tile took
    0.96-1.22x of the 256 tile's time, at least 1.00x at 114 of 116 points (all ``-s26`` files); but 32-row blocks in
    :func:`short_rows` take 128, which the launcher runs with 3 stages (three CTAs per SM).
    ``csrc/structured/bsr_mm.cu`` ``plan_tile_n_wgmma`` is the same rule for the eager C++ entry (a CUDA test
    compares them).
    """
    rows = max(1, m // r)
    if r == 64 and nblocks is not None and nblocks / rows < WIDE_TILE_MIN_BLOCKS_PER_ROW:
        return 128
    if r == 32 and nblocks is not None and short_rows(m, r, nblocks):
        return 128
    return 256 if n > 128 and rows * -(-n // 256) >= num_sms else 128


def short_rows(m: int, r: int, nblocks: int) -> bool:
    """Whether a BSR weight of ``M = m`` rows in blocks of ``r`` rows with ``nblocks`` stored blocks (dynamic mode: the
    declared maximum) has short block rows: at most :data:`SHORT_ROWS_MAX_BLOCKS_PER_ROW` blocks per block row on
    average. There each CTA of the wgmma kernel has a block or two to multiply and its time is mostly latency, so
    32-row blocks take the 128 N tile (:func:`plan_tile_n_wgmma`) and the C++ launcher gives them 3 pipeline stages,
    three CTAs per SM instead of two (``$PRUNEKIT_BSR_STAGES`` overrides it). ``csrc/structured/bsr_mm_wgmma.cu``
    ``short_rows`` is the same rule, with the figures it rests on (H100, fp16, 3072 x 768 at N = 2048 / 4096:
    0.88-0.91x of the time at 1.1-2.4 blocks per row; 1.13x at 6.4 blocks per row on 11008 x 4096)."""
    return r > 0 and nblocks <= SHORT_ROWS_MAX_BLOCKS_PER_ROW * max(1, m // r)


def warp_producer_rule(m: int, r: int, n: int, nblocks: int, tile_n: int, num_sms: int) -> bool:
    """Whether the wgmma kernel for 64-row blocks runs with a producer warp (``$PRUNEKIT_BSR_WARP_PRODUCER`` unset):
    ``r == 64``, :func:`short_rows`, and a launch of ``M / 64 * ceil(N / tile_n)`` CTAs that gives every SM at least
    :data:`WARP_PRODUCER_MIN_CTAS_PER_SM` of them per stored block per block row (and at least that many where rows
    hold fewer than one block). There the kernel's two stages fit four CTAs per SM instead of two, and empty block rows
    skip the pipeline. ``csrc/structured/bsr_mm_wgmma.cu`` ``warp_producer_rule`` is the same rule, with the figures it
    rests on (H100 and H200, fp16, against the producer warpgroup in the same runs: 0.80-0.99x of the time at 25 of the
    26 points where it holds; a loss at 13 of the 16 short-row points where it fails, and at all 63 with longer rows).
    In-sample; a CUDA test checks that both sides agree.

    Args:
        m: M; r: block rows; n: N (tokens); nblocks: stored blocks (dynamic mode: the declared maximum); tile_n: the
            N tile (:func:`plan_tile_n_wgmma`); num_sms: SMs of the GPU.
    """
    if r != 64 or tile_n <= 0 or num_sms <= 0 or not short_rows(m, r, nblocks):
        return False
    rows = max(1, m // r)
    ctas = rows * -(-n // tile_n)
    return ctas * rows >= WARP_PRODUCER_MIN_CTAS_PER_SM * num_sms * max(rows, nblocks)


def warp_tile_n_rule(m: int, r: int, nblocks: int) -> bool:
    """Whether the wgmma kernel for 64-row blocks, where it runs with a producer warp (:func:`warp_producer_rule`) on
    the 128 N tile, takes consumers of 64 tokens instead (``$PRUNEKIT_BSR_WARP_TILE_N`` unset): ``r == 64`` and at most
    1.5 stored blocks per block row (``nblocks``; dynamic mode: the declared maximum). Six CTAs then fit an SM instead
    of four. ``csrc/structured/bsr_mm_wgmma.cu`` ``warp_tile_n_rule`` is the same rule, with its figures (H100, fp16:
    0.90-0.99x of the time at all 10 points with 0.1-1.35 blocks per row, slower at the short rows with 2.4-3.6).
    In-sample; a CUDA test checks that both sides agree."""
    return r == 64 and 2 * nblocks <= 3 * max(1, m // r)


def bsr_variant(variant: str | None = None) -> str:
    """The BSR kernel variant to use: ``variant``, else ``$PRUNEKIT_BSR_VARIANT``, else ``"auto"``.

    Raises:
        ValueError: an unknown name.
    """
    return build.setting(variant, BSR_VARIANT_ENV, "auto", VARIANTS, "BSR kernel variant")


def x_slabs_rule(r: int, c: int, k: int, nblocks: int, n: int) -> bool:
    """Whether the wgmma kernel for ``r x c`` blocks (r in {16, 32}) reads X through its per-call X-slab copy when
    ``$PRUNEKIT_BSR_XSLABS`` is unset: ``nblocks * c >= min_reuse * K`` (each slab read at least ``min_reuse`` times),
    ``min_reuse`` from :data:`XSLABS_MIN_REUSE` at ``n >= XSLABS_SMALL_N``, else :data:`XSLABS_MIN_REUSE_SMALL_N`. The
    same rule as the C++ launcher's (a CUDA test compares them); figures at :data:`XSLABS_SMALL_N`.

    Args:
        r, c: block rows and columns; k: K (in_features); nblocks: stored blocks (dynamic mode: the declared maximum);
            n: N (tokens) of the call.
    """
    if r not in XSLABS_MIN_REUSE or k <= 0:
        return False
    min_reuse = XSLABS_MIN_REUSE_SMALL_N if n < XSLABS_SMALL_N else XSLABS_MIN_REUSE[r]
    return nblocks * c >= min_reuse * k


def wgmma_supports(blocks: torch.Tensor) -> bool:
    """True when the wgmma variant takes this block shape (:data:`WGMMA_BLOCKS`: r and c in {16, 32, 64})."""
    return blocks.dim() == 3 and (int(blocks.shape[1]), int(blocks.shape[2])) in WGMMA_BLOCKS


def wgmma_available() -> bool:
    """True when the loaded library holds the sm_90a wgmma kernels and the current GPU is sm_90 (one probe launch and
    host sync per process, on first use). False without a GPU or library."""
    if not torch.cuda.is_available():
        return False
    try:
        if not is_loaded():
            load()
    except KernelUnavailable:
        return False
    return bool(torch.ops.prunekit_structured.wgmma_available())


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _k_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x: (K, N)`` with ``x[k, n]`` at ``n * ld + k``, ``ld % 8 == 0`` and 16-byte alignment (a copy if needed)."""
    if x.stride(0) == 1 and x.stride(1) % 8 == 0 and x.data_ptr() % 16 == 0 and x.stride(1) >= x.shape[0]:
        return x
    return x.t().contiguous().t()


def bsr_mm_cuda(
    blocks: torch.Tensor,
    crow_indices: torch.Tensor,
    col_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    schedule: torch.Tensor | None = None,
    split_rows: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    tile_n: int | None = None,
    staged_epilogue: bool = True,
    variant: str | None = None,
) -> torch.Tensor:
    """CUDA BSR matmul ``Y (M, N) = act(A @ X + bias[:, None])`` (PopSparse, Li et al. 2023), fp32 accumulation.

    Args:
        blocks: ``(nblocks_capacity, r, c)`` fp16/bf16, r and c in {16, 32, 64} (others run the reference);
            crow_indices: ``(M / r + 1,)`` int32; col_indices: ``(nblocks_capacity,)`` int32 (entries past
            ``crow_indices[-1]`` are never read: the dynamic mode's declared maximum); x: ``(K, N)``, any strides
            (the K-contiguous ``x2d.t()`` is read in place, others are copied once); m: M; bias: ``(M,)`` or None;
            activation: ``"none"`` or ``"relu"``; schedule / split_rows: the static schedule of ``formats/bsr.py``
            (None: dynamic mode); out: optional ``(M, N)`` output to write into (any strides); tile_n: force the
            kernel's N tile (32, 128 or 256; wgmma: 128 or 256; default :func:`plan_tile_n` /
            :func:`plan_tile_n_wgmma`); staged_epilogue: write the output tile through shared memory with 16-byte
            stores (default) rather than element by element; variant: ``"auto"`` (wgmma where
            :func:`auto_takes_wgmma`, else mma), ``"mma"`` (mma.sync, ``bsr_mm.cuh``) or ``"wgmma"`` (sm_90a wgmma +
            TMA, ``bsr_mm_wgmma.cu``, blocks of 16, 32 or 64 rows and columns); default :func:`bsr_variant` (a
            ``"wgmma"`` that comes from ``$PRUNEKIT_BSR_VARIANT`` falls back to ``"mma"``, with one warning, where it
            does not apply).

    Returns:
        ``Y (M, N)`` in ``x.dtype``, laid out by ``layout.new_spmm_output`` (column-major for ``x2d.t()``).

    Raises:
        KernelUnavailable: no GPU/compiler, or an explicit ``variant="wgmma"`` without an sm_90a build on an sm_90
            GPU.
        ValueError: bad activation, shapes or variant, an explicit ``"wgmma"`` for a block shape it does not take,
            or a wgmma ``tile_n`` other than 128 / 256.
    """
    _check_activation(activation)
    explicit_variant = variant is not None
    variant = bsr_variant(variant)
    if x.dim() != 2 or blocks.dim() != 3:
        raise ValueError(f"x must be (K, N) and blocks (nblocks, r, c), got {tuple(x.shape)}, {tuple(blocks.shape)}")
    if not kernel_supports_bsr(blocks, x) or x.shape[0] == 0:
        y = as_spmm_output(reference.bsr_mm(blocks, crow_indices, col_indices, x, m, bias, activation), x)
        if out is not None:
            out.copy_(y)
            return out
        return y
    if not is_loaded():
        load()
    if variant == "wgmma":
        variant = _wgmma_or_fallback(blocks, tile_n, explicit_variant)
    elif variant == "auto" and auto_takes_wgmma(blocks, tile_n, x.shape[1]):
        variant = "wgmma"
    r, c = blocks.shape[1], blocks.shape[2]
    if m % r or x.shape[0] % c or crow_indices.numel() != m // r + 1:
        raise ValueError(f"bsr_mm: M={m}, K={x.shape[0]} and crow_indices do not match blocks of {r}x{c}")
    y = new_spmm_output(x, m) if out is None else out
    if y.shape != (m, x.shape[1]) or y.dtype != x.dtype:
        raise ValueError(f"out must be a ({m}, {x.shape[1]}) {x.dtype} tensor")
    n = x.shape[1]
    if m == 0 or n == 0:
        return y
    if not blocks.is_contiguous() or blocks.data_ptr() % 16:
        blocks = blocks.contiguous().clone()
    if bias is not None and (bias.dtype is not x.dtype or not bias.is_contiguous()):
        bias = bias.to(dtype=x.dtype).contiguous()
    if tile_n is None:
        if variant == "wgmma":
            tile_n = plan_tile_n_wgmma(m, r, n, _sm_count(x.device), blocks.shape[0])
        else:
            tile_n = plan_tile_n(m, r, n, _sm_count(x.device), blocks.shape[0])
    torch.ops.prunekit_structured.bsr_mm_out.default(
        blocks,
        _int32(crow_indices),
        _int32(col_indices),
        None if schedule is None else _int32(schedule),
        None if split_rows is None else _int32(split_rows),
        _k_contiguous(x),
        y,
        bias,
        activation == "relu",
        tile_n,
        staged_epilogue,
        VARIANTS[variant],
    )
    return y


_wgmma_fallback_warned: set[tuple[int, int]] = set()  # block shapes already warned about (once per process)


def auto_takes_wgmma(blocks: torch.Tensor, tile_n: int | None = None, n: int | None = None) -> bool:
    """Whether ``"auto"`` runs the wgmma variant for a call with ``n`` tokens (None: whatever N): on an sm_90 GPU with
    an sm_90a build, for blocks of :data:`AUTO_WGMMA_ROWS` rows, and for 16-row blocks at ``n >=``
    :data:`AUTO_WGMMA_16_MIN_N`, unless a ``tile_n`` only the mma.sync kernels have (32) is forced. Measured on
    the H100: 64-row blocks (benchmarks/results/bsr-h100-2026-11-25.json, block 64 x 64, 50/90/95% sparsity, 5 shapes)
    faster than mma.sync at 14 of 15 points (1.3-2.1x at N >= 2048), 20% slower at 11008 x 4096, N = 16, 50%; 16- and
    32-row blocks: the figures at :data:`AUTO_WGMMA_ROWS`."""
    global _wgmma_state
    if not wgmma_supports(blocks) or (tile_n is not None and tile_n not in WGMMA_TILE_NS):
        return False
    r = int(blocks.shape[1])
    if r not in AUTO_WGMMA_ROWS and not (r == 16 and n is not None and n >= AUTO_WGMMA_16_MIN_N):
        return False
    if _wgmma_state is None:
        _wgmma_state = wgmma_available()
    return _wgmma_state


def _wgmma_or_fallback(blocks: torch.Tensor, tile_n: int | None, explicit: bool) -> str:
    """``"wgmma"`` when that variant takes ``blocks`` on this GPU/build, else ``"mma"`` with one warning per block
    shape when the variant only came from ``$PRUNEKIT_BSR_VARIANT`` (like :func:`eager_bsr_variant`: a process-wide
    default must not break layers whose blocks the variant does not take). An explicit ``variant="wgmma"`` raises.

    Raises:
        ValueError: explicit ``"wgmma"`` for a block shape it does not take, or a ``tile_n`` not in
            :data:`WGMMA_TILE_NS`. KernelUnavailable: explicit ``"wgmma"`` without an sm_90a build on an sm_90 GPU.
    """
    if not wgmma_supports(blocks):
        if explicit:
            raise ValueError(f"the wgmma variant takes blocks of {WGMMA_BLOCKS}, got {tuple(blocks.shape[1:])}")
        problem = f"blocks {tuple(blocks.shape[1:])}"
    elif not wgmma_available():
        if explicit:
            raise KernelUnavailable("the wgmma BSR variant needs an sm_90 GPU and a library built for sm_90a")
        problem = "this GPU/build"
    else:
        if tile_n is not None and tile_n not in WGMMA_TILE_NS:
            raise ValueError(f"the wgmma variant's tile_n is one of {WGMMA_TILE_NS}, got {tile_n}")
        return "wgmma"
    shape = (int(blocks.shape[1]), int(blocks.shape[2]))
    if shape not in _wgmma_fallback_warned:
        _wgmma_fallback_warned.add(shape)
        log.warning("$%s=wgmma does not apply to %s; using mma", BSR_VARIANT_ENV, problem)
    return "mma"


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


# --- 2:4 through cuSPARSELt -------------------------------------------------------------------------------------

_CACHE_ATTR = "_prunekit_cslt_packed"  # on the stored values tensor (tensor_cache.cached)
compress_calls = 0  # cuSPARSELt compressions done in this process (benchmarks check it stays flat while timing)


def cusparselt_available() -> bool:
    """True when this torch has cuSPARSELt and a GPU of sm_80 or newer is visible."""
    try:
        ok = bool(torch.backends.cusparselt.is_available())
    except AttributeError:
        return False
    return ok and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def _decode_nm_dense(values: torch.Tensor, metadata: torch.Tensor, n: int, m_group: int, bits: int, k: int):
    cols = reference.nm_columns(metadata, n, m_group, bits, k)
    dense = torch.zeros(values.shape[0], k, dtype=values.dtype, device=values.device)
    return dense.scatter_(1, cols, values)


_native_state: bool | None = None  # None: not tried yet
_NATIVE_ATTR = "_prunekit_cslt_native"


def cusparselt_dir() -> Path | None:
    """Folder of the cuSPARSELt wheel torch uses (``include/cusparseLt.h``, ``lib/libcusparseLt.so.0``), or None."""
    import importlib.util
    import sys

    candidates = [Path(os.environ[CUSPARSELT_DIR_ENV])] if os.environ.get(CUSPARSELT_DIR_ENV) else []
    try:
        spec = importlib.util.find_spec("nvidia.cusparselt")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) for p in spec.submodule_search_locations]
    candidates += [Path(p) / "nvidia" / "cusparselt" for p in sys.path if p]
    for folder in candidates:
        if (folder / "include" / "cusparseLt.h").is_file() and (folder / "lib" / "libcusparseLt.so.0").is_file():
            return folder
    return None


def load_cslt(verbose: bool = False) -> None:
    """Build (once per key) and load prunekit's cuSPARSELt binding, the ``prunekit_cslt`` operators.

    Raises:
        KernelUnavailable: no GPU/compiler, no cuSPARSELt headers and library, or the build failed.
    """
    try:
        torch.ops.prunekit_cslt.mm  # noqa: B018
        return
    except (AttributeError, RuntimeError):
        pass
    if build.unavailable_reason() is not None:
        raise KernelUnavailable(f"prunekit's cuSPARSELt binding is unavailable: {build.unavailable_reason()}.")
    folder = cusparselt_dir()
    if folder is None:
        raise KernelUnavailable(
            f"prunekit's cuSPARSELt binding needs the nvidia-cusparselt wheel (or ${CUSPARSELT_DIR_ENV}) with "
            "include/cusparseLt.h and lib/libcusparseLt.so.0."
        )
    build.load_extension(cslt_extension(folder), verbose)


def cslt_extension(folder: Path) -> build.Extension:
    """The cuSPARSELt binding's library spec, linked against ``folder/lib/libcusparseLt.so.0`` by rpath (so it is
    never shipped prebuilt)."""
    lib = folder / "lib"
    return build.Extension(
        namespace="prunekit_cslt",
        prefix="prunekit_cslt",
        csrc_dir=CSRC_DIR,
        sources=CSLT_SOURCES,
        headers=("../check.h",),
        probe="mm",
        description="cuSPARSELt binding",
        include_paths=(str(folder / "include"),),
        ldflags=(f"-L{lib}", "-l:libcusparseLt.so.0", f"-Wl,-rpath,{lib}"),
        gencode=False,
        prebuilt=False,
        key_extra=str(folder),
    )


def cslt_extension_here() -> build.Extension | None:
    """The cuSPARSELt binding's library spec (:func:`cslt_extension`) where this torch has cuSPARSELt and its wheel's
    header and library are found (:func:`cusparselt_dir`), else None."""
    folder = cusparselt_dir()
    return cslt_extension(folder) if folder is not None and cusparselt_available() else None


def native_cslt_available() -> bool:
    """True when prunekit's own cuSPARSELt binding loads (tried once per process; ``$PRUNEKIT_CSLT_BACKEND=torch``
    turns it off)."""
    global _native_state
    if os.environ.get(CSLT_BACKEND_ENV) == "torch":
        return False
    if _native_state is None:
        try:
            load_cslt()
            _native_state = True
            from . import cslt_tune

            cslt_tune.apply_staged()  # a loaded package's configuration ids searched at export
        except KernelUnavailable as exc:
            log.warning("2:4 matmul falls back to torch._cslt_sparse_mm: %s", exc)
            _native_state = False
    return _native_state


class _NativeWeight:
    """A weight registered with the binding (compressed once); released with the stored tensor."""

    def __init__(self, dense: torch.Tensor, version: int, data_ptr: int):
        self.id = int(torch.ops.prunekit_cslt.prepare(dense))
        self.version, self.data_ptr = version, data_ptr

    def __del__(self) -> None:
        try:
            torch.ops.prunekit_cslt.release(self.id)
        except Exception:  # interpreter shutdown: the registry is going away anyway
            pass


def native_weight_24(values: torch.Tensor, metadata: torch.Tensor, bits: int, k: int) -> _NativeWeight:
    """The binding's compressed copy of a stored 2:4 weight, built once and kept on ``values`` (rebuilt only when
    ``values`` was modified in place or moved)."""
    global compress_calls
    state = getattr(values, _NATIVE_ATTR, None)
    if state is not None and state.version == tensor_version(values) and state.data_ptr == values.data_ptr():
        return state
    state = _NativeWeight(_decode_nm_dense(values, metadata, 2, 4, bits, k), tensor_version(values), values.data_ptr())
    compress_calls += 1
    setattr(values, _NATIVE_ATTR, state)
    return state


def compressed_24(values: torch.Tensor, metadata: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """cuSPARSELt-compressed copy of a stored 2:4 weight, built once per tensor.

    The copy is kept as an attribute of ``values`` itself (so it lives and dies with the stored weight) and rebuilt
    only when ``values`` was modified in place or moved.
    """

    def build() -> torch.Tensor:
        global compress_calls
        compress_calls += 1
        return torch._cslt_compress(_decode_nm_dense(values, metadata, 2, 4, bits, k))

    return cached(values, _CACHE_ATTR, (values,), (), build)


def cslt_output(output: str | None = None, default: str = CSLT_DEFAULT_OUTPUT) -> str:
    """The binding's output layout (:data:`CSLT_OUTPUTS`): ``output``, else ``$PRUNEKIT_CSLT_OUTPUT``, else
    ``default``.

    Raises:
        ValueError: not ``"row"``, ``"col"`` or ``"view"``.
    """
    return build.setting(output, CSLT_OUTPUT_ENV, default, tuple(CSLT_OUTPUTS), "cuSPARSELt output layout")


def _nm24_native(values, metadata, x, bits, bias, activation, output) -> torch.Tensor:
    state = native_weight_24(values, metadata, bits, x.shape[0])
    return torch.ops.prunekit_cslt.linear.default(state.id, x, bias, activation == "relu", CSLT_OUTPUTS[output])


def nm24_fast(values: torch.Tensor, x: torch.Tensor, n: int, m_group: int) -> bool:
    """True when a 2:4 weight ``values`` and ``x`` take the cuSPARSELt path (fp16/bf16, one dtype, ``M % 32 == 0``,
    ``K % 64 == 0``, cuSPARSELt present)."""
    k = x.shape[0]
    return (
        (n, m_group) == (2, 4)
        and x.dtype in KERNEL_DTYPES
        and values.dtype == x.dtype
        and values.shape[0] % CSLT_ALIGN_MK[0] == 0
        and k % CSLT_ALIGN_MK[1] == 0
        and values.shape[0] > 0
        and cusparselt_available()
    )


def nm_mm_cuda(
    values: torch.Tensor,
    metadata: torch.Tensor,
    x: torch.Tensor,
    n: int,
    m_group: int,
    bits: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    backend: str = "auto",
    output: str | None = None,
) -> torch.Tensor:
    """CUDA N:M matmul ``Y (M, N) = act(A @ X + bias[:, None])`` (2:4: NVIDIA, Mishra et al. 2021).

    At decode shapes (1 <= N <= 16) 2:4 fp16/bf16 weights run on prunekit's own kernel (``kernels/nm24.py``: a
    repacked copy of the weight streamed into the sparse tensor cores, ``mma.sp``). Otherwise
    2:4 fp16/bf16 weights with ``M % 32 == 0`` and ``K % 64 == 0`` run on the sparse tensor cores through cuSPARSELt:
    by default prunekit's own binding (``csrc/structured/cslt/``: weight compressed once, one plan per N and layout,
    so a call is one ``cusparseLtMatmul`` with bias and ReLU fused), else (``backend="torch"`` or no binding)
    ``torch._cslt_sparse_mm`` on a compressed copy cached on ``values`` (torch sets the plan up on every call).
    The binding's configuration id: the one a loaded package stored for the product (searched at export,
    ``kernels/cslt_tune.py``), else at N >= 128 and a row-major output its own search's on the first call
    (``$PRUNEKIT_CSLT_TUNE``, docs/ENVIRONMENT.md), else cuSPARSELt's default selection; torch's path always takes the
    default (cuSPARSELt's own search failed with an internal error on the H100, torch 2.11).
    N is padded to a multiple of 16
    (a copy of X for such N only). Anything else runs the reference on the GPU.

    Args:
        values: ``(M, K / m_group * n)``; metadata: packed in-group indices (uint8, ``formats/nm.py``);
            x: ``(K, N)`` any strides; n, m_group, bits: the pattern; bias: ``(M,)`` or None; activation: none|relu;
            backend: ``"auto"`` (decode kernel at N <= 16, else own binding when it loads), ``"cslt"`` (own
            binding, never the decode kernel), ``"torch"`` (``torch._cslt_sparse_mm``) or ``"decode"`` (the decode
            kernel where it applies, else as ``"auto"``); output: the binding's output layout,
            ``"row"`` (cuSPARSELt's faster configuration on the H100, then the layout rule's transposing copy),
            ``"col"`` (measured, 2.4x slower device time) or ``"view"`` (the row-major Y, no copy); default
            :func:`cslt_output`.

    Returns:
        ``Y (M, N)`` in ``x.dtype``, laid out by ``layout.new_spmm_output``; with ``output="view"`` on the binding's
        path a row-major ``(M, N)`` (the custom op never asks for it).

    Raises:
        ValueError: bad activation, backend or output layout.
    """
    _check_activation(activation)
    k, n_cols = x.shape
    if backend not in ("auto", "cslt", "torch", "decode"):
        raise ValueError(f"2:4 backend must be 'auto', 'cslt', 'torch' or 'decode', got {backend!r}")
    if backend in ("auto", "decode") and nm24.decode_takes(values, x, n, m_group) and nm24.available():
        return nm24.decode_mm(values, metadata, x, bits, bias, activation)
    if not (n_cols > 0 and nm24_fast(values, x, n, m_group)):
        return as_spmm_output(reference.nm_mm(values, metadata, x, n, m_group, bits, bias, activation), x)
    transposed = x.stride(0) == 1 and n_cols > 1
    n_pad = -(-n_cols // CSLT_ALIGN_N) * CSLT_ALIGN_N
    if bias is not None and (bias.dtype is not x.dtype or not bias.is_contiguous()):
        bias = bias.to(dtype=x.dtype).contiguous()
    if backend != "torch" and native_cslt_available():
        try:
            return _nm24_native(values, metadata, x, bits, bias, activation, cslt_output(output))
        except RuntimeError as exc:  # a cuSPARSELt error: report once, then use torch's path for good
            global _native_state
            _native_state = False
            log.warning("prunekit's cuSPARSELt binding failed (%s); using torch._cslt_sparse_mm", exc)
    packed = compressed_24(values, metadata, bits, k)
    if transposed:
        x2d = x.t()
        if n_pad != n_cols or not x2d.is_contiguous():
            buf = x2d.new_zeros(n_pad, k)
            buf[:n_cols] = x2d
            x2d = buf
        dense_b = x2d.t()
    else:
        dense_b = x
        if n_pad != n_cols or not x.is_contiguous():
            dense_b = x.new_zeros(k, n_pad)
            dense_b[:, :n_cols] = x
    res = torch._cslt_sparse_mm(packed, dense_b, bias=bias, transpose_result=transposed)
    if activation == "relu":
        res.relu_()
    if transposed:  # res: (n_pad, M) row-major
        res = res[:n_cols] if n_pad != n_cols else res
        return res.t()
    return as_spmm_output(res[:, :n_cols] if n_pad != n_cols else res, x)


# --- eager entries: one C++ operator call per layer call -----------------------------------------------------------

_wgmma_state: bool | None = None  # wgmma_available(), asked once


def eager_cpp_enabled() -> bool:
    """Whether CUDA calls take the C++ eager entries: ``$PRUNEKIT_STRUCTURED_CPP`` (``1``/``0``), else
    :data:`EAGER_CPP_DEFAULT` (True since their H100 run)."""
    env = os.environ.get(EAGER_CPP_ENV)
    return EAGER_CPP_DEFAULT if env is None else env.strip() not in ("", "0", "false", "False")


def eager_bsr_variant(blocks: torch.Tensor, x: torch.Tensor, variant: str | None = None) -> int | None:
    """Variant number (:data:`VARIANTS`) for the C++ eager entry ``prunekit_structured::bsr_mm`` when the tensor-core
    kernels take ``blocks`` and ``x`` (loading the library on first use), or None when :func:`bsr_mm_cuda` must run
    (reference shapes/dtypes, empty K, or :func:`eager_cpp_enabled` False). The runtime asks once per layer and dtype;
    ``"auto"`` is resolved here, except for 16-row blocks where the wgmma variant is available: their rule depends on
    N, so the C++ entry resolves it per call (:func:`auto_takes_wgmma`). ``"wgmma"`` falls back to ``"mma"`` (with a
    warning) for block shapes or GPUs it does not take.

    Raises:
        KernelUnavailable: no GPU/compiler. ValueError: an unknown variant name.
    """
    global _wgmma_state
    name = bsr_variant(variant)
    if not eager_cpp_enabled() or not kernel_supports_bsr(blocks, x) or x.dim() != 2 or x.shape[0] == 0:
        return None
    if not is_loaded():
        load()
    if name == "auto":
        if auto_takes_wgmma(blocks):
            return VARIANTS["wgmma"]
        # 16-row blocks: the C++ entry resolves "auto" per call, by N (the same rule as auto_takes_wgmma)
        return VARIANTS["auto"] if auto_takes_wgmma(blocks, n=AUTO_WGMMA_16_MIN_N) else VARIANTS["mma"]
    if name == "wgmma":
        if _wgmma_state is None:
            _wgmma_state = wgmma_available()
        if not (_wgmma_state and wgmma_supports(blocks)):
            log.warning("wgmma BSR variant unavailable for blocks %s on this GPU/build; using mma", tuple(blocks.shape))
            name = "mma"
    return VARIANTS[name]


def bsr_mm_entry() -> Callable[..., torch.Tensor]:
    """The C++ eager entry ``prunekit_structured::bsr_mm`` (:func:`fastcall.entry`'s function, else its ``OpOverload``;
    the library is loaded on first use), for callers that keep it: the runtime's ``SparseLinear`` holds it in its
    per-layer plan, sparing the argument parsing and attribute lookups on every call.

    Raises:
        KernelUnavailable: no GPU/compiler."""
    if not is_loaded():
        load()
    return fastcall.entry("bsr_mm")


def lean_max_n(r: int, c: int) -> int:
    """The most tokens per call the lean BSR decode kernel takes for ``r x c`` blocks (csrc/structured/
    bsr_decode_lean.cu, ``lean_max_n``, the same rule): ``$PRUNEKIT_BSR_LEAN_MAX_N`` (16 or 32), else
    :data:`LEAN_MAX_N` (32) for blocks of at most :data:`LEAN_WIDE_MAX_ROWS` rows and :data:`LEAN_NARROW_MAX_N` (16)
    for taller ones (measured, see the constants). ``c`` does not enter the rule (square blocks were measured).

    Raises:
        ValueError: ``$PRUNEKIT_BSR_LEAN_MAX_N`` other than unset, empty, ``auto``, ``16`` or ``32``.
    """
    setting = os.environ.get(LEAN_MAX_N_ENV, "")
    if setting in ("", "auto"):
        return LEAN_MAX_N if r <= LEAN_WIDE_MAX_ROWS else LEAN_NARROW_MAX_N
    if setting not in ("16", "32"):
        raise ValueError(f"${LEAN_MAX_N_ENV} must be auto, 16 or 32, got {setting!r}")
    return int(setting)


def lean_takes(blocks: torch.Tensor, n: int) -> bool:
    """Whether the lean BSR decode kernel takes a call with ``n`` tokens (csrc/structured/bsr_decode_lean.cu,
    ``bsr_lean_run``, the same rule): ``$PRUNEKIT_BSR_LEAN`` not ``0`` (unset, empty or ``1``: on; another value
    raises in the kernel), ``1 <= n <=`` :func:`lean_max_n`, fp16/bf16 blocks of ``r x c`` with r and c in
    (16, 32, 64).

    Args:
        blocks: ``(nblocks, r, c)``; n: N (tokens) of the call.
    """
    return (
        os.environ.get(LEAN_ENV) != "0"
        and blocks.dim() == 3
        and 1 <= n <= lean_max_n(blocks.shape[1], blocks.shape[2])
        and blocks.dtype in (torch.float16, torch.bfloat16)
        and blocks.shape[1] in KERNEL_BLOCK_SIZES
        and blocks.shape[2] in KERNEL_BLOCK_SIZES
    )


def finer_decode_schedule(blocks: torch.Tensor, n: int, wgmma: bool = False) -> bool:
    """Whether a static-mode call with ``n`` tokens runs :func:`decode_schedule`'s finer schedule instead of the stored
    one: ``n <= DECODE_MAX_N``, block rows in :data:`DECODE_SCHEDULE_BLOCK_ROWS`, ``$PRUNEKIT_BSR_DECODE_SCHEDULE`` not
    ``0``, the call runs the mma.sync kernel (the wgmma one was faster with the stored schedule: 32 x 32 blocks at N =
    32, 4096 x 4096 and 11008 x 4096, 90 / 95%: 6.6-15.7 us against 9.7-29.1 with the finer one,
    benchmarks/results/bsr-wgmma-t-ns-h100-2026-11-26-s26b.json), and the lean decode kernel does not take the call
    (:func:`lean_takes`). Reads the two settings.

    Args:
        blocks: ``(nblocks, r, c)``; n: N (tokens) of the call; wgmma: the call runs the wgmma variant.
    """
    return (
        not wgmma
        and n <= DECODE_MAX_N
        and blocks.dim() == 3
        and blocks.shape[1] in DECODE_SCHEDULE_BLOCK_ROWS
        and os.environ.get(DECODE_SCHEDULE_ENV, "1").strip() != "0"
        and not lean_takes(blocks, n)
    )


def _unsplit(crow_indices: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(longest block row in blocks, schedule, split_rows)`` of ``crow_indices``' pattern with no row split (every
    block row one item, longest first), built once (one copy of ``crow_indices`` to the host) and kept on it while its
    data pointer and version stay the same."""

    def build() -> tuple[int, torch.Tensor, torch.Tensor]:
        from ..formats.bsr import static_schedule

        crow = crow_indices.cpu().to(torch.int64)
        counts = crow[1:] - crow[:-1]
        longest = int(counts.max()) if counts.numel() else 0
        items, rows = static_schedule(crow, max(longest, 1))
        return longest, items.to(crow_indices.device), rows.to(crow_indices.device)

    return cached(crow_indices, _UNSPLIT_ATTR, (crow_indices,), None, build)


def lean_warps(m: int, num_sms: int = 132, n: int = 16) -> int:
    """Warps per CTA of the lean BSR decode kernel where ``$PRUNEKIT_BSR_LEAN_WARPS`` is unset, for a call of ``n``
    tokens: 4 above 16 tokens; else 8 where the ``m / 16`` strips (one CTA each) are at most
    :data:`LEAN_WIDE_MAX_STRIPS_PER_SM` per SM, else 4. The C++ launcher's rule (``csrc/structured/bsr_decode_lean.cu``
    ``lean_warps``, with its H100 figures; a CUDA test compares them)."""
    if n > LEAN_NARROW_MAX_N:
        return 4
    return 8 if m // 16 <= LEAN_WIDE_MAX_STRIPS_PER_SM * num_sms else 4


def split_n_class(n: int) -> int:
    """Index of the :data:`SPLIT_MIN_COLS` entry for a call with ``n`` tokens (:func:`split_pays` decides the same way
    for every N of one class)."""
    for i, (max_n, _) in enumerate(SPLIT_MIN_COLS):
        if max_n is None or n <= max_n:
            return i
    return len(SPLIT_MIN_COLS) - 1


def split_pays(blocks: torch.Tensor, crow_indices: torch.Tensor, n: int) -> bool:
    """Whether a static-mode call with ``n`` tokens keeps the stored schedule's split rows: ``$PRUNEKIT_BSR_SPLIT``
    ``1`` / ``0`` force it, else the longest block row must span at least the columns :data:`SPLIT_MIN_COLS` gives for
    ``n`` (the measurements above that table). Reads the row lengths once per pattern (:func:`_unsplit`).

    Args:
        blocks: ``(nblocks, r, c)``; crow_indices: ``(M / r + 1,)`` int32; n: N (tokens) of the call.

    Raises:
        ValueError: ``$PRUNEKIT_BSR_SPLIT`` other than 0, 1, auto or empty.
    """
    setting = os.environ.get(SPLIT_ENV, "").strip()
    if setting not in ("", "auto", "0", "1"):
        raise ValueError(f"${SPLIT_ENV} must be 0, 1 or auto, got {setting!r}")
    if setting in ("0", "1"):
        return setting == "1"
    capturing = crow_indices.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and peek(crow_indices, _UNSPLIT_ATTR, (crow_indices,), None) is None:
        return True  # no host copy inside a CUDA-graph capture: the stored schedule, as before this rule
    longest = _unsplit(crow_indices)[0]
    cols = longest * int(blocks.shape[2])
    return cols >= SPLIT_MIN_COLS[split_n_class(n)][1]


def unsplit_schedule(crow_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The static schedule of ``crow_indices``' pattern with every block row in one item (longest first) and no split
    rows: what a call runs where :func:`split_pays` is False. Kept on ``crow_indices`` (:func:`_unsplit`)."""
    _, items, rows = _unsplit(crow_indices)
    return items, rows


def decode_schedule(
    blocks: torch.Tensor,
    crow_indices: torch.Tensor,
    schedule: torch.Tensor | None,
    split_rows: torch.Tensor | None,
    n: int,
    wgmma: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The static schedule for a call with ``n`` tokens: ``(schedule, split_rows)`` as given, except in static mode
    (``schedule`` given) at ``n <= DECODE_MAX_N`` with block rows in :data:`DECODE_SCHEDULE_BLOCK_ROWS`, where it is
    ``formats.bsr.static_schedule(crow_indices, DECODE_SCHEDULE_CHUNK)`` (every block row in items of at most that many
    blocks; PopSparse's static mode, Li et al. 2023, with a finer split for small N), built once (one copy of
    ``crow_indices`` to the host) and kept on ``crow_indices`` while its data pointer and version stay the same.
    ``$PRUNEKIT_BSR_DECODE_SCHEDULE=0`` keeps the given schedule, and so does a call the lean decode kernel takes
    (:func:`lean_takes`: it reads no schedule) and one the wgmma variant runs (:func:`finer_decode_schedule`). Where
    the given schedule is kept but its split rows do not pay at this N (:func:`split_pays`), it is
    :func:`unsplit_schedule`'s instead (the same blocks, no fp32 workspace or finalize kernel). Dynamic mode (no
    schedule) is left as it is: it must not synchronize with the host.

    Args:
        blocks: ``(nblocks, r, c)``; crow_indices: ``(M / r + 1,)`` int32; schedule: ``(n_items, 4)`` int32 or None;
            split_rows: ``(n_split,)`` int32 or None; n: N (tokens) of the call; wgmma: the call runs the wgmma
            variant.
    """
    if schedule is None:
        return schedule, split_rows
    if not finer_decode_schedule(blocks, n, wgmma):
        if (
            split_rows is not None
            and split_rows.numel()
            and not lean_takes(blocks, n)
            and not split_pays(blocks, crow_indices, n)
        ):
            return unsplit_schedule(crow_indices)
        return schedule, split_rows

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        from ..formats.bsr import static_schedule

        items, rows = static_schedule(crow_indices.cpu(), DECODE_SCHEDULE_CHUNK)
        return items.to(crow_indices.device), rows.to(crow_indices.device)

    return cached(crow_indices, _DECODE_SCHEDULE_ATTR, (crow_indices,), DECODE_SCHEDULE_CHUNK, build)


def bsr_mm_eager(
    blocks: torch.Tensor,
    crow_indices: torch.Tensor,
    col_indices: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    schedule: torch.Tensor | None = None,
    split_rows: torch.Tensor | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """:func:`bsr_mm_cuda` through the C++ entry (output allocation, X layout, N tile and variant chosen in C++): the
    CUDA implementation of the custom ops. Same arguments, result and errors (shape mismatches raise RuntimeError from
    the C++ checks)."""
    _check_activation(activation)
    number = eager_bsr_variant(blocks, x, variant)
    n = x.shape[-1] if x.dim() else 0
    schedule, split_rows = decode_schedule(
        blocks, crow_indices, schedule, split_rows, n, _runs_wgmma(blocks, n, number, variant)
    )
    if number is None:
        return bsr_mm_cuda(blocks, crow_indices, col_indices, x, m, bias, activation, schedule, split_rows)
    return fastcall.entry("bsr_mm")(
        blocks, crow_indices, col_indices, schedule, split_rows, x, m, bias, activation == "relu", number
    )


def _runs_wgmma(blocks: torch.Tensor, n: int, number: int | None, variant: str | None) -> bool:
    """Whether a :func:`bsr_mm_eager` call with ``n`` tokens runs the wgmma kernel: ``number`` from
    :func:`eager_bsr_variant` (an unresolved ``"auto"``, 16-row blocks, is resolved by the C++ entry by N), or, where
    that is None (:func:`bsr_mm_cuda` runs the call), the variant :func:`bsr_mm_cuda` resolves."""
    if number is not None:
        return number == VARIANTS["wgmma"] or (number == VARIANTS["auto"] and n >= AUTO_WGMMA_16_MIN_N)
    name = bsr_variant(variant)
    if name == "wgmma":
        return wgmma_supports(blocks) and wgmma_available()
    return name == "auto" and auto_takes_wgmma(blocks, None, n)


def eager_nm24_output(values: torch.Tensor, x: torch.Tensor, n: int, m_group: int) -> int | None:
    """For the runtime's eager 2:4 call: the binding's ``output`` code (:data:`CSLT_OUTPUTS`; ``$PRUNEKIT_CSLT_OUTPUT``,
    else :data:`CSLT_LAYER_DEFAULT_OUTPUT`) when prunekit's cuSPARSELt binding takes ``values`` and ``x``, or None when
    :func:`nm_mm_cuda` must run. Asked once per layer."""
    if not eager_cpp_enabled() or x.dim() != 2 or not nm24_fast(values, x, n, m_group) or not native_cslt_available():
        return None
    return CSLT_OUTPUTS[cslt_output(default=CSLT_LAYER_DEFAULT_OUTPUT)]


# --- op registration ---------------------------------------------------------------------------------------------


def _bsr_mm_cpu(blocks, crow_indices, col_indices, x, m, bias=None, activation="none"):
    return as_spmm_output(reference.bsr_mm(blocks, crow_indices, col_indices, x, m, bias, activation), x)


def _bsr_mm_fake(blocks, crow_indices, col_indices, x, m, bias=None, activation="none"):
    return new_spmm_output(x, m)


def _bsr_mm_cuda(blocks, crow_indices, col_indices, x, m, bias=None, activation="none"):
    return bsr_mm_eager(blocks, crow_indices, col_indices, x, m, bias, activation)


def _nm_mm_cpu(values, metadata, x, n, m_group, bits, bias=None, activation="none"):
    return as_spmm_output(reference.nm_mm(values, metadata, x, n, m_group, bits, bias, activation), x)


def _nm_mm_fake(values, metadata, x, n, m_group, bits, bias=None, activation="none"):
    return new_spmm_output(x, values.shape[0])


def _bsr_mm_static(
    blocks: torch.Tensor,
    crow_indices: torch.Tensor,
    col_indices: torch.Tensor,
    schedule: torch.Tensor,
    split_rows: torch.Tensor,
    x: torch.Tensor,
    m: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    return as_spmm_output(reference.bsr_mm(blocks, crow_indices, col_indices, x, m, bias, activation), x)


def _bsr_mm_static_fake(blocks, crow_indices, col_indices, schedule, split_rows, x, m, bias=None, activation="none"):
    return new_spmm_output(x, m)


def _bsr_mm_static_cuda(blocks, crow_indices, col_indices, schedule, split_rows, x, m, bias=None, activation="none"):
    return bsr_mm_eager(blocks, crow_indices, col_indices, x, m, bias, activation, schedule, split_rows)


def _bsr_mm_direct(blocks, crow_indices, col_indices, x, m, bias=None, activation="none"):
    if not ops.eager_direct(x, blocks, crow_indices, col_indices, bias):
        return NotImplemented
    return _bsr_mm_cuda(blocks, crow_indices, col_indices, x, m, bias, activation)


def _nm_mm_direct(values, metadata, x, n, m_group, bits, bias=None, activation="none"):
    if not ops.eager_direct(x, values, metadata, bias):
        return NotImplemented
    return nm_mm_cuda(values, metadata, x, n, m_group, bits, bias, activation)


def _bsr_mm_static_direct(blocks, crow_indices, col_indices, schedule, split_rows, x, m, bias=None, activation="none"):
    if not ops.eager_direct(x, blocks, crow_indices, col_indices, schedule, split_rows, bias):
        return NotImplemented
    return _bsr_mm_static_cuda(blocks, crow_indices, col_indices, schedule, split_rows, x, m, bias, activation)


def _register() -> None:
    """CUDA kernels of ``bsr_mm`` / ``nm_mm``, and the output-layout rule of ``layout.py`` for their CPU and fake
    implementations, so that all three agree on strides (column-major Y for the runtime's ``x2d.t()``)."""
    for name, cpu, fake, cuda in (
        ("bsr_mm", _bsr_mm_cpu, _bsr_mm_fake, _bsr_mm_cuda),
        ("nm_mm", _nm_mm_cpu, _nm_mm_fake, nm_mm_cuda),
    ):
        qualname = f"prunekit::{name}"
        torch.library.register_kernel(qualname, "cpu", cpu)
        torch.library.register_fake(qualname, fake)
        torch.library.register_kernel(qualname, "cuda", cuda)
    ops.attach_eager_direct(ops.bsr_mm, _bsr_mm_direct)
    ops.attach_eager_direct(ops.nm_mm, _nm_mm_direct)


_register()
bsr_mm = ops.bsr_mm
bsr_mm_static = ops._define(
    "bsr_mm_static", _bsr_mm_static, _bsr_mm_static_fake, _bsr_mm_static_cuda, direct=_bsr_mm_static_direct
)
"""``prunekit::bsr_mm_static(blocks, crow_indices, col_indices, schedule, split_rows, x, m, bias=None,
activation="none")``: ``bsr_mm`` driven by the static schedule stored with the weight (``formats/bsr.py``)."""
