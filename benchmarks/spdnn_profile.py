"""Where the fused SpDNN chain spends its time: every chain launch of one inference, timed with CUDA events, for the
official network and a relabelled copy (same function, hidden neurons renamed).

Prints one row per launch (layers, live inputs, inputs per block, ms) and the totals, and writes them as JSON with
the device, torch and CUDA versions and the date. A diagnostic of our own kernel (where its time goes, which
block-size rule is fastest); the comparisons with the champion and torch.sparse are benchmarks/spdnn.py's. Run on the
GPU machine (scripts/gpu_spdnn.sh profile); under Nsight Compute the same launches are profiled.

    PYTHONPATH=src python benchmarks/spdnn_profile.py --neurons 1024 --layers 120 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from prunekit.kernels import spdnn_cuda
from prunekit.spdnn.generator import SPDNN_RELU_CAP, bias_for, iter_layers, relabel, synthetic_image_set
from prunekit.spdnn.run import build_chain_layers
from prunekit.spdnn.slot_order import bank_conflict_factor


def min_blocks(sms: int) -> int:
    """The chain op's rule: ``$PRUNEKIT_SPDNN_MIN_BLOCKS``, else half the SMs (csrc/spdnn/spdnn_chain.cu)."""
    env = os.environ.get("PRUNEKIT_SPDNN_MIN_BLOCKS")
    return max(1, int(env)) if env else max(1, sms // 2)


def chain_launches(features, net, bias, sms: int) -> list[dict]:
    """One inference through the shipped driver (``spdnn_cuda.infer_fused``: same schedule, gathers, packing), with
    a CUDA-event timing around each launch (the host round trip between launches apart)."""
    trace: list[dict] = []
    spdnn_cuda.infer_fused(features, net.ell_idx, net.ell_val, bias, SPDNN_RELU_CAP, net.row_pos, net.packed,
                           trace=trace)  # fmt: skip
    torch.cuda.synchronize()
    rows = []
    n = features.shape[1]
    for t in trace:
        bt = spdnn_cuda.block_inputs(n, 4, 1 if t["first"] == t["last"] else 2)
        while bt > 1 and -(-t["live_in"] // bt) < min_blocks(sms):  # the C++ rule in chain()
            bt //= 2
        start, end = t.pop("events")
        rows.append(t | {"block_inputs": bt, "ms": start.elapsed_time(end)})
    return rows


def driver_wall_ms(features, net, bias, repeats: int) -> float:
    """Median host wall time (ms, synchronized) of ``spdnn_cuda.infer_fused``: the launches of the shipped driver
    (settled tail included) plus its host round trips and compactions, which the per-launch events leave out."""
    args = (features, net.ell_idx, net.ell_val, bias, SPDNN_RELU_CAP, net.row_pos, net.packed)
    spdnn_cuda.infer_fused(*args)  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        spdnn_cuda.infer_fused(*args)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--neurons", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes after one warm-up (median per launch)")
    parser.add_argument("--only", choices=("official", "relabelled"), help="one network (e.g. under ncu)")
    parser.add_argument("--min-blocks", default="", help="comma list: also time the official network at each value")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    spdnn_cuda.load()
    n, bias = args.neurons, bias_for(args.neurons)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    source = synthetic_image_set(n)
    features = source.rows(0, source.count, "cuda", torch.float32, 1 << 24)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "neurons": n,
        "layers": args.layers,
        "timing": "CUDA events around each chain launch; median per launch over --repeats passes after a warm-up",
    }
    cases = [("official", None, None), ("relabelled", 1, None)]
    cases += [(f"official, min_blocks={v}", None, int(v)) for v in filter(None, args.min_blocks.split(","))]
    for name, seed, blocks in cases:
        if args.only not in (None, name):
            continue
        if blocks is None:
            os.environ.pop("PRUNEKIT_SPDNN_MIN_BLOCKS", None)
        else:
            os.environ["PRUNEKIT_SPDNN_MIN_BLOCKS"] = str(blocks)
        stream = iter_layers(n, args.layers, "cuda")
        net = relabel(stream, seed) if seed is not None else stream
        layers = build_chain_layers(net, args.layers, n, "cuda")
        report[f"{name}, bank conflict factor"] = bank_conflict_factor(layers.ell_idx)
        report[f"{name}, packed"] = layers.packed is not None
        chain_launches(features, layers, bias, sms)  # warm-up
        passes = [chain_launches(features, layers, bias, sms) for _ in range(max(1, args.repeats))]
        rows = passes[0]
        for i, row in enumerate(rows):
            row["ms"] = sorted(p[i]["ms"] for p in passes)[len(passes) // 2]
        report[name] = rows
        wall_ms = driver_wall_ms(features, layers, bias, max(1, args.repeats))
        report[f"{name}, driver wall ms"] = wall_ms
        print(f"{name}: {sum(r['ms'] for r in rows):.3f} ms in {len(rows)} launches; "
              f"spdnn_cuda.infer_fused wall time {wall_ms:.3f} ms; bank conflict factor "
              f"{report[f'{name}, bank conflict factor']:.3f}")  # fmt: skip
        for r in rows:
            print(f"  layers {r['first']:4d}-{r['last']:4d}  live {r['live_in']:6d} -> {r['live_out']:6d}  "
                  f"BT {r['block_inputs']:2d}  {r['ms']:8.3f} ms")  # fmt: skip
        layers = None
    os.environ.pop("PRUNEKIT_SPDNN_MIN_BLOCKS", None)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
