"""The ``direct`` SpMM kernel's tile settings (issue 4), timed in one run: lanes per row ``$PRUNEKIT_DIRECT_LPR`` (8 /
16 / 32) and X loads in flight per lane ``$PRUNEKIT_DIRECT_UNROLL`` (4 / 8 / 16).

``direct`` (csrc/spmm_direct.cu, after Sputnik's 1-D tiling, Gale et al. SC 2020, sec. 4-5) gives each row LPR lanes
of 16-byte X vectors, so a block covers ``LPR * 8`` fp16 columns. Its default takes 16 lanes up to N = 128 in fp16 and
32 above. Fewer lanes make narrower column tiles: more blocks over N and a smaller slice of X per tile. UNROLL = 4 is
the original loop (four non-zeros' X loads in flight); 8 and 16 keep more loads in flight and load the next chunk's
(value, column) pairs ahead. This script times ``gpu.spmm_csr(..., variant="direct")`` at every combination in
nn.Linear's layout (``x2d.t()``, which ``direct`` copies to row-major first) and, at the default lanes, also with a
row-major ``X: (K, N)``, beside ``"auto"`` and dense cuBLAS (``F.linear``), on the same weights and inputs.
(``direct-lpr-h100-2026-11-27-s30f.json`` came from this script's first version: LPR 4 / 8 / 16 / 32 at UNROLL 4,
both layouts for each.)

Timing: CUDA events, median over replays of a CUDA graph holding many calls rotating over independent input sets
(``spmm.graph_time``). The setting is read by the launcher at each call, so each graph is captured with the
environment set for it. Errors: against a float64 product (``||Y - ref|| / ||ref||``).

Run on the GPU machine (repository root): ``source scripts/gpu_env.sh; python3 benchmarks/direct_lpr.py --out
$OUT/direct-lpr-<dev>-<date>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from split24 import result_meta  # noqa: E402
from spmm import MAX_SETS, graph_time, write_json  # noqa: E402

from prunekit.kernels import build, gpu  # noqa: E402
from prunekit.kernels.testing import encode_csr, random_sparse_weight  # noqa: E402

LPRS = (8, 16, 32)
UNROLLS = (4, 8, 16)
L2_BYTES = 50 * 2**20


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (y.double() - ref).norm()
    return float(diff / ref.norm()) if bool(torch.isfinite(diff)) else float("inf")


def bench(m: int, k: int, sparsity: float, ns: list[int], seed: int) -> list[dict]:
    """Every setting at every N for one weight shape and sparsity: result rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    probe = encode_csr(random_sparse_weight(m, k, sparsity, torch.float16, "cuda", gen))
    csr_bytes = sum(t.numel() * t.element_size() for t in probe.values())
    nsets = max(2, min(MAX_SETS, -(-2 * L2_BYTES // max(1, csr_bytes))))
    weights = [random_sparse_weight(m, k, sparsity, torch.float16, "cuda", gen) for _ in range(nsets)]
    csrs = [encode_csr(w) for w in weights]
    rows = []
    for n in ns:
        x2ds = [torch.randn(n, k, generator=gen, device="cuda").half() for _ in range(nsets)]
        xs = [x.t().contiguous() for x in x2ds]  # row-major (K, N), the same values
        ref = weights[0].double() @ xs[0].double()
        row = {
            "m": m,
            "k": k,
            "n": n,
            "sparsity": sparsity,
            "input_sets": nsets,
            "nnz_padded": csrs[0]["values"].numel(),
        }
        row["dense_ms"] = graph_time([lambda w=w, x=x: F.linear(x, w) for w, x in zip(weights, x2ds, strict=True)])
        row["auto_linear_ms"] = graph_time(
            [lambda c=c, x=x: gpu.spmm_csr(**c, x=x.t(), m=m) for c, x in zip(csrs, x2ds, strict=True)]
        )
        for lpr in (None, *LPRS):  # None: the launcher's default lanes
            for unroll in UNROLLS:
                if lpr is None:
                    os.environ.pop("PRUNEKIT_DIRECT_LPR", None)
                else:
                    os.environ["PRUNEKIT_DIRECT_LPR"] = str(lpr)
                os.environ["PRUNEKIT_DIRECT_UNROLL"] = str(unroll)
                layouts = [("linear", x2ds, lambda x: x.t())]
                if lpr is None:
                    layouts.append(("rowmajor", xs, lambda x: x))
                for layout, inputs, view in layouts:
                    calls = [
                        lambda c=c, x=x, view=view: gpu.spmm_csr(**c, x=view(x), m=m, variant="direct")
                        for c, x in zip(csrs, inputs, strict=True)
                    ]
                    key = f"direct_lpr{lpr or 'default'}_u{unroll}_{layout}"
                    row[f"{key}_rel_error"] = rel_error(calls[0](), ref)
                    row[f"{key}_ms"] = graph_time(calls)
        os.environ.pop("PRUNEKIT_DIRECT_LPR", None)
        os.environ.pop("PRUNEKIT_DIRECT_UNROLL", None)
        linear = {k[: -len("_linear_ms")]: v for k, v in row.items() if k.endswith("_linear_ms") and "direct" in k}
        row["best_direct_linear"] = min(linear, key=linear.get)
        print(
            f"{m}x{k} N={n} sp={sparsity}: dense {row['dense_ms'] * 1e3:.1f} auto {row['auto_linear_ms'] * 1e3:.1f} "
            + " ".join(f"{name[len('direct_') :]} {ms * 1e3:.1f}" for name, ms in linear.items())
            + " us (nn.Linear layout)",
            flush=True,
        )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="4096x4096,11008x4096,4096x11008,768x3072,3072x768")
    parser.add_argument("--ns", default="64,128,256")
    parser.add_argument("--sparsities", default="0.9,0.95,0.98")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA GPU")
    build.load()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ns = [int(v) for v in args.ns.split(",")]
    meta = {
        **result_meta(),
        "method": "CUDA events; median over replays of a CUDA graph holding many calls rotating over input sets "
        "(spmm.graph_time); each graph captured with its PRUNEKIT_DIRECT_* setting in the environment",
    }
    result = {"meta": meta, "rows": []}
    for i, ((m, k), sparsity) in enumerate((s, p) for s in shapes for p in map(float, args.sparsities.split(","))):
        result["rows"].extend(bench(m, k, sparsity, ns, i))
        write_json(args.out, result)


if __name__ == "__main__":
    main()
