"""2:4 matmul for decode shapes (N <= 16): prunekit's own kernel (``csrc/structured/nm24/nm24_decode.cu``).

At N <= 16 the time is the weight's bytes. A 2:4 weight stores 2 bytes per kept value and 4 bits per group of 4
(1.125 bytes per weight against dense's 2, at most 1.78x), but cuSPARSELt's sparse tensor-core kernels, tuned for
large N, ran at 0.42-0.89x of dense cuBLAS at N <= 16 on the H100 (``benchmarks/results/nm-h100-2026-11-25.json``).
This kernel streams a repacked copy of the weight (:func:`build_plan`, once per weight, kept on the stored values
tensor) into the sparse tensor cores (``mma.sp.m16n8k32``, the default) or, with ``$PRUNEKIT_NM24_MMA=prmt``, expands
each group in registers for the dense ``mma.sync.m16n8k16``. The file's header comment describes the layouts. On the
H100 (fp16, graph replay) it runs 1.26-1.47x faster than dense cuBLAS on the 4096 / 11008 decode shapes, 1.49x at
768 x 3072 and 0.77-0.87x at 3072 x 768 (docs/PERFORMANCE_STRUCTURED.md, tenth session). Source: 2:4 structured
sparsity (Mishra et al., "Accelerating Sparse Deep Neural Networks", 2021); the decode streaming into mma.sp follows
the idea of Sparse-Marlin (Castro et al., 2024).

:func:`emulate` replays the kernel lane by lane in torch (byte permutes or mma.sp metadata, fragment layouts,
k-chunks) so that the format and its index arithmetic are checked on the CPU; the hardware's reading of the mma.sp
metadata was checked on the H100 (``scripts/nm24_sp_layout.py``). torch + stdlib only (copied into exported
packages).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import KernelUnavailable
from . import build, fastcall, reference
from .tensor_cache import cached

__all__ = [
    "available",
    "Nm24Plan",
    "build_plan",
    "get_plan",
    "emulate",
    "linear",
    "drop_plan",
    "decode_mm",
    "decode_takes",
    "load",
    "is_loaded",
]

CSRC_DIR = Path(__file__).resolve().parent / "csrc" / "structured"
NAMESPACE = "prunekit_nm24"
STRIPS_PER_BLOCK = 8  # warps per block, one 16-row strip each (kWarps)
KSTEP_ALIGN = 8  # k-steps per register batch (kBatch): the plan pads K to a multiple of 8 * 16 columns
MAX_CHUNK = 64  # k-steps per block (kMaxChunk: 32 KB of staged X next to the 54 KB weight ring)
MAX_N = 16  # tokens per call (kTokens)
WIDE_GROUP_TOKENS = 64  # bitmap at N > 32: tokens per block (kWideNt n-tiles of 8), grid z over such groups
WIDE_CHUNK64_MIN_BLOCKS_PER_SM = 4  # bitmap at N > 32: chunks of MAX_CHUNK k-steps where the grid keeps this many
PORTABLE_CLUSTER = 8  # thread-block cluster size every sm_90 launch may take without the non-portable attribute
MAX_CLUSTER = 16  # k-chunks the kernel reduces in one thread-block cluster on sm_90 (kMaxCluster); more: atomics
MMA_ENV = "PRUNEKIT_NM24_MMA"  # "sp": sparse tensor cores (mma.sp.m16n8k32); "prmt": register expansion + mma.sync
DEFAULT_MMA = "sp"
SP_LAYOUT_ENV = "PRUNEKIT_NM24_SP_LAYOUT"  # which metadata layout build_plan writes for mma.sp (see SP_LAYOUTS)
DEFAULT_SP_LAYOUT = "halves"
# mma.sp m16n8k32 metadata (sparsity selector 0: lanes t = 0, 1 of each quad g): the 4-bit nibble of hardware group j
# (columns 4j .. 4j + 3 of the k32 step) of rows g and g + 8, as the two candidate readings of the PTX ISA's figure:
#   "halves": lane t holds groups 4t .. 4t + 3, row g in bits 0-15 and row g + 8 in bits 16-31;
#   "rows":   lane t holds groups 0 .. 7 of row g + 8t.
SP_LAYOUTS = ("halves", "rows")
CLUSTER_ENV = "PRUNEKIT_NM24_CLUSTER"  # "0": reduce k-chunks with global atomics and counters (as on sm_80)
# "0": where k-chunks are added with global atomics on sm_90 at N <= 16, the decode blocks fence, count and the last one
# writes Y (as on sm_80 and at N > 16), instead of the default second kernel that adds the bias and writes Y once the
# decode grid has ended (nm24_decode.cu, nm24_finish_kernel)
FINISH_ENV = "PRUNEKIT_NM24_FINISH"
DTYPES = (torch.float16, torch.bfloat16)
DECODE_ENV = "PRUNEKIT_NM24_DECODE"  # "0": 2:4 calls at N <= 16 go to cuSPARSELt as before
CHUNK_ENV = "PRUNEKIT_NM24_CHUNK"  # k-steps per block instead of plan_chunk's (tuning: benchmarks/nm24_sweep.py)
# bitmap at N > 16: "8" or "16" strips per block instead of the launcher's rule (16 where that grid takes fewer than
# 4 / 5 of the waves of 8-strip blocks; csrc/structured/nm24/nm24_decode.cu, launch_wide)
WIDE_WARPS_ENV = "PRUNEKIT_NM24_WIDE_WARPS"
RING_ENV = "PRUNEKIT_NM24_RING"  # the weight ring instead of plan_ring's (mma.sp only; tuning)
# weight rings the library is built for, "R x B": R batches of B k-steps per warp in shared memory (templates R, B;
# the register expansion has 3 x 8 only)
RINGS = ("3x8", "4x4", "6x4")
# The lean decode kernels (one or two 16-row strips per block, warps splitting K, weights and X loaded straight into
# registers, no workspace; nm24_decode.cu, nm24_lean_kernel and nm24_lean_bitmap_kernel) instead of the ring kernel:
# unset / "auto", the measured rule (nineteenth session, H100): mma.sp and bitmap plans with K <= LEAN_MAX_K at N <= 16,
# 6 warps per strip (8 for 2:4 at N <= 2). At 3072 x 768 2:4 N = 2 / 8 / 16 took 2.24 / 2.38 / 3.56 us against the ring
# kernel's 4.06 / 4.21 / 4.91, bitmap 2.86-3.89 against 5.10-5.81 (benchmarks/results/nm24-sweep-lean6-h100-2026-11-26-
# s19.json, spmm-bitmap6-lean{0,1-6}-h100-2026-11-26-s19.json). "1": every mma.sp and bitmap call at N <= 16; "0": none.
# LEAN_WARPS_ENV forces the shape: "KW" warps per strip (1, 2, 4, 6, 8) or "KWxSB" with SB strips per block (1, 2; SB = 2
# with KW <= 4; the bitmap kernel takes KW only); unset, the launcher's measured rule (nm24_decode.cu, lean_shape).
LEAN_ENV = "PRUNEKIT_NM24_LEAN"
LEAN_WARPS_ENV = "PRUNEKIT_NM24_LEAN_WARPS"
LEAN_MAX_K = 1024  # kLeanMaxK
SPMV_ENV = "PRUNEKIT_NM24_SPMV"  # "0": N = 1 goes to the tensor-core decode kernel too
SPMV_MAX_K = 49152  # x in the SpMV kernel's shared memory (96 KB)
ROWS = 1 << 56  # cfg bit of prunekit_nm24::linear: x is (N, K) and the result (N, M) (nn.Linear's layout)
_PLAN_ATTR = "_prunekit_nm24_plan"
_state: bool | None = None  # available(), tried once per process

log = logging.getLogger(__name__)

EXTENSION = build.Extension(
    namespace=NAMESPACE,
    prefix=NAMESPACE,
    csrc_dir=CSRC_DIR,
    sources=("nm24/nm24_decode.cu", "nm24/nm24_spmv.cu"),
    headers=("../mma.cuh", "../check.h", "../launch.cuh", "../views.h"),
    probe="mm",
    description="2:4 decode CUDA kernel",
    cuda_cflags=("-O3", "-lineinfo"),
    include_paths=(str(CSRC_DIR.parent),),
)


def is_loaded() -> bool:
    """True when the ``prunekit_nm24`` operators are registered in this process."""
    return build.extension_loaded(EXTENSION)


def load(verbose: bool = False) -> Path | None:
    """Make the ``prunekit_nm24`` operators available, compiling them on first use (under a minute).

    Raises:
        KernelUnavailable: no CUDA torch, no GPU of sm_80 or newer, no nvcc/ninja, or the compilation failed.
    """
    return build.load_extension(EXTENSION, verbose)


def _ensure_loaded() -> None:
    """:func:`load` on the first call; after it a flag (``is_loaded()`` costs microseconds per call)."""
    global _state
    if _state is not True:
        load()
        _state = True


def available() -> bool:
    """True when the decode kernel loads (tried once per process; a failure is logged once and the 2:4 calls keep
    cuSPARSELt)."""
    global _state
    if _state is None:
        try:
            load()
            _state = True
        except KernelUnavailable as exc:
            log.warning("2:4 decode kernel unavailable, N <= 16 uses cuSPARSELt: %s", exc)
            _state = False
    return _state


class Nm24Plan(NamedTuple):
    """The kernel's copy of one 2:4 weight ``(M, K)``.

    ``vals``: ``(strips, ksteps / 2, 32, 4)`` int32, two fp16/bf16 values per word; ``meta``: for ``variant`` 0
    ``(strips, ksteps / 4, 32)`` int32, a byte per k-step (two in-group index nibbles), for ``variant`` 1 (mma.sp)
    ``(strips, ksteps / 2, 16)`` int32 in the layout ``sp_layout`` (:func:`sp_meta`); ``ws``: ``(strips * 16 * 16,)`` float32 and
    ``counters``: ``(row blocks,)`` int32, both zero between calls (the kernel leaves them so); ``chunk``: k-steps per
    block; ``m``, ``k``: the weight's shape; ``dtype``: its dtype; ``variant``: 0 register expansion + mma.sync, 1
    mma.sp; ``ring``, ``batch``: ``ring`` batches of ``batch`` k-steps per warp in shared memory (:func:`plan_ring`);
    ``buffer``: one int32 tensor holding vals, meta, ws and counters back to back (they are views of it) and ``cfg``
    the integer settings packed (:func:`plan_cfg`), the two arguments of the eager entry besides X and bias.
    """

    vals: torch.Tensor
    meta: torch.Tensor
    ws: torch.Tensor
    counters: torch.Tensor
    chunk: int
    m: int
    k: int
    dtype: torch.dtype
    variant: int = 0  # 0: register expansion for mma.sync; 1: sparse tensor cores (mma.sp), meta in SP_LAYOUTS
    sp_layout: str = ""
    ring: int = 3  # weight batches per warp in shared memory (RINGS): ring - 1 in flight while one is multiplied
    batch: int = 8  # k-steps per batch
    buffer: torch.Tensor | None = None  # int32: vals, meta, ws, counters back to back (the four are views of it)
    cfg: int = 0  # m, chunk, variant, ring, batch packed for the eager entry (plan_cfg)


def token_groups(n: int) -> int:
    """Grid z of the decode kernel for ``n`` tokens: 1 up to 32 (one block of 16 or 32 tokens), else groups of
    :data:`WIDE_GROUP_TOKENS` (the bitmap kernel at N > 32, each group decoding the weight again)."""
    return 1 if n <= 2 * MAX_N else -(-n // WIDE_GROUP_TOKENS)


def plan_chunk(strips: int, ksteps: int, num_sms: int, n: int = 1) -> int:
    """k-steps per block: 32, unless that leaves fewer than ``num_sms / 2`` blocks (row blocks x k-chunks x
    :func:`token_groups` of ``n``), then 16, then 8 (never more than ``ksteps``). Chosen from the H100 k-chunk sweep
    (``benchmarks/results/nm24-sweep-h100-2026-11-25-v5.json``: 32 was fastest on the three large decode shapes, 16 on
    768 x 3072 and 3072 x 768; in-sample). The token groups count since the sixteenth session: at 768 x 3072 the
    bitmap kernel took 13.5 / 20.3 us with chunks of 32 against 14.8 / 27.0 with 16 at N = 128 / 256 (2 / 4 groups),
    and 13.0 against 10.0 at N = 64 (one group; ``benchmarks/results/spmm-bitmap-{c32,base}-h100-2026-11-26-s16.json``,
    90%). At N > 32, chunks of :data:`MAX_CHUNK` where they still leave
    :data:`WIDE_CHUNK64_MIN_BLOCKS_PER_SM` blocks per SM and at most :data:`PORTABLE_CLUSTER` k-chunks: at 11008 x
    4096, N = 128 / 256 (688 / 1376 blocks, 4 chunks) 1.12-1.22x faster than 32; at 4096 x 4096 (256 / 512 blocks)
    0.81-0.94x (``spmm-chunk-large-{c64,c32}-h100-2026-11-26-s16.json``, 80-90%); at 4096 x 11008 (704 / 1408 blocks,
    11 chunks in a non-portable cluster against 22 with atomics) 0.80-0.90x (``spmm-chunk-k11008-{new,c32}-...``).
    In-sample, three shapes. Up to :data:`MAX_CLUSTER` k-chunks are reduced in one thread-block cluster on sm_90,
    more with global atomics. ``$PRUNEKIT_NM24_CHUNK`` overrides it (tuning, at most :data:`MAX_CHUNK`)."""
    blocks = -(-strips // STRIPS_PER_BLOCK) * token_groups(n)
    wide_chunks = -(-ksteps // MAX_CHUNK)
    forced = os.environ.get(CHUNK_ENV)
    if forced:
        chunk = -(-int(forced) // KSTEP_ALIGN) * KSTEP_ALIGN
    elif (
        n > 2 * MAX_N
        and blocks * wide_chunks >= WIDE_CHUNK64_MIN_BLOCKS_PER_SM * num_sms
        and wide_chunks <= PORTABLE_CLUSTER
    ):
        chunk = MAX_CHUNK
    else:
        chunk = next((c for c in (32, 16) if blocks * -(-ksteps // c) >= num_sms / 2), KSTEP_ALIGN)
    return max(KSTEP_ALIGN, min(chunk, MAX_CHUNK, ksteps))


def plan_ring(variant: str) -> tuple[int, int]:
    """The weight ring ``(batches, k-steps per batch)`` per warp in shared memory: 3 x 8, two batches in flight while
    one is multiplied (54 KB per block, three blocks per SM). ``$PRUNEKIT_NM24_RING`` may ask for another of
    :data:`RINGS` with mma.sp: 6 x 4 (same bytes, finer batches, five in flight) or 4 x 4 (36 KB, four blocks per SM).
    Measured on the H100: deeper rings of 8 k-steps (4 x 8, 5 x 8: two blocks per SM) were 4-38% slower
    (``benchmarks/results/nm24-sweep-ring-h100-2026-11-25-s10.json``).

    Raises:
        ValueError: ``$PRUNEKIT_NM24_RING`` not one of :data:`RINGS`, or not 3 x 8 for the register expansion."""
    name = build.setting(None, RING_ENV, RINGS[0], RINGS, "2:4 decode weight ring")
    if variant != "sp" and name != RINGS[0]:
        raise ValueError(f"the register expansion ({MMA_ENV}=prmt) has the {RINGS[0]} ring only, not {name}")
    ring, batch = (int(v) for v in name.split("x"))
    return ring, batch


def plan_nbytes(m: int, k: int) -> int:
    """Bytes of the decode plan :func:`build_plan` builds for a 2:4 weight ``(m, k)``: its one int32 buffer (repacked
    values, metadata, the fp32 k-split workspace and the counters), from the shape alone."""
    strips = -(-m // 16)
    ksteps = -(-k // (16 * KSTEP_ALIGN)) * KSTEP_ALIGN
    return 4 * (strips * ksteps * 64 + strips * ksteps * 8 + strips * 16 * MAX_N + -(-strips // STRIPS_PER_BLOCK))


def plan_cfg(m: int, chunk: int, variant: int, ring: int, batch: int) -> int:
    """The plan's settings packed into one int64 for ``prunekit_nm24::linear``: M in bits 0-31, chunk 32-39, variant
    40, ring 44-47, batch 48-51 (fewer arguments to convert per eager call: ``benchmarks/nm24_host.py``); bit 56
    (:data:`ROWS`) is set per call."""
    return m | chunk << 32 | variant << 40 | ring << 44 | batch << 48


def _groups(values: torch.Tensor, metadata: torch.Tensor, bits: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of 4 columns: the value word (int64, lower index's value in the low 16 bits) and the nibble
    ``i0 | i1 << 2`` (int64), both ``(M, K / 4)``. Two values stored at one index are added (as the reference does)."""
    rows = values.shape[0]
    cols = reference.nm_columns(metadata, 2, 4, bits, k).reshape(rows, -1, 2) % 4
    vals = values.reshape(rows, -1, 2)
    i0, i1 = cols[..., 0], cols[..., 1]
    v0, v1 = vals[..., 0], vals[..., 1]
    same = i0 == i1
    if bool(same.any()):
        v0 = torch.where(same, (v0.float() + v1.float()).to(values.dtype), v0)
        v1 = torch.where(same, torch.zeros_like(v1), v1)
        i1 = torch.where(same, (i0 + 1) % 4, i1)
    swap = i0 > i1
    i0, i1 = torch.where(swap, i1, i0), torch.where(swap, i0, i1)
    v0, v1 = torch.where(swap, v1, v0), torch.where(swap, v0, v1)
    bits16 = lambda v: v.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF  # noqa: E731
    return bits16(v0) | (bits16(v1) << 16), i0 | (i1 << 2)


