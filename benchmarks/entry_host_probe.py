"""Host time per eager ``SparseLinear`` call, this tree's fast-call module against a base copy, in one process.

Issue 5 bounds the eager overhead of a BSR layer at 10 us, and at small kernels the host time of a call sets it. This
probe times changes to that host time side by side, on the same weights and inputs, the candidates taking turns within
every trial (``layer_host.interleaved``; host = perf_counter around a burst shorter than the launch queue):

- ``layer``: ``SparseLinear(x)`` with this tree's fast-call module (``csrc/fastcall/fastcall.cpp``), in grad mode (as
  ``bsr.py`` times it) and inside ``torch.inference_mode()``;
- ``layer, base module``: the same layer with its C++ entries taken from a second build of the fast-call module from
  the source file ``--base-fastcall`` (e.g. ``git show REV:src/prunekit/kernels/csrc/fastcall/fastcall.cpp``), loaded
  under another name beside this tree's: the two modules call the same operators, so the difference is the module's;
- for BSR layers on the wgmma kernel, ``layer, PRUNEKIT_BSR_MAP_CACHE=0``: the launcher encodes both TMA maps at every
  call instead of taking them from its per-thread memo (``csrc/structured/bsr_mm_wgmma.cu``, ``make_map``);
- ``kernel``: the layer's device time (median over replays of a CUDA graph, ``bsr.graph_time``).

Points (fp16): BSR with 64 / 32 / 16-row blocks at 3072 x 768, N = 128 and 90% (the small-kernel points where the
eager overhead exceeded 10 us in ``bsr-final-h100-2026-11-27-s37c.json``), BSR with 32-row blocks at 4096 x 4096, N =
16 (the lean kernel: no TMA maps), CSR at 4096 x 4096, N = 1 and 16 (``spmm_csr_auto`` and ``bitmap_linear``) and 2:4
at 4096 x 4096, N = 16 (``linear``). Prints a table and writes ``--out`` JSON (device, torch version, date).

    PYTHONPATH=src python benchmarks/entry_host_probe.py --out benchmarks/results/entry-host-<dev>-<date>.json \\
        --base-fastcall ab_base/fastcall.cpp [--trials 21]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bsr import graph_time  # noqa: E402
from layer_host import env_set, interleaved, weight  # noqa: E402

from prunekit import formats  # noqa: E402
from prunekit.deploy.runtime.sparse_linear import SparseLinear  # noqa: E402
from prunekit.kernels import fastcall  # noqa: E402

POINTS = [  # (format, M, K, N, block or None)
    ("bsr", 3072, 768, 128, 64),
    ("bsr", 3072, 768, 128, 32),
    ("bsr", 3072, 768, 128, 16),
    ("bsr", 4096, 4096, 16, 32),
    ("csr", 4096, 4096, 1, None),
    ("csr", 4096, 4096, 16, None),
    ("nm", 4096, 4096, 16, None),
]
MAP_CACHE_ENV = "PRUNEKIT_BSR_MAP_CACHE"


def load_base(source: Path):
    """The fast-call module built from ``source`` under a name of its own (``prunekit_fastcall_base_<hash>``), in the
    kernel cache (``fastcall._build``)."""
    name = "prunekit_fastcall_base_" + hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    return fastcall._build(name, source)[0]


def make_layer(enc, x: torch.Tensor, module=None) -> SparseLinear:
    """``SparseLinear(enc)`` on the GPU, its eager decisions made on ``x``: with ``module``, the C++ entries it keeps
    are that module's functions (``fastcall.entry`` hands them out while it decides)."""
    layer = SparseLinear(enc).cuda()
    if module is None:
        layer(x)
        return layer
    saved = dict(fastcall._fast)
    fastcall._fast.update({name: getattr(module, name) for name in fastcall.ENTRIES})
    try:
        layer(x)
    finally:
        fastcall._fast.clear()
        fastcall._fast.update(saved)
    return layer


def probe_point(fmt: str, m: int, k: int, n: int, block: int | None, base, gen, trials: int) -> dict:
    w = weight(fmt, m, k, 0.9, block or 32, gen)
    params = {"block_rows": block, "block_cols": block} if fmt == "bsr" else {"n": 2, "m": 4} if fmt == "nm" else {}
    enc = formats.encode(fmt, w.cpu(), params)
    x = torch.randn(n, k, device="cuda", generator=gen).half()
    layer = make_layer(enc, x)
    calls = {"layer": [lambda: layer(x)]}
    contexts = {}
    if base is not None:
        base_layer = make_layer(enc, x, base)
        calls["layer, base module"] = [lambda: base_layer(x)]
    calls["layer, inference_mode"] = calls["layer"]
    contexts["layer, inference_mode"] = torch.inference_mode
    if base is not None:
        calls["layer, base module, inference_mode"] = calls["layer, base module"]
        contexts["layer, base module, inference_mode"] = torch.inference_mode
    encodes_maps = fmt == "bsr" and n > 32  # the wgmma kernel (the lean kernel takes N <= 32 and encodes no map)
    if encodes_maps:
        calls[f"layer, {MAP_CACHE_ENV}=0"] = calls["layer"]
        contexts[f"layer, {MAP_CACHE_ENV}=0"] = lambda: env_set({MAP_CACHE_ENV: "0"})
    res = {"format": fmt, "m": m, "k": k, "n": n, "block": block, "sparsity": 0.9}
    res["kernel_us"] = 1e3 * graph_time(calls["layer"])
    res["rows"] = interleaved(calls, trials, contexts=contexts)
    ref = layer(x).float()
    if base is not None:
        res["base_max_abs_diff"] = float((base_layer(x).float() - ref).abs().max())
    if encodes_maps:
        with env_set({MAP_CACHE_ENV: "0"}):
            res["no_map_cache_max_abs_diff"] = float((layer(x).float() - ref).abs().max())
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--base-fastcall", type=Path, help="fastcall.cpp of the base tree (else no base rows)")
    parser.add_argument("--trials", type=int, default=21)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: entry_host_probe.py needs a CUDA GPU")
    if fastcall.load() is None:
        sys.exit("error: this tree's fast-call module did not load")
    base = load_base(args.base_fastcall) if args.base_fastcall else None
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    results = []
    console = Console()
    for fmt, m, k, n, block in POINTS:
        res = probe_point(fmt, m, k, n, block, base, gen, args.trials)
        results.append(res)
        t = Table(title=f"{fmt} {m}x{k} N={n}" + (f" block {block}" if block else "") + ", host us per eager call")
        for col in ("call", "host us", "host min", "wall us"):
            t.add_column(col, justify="right")
        for name, r in res["rows"].items():
            t.add_row(name, f"{r['host_us']:.2f}", f"{r['host_min_us']:.2f}", f"{r['wall_us']:.2f}")
        console.print(t)
        console.print(f"kernel {res['kernel_us']:.2f} us")
    out = {
        "meta": {
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(),
            "command": " ".join(sys.argv),
            "base_fastcall": str(args.base_fastcall) if args.base_fastcall else None,
            "trials": args.trials,
            "timing": "layer_host.interleaved: host = perf_counter around a burst of 100 calls, the GPU not waited "
            "for; wall = the same with a synchronize before and after; median and min over trials, candidates in turn",
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(args.out)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
