"""Where the device time of one CSR decode call goes (GPU): the custom op against the runtime's layer, beside dense.

For each point (M x K, N, sparsity) it builds independent weight/input sets as ``benchmarks/layer_host.py`` does,
then prints and saves (``--out`` JSON):

- the graph-replayed device time per call (``bsr.graph_time``) of ``ops.spmm_csr(..., x.t(), M)`` (what
  ``benchmarks/spmm.py`` reports as ``prunekit_gpu_ms``) and of ``SparseLinear(x)`` (``layer_host.py``'s
  ``kernel_us``), both under ``torch.inference_mode``, and of dense cuBLAS (``F.linear`` on the same weights);
- torch.profiler's CUDA kernels of 50 eager calls of each: name, launches per call and device us per launch.

It explains the figures of ``spmm.py`` and ``layer_host.py`` kernel by kernel. Run from the repository root on the GPU
machine:

    PYTHONPATH=src python benchmarks/csr_decode_profile.py --out /tmp/csr-decode-profile.json \
        [--points 11008x4096x16x0.98,4096x11008x16x0.98]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bsr import graph_time  # noqa: E402
from nm24_sweep import run_meta  # noqa: E402

from prunekit import formats  # noqa: E402
from prunekit.deploy.runtime.sparse_linear import SparseLinear  # noqa: E402
from prunekit.kernels import ops  # noqa: E402

N_SETS = 8


def kernels(fn, calls: int = 50) -> list[dict]:
    """The CUDA kernels of ``calls`` eager calls of ``fn``: name, launches per call, device us per launch."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None)
        if total is None:
            total = e.cuda_time_total
        if total <= 0 or e.key.startswith("cuda"):
            continue
        out.append({"kernel": e.key[:120], "per_call": e.count / calls, "us_per_launch": total / max(1, e.count)})
    return sorted(out, key=lambda r: -r["us_per_launch"] * r["per_call"])


def run_point(m: int, k: int, n: int, sparsity: float, gen: torch.Generator) -> dict:
    sets = []
    for _ in range(N_SETS):
        w = torch.randn(m, k, device="cuda", generator=gen)
        w = (w * (torch.rand(m, k, device="cuda", generator=gen) >= sparsity)).half()
        enc = formats.encode("csr", w.cpu())
        csr = {name: t.cuda() for name, t in enc.components.items()}
        x2d = torch.randn(n, k, device="cuda", generator=gen).half()
        sets.append((csr, SparseLinear(enc).cuda(), x2d, w))
    res = {"m": m, "k": k, "n": n, "sparsity": sparsity, "n_sets": N_SETS}
    with torch.inference_mode():
        op_calls = [lambda s=s: ops.spmm_csr(**s[0], x=s[2].t(), m=m) for s in sets]
        layer_calls = [lambda s=s: s[1](s[2]) for s in sets]
        ref = op_calls[0]().t().float()
        res["layer_matches_op"] = float((layer_calls[0]().float() - ref).abs().max())
        res["op_graph_us"] = 1e3 * graph_time(op_calls)
        res["layer_graph_us"] = 1e3 * graph_time(layer_calls)
        res["dense_graph_us"] = 1e3 * graph_time([lambda s=s: F.linear(s[2], s[3]) for s in sets])
        res["op_kernels"] = kernels(op_calls[0])
        res["layer_kernels"] = kernels(layer_calls[0])
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", default="11008x4096x16x0.98,4096x11008x16x0.98,4096x4096x16x0.98")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for point in args.points.split(","):
        m, k, n, sp = point.split("x")
        r = run_point(int(m), int(k), int(n), float(sp), gen)
        results.append(r)
        print(
            f"{m}x{k} N={n} sp={sp}: op graph {r['op_graph_us']:.2f} us, layer graph {r['layer_graph_us']:.2f} us, "
            f"dense (cuBLAS) graph {r['dense_graph_us']:.2f} us"
        )
        for name in ("op_kernels", "layer_kernels"):
            for kr in r[name]:
                print(f"  {name[:-8]:5s} {kr['per_call']:.2f} x {kr['us_per_launch']:8.2f} us  {kr['kernel']}")
    meta = run_meta()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
