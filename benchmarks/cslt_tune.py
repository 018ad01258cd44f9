"""cuSPARSELt configuration ids searched at export against the search at run time (issue 5, 2:4 layers).

Since the twenty-third session prunekit's cuSPARSELt binding times cuSPARSELt's configuration ids on the first call of
each 2:4 product at N >= 128 (shape, dtype, X layout, bias, power-of-two N bucket). ``prunekit export`` now runs that
search in a child process and stores the ids in the package (``kernels/cslt_tune.py``). This script measures what that
changes for the process that serves the package:

1. A 2:4-pruned fp16 state dict with one layer per ``--shapes`` entry (``MxK``, bias on) is exported with the search
   for ``--tokens`` (the export's wall time and the search's ``elapsed_s`` from the manifest are recorded).
2. For each mode a fresh Python process loads the package on the GPU and calls every layer at every N of
   ``--tokens`` with row-major activations ``(N, K)``: the first call's wall time (synchronised, in seconds), the
   configuration id and its source (``prunekit_cslt::last_config``: 3 stored, 1 searched, 0 default selection), then
   the call's CUDA-graph time (median over ``--rounds`` rounds of ``--reps`` replays, in ms). Modes:
   - ``stored``: the package as exported (the runtime takes the stored ids);
   - ``search``: the same package with its record dropped before the first call (the binding searches then);
   - ``default``: ``$PRUNEKIT_CSLT_TUNE=0`` (cuSPARSELt's default selection).

Writes ``--out`` JSON (device, torch, date; one row per mode, layer and N) and prints a table. GPU machine, repository
root: ``PYTHONPATH=src python3 benchmarks/cslt_tune.py --out $OUT/cslt-tune-h100-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nm_configs import save_rows  # noqa: E402

from prunekit.deploy.export import export_package  # noqa: E402
from prunekit.prune import prune_checkpoint  # noqa: E402

SHAPES = "768x768,3072x768,768x3072,4096x4096,11008x4096,4096x11008"
MODES = ("stored", "search", "default")
console = Console()

CHILD = textwrap.dedent(
    """
    import json, statistics, sys, time, torch
    from prunekit.deploy.runtime import load
    from prunekit.kernels import cslt_tune, structured
    package, mode, tokens, rounds, reps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    pkg = load(package, device="cuda")
    if mode == "search":
        cslt_tune._staged.clear()  # the record is staged until the binding loads: dropped, the binding searches
    rows = []
    with torch.inference_mode():
        for name, layer in pkg.model.layers.items():
            for n in tokens:
                x = torch.randn(n, layer.in_features, device="cuda", dtype=torch.float16)
                torch.cuda.synchronize()
                start = time.perf_counter()
                layer(x)
                torch.cuda.synchronize()
                first_s = time.perf_counter() - start
                weight = getattr(layer.w_values, structured._NATIVE_ATTR)
                config_id, source = (int(v) for v in torch.ops.prunekit_cslt.last_config(weight.id))
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    layer(x)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=stream):
                        layer(x)
                torch.cuda.synchronize()
                times = []
                for _ in range(rounds):
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    for _ in range(reps):
                        graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(begin.elapsed_time(end) / reps)
                rows.append({"layer": name, "m": layer.out_features, "k": layer.in_features, "n": n,
                             "first_call_s": first_s, "config_id": config_id, "source": source,
                             "graph_ms": statistics.median(times)})
    print(json.dumps(rows))
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=SHAPES, help="layers as MxK, comma-separated")
    parser.add_argument("--tokens", default="128,2048", help="N values, each >= 128")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        g = torch.Generator().manual_seed(0)
        state = {}
        for i, (m, k) in enumerate(shapes):
            state[f"fc{i}.weight"] = torch.randn(m, k, generator=g).half()
            state[f"fc{i}.bias"] = torch.randn(m, generator=g).half()
        save_file(state, str(tmp / "dense.safetensors"))
        prune_checkpoint(tmp / "dense.safetensors", tmp / "p.safetensors", "2:4")
        start = time.perf_counter()
        result = export_package(tmp / "p.safetensors", tmp / "pkg", tune=True, tune_tokens=tokens)
        export_s = time.perf_counter() - start
        record = result.manifest.tuning["cslt"]
        console.print(f"{result.tuning_note} Export: {export_s:.1f} s.")
        for mode in MODES:
            env = dict(os.environ)
            if mode == "default":
                env["PRUNEKIT_CSLT_TUNE"] = "0"
            else:
                env.pop("PRUNEKIT_CSLT_TUNE", None)
            argv = [str(tmp / "pkg"), mode, json.dumps(tokens), str(args.rounds), str(args.reps)]
            out = subprocess.run(
                [sys.executable, "-c", CHILD, *argv], env=env, capture_output=True, text=True, check=True
            )
            for row in json.loads(out.stdout.strip().splitlines()[-1]):
                rows.append({"mode": mode, **row})
    meta = save_rows(args.out, rows)
    data = json.loads(args.out.read_text())
    data["export"] = {"export_s": export_s, "search_elapsed_s": record["elapsed_s"], "configs": record["configs"]}
    args.out.write_text(json.dumps(data, indent=1))
    table = Table(title=f"first call and graph time per mode, {meta['device']}, torch {meta['torch']}")
    for col in ("layer", "M x K", "N", *(f"{m} first s" for m in MODES), *(f"{m} ms (id)" for m in MODES)):
        table.add_column(col)
    keyed = {(r["mode"], r["layer"], r["n"]): r for r in rows}
    for r in rows:
        if r["mode"] != "stored":
            continue
        per = [keyed[(m, r["layer"], r["n"])] for m in MODES]
        table.add_row(
            r["layer"],
            f"{r['m']}x{r['k']}",
            str(r["n"]),
            *(f"{p['first_call_s']:.3f}" for p in per),
            *(f"{p['graph_ms']:.4f} ({p['config_id']}/{p['source']})" for p in per),
        )
    console.print(table)
    console.print(f"export {export_s:.1f} s, of which the search {record['elapsed_s']:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()
