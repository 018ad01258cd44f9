"""2:4 decode kernel (``kernels/nm24.py``) tuning sweep: device time per k-chunk size at decode shapes, next to dense
cuBLAS and torch's semi-structured 2:4 (cuSPARSELt) in the same run.

For each weight shape W (M x K, 2:4 from the 2 largest of every 4 N(0, 1) entries), N, chunk (``auto`` =
``nm24.plan_chunk``, or a forced ``$PRUNEKIT_NM24_CHUNK``) and ring depth (``auto`` = ``nm24.plan_ring``, or a forced
``$PRUNEKIT_NM24_RING``): CUDA-graph replay time (median, rotating input sets larger
than L2, ``benchmarks/bsr.py``'s ``graph_time``) of ``nm24.decode_mm`` on ``x2d.t()``, of ``F.linear(x2d, W)`` and of
``F.linear(x2d, to_sparse_semi_structured(W))``; with ``--lean-warps`` also the lean kernel (``$PRUNEKIT_NM24_LEAN=1``,
one strip per block) at each warps-per-block setting; the streamed GB/s (plan bytes + X + Y over the time). Prints a table,
writes ``--out`` JSON (device, torch version, date).

Run on the GPU machine: ``PYTHONPATH=src python benchmarks/nm24_sweep.py --out benchmarks/results/nm24-sweep-<dev>-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bsr import L2_BYTES, graph_time, relative_error  # noqa: E402
from nm import nm24_weight  # noqa: E402

from prunekit import formats  # noqa: E402
from prunekit.kernels import nm24  # noqa: E402
from prunekit.kernels.testing import prunekit_settings  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (768, 3072), (3072, 768)]


def run_shape(
    m: int,
    k: int,
    n: int,
    chunks: list[str],
    rings: list[str],
    dtype: torch.dtype,
    gen: torch.Generator,
    lean_warps: list[str] = (),
) -> list[dict]:
    from torch.sparse import to_sparse_semi_structured

    elem = torch.finfo(dtype).bits // 8
    n_sets = max(2, min(8, math.ceil(2 * L2_BYTES / (m * k * elem // 2))))
    sets = []
    for _ in range(n_sets):
        w = nm24_weight(m, k, dtype, gen)
        enc = formats.encode("nm", w, {"n": 2, "m": 4})
        sets.append(
            (w, enc.components, int(enc.params["bits"]), torch.randn(n, k, device="cuda", generator=gen).to(dtype))
        )
    dense_ms = graph_time([lambda w=w, x=x: F.linear(x, w) for w, _, _, x in sets])
    try:
        semis = [(to_sparse_semi_structured(w), x) for w, _, _, x in sets]
        torch24_ms = graph_time([lambda s=s, x=x: F.linear(x, s) for s, x in semis])
    except Exception as exc:  # recorded, not fatal: torch's path may refuse a shape
        torch24_ms, semis = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    rows = []
    # the ring kernel at each chunk x ring, then the lean kernel ($PRUNEKIT_NM24_LEAN=1) at each warps-per-block setting
    variants = [("ring", c, r, "auto") for c in chunks for r in rings] + [
        ("lean", "auto", "auto", w) for w in lean_warps
    ]
    for kernel, chunk, ring, warps in variants:
        for env, value in ((nm24.CHUNK_ENV, chunk), (nm24.RING_ENV, ring), (nm24.LEAN_WARPS_ENV, warps)):
            if value == "auto":
                os.environ.pop(env, None)
            else:
                os.environ[env] = value
        os.environ[nm24.LEAN_ENV] = "1" if kernel == "lean" else "0"
        for _, c, _, _ in sets:  # plans read the chunk when they are built
            nm24.drop_plan(c["values"])
        calls = [lambda c=c, b=b, x=x: nm24.decode_mm(c["values"], c["metadata"], x.t(), b) for _, c, b, x in sets]
        w0, c0, b0, x0 = sets[0]
        err = relative_error(calls[0]().t(), F.linear(x0.float(), w0.float()))
        plan = nm24.get_plan(c0["values"], c0["metadata"], b0, k)
        ms = graph_time(calls)
        moved = plan.vals.nbytes + plan.meta.nbytes + (k * n + m * n) * elem
        rows.append(
            {
                "m": m, "k": k, "n": n, "kernel": kernel, "lean_warps": warps if kernel == "lean" else None,
                "chunk": plan.chunk, "chunk_arg": chunk, "ring": f"{plan.ring}x{plan.batch}", "n_sets": n_sets,
                "decode_gpu_ms": ms, "dense_gpu_ms": dense_ms, "torch24_gpu_ms": torch24_ms,
                "speedup_vs_dense": dense_ms / ms, "speedup_vs_torch24": (torch24_ms / ms) if torch24_ms else None,
                "gbs": moved / (ms * 1e-3) / 1e9, "rel_err": err,
                **({"torch24_error": semis} if torch24_ms is None else {}),
            }
        )  # fmt: skip
    for env in (nm24.CHUNK_ENV, nm24.RING_ENV, nm24.LEAN_WARPS_ENV, nm24.LEAN_ENV):
        os.environ.pop(env, None)
    return rows


def run_meta() -> dict:
    """The ``meta`` block of the nm24 result files: device, torch and CUDA versions, UTC date, arguments."""
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "env": prunekit_settings(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ns", default="1,16")
    parser.add_argument("--chunks", default="auto,8,16,32,64")
    parser.add_argument("--rings", default="auto", help="ring depths (nm24.RINGS) or auto (nm24.plan_ring)")
    parser.add_argument("--shapes", help="MxK,... (default: the issue's five)")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument(
        "--lean-warps",
        default="",
        help="also time the lean kernel ($PRUNEKIT_NM24_LEAN=1) at these $PRUNEKIT_NM24_LEAN_WARPS settings: auto, "
        "KW (warps per strip: 1, 2, 4, 8) or KWxSB (SB strips per block: 1, 2), e.g. auto,2,4,8,4x2 (at N = 1 the "
        "SpMV kernel takes the call where it applies)",
    )
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    gen = torch.Generator(device="cuda").manual_seed(0)
    nm24.load()
    meta = run_meta()
    results = []
    for m, k in shapes:
        for n in (int(v) for v in args.ns.split(",")):
            results += run_shape(
                m, k, n, args.chunks.split(","), args.rings.split(","), getattr(torch, args.dtype), gen,
                [w for w in args.lean_warps.split(",") if w],
            )  # fmt: skip
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    table = Table(title=f"2:4 decode kernel by k-chunk ({meta['device']}, {args.dtype}; graph-replay us)")
    for col in (
        "M x K",
        "N",
        "kernel",
        "chunk",
        "ring",
        "decode us",
        "dense us",
        "torch 2:4 us",
        "x dense",
        "x torch 2:4",
        "GB/s",
        "err",
    ):
        table.add_column(col, justify="right")
    for r in results:
        t24 = r["torch24_gpu_ms"]
        table.add_row(
            f"{r['m']}x{r['k']}", str(r["n"]), r.get("kernel", "ring") + (f"/{r['lean_warps']}" if r.get("lean_warps") else ""),
            f"{r['chunk']} ({r['chunk_arg']})", str(r.get("ring", "3x8")),
            f"{r['decode_gpu_ms'] * 1e3:.1f}",
            f"{r['dense_gpu_ms'] * 1e3:.1f}", f"{t24 * 1e3:.1f}" if t24 else "-", f"{r['speedup_vs_dense']:.2f}",
            f"{r['speedup_vs_torch24']:.2f}" if t24 else "-", f"{r['gbs']:.0f}", f"{r['rel_err']:.1e}",
        )  # fmt: skip
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
