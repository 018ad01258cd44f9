"""Same-run comparison with Sputnik (issue 4): prunekit's ``spmm_csr`` against Sputnik's own ``CudaSpmm`` (Gale,
Zaharia, Young, Elsen, "Sparse GPU Kernels for Deep Learning", SC 2020; google-research/sputnik), dense cuBLAS and
torch.sparse.mm, on the same weights and inputs.

Sputnik is a benchmark-only baseline: its sources are never committed. Put them in ``.carry/sputnik`` (git-ignored),
e.g. ``git archive HEAD sputnik/ | tar x -C .carry/sputnik`` in a clone of google-research/sputnik, and carry that
folder to the GPU machine. This script compiles Sputnik's ``sputnik/spmm/cuda_spmm.cu.cc`` unchanged (included by a
small binding written here) with ``torch.utils.cpp_extension`` for the GPU it runs on.

Every contender computes ``Y (M, N) = W (M, K) @ X (K, N)`` with row-major X and Y, Sputnik's layout:

- ``prunekit``: ``ops.spmm_csr(values, row_offsets, column_indices, row_indices, x=X, m=M)``, the variant that
  ``"auto"`` picks (recorded per row);
- ``sputnik_fp16``: ``CudaSpmm`` on the half2 / short2 path, given prunekit's own CSR arrays: prunekit pads every row to
  a multiple of 8 values (zeros at the row's last column), which meets Sputnik's even-row-length rule; column indices
  int16; ``row_indices`` is the swizzle order (rows by length, longest first) that Sputnik's paper and prunekit use;
  it needs an even N, so it does not run at N = 1;
- ``sputnik_fp32``: ``CudaSpmm`` on the float path, the same arrays in fp32 / int32 (fp32 arithmetic on fp16-valued
  inputs);
- ``dense``: ``torch.mm(W, X)`` (cuBLAS) in fp16;
- ``torch_sparse``: ``torch.sparse.mm(W_csr, X)`` in fp16, timed eagerly (cuSPARSE through torch).

And in nn.Linear's layout, activations ``x2d: (N, K)`` (the same values) and an ``(N, M)`` output, as the runtime's
``SparseLinear`` calls the op:

- ``prunekit_linear``: ``ops.spmm_csr(..., x=x2d.t(), m=M)`` (no copy; the output is the transposed view);
- ``dense_linear``: ``F.linear(x2d, W)`` (cuBLAS);
- ``sputnik_fp16_linear``: what that layout costs Sputnik: ``x2d`` copied into a row-major ``(K, N)`` buffer, then
  ``CudaSpmm``, then its ``(M, N)`` output copied into an ``(N, M)`` one.

Timing: CUDA events, ``*_ms`` = median over replays of a CUDA graph holding many calls rotating over independent
input sets (``spmm.graph_time``; device time); torch.sparse.mm eagerly (``spmm.eager_time``). Sputnik's outputs are
filled with NaN before its first call (prunekit and cuBLAS allocate theirs), and every contender's error is checked
against a float64 product on the GPU (``*_rel_error`` = ||Y - ref|| / ||ref||).

Run on the GPU machine (repository root, no install): ``source scripts/gpu_env.sh; python3
benchmarks/sputnik_compare.py --out $OUT/sputnik-compare-<dev>-<date>.json``. Writes the JSON after every weight
(device, torch and CUDA versions, date, Sputnik's commit) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from split24 import result_meta  # noqa: E402
from spmm import MAX_SETS, NS, SHAPES, eager_time, graph_time, write_json  # noqa: E402

from prunekit.kernels import build, gpu, ops  # noqa: E402
from prunekit.kernels.testing import encode_csr, random_sparse_weight, relative_error  # noqa: E402

SPARSITIES = [0.7, 0.8, 0.9, 0.95, 0.98]
L2_BYTES = 50 * 2**20
console = Console()

# The binding: prunekit's own code. It declares nothing of Sputnik's beyond what its public header gives, and calls
# CudaSpmm on torch's current stream so that the calls can be captured in a CUDA graph.
BINDING = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_fp16.h>
#include "sputnik/spmm/cuda_spmm.cu.cc"

namespace {
void check(cudaError_t e) { TORCH_CHECK(e == cudaSuccess, "Sputnik CudaSpmm: ", cudaGetErrorString(e)); }
}

void spmm_fp16(int64_t m, int64_t k, int64_t n, torch::Tensor row_indices, torch::Tensor values,
               torch::Tensor row_offsets, torch::Tensor column_indices, torch::Tensor x, torch::Tensor y) {
  TORCH_CHECK(values.scalar_type() == at::kHalf && column_indices.scalar_type() == at::kShort, "fp16 / int16 wanted");
  TORCH_CHECK(n % 2 == 0 && values.numel() % 2 == 0, "Sputnik's half2 path needs an even N and even row lengths");
  check(sputnik::CudaSpmm(
      int(m), int(k), int(n), int(values.numel()), row_indices.data_ptr<int>(),
      reinterpret_cast<const half2*>(values.data_ptr<at::Half>()), row_offsets.data_ptr<int>(),
      reinterpret_cast<const short2*>(column_indices.data_ptr<int16_t>()),
      reinterpret_cast<const half2*>(x.data_ptr<at::Half>()), reinterpret_cast<half2*>(y.data_ptr<at::Half>()),
      at::cuda::getCurrentCUDAStream()));
}

void spmm_fp32(int64_t m, int64_t k, int64_t n, torch::Tensor row_indices, torch::Tensor values,
               torch::Tensor row_offsets, torch::Tensor column_indices, torch::Tensor x, torch::Tensor y) {
  TORCH_CHECK(values.scalar_type() == at::kFloat && column_indices.scalar_type() == at::kInt, "fp32 / int32 wanted");
  check(sputnik::CudaSpmm(int(m), int(k), int(n), int(values.numel()), row_indices.data_ptr<int>(),
                          values.data_ptr<float>(), row_offsets.data_ptr<int>(), column_indices.data_ptr<int>(),
                          x.data_ptr<float>(), y.data_ptr<float>(), at::cuda::getCurrentCUDAStream()));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("spmm_fp16", &spmm_fp16);
  m.def("spmm_fp32", &spmm_fp32);
}
"""


