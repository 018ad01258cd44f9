"""Why G GPUs are not G times one: the tiled SpDNN driver on one GPU, timed on all inputs and on each rank's share.

The multi-GPU run (``prunekit.spdnn run --gpus G``, Hidayetoglu et al. 2020 sec. IV) gives every rank a contiguous
1/G of the 60000 inputs and reports the slowest rank. This script runs the same driver
(``spdnn_cuda.infer_tiled``) on one GPU for the whole input set and for each share, and traces every launch of the
chain schedule (layers, live inputs in and out, CUDA-event ms), so the part of the time that does not shrink with
the share (per-layer launches over few live tiles, host round trips) can be read off. Each case runs with the layers
as built (output j in ELL column j), after ``spdnn_cuda.tiled_output_order_`` (run.py's default), and with the
ordered layers packed (``pack_ell``, 4 bytes per slot; opt-in ``$PRUNEKIT_SPDNN_TILED_PACK=1``), or the subset
``--orders`` names; ``--streams 1,2,4`` times each case with that many tile groups on their own streams
(``$PRUNEKIT_SPDNN_TILED_STREAMS``), the settings alternating within a case. A diagnostic of our own driver; the
scaling benchmark itself is ``benchmarks/spdnn.py --plan multi``.

    PYTHONPATH=src python benchmarks/spdnn_split.py --neurons 16384 --layers 1920 --shares 2 --json out.json
    PYTHONPATH=src python benchmarks/spdnn_split.py --orders ordered --streams 1,2,4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from prunekit.kernels import spdnn_cuda
from prunekit.spdnn.generator import SPDNN_INPUTS, SPDNN_RELU_CAP, bias_for, iter_layers, synthetic_image_set
from prunekit.spdnn.run import build_ell, partition

STREAMS_ENV = "PRUNEKIT_SPDNN_TILED_STREAMS"  # read by the tiled op at each call (csrc/spdnn/spdnn_chain.cu)


def timed(features: torch.Tensor, net: tuple, bias: float, repeats: int) -> tuple[float, list[float]]:
    """Median wall time (seconds, synchronized) of ``infer_tiled`` after one warm-up, and every timed run.
    ``net``: ``(ell_idx, ell_val, out_pos or None, packed words or None)``."""
    spdnn_cuda.infer_tiled(features, *net[:2], bias, SPDNN_RELU_CAP, net[2], packed=net[3])
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        spdnn_cuda.infer_tiled(features, *net[:2], bias, SPDNN_RELU_CAP, net[2], packed=net[3])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], times


def traced(features: torch.Tensor, net: tuple, bias: float) -> list[dict]:
    """One pass of the chain schedule with CUDA events around each launch: ``first``, ``last``, ``live_in``,
    ``live_out``, ``ms`` per launch."""
    trace: list[dict] = []
    spdnn_cuda.infer_tiled(features, *net[:2], bias, SPDNN_RELU_CAP, net[2], trace=trace, packed=net[3])
    torch.cuda.synchronize()
    for t in trace:
        start, end = t.pop("events")
        t["ms"] = start.elapsed_time(end)
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--neurons", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=1920)
    parser.add_argument("--shares", type=int, default=2, help="G: time each rank's contiguous 1/G of the inputs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--orders",
        default="plain,ordered,ordered+packed",
        help="comma-separated subset of plain, ordered, ordered+packed (run in that order)",
    )
    parser.add_argument("--streams", default="",
                        help="comma-separated tile-group counts ($PRUNEKIT_SPDNN_TILED_STREAMS) to time each case "
                        "with; default: the kernel's own")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("spdnn_split.py needs a CUDA GPU")
    spdnn_cuda.load(verbose=False)
    n, layers, device = args.neurons, args.layers, "cuda"
    bias = bias_for(n)
    t0 = time.perf_counter()
    ell_idx, ell_val, total_nnz = build_ell(iter_layers(n, layers, device), layers, n, device, slot_order=False)
    build_s = time.perf_counter() - t0
    images = synthetic_image_set(n, SPDNN_INPUTS)
    runs = []
    cases = [("all", 0, SPDNN_INPUTS)] + [
        (f"share {r}/{args.shares}", *partition(SPDNN_INPUTS, r, args.shares)) for r in range(args.shares)
    ]
    order_s = 0.0
    out_pos = None
    orders = [o for o in ("plain", "ordered", "ordered+packed") if o in args.orders.split(",")]
    streams = [int(v) for v in args.streams.split(",") if v.strip()] or [None]
    for order in orders:
        if order != "plain" and out_pos is None:  # the same layers, outputs with equal inputs side by side (run.py's)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out_pos = spdnn_cuda.tiled_output_order_(ell_idx, ell_val)
            torch.cuda.synchronize()
            order_s = time.perf_counter() - t0
        packed = None
        if order == "ordered+packed":  # $PRUNEKIT_SPDNN_TILED_PACK=1: packed words over ell_idx (last: in place)
            packed = spdnn_cuda.pack_ell(ell_idx, ell_val, out=ell_idx)
            if packed is None:
                print("the layers do not pack losslessly: no packed run")
                break
        net = (ell_idx, ell_val, out_pos if order != "plain" else None, packed)
        for name, lo, hi in cases:
            features = images.rows(lo, hi, device, torch.float32, 1 << 26)
            for groups in streams:  # the settings alternate within a case: drift hits all of them alike
                if groups is not None:
                    os.environ[STREAMS_ENV] = str(groups)
                median, times = timed(features, net, bias, args.repeats)
                trace = traced(features, net, bias)
                runs.append({"order": order, "case": name, "lo": lo, "hi": hi, "streams": groups,
                             "inference_s": median, "times_s": times, "launches": trace})  # fmt: skip
            os.environ.pop(STREAMS_ENV, None)
            del features
            torch.cuda.empty_cache()

    table = Table(title=f"SpDNN tiled driver, N={n} x {layers} layers, {torch.cuda.get_device_name()}")
    for col in ("outputs", "case", "inputs", "streams", "wall (s)", "launches", "sum of launches (ms)",
                "last launch (ms)", "survivors"):  # fmt: skip
        table.add_column(col)
    for r in runs:
        ms = sum(t["ms"] for t in r["launches"])
        last = r["launches"][-1]["ms"] if r["launches"] else 0.0
        survivors = r["launches"][-1]["live_out"] if r["launches"] else 0
        table.add_row(r["order"], r["case"], str(r["hi"] - r["lo"]), str(r["streams"] or "default"),
                      f"{r['inference_s']:.4f}", str(len(r["launches"])), f"{ms:.1f}", f"{last:.1f}",
                      str(survivors))  # fmt: skip
    Console().print(table)
    for order in orders:
        picked = [r["launches"] for r in runs if r["order"] == order and r["streams"] == streams[0]][:2]
        if len(picked) < 2:
            continue
        a, s = picked
        launches = Table(title=f"per launch, {order} outputs (all inputs | share 0)")
        for col in ("layers", "live in (all)", "ms (all)", "live in (share 0)", "ms (share 0)"):
            launches.add_column(col)
        for i in range(max(len(a), len(s))):
            ra = a[i] if i < len(a) else None
            rs = s[i] if i < len(s) else None
            span = ra or rs
            launches.add_row(
                f"{span['first']}-{span['last']}",
                str(ra["live_in"]) if ra else "",
                f"{ra['ms']:.2f}" if ra else "",
                str(rs["live_in"]) if rs else "",
                f"{rs['ms']:.2f}" if rs else "",
            )
        Console().print(launches)
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "neurons": n, "layers": layers,
            "total_nnz": total_nnz, "build_s": build_s, "output_order_s": order_s, "runs": runs,
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
