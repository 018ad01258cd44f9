"""``prunekit kernels check``: run every CUDA op on fresh random inputs against its float64 reference.

Each case poisons the output (NaN) first, so an unwritten element fails the check. torch only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import build, gpu, nm24, structured
from .testing import (
    TOLERANCE,
    encode_csr,
    env_setting,
    random_block_sparse_weight,
    random_sparse_weight,
    relative_error,
    sddmm_reference64,
    spmm_reference64,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BSR_BLOCKS = ((16, 16), (32, 32), (64, 64), (16, 64))  # square blocks of each size and one rectangular shape
BSR_NS = (1, 13, 130)  # tokens: one, odd below the 16-token tile, odd above one 128-token tile
CSLT_NS = (37, 300)  # tokens past the 2:4 decode kernel's 16, where nm_mm runs on cuSPARSELt


@dataclass(frozen=True)
class KernelCheck:
    """One op/variant/dtype/layout case: relative error vs float64, its bound, and the first-call time."""

    op: str
    variant: str
    dtype: str
    layout: str
    shape: str
    rel_error: float
    tolerance: float
    elapsed_ms: float

    @property
    def passed(self) -> bool:
        return self.rel_error <= self.tolerance


def required_extensions() -> list[build.Extension]:
    """The libraries :func:`run_checks` calls: SpMM/SDDMM, structured (BSR), nm24 (2:4 decode), and prunekit's
    cuSPARSELt binding where torch's cuSPARSELt wheel is installed."""
    cslt = structured.cslt_extension_here()
    return [build.MAIN, structured.EXTENSION, nm24.EXTENSION, *([cslt] if cslt else [])]


