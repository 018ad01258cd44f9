"""2:4 at large N (issue 5): which cuSPARSELt kernels torch's call and prunekit's binding launch, eagerly and in a
CUDA graph, and how long each takes, interleaved in rounds.

``benchmarks/nm_configs.py`` found torch's ``torch._cslt_sparse_mm`` 1-14% faster than the binding by graph time, with
the same library, operand description and compressed bytes, and the binding with a new plan in every call
(``$PRUNEKIT_CSLT_FRESH_PLAN=1``) in between. torch builds its plan inside each call, so in a graph capture its plan
is built during the capture; the binding builds its plan once, before. This script tells a kernel choice from a
measurement artefact:

- ``torch``: ``torch._cslt_sparse_mm(compressed, x2d.t())`` (row-major ``(M, N)`` output, a plan per call);
- ``view``: ``prunekit_cslt::linear`` with the row-major output returned as it is (the runtime layer's call), the
  plan built before any capture;
- ``view_capture_plan``: the same on a weight prepared again, whose first call (and so its plan) happens inside the
  graph capture;
- ``view_fresh``: ``$PRUNEKIT_CSLT_FRESH_PLAN=1``, a new plan in every call, as torch builds one;
- ``view_tuned``: the same on a weight whose plan was built under ``$PRUNEKIT_CSLT_TUNE=1`` (the binding's default
  since the twenty-third session; the other variants run with ``0``, cuSPARSELt's default selection; the binding times
  cuSPARSELt's configuration ids on the first call and keeps the fastest if it beats the default selection by 3%;
  ``tuned_config_id`` in the row, -1 for the default);
- ``dense``: ``F.linear(x2d, W)`` (cuBLAS).

Per point, ``--rounds`` rounds time every variant once each, in an order rotated by one per round, by CUDA-graph
replay (``graph_ms``, median over the rounds, with min and max) and by eager CUDA events around a loop of calls
(``eager_ms``). A last pass runs each variant eagerly and in a graph under ``torch.profiler`` and records the kernel
names and their mean device time (``kernels_eager`` / ``kernels_graph``).

Writes ``--out`` JSON (device, torch, date) and prints a table. GPU machine:
``PYTHONPATH=src python benchmarks/nm_kernels.py --out $OUT/nm-kernels-h100-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nm import nm24_weight  # noqa: E402
from nm_configs import save_rows  # noqa: E402

from prunekit.kernels import structured  # noqa: E402

POINTS = [(4096, 4096, 4096), (11008, 4096, 2048), (4096, 11008, 2048), (16384, 16384, 8192)]
VARIANTS = ("dense", "torch", "view", "view_capture_plan", "view_fresh", "view_tuned")
console = Console()


def _events_ms(fn, reps: int) -> float:
    """Mean ms per call of ``reps`` back-to-back calls of ``fn`` between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _capture(fn, reps: int) -> torch.cuda.CUDAGraph:
    """A graph of ``reps`` calls of ``fn`` (the first call of a new plan may happen inside it)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    torch.cuda.synchronize()
    return graph


def _kernels(prof) -> list[dict]:
    """Kernel names (first 160 characters), counts and mean device us from a finished profiler."""
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        if e.device_type == torch.autograd.DeviceType.CUDA or (dev_us and e.key.startswith(("sm", "void", "cutlass"))):
            rows.append({"name": e.key[:160], "count": e.count, "mean_us": dev_us / max(e.count, 1)})
    return sorted(rows, key=lambda r: -r["mean_us"] * r["count"])


def _capture_plan_works() -> bool:
    """Whether the binding can build a plan inside a CUDA-graph capture (a small weight, one call)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = nm24_weight(128, 256, torch.float16, gen)
    x2d = torch.randn(32, 256, device="cuda", generator=gen).half()
    wid = int(torch.ops.prunekit_cslt.prepare(w))
    try:
        _capture(lambda: torch.ops.prunekit_cslt.linear(wid, x2d.t(), None, False, 2), 1).replay()
        torch.cuda.synchronize()
        return True
    except RuntimeError as exc:
        console.print(f"a plan cannot be built in a capture: {str(exc).splitlines()[0][:200]}")
        return False
    finally:
        torch.ops.prunekit_cslt.release(wid)


