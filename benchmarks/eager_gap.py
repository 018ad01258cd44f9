"""Where the eager-versus-graph gap of long layer calls comes from (issue 5's eager-overhead target).

The thirty-eighth session timed each BSR layer's eager loop against a CUDA graph of the same calls in alternating
rounds (``bsr.overhead_pair``). At kernels of 50 us and more the eager loop took 0.5-5.8% longer (median 1.8%), which
at 647-1541 us kernels is 10-21 us per call, over the target's 10 us. This script splits that gap at a few long points
and puts the same measurement of torch's own layer beside it:

- ``graph_ms``: a CUDA graph of the calls (``bsr.capture_graph``), device time per call (CUDA events);
- ``eager_device_ms``: an eager loop of the same calls, device time per call between two CUDA events recorded after a
  ``torch.cuda._sleep`` that keeps the GPU busy while the host queues the calls, so the events see the GPU work and
  the gaps between the calls' kernels, not the host's time to issue the first call;
- ``eager_wall_ms``: the same loop timed by the host clock with one synchronize at the end (``bsr._eager_loop``, the
  wall time of ``bsr.overhead_pair``), with loops of ``--short-s`` and of ``--long-s`` seconds: a fixed cost per loop
  (the first call's launch, the final synchronize) falls by the loop's length, a cost per call does not.

Bursts (``--bursts``): ``b`` calls issued after a synchronize and timed to the synchronize after them, by the host
clock (``burst<b>_wall_ms``, minus ``b`` graph calls: ``burst<b>_wall_minus_graph_us``) and between CUDA events
recorded around them (``burst<b>_device_ms``, which then includes the host's time to issue the first call): what one
call, or a few, cost an application that waits for each result.

With ``--graph-sleep`` the graph's timing also starts after the sleep, so that both device timings start from the
same idle GPU; ``--only dense`` (with a ``csr`` point at sparsity 0: a dense weight) times ``nn.Linear`` alone and
needs no prunekit kernel.

The contenders at each point: prunekit's ``SparseLinear`` (eager: its C++ entry) and ``nn.Linear`` (cuBLAS) on the
same weight, each rotating over its own input sets (weights and activations, more bytes than twice the L2). Every
quantity is taken in each of ``--rounds`` rounds, the order of the four rotated each round; the JSON keeps the medians
and the per-round lists, and the per-round differences (``*_minus_graph_us``, microseconds per call).

Run on the GPU machine: ``PYTHONPATH=src python benchmarks/eager_gap.py --out benchmarks/results/eager-gap-h100-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bsr import L2_BYTES, _eager_loop, _eager_reps, _ms_between, alternating_rounds, capture_graph  # noqa: E402
from layer_host import weight  # noqa: E402
from nm24_sweep import run_meta  # noqa: E402

from prunekit import formats  # noqa: E402
from prunekit.deploy.runtime.sparse_linear import SparseLinear  # noqa: E402
from prunekit.kernels.testing import env_setting  # noqa: E402

# (format, block, M, K, N, sparsity): the thirty-eighth session's largest paired gaps (16- and 32-row blocks with the
# X-slab copy), a 64-row point where the gap was about 0, and a 2:4 layer
DEFAULT_POINTS = (
    "bsr:16:4096x11008:4096:0.5,bsr:32:11008x4096:4096:0.5,bsr:64:4096x11008:4096:0.5,nm:0:4096x11008:4096:0.5"
)
SLEEP_CYCLES = 20_000_000  # about 10 ms at 1.98 GHz: longer than the host needs to queue a loop's first calls


def parse_points(text: str) -> list[tuple[str, int, int, int, int, float, dict]]:
    """``fmt:block:MxK:N:sparsity[:VAR=VALUE]`` items, comma-separated, as tuples ``(fmt, block, m, k, n, sparsity,
    env)``: ``env`` holds the optional environment setting, made around that point's measurement.

    Raises:
        ValueError: an item that does not have that form."""
    points = []
    for item in text.split(","):
        try:
            fmt, block, shape, n, sparsity, *rest = item.split(":")
            m, k = (int(v) for v in shape.lower().split("x"))
            env = dict(v.split("=", 1) for v in rest)
            points.append((fmt, int(block), m, k, int(n), float(sparsity), env))
        except ValueError as exc:
            raise ValueError(f"bad point {item!r}: expected fmt:block:MxK:N:sparsity[:VAR=VALUE]") from exc
    return points


def _idle_gpu() -> None:
    """Let the GPU drain, then keep it idle for about 10 ms (``torch.cuda._sleep``): work queued after this starts from
    an idle GPU, and the host can queue it before the GPU gets to it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)