def run_checks(seed: int = 0, device: str = "cuda") -> list[KernelCheck]:
    """Check every op of the SpMM and structured libraries on CUDA against float64, output poisoned with NaN first:

    - ``spmm_csr`` (every variant, ``dense`` included, ``tc``, ``scatter``, ``bitmap`` and the lean bitmap kernel for
      fp16/bf16; row-major and transposed X, bias + ReLU; rowwarp's SpMV kernel at N = 1 and its 4-token tile on a
      taller weight) and ``sddmm_csr``, per dtype: M=77 (1067 for the tile), K=203 (odd), N from 1 to 264 (odd and
      vector-aligned), with empty rows and single-entry rows;
    - the 2:4 decode kernel (``nm24``: both inner products and the lean kernel, fp16/bf16) and 2:4 SpMV
      (``$PRUNEKIT_NM24_LEAN`` set for each call as its case asks);
    - ``bsr_mm`` in dynamic and static mode (:func:`_bsr_checks`) and ``nm_mm`` on cuSPARSELt (:func:`_cslt_checks`),
      fp16/bf16.

    The libraries are built first, side by side (:func:`build.build_many`).

    Raises:
        KernelUnavailable: a library cannot be built or loaded here.
    """
    build.build_many(required_extensions())
    gen = torch.Generator(device=device).manual_seed(seed)
    results: list[KernelCheck] = []
    m, k = 77, 203
    for dtype in DTYPES:
        dense = random_sparse_weight(m, k, 0.8, dtype, device, gen, empty_rows=3, single_rows=3)
        csr = encode_csr(dense)
        bias = torch.randn(m, generator=gen, device=device).to(dtype)
        cases = [
            ("rowwarp", 1),  # the SpMV kernel (csrc/spmv_csr.cu)
            ("rowwarp", 5),
            ("rowwarp", 16),
            ("rowwarp_global", 16),
            ("direct", 37),
            ("direct", 264),
            ("tiled", 37),
            ("dense", 1),  # the weight decompressed, then cuBLAS (csrc/spmm_dense.cu); "auto" takes it from N = 65
            ("dense", 264),
        ]
        if dtype in gpu.TC_DTYPES:
            cases += [("tc", 37), ("tc", 264), ("scatter", 1), ("scatter", 13), ("bitmap", 1), ("bitmap", 13)]
            cases += [("bitmap-lean", 1), ("bitmap-lean", 13)]  # the lean kernel on the bitmap plan, forced on
        # the SpMV kernel's 4-token tile needs 8 rows per SM: a taller weight of the same K
        tall = random_sparse_weight(8 * 132 + 11, k, 0.8, dtype, device, gen, empty_rows=3, single_rows=3)
        tall_bias = torch.randn(tall.shape[0], generator=gen, device=device).to(dtype)
        weights = [(dense, csr, bias, variant, n) for variant, n in cases]
        weights.append((tall, encode_csr(tall), tall_bias, "rowwarp", 3))
        for w, c, b, variant, n in weights:
            rows = w.shape[0]
            label = variant
            if variant == "rowwarp" and gpu.spmv_takes(rows, k, n, w.element_size(), gpu._sm_count(w.device)):
                label = "rowwarp (SpMV)" if n == 1 else "rowwarp (SpMV tile)"
            for layout in LAYOUTS:
                x, out = _operands(rows, k, n, layout, dtype, gen, device)
                with _lean_switch(variant):
                    kernel = variant.removesuffix("-lean")
                    _, elapsed = _timed(
                        gpu.spmm_csr, **c, x=x, m=rows, bias=b, activation="relu", variant=kernel, out=out
                    )
                ref = spmm_reference64(w, x, b, "relu")
                results.append(
                    KernelCheck(
                        "spmm_csr",
                        label,
                        str(dtype).removeprefix("torch."),
                        layout,
                        f"{rows}x{k}x{n}",
                        relative_error(out, ref),
                        TOLERANCE[dtype],
                        elapsed,
                    )
                )
        a = torch.randn(m, 29, generator=gen, device=device).to(dtype)
        b = torch.randn(k, 29, generator=gen, device=device).to(dtype)
        out = torch.full((csr["values"].numel(),), float("nan"), dtype=dtype, device=device)
        _, elapsed = _timed(gpu.sddmm_csr, csr["row_offsets"], csr["column_indices"], csr["row_indices"], a, b, out=out)
        if dtype in nm24.DTYPES:
            results += _nm24_checks(m, dtype, gen, device)
        results.append(
            KernelCheck(
                "sddmm_csr",
                "warp-per-entry",
                str(dtype).removeprefix("torch."),
                "row-major",
                f"{m}x{k}, K=29",
                relative_error(out, sddmm_reference64(csr, a, b)),
                TOLERANCE[dtype],
                elapsed,
            )
        )
    for dtype in (torch.float16, torch.bfloat16):
        results += _bsr_checks(dtype, gen, device)
        results += _cslt_checks(dtype, gen, device)
    return results


LAYOUTS = ("row-major", "transposed")


