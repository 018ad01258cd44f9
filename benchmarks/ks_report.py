"""Report of the Kronecker-sparse benchmark (issue 8): merges the part JSONs of ``benchmarks/ks.py``, summarises the
speedup distributions against the issue's targets, writes the Markdown for docs/KRONECKER.md, draws the speedup
distribution (matplotlib PNG) and derives the measured variant table for ``kernels/ks.py`` (``MEASURED_VARIANTS``).

    python benchmarks/ks_report.py benchmarks/results/ks-h100-<date>-part*.json \\
        --merged benchmarks/results/ks-h100-<date>.json --png benchmarks/results/ks-h100-<date>.png \\
        --markdown benchmarks/results/ks-h100-<date>.md

Targets (issue 8, H100): median speedup vs the best of bmm / einsum / dense / BSR >= 1.4x in fp32 and >= 2x in fp16;
vs the authors' kernel >= 1.0x in fp32 and >= 1.5x in fp16; every benchmarked pattern correct vs float64.
Quartiles: ``statistics.quantiles(method="inclusive")``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

TARGETS = {  # issue 8: (vs best baseline, vs authors' kernel) median speedups
    "float32": (1.4, 1.0),
    "float16": (2.0, 1.5),
}
LAYOUTS = ("batch_last", "batch_first")


def merge(paths: list[Path]) -> dict:
    """One result from part JSONs: rows keyed by (pattern, dtype, layout), a later file's row replacing an earlier
    one; ``parts`` lists each file's part, device, ceilings and elapsed seconds; ``not_run`` the patterns no part
    has a row for."""
    merged: dict = {"parts": [], "rows": [], "crashed": [], "hung": []}
    rows: dict[tuple, dict] = {}
    planned: list = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for key in ("device", "torch", "cuda", "date", "batch", "subsample"):
            merged.setdefault(key, data.get(key))
        merged["parts"].append(
            {
                "file": Path(path).name,
                "part": data.get("part"),
                "device": data.get("device"),
                "ceilings": data.get("ceilings"),
                "elapsed_s": data.get("elapsed_s"),
                "authors_build": data.get("authors_build"),
            }
        )
        planned += [tuple(q) for q in data.get("part_patterns", [])]
        for key in ("crashed", "hung"):
            seen = [(e["pattern"], e["dtype"], e["layout"], e.get("name")) for e in merged[key]]
            merged[key] += [
                e for e in data.get(key, []) if (e["pattern"], e["dtype"], e["layout"], e.get("name")) not in seen
            ]
        for row in data.get("rows", []):
            rows[(tuple(row["pattern"]), row["dtype"], row["layout"])] = row
    merged["rows"] = [with_shipped_variant(r) for r in rows.values()]
    have = {key[0] for key in rows}
    merged["not_run"] = [list(q) for q in dict.fromkeys(planned) if q not in have]
    return merged


def with_shipped_variant(row: dict) -> dict:
    """``row`` plus ``shipped_variant`` (what ``kernels.ks.pick_variant`` and ``pick_delta_block`` pick today; a row
    whose pick is the delta-block kernel but that was measured before it existed keeps its tile variant and is flagged
    ``shipped_untimed``: a conservative stand-in, the tile kernel lost wherever both were timed), its ms
    (``ms["prunekit_shipped"]``) and speedups, read from the row's per-variant timings: what a user of this version
    gets, whichever rule picked ``default_variant`` when the row was measured."""
    from prunekit.kernels.ks import BLOCK_DIAGONAL_TO_CUBLAS, pick_delta_block_packed, pick_variant

    a, b, c, d = row["pattern"]
    ms = row.get("ms", {})
    untimed = False
    if d == 1 and BLOCK_DIAGONAL_TO_CUBLAS:
        # ks_mm_cuda runs block_diagonal_mm (torch.bmm on views): timed as variant "cublas" since it exists; before,
        # the bmm baseline's time stands in (the same torch.bmm on the same views, then the same single copy)
        name = "cublas" if ms.get("cublas") else "bmm"
    elif row["dtype"] == "float32":
        name = "f32"
    else:
        tile, pipe = pick_variant(b, c, d, "float16", row["layout"] == "batch_first")
        name = f"tile{tile}_{'pipe' if pipe else 'simple'}"
        if row["layout"] == "batch_first" and pick_delta_block_packed(b, c, d):  # the benchmark's X, Y are packed
            if ms.get("dblock"):
                name = "dblock"
            else:  # a row measured before the delta-block kernel existed: its tile variant stands in (it lost there)
                untimed = True
    ours = ms.get(name)
    best = row.get("best_baseline")
    out = dict(row, shipped_variant=name, shipped_untimed=untimed, ms={**ms, "prunekit_shipped": ours})
    out["shipped_correct"] = bool(row.get("correct")) and row.get("experimental_correct", {}).get(name) is not False
    out["shipped_by_cublas"] = name in ("cublas", "bmm")
    out["speedup_shipped_vs_best"] = ms[best] / ours if ours and best and ms.get(best) else None
    out["speedup_shipped_vs_authors"] = ms["authors"] / ours if ours and ms.get("authors") else None
    return out


def quartiles(values: list[float]) -> dict:
    """``{"count", "median", "q1", "q3", "min", "max"}`` of ``values`` (empty: count 0 only)."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return {"count": 0}
    q = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else [vals[0]] * 3
    return {"count": len(vals), "median": statistics.median(vals), "q1": q[0], "q3": q[2], "min": vals[0],
            "max": vals[-1]}  # fmt: skip


