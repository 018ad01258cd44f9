"""The ``direct`` SpMM kernel's tile settings (issue 4), timed in one run: lanes per row ``$PRUNEKIT_DIRECT_LPR`` (4 /
8 / 16 / 32), X loads in flight per lane ``$PRUNEKIT_DIRECT_UNROLL`` (4 / 8 / 16 / 32) and warps per block
``$PRUNEKIT_DIRECT_WARPS`` (2 / 4 / 8).

``direct`` (csrc/spmm_direct.cu, after Sputnik's 1-D tiling, Gale et al. SC 2020, sec. 4-5) gives each row LPR lanes
of 16-byte X vectors, so a block covers ``LPR * 8`` fp16 columns. Its default takes 16 lanes up to N = 128 in fp16 and
32 above. Fewer lanes make narrower column tiles: more blocks over N and a smaller slice of X per tile. UNROLL = 4 is
the original loop (four non-zeros' X loads in flight); 8 and more keep more loads in flight and load the next chunk's
(value, column) pairs ahead; above LPR each lane holds UNROLL / LPR pairs of a chunk. Fewer warps per block make blocks
of fewer rows (more blocks on small M). This script times ``gpu.spmm_csr(..., variant="direct")`` at every
combination asked for (``--lprs``, ``--unrolls``, ``--warps``; ``default``: the launcher's own choice) in the layouts
asked for (``--layouts``: nn.Linear's ``x2d.t()``, which ``direct`` copies to row-major first, and a row-major ``X:
(K, N)``), beside ``"auto"`` and dense cuBLAS (``F.linear``), on the same weights and inputs.
(``direct-lpr-h100-2026-11-27-s30f.json`` came from this script's first version: LPR 4 / 8 / 16 / 32 at UNROLL 4,
both layouts for each; ``direct-tiles-...-s30g.json`` from its second: UNROLL 4 / 8 / 16, row-major at the default
lanes only.)

Timing: CUDA events, median over replays of a CUDA graph holding many calls rotating over independent input sets
(``spmm.graph_time``). The settings are read by the launcher at each call, so each graph is captured with the
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
from prunekit.kernels.testing import encode_csr, random_sparse_weight, relative_error  # noqa: E402

SETTINGS = {  # environment variable -> what --lprs / --unrolls / --warps may name ("default": unset)
    "PRUNEKIT_DIRECT_LPR": ("4", "8", "16", "32"),
    "PRUNEKIT_DIRECT_UNROLL": ("4", "8", "16", "32"),
    "PRUNEKIT_DIRECT_WARPS": ("2", "4", "8"),
}
SHORT = {"PRUNEKIT_DIRECT_LPR": "lpr", "PRUNEKIT_DIRECT_UNROLL": "u", "PRUNEKIT_DIRECT_WARPS": "w"}  # result keys
L2_BYTES = 50 * 2**20


def bench(m: int, k: int, sparsity: float, ns: list[int], seed: int, combos: list[dict], layouts: list[str]) -> list:
    """Every setting in ``combos`` (environment variable -> value, None: unset) at every N in every layout for one
    weight shape and sparsity: result rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    probe = encode_csr(random_sparse_weight(m, k, sparsity, torch.float16, "cuda", gen))
    csr_bytes = sum(t.numel() * t.element_size() for t in probe.values())
    nsets = max(2, min(MAX_SETS, -(-2 * L2_BYTES // max(1, csr_bytes))))
    weights = [random_sparse_weight(m, k, sparsity, torch.float16, "cuda", gen) for _ in range(nsets)]
    csrs = [encode_csr(w) for w in weights]
    rows = []
    for n in ns:
        x2ds = [torch.randn(n, k, generator=gen, device="cuda").half() for _ in range(nsets)]
        inputs = {
            "linear": (x2ds, lambda x: x.t()),
            "rowmajor": ([x.t().contiguous() for x in x2ds], lambda x: x),  # row-major (K, N), the same values
        }
        ref = weights[0].double() @ inputs["rowmajor"][0][0].double()
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
        for combo in combos:
            for name, value in combo.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            tag = "_".join(f"{short}{combo[name] or 'default'}" for name, short in SHORT.items())
            for layout in layouts:
                xs, view = inputs[layout]
                calls = [
                    lambda c=c, x=x, view=view: gpu.spmm_csr(**c, x=view(x), m=m, variant="direct")
                    for c, x in zip(csrs, xs, strict=True)
                ]
                key = f"direct_{tag}_{layout}"
                row[f"{key}_rel_error"] = relative_error(calls[0](), ref)
                row[f"{key}_ms"] = graph_time(calls)
        for name in SETTINGS:
            os.environ.pop(name, None)
        for layout in layouts:
            timed = {k[: -len(f"_{layout}_ms")]: v for k, v in row.items() if k.endswith(f"_{layout}_ms")}
            timed = {k: v for k, v in timed.items() if k.startswith("direct_")}
            row[f"best_direct_{layout}"] = min(timed, key=timed.get)
            print(
                f"{m}x{k} N={n} sp={sparsity} {layout}: dense {row['dense_ms'] * 1e3:.1f} auto(linear) "
                f"{row['auto_linear_ms'] * 1e3:.1f} "
                + " ".join(f"{name[len('direct_') :]} {ms * 1e3:.1f}" for name, ms in timed.items())
                + " us",
                flush=True,
            )
        rows.append(row)
    return rows


def parse_settings(text: str, name: str) -> list[str | None]:
    """``"8,16,default"`` -> ``["8", "16", None]``; values outside :data:`SETTINGS` raise SystemExit."""
    out: list[str | None] = []
    for item in text.split(","):
        if item == "default":
            out.append(None)
        elif item in SETTINGS[name]:
            out.append(item)
        else:
            raise SystemExit(f"error: {name} takes {', '.join(SETTINGS[name])} or default, not {item!r}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="4096x4096,11008x4096,4096x11008,768x3072,3072x768")
    parser.add_argument("--ns", default="64,128,256")
    parser.add_argument("--sparsities", default="0.9,0.95,0.98")
    parser.add_argument("--lprs", default="default,8,16,32", help="lanes per row to time (default: unset)")
    parser.add_argument("--unrolls", default="4,8,16,32", help="X loads in flight to time")
    parser.add_argument("--warps", default="default", help="warps per block to time")
    parser.add_argument("--layouts", default="linear", help="linear (nn.Linear's x2d.t()), rowmajor, or both")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    if not set(layouts) <= {"linear", "rowmajor"}:
        raise SystemExit(f"error: --layouts takes linear and/or rowmajor, not {args.layouts!r}")
    combos = [
        {"PRUNEKIT_DIRECT_LPR": lpr, "PRUNEKIT_DIRECT_UNROLL": unroll, "PRUNEKIT_DIRECT_WARPS": warps}
        for lpr in parse_settings(args.lprs, "PRUNEKIT_DIRECT_LPR")
        for unroll in parse_settings(args.unrolls, "PRUNEKIT_DIRECT_UNROLL")
        for warps in parse_settings(args.warps, "PRUNEKIT_DIRECT_WARPS")
    ]
    if not torch.cuda.is_available():
        raise SystemExit("error: this benchmark needs a CUDA GPU")
    build.load()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ns = [int(v) for v in args.ns.split(",")]
    meta = {
        **result_meta(),
        "method": "CUDA events; median over replays of a CUDA graph holding many calls rotating over input sets "
        "(spmm.graph_time); each graph captured with its PRUNEKIT_DIRECT_* settings in the environment (keys "
        "direct_lpr<L>_u<U>_w<W>_<layout>; 'default': unset)",
    }
    result = {"meta": meta, "rows": []}
    for i, ((m, k), sparsity) in enumerate((s, p) for s in shapes for p in map(float, args.sparsities.split(","))):
        result["rows"].extend(bench(m, k, sparsity, ns, i, combos, layouts))
        write_json(args.out, result)


if __name__ == "__main__":
    main()