def device_loop_ms(calls: list, reps: int) -> float:
    """Device ms per call of ``reps`` eager calls rotating over ``calls``, between two CUDA events recorded after
    :func:`_idle_gpu` (so the host has queued the first calls before the first event is reached)."""
    _idle_gpu()

    def loop() -> None:
        for i in range(reps):
            calls[i % len(calls)]()

    return _ms_between(loop) / reps


def graph_ms(graph: torch.cuda.CUDAGraph, reps: int, sleep: bool = False) -> float:
    """Device ms per call of one replay of ``graph`` (``reps`` calls), between CUDA events; with ``sleep``, after
    :func:`_idle_gpu` as :func:`device_loop_ms`, so that both start from the same idle GPU (a dense GEMM's clock
    depends on what ran before it)."""
    if sleep:
        _idle_gpu()
    return _ms_between(graph.replay) / reps


def burst_ms(calls: list, size: int, trials: int) -> tuple[float, float]:
    """Medians over ``trials`` of ``size`` calls issued after a synchronize: host-clock ms to the synchronize after
    them, and device ms between CUDA events recorded before the first call and after the last."""
    walls, devices = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(trials):
        torch.cuda.synchronize()
        t = time.perf_counter()
        start.record()
        for i in range(size):
            calls[i % len(calls)]()
        end.record()
        torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - t))
        devices.append(start.elapsed_time(end))
    return statistics.median(walls), statistics.median(devices)


def measure(
    calls: list, rounds: int, short_s: float, long_s: float, bursts=(), burst_trials: int = 9, graph_sleep: bool = False
) -> dict:
    """The four timings of ``calls`` (module docstring), each once per round, in an order rotated every round."""
    graph, reps = capture_graph(calls)
    reps_short, reps_long = _eager_reps(calls, short_s), _eager_reps(calls, long_s)
    kinds = {
        "graph_ms": lambda: graph_ms(graph, reps, graph_sleep),
        "eager_device_ms": lambda: device_loop_ms(calls, reps_short),
        "eager_wall_ms": lambda: _eager_loop(calls, reps_short),
        "eager_wall_long_ms": lambda: _eager_loop(calls, reps_long),
    }
    names = list(kinds)
    per_round = alternating_rounds(kinds, rounds)
    out = {"graph_reps": reps, "eager_reps": reps_short, "eager_long_reps": reps_long}
    for name in names:
        out[name] = statistics.median(per_round[name])
        out[f"{name}_rounds"] = per_round[name]
    for name in names[1:]:  # per-round differences, us per call
        diffs = [1e3 * (e - g) for e, g in zip(per_round[name], per_round["graph_ms"], strict=True)]
        out[f"{name.removesuffix('_ms')}_minus_graph_us"] = statistics.median(diffs)
    out["eager_device_over_graph"] = out["eager_device_ms"] / out["graph_ms"]
    for size in bursts:
        wall, device = burst_ms(calls, size, burst_trials)
        out[f"burst{size}_wall_ms"], out[f"burst{size}_device_ms"] = wall, device
        out[f"burst{size}_wall_minus_graph_us"] = 1e3 * (wall - size * out["graph_ms"])
    return out