def mma_variant(mma: str | None = None) -> str:
    """The decode kernel's inner product: ``mma``, else ``$PRUNEKIT_NM24_MMA``, else :data:`DEFAULT_MMA`.

    Raises:
        ValueError: not ``"prmt"`` or ``"sp"``.
    """
    return build.setting(mma, MMA_ENV, DEFAULT_MMA, ("prmt", "sp"), "2:4 decode kernel variant")


def sp_meta(nibs: torch.Tensor, strips: int, ksteps: int, layout: str) -> torch.Tensor:
    """mma.sp metadata words ``(strips, ksteps / 2, 16)`` int32 (word ``g * 2 + t`` of each k32 step) from the per-group
    nibbles ``nibs: (strips * 16, ksteps * 4)`` int64, in one of :data:`SP_LAYOUTS`.

    Raises:
        ValueError: an unknown layout.
    """
    if layout not in SP_LAYOUTS:
        raise ValueError(f"mma.sp metadata layout must be one of {SP_LAYOUTS}, got {layout!r}")
    n = nibs.reshape(strips, 2, 8, ksteps // 2, 8)  # (strip, half: rows g / g + 8, g, k32, hardware group j)
    dev = nibs.device
    if layout == "halves":  # (strip, k32, g, t, half, j in 4t..4t+3)
        parts = n.reshape(strips, 2, 8, ksteps // 2, 2, 4).permute(0, 3, 2, 4, 1, 5)
        shifts = (torch.arange(2, device=dev)[:, None] * 16 + torch.arange(4, device=dev)[None, :] * 4).to(torch.int64)
    else:  # (strip, k32, g, t = half, j)
        parts = n.permute(0, 3, 2, 1, 4)[:, :, :, :, None, :]
        shifts = (torch.arange(8, device=dev) * 4).to(torch.int64)[None, :]
    words = (parts << shifts).sum(dim=(-1, -2)).reshape(strips, ksteps // 2, 16)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def sp_meta_nibbles(meta: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of :func:`sp_meta`: ``(strips * 16, ksteps * 4)`` int64 nibbles."""
    strips, kpairs, _ = meta.shape
    w = (meta.to(torch.int64) & 0xFFFFFFFF).reshape(strips, kpairs, 8, 2)  # (strip, k32, g, t)
    out = torch.zeros(strips, 2, 8, kpairs, 8, dtype=torch.int64)  # (strip, half, g, k32, j)
    for j in range(8):
        if layout == "halves":
            t, jj = j // 4, j % 4
            for half in range(2):
                out[:, half, :, :, j] = ((w[:, :, :, t] >> (16 * half + 4 * jj)) & 15).permute(0, 2, 1)
        else:
            for half in range(2):
                out[:, half, :, :, j] = ((w[:, :, :, half] >> (4 * j)) & 15).permute(0, 2, 1)
    return out.reshape(strips * 16, kpairs * 8)


def build_plan(
    values: torch.Tensor,
    metadata: torch.Tensor,
    bits: int,
    k: int,
    num_sms: int | None = None,
    mma: str | None = None,
    sp_layout: str | None = None,
) -> Nm24Plan:
    """Repack a stored 2:4 weight (``formats/nm.py``: ``values (M, K / 2)``, ``metadata`` uint8) for the kernel.

    Args:
        values: ``(M, K / 2)`` fp16 or bf16; metadata: packed in-group indices; bits: bits per index; k: K (a
            multiple of 4); num_sms: SMs of the target GPU (default: the values' device, 132 off the GPU).

    Returns:
        :class:`Nm24Plan` on ``values``' device (about 1.2 bytes per weight). ``mma`` (:func:`mma_variant`) and
        ``sp_layout`` (:data:`SP_LAYOUTS`, default ``$PRUNEKIT_NM24_SP_LAYOUT`` or :data:`DEFAULT_SP_LAYOUT`, the one
        the H100 reads) choose the metadata format.

    Raises:
        ValueError: a dtype other than fp16/bf16, K not a multiple of 4, an unknown variant or layout.
    """
    if values.dtype not in DTYPES:
        raise ValueError(f"the 2:4 decode kernel takes float16 or bfloat16 weights, got {values.dtype}")
    if k % 4 or values.shape[1] * 2 != k:
        raise ValueError(f"2:4 values of shape {tuple(values.shape)} do not match K = {k}")
    m = values.shape[0]
    word, nib = _groups(values, metadata, bits, k)
    strips = -(-m // 16)
    ksteps = -(-k // (16 * KSTEP_ALIGN)) * KSTEP_ALIGN
    dev = values.device
    words = torch.zeros(strips * 16, ksteps * 4, dtype=torch.int64, device=dev)
    nibs = torch.full((strips * 16, ksteps * 4), 4, dtype=torch.int64, device=dev)  # padding: indices 0 and 1
    words[:m, : k // 4] = word
    nibs[:m, : k // 4] = nib
    # (strip, half, g, kpair, s, t) -> (strip, kpair, g, t, s, half): uint4 component s * 2 + half
    w6 = words.reshape(strips, 2, 8, ksteps // 2, 2, 4).permute(0, 3, 2, 5, 4, 1)
    vals = w6.reshape(strips, ksteps // 2, 32, 4)
    vals = torch.where(vals >= 2**31, vals - 2**32, vals).to(torch.int32)
    # (strip, half, g, kquad, s, t) -> (strip, kquad, g, t, s, half): nibble at bit s * 8 + half * 4
    n6 = nibs.reshape(strips, 2, 8, ksteps // 4, 4, 4).permute(0, 3, 2, 5, 4, 1)
    shifts = (torch.arange(4, device=dev)[:, None] * 8 + torch.arange(2, device=dev)[None, :] * 4).to(torch.int64)
    meta = (n6 << shifts).sum(dim=(-1, -2)).reshape(strips, ksteps // 4, 32)
    meta = torch.where(meta >= 2**31, meta - 2**32, meta).to(torch.int32)
    variant = mma_variant(mma)
    layout = ""
    if variant == "sp":
        layout = build.setting(sp_layout, SP_LAYOUT_ENV, DEFAULT_SP_LAYOUT, SP_LAYOUTS, "mma.sp metadata layout")
        meta = sp_meta(nibs, strips, ksteps, layout)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    row_blocks = -(-strips // STRIPS_PER_BLOCK)
    chunk = plan_chunk(strips, ksteps, num_sms)
    ring, batch = plan_ring(variant)
    sizes = (vals.numel(), meta.numel(), strips * 16 * MAX_N, row_blocks)
    buffer = torch.empty(sum(sizes), dtype=torch.int32, device=dev)
    parts = buffer.split(sizes)
    parts[0].copy_(vals.reshape(-1))
    parts[1].copy_(meta.reshape(-1))
    # ws and counters start (and stay) zero. Zeroed last: the decode kernels, launched with programmatic dependent
    # launch, read the weights before they wait for the preceding kernel, and touch ws and counters only after it.
    parts[2].zero_()
    parts[3].zero_()
    code = 1 if variant == "sp" else 0
    return Nm24Plan(
        parts[0].view(vals.shape),
        parts[1].view(meta.shape),
        parts[2].view(torch.float32),
        parts[3],
        chunk,
        m,
        k,
        values.dtype,
        code,
        layout,
        ring,
        batch,
        buffer,
        plan_cfg(m, chunk, code, ring, batch),
    )


def get_plan(values: torch.Tensor, metadata: torch.Tensor, bits: int, k: int) -> Nm24Plan:
    """:func:`build_plan`, built once and kept on ``values`` (rebuilt when ``values`` or ``metadata`` change; the
    environment variables are read when it is built, see :func:`drop_plan`)."""

    def make() -> Nm24Plan:
        # ordinary tensors even under inference_mode: the kernel updates ws / counters in place on later calls
        with torch.inference_mode(False), torch.no_grad():
            return build_plan(values, metadata, bits, k)

    return cached(values, _PLAN_ATTR, (values, metadata), (bits, k), make)


def drop_plan(values: torch.Tensor) -> None:
    """Forget the plan kept on ``values``: the next call builds it again, reading ``$PRUNEKIT_NM24_CHUNK``,
    ``$PRUNEKIT_NM24_RING``, ``$PRUNEKIT_NM24_MMA`` and ``$PRUNEKIT_NM24_SP_LAYOUT`` afresh (they are read when a plan
    is built, not per call)."""
    if hasattr(values, _PLAN_ATTR):
        delattr(values, _PLAN_ATTR)


def _byte_perm(x: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """PTX ``prmt.b32 d, x, 0, sel`` (default mode, selector nibbles < 8) on int64 tensors holding 32-bit words."""
    out = torch.zeros_like(x)
    for i in range(4):
        nib = (sel >> (4 * i)) & 7
        byte = torch.where(nib < 4, (x >> (8 * (nib % 4))) & 0xFF, torch.zeros_like(x))
        out |= byte << (8 * i)
    return out


def selector_table() -> torch.Tensor:
    """The kernel's 16 byte-permute selectors (int64): for nibble ``i0 | i1 << 2``, the half of column ``c`` of the
    group takes bytes 0-1 (value 0) if ``c == i0``, bytes 2-3 (value 1) if ``c == i1``, else the zero word's 4-5."""
    table = []
    for nib in range(16):
        i0, i1 = nib & 3, nib >> 2
        sel = 0
        for c in range(4):
            sel |= (0x10 if c == i0 else 0x32 if c == i1 else 0x54) << (8 * c)
        table.append(sel)
    return torch.tensor(table, dtype=torch.int64)


def emulate(plan: Nm24Plan, x: torch.Tensor, bias: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """The kernel's arithmetic replayed in torch, lane by lane (float64 products, fp32-like accumulation order not
    modelled). Variant 0: expansion of each lane's words by :func:`selector_table` into the m16n8k16 A fragments, X
    staged in fragment order (columns 4t .. 4t + 3 of token g at lane g * 4 + t), the PTX fragment layouts of A and B.
    Variant 1 (mma.sp): each lane's words placed at the in-group indices its metadata gives (:func:`_emulate_sp`).

    Args:
        plan: from :func:`build_plan`; x: ``(K, N)``, N <= 16; bias: ``(M,)`` or None.

    Returns:
        ``Y (M, N)`` float64.
    """
    if plan.variant == 1:
        return _emulate_sp(plan, x, bias, relu)
    strips, kpairs = plan.vals.shape[:2]
    ksteps = kpairs * 2
    k, n = x.shape
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    vals = plan.vals.cpu().to(torch.int64) & 0xFFFFFFFF  # (strips, kpairs, 32, 4)
    meta = plan.meta.cpu().to(torch.int64) & 0xFFFFFFFF  # (strips, kquads, 32)
    table = selector_table()
    s = torch.arange(ksteps)
    # per (strip, kstep, lane): the value words of rows g and g + 8 and their nibbles
    per_step = vals[:, s // 2]  # (strips, ksteps, 32, 4)
    odd = (s % 2 == 1)[None, :, None]
    wg = torch.where(odd, per_step[..., 2], per_step[..., 0])  # (strips, ksteps, 32)
    wg8 = torch.where(odd, per_step[..., 3], per_step[..., 1])
    m8 = (meta[:, s // 4, :] >> ((s % 4) * 8)[None, :, None]) & 0xFF
    sg, sg8 = table[m8 & 15], table[m8 >> 4]
    regs = torch.stack(
        [_byte_perm(wg, sg), _byte_perm(wg8, sg8), _byte_perm(wg, sg >> 16), _byte_perm(wg8, sg8 >> 16)], dim=-1
    )  # a.x, a.y, a.z, a.w
    halves = torch.stack([regs & 0xFFFF, (regs >> 16) & 0xFFFF], dim=-1)
    a_vals = (
        torch.where(halves >= 2**15, halves - 2**16, halves).to(torch.int16).view(plan.dtype).double()
    )  # (strips, ksteps, 32, 4 regs, 2)
    # A fragment (PTX m16n8k16, .row): reg 0 row g, k 2t + j; reg 1 row g + 8; reg 2 row g, k 2t + 8 + j; reg 3 row g + 8
    a = torch.zeros(strips, ksteps, 16, 16, dtype=torch.float64)
    for r, (drow, dk) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        for j in range(2):
            a[:, :, g + drow, 2 * t + dk + j] = a_vals[:, :, :, r, j]
    # B fragment (.col): b0 k 2t + j, b1 k 2t + 8 + j, column (token) g; staged item of lane (g, t) = X[tok][4t..4t+3]
    xp = torch.zeros(ksteps * 16, MAX_N, dtype=torch.float64)
    xp[:k, :n] = x.cpu().double()
    xk = xp.reshape(ksteps, 4, 4, MAX_N)  # (kstep, t, j, token): column 4t + j
    b = torch.zeros(ksteps, 16, MAX_N, dtype=torch.float64)
    for tt in range(4):
        for j in range(2):
            b[:, 2 * tt + j, :] = xk[:, tt, j, :]
            b[:, 2 * tt + 8 + j, :] = xk[:, tt, 2 + j, :]
    y = torch.einsum("skrf,kft->srt", a, b).reshape(strips * 16, MAX_N)[: plan.m, :n]
    if bias is not None:
        y = y + bias.cpu().double()[:, None]
    return y.clamp_min(0) if relu else y


def _emulate_sp(plan: Nm24Plan, x: torch.Tensor, bias: torch.Tensor | None, relu: bool) -> torch.Tensor:
    """:func:`emulate` for mma.sp plans: lane (g, t)'s value words are rows g / g + 8 of hardware groups t and t + 4
    (m16n8k16's A layout over the 16 kept values), placed at the in-group indices its metadata layout gives."""
    strips, kpairs = plan.vals.shape[:2]
    nibs = sp_meta_nibbles(plan.meta.cpu(), plan.sp_layout)  # (strips * 16, k32 * 8)
    vals = (plan.vals.cpu().to(torch.int64) & 0xFFFFFFFF).reshape(strips, kpairs, 8, 4, 4)  # (s, k32, g, t, reg)
    dense = torch.zeros(strips * 16, kpairs * 32, dtype=torch.float64)
    rows = torch.arange(strips)[:, None, None, None] * 16 + torch.arange(8)[None, None, :, None]
    k32 = torch.arange(kpairs)[None, :, None, None]
    t = torch.arange(4)[None, None, None, :]
    for reg, (drow, dgroup) in enumerate(((0, 0), (8, 0), (0, 4), (8, 4))):
        row = (rows + drow).expand(strips, kpairs, 8, 4)
        group = (k32 * 8 + t + dgroup).expand(strips, kpairs, 8, 4)
        nib = nibs[row, group]
        word = vals[..., reg]
        for slot, idx in ((0, nib & 3), (1, nib >> 2)):
            half = (word >> (16 * slot)) & 0xFFFF
            value = torch.where(half >= 2**15, half - 2**16, half).to(torch.int16).view(plan.dtype).double()
            dense.index_put_((row, group * 4 + idx), value, accumulate=True)
    k, n = x.shape
    y = dense[: plan.m, :k] @ x.cpu().double()
    if bias is not None:
        y = y + bias.cpu().double()[:, None]
    return y.clamp_min(0) if relu else y


def decode_takes(values: torch.Tensor, x: torch.Tensor, n: int, m_group: int) -> bool:
    """True when the decode kernel takes a 2:4 weight ``values`` and ``x: (K, N)``: a GPU, fp16/bf16 in one dtype,
    1 <= N <= 16, and ``$PRUNEKIT_NM24_DECODE`` not ``0``."""
    return (
        (n, m_group) == (2, 4)
        and x.is_cuda
        and x.dtype in DTYPES
        and values.dtype == x.dtype
        and 1 <= x.shape[1] <= MAX_N
        and values.shape[0] > 0
        and os.environ.get(DECODE_ENV, "1").strip() not in ("0", "false", "False")
    )


def spmv_takes(values: torch.Tensor, metadata: torch.Tensor, x: torch.Tensor, bits: int) -> bool:
    """True when the 2:4 SpMV kernel (``csrc/structured/nm24/nm24_spmv.cu``) takes the stored weight ``values: (M, K /
    2)``, ``metadata: (M, K / 8)`` uint8 and one token ``x`` (``(K, 1)`` or ``(1, K)``) as they are: 2-bit indices, a
    GPU, fp16/bf16 in one dtype, K a multiple of 16 up to :data:`SPMV_MAX_K`, contiguous values (16-byte aligned) and
    metadata, and ``$PRUNEKIT_NM24_SPMV`` not ``0``. Callers have checked the 2:4 pattern (:func:`decode_takes`)."""
    k = values.shape[1] * 2
    return (
        bits == 2
        and x.is_cuda
        and x.numel() == k
        and x.dtype in DTYPES
        and values.dtype == x.dtype
        and 0 < k <= SPMV_MAX_K
        and k % 16 == 0
        and values.is_contiguous()
        and values.data_ptr() % 16 == 0
        and metadata.dtype == torch.uint8
        and metadata.is_contiguous()
        and tuple(metadata.shape) == (values.shape[0], k // 8)
        and os.environ.get(SPMV_ENV, "1").strip() not in ("0", "false", "False")
    )


def spmv(
    values: torch.Tensor,
    metadata: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    relu: bool = False,
    rows: bool = False,
) -> torch.Tensor:
    """One launch of the 2:4 SpMV kernel ``prunekit_nm24::spmv24`` on the stored format (no plan): ``y = act(A x +
    bias)`` with ``values: (M, K / 2)`` fp16/bf16 and ``metadata: (M, K / 8)`` uint8 as :func:`spmv_takes` requires;
    ``x: (K, 1)`` gives ``(M, 1)``, and with ``rows`` ``x: (1, K)`` gives ``(1, M)`` (``nn.Linear``'s layout). ``bias``:
    contiguous ``(M,)`` of x's dtype or None. fp32 accumulation; CUDA cores, 1.25 bytes per weight read (the library
    is loaded on the first call).

    Raises:
        KernelUnavailable: no GPU/compiler. RuntimeError: shapes, dtypes, alignment or devices the kernel does not take
        (C++ checks)."""
    _ensure_loaded()
    return fastcall.entry("spmv24")(values, metadata, x, bias, relu, rows)


def decode_mm(
    values: torch.Tensor,
    metadata: torch.Tensor,
    x: torch.Tensor,
    bits: int,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """``Y (M, N) = act(A @ X + bias[:, None])`` for a 2:4 weight on the decode kernel (one launch; the plan is built on
    the first call and kept on ``values``), or at N = 1 on the SpMV kernel where :func:`spmv_takes` (no plan).

    Args:
        values: ``(M, K / 2)`` fp16/bf16; metadata: packed in-group indices (uint8, ``formats/nm.py``); x: ``(K, N)``
            CUDA, values' dtype, any strides, 1 <= N <= 16; bits: bits per index; bias: ``(M,)`` or None;
            activation: ``"none"`` or ``"relu"``.

    Returns:
        ``Y (M, N)`` in ``x.dtype``, laid out by ``layout.new_spmm_output``.

    Raises:
        KernelUnavailable: no GPU/compiler. RuntimeError: shapes that do not match the plan (C++ checks).
    """
    _ensure_loaded()
    if bias is not None and (bias.dtype is not x.dtype or not bias.is_contiguous()):
        bias = bias.to(dtype=x.dtype).contiguous()
    if x.shape[1] == 1 and spmv_takes(values, metadata, x, bits):
        return spmv(values, metadata, x, bias, activation == "relu")
    plan = get_plan(values, metadata, bits, x.shape[0])
    return linear(plan, x, bias, activation == "relu")


def spmv_entry() -> Callable[..., torch.Tensor]:
    """The C++ entry ``prunekit_nm24::spmv24`` (``(values, metadata, x, bias, relu, rows)``, as :func:`spmv` calls it;
    :func:`fastcall.entry`'s function, else the ``OpOverload``), for callers that keep it: the runtime's
    ``SparseLinear`` at N = 1. Loads the library on the first call.

    Raises:
        KernelUnavailable: no GPU/compiler."""
    _ensure_loaded()
    return fastcall.entry("spmv24")


def linear_entry() -> Callable[..., torch.Tensor]:
    """The C++ entry ``prunekit_nm24::linear`` (``(plan.buffer, x, bias, relu, cfg)``, as :func:`linear` calls it;
    :func:`fastcall.entry`'s function, else the ``OpOverload``), for callers that keep it with a plan: the runtime's
    ``SparseLinear`` holds it in its per-layer decision, sparing the argument parsing, attribute lookups and this
    module's wrapper on every call. Loads the library on the first call.

    Raises:
        KernelUnavailable: no GPU/compiler."""
    _ensure_loaded()
    return fastcall.entry("linear")


def linear(
    plan: Nm24Plan, x: torch.Tensor, bias: torch.Tensor | None = None, relu: bool = False, rows: bool = False
) -> torch.Tensor:
    """One launch of the kernel's C++ entry ``prunekit_nm24::linear`` on a built plan (its one buffer and packed
    settings). ``x: (K, N)`` CUDA in the plan's dtype, 1 <= N <= 16, gives ``Y (M, N)`` laid out by
    ``layout.new_spmm_output``; with ``rows``, ``x`` is the activations ``(N, K)`` and the result ``Y^T (N, M)``
    (the transposes are made in C++: the runtime's ``SparseLinear`` path). ``bias``: contiguous ``(M,)`` of that dtype
    or None (the library must be loaded: :func:`load`).

    Raises:
        RuntimeError: shapes, dtypes or devices that do not match the plan (C++ checks)."""
    return fastcall.entry("linear")(plan.buffer, x, bias, relu, plan.cfg | ROWS if rows else plan.cfg)
