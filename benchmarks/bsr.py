"""BSR matmul benchmark (issue 5): prunekit's tensor-core ``bsr_mm`` (static and dynamic) vs dense cuBLAS and torch's
Triton ``bsr_dense_mm``, in one run.

For every dtype, weight shape W (M x K), block (r x c), block sparsity and N: W keeps each r x c tile with probability
``1 - sparsity`` (N(0, 1) values inside kept tiles), activations are nn.Linear-shaped ``x2d: (N, K)``, and the
contenders compute the layer output as a user would call them:

- prunekit static: ``structured.bsr_mm_eager(blocks, crow, cols, x2d.t(), M, ..., schedule, split_rows)``, the C++
  entry ``prunekit_structured::bsr_mm`` that the runtime's SparseLinear calls when eager (output allocation, N tile
  and variant chosen in C++); returns the transposed (N, M) output, no copies. ``static_op_eager_ms`` times the same
  through the custom op ``structured.bsr_mm_static`` (``prunekit::bsr_mm_static``, the path under torch.compile /
  export; eagerly, since the thirty-eighth session, its direct call of the CUDA implementation, ``ops.eager_direct``),
  ``static_tile<BN>_gpu_ms`` each N tile of the mma.sync kernel, ``static_wgmma_*`` the sm_90a wgmma + TMA variant
  (every block size since the twenty-sixth session, when the library holds it; 16- and 32-row blocks run it with
  the roles swapped; ``static_wgmma_{xslabs,tma}_gpu_ms`` with ``--xslabs``: that kernel with ``$PRUNEKIT_BSR_XSLABS``
  1 / 0; ``static_tpc<v>[_wp<p>][_wt<w>][_st<s>][_t<tile>]_gpu_ms`` with ``--tiles-per-cta`` (``--warp-producer``,
  ``--warp-tile-n``, ``--stages``, ``--wgmma-tile-ns``): the static call with ``$PRUNEKIT_BSR_TILES_PER_CTA=v``
  (``$PRUNEKIT_BSR_WARP_PRODUCER=p``, ``$PRUNEKIT_BSR_WARP_TILE_N=w``, ``$PRUNEKIT_BSR_STAGES=s``, the wgmma kernel
  at that N tile));
- prunekit layer: ``SparseLinear.forward(x2d)`` on the exported weight, eager: ``layer_wall_ms`` is wall-clock per
  call over many back-to-back calls with one synchronize at the end, ``layer_eager_overhead_us`` that minus the
  static device time (what eager calls add over the kernel; about 0 when the GPU is the bottleneck),
  ``layer_host_us`` the host time to issue one call (perf_counter over a burst shorter than the launch queue);
  ``layer_eager_overhead_paired_us`` the same difference with both sides timed in alternating rounds (``overhead_pair``:
  the layer's own calls in a CUDA graph, ``layer_graph_ms``, against eager loops of them, ``layer_paired_wall_ms``),
  so that a drift of the GPU's or the host's speed during the run falls on both; the target's number where present
  (the eager loops hold at least ``--overhead-min-calls`` calls, 64 by default, since the thirty-ninth session);
- prunekit dynamic: ``structured.bsr_mm_cuda(blocks, crow, cols, x2d.t(), M)`` (no schedule);
- dense: ``F.linear(x2d, W)`` (cuBLAS);
- torch BSR: ``torch.sparse._triton_ops.bsr_dense_mm(W_bsr, x2d.t())`` (Triton; eager and CUDA-graph replayed).

Timing: CUDA events; ``*_gpu_ms`` is the median over replays of a CUDA graph of many calls (device time, no launch
gaps), ``*_eager_ms`` the median over loops of plain eager calls (host overhead included: what a user sees). Every
measurement rotates over several independent input sets (W and X) whose total size exceeds twice the L2 where memory
allows. Every contender's output is checked against dense fp32 before timing (relative error in the JSON).

Writes ``--out`` (JSON, rewritten after each configuration so a cut-off run keeps its results) and prints a rich
table. Run on the GPU machine: ``PYTHONPATH=src python benchmarks/bsr.py --out benchmarks/results/bsr-h100-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from prunekit.deploy.runtime.sparse_linear import SparseLinear
from prunekit.formats import EncodedTensor
from prunekit.formats.bsr import static_schedule
from prunekit.kernels import structured
from prunekit.kernels.testing import env_setting, prunekit_settings

QUICK = {
    "shapes": [(16384, 16384), (4096, 4096), (11008, 4096)],
    "ns": {(16384, 16384): [8192], (4096, 4096): [16, 4096], (11008, 4096): [16, 2048]},
    "blocks": [16, 32, 64],
    "sparsities": [0.5, 0.9, 0.95],
    "dtypes": ["float16"],
}
FULL = {
    "shapes": [(16384, 16384), (4096, 4096), (11008, 4096), (4096, 11008), (768, 3072), (3072, 768)],
    "ns": {(16384, 16384): [8192]},
    "default_ns": [1, 16, 128, 2048, 4096],
    "blocks": [16, 32, 64],
    "sparsities": [0.5, 0.7, 0.8, 0.9, 0.95],
    "dtypes": ["float16", "bfloat16"],
}
GRAPH_TARGET_S = 0.02  # device time per timed graph replay
EAGER_TARGET_S = 0.02
OVERHEAD_MIN_CALLS = 64  # overhead_pair's eager loops: at least this many calls (thirty-ninth session)
L2_BYTES = 50 * 2**20  # H100 SXM L2; rotation sets are sized to exceed twice this

console = Console()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` computed on the GPU in fp32 (inf for NaN/inf outputs)."""
    diff = (out.float() - ref.float()).norm()
    return float(diff / ref.float().norm()) if bool(torch.isfinite(diff)) else float("inf")


