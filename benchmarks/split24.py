"""Benchmark of the ``split24`` SpMM variant (kernels/split24.py: a 2:4 part through cuSPARSELt plus a hypersparse
residual) at large N, issue 4's N >= 2048 targets, against dense cuBLAS and the paths a user has today, in one run on
the same weights and inputs (CUDA-graph replays of many calls, median, after warm-up; inputs rotating over sets sized
past the L2, as ``bsr.py``):

- ``dense_ms``: ``F.linear(x2d, W)`` (cuBLAS);
- ``auto_ms``: ``ops.spmm_csr`` on prunekit's CSR, the variant ``"auto"`` picks (``dense`` at these N);
- ``torch_sparse_ms``: ``torch.sparse.mm(W_csr, x2d.t())`` (cuSPARSE; eager loops where a graph cannot hold it);
- ``torch_cslt_ms``: ``torch._cslt_sparse_mm`` on the 2:4 part alone (torch's stock 2:4 path, a lower bound for a
  torch-only split);
- ``w24_ms`` / ``w24_beta_ms``: prunekit's cuSPARSELt binding on the 2:4 part, beta = 0 / 1;
- ``res_write_ms`` / ``res_add_ms``: the residual kernel writing / adding its product;
- ``beta_ms`` / ``post_ms``: the whole variant in each mode (``split24.linear``), with the rel. error against float64.

Writes ``--out`` JSON (device, torch version, date, settings) and prints a table.

    PYTHONPATH=src python benchmarks/split24.py --out benchmarks/results/split24-<dev>-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bsr import L2_BYTES, _ms_between, graph_time  # noqa: E402

from prunekit.kernels import ops, split24  # noqa: E402
from prunekit.kernels.testing import (  # noqa: E402
    encode_csr,
    prunekit_settings,
    random_sparse_weight,
    relative_error,
)


def timed(calls: list, methods: dict, name: str, eager_trials: int = 7) -> float:
    """Graph time (ms per call); where the calls cannot be captured (cuSPARSE's buffers), the median of
    ``eager_trials`` eager loops. ``methods[name]`` records which."""
    try:
        methods[name] = "graph"
        return graph_time(calls)
    except RuntimeError:
        torch.cuda.synchronize()
        methods[name] = "eager"
        return statistics.median(_ms_between(lambda: [c() for c in calls]) / len(calls) for _ in range(eager_trials))


def result_meta() -> dict:
    """The result file's ``meta``: device, torch / CUDA / Python versions, date, arguments, ``PRUNEKIT_*`` settings."""
    return {
        "device": torch.cuda.get_device_properties(0).name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "env": prunekit_settings(),
        "method": "CUDA events; median over replays of a CUDA graph holding many calls (bsr.graph_time); eager loops "
        "where a graph cannot hold the call (methods)",
    }


def bench_point(m: int, k: int, n: int, sparsity: float, dtype: torch.dtype, torch_sparse: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    w = random_sparse_weight(m, k, sparsity, dtype, device="cuda", generator=g)
    w = w * (k * (1 - sparsity)) ** -0.5
    csr = encode_csr(w)
    weight = split24.split24_weight(csr["values"], csr["row_offsets"], csr["column_indices"], m, k)
    w24, _ = split24.split_24(w)
    sets = max(1, min(4, int(2 * L2_BYTES // (n * k * 2)) + 1))
    xs = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(sets)]
    ys = [torch.empty(m, n, device="cuda", dtype=dtype) for _ in range(sets)]
    rv = (weight.r_values, weight.r_column_indices, weight.r_slice_offsets)
    wid = weight.native.id
    methods: dict = {}
    row = {"m": m, "k": k, "n": n, "sparsity": sparsity, "dtype": str(dtype).replace("torch.", "")}
    row["residual_nnz"] = weight.residual_nnz
    row["residual_density"] = weight.residual_nnz / (m * k)
    row["extra_bytes"] = weight.extra_bytes()
    row["dense_ms"] = timed([lambda x=x: F.linear(x, w) for x in xs], methods, "dense")
    args = (csr["values"], csr["row_offsets"], csr["column_indices"], csr["row_indices"])
    row["auto_ms"] = timed([lambda x=x: ops.spmm_csr(*args, x.t(), m) for x in xs], methods, "auto")
    if torch_sparse:
        w_csr = w.to_sparse_csr()
        row["torch_sparse_ms"] = timed([lambda x=x: torch.sparse.mm(w_csr, x.t()) for x in xs], methods, "torch_sparse")
    packed = torch._cslt_compress(w24)
    row["torch_cslt_ms"] = timed(
        [lambda x=x: torch._cslt_sparse_mm(packed, x.t(), transpose_result=True) for x in xs], methods, "torch_cslt"
    )
    mm, mm_beta = torch.ops.prunekit_cslt.mm.default, torch.ops.prunekit_cslt.mm_beta.default
    pairs = list(zip(xs, ys, strict=True))
    row["w24_ms"] = timed([lambda x=x, y=y: mm(wid, x.t(), y, None, False) for x, y in pairs], methods, "w24")
    row["w24_beta_ms"] = timed(
        [lambda x=x, y=y: mm_beta(wid, x.t(), y, None, False, 1.0) for x, y in pairs], methods, "w24_beta"
    )
    row["res_write_ms"] = timed(
        [lambda x=x, y=y: split24.residual_rows_cuda(*rv, x, y, n, False, False) for x, y in pairs],
        methods,
        "res_write",
    )
    row["res_add_ms"] = timed(
        [lambda x=x, y=y: split24.residual_rows_cuda(*rv, x, y, n, True, False) for x, y in pairs], methods, "res_add"
    )
    ref = xs[0].double() @ w.double().t()
    for split_mode in split24.MODES:
        row[f"{split_mode}_ms"] = timed(
            [lambda x=x, s=split_mode: split24.linear(weight, x, None, "none", s) for x in xs], methods, split_mode
        )
        row[f"{split_mode}_rel_error"] = relative_error(split24.linear(weight, xs[0], None, "none", split_mode), ref)
        row[f"{split_mode}_speedup"] = row["dense_ms"] / row[f"{split_mode}_ms"]
    row["auto_rel_error"] = relative_error(ops.spmm_csr(*args, xs[0].t(), m).t(), ref)
    row["auto_speedup"] = row["dense_ms"] / row["auto_ms"]
    row["w24_speedup"] = row["dense_ms"] / row["w24_ms"]
    # bytes of Y (M x N) and X (N x K): what the residual pass moves at least (Y written, X read)
    row["res_write_gbps"] = (m * n + n * k) * xs[0].element_size() / (row["res_write_ms"] * 1e-3) / 1e9
    row["methods"] = methods
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="4096x4096,11008x4096,4096x11008,768x3072,3072x768")
    parser.add_argument("--ns", default="2048,4096")
    parser.add_argument("--sparsities", default="0.9,0.95,0.98")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--no-torch-sparse", action="store_true", help="leave torch.sparse.mm out (slow at large N)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: split24.py needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    rows = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        for sparsity in (float(v) for v in args.sparsities.split(",")):
            for n in (int(v) for v in args.ns.split(",")):
                row = bench_point(m, k, n, sparsity, dtype, not args.no_torch_sparse)
                rows.append(row)
                print(
                    f"{args.dtype} {m}x{k} N={n} s={sparsity}: dense {1e3 * row['dense_ms']:.1f} us, auto "
                    f"{1e3 * row['auto_ms']:.1f} ({row['auto_speedup']:.2f}x), beta {1e3 * row['beta_ms']:.1f} "
                    f"({row['beta_speedup']:.2f}x), post {1e3 * row['post_ms']:.1f} ({row['post_speedup']:.2f}x); "
                    f"2:4 {1e3 * row['w24_ms']:.1f} / beta {1e3 * row['w24_beta_ms']:.1f}, residual write "
                    f"{1e3 * row['res_write_ms']:.1f} add {1e3 * row['res_add_ms']:.1f} (nnz {row['residual_nnz']})",
                    flush=True,
                )
    table = Table(title=f"split24 vs dense cuBLAS ({args.dtype}, graph replays)")
    for col in ("W", "N", "sparsity", "dense us", "auto x", "beta x", "post x", "2:4 alone x", "torch.sparse x",
                "res. write us", "err beta"):  # fmt: skip
        table.add_column(col)
    for r in rows:
        ts = f"{r['dense_ms'] / r['torch_sparse_ms']:.3f}" if "torch_sparse_ms" in r else "-"
        table.add_row(
            f"{r['m']}x{r['k']}", str(r["n"]), f"{r['sparsity']:.2f}", f"{1e3 * r['dense_ms']:.1f}",
            f"{r['auto_speedup']:.2f}", f"{r['beta_speedup']:.2f}", f"{r['post_speedup']:.2f}",
            f"{r['w24_speedup']:.2f}", ts, f"{1e3 * r['res_write_ms']:.1f}", f"{r['beta_rel_error']:.1e}",
        )  # fmt: skip
    Console(width=200).print(table)
    meta = result_meta()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
