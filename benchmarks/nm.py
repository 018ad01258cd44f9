"""2:4 matmul benchmark (issue 5): prunekit's ``nm_mm`` (cuSPARSELt, weight compressed once and cached, algorithm
chosen once per shape) vs dense cuBLAS and torch's ``to_sparse_semi_structured``, in one run.

For every dtype, weight shape W (M x K) and N: W keeps the 2 largest-magnitude of every 4 entries of an N(0, 1)
matrix; activations are nn.Linear-shaped ``x2d: (N, K)``. Contenders, as a user calls them:

- prunekit: ``structured.nm_mm_cuda(values, metadata, x2d.t(), 2, 4, bits, output=...)`` on the stored ``nm``
  format through prunekit's own cuSPARSELt binding (weight compressed and plan built once; C++ entry
  ``prunekit_cslt::linear``, ``backend="cslt"``), in both output layouts in the same run: ``prunekit_row_*`` (cuSPARSELt writes a
  row-major (M, N), then the layout rule's transposing copy), ``prunekit_col_*`` (column-major Y written
  directly) and ``prunekit_view_*`` (the row-major Y returned as it is: the runtime layer's default, whose output is
  then a non-contiguous view as torch's 2:4 F.linear returns); ``prunekit_*`` (no suffix) is the default layout (``structured.cslt_output()``, in the JSON's meta);
  ``prunekit_decode_*`` (N <= 16) prunekit's own 2:4 decode kernel (``kernels/nm24.py``, ``backend="decode"``), which
  ``backend="auto"`` takes at N <= 16 (``default_path`` in each row; ``prunekit_*`` without suffix follows it);
  ``prunekit_torchpath_*`` the same with ``backend="torch"`` (``torch._cslt_sparse_mm``, plan set up per call; its
  eager time, ~0.25 s a call on the H100, only with ``--torch-path-eager``); ``prunekit_op_eager_ms`` the custom op
  ``ops.nm_mm`` (``prunekit::nm_mm``, the path under torch.compile; eagerly, since the thirty-eighth session, its direct
  call of the CUDA implementation, ``ops.eager_direct``); ``layer_*`` ``SparseLinear.forward`` eager as in
  ``benchmarks/bsr.py`` (wall-clock minus the device time of its own path, ``layer_path``; host time per call), and
  ``speedup_layer_eager`` its eager wall-clock against ``dense_layer_wall_ms``, dense ``nn.Linear`` modules (no grad)
  holding the same weights, the two timed in ``--layer-rounds`` alternating rounds (``bsr.wall_pair``; the median of
  the per-round ratios);
- dense: ``F.linear(x2d, W)`` (cuBLAS);
- torch 2:4: ``F.linear(x2d, to_sparse_semi_structured(W))`` (cuSPARSELt through torch's tensor subclass).

Timing as in ``benchmarks/bsr.py`` (CUDA-graph replays = device time; eager loops = what a user sees; rotating input
sets). Writes ``--out`` JSON and prints a rich table.
Run on the GPU machine: ``PYTHONPATH=src python benchmarks/nm.py --out benchmarks/results/nm-h100-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bsr import L2_BYTES, eager_time, graph_time, host_time_us, relative_error, wall_pair  # noqa: E402

from prunekit import formats  # noqa: E402
from prunekit.deploy.runtime.sparse_linear import SparseLinear  # noqa: E402
from prunekit.kernels import nm24, ops, structured  # noqa: E402

POINTS = [
    (16384, 16384, 8192),
    (8192, 8192, 8192),
    (4096, 4096, 4096),
    (11008, 4096, 2048),
    (4096, 11008, 2048),
    (4096, 4096, 16),
    (11008, 4096, 16),
    (4096, 11008, 16),
    (4096, 4096, 1),
    (4096, 4096, 128),
    (3072, 768, 128),
    (768, 3072, 128),
    # decode points of the SpMM benchmark's other shapes (appended: earlier --points indices keep their meaning)
    (11008, 4096, 1),
    (4096, 11008, 1),
    (768, 3072, 16),
    (768, 3072, 1),
    (3072, 768, 16),
    (3072, 768, 1),
]
console = Console()


def nm24_weight(m: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(m, k // 4, 4, device="cuda", generator=gen)
    keep = torch.zeros_like(w, dtype=torch.bool).scatter_(2, w.abs().topk(2, dim=2).indices, True)
    return (w * keep).reshape(m, k).to(dtype)


def run_point(m, k, n, dtype, args, gen) -> dict:
    from torch.sparse import to_sparse_semi_structured

    elem = torch.finfo(dtype).bits // 8
    set_bytes = (m * k // 2 + k * n + m * n) * elem
    n_sets = max(2, min(args.max_sets, math.ceil(2 * L2_BYTES / set_bytes)))
    free = torch.cuda.mem_get_info()[0]
    n_sets = max(1, min(n_sets, int(0.3 * free / (set_bytes + 2 * m * k * elem))))
    sets, encs = [], []
    for _ in range(n_sets):
        w = nm24_weight(m, k, dtype, gen)
        enc = formats.encode("nm", w, {"n": 2, "m": 4})  # encoded on the GPU (torch ops on w's device)
        c = enc.components
        x2d = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
        sets.append((w, c, int(enc.params["bits"]), x2d))
        encs.append(enc)
    res = {"m": m, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch."), "n_sets": n_sets}

    def ours(s, output=None):
        w, c, bits, x2d = s
        return lambda: structured.nm_mm_cuda(
            c["values"], c["metadata"], x2d.t(), 2, 4, bits, backend="cslt", output=output
        )

    def ours_decode(s):
        w, c, bits, x2d = s
        return lambda: structured.nm_mm_cuda(c["values"], c["metadata"], x2d.t(), 2, 4, bits, backend="decode")

    def ours_torch(s):
        w, c, bits, x2d = s
        return lambda: structured.nm_mm_cuda(c["values"], c["metadata"], x2d.t(), 2, 4, bits, backend="torch")

    def ours_op(s):
        w, c, bits, x2d = s
        return lambda: ops.nm_mm(c["values"], c["metadata"], x2d.t(), 2, 4, bits)

    def dense(s):
        w, c, bits, x2d = s
        return lambda: F.linear(x2d, w)

    w0, _, _, x0 = sets[0]
    ref = F.linear(x0.float(), w0.float()).t()
    res["output_default"] = structured.cslt_output()
    decode = n <= nm24.MAX_N and nm24.available()
    res["default_path"] = "decode" if decode else res["output_default"]  # what backend="auto" runs at this point
    for output in ("row", "col", "view"):
        res[f"prunekit_{output}_err"] = relative_error(ours(sets[0], output)(), ref)
    if decode:
        res["prunekit_decode_err"] = relative_error(ours_decode(sets[0])(), ref)
        plan = nm24.get_plan(sets[0][1]["values"], sets[0][1]["metadata"], sets[0][2], k)
        res["decode_plan_bytes"] = plan.vals.nbytes + plan.meta.nbytes
        res["decode_chunk"] = plan.chunk
    compress_before = structured.compress_calls
    res["prunekit_torchpath_err"] = relative_error(ours_torch(sets[0])(), ref)
    contenders = [
        ("prunekit_row", lambda s: ours(s, "row"), True),
        ("prunekit_col", lambda s: ours(s, "col"), True),
        ("prunekit_view", lambda s: ours(s, "view"), True),
        ("prunekit_torchpath", ours_torch, args.torch_path_eager),
        ("dense", dense, True),
    ] + ([("prunekit_decode", ours_decode, True)] if decode else [])
    for name, make, eager in contenders:
        calls = [make(s) for s in sets]
        res[f"{name}_gpu_ms"] = graph_time(calls)
        if eager:
            res[f"{name}_eager_ms"] = eager_time(calls)
    for key in ("gpu_ms", "eager_ms", "err"):
        res[f"prunekit_{key}"] = res[f"prunekit_{res['default_path']}_{key}"]
    res["prunekit_op_eager_ms"] = eager_time([ours_op(s) for s in sets])
    layers = [(SparseLinear(e), s[3]) for e, s in zip(encs, sets, strict=True)]
    layer_calls = [lambda layer=layer, x=x: layer(x) for layer, x in layers]
    res["layer_err"] = relative_error(layer_calls[0]().t(), ref)
    res["layer_host_us"] = host_time_us(layer_calls)
    # the same eager loop through dense nn.Linear modules holding the same weights: what the user's layer replaces,
    # timed in alternating rounds with the layer (the GPU's speed drifts during a run: dense cuBLAS went from 0.194 to
    # 0.216 ms over seven rounds at 4096^3, benchmarks/results/nm-kernels-h100-2026-11-26-s23b.json)
    dense_layers = []
    for w, _, _, x2d in sets:
        lin = torch.nn.Linear(k, m, bias=False, device="cuda", dtype=dtype)
        lin.weight.data = w
        dense_layers.append((lin.requires_grad_(False), x2d))  # inference, as SparseLinear's buffers
    pair = wall_pair(layer_calls, [lambda lin=lin, x=x: lin(x) for lin, x in dense_layers], args.layer_rounds)
    res["layer_wall_ms"], res["dense_layer_wall_ms"] = pair["a_ms"], pair["b_ms"]
    res["speedup_layer_eager"] = pair["b_over_a"]  # median of the per-round ratios
    res["layer_wall_rounds"], res["dense_layer_wall_rounds"] = pair["a_rounds"], pair["b_rounds"]
    # the layer's own kernel: the decode kernel at N <= 16, else the binding in the layer's output layout ("view" unless
    # $PRUNEKIT_CSLT_OUTPUT says otherwise), not the op's default path (row-major output + copy)
    res["layer_path"] = "decode" if decode else structured.cslt_output(default=structured.CSLT_LAYER_DEFAULT_OUTPUT)
    res["layer_eager_overhead_us"] = 1e3 * (res["layer_wall_ms"] - res[f"prunekit_{res['layer_path']}_gpu_ms"])
    res["compressions_while_timing"] = structured.compress_calls - compress_before
    res["native_binding"] = structured.native_cslt_available()
    if args.torch_path_eager:
        # Host cost of one cuSPARSELt call through torch (plan set-up per call) next to the device time, same weight.
        packed = structured.compressed_24(sets[0][1]["values"], sets[0][1]["metadata"], sets[0][2], k)
        res["cslt_direct_eager_ms"] = eager_time(
            [lambda x=x: torch._cslt_sparse_mm(packed, x.t(), transpose_result=True) for _, _, _, x in sets]
        )
    try:
        semis = [(to_sparse_semi_structured(w), x2d) for w, _, _, x2d in sets]
        res["torch24_err"] = relative_error(F.linear(semis[0][1], semis[0][0]).t(), ref)
        calls = [lambda ws=ws, x=x: F.linear(x, ws) for ws, x in semis]
        res["torch24_eager_ms"] = eager_time(calls)
        res["torch24_gpu_ms"] = graph_time(calls)
    except Exception as exc:  # record why the baseline could not run at this point
        res["torch24_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if decode:  # bytes the kernel must move at least: its weight copy, X and Y once
        moved = res["decode_plan_bytes"] + (k * n + m * n) * torch.finfo(dtype).bits // 8
        res["decode_gbs"] = moved / (res["prunekit_decode_gpu_ms"] * 1e-3) / 1e9
    for output in ("row", "col", "view") + (("decode",) if decode else ()):
        res[f"speedup_{output}_gpu"] = res["dense_gpu_ms"] / res[f"prunekit_{output}_gpu_ms"]
        res[f"speedup_{output}_eager"] = res["dense_eager_ms"] / res[f"prunekit_{output}_eager_ms"]
    res["speedup_gpu"] = res["dense_gpu_ms"] / res["prunekit_gpu_ms"]
    res["speedup_eager"] = res["dense_eager_ms"] / res["prunekit_eager_ms"]
    res["eager_overhead_us"] = 1e3 * (res["prunekit_eager_ms"] - res["prunekit_gpu_ms"])
    if "torch24_gpu_ms" in res:
        res["torch24_speedup_gpu"] = res["dense_gpu_ms"] / res["torch24_gpu_ms"]
        res["torch24_speedup_eager"] = res["dense_eager_ms"] / res["torch24_eager_ms"]
    del sets, encs, layers, layer_calls
    torch.cuda.empty_cache()
    return res


def table(results: list[dict]) -> Table:
    t = Table(title="prunekit nm_mm (2:4) vs cuBLAS dense and torch semi-structured (speedups vs dense, same run)")
    for col in ("dtype", "M x K", "N", "row ms", "row x (graph)", "row x (eager)", "col ms", "col x (graph)",
                "decode ms", "decode x (graph / eager)", "layer ovh us", "host us", "torch x (graph)",
                "torch x (eager)", "err row/col"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(
            r["dtype"], f"{r['m']}x{r['k']}", str(r["n"]), f"{r['prunekit_row_gpu_ms']:.3f}",
            f"{r['speedup_row_gpu']:.2f}", f"{r['speedup_row_eager']:.2f}", f"{r['prunekit_col_gpu_ms']:.3f}",
            f"{r['speedup_col_gpu']:.2f}", *_decode_cells(r), f"{r['layer_eager_overhead_us']:.1f}",
            f"{r['layer_host_us']:.1f}",
            f"{r.get('torch24_speedup_gpu', float('nan')):.2f}", f"{r.get('torch24_speedup_eager', float('nan')):.2f}",
            f"{r['prunekit_row_err']:.1e}/{r['prunekit_col_err']:.1e}",
        )  # fmt: skip
    return t


def _decode_cells(r: dict) -> tuple[str, str]:
    if "prunekit_decode_gpu_ms" not in r:
        return "-", "-"
    return (
        f"{r['prunekit_decode_gpu_ms'] * 1e3:.1f} us",
        f"{r['speedup_decode_gpu']:.2f} / {r['speedup_decode_eager']:.2f}",
    )


def _gbs(r: dict) -> str:
    return f" / {r['decode_gbs']:.0f}" if "decode_gbs" in r else ""


def _layer_x(r: dict) -> str:
    return f" / {r['speedup_layer_eager']:.2f}" if "speedup_layer_eager" in r else ""


def _t24(r: dict) -> str:
    return f"{r['torch24_speedup_gpu']:.2f} / {r['torch24_speedup_eager']:.2f}" if "torch24_gpu_ms" in r else "-"


def markdown(path: Path) -> str:
    """Markdown table of a results JSON written by this script (for docs/PERFORMANCE_STRUCTURED.md); JSONs of the
    first run (one output layout, before ``prunekit_row_*`` / ``prunekit_col_*``) render in their own columns."""
    data = json.loads(path.read_text())
    meta = data["meta"]
    lines = [f"{meta['device']}, torch {meta['torch']} (CUDA {meta['cuda']}), {meta['date']}, `{meta['command']}`", ""]
    if data["results"] and "prunekit_row_gpu_ms" not in data["results"][0]:
        lines += [
            "| dtype | M x K | N | ours ms (graph) | x dense (graph) | x dense (eager) | ours eager ms | "
            "ours via torch._cslt_sparse_mm: ms graph / eager | torch 2:4 x dense (graph / eager) | "
            "compressions while timing | rel. err |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in data["results"]:
            lines.append(
                f"| {r['dtype']} | {r['m']}x{r['k']} | {r['n']} | {r['prunekit_gpu_ms']:.3f} | {r['speedup_gpu']:.2f} | "
                f"{r['speedup_eager']:.2f} | {r['prunekit_eager_ms']:.3f} | "
                f"{r['prunekit_torchpath_gpu_ms']:.3f} / {r['prunekit_torchpath_eager_ms']:.3f} | "
                f"{_t24(r)} | {r.get('compressions_while_timing', '-')} | {r['prunekit_err']:.1e} |"
            )
        return "\n".join(lines)
    lines += [
        "| dtype | M x K | N | dense ms (graph) | row-major out: ms (graph) / x dense (graph / eager) | "
        "col-major out: ms (graph) / x dense (graph / eager) | decode kernel: us (graph) / x dense (graph / eager) "
        "/ GB/s | layer: wall - kernel us / host us per call / x nn.Linear (eager) | torch 2:4 x dense (graph / eager) | "
        "compressions while timing | rel. err row / col |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        lines.append(
            f"| {r['dtype']} | {r['m']}x{r['k']} | {r['n']} | {r['dense_gpu_ms']:.3f} | "
            f"{r['prunekit_row_gpu_ms']:.3f} / {r['speedup_row_gpu']:.2f} / {r['speedup_row_eager']:.2f} | "
            f"{r['prunekit_col_gpu_ms']:.3f} / {r['speedup_col_gpu']:.2f} / {r['speedup_col_eager']:.2f} | "
            f"{' / '.join(_decode_cells(r))}{_gbs(r)} | "
            f"{r['layer_eager_overhead_us']:.1f} / {r['layer_host_us']:.1f}{_layer_x(r)} | {_t24(r)} | "
            f"{r.get('compressions_while_timing', '-')} | {r['prunekit_row_err']:.1e} / {r['prunekit_col_err']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", type=Path, help="print the markdown table of a results JSON and exit")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dtypes", default="float16")
    parser.add_argument("--max-sets", type=int, default=8)
    parser.add_argument(
        "--torch-path-eager", action="store_true", help="also time torch._cslt_sparse_mm eagerly (~0.25 s a call)"
    )
    parser.add_argument("--points", help="comma-separated indices into POINTS (default: all)")
    parser.add_argument(
        "--layer-rounds", type=int, default=9, help="alternating rounds of SparseLinear and nn.Linear (eager wall)"
    )
    parser.add_argument("--time-limit-s", type=float, default=1e9, help="stop starting new points after this")
    args = parser.parse_args()
    if args.render:
        print(markdown(args.render))
        return
    if args.out is None:
        parser.error("--out is required")
    gen = torch.Generator(device="cuda").manual_seed(0)
    meta = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cusparselt": structured.cusparselt_available(),
        "command": "PYTHONPATH=src python benchmarks/nm.py " + " ".join(sys.argv[1:]),
        "argv": sys.argv[1:],
        "output_default": structured.cslt_output(),
        "cslt_plan_search": os.environ.get("PRUNEKIT_CSLT_SEARCH", "0") == "1",  # cusparseLtMatmulSearch per plan
        "cslt_tune": os.environ.get("PRUNEKIT_CSLT_TUNE", ""),  # own configuration search per plan ("1" on)
        "autograd_mode": "grad",  # torch's 2:4 subclass and Triton BSR are not run under inference mode here
    }
    results = []
    points = [POINTS[int(i)] for i in args.points.split(",")] if args.points else POINTS
    t0 = time.time()
    for dtype_name in args.dtypes.split(","):
        for m, k, n in points:
            if time.time() - t0 > args.time_limit_s:
                break
            res = run_point(m, k, n, getattr(torch, dtype_name), args, gen)
            results.append(res)
            console.print(
                f"{dtype_name} {m}x{k} N={n}: row {res['prunekit_row_gpu_ms']:.3f} ms "
                f"({res['speedup_row_gpu']:.2f}x dense), col {res['prunekit_col_gpu_ms']:.3f} ms "
                f"({res['speedup_col_gpu']:.2f}x), decode {' / '.join(_decode_cells(res))}, layer overhead {res['layer_eager_overhead_us']:.1f} us, torch 2:4 "
                f"{res.get('torch24_speedup_gpu', float('nan')):.2f}x/{res.get('torch24_speedup_eager', float('nan')):.2f}x"
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    console.print(table(results))


if __name__ == "__main__":
    main()
