"""Host time of one eager ``spmm_csr`` call with the ``dense`` variant, split into its steps (issue 4's target against
torch.sparse.mm at N >= 128, eager).

At N = 128 on the small shapes the ``dense`` variant's kernels take 7-11 us, but an eager ``ops.spmm_csr`` call cost
32-61 us of wall time in ``spmm-tsparse-h100-2026-11-27-s39.json`` (``F.linear``: 14-23 us), so the host decides
whether it is 10x faster than ``torch.sparse.mm``. For each point this script times, per call and on the host only
(``bsr.host_time_us``: a burst of calls shorter than the launch queue, then one synchronize, median of trials):

- ``op``: ``ops.spmm_csr(**csr, x=x2d.t(), m=M)`` (its eager direct call; ``variant`` in the JSON is what it runs);
- ``entry``: the C++ entry it reaches, ``fastcall.entry("spmm_csr_auto")`` with the op's cached variant code (no
  Python checks or lookups);
- ``csr_to_dense``: the decompression alone (``gpu.csr_to_dense``, its own C++ entry: allocation and one launch);
- ``mm``: ``torch.mm(x2d, w_dense.t())``, the GEMM step alone as ATen runs it;
- ``linear``: ``F.linear(x2d, W)`` on the dense weight (cuBLAS; what the dense layer costs);
- ``layer``: ``SparseLinear(x2d)`` on the same weight;
- ``empty``: ``torch.empty`` of the output's size (the floor of any call that allocates its result).

It also writes the top of a ``torch.profiler`` table (CPU time per ATen / CUDA runtime call) of ``--profile-calls``
``op`` calls at the first point. Run on the GPU machine:
``PYTHONPATH=src python benchmarks/dense_host_probe.py --out benchmarks/results/dense-host-h100-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bsr import host_time_us  # noqa: E402
from nm24_sweep import run_meta  # noqa: E402

from prunekit import formats  # noqa: E402
from prunekit.deploy.runtime.sparse_linear import SparseLinear  # noqa: E402
from prunekit.kernels import fastcall, gpu, ops  # noqa: E402
from prunekit.kernels.testing import encode_csr, random_sparse_weight  # noqa: E402

DEFAULT_POINTS = "768x3072:128:0.9,3072x768:128:0.9,4096x4096:128:0.9,768x3072:16:0.9"


def run_point(m: int, k: int, n: int, sparsity: float, trials: int, gen: torch.Generator) -> dict:
    w = random_sparse_weight(m, k, sparsity, torch.float16, "cuda", gen)
    csr = encode_csr(w)
    x2d = torch.randn(n, k, device="cuda", generator=gen).half()
    layer = SparseLinear(formats.encode("csr", w.cpu())).cuda()
    calls = {"op": lambda: ops.spmm_csr(**csr, x=x2d.t(), m=m)}
    kind, plan = gpu.spmm_op_entry(csr["values"], csr["row_offsets"], csr["column_indices"], x2d.t(), m)
    res = {"m": m, "k": k, "n": n, "sparsity": sparsity, "entry_kind": kind}
    if kind == "auto" and plan is not None:
        res["variant_code"] = plan
        entry = fastcall.entry("spmm_csr_auto")
        calls["entry"] = lambda: entry(
            csr["values"], csr["row_offsets"], csr["column_indices"], csr["row_indices"], x2d.t(), m, None, False, plan
        )
    calls["csr_to_dense"] = lambda: gpu.csr_to_dense(csr["values"], csr["row_offsets"], csr["column_indices"], m, k)
    w_dense = w.contiguous()
    calls["mm"] = lambda: torch.mm(x2d, w_dense.t())
    calls["linear"] = lambda: F.linear(x2d, w)
    calls["layer"] = lambda: layer(x2d)
    calls["empty"] = lambda: torch.empty(n, m, device="cuda", dtype=torch.float16)
    res["variant"] = gpu.plan_spmm(m, k, n, csr["values"].numel(), gpu._sm_count(x2d.device), "auto", x2d.dtype).variant
    with torch.inference_mode():
        for name, call in calls.items():
            res[f"{name}_host_us"] = host_time_us([call], trials=trials)
    return res


def profile_table(m: int, k: int, n: int, sparsity: float, calls: int, gen: torch.Generator) -> str:
    """``torch.profiler``'s CPU table (self CPU time, top rows) over ``calls`` eager ``ops.spmm_csr`` calls."""
    w = random_sparse_weight(m, k, sparsity, torch.float16, "cuda", gen)
    csr = encode_csr(w)
    x = torch.randn(n, k, device="cuda", generator=gen).half().t()
    with torch.inference_mode():
        for _ in range(10):
            ops.spmm_csr(**csr, x=x, m=m)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                ops.spmm_csr(**csr, x=x, m=m)
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--points", default=DEFAULT_POINTS, help="MxK:N:sparsity, comma-separated")
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--profile-calls", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("dense_host_probe.py: no CUDA device")
    try:
        points = []
        for item in args.points.split(","):
            shape, n, sparsity = item.split(":")
            m, k = (int(v) for v in shape.lower().split("x"))
            points.append((m, k, int(n), float(sparsity)))
    except ValueError:
        sys.exit(f"dense_host_probe.py: bad --points {args.points!r}: expected MxK:N:sparsity items")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    results = [run_point(*p, args.trials, gen) for p in points]
    table = profile_table(*points[0], args.profile_calls, gen)
    meta = run_meta() | {"command": "PYTHONPATH=src python benchmarks/dense_host_probe.py " + " ".join(sys.argv[1:])}
    args.out.write_text(json.dumps({"meta": meta, "results": results, "profile": table}, indent=1))
    for r in results:
        print({key: round(v, 2) if isinstance(v, float) else v for key, v in r.items()})
    print(table)


if __name__ == "__main__":
    main()
