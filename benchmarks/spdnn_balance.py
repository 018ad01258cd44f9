"""Where the time of a multi-GPU SpDNN run goes, rank by rank: the tiled driver with and without survivor balancing.

Run under torchrun, one process per GPU. Every rank builds the same network (ordered outputs, as run.py does), takes
its contiguous share of the 60000 synthetic inputs (``prunekit.spdnn.run.partition``) and times
``spdnn_cuda.infer_tiled`` after one warm-up, alternating balanced (``prunekit.spdnn.balance.Balance``) and unbalanced
runs, each rank timed on its own after a barrier. A traced run of each then gives the per-launch CUDA-event times, the
live rows per launch and, when balanced, the host seconds spent in the collectives (waits for the other ranks
included). Rank 0 prints a table and writes JSON with device, torch version and date. A diagnostic of our own driver;
the scaling benchmark is ``benchmarks/spdnn.py --plan multi``.

    torchrun --standalone --nproc_per_node=2 benchmarks/spdnn_balance.py --neurons 16384 --layers 1920 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from prunekit.kernels import spdnn_cuda
from prunekit.spdnn.balance import Balance
from prunekit.spdnn.generator import SPDNN_INPUTS, SPDNN_RELU_CAP, bias_for, iter_layers, synthetic_image_set
from prunekit.spdnn.run import build_ell, partition


def run_once(features, net, bias, balanced: bool, lo: int, trace=None):
    """One synchronized ``infer_tiled``: ``(seconds, survivors, Balance or None)``."""
    even = Balance(lo) if balanced else None
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    idx, val, out_pos = net
    live = spdnn_cuda.infer_tiled(features, idx, val, bias, SPDNN_RELU_CAP, out_pos, trace=trace, balance=even)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, int(live.numel()), even


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--neurons", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=1920)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    spdnn_cuda.load(verbose=False)
    n, layers = args.neurons, args.layers
    bias = bias_for(n)
    ell_idx, ell_val, _ = build_ell(iter_layers(n, layers, "cuda"), layers, n, "cuda", slot_order=False)
    out_pos = spdnn_cuda.tiled_output_order_(ell_idx, ell_val)
    net = (ell_idx, ell_val, out_pos)
    lo, hi = partition(SPDNN_INPUTS, rank, world)
    features = synthetic_image_set(n, SPDNN_INPUTS).rows(lo, hi, "cuda", torch.float32, 1 << 26)
    times = {True: [], False: []}
    for balanced in (True, False):  # warm-up
        run_once(features, net, bias, balanced, lo)
    for _ in range(args.repeats):
        for balanced in (True, False):
            times[balanced].append(run_once(features, net, bias, balanced, lo)[0])
    report = {}
    for balanced in (True, False):
        trace: list[dict] = []
        seconds, survivors, even = run_once(features, net, bias, balanced, lo, trace)
        for t in trace:
            start, end = t.pop("events")
            t["ms"] = start.elapsed_time(end)
        report["balanced" if balanced else "unbalanced"] = {
            "times_s": times[balanced], "median_s": sorted(times[balanced])[len(times[balanced]) // 2],
            "traced_s": seconds, "survivors": survivors, "launches": trace,
            "collective_s": even.seconds if even else 0.0, "collective_calls": even.calls if even else [],
        }  # fmt: skip
    parts: list = [None] * world
    dist.all_gather_object(parts, {"rank": rank, "lo": lo, "hi": hi, **report})
    if rank == 0:
        table = Table(title=f"SpDNN tiled driver per rank, N={n} x {layers}, {world} x {torch.cuda.get_device_name()}")
        for col in (
            "rank",
            "mode",
            "median (s)",
            "launch sum (ms)",
            "last launch (ms)",
            "collectives (ms)",
            "survivors",
        ):
            table.add_column(col)
        for p in parts:
            for mode in ("balanced", "unbalanced"):
                r = p[mode]
                table.add_row(str(p["rank"]), mode, f"{r['median_s']:.4f}", f"{sum(t['ms'] for t in r['launches']):.1f}",
                              f"{r['launches'][-1]['ms']:.1f}", f"{r['collective_s'] * 1e3:.2f}", str(r["survivors"]))  # fmt: skip
        Console().print(table)
        for p in parts:
            print(p["rank"], [(name, round(sec * 1e3, 3)) for name, sec in p["balanced"]["collective_calls"]])
            print(
                p["rank"],
                [(t["first"], t["live_in"], round(t["ms"], 1), t.get("balanced")) for t in p["balanced"]["launches"]],
            )
        if args.json:
            args.json.write_text(json.dumps({
                "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "neurons": n, "layers": layers,
                "world": world, "ranks": parts,
            }, indent=1))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
