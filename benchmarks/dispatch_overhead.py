"""Host time of one call through prunekit's custom-op layers, by autograd mode, without any device work.

By default every op is called on ``meta`` tensors, so the dispatcher runs the op's fake implementation and no
kernel or reference computation happens: what is left is the host cost of the layers a user's eager call goes
through (``torch.library.custom_op`` wrapper, the Python autograd kernel custom ops register, dispatch, the fake
impl). ``--device cuda`` calls the real CUDA implementations on tiny inputs (device time negligible, kernels
launched asynchronously; one synchronize per trial).
The same call is timed under grad mode, ``torch.no_grad()`` and ``torch.inference_mode()`` (the runtime's ``run``
uses inference mode), next to ``torch.mm`` on meta tensors as the floor of a C++ op. Wall-clock, median of
several trials of many calls after a warm-up. Runs on any machine (CPU only); the figures depend on the host CPU.

    python benchmarks/dispatch_overhead.py [--device meta|cuda] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from prunekit.kernels import ops

CALLS = 2000
TRIALS = 7


def per_call_us(fn, mode, sync) -> float:
    with mode():
        for _ in range(200):
            fn()
        sync()
        trials = []
        for _ in range(TRIALS):
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            sync()
            trials.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(trials)


def calls(device: str) -> dict[str, callable]:
    m, k, n, nnz = 64, 64, 16, 512
    meta = torch.device(device)
    # valid sparse structures (8 non-zeros per row, 2 blocks per block row), so real kernels can run them too
    values = torch.zeros(nnz, dtype=torch.float16, device=meta)
    row_offsets = torch.arange(0, nnz + 1, nnz // m, dtype=torch.int32).to(meta)
    cols = (torch.arange(nnz) % (nnz // m)).to(torch.int16).to(meta)
    rows = torch.arange(m, dtype=torch.int32).to(meta)
    x = torch.zeros(n, k, dtype=torch.float16, device=meta).t()
    w = torch.zeros(m, k, dtype=torch.float16, device=meta)
    blocks = torch.zeros(8, 16, 16, dtype=torch.float16, device=meta)
    crow = torch.arange(0, 9, 2, dtype=torch.int32).to(meta)
    bcol = torch.tensor([0, 1] * 4, dtype=torch.int32).to(meta)
    return {
        "torch.mm (C++ op, floor)": lambda: torch.mm(w, x),
        "prunekit::spmm_csr (custom op, autograd registered)": lambda: ops.spmm_csr(
            values, row_offsets, cols, rows, x, m
        ),
        "prunekit::bsr_mm (custom op)": lambda: ops.bsr_mm(blocks, crow, bcol, x, m),
        "torch.ops.prunekit.spmm_csr (op overload)": lambda: torch.ops.prunekit.spmm_csr(
            values, row_offsets, cols, rows, x, m
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="meta", choices=["meta", "cuda"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    modes = {"grad": nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = []
    for name, fn in calls(args.device).items():
        rows.append({"call": name, **{f"{mode}_us": per_call_us(fn, ctx, sync) for mode, ctx in modes.items()}})
    table = Table(title=f"host time per call on {args.device} tensors (us, median)")
    table.add_column("call")
    for mode in modes:
        table.add_column(mode, justify="right")
    for r in rows:
        table.add_row(r["call"], *(f"{r[f'{mode}_us']:.1f}" for mode in modes))
    Console().print(table)
    host = "h100" if args.device == "cuda" and "H100" in torch.cuda.get_device_name() else platform.node() or "host"
    date = dt.date.today().isoformat()
    out = args.out or Path(__file__).resolve().parent / "results" / f"dispatch-overhead-{host}-{date}.json"
    payload = {
        "benchmark": "dispatch_overhead",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (meta tensors: no device work)",
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": __import__("os").cpu_count(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "calls_per_trial": CALLS,
        "trials": TRIALS,
        "method": "wall-clock perf_counter, median of trials, 200 warm-up calls",
        "results": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(out)
    Console().print(f"wrote {out}")


if __name__ == "__main__":
    main()
