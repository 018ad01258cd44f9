"""The lean decode kernels against the kernels they would replace, from result files already written on the GPU (no
GPU needed here): prints a table per comparison and, with ``--out``, writes the rows as JSON.

    python benchmarks/lean_compare.py nm24 SWEEP.json              # nm24_sweep.py --lean-warps ... (one file)
    python benchmarks/lean_compare.py bsr LEAN.json TILED.json     # bsr.py with $PRUNEKIT_BSR_LEAN=1 and =0
    python benchmarks/lean_compare.py bitmap LEAN.json RING.json   # spmm.py --forced bitmap, $PRUNEKIT_NM24_LEAN=1 / 0

Times are the files' CUDA-graph medians (``*_gpu_ms``); ``lean / base`` below 1 means the lean kernel is faster. The
rows of the two files are matched by shape, N, sparsity and block; a key only one file has is listed as missing.
``scripts/gpu_structured.sh nm24lean | bsrlean | bitmaplean`` writes the files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: cannot read {path}: {exc}") from None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def compare_nm24(sweep: dict) -> list[dict]:
    """One nm24_sweep.py file: per (M, K, N), the ring kernel at the default chunk ("auto") against each lean setting
    and the best of them, with dense cuBLAS from the same row.

    Args:
        sweep: the parsed JSON (``results`` rows with ``kernel``, ``lean_warps``, ``decode_gpu_ms``, ``dense_gpu_ms``).

    Returns:
        One dict per (M, K, N): ring_ms, dense_ms, lean_ms per setting, best_setting, best_ms, best_vs_ring,
        best_vs_dense (dense / lean: above 1 is faster than dense), ring_vs_dense; missing keys are None.
    """
    groups: dict[tuple, dict] = {}
    for r in sweep.get("results", []):
        key = (r["m"], r["k"], r["n"])
        g = groups.setdefault(key, {"ring_ms": None, "dense_ms": r.get("dense_gpu_ms"), "lean": {}})
        if r.get("kernel", "ring") == "ring":
            if r.get("chunk_arg", "auto") == "auto" and str(r.get("ring", "3x8")) in ("3x8", "auto"):
                g["ring_ms"] = r["decode_gpu_ms"]
        else:
            g["lean"][str(r.get("lean_warps"))] = r["decode_gpu_ms"]
    rows = []
    for (m, k, n), g in sorted(groups.items()):
        best = min(g["lean"].items(), key=lambda kv: kv[1]) if g["lean"] else (None, None)
        rows.append(
            {
                "m": m, "k": k, "n": n, "ring_ms": g["ring_ms"], "dense_ms": g["dense_ms"], "lean_ms": g["lean"],
                "best_setting": best[0], "best_ms": best[1], "best_vs_ring": _ratio(best[1], g["ring_ms"]),
                "best_vs_dense": _ratio(g["dense_ms"], best[1]), "ring_vs_dense": _ratio(g["dense_ms"], g["ring_ms"]),
            }
        )  # fmt: skip
    return rows


def _paired(lean: list[dict], base: list[dict], key_fields: tuple[str, ...]) -> tuple[list, list]:
    """Rows of two files matched by ``key_fields``: (pairs of (key, lean row, base row), keys found in one only)."""
    index = {tuple(r.get(f) for f in key_fields): r for r in base}
    pairs, missing = [], []
    for r in lean:
        key = tuple(r.get(f) for f in key_fields)
        if key in index:
            pairs.append((key, r, index.pop(key)))
        else:
            missing.append(key)
    return pairs, missing + list(index)


def compare_bsr(lean: dict, tiled: dict) -> tuple[list[dict], list]:
    """Two bsr.py files (``$PRUNEKIT_BSR_LEAN=1`` with torch's Triton BSR in it, and ``=0``): per (M, K, N, block,
    sparsity) the static and dynamic graph times of both, the layer's eager wall time of both, Triton's, and the
    ratios lean / tiled and Triton / lean (above 1: the lean kernel beats Triton).

    Returns:
        (rows, keys present in only one file).
    """
    fields = ("m", "k", "n", "block", "sparsity", "dtype")
    pairs, missing = _paired(lean.get("results", []), tiled.get("results", []), fields)
    rows = []
    for key, a, b in pairs:
        row = dict(zip(fields, key, strict=True))
        for mode in ("static", "dynamic"):
            row[f"{mode}_lean_ms"], row[f"{mode}_tiled_ms"] = a.get(f"{mode}_gpu_ms"), b.get(f"{mode}_gpu_ms")
            row[f"{mode}_lean_vs_tiled"] = _ratio(a.get(f"{mode}_gpu_ms"), b.get(f"{mode}_gpu_ms"))
        triton = a.get("torch_bsr_gpu_ms") or b.get("torch_bsr_gpu_ms")
        row["triton_ms"] = triton
        row["triton_vs_lean_static"] = _ratio(triton, a.get("static_gpu_ms"))
        row["layer_lean_ms"], row["layer_tiled_ms"] = a.get("layer_wall_ms"), b.get("layer_wall_ms")
        row["dense_ms"] = a.get("dense_gpu_ms")
        row["errors"] = [a.get("static_err"), a.get("dynamic_err"), a.get("layer_err")]
        rows.append(row)
    return rows, missing


def compare_bitmap(lean: dict, ring: dict) -> tuple[list[dict], list]:
    """Two spmm.py files with ``--forced bitmap`` (``$PRUNEKIT_NM24_LEAN=1`` and ``=0``): per (dtype, M, K, N,
    sparsity) the bitmap kernel's graph time in both, the ratio, dense cuBLAS and each against dense (dense / time).

    Returns:
        (rows, keys present in only one file).
    """
    fields = ("dtype", "m", "k", "n", "sparsity")
    pairs, missing = _paired(lean.get("rows", []), ring.get("rows", []), fields)
    rows = []
    for key, a, b in pairs:
        la, lb = a.get("bitmap_gpu_ms"), b.get("bitmap_gpu_ms")
        dense = a.get("dense_gpu_ms")
        rows.append(
            {
                **dict(zip(fields, key, strict=True)), "lean_ms": la, "ring_ms": lb, "lean_vs_ring": _ratio(la, lb),
                "dense_ms": dense, "lean_vs_dense": _ratio(dense, la), "ring_vs_dense": _ratio(dense, lb),
                "lean_error": a.get("bitmap_rel_error"),
            }
        )  # fmt: skip
    return rows, missing


def _us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.2f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(kind: str, rows: list[dict], missing: list, console: Console) -> None:
    """Print ``rows`` (as the compare_* functions return them) as a table, then the unmatched keys."""
    if kind == "nm24":
        table = Table(title="2:4 decode: ring kernel (auto chunk) against the lean kernel (graph us)")
        for col in ("M x K", "N", "dense", "ring", "lean by setting", "best", "best / ring", "x dense (best)"):
            table.add_column(col, justify="right")
        for r in rows:
            settings = " ".join(f"{s}:{_us(v)}" for s, v in sorted(r["lean_ms"].items()))
            table.add_row(
                f"{r['m']}x{r['k']}", str(r["n"]), _us(r["dense_ms"]), _us(r["ring_ms"]), settings or "-",
                f"{r['best_setting']}: {_us(r['best_ms'])}" if r["best_setting"] else "-", _x(r["best_vs_ring"]),
                _x(r["best_vs_dense"]),
            )  # fmt: skip
    elif kind == "bsr":
        table = Table(title="BSR at decode N: tiled kernel against the lean kernel (graph us; layer: eager wall us)")
        cols = ("M x K", "N", "block", "sp", "static tiled", "static lean", "lean / tiled", "dynamic lean / tiled",
                "Triton", "Triton / lean", "layer tiled", "layer lean")  # fmt: skip
        for col in cols:
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(
                f"{r['m']}x{r['k']}", str(r["n"]), str(r["block"]), f"{r['sparsity']:.2f}", _us(r["static_tiled_ms"]),
                _us(r["static_lean_ms"]), _x(r["static_lean_vs_tiled"]), _x(r["dynamic_lean_vs_tiled"]),
                _us(r["triton_ms"]), _x(r["triton_vs_lean_static"]), _us(r["layer_tiled_ms"]), _us(r["layer_lean_ms"]),
            )  # fmt: skip
    else:
        table = Table(title="bitmap decode: ring kernel against the lean kernel (graph us)")
        for col in (
            "dtype",
            "M x K",
            "N",
            "sp",
            "dense",
            "ring",
            "lean",
            "lean / ring",
            "x dense ring",
            "x dense lean",
        ):
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(
                r["dtype"], f"{r['m']}x{r['k']}", str(r["n"]), f"{r['sparsity']:.2f}", _us(r["dense_ms"]),
                _us(r["ring_ms"]), _us(r["lean_ms"]), _x(r["lean_vs_ring"]), _x(r["ring_vs_dense"]),
                _x(r["lean_vs_dense"]),
            )  # fmt: skip
    console.print(table)
    for key in missing:
        console.print(f"in one file only: {key}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("nm24", "bsr", "bitmap"))
    parser.add_argument("files", type=Path, nargs="+", help="nm24: the sweep file; bsr / bitmap: lean file, base file")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    expected = 1 if args.kind == "nm24" else 2
    if len(args.files) != expected:
        parser.error(f"{args.kind} takes {expected} file(s), got {len(args.files)}")
    data = [_load(p) for p in args.files]
    if args.kind == "nm24":
        rows, missing = compare_nm24(data[0]), []
    elif args.kind == "bsr":
        rows, missing = compare_bsr(*data)
    else:
        rows, missing = compare_bitmap(*data)
    render(args.kind, rows, missing, Console(width=200))
    if args.out:
        meta = [d.get("meta") or d.get("environment") for d in data]
        payload = {"kind": args.kind, "files": [str(p) for p in args.files], "meta": meta, "rows": rows}
        payload["missing"] = [list(k) for k in missing]
        tmp = args.out.with_name(args.out.name + ".tmp")  # written whole, then renamed
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