def summarize(rows: list[dict]) -> dict:
    """Per ``dtype/layout`` (and ``dtype/all``): quartiles of the speedup vs the best baseline (the default variant
    and the fastest variant), vs the authors' kernel, and of the floor fraction; wins (> 1x), correctness, the
    three worst patterns vs the best baseline, and whether the issue's medians are met."""
    out = {}
    for dt in ("float32", "float16"):
        for layout in (*LAYOUTS, "all"):
            sel = [r for r in rows if r["dtype"] == dt and (layout == "all" or r["layout"] == layout)]
            if not sel:
                continue
            vs_best = quartiles([r.get("speedup_vs_best") for r in sel])
            vs_authors = quartiles([r.get("speedup_vs_authors") for r in sel])
            ranked = sorted((r for r in sel if r.get("speedup_vs_best")), key=lambda r: r["speedup_vs_best"])
            target_best, target_authors = TARGETS[dt]
            out[f"{dt}/{layout}"] = {
                "vs_best": vs_best,
                "best_variant_vs_best": quartiles([r.get("speedup_best_variant_vs_best") for r in sel]),
                "shipped_vs_best": quartiles([r.get("speedup_shipped_vs_best") for r in sel]),
                "shipped_vs_authors": quartiles([r.get("speedup_shipped_vs_authors") for r in sel]),
                "shipped_untimed": sum(bool(r.get("shipped_untimed")) for r in sel),
                "shipped_by_cublas": sum(bool(r.get("shipped_by_cublas")) for r in sel),
                "shipped_all_correct": all(r.get("shipped_correct", r.get("correct")) for r in sel),
                "vs_authors": vs_authors,
                "floor_fraction": quartiles([r.get("floor_fraction") for r in sel]),
                "wins": sum((r.get("speedup_vs_best") or 0) > 1.0 for r in sel),
                "rows": len(sel),
                "all_correct": all(r.get("correct") for r in sel),
                "incorrect": [[r["pattern"], r["layout"]] for r in sel if not r.get("correct")],
                "worst": [
                    [r["pattern"], r["layout"], r["best_baseline"], round(r["speedup_vs_best"], 3)] for r in ranked[:3]
                ],  # fmt: skip
                "target_vs_best": target_best,
                "met_vs_best": vs_best.get("median", 0) >= target_best if vs_best["count"] else None,
                "target_vs_authors": target_authors,
                "met_vs_authors": vs_authors.get("median", 0) >= target_authors if vs_authors["count"] else None,
            }
    return out


def variant_table(rows: list[dict], dtype: str = "float16") -> dict:
    """Measured ``(tile_rows, pipelined)`` per ``kernels.ks.variant_key``: among the ``dtype`` rows of a key, the
    variant with the smallest geometric mean of (its time / the fastest variant's time) over the rows where every
    variant was timed. Returns ``{key (tuple): {"tile_rows", "pipelined", "geomean_ratio", "rows", "wins"}}``."""
    from prunekit.kernels.ks import variant_key

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["dtype"] != dtype:
            continue
        a, b, c, d = r["pattern"]
        groups.setdefault(variant_key(b, c, d, r["layout"] == "batch_first"), []).append(r)
    table = {}
    for key, sel in sorted(groups.items()):
        names = sorted({v for r in sel for v in r["ms"] if v.startswith("tile")})
        full = [r for r in sel if all(r["ms"].get(v) for v in names)]
        if not names or not full:
            continue
        score = {
            v: math.exp(statistics.fmean(math.log(r["ms"][v] / min(r["ms"][w] for w in names)) for r in full))
            for v in names
        }
        best = min(names, key=lambda v: (score[v], v))
        tile = int(best.split("_")[0].removeprefix("tile"))
        table[key] = {
            "tile_rows": tile,
            "pipelined": best.endswith("_pipe"),
            "geomean_ratio": score[best],
            "rows": len(full),
            "wins": {v: sum(min(names, key=lambda w, r=r: r["ms"][w]) == v for r in full) for v in names},
        }
    return table


