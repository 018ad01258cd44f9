"""SpMM benchmark (issue 4): prunekit's ``spmm_csr`` vs dense cuBLAS and torch.sparse.mm (CSR), in one run.

For every dtype, weight shape W (M x K), sparsity and N: W is random (i.i.d. N(0,1), each entry zeroed with
probability ``sparsity``), activations are nn.Linear-shaped ``x2d: (N, K)``, and the three contenders compute the
layer output the way a user would call them:

- prunekit: ``ops.spmm_csr(..., x2d.t(), M)`` (the runtime's call; returns the transposed (N, M) output, no copies;
  eagerly its direct call of the CUDA implementation, ``ops.eager_direct``; with ``--op-rounds`` also the registered
  op ``torch.ops.prunekit.spmm_csr`` against it, wall-clock in alternating rounds);
- dense: ``F.linear(x2d, W)`` (cuBLAS);
- torch.sparse: ``torch.sparse.mm(W_csr, x2d.t())`` (cuSPARSE through torch, int64 CSR).

For fp16/bf16 and N <= 16 the run also times the tensor-core decode variant ``scatter`` and the CUDA-core rowwarp as
``auto`` runs it there, X gathered from global memory, and the bitmap decode kernel, all forced (``scatter_gpu_ms``,
``rowwarp_global_gpu_ms``, ``bitmap_gpu_ms``; ``scatter_gbps`` / ``bitmap_gbps`` count the plan's bytes, X and Y once).
For fp16/bf16 and N <= gpu.BITMAP_WIDE_MAX_N it also times the runtime's ``SparseLinear`` eagerly (``layer_eager_ms``,
against F.linear and torch.sparse.mm: ``speedup_layer_vs_dense_eager``, ``speedup_layer_vs_torch_sparse``).
For fp16/bf16 and N > 16 it times the CUDA-core ``direct`` variant and the bitmap kernel (32- or 64-token blocks) forced,
and from N >= TC_BENCH_MIN_N also the tensor-core variant (``variant="tc"``, transposed activations copied to
row-major inside the call, so the copy is timed), and from N >= gpu.DENSE_MIN_N the ``dense`` variant (the weight
decompressed, then cuBLAS; below that N too where ``--forced`` names it, and ``rowwarp`` up to gpu.ROWWARP_MAX_N)
(``direct_gpu_ms``, ``bitmap_gpu_ms``, ``tc_gpu_ms``, ``dense_variant_gpu_ms``), and records the tc plan's statistics (compute fraction, ldmatrix conflict factor,
build time of the plan on the GPU, first call only; later calls reuse the plan cached on the weight), and the dense
variant's decompression alone (``dense_variant_decompress_gpu_ms``; ``dense_variant_decompress_gbps`` counts the
dense buffer written and the CSR read once). (In ``spmm-dense-h100-2026-11-26-s25a.json``, written before these keys,
the variant's time overwrote ``dense_gpu_ms``, cuBLAS's; that file's ``speedup_dense_vs_dense`` is cuBLAS's time over
the variant's.)

Timing (docs/KERNELS.md "Measurement"): CUDA events; ``gpu_ms`` is the median over replays of a CUDA graph of many
calls (device time, no launch gaps), ``eager_ms`` the median over loops of plain eager calls (host overhead included,
what a user sees); torch.sparse.mm is timed eager only. Every measurement rotates over several independent input sets
(W and X) whose total size exceeds twice the L2 where memory allows; ``l2_resident`` flags those that could not.

Writes ``<out>`` (JSON, rewritten after every configuration so a cut-off run keeps its results) and prints a rich table.
Run on the GPU machine: ``PYTHONPATH=src python benchmarks/spmm.py --out benchmarks/results/spmm-h100-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from prunekit import formats
from prunekit.deploy.runtime.sparse_linear import SparseLinear
from prunekit.kernels import build, gpu, ops
from prunekit.kernels.spmm_bitmap_plan import bitmap_bytes, get_bitmap_plan
from prunekit.kernels.spmm_scatter_plan import get_scatter_plan
from prunekit.kernels.spmm_tc_plan import build_tc_plan
from prunekit.kernels.testing import encode_csr, prunekit_settings, random_sparse_weight, relative_error

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bsr import wall_pair  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (768, 3072), (3072, 768)]
NS = [1, 16, 128, 2048, 4096]
SPARSITIES = [0.5, 0.7, 0.8, 0.9, 0.95, 0.98]
DTYPES = ["float16", "bfloat16"]
# H100 ceilings measured on this machine and quoted in issue 4 (2026-11-23): CUDA-core FP32 FMA peak, HBM copy rate.
CUDA_CORE_FP32_TFLOPS = 64.5
HBM_GBPS = 3000.0
MAX_SETS = 16
GRAPH_TARGET_S = 0.02  # device time per graph replay
EAGER_TARGET_S = 0.03
TC_BENCH_MIN_N = 128  # smallest N at which the tensor-core and direct variants are timed forced
# JSON key prefix of a forced variant where its name would clash with a baseline's keys ("dense_gpu_ms" is cuBLAS)
FORCED_KEYS = {"dense": "dense_variant"}

console = Console()


def _ms_between(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def warm_up(seconds: float = 2.0) -> None:
    """Keep the GPU and the host's launch loop busy for ``seconds`` before the first timing. In two runs of the
    thirty-first session the first configuration's eager times, cuBLAS's included, were about twice the later ones' on
    the same shape and N (cuBLAS eager at 4096 x 4096, N = 48: 43.4 us first, 15.9 two configurations later,
    spmm-midn-h100-2026-11-27-s31d.json; N = 32: 39.3 against 19.6, spmm-n32to64-h100-2026-11-27-s31b.json)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(50):
            F.linear(x, a)
        torch.cuda.synchronize()


