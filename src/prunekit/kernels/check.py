"""``prunekit kernels check``: run every CUDA op on fresh random inputs against its float64 reference.

Each case poisons the output (NaN) first, so an unwritten element fails the check. torch only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import build, gpu, nm24
from .testing import (
    TOLERANCE,
    encode_csr,
    env_setting,
    random_sparse_weight,
    relative_error,
    sddmm_reference64,
    spmm_reference64,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


def run_checks(seed: int = 0, device: str = "cuda") -> list[KernelCheck]:
    """Check ``spmm_csr`` (every variant, ``dense`` included, ``tc``, ``scatter``, ``bitmap`` and the lean bitmap kernel for fp16/bf16;
    row-major and transposed X, bias + ReLU; rowwarp's SpMV kernel at N = 1 and its 4-token tile on a taller weight),
    the 2:4 decode kernel (``nm24``: both inner products and the lean kernel, fp16/bf16) and 2:4 SpMV, and
    ``sddmm_csr`` per dtype. The lean kernels' switch (``$PRUNEKIT_NM24_LEAN``) is set for each call as its case asks.

    M=77 (1067 for the tile), K=203 (odd), N from 1 to 264 (odd and vector-aligned), with empty rows and single-entry
    rows.

    Raises:
        KernelUnavailable: the extension cannot be built or loaded here.
    """
    build.load()
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
            for layout in ("row-major", "transposed"):
                x2d = torch.randn(n, k, generator=gen, device=device).to(dtype)
                x = x2d.t() if layout == "transposed" else x2d.t().contiguous()
                out = torch.full((rows, n), float("nan"), dtype=dtype, device=device)
                if layout == "transposed":
                    out = torch.full((n, rows), float("nan"), dtype=dtype, device=device).t()
                torch.cuda.synchronize()
                start = time.perf_counter()
                with _lean_switch(variant):
                    kernel = variant.removesuffix("-lean")
                    gpu.spmm_csr(**c, x=x, m=rows, bias=b, activation="relu", variant=kernel, out=out)
                torch.cuda.synchronize()
                elapsed = (time.perf_counter() - start) * 1e3
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
        torch.cuda.synchronize()
        start = time.perf_counter()
        gpu.sddmm_csr(csr["row_offsets"], csr["column_indices"], csr["row_indices"], a, b, out=out)
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
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
    return results


def _lean_switch(variant: str):
    """``$PRUNEKIT_NM24_LEAN`` for one check's calls (the nm24 launcher reads it at each call): on for the variants
    named ``...-lean``, off for the others."""
    return env_setting(nm24.LEAN_ENV, "1" if variant.endswith("-lean") else "0")


def _nm24_checks(m: int, dtype: torch.dtype, gen: torch.Generator, device: str) -> list[KernelCheck]:
    """The 2:4 decode kernel (``kernels/nm24.py``) on an ``(m, 204)`` 2:4 weight (K not a multiple of 16), N = 1 / 13 /
    16, both X layouts, bias + ReLU, mma.sp, the register expansion and the lean kernel (``$PRUNEKIT_NM24_LEAN=1`` for
    its calls only); the 2:4 SpMV kernel on an ``(m, 208)`` weight, both x layouts."""
    from .. import formats

    k = 204
    nm24.load()
    w = torch.randn(m, k // 4, 4, generator=gen, device=device)
    keep = torch.zeros_like(w, dtype=torch.bool).scatter_(2, w.abs().topk(2, dim=2).indices, True)
    dense = (w * keep).reshape(m, k).to(dtype)
    enc = formats.encode("nm", dense, {"n": 2, "m": 4})
    values, metadata, bits = enc.components["values"], enc.components["metadata"], int(enc.params["bits"])
    bias = torch.randn(m, generator=gen, device=device).to(dtype)
    results = []
    for variant in ("sp", "prmt", "sp-lean"):  # sp-lean: the lean kernel on the mma.sp plan, forced on
        plan = nm24.build_plan(values, metadata, bits, k, mma=variant.removesuffix("-lean"))
        for n in (1, 13, 16):
            for layout in ("row-major", "transposed"):
                x2d = torch.randn(n, k, generator=gen, device=device).to(dtype)
                x = x2d.t() if layout == "transposed" else x2d.t().contiguous()
                out = torch.full((n, m) if layout == "transposed" else (m, n), float("nan"), dtype=dtype, device=device)
                out = out.t() if layout == "transposed" else out
                torch.cuda.synchronize()
                start = time.perf_counter()
                with _lean_switch(variant):
                    torch.ops.prunekit_nm24.mm.default(
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
                torch.cuda.synchronize()
                elapsed = (time.perf_counter() - start) * 1e3
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
    w = torch.randn(m, k // 4, 4, generator=gen, device=device)
    keep = torch.zeros_like(w, dtype=torch.bool).scatter_(2, w.abs().topk(2, dim=2).indices, True)
    dense = (w * keep).reshape(m, k).to(dtype)
    enc = formats.encode("nm", dense, {"n": 2, "m": 4})
    values, metadata, bits = enc.components["values"], enc.components["metadata"], int(enc.params["bits"])
    for rows in (False, True):
        x = torch.randn(k, 1, generator=gen, device=device).to(dtype)
        torch.full((m,), float("nan"), dtype=dtype, device=device)  # freed: the output's block starts as NaN
        torch.cuda.synchronize()
        start = time.perf_counter()
        y = nm24.spmv(values, metadata, x.t() if rows else x, bias, True, rows=rows)
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
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
