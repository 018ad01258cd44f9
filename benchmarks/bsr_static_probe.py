"""Why a static BSR call can take longer than the dynamic one on the same pattern (twenty-seventh session probe).

Builds one random block pattern (benchmarks/bsr.py's block_weight; with --heavy-rows, a few block rows made dense),
then times with CUDA graphs (bsr.py's graph_time, two rounds in turn) and lists the kernels (torch.profiler: name and
device time) of: dynamic mode; the stored schedule; a schedule in block-row order; every block row one item, unsplit;
the stored schedule and dynamic mode through the C++ eager entry. Writes --out (JSON, with device, torch version and
date) and prints one summary line. Usage (GPU machine, repository root, after scripts/gpu_env.sh):

    python benchmarks/bsr_static_probe.py --m 11008 --k 4096 --n 128 --block 64 --sparsity 0.95 --out probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bsr as bench  # noqa: E402

from prunekit import formats  # noqa: E402
from prunekit.formats.bsr import static_schedule  # noqa: E402
from prunekit.kernels import structured  # noqa: E402


def kernels_of(fn) -> list[dict]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], record_shapes=False) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(e, "device_time", None)
            out.append({"name": e.name[:90], "us": round(us if us is not None else e.cuda_time, 2)})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=11008)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--sparsity", type=float, default=0.95)
    p.add_argument("--heavy-rows", type=int, default=0, help="block rows made dense over their first --heavy-blocks")
    p.add_argument("--heavy-blocks", type=int, default=0)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    structured.load()
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, k, n, r = a.m, a.k, a.n, a.block
    w, c = bench.block_weight(m, k, r, r, a.sparsity, torch.float16, gen)
    if a.heavy_rows:  # a skewed pattern: a few block rows far longer than the rest (the static schedule's case)
        w = w.clone()
        rows_at = torch.linspace(0, m // r - 1, a.heavy_rows).long().tolist()
        for br in rows_at:
            w[br * r : (br + 1) * r, : a.heavy_blocks * r] = torch.randn(r, a.heavy_blocks * r, device="cuda").half()
        comp = formats.encode("bsr", w.cpu(), {"block_rows": r, "block_cols": r}).components
        c = {key: t.cuda() for key, t in comp.items()}
    x2d = torch.randn(n, k, device="cuda", dtype=torch.float16)
    x = x2d.t()
    crow = c["crow_indices"]
    row_sched, row_split = (t.cuda() for t in static_schedule(crow.cpu(), None, "row"))
    rows = crow.numel() - 1
    natural = torch.stack(
        [torch.arange(rows, device="cuda", dtype=torch.int32), crow[:-1], crow[1:], torch.full_like(crow[1:], -1)], 1
    ).contiguous()
    base = (c["blocks"], crow, c["col_indices"], x, m)
    calls = {
        "dynamic": lambda: structured.bsr_mm_cuda(*base),
        "stored": lambda: structured.bsr_mm_cuda(*base, None, "none", c["schedule"], c["split_rows"]),
        "row": lambda: structured.bsr_mm_cuda(*base, None, "none", row_sched, row_split),
        "natural_unsplit": lambda: structured.bsr_mm_cuda(
            *base, None, "none", natural, torch.empty(0, dtype=torch.int32, device="cuda")
        ),
        "eager_stored": lambda: structured.bsr_mm_eager(*base, None, "none", c["schedule"], c["split_rows"]),
        "eager_dynamic": lambda: structured.bsr_mm_eager(*base),
    }
    ref = (w.float() @ x.float()).half()
    counts = (crow[1:] - crow[:-1]).cpu()
    res = {"m": m, "k": k, "n": n, "block": r, "sparsity": a.sparsity, "split_rows": int(c["split_rows"].numel()),
           "heavy_rows": a.heavy_rows, "heavy_blocks": a.heavy_blocks, "longest_row": int(counts.max()),
           "median_row": float(counts.double().median()), "schedule_items": int(c["schedule"].shape[0])}  # fmt: skip
    for rnd in range(2):  # two rounds, in turn: drift shows as a difference between them
        for name, fn in calls.items():
            y = fn()
            res.setdefault(f"{name}_err", bench.relative_error(y, ref))
            res[f"{name}_gpu_ms_round{rnd}"] = bench.graph_time([fn])
    for name, fn in calls.items():
        res[f"{name}_kernels"] = kernels_of(fn)
    res["meta"] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": "median of CUDA-graph replays (benchmarks/bsr.py graph_time), faster of two rounds in the summary",
        "argv": sys.argv[1:],
    }
    text = json.dumps(res, indent=1)
    if a.out:
        a.out.write_text(text)
    else:
        print(text)
    best = {name: 1e3 * min(res[f"{name}_gpu_ms_round0"], res[f"{name}_gpu_ms_round1"]) for name in calls}
    print(
        f"{m} {k} N {n} b {r} {a.sparsity} heavy {a.heavy_rows} x {a.heavy_blocks} longest {res['longest_row']} "
        f"median {res['median_row']} split {res['split_rows']} | stored {best['stored']:.1f} "
        f"unsplit {best['natural_unsplit']:.1f} dynamic {best['dynamic']:.1f} eager_stored {best['eager_stored']:.1f}"
    )


if __name__ == "__main__":
    main()
