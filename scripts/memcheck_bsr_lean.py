"""Small cases of the lean BSR decode kernel for compute-sanitizer (run from the repository root on the GPU machine):

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/memcheck_bsr_lean.py

Every block shape of the kernel at N = 1, 9, 17 and 32 ($PRUNEKIT_BSR_LEAN_MAX_N=32: all of its instances, 1, 2 and 4
n-tiles), fp16 and bf16, static and dynamic mode, both X layouts, with programmatic dependent launch on and off, a
dense block row of 300 blocks (over 32 per warp: the column indices in several batches) and an empty one. The float64
check is the GPU tests' job; this prints one line when the calls ran.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, "src")
sys.path.insert(0, "tests/kernels")
from test_bsr_mm import _components, block_sparse_weight  # noqa: E402

from prunekit.kernels import structured  # noqa: E402

os.environ[structured.LEAN_ENV] = "1"
os.environ[structured.LEAN_MAX_N_ENV] = "32"
for pdl in ("1", "0"):
    os.environ[structured.PDL_ENV] = pdl
    for dtype in (torch.float16, torch.bfloat16):
        for r, c in ((16, 16), (16, 64), (32, 32), (32, 16), (64, 64), (64, 16)):
            m, k = 4 * r, 300 * c
            dense = block_sparse_weight(m, k, r, c, 0.05, dtype, heavy_rows=1)
            comp = {key: t.cuda() for key, t in _components(dense, r, c).items()}
            base = (comp["blocks"], comp["crow_indices"], comp["col_indices"])
            bias = torch.randn(m, device="cuda").to(dtype)
            for n in (1, 9, 17, 32):
                x2d = torch.randn(n, k, device="cuda").to(dtype)
                for x in (x2d.t(), x2d.t().contiguous()):
                    for sched in ((None, None), (comp["schedule"], comp["split_rows"])):
                        structured.bsr_mm_cuda(*base, x, m, bias, "relu", *sched)
torch.cuda.synchronize()
print("memcheck lean cases ran")