def variant_table_literal(table: dict, source: str) -> str:
    """The Python lines to paste into kernels/ks.py."""
    lines = ["MEASURED_VARIANTS: dict[tuple[str, str, str, str], tuple[int, bool]] = {"]
    for key, v in table.items():
        lines.append(f"    {key!r}: ({v['tile_rows']}, {v['pipelined']}),  # geomean {v['geomean_ratio']:.3f}")
    lines += ["}", f"MEASURED_SOURCE: str | None = {source!r}"]
    return "\n".join(lines)


def _fmt(q: dict, key: str = "median") -> str:
    return f"{q[key]:.2f}" if q.get("count") else "-"


def markdown(merged: dict) -> str:
    """Markdown for docs/KRONECKER.md: run line, summary vs the targets, worst patterns, variant table, all rows."""
    rows = merged["rows"]
    summary = summarize(rows)
    patterns = len({tuple(r["pattern"]) for r in rows})
    ceil = (merged.get("parts") or [{}])[0].get("ceilings") or {}
    sub = merged.get("subsample") or {}
    lines = [
        f"{merged.get('device')}, torch {merged.get('torch')}, CUDA {merged.get('cuda')}, {merged.get('date')}, "
        f"batch {merged.get('batch')}: {patterns} patterns of the subsample's {sub.get('count', '?')} ({len(rows)} rows) "
        f"from {len(merged['parts'])} part(s); "
        f"{len(merged.get('not_run', []))} planned patterns not run. Ceilings of the first part: copy "
        f"{ceil.get('copy_gbps', float('nan')):.0f} GB/s, fp16 matmul {ceil.get('matmul_float16_tflops', float('nan')):.0f}"
        f" TFLOP/s, fp32 {ceil.get('matmul_float32_tflops', float('nan')):.0f} TFLOP/s.",
        "",
        "",
        "'vs best' and 'vs authors' use the variant each row ran as `prunekit` (`default_variant`); 'shipped' uses the "
        "variant today's `pick_variant` and `pick_delta_block` pick (`shipped_variant`), read from the same row's "
        "per-variant timings; 'untimed' counts rows whose pick is the delta-block kernel but that ran before it existed "
        "(their tile variant stands in: slower wherever both were timed, so 'shipped' is a lower bound there); "
        "'cuBLAS' counts d = 1 rows, which `ks_mm` hands to `torch.bmm` (`block_diagonal_mm`): their shipped time is "
        "variant `cublas` where timed, else the `bmm` baseline's (the same calls).",
        "",
        "| dtype / layout | rows | vs best: median (q1-q3) [min, max] | target | met | shipped vs best (q1-q3) | "
        "best variant vs best | vs authors: median (q1-q3) | target | met | shipped vs authors | untimed | cuBLAS | "
        "floor fraction median | wins | all correct |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        vb, va = s["vs_best"], s["vs_authors"]
        lines.append(
            f"| {key} | {s['rows']} | {_fmt(vb)}x ({_fmt(vb, 'q1')}-{_fmt(vb, 'q3')}) [{_fmt(vb, 'min')}, "
            f"{_fmt(vb, 'max')}] | {s['target_vs_best']}x | {s['met_vs_best']} | {_fmt(s['shipped_vs_best'])}x "
            f"({_fmt(s['shipped_vs_best'], 'q1')}-{_fmt(s['shipped_vs_best'], 'q3')}) | {_fmt(s['best_variant_vs_best'])}x | "
            f"{_fmt(va)}x ({_fmt(va, 'q1')}-{_fmt(va, 'q3')}) | {s['target_vs_authors']}x | {s['met_vs_authors']} | "
            f"{_fmt(s['shipped_vs_authors'])}x | {s['shipped_untimed']} | {s['shipped_by_cublas']} | "
            f"{_fmt(s['floor_fraction'])} | {s['wins']} | {s['all_correct'] and s['shipped_all_correct']} |"
        )
    lines += ["", "Worst patterns vs the best baseline (pattern, layout, baseline, speedup):", ""]
    for key, s in summary.items():
        if key.endswith("/all"):
            continue
        worst = "; ".join(f"{','.join(map(str, p))} {lay} {base} {sp}x" for p, lay, base, sp in s["worst"])
        lines.append(f"- {key}: {worst or '-'}")
    if merged.get("crashed") or merged.get("hung"):
        lines += ["", "Rows not measured or contenders skipped (crashes and hangs, ``benchmarks/ks.py``):", ""]
    for e in merged.get("crashed", []):
        culprits = [n for n, v in (e.get("diagnosis") or {}).items() if v.get("exit_code") or v.get("error")]
        why = (
            f"of the {len(e['diagnosis'])} contenders then run alone under CUDA_LAUNCH_BLOCKING=1, failed: "
            f"{', '.join(culprits)}"
            if culprits
            else "not diagnosed"
        )
        lines.append(f"- {','.join(map(str, e['pattern']))} {e['dtype']} {e['layout']}: the process died (CUDA "
                     f"context lost); row not measured; {why}")  # fmt: skip
    for e in merged.get("hung", []):
        lines.append(f"- {','.join(map(str, e['pattern']))} {e['dtype']} {e['layout']}: {e['name']} ran over "
                     f"{e.get('after_s', '?')} s and was skipped on this row")  # fmt: skip
    table = variant_table(rows)
    if table:
        lines += [
            "",
            "| variant key | tile rows | pipelined | geomean time / fastest | rows | wins |",
            "|---|---|---|---|---|---|",
        ]
        for key, v in table.items():
            wins = ", ".join(f"{n} {c}" for n, c in v["wins"].items())
            lines.append(
                f"| {' '.join(key)} | {v['tile_rows']} | {v['pipelined']} | {v['geomean_ratio']:.3f} | {v['rows']} | "
                f"{wins} |"
            )
    lines += [
        "",
        "| pattern | dtype | layout | prunekit ms (variant) | best variant ms | best baseline | its ms | speedup | "
        "authors ms | vs authors | floor fraction | correct |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(v, f=".3f"):
        return "-" if v is None else format(v, f)

    for r in sorted(rows, key=lambda r: (r["dtype"], r["layout"], r["pattern"])):
        ms = r["ms"]
        best = r.get("best_baseline")
        lines.append(
            f"| {','.join(map(str, r['pattern']))} | {r['dtype']} | {r['layout']} | {num(ms.get('prunekit'))} "
            f"({r.get('default_variant')}) | {num(ms.get('prunekit_best'))} | {best} | {num(ms.get(best) if best else None)}"
            f" | {num(r.get('speedup_vs_best'), '.2f')} | {num(ms.get('authors'))} | "
            f"{num(r.get('speedup_vs_authors'), '.2f')} | {num(r.get('floor_fraction'), '.2f')} | {r.get('correct')} |"
        )
    return "\n".join(lines) + "\n"


def plot(merged: dict, out: Path) -> Path:
    """Two panels: sorted speedups vs the best baseline and vs the authors' kernel, per dtype and layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = merged["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {("float32", "batch_last"): "tab:blue", ("float32", "batch_first"): "tab:cyan",
              ("float16", "batch_last"): "tab:red", ("float16", "batch_first"): "tab:orange"}  # fmt: skip
    for ax, field, title in (
        (axes[0], "speedup_vs_best", "vs best of bmm / einsum / dense / BSR"),
        (axes[1], "speedup_vs_authors", "vs the authors' kernel"),
    ):
        for (dt, layout), color in colors.items():
            sp = sorted(r[field] for r in rows if r["dtype"] == dt and r["layout"] == layout and r.get(field))
            if sp:
                ax.plot(range(1, len(sp) + 1), sp, marker="o", ms=2, color=color, label=f"{dt} {layout} (n={len(sp)})")
        for dt, ls in (("float32", ":"), ("float16", "--")):
            target = TARGETS[dt][0 if field == "speedup_vs_best" else 1]
            ax.axhline(target, color="gray", lw=0.8, ls=ls, label=f"{dt} target {target}x")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("patterns, sorted by speedup")
        ax.set_ylabel("prunekit ks_mm speedup")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"Kronecker-sparse matmul, batch {merged.get('batch')}, {merged.get('device')}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", type=Path, help="Part JSONs of benchmarks/ks.py.")
    parser.add_argument("--merged", type=Path, help="Write the merged JSON (with its summary) here.")
    parser.add_argument("--png", type=Path, help="Write the speedup distribution plot here.")
    parser.add_argument("--markdown", type=Path, help="Write the Markdown tables here (else print them).")
    args = parser.parse_args(argv)
    for path in (args.merged, args.png, args.markdown):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
    merged = merge(args.parts)
    merged["summary"] = summarize(merged["rows"])
    table = variant_table(merged["rows"])
    merged["variant_table"] = [{"key": list(k), **v} for k, v in table.items()]
    source = args.merged.name if args.merged else ", ".join(p.name for p in args.parts)
    if args.merged:
        args.merged.write_text(json.dumps(merged, indent=1) + "\n")
    if args.png:
        plot(merged, args.png)
    text = markdown(merged) + "\n```python\n" + variant_table_literal(table, source) + "\n```\n"
    if args.markdown:
        args.markdown.write_text(text)
    else:
        print(text)
    return merged


if __name__ == "__main__":
    main()
