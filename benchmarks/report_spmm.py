"""Render the SpMM benchmark JSON (benchmarks/spmm.py) as Markdown: result tables and issue 4's targets, met or not.

    python benchmarks/report_spmm.py benchmarks/results/spmm-h100-2026-11-23.json [--variants VARIANTS.json]

Prints Markdown on stdout; docs/PERFORMANCE.md embeds its output between the GENERATED markers. Every figure comes
from the JSON files; nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def _fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def results_table(rows: list[dict], dtype: str) -> str:
    rows = [r for r in rows if r["dtype"] == dtype]
    if not rows:
        return f"(no {dtype} rows)\n"
    out = [
        f"#### {dtype}\n",
        "| W (M x K) | N | sparsity | variant | prunekit ms | dense ms | vs dense | prunekit eager ms "
        "| dense eager ms | torch.sparse eager ms | vs torch.sparse (eager) | nnz TFLOP/s | % CUDA-core peak "
        "| GB/s | % of 3 TB/s | rel. error | sets |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["m"], r["k"], r["sparsity"], r["n"])):
        sp = r["torch_sparse_eager_ms"]
        out.append(
            f"| {r['m']}x{r['k']} | {r['n']} | {r['sparsity']:.2f} | {r['variant']} | {r['prunekit_gpu_ms']:.4f} "
            f"| {r['dense_gpu_ms']:.4f} | {_fmt_ratio(r['speedup_vs_dense'])} | {r['prunekit_eager_ms']:.4f} "
            f"| {r['dense_eager_ms']:.4f} | {'-' if sp is None else f'{sp:.4f}'} "
            f"| {_fmt_ratio(r['speedup_vs_torch_sparse'])} | {r['nnz_tflops']:.2f} "
            f"| {100 * r['fraction_of_cuda_core_peak']:.1f} | {r['gbps']:.0f} | {100 * r['fraction_of_hbm']:.1f} "
            f"| {r['rel_error']:.1e} | {r['input_sets']}{'*' if r['l2_resident'] else ''} |"
        )
    return "\n".join(out) + "\n"


def _agg(values: list[float]) -> str:
    if not values:
        return "not measured"
    return f"min {min(values):.2f}x, median {statistics.median(values):.2f}x, max {max(values):.2f}x (n={len(values)})"


def targets(rows: list[dict], dtype: str = "float16") -> str:
    rows = [r for r in rows if r["dtype"] == dtype]
    lines = [
        f"| target ({dtype}) | measured (over shapes and N) | met |",
        "|---|---|---|",
    ]

    def check(label: str, sel: list[dict], key: str, bound: float) -> None:
        vals = [r[key] for r in sel if r.get(key) is not None]
        met = "not measured" if not vals else ("**met**" if min(vals) >= bound else "not met")
        if vals and min(vals) < bound <= max(vals):
            met = f"not met (met in {sum(v >= bound for v in vals)} of {len(vals)})"
        lines.append(f"| {label} | {_agg(vals)} | {met} |")

    for sp, bound in ((0.9, 1.0), (0.95, 2.0), (0.98, 3.5)):
        sel = [r for r in rows if r["n"] >= 2048 and abs(r["sparsity"] - sp) < 1e-9]
        check(f"vs dense, N >= 2048, {sp:.0%}: >= {bound}x", sel, "speedup_vs_dense", bound)
    for sp, bound in ((0.8, 2.0), (0.9, 3.0)):
        sel = [r for r in rows if r["n"] <= 16 and abs(r["sparsity"] - sp) < 1e-9]
        check(f"vs dense, N <= 16, {sp:.0%}: >= {bound}x", sel, "speedup_vs_dense", bound)
    sel = [r for r in rows if r["n"] >= 128 and r["sparsity"] >= 0.7 - 1e-9]
    check("vs torch.sparse.mm, N >= 128, sparsity >= 70%: >= 10x (eager vs eager)", sel, "speedup_vs_torch_sparse", 10)
    sel = [r for r in rows if r["n"] <= 16 and r["sparsity"] >= 0.7 - 1e-9]
    check("vs torch.sparse.mm, N <= 16, sparsity >= 70%: >= 5x (eager vs eager)", sel, "speedup_vs_torch_sparse", 5)
    errs = [r["rel_error"] for r in rows]
    if errs:
        lines.append(f"| benchmark outputs vs fp32 dense: rel. error | max {max(errs):.1e} | (tests: see KERNELS.md) |")
    return "\n".join(lines) + "\n"


def fractions(rows: list[dict], dtype: str = "float16") -> str:
    rows = [r for r in rows if r["dtype"] == dtype]
    big = [r for r in rows if r["n"] >= 2048]
    small = [r for r in rows if r["n"] <= 16]
    lines = ["| regime | achieved | fraction of the limit |", "|---|---|---|"]
    if big:
        best = max(big, key=lambda r: r["nnz_tflops"])
        lines.append(
            f"| N >= 2048 (compute): nnz TFLOP/s vs 64.5 TFLOP/s CUDA-core FP32 FMA peak | median "
            f"{statistics.median(r['nnz_tflops'] for r in big):.2f}, best {best['nnz_tflops']:.2f} "
            f"({best['m']}x{best['k']}, N={best['n']}, {best['sparsity']:.0%}) | median "
            f"{100 * statistics.median(r['fraction_of_cuda_core_peak'] for r in big):.1f}%, best "
            f"{100 * best['fraction_of_cuda_core_peak']:.1f}% |"
        )
    if small:
        best = max(small, key=lambda r: r["gbps"])
        lines.append(
            f"| N <= 16 (memory): GB/s of the minimum bytes vs 3 TB/s | median "
            f"{statistics.median(r['gbps'] for r in small):.0f}, best {best['gbps']:.0f} "
            f"({best['m']}x{best['k']}, N={best['n']}, {best['sparsity']:.0%}) | median "
            f"{100 * statistics.median(r['fraction_of_hbm'] for r in small):.1f}%, best "
            f"{100 * best['fraction_of_hbm']:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def variants_table(rows: list[dict]) -> str:
    names = [k.removesuffix("_gpu_ms") for k in rows[0] if k.endswith("_gpu_ms")]
    out = [
        "| dtype | W (M x K) | sparsity | N | " + " | ".join(f"{n} ms" for n in names) + " | fastest | auto picks |",
        "|---|---|---:|---:|" + "---:|" * len(names) + "---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["m"], r["k"], r["sparsity"], r["n"])):
        forced = {n: r[f"{n}_gpu_ms"] for n in names if n != "auto"}
        fastest = min(forced, key=forced.get)
        out.append(
            f"| {r['dtype']} | {r['m']}x{r['k']} | {r['sparsity']:.2f} | {r['n']} | "
            + " | ".join(f"{r[f'{n}_gpu_ms']:.4f}" for n in names)
            + f" | {fastest} | {r['auto_variant']} |"
        )
    return "\n".join(out) + "\n"


def render(result: dict, variants: dict | None) -> str:
    env = result["environment"]
    parts = [
        f"Device: **{env['device']}** ({env['sm_count']} SMs, L2 {env['l2_bytes'] / 2**20:.0f} MiB), "
        f"torch {env['torch']}, CUDA {env['cuda']}, date {env['date_utc']}, kernel build {env['kernel_build_key']}.\n",
        f"Command: `{env['command']}`. Method: {env['method']}.\n",
        "### Targets of issue 4\n",
        targets(result["rows"]),
        "### Fraction of the limit\n",
        fractions(result["rows"]),
        "### All results\n",
        "`vs dense` = dense cuBLAS device time / prunekit device time (CUDA graphs); eager columns include host "
        "overhead; `sets` = independent (W, X) input sets rotated (`*`: their total still fits in twice the L2).\n",
    ]
    by_dtype = defaultdict(list)
    for r in result["rows"]:
        by_dtype[r["dtype"]].append(r)
    for dtype in by_dtype:
        parts.append(results_table(result["rows"], dtype))
    if result.get("skipped"):
        parts.append(f"Configurations skipped by the run's time budget: {len(result['skipped'])}.\n")
    if variants:
        venv = variants["environment"]
        parts.append(
            f"### Variant sweep (heuristic measurement)\n\nDevice {venv['device']}, torch {venv['torch']}, "
            f"{venv['date_utc']}; command `{venv['command']}`. Device time (CUDA graphs) of each variant forced.\n"
        )
        parts.append(variants_table(variants["rows"]))
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--variants", type=Path, default=None)
    args = parser.parse_args()
    result = json.loads(args.results.read_text())
    variants = json.loads(args.variants.read_text()) if args.variants else None
    print(render(result, variants))


if __name__ == "__main__":
    main()
