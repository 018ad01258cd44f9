"""How fast can a CTA-tiled kernel write Y^T, the runtime's (N, M) output of the BSR kernels, on this GPU?

A diagnostic of the BSR wgmma kernels' epilogue (docs/PERFORMANCE_STRUCTURED.md, thirty-fifth session): at 3072 x 768
with 64-row blocks and 99% sparsity (nearly every block row empty, so the kernel does little but write act(bias)),
N = 4096, the kernel took 12.6-13.1 us and torch's Triton BSR 10.5 us, while ``Tensor.fill_`` writes the same 25.2 MB in
8.3 us (benchmarks/results/bsr-wp-tiles-h100-2026-11-27-s35c.json, fill-probe-h100-2026-11-27-s35c.log). This script
times a kernel that only writes constant tiles of Y^T in the kernels' tile shape, so that the write pattern can be
told apart from the rest of the kernel:

- ``seg``: outputs m per CTA tile (64: a 64-row block's tile, 128 bytes per token row; 128 / 256: two / four block rows);
- ``tokens``: tokens (rows of Y^T) per CTA tile;
- ``threads``: threads per CTA (160: the 64-row kernel with a producer warp; 256 with a producer warpgroup);
- ``smem``: dynamic shared memory per CTA, unused, to hold the CTAs per SM to the kernel's (49 KB: four per SM);
- ``order``: ``m`` CTAs walk M first (the kernels' blockIdx.x = block row), ``n`` tokens first.

Against ``Tensor.fill_`` and ``Tensor.zero_`` on the same tensor, in the same run. Time: CUDA events around a CUDA graph
of 20 launches, median of 15 replays after warm-up. Saves JSON (device, torch version, date) to ``--out``.

    PYTHONPATH=src python benchmarks/yt_write_probe.py --out benchmarks/results/yt-write-<device>-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import statistics
from pathlib import Path

import torch

SOURCE = r"""
#include <cuda_fp16.h>
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

template <int SEG>
__global__ void fill_yt(int4* y, int m, int n, int tokens, int order, int4 value) {
  const int n_rt = m / SEG, n_tt = (n + tokens - 1) / tokens;
  const int rt = order == 0 ? blockIdx.x % n_rt : blockIdx.x / n_tt;
  const int tt = order == 0 ? blockIdx.x / n_rt : blockIdx.x % n_tt;
  constexpr int PER_ROW = SEG / 8;  // 16-byte vectors per token row of the tile
  const int rows = min(tokens, n - tt * tokens);
  for (int idx = threadIdx.x; idx < rows * PER_ROW; idx += blockDim.x) {
    const int nl = idx / PER_ROW, ml = idx % PER_ROW;
    y[(static_cast<long long>(tt) * tokens + nl) * (m / 8) + rt * PER_ROW + ml] = value;
  }
}

void yt_fill(torch::Tensor y, int64_t seg, int64_t tokens, int64_t threads, int64_t smem, int64_t order) {
  const int n = y.size(0), m = y.size(1);
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == at::kHalf && m % seg == 0, "fill: contiguous fp16, seg | m");
  const int ctas = (m / seg) * ((n + tokens - 1) / tokens);
  const int4 value = make_int4(0x3c003c00, 0x3c003c00, 0x3c003c00, 0x3c003c00);  // 1.0 in fp16
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto* p = reinterpret_cast<int4*>(y.data_ptr());
  auto launch = [&](auto kernel) {
    if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    kernel<<<ctas, threads, smem, stream>>>(p, m, n, tokens, order, value);
  };
  if (seg == 64) launch(fill_yt<64>);
  else if (seg == 128) launch(fill_yt<128>);
  else launch(fill_yt<256>);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""


def graph_us(fns: list, launches: int = 20, replays: int = 15) -> float:
    """Median time of one call in microseconds: CUDA events around a graph of ``launches`` calls that take the
    callables of ``fns`` in turn (one per output buffer)."""
    for fn in fns:
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            fns[i % len(fns)]()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--m", type=int, default=3072)
    parser.add_argument("--ns", default="2048,4096")
    parser.add_argument("--segs", default="64,128,256")
    parser.add_argument("--tokens", default="128,256")
    parser.add_argument("--threads", default="160,256")
    parser.add_argument("--smems", default="0,50176")
    parser.add_argument(
        "--buffers",
        default="1,4",
        help="comma-separated counts of output buffers the timed calls take in turn (1: the same Y, which the 50 MB L2 "
        "can absorb; 4: 100 MB at N = 4096, written back to DRAM)",
    )
    args = parser.parse_args()
    from torch.utils.cpp_extension import load_inline

    ext = load_inline(
        "prunekit_yt_write_probe",
        cpp_sources="void yt_fill(torch::Tensor y, int64_t seg, int64_t tokens, int64_t threads, int64_t smem, "
        "int64_t order);",
        cuda_sources=SOURCE,
        functions=["yt_fill"],
    )
    rows = []
    for n, buffers in itertools.product(
        [int(v) for v in args.ns.split(",")], [int(v) for v in args.buffers.split(",")]
    ):
        ys = [torch.empty(n, args.m, device="cuda", dtype=torch.float16) for _ in range(buffers)]
        y = ys[0]
        mbytes = y.numel() * 2 / 1e6
        for name in ("fill_", "zero_"):
            fns = [functools.partial(t.fill_, 1.0) if name == "fill_" else t.zero_ for t in ys]
            us = graph_us(fns)
            rows.append(
                {"n": n, "m": args.m, "buffers": buffers, "kernel": f"torch {name}", "us": us, "tb_s": mbytes / us}
            )
        grid = itertools.product(
            [int(v) for v in args.segs.split(",")],
            [int(v) for v in args.tokens.split(",")],
            [int(v) for v in args.threads.split(",")],
            [int(v) for v in args.smems.split(",")],
            ("m", "n"),
        )
        for seg, tokens, threads, smem, order in grid:
            calls = [functools.partial(ext.yt_fill, t, seg, tokens, threads, smem, int(order == "n")) for t in ys]
            y.fill_(0.0)
            calls[0]()
            assert bool((y == 1.0).all()), (seg, tokens, threads, smem, order)  # every element written
            us = graph_us(calls)
            rows.append({
                "n": n, "m": args.m, "buffers": buffers, "kernel": "tiles", "seg": seg, "tokens": tokens, "threads": threads,
                "smem": smem, "order": order, "us": us, "tb_s": mbytes / us,
            })  # fmt: skip
    for r in rows:
        desc = r["kernel"] if r["kernel"] != "tiles" else (
            f"seg {r['seg']:3d} tokens {r['tokens']} threads {r['threads']} smem {r['smem']:5d} order {r['order']}"
        )  # fmt: skip
        print(f"N={r['n']} buffers {r['buffers']} {desc:60s} {r['us']:7.2f} us {r['tb_s']:5.2f} TB/s")
    meta = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": "median of 15 replays of a CUDA graph of 20 launches",
        "argv": vars(args) | {"out": str(args.out)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