def _timed(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), milliseconds)``: the wall time of one call between two device synchronizations (a first
    call's time, so build and plan work included)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    torch.cuda.synchronize()
    return result, (time.perf_counter() - start) * 1e3


def _operands(
    m: int, k: int, n: int, layout: str, dtype: torch.dtype, gen: torch.Generator, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``x: (K, N)`` (``"transposed"``: the ``x2d.t()`` view of nn.Linear's ``(N, K)`` activations, else
    row-major) and an ``(M, N)`` output of the matching layout filled with NaN."""
    x2d = torch.randn(n, k, generator=gen, device=device).to(dtype)
    if layout == "transposed":
        return x2d.t(), torch.full((n, m), float("nan"), dtype=dtype, device=device).t()
    return x2d.t().contiguous(), torch.full((m, n), float("nan"), dtype=dtype, device=device)


def _random_24(
    m: int, k: int, dtype: torch.dtype, gen: torch.Generator, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A random 2:4 weight ``(m, k)`` (the 2 largest of every 4) and its ``nm`` format: (dense, values, metadata,
    bits)."""
    from .. import formats

    w = torch.randn(m, k // 4, 4, generator=gen, device=device)
    keep = torch.zeros_like(w, dtype=torch.bool).scatter_(2, w.abs().topk(2, dim=2).indices, True)
    dense = (w * keep).reshape(m, k).to(dtype)
    enc = formats.encode("nm", dense, {"n": 2, "m": 4})
    return dense, enc.components["values"], enc.components["metadata"], int(enc.params["bits"])


def _bsr_checks(dtype: torch.dtype, gen: torch.Generator, device: str) -> list[KernelCheck]:
    """``bsr_mm`` (dynamic mode) and ``bsr_mm_static`` (the schedule of ``formats.bsr.static_schedule`` with items of
    one block, so the dense block row is split and summed in fp32) on a ``(192, 320)`` weight per block shape of
    :data:`BSR_BLOCKS` (an empty block row, a one-block row, a dense row), bias + ReLU: the mma.sync kernel, the sm_90a
    wgmma kernel where it runs, and the lean decode kernel (``$PRUNEKIT_BSR_LEAN``, N <= 13). One row per case: the
    worst error over N in :data:`BSR_NS` and both X layouts, and the first call's time."""
    from .. import formats
    from ..formats.bsr import static_schedule

    m, k = 192, 320
    variants = ["mma", "wgmma"] if structured.wgmma_available() else ["mma"]
    cases = [(v, mode) for v in variants for mode in ("dynamic", "static")] + [("lean", "dynamic")]
    results = []
    for r, c in BSR_BLOCKS:
        dense = random_block_sparse_weight(m, k, r, c, 0.3, dtype, device, gen)
        comp = {
            key: t.to(device)
            for key, t in formats.encode("bsr", dense.cpu(), {"block_rows": r, "block_cols": c}).components.items()
        }
        schedule = tuple(t.to(device) for t in static_schedule(comp["crow_indices"], chunk=1))
        bias = torch.randn(m, generator=gen, device=device).to(dtype)
        for variant, mode in cases:
            ns = tuple(n for n in BSR_NS if n <= 16) if variant == "lean" else BSR_NS
            worst, first_ms = 0.0, None
            with env_setting(structured.LEAN_ENV, "1" if variant == "lean" else "0"):
                for n in ns:
                    for layout in LAYOUTS:
                        x, out = _operands(m, k, n, layout, dtype, gen, device)
                        _, ms = _timed(
                            structured.bsr_mm_cuda,
                            comp["blocks"], comp["crow_indices"], comp["col_indices"], x, m, bias, "relu",
                            *(schedule if mode == "static" else (None, None)),
                            out=out, variant=None if variant == "lean" else variant,
                        )  # fmt: skip
                        first_ms = ms if first_ms is None else first_ms
                        worst = max(worst, relative_error(out, spmm_reference64(dense, x, bias, "relu")))
            results.append(
                KernelCheck(
                    "bsr_mm_static" if mode == "static" else "bsr_mm",
                    f"{variant} {r}x{c}",
                    str(dtype).removeprefix("torch."),
                    "both",
                    f"{m}x{k}x{'/'.join(map(str, ns))}",
                    worst,
                    TOLERANCE[dtype],
                    first_ms,
                )  # fmt: skip
            )
    return results


def _cslt_checks(dtype: torch.dtype, gen: torch.Generator, device: str) -> list[KernelCheck]:
    """``nm_mm`` on a ``(128, 256)`` 2:4 weight at N in :data:`CSLT_NS` (cuSPARSELt's range), bias + ReLU, both X
    layouts: prunekit's cuSPARSELt binding with both output layouts where it loads, and torch's ``_cslt_sparse_mm``
    path. None where this torch has no cuSPARSELt. The output is returned by the op, so the poison is a freed NaN
    block of its size just before the call (the caching allocator hands the same block back)."""
    if not structured.cusparselt_available():
        return []
    m, k = 128, 256
    dense, values, metadata, bits = _random_24(m, k, dtype, gen, device)
    bias = torch.randn(m, generator=gen, device=device).to(dtype)
    backends = [("torch", None)]
    if structured.native_cslt_available():
        backends = [("cslt", "col"), ("cslt", "row"), *backends]
    results = []
    for backend, output in backends:
        for n in CSLT_NS:
            for layout in LAYOUTS:
                x, out = _operands(m, k, n, layout, dtype, gen, device)
                del out  # freed: the output's block starts as NaN
                y, elapsed = _timed(
                    structured.nm_mm_cuda, values, metadata, x, 2, 4, bits, bias, "relu", backend=backend, output=output
                )
                results.append(
                    KernelCheck(
                        "nm_mm (2:4 cuSPARSELt)",
                        backend if output is None else f"{backend} ({output}-major Y)",
                        str(dtype).removeprefix("torch."),
                        layout,
                        f"{m}x{k}x{n}",
                        relative_error(y, spmm_reference64(dense, x, bias, "relu")),
                        TOLERANCE[dtype],
                        elapsed,
                    )  # fmt: skip
                )
    return results


def _lean_switch(variant: str):
    """``$PRUNEKIT_NM24_LEAN`` for one check's calls (the nm24 launcher reads it at each call): on for the variants
    named ``...-lean``, off for the others."""
    return env_setting(nm24.LEAN_ENV, "1" if variant.endswith("-lean") else "0")


def _nm24_checks(m: int, dtype: torch.dtype, gen: torch.Generator, device: str) -> list[KernelCheck]:
    """The 2:4 decode kernel (``kernels/nm24.py``) on an ``(m, 204)`` 2:4 weight (K not a multiple of 16), N = 1 / 13 /
    16, both X layouts, bias + ReLU, mma.sp, the register expansion and the lean kernel (``$PRUNEKIT_NM24_LEAN=1`` for
    its calls only); the 2:4 SpMV kernel on an ``(m, 208)`` weight, both x layouts."""
    k = 204
    nm24.load()
    dense, values, metadata, bits = _random_24(m, k, dtype, gen, device)
    bias = torch.randn(m, generator=gen, device=device).to(dtype)
    results = []
    for variant in ("sp", "prmt", "sp-lean"):  # sp-lean: the lean kernel on the mma.sp plan, forced on
        plan = nm24.build_plan(values, metadata, bits, k, mma=variant.removesuffix("-lean"))
        for n in (1, 13, 16):
            for layout in LAYOUTS:
                x, out = _operands(m, k, n, layout, dtype, gen, device)
                with _lean_switch(variant):
                    _, elapsed = _timed(
                        torch.ops.prunekit_nm24.mm.default,
                        plan.vals,
                        plan.meta,
                        plan.ws,
                        plan.counters,
                        x,
                        out,
                        bias,
                        True,
                        m,
                        plan.chunk,
                        plan.variant,
                        plan.ring,
                        plan.batch,
                    )
                error = relative_error(out, spmm_reference64(dense, x, bias, "relu"))
                results.append(
                    KernelCheck(
                        "nm_mm (2:4 decode)",
                        variant,
                        str(dtype).removeprefix("torch."),
                        layout,
                        f"{m}x{k}x{n}",
                        error,
                        TOLERANCE[dtype],
                        elapsed,
                    )  # fmt: skip
                )
    # the 2:4 SpMV kernel (N = 1, the stored format; K a multiple of 16)
    k = 208
    dense, values, metadata, bits = _random_24(m, k, dtype, gen, device)
    for rows in (False, True):
        x = torch.randn(k, 1, generator=gen, device=device).to(dtype)
        torch.full((m,), float("nan"), dtype=dtype, device=device)  # freed: the output's block starts as NaN
        y, elapsed = _timed(nm24.spmv, values, metadata, x.t() if rows else x, bias, True, rows=rows)
        error = relative_error(y.t() if rows else y, spmm_reference64(dense, x, bias, "relu"))
        layout = "(1, K) rows" if rows else "(K, 1)"
        results.append(
            KernelCheck(
                "nm_mm (2:4 SpMV)",
                "spmv24",
                str(dtype).removeprefix("torch."),
                layout,
                f"{m}x{k}x1",
                error,
                TOLERANCE[dtype],
                elapsed,
            )  # fmt: skip
        )
    return results
