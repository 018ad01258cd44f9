"""The Kronecker-sparse matmul op ``prunekit::ks_mm``: CPU reference, fake impl and CUDA kernels.

``ks_mm(blocks, x, bias=None, activation="none") -> Y (a*b*d, N)`` computes ``Y = act(K @ X + bias[:, None])`` for
one Kronecker-sparse factor ``K`` with pattern ``(a, b, c, d)`` stored as ``blocks: (a, d, b, c)`` (Gonon et al.
2024, "Fast inference with Kronecker-sparse matrices", arXiv 2405.15013, section 2; ``formats/ks.py``), with
``X: (a*c*d, N)`` read in place in either layout: batch-last (row-major ``X``) or batch-first (the column-major
view ``x2d.t()`` of the activations ``x2d: (N, a*c*d)``); ``Y`` follows ``layout.py`` (column-major for a
column-major ``X``). No permutation pass: every ``(alpha, delta)`` block is one dense ``b x c`` tile multiplied
with the strided rows of ``X`` it meets (the paper's section 4 kernel idea), accumulation in fp32.

- CPU: ``ks_reference.ks_mm`` (einsum on the blocks, no dense matrix).
- CUDA (``csrc/ks/``): fp16/bf16 on tensor cores (WMMA 16x16x16 on the ``b x c`` tiles, fp32 accumulators; one
  shared-memory stage, or two with cp.async loads overlapping the mma), fp32 on CUDA cores (register-tiled FMA);
  tile rows and pipelining picked per pattern by :func:`pick_variant` (a measured table once the benchmark has
  run, else the a-priori :func:`pick_tile`). float64 runs the reference on
  the GPU. The extension (``prunekit_ks`` operator namespace) is built on first CUDA use into
  ``build.cache_root()`` in a folder keyed by the sources' sha256, torch and CUDA versions and target archs (the
  same scheme as ``build.py``, whose helpers it uses read-only).

:func:`ks_chain_mm` runs a chain ``K_1 @ ... @ K_L`` factor after factor (``K_L`` first), bias and activation after
``K_1``. Importing this module never fails; CUDA calls without a GPU/compiler raise :class:`KernelUnavailable`.
torch + stdlib only (copied into exported packages).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from . import build, ks_reference, ops, reference
from .layout import new_spmm_output, transposed_io

log = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parent / "csrc" / "ks"
SOURCES = ("ks_mm.cu", "ks_mm_f16.cu", "ks_mm_bf16.cu", "ks_mm_tf32.cu")
HEADERS = ("ks_mm.cuh", "../check.h")
NAMESPACE = "prunekit_ks"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE_ROWS = (64, 128)  # rows of b per CTA the tensor-core kernel is instantiated for (columns of N: 128)
# Two shared-memory stages (cp.async) by default: on the H100 the pipelined variant was the fastest (or within 1%)
# in every variant class of the first 100 patterns of the sweep (benchmarks/results/ks-h100-2026-11-25-part1of1.json).
PIPELINED_DEFAULT = True
# Measured (tile rows, pipelined) per variant_key(), derived by ``benchmarks/ks_report.py`` (the variant with the
# smallest geometric-mean time ratio to the per-pattern fastest variant, fp16 rows) from MEASURED_SOURCE. Keys the
# table lacks fall back to the a-priori rule (pick_tile, PIPELINED_DEFAULT).
MEASURED_VARIANTS: dict[tuple[str, str, str, str], tuple[int, bool]] = {
    ("batch_first", "b%128", "c<=256", "d>1"): (128, True),  # geomean 1.000
    ("batch_first", "b%128", "c<=64", "d>1"): (128, True),  # geomean 1.001
    ("batch_first", "b%128", "c>256", "d=1"): (128, True),  # geomean 1.000
    ("batch_first", "b%128", "c>256", "d>1"): (128, True),  # geomean 1.000
    ("batch_first", "b<=64", "c<=256", "d>1"): (64, True),  # geomean 1.000
    ("batch_first", "b<=64", "c<=64", "d=1"): (64, True),  # geomean 1.001
    ("batch_first", "b<=64", "c<=64", "d>1"): (64, True),  # geomean 1.005
    ("batch_first", "b>64", "c<=256", "d=1"): (128, True),  # geomean 1.000
    ("batch_first", "b>64", "c<=256", "d>1"): (128, True),  # geomean 1.000
    ("batch_first", "b>64", "c<=64", "d=1"): (128, True),  # geomean 1.000
    ("batch_first", "b>64", "c<=64", "d>1"): (128, True),  # geomean 1.000
    ("batch_first", "b>64", "c>256", "d>1"): (128, True),  # geomean 1.008
    ("batch_last", "b%128", "c<=256", "d>1"): (128, True),  # geomean 1.000
    ("batch_last", "b%128", "c<=64", "d>1"): (128, True),  # geomean 1.000
    ("batch_last", "b%128", "c>256", "d=1"): (128, True),  # geomean 1.000
    ("batch_last", "b%128", "c>256", "d>1"): (128, True),  # geomean 1.000
    ("batch_last", "b<=64", "c<=256", "d>1"): (64, True),  # geomean 1.000
    ("batch_last", "b<=64", "c<=64", "d=1"): (64, True),  # geomean 1.000
    ("batch_last", "b<=64", "c<=64", "d>1"): (64, True),  # geomean 1.000
    ("batch_last", "b>64", "c<=256", "d=1"): (128, True),  # geomean 1.000
    ("batch_last", "b>64", "c<=256", "d>1"): (128, True),  # geomean 1.000
    ("batch_last", "b>64", "c<=64", "d=1"): (128, True),  # geomean 1.000
    ("batch_last", "b>64", "c<=64", "d>1"): (64, True),  # geomean 1.001
    ("batch_last", "b>64", "c>256", "d>1"): (128, True),  # geomean 1.000
}
MEASURED_SOURCE: str | None = (
    "benchmarks/results/ks-h100-2026-11-25-part1of1.json: the first 100 patterns of the shuffled sweep "
    "(H100, torch 2.11, fp16 rows); the sweep's later patterns ran with this table"
)

# The batch-first delta-block kernel (delta_block=True) against the best tile variant, H100, fp16, on the 79
# batch-first rows of the sweep that timed it (benchmarks/results/ks-h100-2026-11-25-part1of1.json, variant
# "dblock"): 8 deltas per CTA won every row with c a multiple of 8 or c <= 64 (1.27x-4.38x, median 1.9x) and lost the
# three with c > 256 ragged (0.44x-0.50x: its scalar W path); 4 deltas won where min(b, c) <= 64 (1.16x-1.50x) and
# lost elsewhere (0.67x-0.86x); 2 deltas never won (0.40x-0.96x). The rule separates the 79 rows without error; it
# was read from the same rows (in-sample). bf16 runs the same template and takes the same rule (not timed).
DELTA_BLOCK_SOURCE = "benchmarks/results/ks-h100-2026-11-25-part1of1.json (79 fp16 batch-first rows, variant dblock)"
# d = 1 (block-diagonal K: a independent b x c blocks) is a plain batched GEMM with no permutation, and cuBLAS's
# batched GEMM beat every variant of the tile kernel on the H100 sweep there: the fastest variant reached a median
# 0.19x-0.39x of torch.bmm per dtype and layout, and won 1 of the 94 d = 1 rows (same file). So with its defaults
# ks_mm_cuda hands d = 1 to block_diagonal_mm (torch.bmm on views of X and Y).
BLOCK_DIAGONAL_TO_CUBLAS = True

__all__ = [
    "ks_mm",
    "ks_chain_mm",
    "ks_mm_cuda",
    "load",
    "is_loaded",
    "pick_tile",
    "pick_variant",
    "variant_key",
    "delta_block_fits",
    "delta_block_width",
    "pick_delta_block",
    "pick_delta_block_packed",
    "uses_delta_block",
    "block_diagonal_mm",
]


def pick_tile(b: int, c: int, dtype: torch.dtype) -> int:
    """Rows of ``b`` one CTA computes: 128 when ``b`` is a multiple of 128 (fewer re-reads of X), else 64 (less
    padding waste for b = 48, 96, 192, ...). fp32 always uses 128 x 128 tiles of 8 x 8 per thread.

    An a-priori rule, not yet a measured one: ``benchmarks/ks.py`` times both tile sizes per pattern to replace it.
    """
    if dtype == torch.float32:
        return 128
    return 128 if b % 128 == 0 else 64


def variant_key(b: int, c: int, d: int, batch_first: bool) -> tuple[str, str, str, str]:
    """Class of a pattern for the measured variant table: ``(layout, b class, c class, d class)``.

    ``layout``: ``"batch_first"`` | ``"batch_last"``; b: ``"b%128"`` (a multiple of 128: 128-row tiles waste
    nothing), ``"b<=64"`` or ``"b>64"``; c: ``"c<=64"``, ``"c<=256"`` or ``"c>256"`` (k-steps of 32 per tile, the
    pipelined variant's overlap needs several); d: ``"d=1"`` or ``"d>1"`` (batch-first gathers X at stride d).
    """
    b_class = "b%128" if b % 128 == 0 else ("b<=64" if b <= 64 else "b>64")
    c_class = "c<=64" if c <= 64 else ("c<=256" if c <= 256 else "c>256")
    return ("batch_first" if batch_first else "batch_last", b_class, c_class, "d=1" if d == 1 else "d>1")


def pick_variant(b: int, c: int, d: int, dtype: torch.dtype, batch_first: bool = False) -> tuple[int, bool]:
    """``(tile_rows, pipelined)`` for a pattern: the measured table :data:`MEASURED_VARIANTS` when it has the
    pattern's :func:`variant_key`, else the a-priori rule ``(pick_tile(b, c, dtype), PIPELINED_DEFAULT)``.
    fp32 (CUDA cores) has one variant: ``(128, False)``.
    """
    if dtype == torch.float32:
        return 128, False
    measured = MEASURED_VARIANTS.get(variant_key(b, c, d, batch_first))
    if measured is not None:
        return int(measured[0]), bool(measured[1])
    return pick_tile(b, c, dtype), PIPELINED_DEFAULT


def pick_delta_block(b: int, c: int, width: int) -> bool:
    """Whether the batch-first delta-block kernel beats the tile kernels for a pattern, by the rule measured on the
    H100 (:data:`DELTA_BLOCK_SOURCE`): ``width`` 8 (deltas per CTA, :func:`delta_block_width`) when ``c`` is a
    multiple of 8 or ``c <= 64``; ``width`` 4 when ``min(b, c) <= 64``; never for ``width`` 2 (or 0: it cannot run).
    """
    if width == 8:
        return c % 8 == 0 or c <= 64
    if width == 4:
        return min(b, c) <= 64
    return False


def pick_delta_block_packed(b: int, c: int, d: int) -> bool:
    """:func:`pick_delta_block` for packed, 16-byte aligned batch-first X and Y (row strides ``a*c*d`` and ``a*b*d``,
    multiples of ``d``), where the width is the largest of 8, 4, 2 that divides ``d`` (as in the benchmark)."""
    return pick_delta_block(b, c, next((w for w in (8, 4, 2) if d % w == 0), 0))


def block_diagonal_mm(
    blocks: torch.Tensor, x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none"
) -> torch.Tensor:
    """``y (a*b, N) = act(blockdiag(blocks) @ x + bias[:, None])`` for a factor with ``d = 1``, by ``torch.bmm``
    (cuBLAS batched GEMM on CUDA) on views: batch-last ``x`` (row-major) is read in place, batch-first ``x`` (the
    ``x2d.t()`` view of ``(N, a*c)``) as a strided operand; the product lands in ``y`` directly when ``y`` is
    row-major and packed, else through one copy (as the benchmark's ``bmm`` baseline does).

    Args:
        blocks: ``(a, 1, b, c)``; x: ``(a*c, N)`` any strides; y: ``(a*b, N)`` output, any strides, written in full;
        bias: ``(a*b,)`` or None; activation: ``"none"`` | ``"relu"``. All of one dtype and device.

    Returns:
        ``y``.

    Raises:
        ValueError: ``d != 1`` or shapes that do not match.
    """
    a, b, c, d = ks_reference.check_ks_args(blocks, x)
    n = x.shape[1]
    if d != 1 or tuple(y.shape) != (a * b, n):
        raise ValueError(f"block_diagonal_mm: needs d = 1 and y of shape ({a * b}, {n}), got d = {d}, {tuple(y.shape)}")
    w = blocks.reshape(a, b, c)
    if transposed_io(x):  # batch-first: x = x2d.t(), x2d (N, a*c) row-major
        xs = x.t().reshape(n, a, c).permute(1, 2, 0)  # (a, c, N), strided, no copy
    else:
        xs = x.reshape(a, c, n)
    if y.is_contiguous():
        torch.bmm(w, xs, out=y.view(a, b, n))
    else:
        y.copy_(torch.bmm(w, xs).reshape(a * b, n))
    if bias is not None:
        y.add_(bias.to(y.dtype)[:, None])
    if activation == "relu":
        y.relu_()
    return y


def uses_delta_block(blocks: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> bool:
    """True when :func:`ks_mm_cuda` with its defaults runs the delta-block kernel for these tensors: fp16/bf16,
    batch-first x and y that fit it (:func:`delta_block_fits`) and :func:`pick_delta_block` says it pays.

    Args:
        blocks: ``(a, d, b, c)``; x: ``(a*c*d, N)``; y: ``(a*b*d, N)``.
    """
    if x.dtype not in (torch.float16, torch.bfloat16) or not transposed_io(x) or delta_block_fits(blocks, x, y):
        return False
    return pick_delta_block(int(blocks.shape[2]), int(blocks.shape[3]), delta_block_width(blocks, x, y))


EXTENSION = build.Extension(
    namespace=NAMESPACE,
    prefix=NAMESPACE,
    csrc_dir=CSRC_DIR,
    sources=SOURCES,
    headers=HEADERS,
    probe="ks_mm_out",
    description="Kronecker-sparse CUDA kernels",
)


def is_loaded() -> bool:
    """True when the ``prunekit_ks`` operators are registered in this process."""
    return build.extension_loaded(EXTENSION)


def load(verbose: bool = False) -> Path | None:
    """Make the ``prunekit_ks`` operators available, compiling them on first use (about a minute).

    Returns:
        Path of the loaded library, or None when another copy registered the operators first.

    Raises:
        KernelUnavailable: no CUDA torch, no GPU of sm_80 or newer, no nvcc/ninja, or the compilation failed.
    """
    return build.load_extension(EXTENSION, verbose)


def _check_activation(activation: str) -> None:
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; known: {', '.join(reference.ACTIVATIONS)}")


def ks_mm_cuda(
    blocks: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    out: torch.Tensor | None = None,
    tile_rows: int | None = None,
    pipelined: bool | None = None,
    delta_block: bool | None = None,
    tf32x3: bool = False,
) -> torch.Tensor:
    """CUDA ``Y (a*b*d, N) = act(K @ X + bias[:, None])`` for one KS factor (Gonon et al. 2024, section 4).

    Args:
        blocks: ``(a, d, b, c)`` fp16/bf16 (tensor cores) or fp32 (CUDA cores), same dtype as ``x`` (else the
            reference runs on the GPU); x: ``(a*c*d, N)`` any strides (read in place); bias: ``(a*b*d,)`` or None;
            activation: ``"none"`` | ``"relu"``; out: optional ``(a*b*d, N)`` output of ``x``'s dtype, any strides;
            tile_rows: override :func:`pick_variant`'s tile (64 or 128; fp16/bf16 only); pipelined: two
            shared-memory stages with cp.async (default: :func:`pick_variant`'s; fp16/bf16 only); delta_block: the
            batch-first kernel that gives a CTA 8, 4 or 2 consecutive deltas so that X and Y move in vectors of
            that many elements (fp16/bf16, conditions in :func:`delta_block_fits`); None (default): taken when
            ``tile_rows``, ``pipelined`` and ``tf32x3`` are not given and :func:`uses_delta_block` says so (the
            measured rule :func:`pick_delta_block`). With all four of these left at their defaults, ``d = 1`` runs
            :func:`block_diagonal_mm` (cuBLAS batched GEMM, measured faster; ``BLOCK_DIAGONAL_TO_CUBLAS``);
            tf32x3: fp32 on tensor cores with the 3xTF32 split (hi*hi + hi*lo + lo*hi in fp32; float32 only; never
            picked by default: on the H100 its first version reached a relative error of 1.35e-5 against float64 for
            c = 903, above the 1e-5 its test asks; the round-to-nearest partial sums that fix it in a rounding model
            are not yet run on a GPU, and it is not timed).

    Returns:
        ``Y`` in ``x.dtype``, laid out by ``layout.new_spmm_output`` unless ``out`` is given.

    Raises:
        KernelUnavailable: no GPU/compiler. ValueError: bad activation, shapes or ``tile_rows``, or ``delta_block``
        for tensors that do not fit it.
    """
    _check_activation(activation)
    a, b, c, d = ks_reference.check_ks_args(blocks, x)
    m = a * b * d
    if x.dtype not in KERNEL_DTYPES or blocks.dtype != x.dtype:
        y = ks_reference.ks_mm(blocks, x, bias, activation)
        return y if out is None else out.copy_(y)
    load()
    y = new_spmm_output(x, m) if out is None else out
    if tuple(y.shape) != (m, x.shape[1]) or y.dtype != x.dtype:
        raise ValueError(f"out must be a ({m}, {x.shape[1]}) {x.dtype} tensor")
    if m == 0 or x.shape[1] == 0:
        return y
    if c == 0:
        return y.copy_(ks_reference.ks_mm(blocks, x, bias, activation))
    defaults = tile_rows is None and pipelined is None and delta_block is None and not tf32x3
    if d == 1 and defaults and BLOCK_DIAGONAL_TO_CUBLAS:
        return block_diagonal_mm(blocks, x, y, bias, activation)
    auto_tile, auto_pipe = pick_variant(b, c, d, x.dtype, transposed_io(x))
    tile = tile_rows or auto_tile
    if tile not in TILE_ROWS:
        raise ValueError(f"tile_rows must be one of {TILE_ROWS}, got {tile}")
    if bias is not None:
        bias = bias.to(dtype=x.dtype).contiguous()
    pipe = int(auto_pipe if pipelined is None else bool(pipelined))
    blocks = blocks.contiguous()
    if delta_block is None:
        delta_block = tile_rows is None and pipelined is None and not tf32x3 and uses_delta_block(blocks, x, y)
    if delta_block:
        why = delta_block_fits(blocks, x, y)
        if why:
            raise ValueError(f"delta_block: {why}")
        pipe = 2  # the C++ entry's code for the delta-block kernel
    if tf32x3:
        if x.dtype != torch.float32:
            raise ValueError(f"tf32x3: float32 only, got {x.dtype}")
        pipe = 3  # the C++ entry's code for the 3xTF32 kernel
    torch.ops.prunekit_ks.ks_mm_out(blocks, x, y, bias, activation == "relu", tile, pipe)
    return y


def delta_block_width(blocks: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> int:
    """Deltas per CTA the batch-first delta-block kernel would use for these tensors: the largest of 8, 4, 2 that
    divides ``d``, both row strides and both data pointers (in elements); 0 when none does or the layout is not
    batch-first. Mirrors ``dblock_width`` in ``csrc/ks/ks_mm.cuh``.

    Args:
        blocks: ``(a, d, b, c)``; x: ``(a*c*d, N)``; y: ``(a*b*d, N)``.
    """
    if x.stride(0) != 1 or y.stride(0) != 1:
        return 0
    d = int(blocks.shape[1])
    elt = x.element_size()

    def align(t: torch.Tensor) -> int:
        ptr = t.data_ptr()
        nbytes = 16 if ptr % 16 == 0 else 8 if ptr % 8 == 0 else 4 if ptr % 4 == 0 else 2 if ptr % 2 == 0 else 1
        return max(1, nbytes // elt)  # 1: no vector width divides it

    # with one column (N == 1) the column stride is never used: any value fits
    sxn, syn = (x.stride(1), y.stride(1)) if x.shape[1] > 1 else (0, 0)
    for width in (8, 4, 2):
        if d % width == 0 and sxn % width == 0 and syn % width == 0:
            if align(x) % width == 0 and align(y) % width == 0:
                return width
    return 0


def delta_block_fits(blocks: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> str | None:
    """Why the batch-first delta-block kernel cannot take these tensors, or None when it can.

    Args:
        blocks: ``(a, d, b, c)`` contiguous; x: ``(a*c*d, N)``; y: ``(a*b*d, N)``.

    It needs fp16/bf16, batch-first X and Y (``stride(0) == 1``: the ``x2d.t()`` views of row-major ``(N,
    features)`` matrices), an even ``d`` with the row strides and data pointers divisible by the chosen width
    (:func:`delta_block_width`: 8, 4 or 2 deltas per CTA) and 16-byte aligned blocks.
    """
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"needs float16 or bfloat16, got {x.dtype}"
    for name, t in (("x", x), ("y", y)):
        if t.stride(0) != 1:
            return f"needs batch-first {name} (stride(0) == 1), got strides {tuple(t.stride())}"
    d = int(blocks.shape[1])
    if d % 2:
        return f"needs an even d (8, 4 or 2 deltas per CTA), got d = {d}"
    if blocks.data_ptr() % 16:
        return "needs 16-byte aligned blocks"
    if not delta_block_width(blocks, x, y):
        return "needs row strides and data pointers of x and y divisible by 2 elements or more (as d is)"
    return None


def _ks_mm_cpu(
    blocks: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none"
) -> torch.Tensor:
    return ks_reference.ks_mm(blocks, x, bias, activation)


def _ks_mm_fake(blocks, x, bias=None, activation="none"):
    return new_spmm_output(x, int(blocks.shape[0]) * int(blocks.shape[2]) * int(blocks.shape[1]))


def _ks_mm_cuda(blocks, x, bias=None, activation="none"):
    return ks_mm_cuda(blocks, x, bias, activation)


ks_mm = ops._define("ks_mm", _ks_mm_cpu, _ks_mm_fake, _ks_mm_cuda)
"""``prunekit::ks_mm(blocks, x, bias=None, activation="none")``: ``Y = act(K @ X + bias[:, None])`` for a
Kronecker-sparse factor ``blocks: (a, d, b, c)`` and ``x: (a*c*d, N)`` (any strides; batch-first ``x2d.t()`` gives a
column-major Y). CPU: ``ks_reference.ks_mm``; CUDA: :func:`ks_mm_cuda`."""


def ks_chain_mm(
    factors: list[torch.Tensor],
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """``Y = act(K_1 @ ... @ K_L @ X + bias[:, None])`` through ``prunekit::ks_mm``, ``K_L`` first.

    Args:
        factors: blocks ``[(a_i, d_i, b_i, c_i), ...]``, ``K_1`` first; x: ``(K, N)`` any strides; bias: ``(M,)``.

    Returns:
        ``Y (M, N)`` in ``x.dtype`` (intermediates in ``x.dtype`` too), laid out like ``layout.new_spmm_output``.
    """
    y = x
    for i, blk in enumerate(reversed(factors)):
        last = i == len(factors) - 1
        y = ks_mm(blk, y, bias if last else None, activation if last else "none")
    return y
