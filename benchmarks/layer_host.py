"""Eager host time and eager overhead of ``SparseLinear`` per format at decode shapes, next to dense in the same run.

Issue 5 bounds the eager overhead of a BSR layer (wall-clock time of an eager call minus its kernel's device time) at
10 us, and at decode sizes the host time of one eager call, not the kernel, often sets what a user sees. For each
point (format, M x K, N) this times, on the same weights and inputs:

- ``kernel us``: the layer's device time, median over replays of a CUDA graph holding many calls (``bsr.graph_time``);
- ``wall us``: wall-clock per eager call over many back-to-back calls with one synchronize at the end
  (``bsr.wall_time``), and ``overhead us`` = wall - kernel, the target's number;
- ``host us``: host time to issue one call in a burst shorter than the launch queue (``bsr.host_time_us``);
- the same wall and host times for ``nn.Linear`` on the dense weight, and, with ``--base-module``, for the
  ``SparseLinear`` of another tree (its ``sparse_linear.py``, imported in place of this one's, on this tree's kernels):
  a before/after of a change to the layer's Python in one run; or, with ``--base-no-fastcall``, for this tree's layer
  with its decisions made inside ``fastcall.disabled()``, so that it calls the ``OpOverload`` entries (before/after
  the fast-call module); or, with ``--base-bitmap-floor D``, for this tree's layer with the bitmap kernel's density
  floor at N = 9-16 set to 1 / D while it decides (``csr`` only: bitmap against what ``"auto"`` takes there, e.g.
  rowwarp with its copy of X at 98%); or, with ``--base-env NAME=VALUE``, for this tree's layer called with those
  environment variables set (the C++ launchers' per-call switches, e.g. ``PRUNEKIT_ROWWARP_TRANSPOSE=0``: torch's
  copy of X instead of rowwarp's own transpose), whose device time is then timed too (``base_kernel_us``).

Inputs rotate over several independent weight/input sets sized past twice the L2 (as ``bsr.py``). Formats: ``bsr``
(static, ``--blocks``), ``nm`` (2:4), ``csr`` (the eager ``"auto"`` path). Prints a table and writes ``--out`` JSON
(device, torch version, date, settings).

    PYTHONPATH=src python benchmarks/layer_host.py --out benchmarks/results/layer-host-<dev>-<date>.json \
        [--formats bsr,nm,csr] [--shapes 4096x4096,3072x768] [--ns 1,16] [--base-module OLD/sparse_linear.py] \
        [--breakdown]   (each layer of one eager call at the first shape and the last N)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bsr import L2_BYTES, graph_time  # noqa: E402
from nm import nm24_weight  # noqa: E402
from nm24_sweep import run_meta  # noqa: E402

from prunekit import formats  # noqa: E402
from prunekit.deploy.runtime.sparse_linear import SparseLinear  # noqa: E402
from prunekit.kernels import fastcall  # noqa: E402


def interleaved(
    calls: dict[str, list], trials: int = 15, burst: int = 100, contexts: dict | None = None
) -> dict[str, dict[str, float]]:
    """Host and wall microseconds per call of each entry of ``calls`` (name -> calls to rotate over), the candidates
    taking turns within every trial so that slow phases of the host hit them alike. ``host``: perf_counter around a
    burst of calls shorter than the launch queue, the GPU not waited for (the host never blocks); ``wall``: the same
    burst with a synchronize before and after it, so device time counts where the GPU is the bottleneck. Median and
    minimum over ``trials``. ``contexts``: name -> a function giving a context manager that each burst of that
    candidate runs in (e.g. :func:`env_set`), entered outside the timed span."""
    contexts = contexts or {}
    samples = {name: {"host": [], "wall": []} for name in calls}
    for fns in calls.values():
        for f in fns:
            f()
    torch.cuda.synchronize()
    for _ in range(trials):
        for name, fns in calls.items():
            for kind in ("host", "wall"):
                with contexts.get(name, contextlib.nullcontext)():
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for i in range(burst):
                        fns[i % len(fns)]()
                    if kind == "wall":
                        torch.cuda.synchronize()
                    samples[name][kind].append((time.perf_counter() - start) / burst * 1e6)
                    torch.cuda.synchronize()
    return {
        name: {f"{kind}_us": statistics.median(v) for kind, v in s.items()}
        | {f"{kind}_min_us": min(v) for kind, v in s.items()}
        for name, s in samples.items()
    }


@contextlib.contextmanager
def env_set(assignments: dict[str, str] | None):
    """Within the block, the environment variables ``assignments`` (name -> value) are set (the kernels' per-call
    switches, read by the C++ launchers at each call, e.g. ``PRUNEKIT_ROWWARP_TRANSPOSE=0``); restored after."""
    assignments = assignments or {}
    before = {name: os.environ.get(name) for name in assignments}
    os.environ.update(assignments)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load_base(path: Path) -> type:
    """``SparseLinear`` from another tree's ``sparse_linear.py``, imported as a sibling module of this one (its relative
    imports resolve to this tree's formats and kernels)."""
    name = "prunekit.deploy.runtime._base_sparse_linear"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.SparseLinear


