"""Kronecker-sparse matmul benchmark (issue 8; the sweep of Gonon et al. 2024, arXiv 2405.15013, section 5).

For each pattern (a, b, c, d) of a deterministic subsample of the paper's 728 patterns (``--patterns``, the authors'
``patterns.in`` as copied to shared/data/ks_patterns.txt), batch N = 25088, fp32 and fp16, batch-last (X: (a*c*d, N)
row-major) and batch-first (x2d: (N, a*c*d) row-major, the op reads X = x2d.t() in place), it times Y = K X with:

- ``prunekit``: ``kernels.ks.ks_mm_cuda`` (tensor cores for fp16, CUDA cores for fp32; its default tile rows and
  pipelining), and for fp16 also every variant (``tile64_simple``, ``tile64_pipe``, ``tile128_simple``,
  ``tile128_pipe``: one or two shared-memory stages) to check the defaults against measurements;
- ``bmm``: Monarch-style permute X to (a*d, c, N) + bmm + permute back (copies included);
- ``einsum``: ``torch.einsum`` on the (a, d, b, c) blocks and the viewed X;
- ``dense``: cuBLAS on the dense (a*b*d, a*c*d) K (fp32 without TF32);
- ``bsr``: torch BSR with (b, c) blocks, only when d == 1 (for d > 1 the support has no dense tiles without a
  permutation: that case is the bmm baseline); ``csr``: torch sparse CSR.

The authors' own kernel is not in this script: its build compiles one extension per pattern (~40 s each, see
shared/baselines/README.md), which the device budget of this run does not allow.

Timing: CUDA events around each call after 2 warm-ups, median of up to 10 calls (at least 3, about 40 ms per
contender; a contender over 100 ms per call is timed once after one warm-up); before each timed call a 256 MB
scratch buffer is overwritten (outside the events), so no call finds its inputs in the 50 MB L2 (small patterns'
X would fit). Correctness: every prunekit variant's output (poisoned with NaN first) against a float64
einsum on the GPU, relative Frobenius error (``correct``: all variants under the dtype's tolerance). Floor per pattern: max(2*a*b*c*d*N / peak, (a*c*d + a*b*d)*N*bytes / bw)
with peak (cuBLAS 8192^3 matmul of the dtype) and bw (device-to-device copy) measured at the start of the run.

Subsample (deterministic): the patterns with max(a*b*d, a*c*d) <= ``--max-dim`` (16384 by default: 394 of 728), every
``len // --count``-th of them in file order, the first ``--count``, run in an order shuffled with seed 0. ``--budget-s`` stops starting new patterns after
that many seconds; the JSON (rewritten after each pattern) says which ran.

``python benchmarks/ks.py --out benchmarks/results/ks-h100-<date>.json`` on the GPU machine;
``python benchmarks/ks.py --plot RESULTS.json`` (any machine) draws the speedup distribution next to the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BATCH = 25088  # the paper's batch (Gonon et al. 2024, section 5: 128 images x 196 ViT tokens)
FLUSH_BYTES = 256 << 20  # > 2x the H100's 50 MB L2
_FLUSH: list = []  # the scratch buffer overwritten before each timed call (cuda only)
DEVICE = "cuda"  # "cpu" with --dry-run: the same code path on tiny sizes with the reference op (no timings kept)
DEFAULT_PATTERNS = Path(__file__).resolve().parents[2] / "shared" / "data" / "ks_patterns.txt"
TARGET_MS = 40.0  # time per contender and pattern
SLOW_MS = 100.0  # contenders slower than this per call are timed once
TOL = {"float32": 1e-5, "float16": 2e-3}


def read_patterns(path: Path) -> list[tuple[int, int, int, int]]:
    """The (a, b, c, d) lines of the authors' pattern list, in file order."""
    quads = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            quads.append(tuple(int(v) for v in line.split(",")))
    return quads


