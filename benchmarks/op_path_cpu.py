"""Host time of the Python in front of an eager ``ops.spmm_csr`` call (issue 4's target against torch.sparse.mm is
set by host time at small sizes), this tree against another, on the CPU (no GPU needed).

An eager CUDA call of ``ops.spmm_csr`` runs, before its C++ entry: ``ops.eager_direct`` (may the call skip the
custom-op layers?), ``ops._spmm_csr_cuda`` (the CUDA implementation's wrapper) and, inside ``gpu.spmm_csr_op``,
``gpu.spmm_op_entry`` (the decision kept on the weight). This script times those three on CPU tensors: ``eager_direct``
with ``device_type="cpu"`` (the same checks), ``spmm_op_entry`` on a decision already kept, and ``_spmm_csr_cuda`` with
``gpu.spmm_csr_op`` replaced by a no-op (its own cost only). Each in grad mode and under ``inference_mode``, the
minimum over 9 repeats of 20000 calls, us per call.

With ``--base-src PATH`` (another checkout's ``src``) the timings run in child processes that take turns, this tree
and the base, ``--trials`` times each; the JSON keeps every trial and the medians. Writes ``--out`` (JSON).

    python benchmarks/op_path_cpu.py --base-src /tmp/oldtree/src --out benchmarks/results/op-path-cpu-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import timeit
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parent.parent / "src"


def measure() -> dict:
    """The three timings in both modes, us per call (this process's prunekit)."""
    from prunekit.kernels import gpu, ops
    from prunekit.kernels.tensor_cache import cached
    from prunekit.kernels.testing import encode_csr, random_sparse_weight

    torch.manual_seed(0)
    c = encode_csr(random_sparse_weight(768, 3072, 0.9, torch.float16, "cpu"))
    v, ro, ci, ri = c["values"], c["row_offsets"], c["column_indices"], c["row_indices"]
    x = torch.randn(16, 3072).half().t()
    cached(v, gpu.OP_ENTRY_ATTR, (v, ci, ro), None, dict)[(x.dtype, True, 768, 16)] = ("auto", 1)
    gpu.spmm_csr_op = lambda *args: None  # _spmm_csr_cuda's own cost only

    def per_call(f) -> float:
        f()
        return min(timeit.repeat(f, number=20000, repeat=9)) / 20000 * 1e6

    out = {}
    for mode in ("grad", "inference_mode"):
        with torch.inference_mode() if mode == "inference_mode" else torch.enable_grad():
            out[mode] = {
                "eager_direct": per_call(lambda: ops.eager_direct(x, v, ro, ci, ri, None, device_type="cpu")),
                "spmm_op_entry": per_call(lambda: gpu.spmm_op_entry(v, ro, ci, x, 768, None)),
                "_spmm_csr_cuda": per_call(lambda: ops._spmm_csr_cuda(v, ro, ci, ri, x, 768, None, "none")),
            }
            out[mode]["sum"] = sum(out[mode].values())
    return out


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` where that file is missing)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def child(src: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(
        [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True, timeout=600
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON results path")
    parser.add_argument("--base-src", type=Path, help="another checkout's src folder to time against")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    if args.out is None:
        sys.exit("op_path_cpu.py: --out is required")
    if args.base_src is not None and not (args.base_src / "prunekit").is_dir():
        sys.exit(f"op_path_cpu.py: --base-src {args.base_src} holds no prunekit package")
    trees = {"this": SRC} | ({"base": args.base_src} if args.base_src else {})
    trials = {name: [] for name in trees}
    for _ in range(args.trials):
        for name, src in trees.items():
            trials[name].append(child(src))
    medians = {
        name: {mode: {key: statistics.median(t[mode][key] for t in runs) for key in runs[0][mode]} for mode in runs[0]}
        for name, runs in trials.items()
    }
    meta = {
        "device": cpu_name(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "base_src": str(args.base_src) if args.base_src else None,
        "command": "python benchmarks/op_path_cpu.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    args.out.write_text(json.dumps({"meta": meta, "medians": medians, "trials": trials}, indent=1))
    for name, modes in medians.items():
        for mode, keys in modes.items():
            print(name, mode, {k: round(v, 2) for k, v in keys.items()})


if __name__ == "__main__":
    main()