def weight(fmt: str, m: int, k: int, sparsity: float, block: int, gen: torch.Generator) -> torch.Tensor:
    """``(m, k)`` fp16 weight on the GPU: ``block x block`` tiles kept with probability 1 - sparsity (bsr), the two
    largest of every four (nm), or elements kept with probability 1 - sparsity (csr)."""
    if fmt == "nm":
        return nm24_weight(m, k, torch.float16, gen)
    w = torch.randn(m, k, device="cuda", generator=gen)
    if fmt == "bsr":
        keep = torch.rand(m // block, k // block, device="cuda", generator=gen) >= sparsity
        return (w * keep.repeat_interleave(block, 0).repeat_interleave(block, 1)).half()
    return (w * (torch.rand(m, k, device="cuda", generator=gen) >= sparsity)).half()


@contextlib.contextmanager
def bitmap_floor(denominator: int | None):
    """Within the block, ``"auto"`` takes the bitmap kernel at N = 9-16 from density 1 / ``denominator`` (the
    constants ``gpu.bitmap_min_density_denominator`` reads; None: as they are)."""
    from prunekit.kernels import gpu

    names = (
        "BITMAP_MIN_DENSITY_DENOMINATOR_STAGED",
        "BITMAP_MIN_DENSITY_DENOMINATOR_16",
        "BITMAP_SMALL_MIN_DENSITY_DENOMINATOR",
    )
    before = {name: getattr(gpu, name) for name in names}
    # gpu.plan_spmm keeps its plans (functools.lru_cache): without clearing them the decisions made inside the block
    # would be served to the layers deciding after it (the twenty-first session's runs of this option: both arms
    # then ran the bitmap kernel)
    gpu._plan_spmm.cache_clear()
    try:
        for name in names:
            setattr(gpu, name, denominator or before[name])
        yield
    finally:
        for name, value in before.items():
            setattr(gpu, name, value)
        gpu._plan_spmm.cache_clear()


def run_point(
    fmt, m, k, n, sparsity, block, base_cls, gen, trials, base_no_fastcall=False, base_floor=None, base_env=None
) -> dict:
    params = {"block_rows": block, "block_cols": block} if fmt == "bsr" else {"n": 2, "m": 4} if fmt == "nm" else {}
    density = 0.5 if fmt == "nm" else 1 - sparsity
    set_bytes = (m * k * density * (3 if fmt == "csr" else 2) + 2 * k * n + 2 * m * n) * 1.0
    n_sets = max(2, min(16, math.ceil(2 * L2_BYTES / set_bytes)))
    sets = []
    for _ in range(n_sets):
        w = weight(fmt, m, k, sparsity, block, gen)
        enc = formats.encode(fmt, w.cpu(), params)
        x2d = torch.randn(n, k, device="cuda", generator=gen).half()
        dense = torch.nn.Linear(k, m, bias=False, device="cuda", dtype=torch.float16)
        dense.weight.data.copy_(w)
        base = base_cls(enc).cuda() if base_cls is not None else None
        sets.append((SparseLinear(enc).cuda(), base, dense, x2d))
    res = {"format": fmt, "m": m, "k": k, "n": n, "sparsity": 0.5 if fmt == "nm" else sparsity, "n_sets": n_sets}
    if fmt == "bsr":
        res["block"] = block
    if base_no_fastcall or base_floor:  # the base layers decide (and keep) their entries in their setting
        off = fastcall.disabled() if base_no_fastcall else contextlib.nullcontext()
        with torch.inference_mode(), off, bitmap_floor(base_floor):
            for s in sets:
                s[1](s[3])
    with torch.inference_mode():
        layer0, _, dense0, x0 = sets[0]
        ref = dense0(x0).float()
        res["rel_err"] = float((layer0(x0).float() - ref).norm() / ref.norm().clamp_min(1e-30))
        calls = {
            "layer": [lambda s=s: s[0](s[3]) for s in sets],
            "dense": [lambda s=s: s[2](s[3]) for s in sets],
        }
        if base_cls is not None:
            calls["base"] = [lambda s=s: s[1](s[3]) for s in sets]
        res["kernel_us"] = 1e3 * graph_time(calls["layer"])
        res["dense_kernel_us"] = 1e3 * graph_time(calls["dense"])
        if base_env:  # the base's own device time: the switches change which kernels run
            with env_set(base_env):
                res["base_kernel_us"] = 1e3 * graph_time(calls["base"])
        contexts = {"base": lambda: env_set(base_env)} if base_env else None
        for name, times in interleaved(calls, trials, contexts=contexts).items():
            for key, value in times.items():
                res[f"{name}_{key}"] = value
    res["overhead_us"] = res["layer_wall_us"] - res["kernel_us"]
    if base_cls is not None:
        res["base_overhead_us"] = res["base_wall_us"] - res.get("base_kernel_us", res["kernel_us"])
    res["vs_dense_eager"] = res["dense_wall_us"] / res["layer_wall_us"]
    del sets
    torch.cuda.empty_cache()
    return res


def breakdown(m: int, k: int, n: int, sparsity: float, base_cls, gen, trials: int) -> dict[str, dict[str, float]]:
    """Host (and wall) us per call of each layer of the eager path at one point (fp16), all candidates interleaved:
    Python floors (a view op, ``torch.empty``, a C++ op with no arguments), dense ``F.linear`` / ``nn.Linear``, and
    for each format (bsr with 32 x 32 blocks, nm, csr) the C++ entry alone (arguments prepared), the layer's
    ``forward`` and the layer called as a module (and the base tree's layer, if given)."""
    from prunekit.kernels import gpu, nm24, structured

    x = torch.randn(n, k, device="cuda", generator=gen).half()
    dense = torch.nn.Linear(k, m, bias=False, device="cuda", dtype=torch.float16)
    contexts = {}
    rows = {
        "x.t() (a Python view op)": [lambda: x.t()],
        "torch.empty(N, M) on the GPU": [lambda: torch.empty(n, m, device="cuda", dtype=torch.float16)],
        "C++ op without arguments (prunekit_structured::wgmma_available)": [
            lambda: torch.ops.prunekit_structured.wgmma_available()
        ],
        "F.linear (dense)": [lambda: torch.nn.functional.linear(x, dense.weight)],
        "nn.Linear (dense)": [lambda: dense(x)],
    }
    for fmt in ("bsr", "nm", "csr"):
        w = weight(fmt, m, k, sparsity, 32, gen)
        params = {"block_rows": 32, "block_cols": 32} if fmt == "bsr" else {"n": 2, "m": 4} if fmt == "nm" else {}
        enc = formats.encode(fmt, w.cpu(), params)
        layer = SparseLinear(enc).cuda()
        layer(x)  # the per-layer decisions
        b = layer._buffers
        # each C++ entry alone (arguments prepared), called both ways: the fast-call module's function (what the
        # layer keeps where the module loads) and the operator's OpOverload
        ways = {"fast": fastcall.entry, "torch.ops": op_overload}
        if fmt == "bsr":
            _, variant, _ = layer._eager_plans[(x.dtype, torch.float16, n if n <= structured.DECODE_MAX_N else 0)]
            args = (b["w_blocks"], b["w_crow_indices"], b["w_col_indices"], b["w_schedule"], b["w_split_rows"], x, m)
            for way, get in ways.items():
                rows[f"bsr: C++ entry alone, {way} (10 arguments)"] = [
                    lambda op=get("bsr_mm"), a=args, v=variant: op(*a, None, False, v)
                ]
        elif fmt == "nm" and n > 1:
            _, _, buffer, cfg = layer._eager_plans[(x.dtype, torch.float16, "decode")]
            for way, get in ways.items():
                rows[f"nm: C++ entry alone, {way} (5 arguments)"] = [
                    lambda op=get("linear"), bu=buffer, c=cfg: op(bu, x, None, False, c)
                ]
        elif fmt == "csr":
            v, o, c, r = b["w_values"], b["w_row_offsets"], b["w_column_indices"], b["w_row_indices"]
            kind, plan = gpu.spmm_op_entry(v, o, c, x, m, None, rows=True)
            for way, get in ways.items():
                if kind == "bitmap":
                    buffer, cfg, shape = plan
                    rows[f"csr: C++ entry alone, {way} (bitmap_linear, 6 arguments)"] = [
                        lambda op=get("bitmap_linear"), bu=buffer, cf=cfg | nm24.ROWS, sh=shape: op(
                            bu, x, None, False, cf, sh
                        )
                    ]
                elif plan is not None:
                    rows[f"csr: C++ entry alone, {way} (spmm_csr_auto, 9 arguments)"] = [
                        lambda op=get("spmm_csr_auto"), a=(v, o, c, r), p=plan | gpu.SPMM_ROWS: op(
                            *a, x, m, None, False, p
                        )
                    ]
            if kind != "bitmap" and plan is not None:  # the same weight through the bitmap entry, its plan forced
                buffer, cfg, shape = gpu.bitmap_linear_plan((v, o, c), m, k, x.device, n)
                rows["csr: bitmap entry alone on this weight, fast (its plan forced)"] = [
                    lambda op=fastcall.entry("bitmap_linear"), bu=buffer, cf=cfg | nm24.ROWS, sh=shape: op(
                        bu, x, None, False, cf, sh
                    )
                ]
                rows[f"csr: C++ entry alone, fast, {ROWWARP_COPY_ENV}=0"] = rows[
                    "csr: C++ entry alone, fast (spmm_csr_auto, 9 arguments)"
                ]
                contexts[f"csr: C++ entry alone, fast, {ROWWARP_COPY_ENV}=0"] = lambda: env_set({ROWWARP_COPY_ENV: "0"})
            rows["csr: gpu.spmm_csr_op (the custom op's CUDA implementation, x.t())"] = [
                lambda a=(v, o, c, r): gpu.spmm_csr_op(*a, x.t(), m, None)
            ]
        rows[f"{fmt}: SparseLinear.forward(x)"] = [lambda la=layer: la.forward(x)]
        rows[f"{fmt}: SparseLinear(x)"] = [lambda la=layer: la(x)]
        if base_cls is not None:
            base = base_cls(enc).cuda()
            rows[f"{fmt}: base SparseLinear(x)"] = [lambda la=base: la(x)]
        with fastcall.disabled():  # the layer with the OpOverload entries (decided here, kept)
            plain = SparseLinear(enc).cuda()
            plain(x)
        rows[f"{fmt}: SparseLinear(x), fast-call module off"] = [lambda la=plain: la(x)]
    with torch.inference_mode():
        return interleaved(rows, trials, contexts=contexts), profiles(rows)


ROWWARP_COPY_ENV = "PRUNEKIT_ROWWARP_TRANSPOSE"  # "0": torch's copy of X instead of rowwarp's own transpose


def op_overload(name: str):
    """The ``OpOverload`` of the operator the fast entry ``name`` calls."""
    namespace, op = fastcall.ENTRIES[name]
    return getattr(getattr(torch.ops, namespace), op).default


def profiles(rows: dict[str, list], calls: int = 50) -> dict[str, list[dict]]:
    """torch.profiler's CPU-side view of ``calls`` eager calls of each layer-level candidate of :func:`breakdown`
    (SparseLinear and nn.Linear): per event (ATen op, our ops, CUDA runtime calls such as ``cudaLaunchKernel``), its
    count and self CPU us per call, the ten largest. The profiler adds its own cost to each event: read the shares, not
    the sums."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, fns in rows.items():
        if not (name.endswith("SparseLinear(x)") or name.startswith("nn.Linear")):
            continue
        fns[0]()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fns[0]()
            torch.cuda.synchronize()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
        out[name] = [
            {"event": e.key, "count_per_call": e.count / calls, "self_cpu_us_per_call": e.self_cpu_time_total / calls}
            for e in events
        ]
    return out


def table(results: list[dict], base: bool) -> Table:
    t = Table(title="SparseLinear eager: host time and overhead per call (us), fp16")
    cols = ["format", "M x K", "N", "sp", "kernel", "wall", "overhead", "host"]
    cols += ["base kernel", "base wall", "base overhead", "base host"] if base else []
    cols += ["dense kernel", "dense wall", "dense host", "x dense (eager)", "err"]
    for c in cols:
        t.add_column(c, justify="right")
    for r in results:
        name = f"bsr b{r['block']}" if r["format"] == "bsr" else r["format"]
        row = [name, f"{r['m']}x{r['k']}", str(r["n"]), f"{r['sparsity']:.2f}", f"{r['kernel_us']:.2f}"]
        row += [f"{r['layer_wall_us']:.2f}", f"{r['overhead_us']:.2f}", f"{r['layer_host_us']:.2f}"]
        if base:
            row += [f"{r['base_kernel_us']:.2f}" if "base_kernel_us" in r else "-"]
            row += [f"{r['base_wall_us']:.2f}", f"{r['base_overhead_us']:.2f}", f"{r['base_host_us']:.2f}"]
        row += [f"{r['dense_kernel_us']:.2f}", f"{r['dense_wall_us']:.2f}", f"{r['dense_host_us']:.2f}"]
        row += [f"{r['vs_dense_eager']:.2f}", f"{r['rel_err']:.1e}"]
        t.add_row(*row)
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--formats", default="bsr,nm,csr", help="empty: only the breakdown")
    parser.add_argument("--shapes", default="4096x4096,11008x4096,3072x768")
    parser.add_argument("--ns", default="1,16")
    parser.add_argument("--sparsity", type=float, default=0.9, help="bsr and csr (nm is 2:4)")
    parser.add_argument("--blocks", default="32,64", help="bsr block sizes (square)")
    parser.add_argument("--base-module", type=Path, help="another tree's sparse_linear.py, timed beside this one")
    parser.add_argument(
        "--base-no-fastcall",
        action="store_true",
        help="time this tree's layer with the fast-call module off as the base (instead of --base-module)",
    )
    parser.add_argument(
        "--base-bitmap-floor",
        type=int,
        metavar="D",
        help="csr: the base is this tree's layer deciding with the bitmap density floor 1/D at N = 9-16",
    )
    parser.add_argument(
        "--base-env",
        action="append",
        metavar="NAME=VALUE",
        help="the base is this tree's layer called with these environment variables set (the kernels' per-call "
        "switches, e.g. PRUNEKIT_ROWWARP_TRANSPOSE=0); repeatable",
    )
    parser.add_argument("--trials", type=int, default=15, help="interleaved trials per point (medians reported)")
    parser.add_argument(
        "--breakdown", action="store_true", help="also time each layer of one eager call (breakdown() below)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("layer_host.py needs a CUDA GPU")
    if sum(map(bool, (args.base_module, args.base_no_fastcall, args.base_bitmap_floor, args.base_env))) > 1:
        raise SystemExit("--base-module, --base-no-fastcall, --base-bitmap-floor and --base-env are exclusive")
    base_env = dict(a.split("=", 1) for a in args.base_env) if args.base_env else None
    own_base = args.base_no_fastcall or args.base_bitmap_floor or base_env
    base_cls = load_base(args.base_module) if args.base_module else SparseLinear if own_base else None
    if args.base_no_fastcall and fastcall.load() is None:
        raise SystemExit("--base-no-fastcall: the fast-call module is unavailable here (see the warning)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for fmt in filter(None, args.formats.split(",")):
        for shape in args.shapes.split(","):
            m, k = (int(v) for v in shape.split("x"))
            for n in (int(v) for v in args.ns.split(",")):
                for block in (int(b) for b in args.blocks.split(",")) if fmt == "bsr" else (0,):
                    res = run_point(
                        fmt,
                        m,
                        k,
                        n,
                        args.sparsity,
                        block,
                        base_cls,
                        gen,
                        args.trials,
                        args.base_no_fastcall,
                        args.base_bitmap_floor,
                        base_env,
                    )
                    results.append(res)
                    print(json.dumps(res), flush=True)
    Console().print(table(results, base_cls is not None))
    base = str(args.base_module) if args.base_module else "fast-call module off" if args.base_no_fastcall else None
    if args.base_bitmap_floor:
        base = f"bitmap density floor 1/{args.base_bitmap_floor} at N = 9-16"
    if base_env:
        base = "this layer with " + " ".join(f"{name}={value}" for name, value in base_env.items())
    out = {"meta": run_meta() | {"base_module": base, "fastcall": str(fastcall.loaded_path())}}
    out["results"] = results
    if args.breakdown:
        m, k = (int(v) for v in args.shapes.split(",")[0].split("x"))
        n = int(args.ns.split(",")[-1])
        # (with --base-no-fastcall the breakdown's own "fast-call module off" row is that base)
        other = base_cls if args.base_module else None
        rows, profiled = breakdown(m, k, n, args.sparsity, other, gen, max(args.trials, 21))
        t = Table(title=f"host us per eager call, {m}x{k}, N = {n}, fp16 (median / min over interleaved trials)")
        for c in ("call", "host us", "host min", "wall us"):
            t.add_column(c, justify="right")
        for name, r in rows.items():
            t.add_row(name, f"{r['host_us']:.2f}", f"{r['host_min_us']:.2f}", f"{r['wall_us']:.2f}")
        Console().print(t)
        for name, events in profiled.items():
            print(f"profile of {name}: self CPU us per call")
            for e in events:
                print(f"  {e['self_cpu_us_per_call']:8.2f}  x{e['count_per_call']:.0f}  {e['event']}")
        out["breakdown"] = {"m": m, "k": k, "n": n, "sparsity": args.sparsity, "rows": rows, "profiles": profiled}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