def subsample(quads: list, count: int, max_dim: int) -> list:
    """Every ``len // count``-th pattern with max(a*b*d, a*c*d) <= max_dim, the first ``count`` (file order), in
    an order shuffled with seed 0."""
    fit = [q for q in quads if max(q[0] * q[1] * q[3], q[0] * q[2] * q[3]) <= max_dim]
    step = max(1, len(fit) // count)
    chosen = fit[::step][:count]
    random.Random(0).shuffle(chosen)  # run order: a budget cut still leaves a spread of the subsample
    return chosen


def _event_ms(fn) -> float:
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if _FLUSH:
        _FLUSH[0].zero_()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def median_ms(fn, target_ms: float = TARGET_MS) -> float:
    """Median event time of ``fn`` after warm-up: up to 10 calls (at least 3) within ``target_ms``; a contender
    slower than :data:`SLOW_MS` per call is timed once after one warm-up (it cannot be the best by a margin that
    matters, and the device budget is short)."""
    first = _event_ms(fn)
    if first > SLOW_MS:
        return _event_ms(fn)
    _event_ms(fn)
    times: list[float] = []
    while len(times) < 10 and (len(times) < 3 or sum(times) < target_ms):
        times.append(_event_ms(fn))
    return statistics.median(times)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def ks_call(blocks, x, out=None, tile_rows=None, pipelined=None):
    """The prunekit contender: the CUDA kernel (the reference op under --dry-run)."""
    from prunekit.kernels import ks

    if DEVICE == "cpu":
        y = ks.ks_mm(blocks, x)
        return y if out is None else out.copy_(y)
    return ks.ks_mm_cuda(blocks, x, out=out, tile_rows=tile_rows, pipelined=pipelined)


def ceilings() -> dict:
    """Measured device ceilings: copy bandwidth (read + write bytes / s) and matmul rates per dtype."""
    buffers = [torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    copy_ms = median_ms(lambda: buffers[1].copy_(buffers[0]))
    out = {"copy_gbps": 2 * buffers[0].numel() / copy_ms / 1e6}
    buffers.clear()
    for name, dtype in (("float16", torch.float16), ("float32", torch.float32)):
        a = torch.randn(8192, 8192, device=DEVICE, dtype=dtype)
        b = torch.randn(8192, 8192, device=DEVICE, dtype=dtype)
        ms = median_ms(lambda a=a, b=b: a @ b)
        out[f"matmul_{name}_tflops"] = 2 * 8192**3 / ms / 1e9
    return out


def run_pattern(quad, dtype_name: str, batch_first: bool, ceil: dict, gen: torch.Generator) -> dict:
    from prunekit.formats.ks import blocks_to_dense
    from prunekit.kernels import ks

    a, b, c, d = quad
    dtype = getattr(torch, dtype_name)
    m, k, n = a * b * d, a * c * d, BATCH
    blocks = (torch.randn(a, d, b, c, generator=gen, device=DEVICE) / math.sqrt(c)).to(dtype)
    if batch_first:
        x2d = torch.randn(n, k, generator=gen, device=DEVICE).to(dtype)
        x = x2d.t()
    else:
        x = torch.randn(k, n, generator=gen, device=DEVICE).to(dtype)
        x2d = None
    row = {"pattern": list(quad), "dtype": dtype_name, "layout": "batch_first" if batch_first else "batch_last"}

    ref = torch.einsum("adbc,acdn->abdn", blocks.double(), x.double().reshape(a, c, d, n)).reshape(m, n)
    ref_norm = float(ref.norm())
    variants = {"prunekit": {}}
    if dtype != torch.float32 and DEVICE == "cuda":
        for tile in ks.TILE_ROWS:
            for pipe in (False, True):
                variants[f"tile{tile}_{'pipe' if pipe else 'simple'}"] = {"tile_rows": tile, "pipelined": pipe}

    def poisoned_error(kwargs: dict, ref: torch.Tensor) -> float | None:
        out = torch.full((n, m), float("nan"), dtype=dtype, device=DEVICE).t() if batch_first else None
        if out is None:
            out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
        ks_call(blocks, x, out=out, **kwargs)
        _sync()
        err = float((out.double() - ref).norm()) / ref_norm
        return None if math.isnan(err) else err

    row["variant_rel_error"] = {name: poisoned_error(kw, ref) for name, kw in variants.items()}
    row["rel_error"] = row["variant_rel_error"]["prunekit"]
    row["correct"] = all(e is not None and e < TOL[dtype_name] for e in row["variant_rel_error"].values())
    del ref

    ms: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    row["tile_rows"] = ks.pick_tile(b, c, dtype)
    row["pipelined"] = ks.PIPELINED_DEFAULT
    for name, kwargs in variants.items():
        ms[name] = median_ms(lambda kwargs=kwargs: ks_call(blocks, x, **kwargs))

    w_bmm = blocks.reshape(a * d, b, c)

    def bmm_call():
        xs = x2d.reshape(n, a, c, d).permute(1, 3, 2, 0) if batch_first else x.reshape(a, c, d, n).permute(0, 2, 1, 3)
        y = torch.bmm(w_bmm, xs.reshape(a * d, c, n))
        y = y.reshape(a, d, b, n).permute(3, 0, 2, 1) if batch_first else y.reshape(a, d, b, n).permute(0, 2, 1, 3)
        return y.reshape(n, m) if batch_first else y.reshape(m, n)

    def einsum_call():
        if batch_first:
            return torch.einsum("adbc,nacd->nabd", blocks, x2d.reshape(n, a, c, d)).reshape(n, m)
        return torch.einsum("adbc,acdn->abdn", blocks, x.reshape(a, c, d, n)).reshape(m, n)

    contenders = {"bmm": bmm_call, "einsum": einsum_call}
    dense_w = blocks_to_dense(blocks)
    contenders["dense"] = (lambda: F.linear(x2d, dense_w)) if batch_first else (lambda: dense_w @ x)
    try:
        csr = dense_w.to_sparse_csr()
        contenders["csr"] = (lambda: csr @ x2d.t()) if batch_first else (lambda: csr @ x)
    except Exception as exc:  # noqa: BLE001 - record why a baseline cannot run
        errors["csr"] = str(exc).splitlines()[0][:160]
    if d == 1:
        try:
            bsr = dense_w.to_sparse_bsr((b, c))
            contenders["bsr"] = (lambda: bsr @ x2d.t()) if batch_first else (lambda: bsr @ x)
        except Exception as exc:  # noqa: BLE001
            errors["bsr"] = str(exc).splitlines()[0][:160]
    for name, fn in contenders.items():
        try:
            ms[name] = median_ms(fn)
        except Exception as exc:  # noqa: BLE001
            ms[name] = None
            errors[name] = str(exc).splitlines()[0][:160]
        _empty_cache()
    row["ms"] = ms
    row["errors"] = errors
    base = {k: v for k, v in ms.items() if k in ("bmm", "einsum", "dense", "bsr") and v}
    row["best_baseline"] = min(base, key=base.get) if base else None
    row["speedup_vs_best"] = base[row["best_baseline"]] / ms["prunekit"] if base else None
    elt = torch.finfo(dtype).bits // 8
    flops = 2 * a * b * c * d * n
    nbytes = (k + m) * n * elt
    peak = ceil[f"matmul_{dtype_name}_tflops"] * 1e12
    floor_ms = max(flops / peak, nbytes / (ceil["copy_gbps"] * 1e9)) * 1e3
    row["floor_ms"] = floor_ms
    row["floor_fraction"] = floor_ms / ms["prunekit"]
    return row


def summarize(rows: list) -> dict:
    out = {}
    for dt in ("float32", "float16"):
        for layout in ("batch_last", "batch_first", "all"):
            sel = [r for r in rows if r["dtype"] == dt and (layout == "all" or r["layout"] == layout)]
            sp = sorted(r["speedup_vs_best"] for r in sel if r.get("speedup_vs_best"))
            if not sp:
                continue
            q = statistics.quantiles(sp, n=4, method="inclusive") if len(sp) > 1 else [sp[0]] * 3
            worst = sorted((r for r in sel if r.get("speedup_vs_best")), key=lambda r: r["speedup_vs_best"])[:3]
            out[f"{dt}/{layout}"] = {
                "count": len(sp),
                "median": statistics.median(sp),
                "q1": q[0],
                "q3": q[2],
                "min": sp[0],
                "max": sp[-1],
                "wins": sum(s > 1.0 for s in sp),
                "floor_fraction_median": statistics.median(r["floor_fraction"] for r in sel),
                "all_correct": all(r["correct"] for r in sel),
                "worst": [[r["pattern"], r["layout"], round(r["speedup_vs_best"], 3)] for r in worst],
            }
    return out


def markdown(path: Path) -> str:
    """Markdown tables (summary, then every row) of a results JSON, for docs/KRONECKER.md."""
    data = json.loads(path.read_text())
    ceil = data["ceilings"]
    lines = [
        f"{data['device']}, torch {data['torch']}, CUDA {data['cuda']}, {data['date']}, batch {data['batch']}; "
        f"{data.get('patterns_run', 0)} patterns of the subsample ran in {data.get('elapsed_s', 0):.0f} s. Measured "
        f"ceilings: copy {ceil['copy_gbps']:.0f} GB/s, fp16 matmul {ceil['matmul_float16_tflops']:.0f} TFLOP/s, "
        f"fp32 matmul {ceil['matmul_float32_tflops']:.0f} TFLOP/s.",
        "",
        "| dtype / layout | n | median speedup | q1 | q3 | min | max | wins | median floor fraction | all correct |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, v in data.get("summary", {}).items():
        lines.append(
            f"| {key} | {v['count']} | {v['median']:.2f}x | {v['q1']:.2f} | {v['q3']:.2f} | {v['min']:.2f} | "
            f"{v['max']:.2f} | {v['wins']} | {v['floor_fraction_median']:.2f} | {v['all_correct']} |"
        )
    lines += [
        "",
        "| pattern | dtype | layout | prunekit ms | best baseline | its ms | speedup | floor fraction | rel. error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        best = r["best_baseline"]
        lines.append(
            f"| {','.join(map(str, r['pattern']))} | {r['dtype']} | {r['layout']} | {r['ms']['prunekit']:.3f} | "
            f"{best} | {r['ms'].get(best) or float('nan'):.3f} | {r['speedup_vs_best'] or float('nan'):.2f}x | "
            f"{r['floor_fraction']:.2f} | {r['rel_error'] if r['rel_error'] is None else format(r['rel_error'], '.1e')} |"
        )
    return "\n".join(lines)


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for dt, layout, color in (
        ("float32", "batch_last", "tab:blue"),
        ("float32", "batch_first", "tab:cyan"),
        ("float16", "batch_last", "tab:red"),
        ("float16", "batch_first", "tab:orange"),
    ):
        sp = sorted(
            r["speedup_vs_best"]
            for r in data["rows"]
            if r["dtype"] == dt and r["layout"] == layout and r["speedup_vs_best"]
        )
        if sp:
            ax.plot(range(1, len(sp) + 1), sp, marker="o", ms=3, color=color, label=f"{dt} {layout} (n={len(sp)})")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("patterns, sorted by speedup")
    ax.set_ylabel("prunekit ks_mm speedup vs best of bmm/einsum/dense/bsr")
    ax.set_title(f"Kronecker-sparse matmul, batch {data['batch']}, {data['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", type=Path, default=DEFAULT_PATTERNS)
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--max-dim", type=int, default=16384)
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--layouts", default="batch_last,batch_first")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path, help="Draw the speedup distribution of a results JSON and exit.")
    parser.add_argument("--markdown", type=Path, help="Print Markdown tables of a results JSON and exit.")
    parser.add_argument("--dry-run", action="store_true", help="CPU, batch 64, reference op: checks the script only.")
    args = parser.parse_args()
    global DEVICE, BATCH
    if args.dry_run:
        DEVICE, BATCH = "cpu", 64
    if args.plot:
        print(plot(args.plot))
        return
    if args.markdown:
        print(markdown(args.markdown))
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    quads = subsample(read_patterns(args.patterns), args.count, args.max_dim)
    if DEVICE == "cuda":
        _FLUSH.append(torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda"))
    ceil = (
        ceilings()
        if DEVICE == "cuda"
        else {"copy_gbps": 1.0, "matmul_float16_tflops": 1.0, "matmul_float32_tflops": 1.0}
    )
    print(json.dumps(ceil), flush=True)
    result = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run, not a measurement)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "date": datetime.date.today().isoformat(),
        "batch": BATCH,
        "subsample": {"count": args.count, "max_dim": args.max_dim, "patterns": [list(q) for q in quads]},
        "ceilings": ceil,
        "rows": [],
    }
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    out_path = args.out or Path(os.environ.get("OUT", ".")) / "ks.json"
    done = 0
    for quad in quads:
        if time.perf_counter() - started > args.budget_s:
            break
        for dtype_name in args.dtypes.split(","):
            for layout in args.layouts.split(","):
                row = run_pattern(quad, dtype_name, layout == "batch_first", ceil, gen)
                result["rows"].append(row)
                ms = row["ms"]
                print(
                    f"{quad} {dtype_name:8s} {layout:11s} ok={row['correct']} err={row['rel_error']:.1e} "
                    f"ours={ms['prunekit']:.3f} best={row['best_baseline']}="
                    f"{(ms.get(row['best_baseline']) or float('nan')):.3f} x{row['speedup_vs_best'] or 0:.2f} "
                    f"floor={row['floor_fraction']:.2f} "
                    + " ".join(f"{k}={v:.3f}" for k, v in ms.items() if v and k != "prunekit"),
                    flush=True,
                )
                _empty_cache()
        done += 1
        result["patterns_run"] = done
        result["elapsed_s"] = time.perf_counter() - started
        result["summary"] = summarize(result["rows"])
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result.get("summary", {}), indent=1))


if __name__ == "__main__":
    main()
