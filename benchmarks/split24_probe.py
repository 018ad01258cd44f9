"""Probe: unstructured sparse weights as a 2:4 part plus a residual, at large N (issue 4's N >= 2048 targets).

A random unstructured weight at sparsity s has, in each group of 4 along K, more than 2 non-zeros with probability
4 s (1 - s)^3 + (1 - s)^4 (0.37% of the groups at 90%, 0.05% at 95%). So ``W = W24 + R``: ``W24`` keeps the two
largest of every group (a 2:4 weight, Hopper's sparse tensor cores through cuSPARSELt) and the residual ``R`` the
rest (density 0.1% at 90%). This times, in one run on the same weights and inputs (CUDA-graph replays of many calls,
median, inputs rotating over sets sized past the L2, as ``bsr.py``):

- ``dense_ms``: ``F.linear(x2d, W)`` (cuBLAS);
- ``w24_ms``: ``torch._cslt_sparse_mm(torch._cslt_compress(W24), x2d.t(), transpose_result=True)`` (cuSPARSELt
  through torch, its default configuration; the output (N, M) as ``nn.Linear``'s);
- ``residual_ms``: ``torch.sparse.mm(R_csr, x2d.t())`` (cuSPARSE SpMM), and ``add_ms`` the add of its result into
  the 2:4 part's output (what a fused accumulate would save);
- ``total_ms`` = the three back to back in one graph, and ``speedup`` = ``dense_ms / total_ms``; rel. error of the
  total against float64.

It decides whether a ``split24`` SpMM variant is worth building; it is not the variant. Writes ``--out`` JSON (device,
torch version, date) and prints a table.

    PYTHONPATH=src python benchmarks/split24_probe.py --out benchmarks/results/split24-probe-<dev>-<date>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bsr import L2_BYTES  # noqa: E402
from split24 import result_meta  # noqa: E402
from split24 import timed as timed_calls  # noqa: E402

from prunekit.kernels.split24 import split_24  # noqa: E402  (the variant's own split)


def time_point(
    w: torch.Tensor, packed: torch.Tensor, res_csr: torch.Tensor, n: int, layers: tuple | None = None
) -> dict:
    """Graph times (ms) of the dense, 2:4, residual, add and total calls at ``n`` tokens, and the total's error; with
    ``layers`` (prunekit's ``SparseLinear`` on the 2:4 part and on the residual) the same for prunekit's pieces."""
    m, k = w.shape
    dtype = w.dtype
    sets = max(1, min(4, int(2 * L2_BYTES // (n * k * 2)) + 1))
    xs = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(sets)]
    outs = [torch.empty(n, m, device="cuda", dtype=dtype) for _ in range(sets)]
    parts = [torch.empty(m, n, device="cuda", dtype=dtype) for _ in range(sets)]

    def total(x: torch.Tensor) -> torch.Tensor:
        y = torch._cslt_sparse_mm(packed, x.t(), transpose_result=True)  # (N, M): nn.Linear's layout
        return y.add_(torch.sparse.mm(res_csr, x.t()).t())

    methods = {}

    def timed(name: str, calls: list) -> float:
        return timed_calls(calls, methods, name, eager_trials=15)

    row = {
        "dense_ms": timed("dense", [lambda x=x: F.linear(x, w) for x in xs]),
        "w24_ms": timed("w24", [lambda x=x: torch._cslt_sparse_mm(packed, x.t(), transpose_result=True) for x in xs]),
        "residual_ms": timed("residual", [lambda x=x: torch.sparse.mm(res_csr, x.t()) for x in xs]),
        "add_ms": timed("add", [lambda o=o, p=p: o.add_(p.t()) for o, p in zip(outs, parts, strict=True)]),
        "total_ms": timed("total", [lambda x=x: total(x) for x in xs]),
    }
    ref = xs[0].double() @ w.double().t()
    if layers is not None:  # prunekit's own pieces: SparseLinear on the 2:4 part (prunekit's cuSPARSELt binding, its
        # configuration search) and on the residual as CSR ("auto"), their (N, M) outputs added
        l24, lres = layers
        row["ours_w24_ms"] = timed("ours_w24", [lambda x=x: l24(x) for x in xs])
        row["ours_residual_ms"] = timed("ours_residual", [lambda x=x: lres(x) for x in xs])
        row["ours_total_ms"] = timed("ours_total", [lambda x=x: l24(x).add_(lres(x)) for x in xs])
        y = l24(xs[0]).add_(lres(xs[0]))
        row["ours_rel_error"] = float((y.double() - ref).norm() / ref.norm())
        row["ours_speedup"] = row["dense_ms"] / row["ours_total_ms"]
        row["ours_w24_speedup"] = row["dense_ms"] / row["ours_w24_ms"]
    row["methods"] = methods
    y = total(xs[0])
    row["rel_error"] = float((y.double() - ref).norm() / ref.norm())
    row["speedup"] = row["dense_ms"] / row["total_ms"]
    row["w24_speedup"] = row["dense_ms"] / row["w24_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="4096x4096,11008x4096,4096x11008")
    parser.add_argument("--ns", default="2048,4096")
    parser.add_argument("--sparsities", default="0.8,0.9,0.95")
    parser.add_argument("--prunekit", action="store_true", help="also time prunekit's SparseLinear pieces")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: split24_probe.py needs a CUDA GPU")
    dtype = torch.float16
    rows = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        for sparsity in (float(v) for v in args.sparsities.split(",")):
            g = torch.Generator(device="cuda").manual_seed(0)
            w = torch.randn(m, k, generator=g, device="cuda") * (
                torch.rand(m, k, generator=g, device="cuda") >= sparsity
            )
            w = (w * (k * (1 - sparsity)) ** -0.5).to(dtype)
            w24, res = split_24(w)
            packed = torch._cslt_compress(w24)
            res_csr = res.to_sparse_csr()
            layers = None
            if args.prunekit:
                from prunekit import formats
                from prunekit.deploy.runtime.sparse_linear import SparseLinear

                l24 = SparseLinear(formats.encode("nm", w24.cpu(), {"n": 2, "m": 4})).cuda()
                lres = SparseLinear(formats.encode("csr", res.cpu(), {})).cuda()
                layers = (l24, lres)
            res_density = res_csr.values().numel() / (m * k)
            for n in (int(v) for v in args.ns.split(",")):
                row = time_point(w, packed, res_csr, n, layers)
                row.update(m=m, k=k, n=n, sparsity=sparsity, residual_density=res_density)
                rows.append(row)
                print(
                    f"{m}x{k} N={n} s={sparsity}: dense {1e3 * row['dense_ms']:.1f} us, 2:4 {1e3 * row['w24_ms']:.1f}, "
                    f"residual {1e3 * row['residual_ms']:.1f} (density {100 * res_density:.3f}%), add "
                    f"{1e3 * row['add_ms']:.1f}, total {1e3 * row['total_ms']:.1f} -> {row['speedup']:.2f}x "
                    f"(2:4 alone {row['w24_speedup']:.2f}x), rel. err {row['rel_error']:.1e}"
                    + (
                        f"; prunekit: 2:4 {1e3 * row['ours_w24_ms']:.1f}, residual {1e3 * row['ours_residual_ms']:.1f}, "
                        f"total {1e3 * row['ours_total_ms']:.1f} -> {row['ours_speedup']:.2f}x (2:4 alone "
                        f"{row['ours_w24_speedup']:.2f}x), rel. err {row['ours_rel_error']:.1e}"
                        if "ours_total_ms" in row
                        else ""
                    ),
                    flush=True,
                )
    meta = result_meta()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    print(f"wrote {args.out}; median speedup {statistics.median(r['speedup'] for r in rows):.2f}x")


if __name__ == "__main__":
    main()
