"""Which mma.sp metadata layout (``nm24.SP_LAYOUTS``) the GPU reads: run the decode kernel's mma.sp variant with
each candidate on fresh random 2:4 weights (fp16 and bf16, N = 1 / 9 / 16, one and several k-chunks) against float64
and print the largest relative error per layout, then ``best_layout=<name>`` (the one within tolerance, or ``none``).
The register-expansion variant runs beside them as a control. GPU machine, repository root: ``PYTHONPATH=src python
scripts/nm24_sp_layout.py``."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests/kernels")
from test_nm24_decode import _cuda24  # noqa: E402

from prunekit.kernels import nm24  # noqa: E402
from prunekit.kernels.testing import TOLERANCE, relative_error, spmm_reference64  # noqa: E402


def worst_error(mma: str, layout: str | None) -> float:
    worst = 0.0
    for i, (m, k) in enumerate(((128, 256), (300, 1000), (64, 4096), (1024, 1024))):
        for dtype in (torch.float16, torch.bfloat16):
            dense, values, metadata, bits = _cuda24(m, k, dtype, seed=i)
            plan = nm24.build_plan(values, metadata, bits, k, mma=mma, sp_layout=layout)
            for n in (1, 9, 16):
                x = torch.randn(n, k, device="cuda").to(dtype).t()
                y = torch.full((n, m), float("nan"), device="cuda", dtype=dtype).t()
                torch.ops.prunekit_nm24.mm.default(
                    plan.vals, plan.meta, plan.ws, plan.counters, x, y, None, False, m, plan.chunk, plan.variant
                )
                err = relative_error(y, spmm_reference64(dense, x, None, "none")) / TOLERANCE[dtype]
                worst = max(worst, err)
    return worst


def main() -> None:
    nm24.load()
    print(f"prmt (control): worst error / tolerance {worst_error('prmt', None):.3g}")
    best = "none"
    for layout in nm24.SP_LAYOUTS:
        ratio = worst_error("sp", layout)
        print(f"sp, layout {layout}: worst error / tolerance {ratio:.3g}")
        if ratio < 1 and best == "none":
            best = layout
    print(f"best_layout={best}")


if __name__ == "__main__":
    main()