def eager_time(
    calls: list, min_reps: int = 3, trials: int = 5, target_s: float = EAGER_TARGET_S, inference: bool = True
) -> float:
    """Median per-call ms of loops of eager calls rotating over ``calls`` (host overhead included).

    ``inference`` runs the loops under ``torch.inference_mode()``, as the exported runtime's ``run`` does: it skips
    the Python autograd kernel every ``torch.library.custom_op`` carries (``bench_overhead`` times both modes).
    """
    mode = torch.inference_mode if inference else contextlib.nullcontext
    with mode():
        for c in calls:
            c()
        torch.cuda.synchronize()
        one = _ms_between(calls[0])
        reps = max(min_reps, min(400, int(target_s * 1e3 / max(one, 1e-3))))

        def loop() -> None:
            for i in range(reps):
                calls[i % len(calls)]()

        return statistics.median(_ms_between(loop) / reps for _ in range(trials))


def graph_time(calls: list, replays: int = 7, target_s: float = GRAPH_TARGET_S) -> float:
    """Median per-call ms of replays of a CUDA graph holding many calls rotating over ``calls`` (device time)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
        one = _ms_between(calls[0])
    torch.cuda.current_stream().wait_stream(stream)
    reps = max(len(calls), min(400, int(target_s * 1e3 / max(one, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = [_ms_between(graph.replay) / reps for _ in range(replays)]
    del graph
    return statistics.median(times)


def time_forced(variants: tuple[str, ...], csrs: list, xs: list, m: int, ref: torch.Tensor, dense_gpu: float) -> dict:
    """Each variant forced on the same input sets: ``<variant>_rel_error`` (first set, vs ``ref``), ``<variant>_gpu_ms``
    (CUDA-graph replays, median) and ``speedup_<variant>_vs_dense``."""
    out = {}
    for variant in variants:
        calls = [
            lambda c=c, x=x, v=variant: gpu.spmm_csr(**c, x=x.t(), m=m, variant=v)
            for c, x in zip(csrs, xs, strict=True)
        ]
        key = FORCED_KEYS.get(variant, variant)
        out[f"{key}_rel_error"] = relative_error(calls[0]().t(), ref)
        out[f"{key}_gpu_ms"] = graph_time(calls)
        out[f"speedup_{key}_vs_dense"] = dense_gpu / out[f"{key}_gpu_ms"]
    return out


def bench_config(
    dtype_name: str,
    m: int,
    k: int,
    sparsity: float,
    ns: list[int],
    l2_bytes: int,
    seed: int,
    forced_only: tuple[str, ...] | None = None,
    op_rounds: int = 0,
) -> list:
    dtype = getattr(torch, dtype_name)
    esize = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    probe = random_sparse_weight(m, k, sparsity, dtype, "cuda", gen)
    probe_csr = encode_csr(probe)
    sparse_bytes = sum(t.numel() * t.element_size() for t in probe_csr.values())
    del probe, probe_csr
    max_x_bytes = max(ns) * k * esize
    free_bytes = torch.cuda.mem_get_info()[0]
    set_bytes_all = m * k * esize + sparse_bytes * 3 + max_x_bytes + max(ns) * m * esize * 2
    nsets = max(
        2, min(MAX_SETS, math.ceil(2 * l2_bytes / max(1, sparse_bytes)), int(0.5 * free_bytes // set_bytes_all))
    )
    weights, csrs, torch_csrs = [], [], []
    for _ in range(nsets):
        w = random_sparse_weight(m, k, sparsity, dtype, "cuda", gen)
        weights.append(w)
        csrs.append(encode_csr(w))
        torch_csrs.append(w.to_sparse_csr())
    nnz_real = int((weights[0] != 0).sum())
    nnz_padded = csrs[0]["values"].numel()
    tc_stats = {}
    if dtype in gpu.TC_DTYPES and max(ns) >= TC_BENCH_MIN_N and (forced_only is None or "tc" in forced_only):
        c0 = csrs[0]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tc_plan = build_tc_plan(c0["values"], c0["row_offsets"], c0["column_indices"], m, k)
        torch.cuda.synchronize()
        tc_stats = {
            "tc_plan_build_ms": 1e3 * (time.perf_counter() - t0),
            "tc_compute_fraction": tc_plan.compute_fraction,
            "tc_conflict_factor": tc_plan.conflict_factor,
            "tc_plan_mbytes": tc_plan.nbytes / 1e6,
        }
        del tc_plan
    rows = []
    for n in ns:
        xs = [torch.randn(n, k, generator=gen, device="cuda").to(dtype) for _ in range(nsets)]
        x_bytes = n * k * esize
        l2_resident = nsets * (sparse_bytes + x_bytes) < 2 * l2_bytes

        # Correctness of this very configuration (first set) against the dense product in fp32.
        y = ops.spmm_csr(**csrs[0], x=xs[0].t(), m=m)
        ref = F.linear(xs[0].float(), weights[0].float())
        err = relative_error(y.t(), ref)
        plan = gpu.plan_spmm(
            m, k, n, nnz_padded, torch.cuda.get_device_properties(0).multi_processor_count, "auto", dtype
        )

        ours = [lambda c=c, x=x: ops.spmm_csr(**c, x=x.t(), m=m) for c, x in zip(csrs, xs, strict=True)]
        dense = [lambda w=w, x=x: F.linear(x, w) for w, x in zip(weights, xs, strict=True)]
        ours_gpu = graph_time(ours)
        ours_eager = eager_time(ours)
        if op_rounds:
            # the same call through the registered op (torch.ops.prunekit.spmm_csr: the custom-op layers), against
            # ops.spmm_csr's eager direct call, in alternating rounds of wall-clock loops (bsr.wall_pair)
            via_op = [
                lambda c=c, x=x: torch.ops.prunekit.spmm_csr.default(**c, x=x.t(), m=m)
                for c, x in zip(csrs, xs, strict=True)
            ]
            pair = wall_pair(ours, via_op, op_rounds)
            op_pair = {
                "prunekit_direct_wall_ms": pair["a_ms"],
                "prunekit_op_wall_ms": pair["b_ms"],
                "op_over_direct_wall": pair["b_over_a"],
            }
        else:
            op_pair = {}
        dense_gpu = graph_time(dense)
        dense_eager = eager_time(dense)
        forced = {}
        if dtype in gpu.TC_DTYPES and n > gpu.SCATTER_MAX_N:
            # Wide N: the CUDA-core direct kernel and the bitmap kernel (64-token blocks) forced, and the tensor-core
            # tc kernel from TC_BENCH_MIN_N
            wide = ("tc", "direct", "bitmap") if tc_stats and n >= TC_BENCH_MIN_N else ("direct", "bitmap")
            wide += ("dense",) if n >= gpu.DENSE_MIN_N or "dense" in (forced_only or ()) else ()
            wide += ("rowwarp",) if n <= gpu.ROWWARP_MAX_N and "rowwarp" in (forced_only or ()) else ()  # only asked
            wide = tuple(v for v in wide if forced_only is None or v in forced_only)
            forced.update(time_forced(wide, csrs, xs, m, ref, dense_gpu))
            if "tc" in wide:
                forced.update(tc_stats)
            if "dense" in wide:
                # the dense variant's first step alone: the weight decompressed into its (M, K) scratch buffer
                decompress = [
                    lambda c=c: gpu.csr_to_dense(c["values"], c["row_offsets"], c["column_indices"], m, k) for c in csrs
                ]
                forced["dense_variant_decompress_gpu_ms"] = graph_time(decompress)
                written = m * (-(-k * esize // 16) * 16) + sparse_bytes
                forced["dense_variant_decompress_gbps"] = (
                    written / (forced["dense_variant_decompress_gpu_ms"] * 1e-3) / 1e9
                )
        if dtype in gpu.TC_DTYPES and n <= gpu.SCATTER_MAX_N:
            # Decode: the tensor-core scatter kernel and the CUDA-core rowwarp kernel with X gathered from global
            # memory ("rowwarp_global"), and the bitmap kernel; forced "rowwarp" (X staged in shared memory where it
            # fits) only where --forced names it
            decode = ("scatter", "rowwarp_global", "bitmap") + (
                ("rowwarp",) if "rowwarp" in (forced_only or ()) else ()
            )
            decode = tuple(v for v in decode if forced_only is None or v in forced_only)
            forced.update(time_forced(decode, csrs, xs, m, ref, dense_gpu))
        if "scatter_gpu_ms" in forced:
            strip = gpu.scatter_strip_rows()
            sc = get_scatter_plan(csrs[0]["values"], csrs[0]["row_offsets"], csrs[0]["column_indices"], m, k, strip)
            sc_bytes = sc.nbytes + x_bytes + n * m * esize
            forced["scatter_strip_rows"] = strip
            forced["scatter_kr_groups"] = gpu.scatter_kr_groups(
                m, k, torch.cuda.get_device_properties(0).multi_processor_count, strip
            )
            forced["scatter_plan_mbytes"] = sc.nbytes / 1e6
            forced["scatter_gbps"] = sc_bytes / (forced["scatter_gpu_ms"] * 1e-3) / 1e9
        if "bitmap_gpu_ms" in forced:
            bm = get_bitmap_plan(csrs[0]["values"], csrs[0]["row_offsets"], csrs[0]["column_indices"], m, k)
            forced["bitmap_plan_mbytes"] = bitmap_bytes(bm) / 1e6
            forced["bitmap_slot_words"] = bm.slot_words
            forced["bitmap_gbps"] = (
                (bitmap_bytes(bm) + x_bytes + n * m * esize) / (forced["bitmap_gpu_ms"] * 1e-3) / 1e9
            )
        if dtype in gpu.TC_DTYPES and n <= gpu.BITMAP_WIDE_MAX_N:
            # The runtime's layer, eagerly, as a user calls it: x (N, K) in, Y (N, M) out (its own eager route: the
            # bitmap entry where "auto" takes that kernel, else the generic CSR path); dense_eager_ms is F.linear.
            layers = [SparseLinear(formats.encode("csr", w.cpu())).cuda() for w in weights]
            calls = [lambda layer=layer, x=x: layer(x) for layer, x in zip(layers, xs, strict=True)]
            with torch.inference_mode():
                layer_err = relative_error(calls[0](), ref)
            forced["layer_eager_ms"] = eager_time(calls)
            forced["layer_rel_error"] = layer_err
            forced["speedup_layer_vs_dense_eager"] = dense_eager / forced["layer_eager_ms"]
            del layers, calls
        try:
            tsp = [lambda s=s, x=x: torch.sparse.mm(s, x.t()) for s, x in zip(torch_csrs, xs, strict=True)]
            sparse_eager = eager_time(tsp, min_reps=1, trials=3)
            sparse_error = None
        except RuntimeError as exc:  # e.g. a dtype cuSPARSE does not take
            sparse_eager, sparse_error = None, str(exc).splitlines()[0]
        if "layer_eager_ms" in forced and sparse_eager:
            forced["speedup_layer_vs_torch_sparse"] = sparse_eager / forced["layer_eager_ms"]
        flops = 2.0 * nnz_real * n
        min_bytes = nnz_padded * (esize + csrs[0]["column_indices"].element_size()) + (m + 1) * 4 + x_bytes
        min_bytes += n * m * esize
        rows.append(
            {
                "dtype": dtype_name,
                "m": m,
                "k": k,
                "n": n,
                "sparsity": sparsity,
                "nnz": nnz_real,
                "nnz_padded": nnz_padded,
                "variant": plan.variant,
                "plan": dataclasses.asdict(plan),
                "input_sets": nsets,
                "l2_resident": l2_resident,
                "spmv_kernel": gpu.spmv_takes(
                    m, k, n, esize, gpu._sm_count(torch.device("cuda"))
                ),  # rowwarp: spmv_csr.cu
                "rel_error": err,
                "prunekit_gpu_ms": ours_gpu,
                "prunekit_eager_ms": ours_eager,
                "dense_gpu_ms": dense_gpu,
                "dense_eager_ms": dense_eager,
                "torch_sparse_eager_ms": sparse_eager,
                "torch_sparse_error": sparse_error,
                "speedup_vs_dense": dense_gpu / ours_gpu,
                "speedup_vs_dense_eager": dense_eager / ours_eager,
                "speedup_vs_torch_sparse": (sparse_eager / ours_eager) if sparse_eager else None,
                "nnz_tflops": flops / (ours_gpu * 1e-3) / 1e12,
                "fraction_of_cuda_core_peak": flops / (ours_gpu * 1e-3) / 1e12 / CUDA_CORE_FP32_TFLOPS,
                "min_bytes": min_bytes,
                "gbps": min_bytes / (ours_gpu * 1e-3) / 1e9,
                "fraction_of_hbm": min_bytes / (ours_gpu * 1e-3) / 1e9 / HBM_GBPS,
                **op_pair,
                **forced,
            }
        )
        del xs, ours, dense
    del weights, csrs, torch_csrs
    torch.cuda.empty_cache()
    return rows


def bench_variants(dtype_name: str, m: int, k: int, sparsity: float, ns: list[int], seed: int) -> list:
    """Device time of each SpMM variant forced, for tuning ``gpu.plan_spmm`` (``auto`` included)."""
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nsets = 4
    csrs = [encode_csr(random_sparse_weight(m, k, sparsity, dtype, "cuda", gen)) for _ in range(nsets)]
    rows = []
    for n in ns:
        xs = [torch.randn(n, k, generator=gen, device="cuda").to(dtype) for _ in range(nsets)]
        row = {"dtype": dtype_name, "m": m, "k": k, "n": n, "sparsity": sparsity}
        variants = ["auto", "rowwarp", "rowwarp_global", "direct", "tiled"]
        if dtype in gpu.TC_DTYPES:
            variants.append("tc")
        for variant in variants:
            calls = [
                lambda c=c, x=x, v=variant: gpu.spmm_csr(**c, x=x.t(), m=m, variant=v)
                for c, x in zip(csrs, xs, strict=True)
            ]
            row[f"{variant}_gpu_ms"] = graph_time(calls)
        row["auto_variant"] = gpu.plan_spmm(m, k, n, csrs[0]["values"].numel(), 132, "auto", dtype).variant
        rows.append(row)
    return rows


def bench_overhead(dtype_name: str = "float16") -> list:
    """Per-call eager time of each layer of the call path on a tiny problem (device time negligible): host overhead."""
    dtype = getattr(torch, dtype_name)
    m = k = 256
    w_sparse = random_sparse_weight(m, k, 0.9, dtype, "cuda")
    csr = encode_csr(w_sparse)
    layer = SparseLinear(formats.encode("csr", w_sparse.cpu()), None).to("cuda")  # the runtime's layer
    x2d = torch.randn(1, k, device="cuda").to(dtype)
    x = x2d.t()
    y = torch.empty(m, 1, dtype=dtype, device="cuda")
    args = (csr["values"], csr["row_offsets"], csr["column_indices"], csr["row_indices"], x, m)
    plan = gpu.plan_spmm(m, k, 1, csr["values"].numel())
    raw = torch.ops.prunekit_ext.spmm_csr_rowwarp.default
    entry = torch.ops.prunekit_ext.spmm_csr_auto.default  # the runtime's eager CSR call with $PRUNEKIT_SPMM_CPP=1
    w = torch.randn(m, k, device="cuda").to(dtype)
    paths = {
        "ops.spmm_csr (custom_op wrapper)": lambda: ops.spmm_csr(*args),
        "torch.ops.prunekit.spmm_csr.default": lambda: torch.ops.prunekit.spmm_csr.default(*args),
        "gpu.spmm_csr (launcher, no dispatcher)": lambda: gpu.spmm_csr(*args),
        "torch.ops.prunekit_ext.spmm_csr_rowwarp (kernel op, preallocated out)": lambda: raw(
            *args[:5], y, None, False, plan.subwarp, plan.ntile, plan.stage_x
        ),
        "torch.ops.prunekit_ext.spmm_csr_auto (C++ eager entry, allocates Y)": lambda: entry(*args, None, False, 0),
        "SparseLinear (runtime layer, x (1, K))": lambda: layer(x2d),
        "F.linear (dense cuBLAS, same shape)": lambda: F.linear(x2d, w),
    }
    return [
        {
            "path": name,
            "eager_us": 1e3 * eager_time([fn], min_reps=200, trials=7),
            "eager_grad_mode_us": 1e3 * eager_time([fn], min_reps=200, trials=7, inference=False),
        }
        for name, fn in paths.items()
    ]


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "kernel_build_key": build.current_key()[:16],
        # e.g. $PRUNEKIT_NM24_LEAN=1: the bitmap calls at N <= 16 on the lean decode kernel
        "env": prunekit_settings(),
        "method": "CUDA events; gpu_ms = median of CUDA-graph replays, eager_ms = median of eager loops under "
        "torch.inference_mode (as the runtime's run); inputs rotated over input_sets independent (W, X) sets",
    }


def render(rows: list, title: str) -> None:
    table = Table(title=title)
    for col in (
        "dtype",
        "W",
        "N",
        "sp",
        "variant",
        "ours ms",
        "dense ms",
        "vs dense",
        "tc vs dense",
        "bitmap vs dense",
        "vs t.sparse",
        "TFLOP/s",
        "GB/s",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        vs_sparse = r["speedup_vs_torch_sparse"]
        table.add_row(
            r["dtype"],
            f"{r['m']}x{r['k']}",
            str(r["n"]),
            f"{r['sparsity']:.2f}",
            r["variant"],
            f"{r['prunekit_gpu_ms']:.4f}",
            f"{r['dense_gpu_ms']:.4f}",
            f"{r['speedup_vs_dense']:.2f}x",
            f"{r['speedup_tc_vs_dense']:.2f}x" if "speedup_tc_vs_dense" in r else "-",
            f"{r['speedup_bitmap_vs_dense']:.2f}x" if "speedup_bitmap_vs_dense" in r else "-",
            f"{vs_sparse:.1f}x" if vs_sparse else "-",
            f"{r['nnz_tflops']:.1f}",
            f"{r['gbps']:.0f}",
        )
    console.print(table)


def write_json(path: Path, result: dict) -> None:
    """Write ``result`` to ``path`` atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--shapes", default=",".join(f"{m}x{k}" for m, k in SHAPES))
    parser.add_argument("--ns", default=",".join(map(str, NS)))
    parser.add_argument("--sparsities", default=",".join(map(str, SPARSITIES)))
    parser.add_argument("--variants", action="store_true", help="time each SpMM variant forced instead")
    parser.add_argument("--overhead", action="store_true", help="also measure the host overhead of each call layer")
    parser.add_argument(
        "--op-rounds",
        type=int,
        default=0,
        help="also time ops.spmm_csr's eager call against the registered op (torch.ops.prunekit.spmm_csr) in this "
        "many alternating rounds (prunekit_direct_wall_ms, prunekit_op_wall_ms, op_over_direct_wall)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="only run the first dtype/shape/sparsity/N 5 times (for ncu), no timing"
    )
    parser.add_argument("--time-budget-s", type=float, default=float("inf"), help="start no config after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--forced", default="", help="comma-separated variants to time forced (default: all of tc, direct, bitmap, ...)"
    )
    args = parser.parse_args()
    forced_only = tuple(args.forced.split(",")) if args.forced else None

    build.load()
    if not args.profile:
        warm_up()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ns = [int(v) for v in args.ns.split(",")]
    sparsities = [float(v) for v in args.sparsities.split(",")]
    dtypes = args.dtypes.split(",")
    if args.profile:
        (m, k), n, dtype = shapes[0], ns[0], getattr(torch, dtypes[0])
        csr = encode_csr(random_sparse_weight(m, k, sparsities[0], dtype, "cuda"))
        x2d = torch.randn(n, k, device="cuda").to(dtype)
        for _ in range(5):
            ops.spmm_csr(**csr, x=x2d.t(), m=m)
        torch.cuda.synchronize()
        console.print(
            f"profiled {dtypes[0]} {m}x{k} N={n} sparsity={sparsities[0]}: {gpu.plan_spmm(m, k, n, csr['values'].numel(), 132, 'auto', dtype)}"
        )
        return
    env = environment()
    l2 = env["l2_bytes"] or 50 * 2**20
    result = {"environment": env, "rows": [], "skipped": []}
    if args.overhead:
        result["overhead"] = bench_overhead()
        for r in result["overhead"]:
            console.print(f"host overhead: {r['path']}: {r['eager_us']:.1f} us/call")
    started = time.monotonic()
    configs = [(d, m, k, s) for d in dtypes for (m, k) in shapes for s in sparsities]
    for i, (dtype_name, m, k, sparsity) in enumerate(configs):
        if time.monotonic() - started > args.time_budget_s:
            result["skipped"].append({"dtype": dtype_name, "m": m, "k": k, "sparsity": sparsity, "ns": ns})
            continue
        t0 = time.monotonic()
        if args.variants:
            rows = bench_variants(dtype_name, m, k, sparsity, ns, args.seed + i)
        else:
            rows = bench_config(dtype_name, m, k, sparsity, ns, l2, args.seed + i, forced_only, args.op_rounds)
        result["rows"].extend(rows)
        result["elapsed_s"] = time.monotonic() - started
        write_json(args.out, result)
        console.print(
            f"[{i + 1}/{len(configs)}] {dtype_name} {m}x{k} sp={sparsity} done in {time.monotonic() - t0:.1f}s"
        )
        if args.variants:
            for r in rows:
                console.print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}))
    if not args.variants:
        render(result["rows"], f"prunekit spmm_csr on {env['device']} (torch {env['torch']}, {env['date_utc']})")
    if result["skipped"]:
        write_json(args.out, result)  # the skipped list too: nothing was written after the last measured one
        console.print(f"[yellow]{len(result['skipped'])} configurations skipped by the time budget[/yellow]")


if __name__ == "__main__":
    main()
