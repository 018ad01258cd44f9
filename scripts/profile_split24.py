"""Nsight Compute target for the split24 residual kernel (csrc/spmm_residual.cu): one weight, the kernel called a few
times in write and add mode, so that ``ncu --kernel-name regex:residual_rows --launch-skip S --launch-count 1`` can pick
one launch. Run from the repository root on the GPU machine (PYTHONPATH=src):

    ncu --kernel-name regex:residual_rows --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        python3 scripts/profile_split24.py --m 4096 --k 4096 --n 2048 --sparsity 0.9
"""

from __future__ import annotations

import argparse

import torch

from prunekit.kernels import split24
from prunekit.kernels.testing import random_sparse_weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--sparsity", type=float, default=0.9)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = random_sparse_weight(args.m, args.k, args.sparsity, torch.float16, device="cuda", generator=g)
    _, residual = split24.split_24(w)
    rv = split24.residual_sell(residual)
    x = torch.randn(args.n, args.k, device="cuda", dtype=torch.float16)
    y = torch.empty(args.m, args.n, device="cuda", dtype=torch.float16)
    for accumulate in (False, False, False, True, True):  # launches 0-2 write, 3-4 add
        split24.residual_rows_cuda(*rv, x, y, args.n, accumulate, False)
    torch.cuda.synchronize()
    print(f"residual slots {rv[0].numel()}, tile_n {split24.residual_tile_n(args.k)}")


if __name__ == "__main__":
    main()
