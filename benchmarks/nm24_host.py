"""Host time per eager call of the 2:4 decode path, layer by layer, next to dense ``F.linear`` in the same run.

At decode sizes one eager call can cost more host time than its kernel takes on the GPU, and then the host sets the
speed a user sees. This times (``benchmarks/bsr.py``'s ``host_time_us``: median microseconds to issue one call in a
burst shorter than the launch queue, so the host never waits on the GPU) each layer a ``SparseLinear`` call goes
through, from the raw C++ operator up:

- ``torch.empty``: allocating the output alone (the floor of any op that returns a new tensor);
- ``F.linear`` / ``nn.Linear`` dense: cuBLAS through ATen (function / module), the eager calls to beat;
- ``op mm``: ``torch.ops.prunekit_nm24.mm.default`` on a built plan's four tensors and settings (13 arguments, Y
  preallocated); ``op linear``: ``torch.ops.prunekit_nm24.linear.default`` on its one buffer and packed settings (5
  arguments; dispatcher + C++ checks + allocation + launch);
- ``nm24.linear``: the Python wrapper around it; ``nm24.decode_mm``: plus the plan lookup;
- ``nm_mm_cuda``: ``structured.nm_mm_cuda(backend="auto")``, the library's 2:4 entry;
- ``ops.nm_mm``: the ``prunekit::nm_mm`` custom op (the path under torch.compile);
- ``SparseLinear``: the runtime's layer, ``(N, K)`` activations in.

The device time of the same call (CUDA-graph replay of one input set, so the weight may sit in L2: a hint of which
calls are host-bound, not a kernel timing; those are in ``benchmarks/nm.py``) is printed beside. Prints a table and
writes ``--out`` JSON (device, torch version, date).

    PYTHONPATH=src python benchmarks/nm24_host.py --out benchmarks/results/nm24-host-<dev>-<date>.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bsr import graph_time, host_time_us  # noqa: E402
from nm import nm24_weight  # noqa: E402
from nm24_sweep import run_meta  # noqa: E402

from prunekit import formats  # noqa: E402
from prunekit.deploy.runtime.sparse_linear import SparseLinear  # noqa: E402
from prunekit.kernels import nm24, ops, structured  # noqa: E402


def run_point(m: int, k: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> list[dict]:
    w = nm24_weight(m, k, dtype, gen)
    enc = formats.encode("nm", w, {"n": 2, "m": 4})
    c, bits = enc.components, int(enc.params["bits"])
    x2d = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
    x = x2d.t()
    plan = nm24.get_plan(c["values"], c["metadata"], bits, k)
    mm, op = torch.ops.prunekit_nm24.mm.default, torch.ops.prunekit_nm24.linear.default
    y = torch.empty(m, n, device="cuda", dtype=dtype)
    mm_args = (plan.vals, plan.meta, plan.ws, plan.counters, x, y, None, False, m, plan.chunk, plan.variant)
    layer = SparseLinear(enc)
    dense_layer = torch.nn.Linear(k, m, bias=False, device="cuda", dtype=dtype)
    calls = {
        "torch.empty": lambda: torch.empty(m, n, device="cuda", dtype=dtype),
        "F.linear dense": lambda: F.linear(x2d, w),
        "nn.Linear dense": lambda: dense_layer(x2d),
        "op mm (13 args)": lambda: mm(*mm_args, plan.ring, plan.batch),
        "op linear (5 args)": lambda: op(plan.buffer, x, None, False, plan.cfg),
        "nm24.linear": lambda: nm24.linear(plan, x),
        "nm24.decode_mm": lambda: nm24.decode_mm(c["values"], c["metadata"], x, bits),
        "nm_mm_cuda": lambda: structured.nm_mm_cuda(c["values"], c["metadata"], x, 2, 4, bits),
        "ops.nm_mm": lambda: ops.nm_mm(c["values"], c["metadata"], x, 2, 4, bits),
        "SparseLinear": lambda: layer(x2d),
    }
    rows = []
    with torch.inference_mode():
        for name, call in calls.items():
            rows.append(
                {
                    "m": m, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch."), "layer": name,
                    "host_us": host_time_us([call], burst=200, trials=7),
                    "gpu_us": 1e3 * graph_time([call]) if name != "torch.empty" else 0.0,
                }
            )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="4096x4096,768x3072", help="MxK,...")
    parser.add_argument("--ns", default="1,16")
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    nm24.load()
    meta = run_meta()
    results = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        for n in (int(v) for v in args.ns.split(",")):
            results += run_point(m, k, n, getattr(torch, args.dtype), gen)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    table = Table(title=f"2:4 decode path: host us per eager call ({meta['device']}, {args.dtype})")
    for col in ("M x K", "N", "layer", "host us", "device us (graph)", "host-bound"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            f"{r['m']}x{r['k']}", str(r["n"]), r["layer"], f"{r['host_us']:.1f}",
            f"{r['gpu_us']:.1f}" if r["gpu_us"] else "-", "yes" if r["host_us"] > r["gpu_us"] else "no",
        )  # fmt: skip
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