def run_point(m: int, k: int, n: int, args, gen: torch.Generator) -> dict:
    dtype = getattr(torch, args.dtype)
    w = nm24_weight(m, k, dtype, gen)
    x2d = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
    packed = torch._cslt_compress(w)
    wid = int(torch.ops.prunekit_cslt.prepare(w))
    ref = F.linear(x2d.float(), w.float())

    def view(i: int = wid):
        return torch.ops.prunekit_cslt.linear(i, x2d.t(), None, False, 2)

    tuned_id = int(torch.ops.prunekit_cslt.prepare(w))
    os.environ["PRUNEKIT_CSLT_TUNE"] = "1"
    try:
        start = time.perf_counter()
        view(tuned_id)  # the first call builds the plan: the configuration search runs here
        torch.cuda.synchronize()
        tune_s = time.perf_counter() - start
    finally:
        os.environ["PRUNEKIT_CSLT_TUNE"] = "0"  # every other variant's plans: cuSPARSELt's default selection
    calls = {
        "dense": lambda: F.linear(x2d, w),
        "torch": lambda: torch._cslt_sparse_mm(packed, x2d.t()),
        "view": view,
        "view_tuned": lambda: view(tuned_id),
    }

    @contextlib.contextmanager
    def variant(name: str, reps: int):
        """The call of variant ``name`` and a CUDA graph of ``reps`` such calls: ``view_capture_plan`` on a weight
        prepared again, whose plan is built inside the capture; ``view_fresh`` under ``$PRUNEKIT_CSLT_FRESH_PLAN=1``
        while inside; the others warmed up once before the capture."""
        fresh_id = None
        if name == "view_capture_plan":
            fresh_id = int(torch.ops.prunekit_cslt.prepare(w))
            fn = lambda: view(fresh_id)  # noqa: E731
        else:
            fn = calls.get(name, view)
        if name == "view_fresh":
            os.environ["PRUNEKIT_CSLT_FRESH_PLAN"] = "1"
        try:
            if fresh_id is None:
                fn()
                torch.cuda.synchronize()
            yield fn, _capture(fn, reps)
        finally:
            os.environ.pop("PRUNEKIT_CSLT_FRESH_PLAN", None)
            if fresh_id is not None:
                torch.ops.prunekit_cslt.release(fresh_id)

    res: dict = {"m": m, "k": k, "n": n, "dtype": args.dtype, "rounds": args.rounds}
    res["tuned_config_id"], res["tune_source"] = (int(v) for v in torch.ops.prunekit_cslt.last_config(tuned_id))
    res["tune_first_call_s"] = tune_s
    for name, fn in calls.items():
        out = fn()
        y = out if name == "dense" else out.t()
        res[f"{name}_err"] = float((y.float() - ref).norm() / ref.norm())
    variants = VARIANTS if args.capture_plan else tuple(v for v in VARIANTS if v != "view_capture_plan")
    res["variants"] = list(variants)
    graph_ms: dict[str, list[float]] = {v: [] for v in variants}
    eager_ms: dict[str, list[float]] = {v: [] for v in variants}
    one = max(_events_ms(calls["dense"], 3), 1e-3)
    reps = max(5, min(100, int(args.target_ms / one)))
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for name in order:
            with variant(name, reps) as (fn, graph):
                graph.replay()
                torch.cuda.synchronize()
                graph_ms[name].append(statistics.median(_events_ms(graph.replay, 1) / reps for _ in range(5)))
                del graph
                eager_ms[name].append(_events_ms(fn, reps))
    for name in variants:
        res[f"{name}_graph_ms"] = statistics.median(graph_ms[name])
        res[f"{name}_graph_ms_min"], res[f"{name}_graph_ms_max"] = min(graph_ms[name]), max(graph_ms[name])
        res[f"{name}_graph_ms_rounds"] = graph_ms[name]
        res[f"{name}_eager_ms"] = statistics.median(eager_ms[name])
        res[f"{name}_eager_ms_rounds"] = eager_ms[name]
    for name in variants[1:]:
        res[f"{name}_graph_x_dense"] = res["dense_graph_ms"] / res[f"{name}_graph_ms"]
        res[f"{name}_eager_x_dense"] = res["dense_eager_ms"] / res[f"{name}_eager_ms"]
    # kernel names, eager and in a graph
    from torch.profiler import ProfilerActivity, profile

    for name in variants if not args.no_profile else ():
        with variant(name, 3) as (fn, graph):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            res[f"{name}_kernels_eager"] = _kernels(prof)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            res[f"{name}_kernels_graph"] = _kernels(prof)
            del graph
    torch.ops.prunekit_cslt.release(wid)
    torch.ops.prunekit_cslt.release(tuned_id)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", default="", help="comma-separated indices into POINTS (default all)")
    parser.add_argument("--shapes", default="", help="MxKxN,... instead of --points, e.g. 4096x4096x512")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler pass (kernel names)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--target-ms", type=float, default=40.0, help="device time per graph / eager loop")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("nm_kernels.py needs a CUDA GPU")
    structured.load_cslt()
    # the binding searches configurations by default (kTuneDefault); the variants other than view_tuned time
    # cuSPARSELt's default selection
    os.environ["PRUNEKIT_CSLT_TUNE"] = "0"
    args.capture_plan = _capture_plan_works()
    points = [POINTS[int(i)] for i in args.points.split(",")] if args.points else POINTS
    if args.shapes:
        points = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, k, n in points:
        rows.append(run_point(m, k, n, args, gen))
        torch.cuda.empty_cache()
        console.print(
            f"{m}x{k} N={n} done: configuration id {rows[-1]['tuned_config_id']} chosen in "
            f"{rows[-1]['tune_first_call_s']:.2f} s"
        )
    meta = save_rows(args.out, rows)
    table = Table(title=f"2:4 kernels, x dense (graph / eager, median of rounds) on {meta['device']} ({meta['date']})")
    table.add_column("M x K, N")
    table.add_column("dense ms (graph)")
    names = [v for v in VARIANTS[1:] if all(f"{v}_graph_x_dense" in r for r in rows)]
    for name in names:
        table.add_column(name)
    for r in rows:
        table.add_row(
            f"{r['m']}x{r['k']}, {r['n']}",
            f"{r['dense_graph_ms']:.4f}",
            *(f"{r[name + '_graph_x_dense']:.2f} / {r[name + '_eager_x_dense']:.2f}" for name in names),
        )
    console.print(table)
    for r in rows:
        console.print(f"{r['m']}x{r['k']}, N={r['n']}")
        for name in r["variants"]:
            for mode in ("eager", "graph"):
                ks = r.get(f"{name}_kernels_{mode}", [])
                desc = "; ".join(f"{x['name'][:90]} x{x['count']} {x['mean_us']:.1f}us" for x in ks[:3])
                console.print(f"  {name:18s} {mode:5s} {desc}")


if __name__ == "__main__":
    main()
