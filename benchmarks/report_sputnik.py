"""Summarise a ``benchmarks/sputnik_compare.py`` result file as Markdown: prunekit against Sputnik's fp16 SpMM.

    python benchmarks/report_sputnik.py benchmarks/results/sputnik-compare-h100-2026-11-27-s31d.json
    python benchmarks/report_sputnik.py FILE --shapes 4096x4096,11008x4096,4096x11008 --ns 64 --sparsities 0.95,0.98

One table row per (N, sparsity) over the shapes in the file (or ``--shapes``), with the range (min-max) and the count
of points where prunekit is as fast or faster, of three same-run ratios of Sputnik's time to prunekit's (> 1: prunekit
faster):

- ``row-major``: Sputnik's fp16 ``CudaSpmm`` against prunekit's ``"auto"``, both given row-major X (K, N) and Y (M, N)
  (``prunekit_vs_sputnik_fp16``);
- ``nn.Linear``: both given nn.Linear's activations (N, K) and output (N, M), Sputnik with the two transposes it needs
  (``prunekit_linear_vs_sputnik_fp16_linear``);
- ``nn.Linear vs Sputnik's own layout``: prunekit in nn.Linear's layout against Sputnik in row-major
  (``sputnik_fp16_ms / prunekit_linear_ms``).

It also lists the kernels ``"auto"`` ran (``prunekit_variant``). A ratio missing from a row (files written before the
nn.Linear contenders existed) shows as ``-``. Every figure comes from the file; nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

RATIOS = (
    ("row-major", "prunekit_vs_sputnik_fp16"),
    ("nn.Linear", "prunekit_linear_vs_sputnik_fp16_linear"),
    ("nn.Linear vs Sputnik's own layout", None),  # computed: sputnik_fp16_ms / prunekit_linear_ms
)


def ratio(row: dict, key: str | None) -> float | None:
    """Sputnik's time over prunekit's for one row (``key`` from :data:`RATIOS`), or None where the row lacks it."""
    if key is not None:
        value = row.get(key)
        return float(value) if value is not None else None
    sputnik, ours = row.get("sputnik_fp16_ms"), row.get("prunekit_linear_ms")
    return float(sputnik) / float(ours) if sputnik and ours else None


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    wins = sum(v >= 1.0 for v in values)
    return f"{min(values):.2f}-{max(values):.2f}x ({wins} of {len(values)})"


def summary_table(
    rows: list[dict],
    shapes: set[tuple[int, int]] | None = None,
    ns: set[int] | None = None,
    sparsities: set[float] | None = None,
) -> str:
    """Markdown table of :data:`RATIOS` per (N, sparsity) over ``rows`` (``sputnik_compare.py``'s ``rows``), kept to
    ``shapes`` (M, K), ``ns`` and ``sparsities`` where given.

    Raises:
        ValueError: no row is left after the filters.
    """
    groups: dict[tuple[int, float], list[dict]] = defaultdict(list)
    for r in rows:
        if shapes is not None and (r["m"], r["k"]) not in shapes:
            continue
        if ns is not None and r["n"] not in ns:
            continue
        if sparsities is not None and not any(abs(r["sparsity"] - s) < 1e-9 for s in sparsities):
            continue
        groups[(r["n"], r["sparsity"])].append(r)
    if not groups:
        raise ValueError("no result row matches the shapes, N and sparsities asked for")
    head = " | ".join(name for name, _ in RATIOS)
    out = [
        f"| N | sparsity | shapes | {head} | prunekit kernels |",
        "|---:|---:|---:|" + "---|" * len(RATIOS) + "---|",
    ]
    for (n, sparsity), group in sorted(groups.items()):
        cells = []
        for _, key in RATIOS:
            cells.append(_cell([v for v in (ratio(r, key) for r in group) if v is not None]))
        kernels = ", ".join(sorted({str(r.get("prunekit_variant", "?")) for r in group}))
        out.append(f"| {n} | {sparsity:.2f} | {len(group)} | " + " | ".join(cells) + f" | {kernels} |")
    return "\n".join(out) + "\n"


def _parse_shapes(text: str) -> set[tuple[int, int]]:
    try:
        return {(int(m), int(k)) for m, k in (s.split("x") for s in text.split(","))}
    except ValueError:
        raise SystemExit(f"error: --shapes takes MxK[,MxK...], not {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a sputnik_compare.py result file")
    parser.add_argument("--shapes", default=None, help="MxK[,MxK...]: only these weight shapes")
    parser.add_argument("--ns", default=None, help="only these N")
    parser.add_argument("--sparsities", default=None, help="only these sparsities")
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.path.read_text())
        rows = data["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"error: {args.path} is not a sputnik_compare.py result file ({exc})") from None
    try:
        ns = {int(v) for v in args.ns.split(",")} if args.ns else None
        sparsities = {float(v) for v in args.sparsities.split(",")} if args.sparsities else None
    except ValueError:
        raise SystemExit("error: --ns takes integers and --sparsities numbers, comma-separated") from None
    shapes = _parse_shapes(args.shapes) if args.shapes else None
    meta = data.get("meta", {})
    try:
        table = summary_table(rows, shapes, ns, sparsities)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    sys.stdout.write(
        f"{args.path.name}: {meta.get('device', '?')}, torch {meta.get('torch', '?')}, {meta.get('date_utc', '?')}; "
        f"{meta.get('sputnik', 'Sputnik')}. Sputnik's time over prunekit's (> 1: prunekit faster), range over the "
        "shapes (points where prunekit is as fast or faster).\n\n" + table
    )


if __name__ == "__main__":
    main()
