"""2:4 at large N (issue 5): which operand layouts and cuSPARSELt configurations of prunekit's binding are fast.

``benchmarks/nm.py`` found the binding's default (cuSPARSELt writes a row-major ``Y (M, N)``, then the layout rule's
transposing copy) at 0.69-1.25x of dense where torch's ``to_sparse_semi_structured`` reached 1.28-1.64x (graph) in the
same run. torch returns the transposed view of cuSPARSELt's row-major output and copies nothing. This script times,
per large GEMM and in one run (CUDA-graph replays, median; rotating input sets as in ``benchmarks/bsr.py``):

- ``dense``: ``F.linear(x2d, W)`` (cuBLAS); ``torch24``: ``F.linear(x2d, to_sparse_semi_structured(W))``;
  ``torch_cslt_mm``: ``torch._cslt_sparse_mm(torch._cslt_compress(W), x2d.t())`` (the same call without the subclass);
- ``mm_<x>_<y>_bt<0|1>``: one ``prunekit_cslt::mm`` call (no copy) with X ``(K, N)`` column-major (``xc``, the
  transposed view of nn.Linear activations) or row-major (``xr``), and Y ``(M, N)`` row-major (``yr``) or
  column-major (``yc``, the transposed view of a contiguous ``(N, M)``, the layer's output layout); ``bt1``: X described
  to cuSPARSELt as the transpose of an ``(N, K)`` with opB = T (``$PRUNEKIT_CSLT_B_T=1``, what torch does), ``bt0`` as
  itself;
- ``linear``: the binding's entry as the custom op calls it (``structured.nm_mm_cuda(..., backend="cslt")``, layout
  rule); ``linear_view`` the same with ``output="view"`` (row-major Y returned as it is, the runtime layer's default);
- ``sbT_<x>_<y>`` / ``sbN_<x>_<y>``: W as cuSPARSELt's structured B operand (``prunekit_cslt::prepare_b``), the
  product computed as ``Y^T (N, M) = X^T (N, K) @ W^T``; ``sb_linear`` the binding's entry on the ``sbT`` weights;
- ``copy_t``: the transposing copy alone (``(N, M)`` buffer from a row-major ``(M, N)``), torch's ``copy_``;
- ``alg<i>`` / ``splitk1``: ``mm_xc_yr`` (the default X description) with ``$PRUNEKIT_CSLT_ALG=i`` /
  ``$PRUNEKIT_CSLT_SPLIT_K=1`` (plans built by those settings; an id cuSPARSELt refuses is recorded as an error; split-K
  2 and 4 were refused with "invalid value" on the H100); ``--algs -1`` times every id up to cuSPARSELt's
  ``CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID`` (``max_alg_id`` in the row), in ``--alg-layout``; ``skmode<m>_sk<f>``: split-K factor ``f`` under
  ``cusparseLtSplitKMode_t`` value ``m`` (``$PRUNEKIT_CSLT_SPLIT_K_MODE``, ``--split-k-modes``);
  ``fresh_plan1``: ``$PRUNEKIT_CSLT_FRESH_PLAN=1``, a new
  plan in every call, as ``torch._cslt_sparse_mm`` builds one (device time only: the graph replays the kernels).

Writes ``--out`` JSON (device, torch, date) and prints a table. GPU machine:
``PYTHONPATH=src python benchmarks/nm_configs.py --out $OUT/nm-configs-h100-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
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
from prunekit.kernels import structured  # noqa: E402

POINTS = [(16384, 16384, 8192), (8192, 8192, 8192), (4096, 4096, 4096), (11008, 4096, 2048), (4096, 11008, 2048)]
LAYOUTS = ("xc_yr", "xc_yc", "xr_yr", "xr_yc")
console = Console()


@contextlib.contextmanager
def _env(name: str, value: str):
    """``$name`` set to ``value`` inside the block (the binding reads it when a plan is built), unset after."""
    os.environ[name] = value
    try:
        yield
    finally:
        del os.environ[name]


def _operands(x2d: torch.Tensor, m: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """X ``(K, N)`` and Y ``(M, N)`` in ``layout`` (``x2d: (N, K)`` row-major)."""
    n = x2d.shape[0]
    x = x2d.t() if layout.startswith("xc") else x2d.t().contiguous()
    y = torch.empty(m, n, dtype=x2d.dtype, device=x2d.device)
    if layout.endswith("yc"):
        y = torch.empty(n, m, dtype=x2d.dtype, device=x2d.device).t()
    return x, y


def save_rows(out: Path, rows: list[dict]) -> dict:
    """Write ``{"environment": meta, "rows": rows}`` to ``out`` (through a temporary file, then a rename) and return
    ``meta``: device, torch and CUDA versions, UTC date, host and command line."""
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "command": " ".join(sys.argv),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"environment": meta, "rows": rows}, indent=1))
    tmp.replace(out)
    return meta


def run_point(m: int, k: int, n: int, dtype: torch.dtype, args, gen: torch.Generator) -> dict:
    from torch.sparse import to_sparse_semi_structured

    elem = torch.finfo(dtype).bits // 8
    set_bytes = (m * k // 2 + k * n + 2 * m * n) * elem
    n_sets = max(2, min(args.max_sets, math.ceil(2 * L2_BYTES / set_bytes)))
    sets = []
    for _ in range(n_sets):
        w = nm24_weight(m, k, dtype, gen)
        enc = formats.encode("nm", w, {"n": 2, "m": 4})
        c, bits = enc.components, int(enc.params["bits"])
        x2d = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
        state = structured.native_weight_24(c["values"], c["metadata"], bits, k)
        sets.append((w, c, bits, x2d, state))
    res: dict = {"m": m, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch."), "n_sets": n_sets}
    w0, _, _, x0, _ = sets[0]
    ref = F.linear(x0.float(), w0.float()).t()

    def timed(name: str, calls: list, check=None) -> None:
        try:
            res[f"{name}_gpu_ms"] = graph_time(calls)
            if check is not None:
                res[f"{name}_err"] = relative_error(check(), ref)
        except RuntimeError as exc:  # a configuration cuSPARSELt refuses
            res[f"{name}_error"] = str(exc).splitlines()[0][:200]
            torch.cuda.synchronize()

    def timed_mm(name: str, layout: str = "xc_yr", ids: list[int] | None = None) -> None:
        """One ``prunekit_cslt::mm`` per set (weight ids: the sets' own, or ``ids``), operands in ``layout``; the
        first set's output checked."""
        calls, outs = [], []
        for i, (_, _, _, x2d, state) in enumerate(sets):
            x, y = _operands(x2d, m, layout)
            wid = state.id if ids is None else ids[i]
            calls.append(lambda wid=wid, x=x, y=y: torch.ops.prunekit_cslt.mm(wid, x, y, None, False))
            outs.append(y)
        timed(name, calls, lambda: (calls[0](), outs[0])[1])

    def timed_linear(name: str, output: str | None) -> None:
        """The binding's entry as ``structured.nm_mm_cuda`` calls it, in ``output`` (None: the op's default)."""
        calls = [
            lambda c=c, b=b, x=x: structured.nm_mm_cuda(
                c["values"], c["metadata"], x.t(), 2, 4, b, backend="cslt", output=output
            )
            for _, c, b, x, _ in sets
        ]
        timed(name, calls, calls[0])

    timed("dense", [lambda w=w, x=x: F.linear(x, w) for w, _, _, x, _ in sets])
    try:
        semis = [(to_sparse_semi_structured(w), x) for w, _, _, x, _ in sets]
        timed(
            "torch24",
            [lambda s=s, x=x: F.linear(x, s) for s, x in semis],
            lambda: F.linear(semis[0][1], semis[0][0]).t(),
        )
    except Exception as exc:  # record why the baseline could not run
        res["torch24_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    # torch's own cuSPARSELt call without the tensor subclass, on torch's compressed weight (what F.linear on a
    # to_sparse_semi_structured weight runs): row-major (M, N) output
    packed = [torch._cslt_compress(w) for w, _, _, _, _ in sets]
    timed(
        "torch_cslt_mm",
        [lambda p=p, x=x: torch._cslt_sparse_mm(p, x.t()) for p, (_, _, _, x, _) in zip(packed, sets, strict=True)],
        lambda: torch._cslt_sparse_mm(packed[0], x0.t()),
    )
    # prunekit's binding (plan built once) on torch's compressed bytes: tells a compression difference from a plan one
    ids = [int(torch.ops.prunekit_cslt.prepare_with(w, p)) for p, (w, _, _, _, _) in zip(packed, sets, strict=True)]
    timed_mm("mm_torch_packed", ids=ids)
    for i in ids:
        torch.ops.prunekit_cslt.release(i)
    for layout in LAYOUTS:
        for b_t in ("0", "1"):  # X described as itself (opB = N) or as the transpose of an (N, K) (opB = T)
            with _env("PRUNEKIT_CSLT_B_T", b_t):
                timed_mm(f"mm_{layout}_bt{b_t}", layout)
    timed_linear("linear_view", "view")
    timed_linear("linear", None)
    # W as cuSPARSELt's structured B operand (prepare_b): Y^T (N, M) = X^T (N, K) @ W^T, W described as the (M, K)
    # row-major W with opB = T (``sbT``) or the (K, M) column-major W^T with opB = N (``sbN``); then the entry
    # (``prunekit_cslt::linear``, Y the transposed view of a contiguous (N, M), no copy) on the ``sbT`` weights
    for col in (False, True):
        tag = "sbN" if col else "sbT"
        try:
            ids_b = [int(torch.ops.prunekit_cslt.prepare_b(w, col)) for w, _, _, _, _ in sets]
        except RuntimeError as exc:
            res[f"{tag}_error"] = str(exc).splitlines()[0][:200]
            torch.cuda.synchronize()
            continue
        for layout in ("xc_yc", "xc_yr", "xr_yc"):
            timed_mm(f"{tag}_{layout}", layout, ids=ids_b)
        if not col:
            calls = [
                lambda i=i, x=x: torch.ops.prunekit_cslt.linear(i, x.t(), None, False, 0)
                for i, (_, _, _, x, _) in zip(ids_b, sets, strict=True)
            ]
            timed("sb_linear", calls, calls[0])
        for i in ids_b:
            torch.ops.prunekit_cslt.release(i)
    ys = [torch.randn(m, n, device="cuda", generator=gen).to(dtype) for _ in range(n_sets)]
    outs = [torch.empty(n, m, dtype=dtype, device="cuda") for _ in range(n_sets)]
    timed("copy_t", [lambda o=o, y=y: o.copy_(y.t()) for o, y in zip(outs, ys, strict=True)])
    del ys, outs
    n_algs = args.algs
    if n_algs < 0:  # every configuration id cuSPARSELt offers for this product
        x, y = _operands(sets[0][3], m, args.alg_layout)
        res["max_alg_id"] = int(torch.ops.prunekit_cslt.max_alg_id(sets[0][4].id, x, y))
        n_algs = res["max_alg_id"] + 1
    for env, values, prefix in (
        ("PRUNEKIT_CSLT_ALG", range(n_algs), "alg"),
        ("PRUNEKIT_CSLT_SPLIT_K", (1,), "splitk"),
        ("PRUNEKIT_CSLT_FRESH_PLAN", (1,), "fresh_plan"),
    ):
        for v in values:
            with _env(env, str(v)):
                layout = args.alg_layout if prefix == "alg" else "xc_yr"
                console.print(f"{m}x{k} N={n}: {prefix}{v} ({layout})")  # the last line names a crashing one
                timed_mm(f"{prefix}{v}", layout)
    # split-K factors under each cusparseLtSplitKMode_t value (an integer: the modes differ between versions)
    for mode in [int(v) for v in args.split_k_modes.split(",") if v]:
        for factor in [int(v) for v in args.split_ks.split(",") if v]:
            with _env("PRUNEKIT_CSLT_SPLIT_K_MODE", str(mode)), _env("PRUNEKIT_CSLT_SPLIT_K", str(factor)):
                timed_mm(f"skmode{mode}_sk{factor}")
    for key in [k for k in res if k.endswith("_gpu_ms") and k != "dense_gpu_ms"]:
        res[key.replace("_gpu_ms", "_x_dense")] = res["dense_gpu_ms"] / res[key]
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", default="", help="comma-separated indices into POINTS (default all)")
    parser.add_argument(
        "--algs", type=int, default=8, help="time configuration ids 0 .. ALGS-1 (-1: every id cuSPARSELt offers)"
    )
    parser.add_argument("--alg-layout", default="xc_yr", choices=LAYOUTS, help="operand layouts of the id sweep")
    parser.add_argument("--split-k-modes", default="", help="cusparseLtSplitKMode_t values to time, e.g. 1,2,6")
    parser.add_argument("--split-ks", default="2,4", help="split-K factors timed under each of --split-k-modes")
    parser.add_argument("--max-sets", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("nm_configs.py needs a CUDA GPU")
    structured.load_cslt()
    # configurations are compared against cuSPARSELt's default selection: the binding's own search (on by default)
    # stays off unless $PRUNEKIT_CSLT_TUNE is set
    os.environ.setdefault("PRUNEKIT_CSLT_TUNE", "0")
    points = [POINTS[int(i)] for i in args.points.split(",")] if args.points else POINTS
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, k, n in points:
        rows.append(run_point(m, k, n, torch.float16, args, gen))
        torch.cuda.empty_cache()
        console.print(f"{m}x{k} N={n} done")
    meta = save_rows(args.out, rows)
    names = sorted({k[: -len("_x_dense")] for r in rows for k in r if k.endswith("_x_dense")})
    table = Table(title=f"2:4 configurations, x dense (graph) on {meta['device']} ({meta['date']})")
    table.add_column("M x K, N")
    for name in names:
        table.add_column(name)
    for r in rows:
        table.add_row(
            f"{r['m']}x{r['k']}, {r['n']}",
            *(f"{r[name + '_x_dense']:.2f}" if name + "_x_dense" in r else "-" for name in names),
        )
    console.print(table)


if __name__ == "__main__":
    main()
