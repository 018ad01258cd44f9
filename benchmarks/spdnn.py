"""Sparse DNN Graph Challenge benchmark: prunekit's fused chain kernel vs torch.sparse, TeraEdges/s, PASS.

Synthetic challenge networks (the official recipe, built on the GPU) and synthetic stroke images at the
official input densities (60000 inputs); the truth categories come from a float64 run of the independent
reference path (torch.sparse). Inference time excludes building the layers, as the challenge counts it;
the median of REPEATS timed runs after a warm-up. A relabelled copy of the N=1024 network checks that the
kernel does not depend on the generator's structure.

    PYTHONPATH=src python benchmarks/spdnn.py [--budget-s 420] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from prunekit.spdnn.run import run_network

PLAN = [
    (1024, 120),
    (1024, 480),
    (1024, 1920),
    (4096, 120),
    (4096, 480),
    (4096, 1920),
    (16384, 120),
    (16384, 480),
    (16384, 1920),
    (65536, 120),
]
REPEATS = 5


def render(path: Path) -> str:
    """Markdown table of a results file (for docs/PERFORMANCE.md)."""
    data = json.loads(path.read_text())
    lines = [
        f"Device: {data['device']}, torch {data['torch']}, CUDA {data['cuda']}, {data['date']}; median of "
        f"{data['repeats']} timed runs after a warm-up; {data['inputs']}. Source: `{path.as_posix()}`.",
        "",
        "| case | N | layers | kernel | inference (s) | TeraEdges/s | categories | check |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        check = "PASS" if r["passed"] else "FAIL"
        lines.append(
            f"| {r['case']} | {r['neurons']} | {r['layers']} | {r['kernel']} | {r['inference_s']:.4f} "
            f"| {r['teraedges_per_s']:.2f} | {r['categories']} | {check} |"
        )
    for r in data["skipped"]:
        lines.append(f"| not run: {r['reason']} | {r['neurons']} | {r['layers']} | | | | | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--render", type=Path, help="print the Markdown table of a results JSON and exit")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="stop starting new networks after this many seconds"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--inputs", type=int, default=60000)
    args = parser.parse_args()
    if args.render:
        print(render(args.render), end="")
        return
    start = time.perf_counter()
    rows, skipped = [], []

    device = torch.cuda.get_device_name().replace(" ", "-")
    date = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"spdnn-{device}-{date}.json"

    def save() -> None:
        payload = {
            "benchmark": "spdnn",
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "date": date,
            "repeats": REPEATS,
            "inputs": "synthetic stroke images at the official densities (see docs/SPDNN.md)",
            "rows": rows,
            "skipped": skipped,
        }
        path.write_text(json.dumps(payload, indent=2) + "\n")

    def record(kind: str, neurons: int, layers: int, **kw) -> None:
        try:
            r = run_network(neurons, layers, synthetic=True, device="cuda", inputs=args.inputs, repeats=REPEATS, **kw)
        except torch.OutOfMemoryError:
            skipped.append({"neurons": neurons, "layers": layers, "case": kind, "reason": "CUDA out of memory"})
            torch.cuda.empty_cache()
            save()
            return
        rows.append(
            {
                "case": kind,
                "neurons": neurons,
                "layers": layers,
                "inputs": r.inputs,
                "kernel": r.kernel,
                "build_s": r.build_s,
                "inference_s": r.inference_s,
                "teraedges_per_s": r.teraedges_per_s,
                "categories": int(r.categories.numel()),
                "passed": r.passed,
            }
        )
        Console().print(rows[-1])
        save()
        torch.cuda.empty_cache()

    record("reference torch.sparse fp32", 1024, 120, kernel="reference")
    for neurons, layers in PLAN:
        if time.perf_counter() - start > args.budget_s:
            skipped.append({"neurons": neurons, "layers": layers, "reason": "time budget of the GPU run"})
            continue
        record("fused", neurons, layers, kernel="auto")
        if (neurons, layers) == (1024, 120):
            record("fused, relabelled network", neurons, layers, kernel="auto", relabel_seed=1)

    table = Table(title=f"SpDNN challenge on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    for col in ("case", "N", "L", "kernel", "inference (s)", "TeraEdges/s", "categories", "check"):
        table.add_column(col)
    for r in rows:
        check = "PASS" if r["passed"] else "FAIL"
        table.add_row(
            r["case"],
            str(r["neurons"]),
            str(r["layers"]),
            r["kernel"],
            f"{r['inference_s']:.4f}",
            f"{r['teraedges_per_s']:.2f}",
            str(r["categories"]),
            check,
        )
    Console(width=160).print(table)
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