def run_point(fmt: str, block: int, m: int, k: int, n: int, sparsity: float, env: dict, args, gen) -> dict:
    density = 0.5 if fmt == "nm" else 1 - sparsity
    set_bytes = 2.0 * (m * k * density + k * n + m * n)
    n_sets = max(2, min(4, math.ceil(2 * L2_BYTES / set_bytes)))
    params = {"block_rows": block, "block_cols": block} if fmt == "bsr" else {"n": 2, "m": 4} if fmt == "nm" else {}
    layers, denses = [], []
    for _ in range(n_sets):
        w = weight(fmt, m, k, sparsity, block, gen)
        x2d = torch.randn(n, k, device="cuda", generator=gen).half()
        dense = torch.nn.Linear(k, m, bias=False, device="cuda", dtype=torch.float16)
        dense.weight.data.copy_(w)
        denses.append(lambda dense=dense, x=x2d: dense(x))
        if args.only != "dense":
            layer = SparseLinear(formats.encode(fmt, w.cpu(), params)).cuda()
            layers.append(lambda layer=layer, x=x2d: layer(x))
    res = {"format": fmt, "block": block, "m": m, "k": k, "n": n, "sparsity": sparsity, "n_sets": n_sets, "env": env}
    res["graph_sleep"] = args.graph_sleep
    bursts = [int(b) for b in args.bursts.split(",")] if args.bursts else []
    contenders = [("layer", layers), ("dense", denses)]
    contenders = [(name, calls) for name, calls in contenders if args.only in ("both", name)]
    with torch.inference_mode(), env_settings(env):
        for name, calls in contenders:
            timings = measure(calls, args.rounds, args.short_s, args.long_s, bursts, graph_sleep=args.graph_sleep)
            for key, value in timings.items():
                res[f"{name}_{key}"] = value
    return res


@contextlib.contextmanager
def env_settings(env: dict):
    """The environment variables of ``env`` set within the block (restored after)."""
    with contextlib.ExitStack() as stack:
        for name, value in env.items():
            stack.enter_context(env_setting(name, value))
        yield


def print_table(results: list[dict]) -> None:
    table = Table(
        title="eager loops against a CUDA graph of the same calls (us per call, medians of per-round differences)"
    )
    bursts = sorted({int(k.split("_burst")[1].split("_")[0]) for r in results for k in r if "_burst" in k})
    columns = ["point", "who", "graph us", "eager device - graph", "eager wall - graph", "long wall - graph"]
    for col in columns + [f"burst {b} wall - graph" for b in bursts]:
        table.add_column(col, justify="right")
    for r in results:
        point = f"{r['format']}{r['block'] or ''} {r['m']}x{r['k']}@{r['n']} {r['sparsity']:.0%}"
        point += "".join(f" {name}={value}" for name, value in r["env"].items())
        for who in (w for w in ("layer", "dense") if f"{w}_graph_ms" in r):
            table.add_row(
                point,
                who,
                f"{1e3 * r[f'{who}_graph_ms']:.1f}",
                f"{r[f'{who}_eager_device_minus_graph_us']:.2f}",
                f"{r[f'{who}_eager_wall_minus_graph_us']:.2f}",
                f"{r[f'{who}_eager_wall_long_minus_graph_us']:.2f}",
                *(f"{r.get(f'{who}_burst{b}_wall_minus_graph_us', float('nan')):.1f}" for b in bursts),
            )
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--points", default=DEFAULT_POINTS, help="fmt:block:MxK:N:sparsity, comma-separated")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--short-s", type=float, default=0.02, help="eager loop length, s (bsr.py's EAGER_TARGET_S)")
    parser.add_argument("--long-s", type=float, default=0.2, help="the long eager loop's length, s")
    parser.add_argument("--bursts", default="1,2,4", help="burst sizes, comma-separated ('' for none)")
    parser.add_argument("--only", choices=("both", "layer", "dense"), default="both", help="which contenders to time")
    parser.add_argument(
        "--graph-sleep",
        action="store_true",
        help="the graph timing too starts after a torch.cuda._sleep (same idle GPU)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("eager_gap.py: no CUDA device")
    try:
        points = parse_points(args.points)
    except ValueError as exc:
        sys.exit(f"eager_gap.py: {exc}")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    meta = run_meta() | {"command": "PYTHONPATH=src python benchmarks/eager_gap.py " + " ".join(sys.argv[1:])}
    results = []
    for point in points:
        t = time.perf_counter()
        try:
            results.append(run_point(*point, args, gen))
        except Exception as exc:  # record the point's failure; keep measuring the others
            results.append({"point": list(point), "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
        print(f"{point}: {time.perf_counter() - t:.0f} s", flush=True)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print_table([r for r in results if "error" not in r])


if __name__ == "__main__":
    main()