def _ms_between(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def eager_time(calls: list, trials: int = 5, target_s: float = EAGER_TARGET_S) -> float:
    """Median per-call ms over ``trials`` loops of eager calls rotating over ``calls`` (host overhead included)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    one = _ms_between(calls[0])
    reps = max(3, min(500, int(target_s * 1e3 / max(one, 1e-3))))

    def loop() -> None:
        for i in range(reps):
            calls[i % len(calls)]()

    return statistics.median(_ms_between(loop) / reps for _ in range(trials))


def graph_time(calls: list, replays: int = 7, target_s: float = GRAPH_TARGET_S) -> float:
    """Median per-call ms over replays of one CUDA graph holding many calls rotating over ``calls`` (device time)."""
    graph, reps = capture_graph(calls, target_s)
    return statistics.median(_ms_between(graph.replay) / reps for _ in range(replays))


def capture_graph(calls: list, target_s: float = GRAPH_TARGET_S) -> tuple[torch.cuda.CUDAGraph, int]:
    """One CUDA graph holding ``reps`` calls rotating over ``calls`` (about ``target_s`` of device time, at most 200
    calls), warmed up and replayed once: ``(graph, reps)``."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    one = _ms_between(calls[0])
    reps = max(len(calls), min(200, int(target_s * 1e3 / max(one, 1e-3))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # warm-up on the capture stream (allocator pools, lazy init)
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    return graph, reps


def _eager_reps(calls: list, target_s: float) -> int:
    """Calls per eager loop: about ``target_s`` of one warm call of ``calls[0]`` (every call run once first)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    t = time.perf_counter()
    calls[0]()
    torch.cuda.synchronize()
    return max(10, min(2000, int(target_s / max(time.perf_counter() - t, 1e-6))))


def _eager_loop(calls: list, reps: int) -> float:
    """Wall-clock ms per call of ``reps`` back-to-back calls rotating over ``calls``, one synchronize at the end."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(reps):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def wall_time(calls: list, trials: int = 5, target_s: float = EAGER_TARGET_S) -> float:
    """Median wall-clock ms per call (perf_counter) over ``trials`` loops of back-to-back eager calls with one
    synchronize at the end of each loop: host and device time together, as an application sees them."""
    reps = _eager_reps(calls, target_s)
    return statistics.median(_eager_loop(calls, reps) for _ in range(trials))


def alternating_rounds(timers: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each timer once per round, ``rounds`` rounds, the order rotated by one every round (two timers: swapped), so
    that a drift of the GPU's or the host's speed during the run (clocks, temperature) falls on all alike: the list of
    each timer's results by round."""
    names = list(timers)
    results: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            results[name].append(timers[name]())
    return results


def wall_pair(a_calls: list, b_calls: list, rounds: int = 9, target_s: float = EAGER_TARGET_S) -> dict:
    """Wall-clock ms per call of two contenders timed in alternating rounds (one ``wall_time`` loop of each per
    round, the order swapped every round), so that a drift of the GPU's speed during the run (clocks, temperature)
    falls on both alike. Returns ``a_ms`` / ``b_ms`` (medians over the rounds), ``b_over_a`` (median of the per-round
    ratios b / a) and the per-round lists ``a_rounds`` / ``b_rounds``."""
    reps_a, reps_b = _eager_reps(a_calls, target_s), _eager_reps(b_calls, target_s)
    timed = alternating_rounds(
        {"a": lambda: _eager_loop(a_calls, reps_a), "b": lambda: _eager_loop(b_calls, reps_b)}, rounds
    )
    a_rounds, b_rounds = timed["a"], timed["b"]
    return {
        "a_ms": statistics.median(a_rounds),
        "b_ms": statistics.median(b_rounds),
        "b_over_a": statistics.median(b / a for a, b in zip(a_rounds, b_rounds, strict=True)),
        "a_rounds": a_rounds,
        "b_rounds": b_rounds,
    }


def overhead_pair(
    calls: list,
    rounds: int = 7,
    replays: int = 3,
    target_s: float = EAGER_TARGET_S,
    min_calls: int = OVERHEAD_MIN_CALLS,
) -> dict:
    """What eager calls add over their own device time, both timed in the same window: a CUDA graph of ``calls``
    (:func:`capture_graph`; the median of ``replays`` replays) and a loop of back-to-back eager calls with one
    synchronize at the end (:func:`_eager_loop`, wall-clock) take turns in ``rounds`` rounds, the order swapped every
    round. A drift of the GPU's speed (clocks, temperature) or of the host's during the run then falls on both alike;
    timed minutes apart (``wall_time`` minus ``graph_time``), the difference of two long kernels' times carried that
    drift (up to 72 us on a 461 us kernel in ``bsr-final-h100-2026-11-27-s37c.json``, where the same kernel's three
    eager paths gave 7, 45 and 72 us). Returns ``graph_ms`` and ``wall_ms`` (ms per call, medians over the rounds),
    ``overhead_us`` (the median over the rounds of wall - graph, microseconds per call) and the per-round lists
    ``graph_rounds`` / ``wall_rounds`` (ms). Each eager loop makes at least ``min_calls`` calls: what a loop costs
    once (the first call's issue, the synchronize at its end) is divided by its calls, and at long kernels the
    ``target_s`` loops held only 12-24 (``eager_gap.py``, ``eager-gap-h100-2026-11-27-s39.json``: 25 and 16 us per call
    over the graph in those loops, -0.9 and 5.0 us in loops of 118-223 calls, at 1502 / 745 us kernels)."""
    graph, reps = capture_graph(calls, target_s)
    eager_reps = max(min_calls, _eager_reps(calls, target_s))
    timed = alternating_rounds(
        {
            "graph": lambda: statistics.median(_ms_between(graph.replay) / reps for _ in range(replays)),
            "wall": lambda: _eager_loop(calls, eager_reps),
        },
        rounds,
    )
    graph_rounds, wall_rounds = timed["graph"], timed["wall"]
    return {
        "graph_ms": statistics.median(graph_rounds),
        "wall_ms": statistics.median(wall_rounds),
        "overhead_us": 1e3 * statistics.median(w - g for g, w in zip(graph_rounds, wall_rounds, strict=True)),
        "graph_rounds": graph_rounds,
        "wall_rounds": wall_rounds,
    }


def host_time_us(calls: list, burst: int = 200, trials: int = 5) -> float:
    """Median host microseconds to issue one call (perf_counter around ``burst`` calls, before synchronizing; the
    burst is shorter than the launch queue, so the host never waits on the GPU)."""
    for c in calls:
        c()
    samples = []
    for _ in range(trials):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(burst):
            calls[i % len(calls)]()
        samples.append((time.perf_counter() - t) / burst * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def block_weight(
    m: int, k: int, r: int, c: int, sparsity: float, dtype: torch.dtype, gen: torch.Generator, chunk: int | None = None
):
    """Dense W with r x c tiles kept with probability 1 - sparsity, and its BSR components (built on the GPU); the
    static schedule with at most ``chunk`` blocks per item (None: ``formats.bsr.schedule_chunk``'s)."""
    keep = torch.rand(m // r, k // c, device="cuda", generator=gen) >= sparsity
    w = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.float32).to(dtype)
    w.mul_(keep.repeat_interleave(r, 0).repeat_interleave(c, 1))
    tiles = w.reshape(m // r, r, k // c, c).transpose(1, 2)
    rows, cols = torch.nonzero(keep, as_tuple=True)
    crow = torch.zeros(m // r + 1, dtype=torch.int64, device="cuda")
    crow[1:] = torch.cumsum(keep.sum(1), 0)
    schedule, split_rows = static_schedule(crow.cpu(), chunk)
    comp = {
        "blocks": tiles[rows, cols].contiguous(),
        "crow_indices": crow.to(torch.int32),
        "col_indices": cols.to(torch.int32),
        "schedule": schedule.cuda(),
        "split_rows": split_rows.cuda(),
    }
    return w, comp


def _triton_bsr():
    try:
        from torch.sparse._triton_ops import bsr_dense_mm
    except ImportError:
        return None
    return bsr_dense_mm


def run_config(m, k, n, r, sparsity, dtype, args, gen) -> dict:
    elem = torch.finfo(dtype).bits // 8
    set_bytes = (m * k * (1 - sparsity) + k * n + m * n) * elem
    n_sets = max(2, min(args.max_sets, math.ceil(2 * L2_BYTES / max(set_bytes, 1))))
    free = torch.cuda.mem_get_info()[0]
    n_sets = max(1, min(n_sets, int(0.35 * free / (set_bytes + m * k * elem))))
    sets = []
    for _ in range(n_sets):
        w, comp = block_weight(m, k, r, r, sparsity, dtype, gen, args.schedule_chunk)
        x2d = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.float32).to(dtype)
        sets.append((w, comp, x2d))
    res = {
        "m": m, "k": k, "n": n, "block": r, "sparsity": sparsity, "dtype": str(dtype).removeprefix("torch."),
        "n_sets": n_sets, "l2_resident": n_sets * set_bytes < 2 * L2_BYTES,
        "nblocks": int(sets[0][1]["crow_indices"][-1]), "split_rows": int(sets[0][1]["split_rows"].numel()),
        "schedule_items": int(sets[0][1]["schedule"].shape[0]), "schedule_chunk_arg": args.schedule_chunk,
    }  # fmt: skip
    # the schedule the static eager calls run at this N: the stored one, or structured.decode_schedule's finer one
    c0 = sets[0][1]
    used, _ = structured.decode_schedule(c0["blocks"], c0["crow_indices"], c0["schedule"], c0["split_rows"], n)
    res["decode_schedule_items"] = int(used.shape[0])

    def static_call(s, tile_n=None, variant=None):
        w, c, x2d = s
        if tile_n is None:  # the runtime's eager call: the C++ entry
            return lambda: structured.bsr_mm_eager(
                c["blocks"], c["crow_indices"], c["col_indices"], x2d.t(), m, None, "none", c["schedule"],
                c["split_rows"], variant=variant,
            )  # fmt: skip
        return lambda: structured.bsr_mm_cuda(
            c["blocks"], c["crow_indices"], c["col_indices"], x2d.t(), m, None, "none", c["schedule"],
            c["split_rows"], tile_n=tile_n, variant=variant,
        )  # fmt: skip

    def layer_call(s):
        w, c, x2d = s
        enc = EncodedTensor("bsr", (m, k), res["dtype"], {"block_rows": r, "block_cols": r}, c)
        layer = SparseLinear(enc)
        return lambda: layer(x2d)

    def static_op_call(s):
        w, c, x2d = s
        return lambda: structured.bsr_mm_static(
            c["blocks"], c["crow_indices"], c["col_indices"], c["schedule"], c["split_rows"], x2d.t(), m
        )

    def dynamic_call(s):
        w, c, x2d = s
        return lambda: structured.bsr_mm_cuda(c["blocks"], c["crow_indices"], c["col_indices"], x2d.t(), m)

    def dense_call(s):
        w, c, x2d = s
        return lambda: F.linear(x2d, w)

    w0, _, x0 = sets[0]
    ref = F.linear(x0.float(), w0.float()).t()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res["tile_n"] = structured.plan_tile_n(m, r, n, sms, sets[0][1]["blocks"].shape[0])
    res["static_err"] = relative_error(static_call(sets[0])(), ref)
    res["static_op_err"] = relative_error(static_op_call(sets[0])(), ref)
    res["dynamic_err"] = relative_error(dynamic_call(sets[0])(), ref)
    for name, make in (("static", static_call), ("dynamic", dynamic_call), ("dense", dense_call)):
        calls = [make(s) for s in sets]
        res[f"{name}_gpu_ms"] = graph_time(calls)
        res[f"{name}_eager_ms"] = eager_time(calls)
    res["static_op_eager_ms"] = eager_time([static_op_call(s) for s in sets])
    res["split_pays"] = structured.split_pays(c0["blocks"], c0["crow_indices"], n)  # what "auto" runs here (set 0)
    if args.split:  # the stored split rows forced on and off, in this order, same sets (structured.split_pays)
        for key, value in (("split", "1"), ("unsplit", "0")):
            with env_setting(structured.SPLIT_ENV, value):
                res[f"static_{key}_err"] = relative_error(static_call(sets[0])(), ref)
                res[f"static_{key}_gpu_ms"] = graph_time([static_call(s) for s in sets])
    for order in args.schedule_orders.split(",") if args.schedule_orders else ():
        # the same patterns with the schedule's items in another order (formats.bsr.static_schedule's order)
        resched = []
        for w, c, x2d in sets:
            sched, split = static_schedule(c["crow_indices"].cpu(), args.schedule_chunk, order)
            resched.append((w, {**c, "schedule": sched.cuda(), "split_rows": split.cuda()}, x2d))
        res[f"static_order_{order}_err"] = relative_error(static_call(resched[0])(), ref)
        res[f"static_order_{order}_gpu_ms"] = graph_time([static_call(s) for s in resched])
    layers = [layer_call(s) for s in sets]
    res["layer_err"] = relative_error(layers[0]().t(), ref)
    res["layer_wall_ms"] = wall_time(layers)
    res["layer_host_us"] = host_time_us(layers)
    res["layer_eager_overhead_us"] = 1e3 * (res["layer_wall_ms"] - res["static_gpu_ms"])
    if not args.no_paired_overhead:  # the same calls' device time and wall time in alternating rounds
        pair = overhead_pair(layers, args.overhead_rounds, min_calls=args.overhead_min_calls)
        res["layer_graph_ms"], res["layer_paired_wall_ms"] = pair["graph_ms"], pair["wall_ms"]
        res["layer_eager_overhead_paired_us"] = pair["overhead_us"]
    if args.wgmma and structured.wgmma_available():
        try:
            res["static_wgmma_err"] = relative_error(static_call(sets[0], variant="wgmma")(), ref)
            res["static_wgmma_gpu_ms"] = graph_time([static_call(s, variant="wgmma") for s in sets])
            res["static_wgmma_speedup_gpu"] = res["dense_gpu_ms"] / res["static_wgmma_gpu_ms"]
            for tile_n in structured.WGMMA_TILE_NS:
                res[f"static_wgmma_tile{tile_n}_gpu_ms"] = graph_time([static_call(s, tile_n, "wgmma") for s in sets])
            res["xslabs_rule"] = structured.x_slabs_rule(r, r, k, res["nblocks"], n)  # what "auto" runs here
            if args.xslabs and r in (16, 32):  # the X-slab kernels forced on and off, in this order, same sets
                for key, value in (("xslabs", "1"), ("tma", "0")):
                    with env_setting(structured.XSLABS_ENV, value):
                        res[f"static_wgmma_{key}_err"] = relative_error(static_call(sets[0], variant="wgmma")(), ref)
                        res[f"static_wgmma_{key}_gpu_ms"] = graph_time([static_call(s, variant="wgmma") for s in sets])
        except Exception as exc:  # record why the variant could not run at this point; keep benchmarking
            res["static_wgmma_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    # the static call with the wgmma kernels' output tiles per CTA ($PRUNEKIT_BSR_TILES_PER_CTA), 64-row producer
    # ($PRUNEKIT_BSR_WARP_PRODUCER), pipeline stages ($PRUNEKIT_BSR_STAGES) and N tile forced, every combination, same
    # sets: static_tpc<v>[_wp<p>][_st<s>][_t<tile>]_gpu_ms
    tpc_sweep = args.tiles_per_cta.split(",") if args.tiles_per_cta else []
    sweep = itertools.product(
        tpc_sweep,
        args.warp_producer.split(",") if args.warp_producer else [None],
        args.warp_tile_n.split(",") if args.warp_tile_n else [None],
        args.stages.split(",") if args.stages else [None],
        [int(t) for t in args.wgmma_tile_ns.split(",")] if args.wgmma_tile_ns else [None],
    )
    for per_cta, producer, warp_tile, stages, tile_n in sweep:
        key = (
            f"static_tpc{per_cta}"
            + (f"_wp{producer}" if producer else "")
            + (f"_wt{warp_tile}" if warp_tile else "")
            + (f"_st{stages}" if stages else "")
            + (f"_t{tile_n}" if tile_n else "")
        )
        with (
            env_setting(structured.TILES_PER_CTA_ENV, per_cta),
            env_setting(structured.STAGES_ENV, stages),
            env_setting(structured.WARP_PRODUCER_ENV, producer),
            env_setting(structured.WARP_TILE_N_ENV, warp_tile),
        ):
            variant = "wgmma" if tile_n else None
            res[f"{key}_err"] = relative_error(static_call(sets[0], tile_n, variant)(), ref)
            res[f"{key}_gpu_ms"] = graph_time([static_call(s, tile_n, variant) for s in sets])
    for tile_n in (32, 128) if n <= structured.DECODE_MAX_N else (128, 256):  # the N-tile sweep behind plan_tile_n
        res[f"static_tile{tile_n}_gpu_ms"] = graph_time([static_call(s, tile_n) for s in sets])
    triton_mm = _triton_bsr()
    if triton_mm is not None and not args.no_torch_bsr:
        try:
            bsrs = [(w.to_sparse_bsr((r, r)), x2d) for w, _, x2d in sets]
            res["torch_bsr_err"] = relative_error(triton_mm(bsrs[0][0], bsrs[0][1].t()), ref)
            calls = [lambda b=b, x=x: triton_mm(b, x.t()) for b, x in bsrs]
            res["torch_bsr_eager_ms"] = eager_time(calls)
            res["torch_bsr_gpu_ms"] = graph_time(calls)
        except Exception as exc:  # record why the baseline could not run at this point; keep benchmarking
            res["torch_bsr_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    flops = 2.0 * m * k * n
    res["dense_tflops"] = flops / res["dense_gpu_ms"] / 1e9
    res["static_effective_tflops"] = flops / res["static_gpu_ms"] / 1e9
    res["static_speedup_gpu"] = res["dense_gpu_ms"] / res["static_gpu_ms"]
    res["static_speedup_eager"] = res["dense_eager_ms"] / res["static_eager_ms"]
    res["dynamic_over_static"] = res["dynamic_gpu_ms"] / res["static_gpu_ms"]
    res["static_eager_overhead_us"] = 1e3 * (res["static_eager_ms"] - res["static_gpu_ms"])
    res["static_op_eager_overhead_us"] = 1e3 * (res["static_op_eager_ms"] - res["static_gpu_ms"])
    if "torch_bsr_gpu_ms" in res:
        res["torch_bsr_speedup_gpu"] = res["dense_gpu_ms"] / res["torch_bsr_gpu_ms"]
    del sets
    torch.cuda.empty_cache()
    return res


def layer_overhead_us(row: dict) -> float:
    """The eager-overhead target's number for a result row: ``layer_eager_overhead_paired_us`` where the row has it
    (timed in alternating rounds with the layer's own graph), else ``layer_eager_overhead_us`` (wall minus the static
    call's graph time, timed apart: the only one in files before the thirty-eighth session)."""
    return row.get("layer_eager_overhead_paired_us", row["layer_eager_overhead_us"])


def table(results: list[dict]) -> Table:
    t = Table(title="prunekit bsr_mm vs cuBLAS dense and torch Triton BSR (speedups vs dense, same run)")
    for col in ("dtype", "M x K", "N", "blk", "sp", "static ms", "x dense", "eager x", "layer ovh us", "host us",
                "wgmma x", "dyn/static", "torch bsr x (graph)", "torch bsr x (eager)", "err"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in results:
        tb = f"{r['torch_bsr_speedup_gpu']:.2f}" if "torch_bsr_speedup_gpu" in r else "-"
        te = f"{r['dense_eager_ms'] / r['torch_bsr_eager_ms']:.2f}" if "torch_bsr_eager_ms" in r else "-"
        t.add_row(
            r["dtype"], f"{r['m']}x{r['k']}", str(r["n"]), str(r["block"]), f"{r['sparsity']:.2f}",
            f"{r['static_gpu_ms']:.3f}", f"{r['static_speedup_gpu']:.2f}", f"{r['static_speedup_eager']:.2f}",
            f"{layer_overhead_us(r):.1f}", f"{r['layer_host_us']:.1f}",
            f"{r['static_wgmma_speedup_gpu']:.2f}" if "static_wgmma_speedup_gpu" in r else "-",
            f"{r['dynamic_over_static']:.2f}", tb, te, f"{max(r['static_err'], r['dynamic_err']):.1e}",
        )  # fmt: skip
    return t


def markdown(path: Path) -> str:
    """Markdown table of a results JSON written by this script (docs/PERFORMANCE_STRUCTURED.md is made with it)."""
    data = json.loads(path.read_text())
    meta = data["meta"]
    lines = [
        f"{meta['device']}, torch {meta['torch']} (CUDA {meta['cuda']}), {meta['date']}, `{meta['command']}`",
        "",
        "| dtype | M x K | N | block | sparsity | static ms (graph) | x dense (graph) | x dense (eager) | "
        "eager overhead us (direct / op) | layer: wall - kernel us / host us per call | wgmma x dense (graph) | "
        "dynamic / static | torch BSR x dense (graph / eager) | rel. err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        tb = "-"
        if "torch_bsr_gpu_ms" in r:
            tb = f"{r['torch_bsr_speedup_gpu']:.2f} / {r['dense_eager_ms'] / r['torch_bsr_eager_ms']:.2f}"
        layer = "-"
        if "layer_wall_ms" in r:
            layer = f"{layer_overhead_us(r):.1f} / {r['layer_host_us']:.1f}"
        wg = f"{r['static_wgmma_speedup_gpu']:.2f}" if "static_wgmma_speedup_gpu" in r else "-"
        lines.append(
            f"| {r['dtype']} | {r['m']}x{r['k']} | {r['n']} | {r['block']} | {r['sparsity']:.2f} | "
            f"{r['static_gpu_ms']:.3f} | {r['static_speedup_gpu']:.2f} | {r['static_speedup_eager']:.2f} | "
            f"{r['static_eager_overhead_us']:.0f} / {r['static_op_eager_overhead_us']:.0f} | {layer} | {wg} | "
            f"{r['dynamic_over_static']:.2f} | {tb} | {max(r['static_err'], r['dynamic_err']):.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", type=Path, help="print the markdown table of a results JSON and exit")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--full", action="store_true", help="the whole grid (about an hour); default: quick grid")
    parser.add_argument("--max-sets", type=int, default=8)
    parser.add_argument("--no-torch-bsr", action="store_true")
    parser.add_argument(
        "--no-paired-overhead",
        action="store_true",
        help="skip layer_eager_overhead_paired_us (the layer's graph and eager loops in alternating rounds)",
    )
    parser.add_argument("--overhead-rounds", type=int, default=7, help="rounds of bsr.overhead_pair per point")
    parser.add_argument(
        "--overhead-min-calls",
        type=int,
        default=OVERHEAD_MIN_CALLS,
        help="calls per eager loop of overhead_pair, at least",
    )
    parser.add_argument("--wgmma", action=argparse.BooleanOptionalAction, default=True, help="time the wgmma variant")
    parser.add_argument("--blocks", help="comma-separated block sizes (default: the grid's)")
    parser.add_argument("--sparsities", help="comma-separated block sparsities (default: the grid's)")
    parser.add_argument("--dtypes", help="comma-separated dtypes, float16 / bfloat16 (default: the grid's)")
    parser.add_argument("--time-limit-s", type=float, default=1e9, help="stop starting new configurations after this")
    parser.add_argument("--shapes", help="comma-separated MxK of the grid to run (default: all of the grid's)")
    parser.add_argument("--ns", help="comma-separated N to run, among the grid's for each shape (default: all)")
    parser.add_argument(
        "--xslabs",
        action="store_true",
        help="time the wgmma X-slab kernels ($PRUNEKIT_BSR_XSLABS=1 / 0), blocks 16 / 32",
    )
    parser.add_argument(
        "--split", action="store_true", help="time the static call with the stored split rows forced on and off"
    )
    parser.add_argument(
        "--schedule-orders",
        help="comma-separated static-schedule orders (formats.bsr.SCHEDULE_ORDERS) to time besides the stored one",
    )
    parser.add_argument("--any-ns", help="comma-separated N to run at every shape instead of the grid's")
    parser.add_argument(
        "--tiles-per-cta",
        help="comma-separated output tiles per CTA of the wgmma kernels ($PRUNEKIT_BSR_TILES_PER_CTA: 1-64 or wave) "
        "to time the static call with, as static_tpc<v>_gpu_ms (crossed with --warp-producer, --stages and "
        "--wgmma-tile-ns)",
    )
    parser.add_argument("--stages", help="with --tiles-per-cta: comma-separated $PRUNEKIT_BSR_STAGES values")
    parser.add_argument(
        "--warp-producer", help="with --tiles-per-cta: comma-separated $PRUNEKIT_BSR_WARP_PRODUCER values (0, 1, auto)"
    )
    parser.add_argument("--wgmma-tile-ns", help="with --tiles-per-cta: comma-separated wgmma N tiles (128, 256)")
    parser.add_argument(
        "--warp-tile-n", help="with --tiles-per-cta: comma-separated $PRUNEKIT_BSR_WARP_TILE_N values (64, 128)"
    )
    parser.add_argument(
        "--schedule-chunk", type=int, help="most blocks per static-schedule item (default: formats.bsr.schedule_chunk)"
    )
    args = parser.parse_args()
    if args.render:
        print(markdown(args.render))
        return
    if args.out is None:
        parser.error("--out is required")
    grid = dict(FULL if args.full else QUICK)
    if args.blocks:
        grid["blocks"] = [int(b) for b in args.blocks.split(",")]
    if args.sparsities:
        grid["sparsities"] = [float(v) for v in args.sparsities.split(",")]
    if args.dtypes:
        grid["dtypes"] = args.dtypes.split(",")
    if args.shapes:
        grid["shapes"] = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    only_ns = None if not args.ns else {int(v) for v in args.ns.split(",")}
    structured.load()
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    meta = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "command": "PYTHONPATH=src python benchmarks/bsr.py" + (" --full" if args.full else ""),
        "argv": sys.argv[1:],
        "variant": structured.bsr_variant(),
        "wgmma_available": structured.wgmma_available(),
        "timing": "median of CUDA-graph replays (gpu_ms) and of eager loops (eager_ms), rotating input sets",
        "autograd_mode": "grad",  # torch's 2:4 subclass and Triton BSR are not run under inference mode here
        # e.g. $PRUNEKIT_BSR_LEAN=1: every prunekit call at N <= 16 on the lean decode kernel
        "env": prunekit_settings(),
    }
    results: list[dict] = []
    for dtype_name in grid["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for m, k in grid["shapes"]:
            shape_ns = grid["ns"].get((m, k), grid.get("default_ns", []))
            for n in [int(v) for v in args.any_ns.split(",")] if args.any_ns else shape_ns:
                if only_ns is not None and n not in only_ns:
                    continue
                for r in grid["blocks"]:
                    for sparsity in grid["sparsities"]:
                        if time.time() - t0 > args.time_limit_s:
                            break
                        res = run_config(m, k, n, r, sparsity, dtype, args, gen)
                        results.append(res)
                        console.print(
                            f"{dtype_name} {m}x{k} N={n} b{r} s={sparsity}: static {res['static_gpu_ms']:.3f} ms "
                            f"({res['static_speedup_gpu']:.2f}x dense, eager {res['static_speedup_eager']:.2f}x), "
                            f"dyn/static {res['dynamic_over_static']:.2f}, torch bsr "
                            f"{res.get('torch_bsr_speedup_gpu', float('nan')):.2f}x, err {res['static_err']:.1e}"
                        )
                        args.out.parent.mkdir(parents=True, exist_ok=True)
                        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    console.print(table(results))


if __name__ == "__main__":
    main()