def load_sputnik(root: Path, build_dir: Path):
    """Compile Sputnik's SpMM from ``root`` (holding ``sputnik/spmm/cuda_spmm.cu.cc``) for this GPU; the module.

    Raises:
        SystemExit: the sources are missing (a one-line message).
    """
    from torch.utils.cpp_extension import load

    if not (root / "sputnik" / "spmm" / "cuda_spmm.cu.cc").is_file():
        raise SystemExit(f"error: no Sputnik sources under {root} (see this script's docstring)")
    build_dir.mkdir(parents=True, exist_ok=True)
    source = build_dir / "sputnik_binding.cu"
    source.write_text(BINDING)
    major, minor = torch.cuda.get_device_capability()
    return load(
        name="prunekit_bench_sputnik",
        sources=[str(source)],
        extra_include_paths=[str(root)],
        extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}", "-std=c++17"],
        build_directory=str(build_dir),
        verbose=False,
    )


def sputnik_commit(root: Path) -> str:
    """``$SPUTNIK_COMMIT``, else the git HEAD of ``root`` if it is a clone, else "unknown"."""
    if os.environ.get("SPUTNIK_COMMIT"):
        return os.environ["SPUTNIK_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def sputnik_call(fn, m: int, k: int, n: int, csr: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One Sputnik ``CudaSpmm`` call on prunekit's CSR arrays (``fn``: the module's ``spmm_fp16`` / ``spmm_fp32``),
    ``x: (K, N)`` row-major into ``y: (M, N)``; returns ``y``."""
    fn(m, k, n, csr["row_indices"], csr["values"], csr["row_offsets"], csr["column_indices"], x, y)
    return y


def bench_weight(sp, m: int, k: int, sparsity: float, ns: list[int], seed: int) -> list[dict]:
    """Every contender at every N for one (M, K, sparsity): a list of result rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    probe = encode_csr(random_sparse_weight(m, k, sparsity, torch.float16, "cuda", gen))
    csr_bytes = sum(t.numel() * t.element_size() for t in probe.values())
    nsets = max(2, min(MAX_SETS, -(-2 * L2_BYTES // max(1, csr_bytes + m * k * 2))))
    weights, csrs, csrs32, torch_csrs = [], [], [], []
    for _ in range(nsets):
        w = random_sparse_weight(m, k, sparsity, torch.float16, "cuda", gen)
        c = encode_csr(w)
        weights.append(w)
        csrs.append(c)
        csrs32.append({**c, "values": c["values"].float(), "column_indices": c["column_indices"].int()})
        torch_csrs.append(w.to_sparse_csr())
    rows = []
    for n in ns:
        xs = [torch.randn(k, n, generator=gen, device="cuda").half() for _ in range(nsets)]
        xs32 = [x.float() for x in xs]
        ref = weights[0].double() @ xs[0].double()
        ys = {
            name: [torch.full((m, n), float("nan"), device="cuda", dtype=dt) for _ in range(nsets)]
            for name, dt in (("sputnik_fp16", torch.float16), ("sputnik_fp32", torch.float32))
        }
        x2ds = [x.t().contiguous() for x in xs]  # the same activations as nn.Linear holds them: (N, K)
        # name -> (calls, whether the output is (N, M), nn.Linear's layout, instead of (M, N))
        calls = {
            "prunekit": ([lambda c=c, x=x: ops.spmm_csr(**c, x=x, m=m) for c, x in zip(csrs, xs, strict=True)], False),
            "prunekit_linear": (
                [lambda c=c, x=x: ops.spmm_csr(**c, x=x.t(), m=m).t() for c, x in zip(csrs, x2ds, strict=True)],
                True,
            ),
            "dense": ([lambda w=w, x=x: torch.mm(w, x) for w, x in zip(weights, xs, strict=True)], False),
            "dense_linear": ([lambda w=w, x=x: F.linear(x, w) for w, x in zip(weights, x2ds, strict=True)], True),
            "sputnik_fp32": (
                [
                    lambda c=c, x=x, y=y, n=n: sputnik_call(sp.spmm_fp32, m, k, n, c, x, y)
                    for c, x, y in zip(csrs32, xs32, ys["sputnik_fp32"], strict=True)
                ],
                False,
            ),
        }
        if n % 2 == 0 and csrs[0]["column_indices"].dtype == torch.int16:
            calls["sputnik_fp16"] = (
                [
                    lambda c=c, x=x, y=y, n=n: sputnik_call(sp.spmm_fp16, m, k, n, c, x, y)
                    for c, x, y in zip(csrs, xs, ys["sputnik_fp16"], strict=True)
                ],
                False,
            )
            # what nn.Linear-shaped activations cost Sputnik: X transposed into its row-major (K, N) buffer, its
            # (M, N) output transposed back to (N, M), both as copies
            xbuf = torch.empty(k, n, device="cuda", dtype=torch.float16)
            outs = [torch.full((n, m), float("nan"), device="cuda", dtype=torch.float16) for _ in range(nsets)]
            calls["sputnik_fp16_linear"] = (
                [
                    lambda c=c, x=x, y=y, o=o, n=n, xb=xbuf: o.copy_(
                        sputnik_call(sp.spmm_fp16, m, k, n, c, xb.copy_(x.t()), y).t()
                    )
                    for c, x, y, o in zip(csrs, x2ds, ys["sputnik_fp16"], outs, strict=True)
                ],
                True,
            )
        row = {
            "m": m,
            "k": k,
            "n": n,
            "sparsity": sparsity,
            "nnz_padded": csrs[0]["values"].numel(),
            "input_sets": nsets,
            "prunekit_variant": gpu.plan_spmm(
                m,
                k,
                n,
                csrs[0]["values"].numel(),
                torch.cuda.get_device_properties(0).multi_processor_count,
                "auto",
                torch.float16,
            ).variant,
        }
        for name, (fns, linear) in calls.items():
            out = fns[0]()
            torch.cuda.synchronize()
            row[f"{name}_rel_error"] = relative_error(out.t() if linear else out, ref)
            row[f"{name}_ms"] = graph_time(fns)
        tsp = [lambda s=s, x=x: torch.sparse.mm(s, x) for s, x in zip(torch_csrs, xs, strict=True)]
        row["torch_sparse_eager_ms"] = eager_time(tsp, min_reps=1, trials=3)
        row["prunekit_vs_dense"] = row["dense_ms"] / row["prunekit_ms"]
        row["prunekit_linear_vs_dense_linear"] = row["dense_linear_ms"] / row["prunekit_linear_ms"]
        for name in ("sputnik_fp16", "sputnik_fp32"):
            if f"{name}_ms" in row:
                row[f"prunekit_vs_{name}"] = row[f"{name}_ms"] / row["prunekit_ms"]
                row[f"prunekit_linear_vs_{name}"] = row[f"{name}_ms"] / row["prunekit_linear_ms"]
                row[f"{name}_vs_dense"] = row["dense_ms"] / row[f"{name}_ms"]
        if "sputnik_fp16_linear_ms" in row:
            row["prunekit_linear_vs_sputnik_fp16_linear"] = row["sputnik_fp16_linear_ms"] / row["prunekit_linear_ms"]
        rows.append(row)
        del xs, xs32, x2ds, ys, calls, tsp, ref
    del weights, csrs, csrs32, torch_csrs
    torch.cuda.empty_cache()
    return rows


def render(rows: list[dict], title: str) -> None:
    table = Table(title=title)
    cols = (
        "W (M x K)",
        "N",
        "sparsity",
        "variant",
        "prunekit ms",
        "prunekit (N, K) X ms",
        "Sputnik fp16 ms",
        "Sputnik fp32 ms",
        "dense ms",
        "vs Sputnik fp16",
        "(N, K) X vs Sputnik fp16",
        "vs dense",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        sp16 = r.get("sputnik_fp16_ms")
        table.add_row(
            f"{r['m']}x{r['k']}",
            str(r["n"]),
            f"{r['sparsity']:.2f}",
            r["prunekit_variant"],
            f"{r['prunekit_ms']:.4f}",
            f"{r['prunekit_linear_ms']:.4f}",
            f"{sp16:.4f}" if sp16 else "-",
            f"{r['sputnik_fp32_ms']:.4f}",
            f"{r['dense_ms']:.4f}",
            f"{r['prunekit_vs_sputnik_fp16']:.2f}x" if sp16 else "-",
            f"{r['prunekit_linear_vs_sputnik_fp16']:.2f}x" if sp16 else "-",
            f"{r['prunekit_vs_dense']:.2f}x",
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--sputnik-src", type=Path, default=Path(".carry/sputnik"), help="folder holding sputnik/")
    parser.add_argument("--build-dir", type=Path, default=Path("/tmp/prunekit-bench-sputnik"))
    parser.add_argument("--shapes", default=",".join(f"{m}x{k}" for m, k in SHAPES))
    parser.add_argument("--ns", default=",".join(map(str, NS)))
    parser.add_argument("--sparsities", default=",".join(map(str, SPARSITIES)))
    parser.add_argument("--time-budget-s", type=float, default=float("inf"), help="start no weight after this")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA GPU")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ns = [int(v) for v in args.ns.split(",")]
    sparsities = [float(v) for v in args.sparsities.split(",")]
    started = time.monotonic()
    sp = load_sputnik(args.sputnik_src.resolve(), args.build_dir)
    build.load()
    result = {
        "meta": {
            **result_meta(),
            "sputnik": f"google-research/sputnik {sputnik_commit(args.sputnik_src)}, sputnik/spmm/cuda_spmm.cu.cc",
            "method": "CUDA events; median over replays of a CUDA graph holding many calls rotating over input sets "
            "(spmm.graph_time); torch.sparse.mm eager (spmm.eager_time). Row-major X (K, N) and Y (M, N), and "
            "nn.Linear's x2d (N, K) / Y (N, M) for the *_linear contenders; fp16 inputs; errors against float64 "
            "(Sputnik's outputs NaN-poisoned first).",
            "build_s": time.monotonic() - started,
        },
        "rows": [],
        "skipped": [],
    }
    for i, ((m, k), sparsity) in enumerate((s, p) for s in shapes for p in sparsities):
        if time.monotonic() - started > args.time_budget_s:
            result["skipped"].append({"m": m, "k": k, "sparsity": sparsity})
            continue
        t0 = time.monotonic()
        rows = bench_weight(sp, m, k, sparsity, ns, args.seed + i)
        result["rows"].extend(rows)
        result["meta"]["elapsed_s"] = time.monotonic() - started
        write_json(args.out, result)
        best = statistics.median(r.get("prunekit_vs_sputnik_fp16", r["prunekit_vs_sputnik_fp32"]) for r in rows)
        console.print(f"{m}x{k} sp={sparsity}: {time.monotonic() - t0:.1f} s, median prunekit/Sputnik {best:.2f}x")
    render(result["rows"], f"prunekit vs Sputnik on {result['meta']['device']} ({result['meta']['date_utc']})")
    if result["skipped"]:
        write_json(args.out, result)  # the skipped list too: nothing was written after the last measured one
        console.print(f"[yellow]{len(result['skipped'])} weights skipped by the time budget[/yellow]")


if __name__ == "__main__":
    main()
