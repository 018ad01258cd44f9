"""Kronecker-sparse matmul benchmark (issue 8; the sweep of Gonon et al. 2024, arXiv 2405.15013, section 5).

For each pattern (a, b, c, d) of a fixed subsample of the paper's 728 patterns (``benchmarks/ks_subsample.txt``;
how it is drawn: :func:`draw_subsample`), batch N = 25088, fp32 and fp16, batch-last (X: (a*c*d, N) row-major) and
batch-first (x2d: (N, a*c*d) row-major; the op reads X = x2d.t() in place), it times Y = K X with:

- prunekit ``kernels.ks.ks_mm_cuda``: fp16 every tensor-core variant (``tile64_simple``, ``tile64_pipe``,
  ``tile128_simple``, ``tile128_pipe``: 64/128 rows of b per CTA, one or two shared-memory stages), fp32 the
  CUDA-core kernel (``f32``). ``prunekit`` is what ``ks_mm_cuda``'s defaults run (what a user gets:
  ``ks.pick_variant``'s tile variant, the delta-block kernel ``dblock`` where ``ks.pick_delta_block`` says so, and
  for d = 1 ``cublas``, i.e. ``ks.block_diagonal_mm``),
  ``prunekit_best`` the fastest variant (what a measured table could reach);
- ``bmm``: Monarch-style permute X to (a*d, c, N) + bmm + permute back (copies included);
- ``einsum``: ``torch.einsum`` on the (a, d, b, c) blocks and the viewed X;
- ``dense``: cuBLAS on the dense (a*b*d, a*c*d) K (fp32 without TF32);
- ``bsr``: torch BSR, only when d == 1 (K is then block-diagonal), square blocks of gcd(b, c) as the authors did;
- ``csr``: torch sparse CSR (built from the blocks, never through a dense K);
- ``authors``: the authors' kernel (PascalCarrivain/ksmm, ``src/ksmm_py/layer/kronecker_sparse``), built from
  their public sources in the git-ignored ``.carry/ksmm/`` (never committed) as a benchmark-only baseline, with the
  tile sizes of their own tuning files (``*.best``, batch 25088, VSIZE 4 else 2) for every pattern at once: one
  extension, one generated dispatch per (layout, precision) split over several translation units so that the
  build runs in parallel (:func:`build_authors`). Patterns their tuning files lack are recorded as such.

Every baseline runs in its own ``try``: a failure (e.g. an unsupported layout) is recorded with its message, the run
goes on. A baseline whose estimated call time exceeds ``--max-call-ms`` (only dense and CSR on the largest
patterns) is skipped, with the estimate recorded.

Correctness: every prunekit variant writes into an output poisoned with NaN first, the authors' kernel (it allocates
its own output) gets a NaN-filled block freed to torch's caching allocator just before, and each output is compared
with a float64 einsum on the GPU (relative Frobenius error; ``correct``: every prunekit variant under the dtype's
tolerance).

Timing: CUDA events around each call after warm-up, median of up to 10 calls (at least 3, about 40 ms per
contender; a contender over 100 ms per call is timed once after one warm-up); before each timed call a 256 MB
scratch buffer is overwritten (outside the events), so no call finds its inputs in the 50 MB L2. Two savings keep
the sweep within its device time: cuBLAS does not look at the values, so ``dense`` is timed once per (M, K, dtype,
layout) and reused by every pattern of that shape (the row's ``dense_timed_on`` names the pattern it was timed
on, also across parts and resumed runs of the same date); ``csr`` (reported, not in the target's baseline set) is
timed once after one warm-up and skipped above ``--max-csr-ms`` estimated.

Floor per pattern (the issue's): ``max(2*a*b*c*d*N / peak, (a*c*d + a*b*d)*N*bytes / bw)`` with ``peak`` the cuBLAS
8192^3 matmul rate of the dtype and ``bw`` the device-to-device copy bandwidth, both measured at the start of each
part; ``floor_fraction`` = floor / time.

Parts: the subsample does not fit one 10-minute device call, so :func:`assign_parts` splits it into ``k`` parts of
about equal *estimated* time (:func:`estimate_pattern_s`: a cost model of every timed call, warm-up and check from
the FLOPs and bytes of each contender at assumed H100 rates, constants in :data:`COST`), deterministically
(longest first, to the least loaded part). ``--part i/k`` runs part i; ``--budget-s`` stops starting patterns
after that many seconds (the JSON says which ran, ``--resume`` skips patterns already in the part's JSON).
Each part writes ``benchmarks/results/ks-<dev>-<date>-part<i>of<k>.json`` (and a copy under ``$OUT`` when set);
``benchmarks/ks_report.py`` merges the parts, prints the tables, draws the plot and derives the variant table.

``python benchmarks/ks.py --plan 3`` prints the parts with their estimates; ``--dry-run`` runs the whole code path
on the CPU with the reference op on tiny sizes (its timings mean nothing); ``--write-subsample`` redraws
``ks_subsample.txt`` from the pattern list.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
BATCH = 25088  # the paper's batch (Gonon et al. 2024, section 5: 128 images x 196 ViT tokens)
FLUSH_BYTES = 256 << 20  # > 2x the H100's 50 MB L2
_FLUSH: list = []  # the scratch buffer overwritten before each timed call (cuda only)
DEVICE = "cuda"  # "cpu" with --dry-run: the same code path on tiny sizes with the reference op (no timings kept)
PATTERNS_FILE = ROOT.parent / "shared" / "data" / "ks_patterns.txt"
PATTERNS_CARRY = ROOT / ".carry" / "ks" / "ks_patterns.txt"
SUBSAMPLE_FILE = ROOT / "benchmarks" / "ks_subsample.txt"
AUTHORS_DIR = ROOT / ".carry" / "ksmm"
RESULTS_DIR = ROOT / "benchmarks" / "results"
SUBSAMPLE_FRACTION = 1 / 3
SUBSAMPLE_SEED = 0
TARGET_MS = 40.0  # time per contender and pattern
SLOW_MS = 100.0  # contenders slower than this per call are timed once
TOL = {"float32": 1e-5, "float16": 2e-3}
BASELINES = ("bmm", "einsum", "dense", "bsr")  # the "best baseline" set
ALL_BASELINES = (*BASELINES, "csr", "authors")
# Variants not shipped by default (tf32x3: above fp32's error bound on the H100): their correctness is recorded apart
# (row["experimental_correct"]) so that a wrong one cannot mark the row incorrect; a wrong variant is never the best.
# dblock was one until 2026-11-25 (the rows of that sweep hold its correctness there).
EXPERIMENTAL_VARIANTS = ("tf32x3",)
# Variants left out of this run (comma-separated names): scripts/gpu_ks.sh sets it when the experimental variants'
# own GPU tests fail, so that a kernel that crashes cannot cost a process restart on every row.
SKIP_VARIANTS = frozenset(v for v in os.environ.get("KS_SKIP_VARIANTS", "").split(",") if v)
BSR_MAX_BLOCK = 512  # torch BSR (Triton) with blocks this large did not finish its first call in 60 s (H100)
BSR_MAX_BLOCK_FP32 = 256  # likewise for float32 from 256x256 blocks ((1,256,256,1), both layouts, 2026-11-25)

Quad = tuple[int, int, int, int]
# Crash bookkeeping: a kernel that kills the CUDA context (e.g. an illegal instruction) takes the process with it,
# and the error surfaces at a later synchronisation, not necessarily in the contender that caused it. Before each
# contender runs, its key is written to _MARKER; the next --resume run finds the file, records the (pattern, dtype,
# layout) as crashed (result["crashed"], with the step that was running) and skips it from then on; --diagnose then
# runs each contender of each crashed row alone in its own process with CUDA_LAUNCH_BLOCKING=1 to name the culprit.
_MARKER: list[Path] = []
_EXCLUDED: set[tuple] = set()
_ONLY: list[str] = []  # --single: run only this contender
HUNG = "hung (over --step-timeout-s) in an earlier run of this part; not run again on this row"


STEP_TIMEOUT_S = 60.0  # a step running longer is taken as hung (e.g. a Triton compile of a 512x512 BSR block)
_STEP: list = [None, 0.0]  # the marker's text and when it was written (watchdog input)


def _mark(quad: Quad, dtype_name: str, layout: str, name: str) -> None:
    if _MARKER:
        text = json.dumps({"pattern": list(quad), "dtype": dtype_name, "layout": layout, "name": name})
        _MARKER[0].write_text(text)
        _STEP[:] = [text, time.monotonic()]


def _watchdog(timeout_s: float) -> None:
    """Daemon thread: when one marked step runs over ``timeout_s``, the marker gets ``"hung": true`` and the process
    exits (code 3); the next --resume run then skips that contender only on that row (``result["hung"]``)."""
    import threading

    def watch():
        while True:
            time.sleep(1.0)
            text, since = _STEP
            if _MARKER and text is not None and time.monotonic() - since > timeout_s:
                entry = json.loads(text) | {"hung": True, "after_s": round(time.monotonic() - since, 1)}
                _MARKER[0].write_text(json.dumps(entry))
                print(f"hung, exiting: {entry}", flush=True)
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _excluded(quad: Quad, dtype_name: str, layout: str, name: str) -> bool:
    if _ONLY:
        return name != _ONLY[0]
    return (tuple(quad), dtype_name, layout, name) in _EXCLUDED


# ---------------------------------------------------------------------------------------------------------------
# patterns and the subsample
# ---------------------------------------------------------------------------------------------------------------


def read_patterns(path: Path) -> list[Quad]:
    """The ``a,b,c,d`` lines of a pattern file (``#`` comments skipped), in file order."""
    quads = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            quads.append(tuple(int(v) for v in line.split(",")))
    return quads


def draw_subsample(quads: list[Quad], fraction: float = SUBSAMPLE_FRACTION, seed: int = SUBSAMPLE_SEED) -> list[Quad]:
    """A stratified systematic sample: the patterns are grouped by ``(a, d)`` (the grid of groups the kernels
    launch), each group sorted by ``(b*c, b, c)`` (the tile size); from a group of ``n`` patterns,
    ``max(1, round(n * fraction))`` are taken at evenly spaced positions ``start + i * n / take`` with ``start``
    drawn uniformly in ``[0, n / take)`` from ``random.Random(seed)``, the groups visited in sorted ``(a, d)``
    order. Every ``(a, d)`` appears, and each group's sample spans its tile sizes. Output in that order."""
    rng = random.Random(seed)
    groups: dict[tuple[int, int], list[Quad]] = collections.defaultdict(list)
    for q in quads:
        groups[(q[0], q[3])].append(q)
    chosen: list[Quad] = []
    for key in sorted(groups):
        group = sorted(groups[key], key=lambda q: (q[1] * q[2], q[1], q[2]))
        take = max(1, round(len(group) * fraction))
        step = len(group) / take
        start = rng.random() * step
        chosen += [group[min(len(group) - 1, int(start + i * step))] for i in range(take)]
    return chosen


def write_subsample(path: Path, quads: list[Quad], source: Path, fraction: float, seed: int) -> list[Quad]:
    chosen = draw_subsample(quads, fraction, seed)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    header = [
        f"# Fixed subsample of the Kronecker-sparse benchmark patterns a,b,c,d: {len(chosen)} of {len(quads)}.",
        f"# Drawn by benchmarks/ks.py draw_subsample(fraction={fraction:.6g}, seed={seed}) from {source.name}",
        f"# (sha256 {digest}...): grouped by (a, d), each group sorted by (b*c, b, c), max(1, round(n * fraction))",
        "# patterns per group at evenly spaced positions from a seeded random start. Redraw: python",
        "# benchmarks/ks.py --write-subsample --patterns PATH (tests/kernels/test_ks_bench.py checks it is current).",
    ]
    path.write_text("\n".join(header + [",".join(map(str, q)) for q in chosen]) + "\n")
    return chosen


# ---------------------------------------------------------------------------------------------------------------
# cost model and parts
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Assumed H100 rates for planning only (never reported as measurements): bytes/s of a streaming kernel, FLOP/s
    of cuBLAS per dtype, of CSR SpMM and of float64 einsum, the efficiency assumed of the prunekit and authors'
    kernels against their floor, and the fixed seconds per (pattern, dtype, layout) (allocation, randn, syncs)."""

    bandwidth: float = 2.0e12
    flops: tuple[tuple[str, float], ...] = (("float16", 4.0e14), ("float32", 4.0e13), ("float64", 4.0e13))
    csr_flops: float = 1.0e12
    kernel_efficiency: float = 0.35
    authors_efficiency: float = 0.15
    overhead_s: float = 0.25

    def rate(self, dtype_name: str) -> float:
        return dict(self.flops)[dtype_name]


COST = CostModel()


def contender_ms(quad: Quad, dtype_name: str, batch: int = BATCH, cost: CostModel = COST) -> dict[str, float]:
    """Estimated ms per call of every contender (cost model :data:`COST`; for planning and skipping only)."""
    a, b, c, d = quad
    elt = 2 if dtype_name == "float16" else 4
    m, k = a * b * d, a * c * d
    flops = 2.0 * a * b * c * d * batch
    io = (m + k) * batch * elt
    floor_s = max(flops / cost.rate(dtype_name), io / cost.bandwidth)
    est = {
        "prunekit": floor_s / cost.kernel_efficiency,
        "bmm": flops / cost.rate(dtype_name) + 3 * io / cost.bandwidth,
        "einsum": flops / cost.rate(dtype_name) + 3 * io / cost.bandwidth,
        "dense": 2.0 * m * k * batch / cost.rate(dtype_name) + (m * k * elt + io) / cost.bandwidth,
        "csr": flops / cost.csr_flops + 2 * io / cost.bandwidth,
        "authors": floor_s / cost.authors_efficiency,
    }
    if d == 1:
        est["bsr"] = flops / cost.csr_flops * 0.5 + io / cost.bandwidth
    return {name: s * 1e3 for name, s in est.items()}


def timing_s(call_ms: float, quick: bool = False) -> float:
    """Seconds :func:`median_ms` spends on a contender of ``call_ms`` per call (warm-ups included)."""
    if quick or call_ms > SLOW_MS:
        return 2 * call_ms / 1e3
    calls = 2  # first call + warm-up
    total = 0.0
    while calls < 12 and (calls < 5 or total < TARGET_MS):
        calls += 1
        total += call_ms
    return calls * (call_ms + 0.3) / 1e3  # + flush and event overhead per call


def estimate_pattern_s(
    quad: Quad,
    dtypes: tuple[str, ...] = ("float16", "float32"),
    layouts: int = 2,
    batch: int = BATCH,
    max_call_ms: float = 1500.0,
    cost: CostModel = COST,
    max_csr_ms: float = 500.0,
) -> float:
    """Estimated seconds of one pattern in this benchmark: for each dtype and layout, the float64 reference, one
    poisoned check per prunekit variant and the authors' kernel, and :func:`timing_s` of every contender timed
    (``dense`` counted for every pattern: an upper bound, since it is timed once per shape)."""
    a, b, c, d = quad
    total = 0.0
    for dtype_name in dtypes:
        est = contender_ms(quad, dtype_name, batch, cost)
        variants = 4 if dtype_name != "float32" else 2
        m, k = a * b * d, a * c * d
        ref_s = 2.0 * a * b * c * d * batch / cost.rate("float64") + 3 * (m + k) * batch * 8 / cost.bandwidth
        checks_s = (variants + 1) * (est["prunekit"] / 1e3 + 3 * m * batch * 8 / cost.bandwidth)
        timed = variants * timing_s(est["prunekit"])
        timed += sum(timing_s(ms) for name, ms in est.items() if name not in ("prunekit", "csr") and ms <= max_call_ms)
        if est["csr"] <= min(max_call_ms, max_csr_ms):
            timed += timing_s(est["csr"], quick=True)
        total += layouts * (cost.overhead_s + ref_s + checks_s + timed)
    return total


def assign_parts(quads: list[Quad], parts: int, **estimate_kwargs) -> list[list[Quad]]:
    """Split ``quads`` into ``parts`` lists of about equal :func:`estimate_pattern_s`: longest first (ties in list
    order), each to the part with the least estimated time so far (lowest index on ties); each part keeps the
    subsample's order. Deterministic."""
    est = {q: estimate_pattern_s(q, **estimate_kwargs) for q in quads}
    order = sorted(range(len(quads)), key=lambda i: (-est[quads[i]], i))
    load = [0.0] * parts
    members: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        p = min(range(parts), key=lambda j: (load[j], j))
        load[p] += est[quads[i]]
        members[p].append(i)
    return [[quads[i] for i in sorted(idx)] for idx in members]


# ---------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------


def _event_ms(fn) -> float:
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if _FLUSH:
        _FLUSH[0].zero_()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def median_ms(fn, target_ms: float = TARGET_MS, quick: bool = False) -> float:
    """Median event time of ``fn`` after warm-up: up to 10 calls (at least 3) within ``target_ms``; a contender
    slower than :data:`SLOW_MS` per call, or any with ``quick``, is timed once after one warm-up."""
    first = _event_ms(fn)
    if quick or first > SLOW_MS:
        return _event_ms(fn)
    _event_ms(fn)
    times: list[float] = []
    while len(times) < 10 and (len(times) < 3 or sum(times) < target_ms):
        times.append(_event_ms(fn))
    return statistics.median(times)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def ceilings() -> dict:
    """Measured device ceilings: copy bandwidth (read + write bytes / s) and matmul rates per dtype."""
    if DEVICE == "cpu":
        return {"copy_gbps": 1.0, "matmul_float16_tflops": 1.0, "matmul_float32_tflops": 1.0}
    buffers = [torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    copy_ms = median_ms(lambda: buffers[1].copy_(buffers[0]))
    out = {"copy_gbps": 2 * buffers[0].numel() / copy_ms / 1e6}
    buffers.clear()
    for name, dtype in (("float16", torch.float16), ("float32", torch.float32)):
        x = torch.randn(8192, 8192, device=DEVICE, dtype=dtype)
        w = torch.randn(8192, 8192, device=DEVICE, dtype=dtype)
        ms = median_ms(lambda x=x, w=w: x @ w)
        out[f"matmul_{name}_tflops"] = 2 * 8192**3 / ms / 1e9
    _empty_cache()
    return out


# ---------------------------------------------------------------------------------------------------------------
# the authors' kernel (benchmark-only baseline, sources in the git-ignored .carry/ksmm/)
# ---------------------------------------------------------------------------------------------------------------

AUTHORS_FILES = ("kernel.cpp", "kernel.cu", "kernel.py", "template_kernels_float.cuh", "template_kernels_half.cuh")
AUTHORS_LAYOUTS = (("bs_first", False), ("bs_last", True))
AUTHORS_PRECISIONS = (("half", "float16"), ("float", "float32"))
AUTHORS_CHUNK = 12  # dispatch lines per generated translation unit (parallel compilation)


def _authors_module(src: Path):
    """The authors' ``kernel.py`` imported from ``src`` (for its instance-line generator only)."""
    spec = importlib.util.spec_from_file_location("ksmm_authors_kernel_py", src / "kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _best_rows(path: Path, batch: int) -> dict[Quad, list[list[int]]]:
    """Rows of an authors' ``*.best`` tuning file for ``batch``: (a, b, c, d) -> [[TILEX, TILEK, TILEY, TX, TY,
    VSIZE], ...] in file order."""
    rows: dict[Quad, list[list[int]]] = collections.defaultdict(list)
    for line in path.read_text().splitlines()[1:]:
        f = line.split()
        if len(f) >= 11 and int(f[0]) == batch:
            rows[tuple(int(v) for v in f[1:5])].append([int(v) for v in f[5:11]])
    return rows


def authors_sources(src: Path, quads: list[Quad], batch: int = BATCH) -> tuple[dict[str, str], dict[str, list]]:
    """Generated sources of the authors' extension for ``quads``: ``{file name: text}`` for the four dispatch
    headers their ``kernel.cu`` includes (declarations + a dispatcher over the parts) and the part files (their
    instance lines from ``add_lines_to_instantiate_kernel_with_hp`` with their ``*.best`` tile sizes, VSIZE 4
    preferred, else 2, as their loader does with its default vsize=4), and ``{"<layout>_<precision>": [pattern,
    ...]}`` of the patterns their tuning files lack."""
    gen = _authors_module(src).add_lines_to_instantiate_kernel_with_hp
    files: dict[str, str] = {}
    missing: dict[str, list] = {}
    for layout, _ in AUTHORS_LAYOUTS:
        for precision, _dtype_name in AUTHORS_PRECISIONS:
            name = f"kernel_{layout}_{precision}"
            best = _best_rows(src / f"{name}.best", batch)
            lines_per_quad = []
            for q in quads:
                rows = best.get(tuple(q), [])
                row = next((r for r in rows if r[5] == 4), None) or next((r for r in rows if r[5] == 2), None)
                if row is None:
                    missing.setdefault(f"{layout}_{precision}", []).append(list(q))
                    continue
                lines_per_quad.append("".join(gen([], name, batch, *q, precision, *row)))
            signature = (
                f"{precision} *input, {precision} *values, {precision} *output, int batch_size, int a, int b, "
                "int c, int d, dim3 &blockGrid, dim3 &threadsPerBlock"
            )
            call = "input, values, output, batch_size, a, b, c, d, blockGrid, threadsPerBlock"
            parts = [lines_per_quad[i : i + AUTHORS_CHUNK] for i in range(0, len(lines_per_quad), AUTHORS_CHUNK)]
            for j, chunk in enumerate(parts):
                files[f"gen_{name}_{j}.cu"] = (
                    f'// generated by prunekit benchmarks/ks.py\n#include <cassert>\n#include "template_kernels_'
                    f'{precision}.cuh"\n\nbool gen_{name}_{j}({signature}) {{\n\twhile (1) {{\n'
                    "\t\tthreadsPerBlock.y = 1;\n" + "".join(chunk) + "\t\treturn false;\n\t}\n\treturn true;\n}\n"
                )
            decls = "".join(f"bool gen_{name}_{j}({signature});\n" for j in range(len(parts)))
            tries = "".join(f"\tif (gen_{name}_{j}({call})) return;\n" for j in range(len(parts)))
            files[f"{name}.cuh"] = (
                f"// generated by prunekit benchmarks/ks.py\n#pragma once\n#include <cstdio>\n#include <cuda_fp16.h>\n"
                f"#include <cuda_runtime.h>\n\n{decls}\nvoid best_{name}({signature}) {{\n{tries}"
                f'\tfprintf(stderr, "ksmm baseline: no instance for batch %d, pattern %d,%d,%d,%d\\n", batch_size, '
                "a, b, c, d);\n}\n"
            )
    return files, missing


def build_authors(src: Path, quads: list[Quad], build_root: Path, verbose: bool = False):
    """Build (or load, when built before: ninja is incremental) the authors' extension for ``quads``.

    Returns:
        ``(module, info)``: the Python module (``forward(input, factor, bs_last, a, b, c, d, dtype_str, vsize)``)
        and ``{"name", "missing", "build_s", "files"}``.

    Raises:
        FileNotFoundError: the sources are not in ``src``; RuntimeError: the compilation failed.
    """
    from torch.utils import cpp_extension

    for f in AUTHORS_FILES:
        if not (src / f).is_file():
            raise FileNotFoundError(f"the authors' kernel source {src / f} is missing (see docs/KRONECKER.md)")
    files, missing = authors_sources(src, quads)
    digest = hashlib.sha256()
    for f in AUTHORS_FILES:
        digest.update((src / f).read_bytes())
    for name in sorted(files):
        digest.update(name.encode() + files[name].encode())
    name = f"ksmm_authors_{digest.hexdigest()[:12]}"
    folder = build_root / name
    gen_dir = folder / "src"
    gen_dir.mkdir(parents=True, exist_ok=True)
    for f in AUTHORS_FILES:  # copied only when changed: a new mtime on a header would make ninja rebuild every unit
        if f != "kernel.py" and (not (gen_dir / f).is_file() or (gen_dir / f).read_bytes() != (src / f).read_bytes()):
            shutil.copyfile(src / f, gen_dir / f)
    for fname, text in files.items():
        target = gen_dir / fname
        if not target.is_file() or target.read_text() != text:
            target.write_text(text)
    prebuilt = Path(os.environ.get("KS_AUTHORS_PREBUILT", "/nonexistent")) / f"{name}.so"
    if prebuilt.is_file():  # carried from an earlier call's $OUT/prebuilt-authors (same sources, same dispatch)
        t0 = time.perf_counter()
        spec = importlib.util.spec_from_file_location(name, prebuilt)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module, {"name": name, "missing": missing, "build_s": time.perf_counter() - t0, "files": len(files),
                        "prebuilt": str(prebuilt)}  # fmt: skip
    if DEVICE == "cuda" and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    t0 = time.perf_counter()
    module = cpp_extension.load(
        name=name,
        sources=[str(gen_dir / "kernel.cpp"), str(gen_dir / "kernel.cu")]
        + [str(gen_dir / f) for f in sorted(files) if f.endswith(".cu")],
        extra_cuda_cflags=["-O3"],
        build_directory=str(folder),
        verbose=verbose,
    )
    info = {"name": name, "missing": missing, "build_s": time.perf_counter() - t0, "files": len(files)}
    return module, info


# ---------------------------------------------------------------------------------------------------------------
# one pattern
# ---------------------------------------------------------------------------------------------------------------


def ks_call(blocks, x, out=None, tile_rows=None, pipelined=None, delta_block=None, tf32x3=False):
    """The prunekit contender: the CUDA kernel (the reference op under --dry-run)."""
    from prunekit.kernels import ks

    if DEVICE == "cpu":
        y = ks.ks_mm(blocks, x)
        return y if out is None else out.copy_(y)
    return ks.ks_mm_cuda(
        blocks, x, out=out, tile_rows=tile_rows, pipelined=pipelined, delta_block=delta_block, tf32x3=tf32x3
    )


def prunekit_variants(dtype: torch.dtype) -> dict[str, dict]:
    """Variant name -> ks_mm_cuda keyword arguments."""
    from prunekit.kernels import ks

    if dtype == torch.float32:
        variants = {"f32": {}, "tf32x3": {"tf32x3": True}}
    else:
        variants = {
            f"tile{tile}_{'pipe' if pipe else 'simple'}": {"tile_rows": tile, "pipelined": pipe}
            for tile in ks.TILE_ROWS
            for pipe in (False, True)
        }
    return {name: kw for name, kw in variants.items() if name not in SKIP_VARIANTS}


def csr_from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """torch sparse CSR of K built from the blocks: row (alpha*b + beta)*d + delta holds, at columns
    (alpha*c + gamma)*d + delta for gamma < c (increasing), the values blocks[alpha, delta, beta, :]."""
    a, d, b, c = blocks.shape
    dev = blocks.device
    alpha = torch.arange(a, device=dev).view(a, 1, 1, 1)
    gamma = torch.arange(c, device=dev).view(1, 1, 1, c)
    delta = torch.arange(d, device=dev).view(1, 1, d, 1)
    cols = ((alpha * c + gamma) * d + delta).expand(a, b, d, c).reshape(-1)
    values = blocks.permute(0, 2, 1, 3).reshape(-1)
    crow = torch.arange(a * b * d + 1, device=dev) * c
    return torch.sparse_csr_tensor(crow, cols, values, size=(a * b * d, a * c * d))


def bsr_from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """torch BSR of K for d == 1 (block-diagonal), square blocks of side gcd(b, c) (the authors' choice)."""
    a, d, b, c = blocks.shape
    if d != 1:
        raise ValueError("BSR baseline only for d == 1")
    s = math.gcd(b, c)
    rb, cb = b // s, c // s
    dev = blocks.device
    values = blocks[:, 0].reshape(a, rb, s, cb, s).permute(0, 1, 3, 2, 4).reshape(-1, s, s)
    alpha = torch.arange(a, device=dev).view(a, 1, 1)
    cols = (alpha * cb + torch.arange(cb, device=dev).view(1, 1, cb)).expand(a, rb, cb).reshape(-1)
    crow = torch.arange(a * rb + 1, device=dev) * cb
    return torch.sparse_bsr_tensor(crow, cols, values.contiguous(), size=(a * b, a * c))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def dense_key(m: int, k: int, dtype_name: str, layout: str) -> str:
    """Key of the dense timing cache: cuBLAS time depends on the shape, dtype and layout, not on the values."""
    return f"{m}x{k}/{dtype_name}/{layout}"


def seed_dense_cache(paths) -> dict[str, tuple[float, list[int]]]:
    """The dense timings already in result JSONs (``paths``): ``{dense_key: (ms, pattern timed on)}``."""
    cache: dict[str, tuple[float, list[int]]] = {}
    for path in paths:
        try:
            rows = json.loads(Path(path).read_text()).get("rows", [])
        except (OSError, ValueError):
            continue
        for r in rows:
            ms = r.get("ms", {}).get("dense")
            a, b, c, d = r["pattern"]
            if ms and not r.get("dense_timed_on"):  # timed on this very row
                cache.setdefault(dense_key(a * b * d, a * c * d, r["dtype"], r["layout"]), (ms, r["pattern"]))
    return cache


def run_pattern(
    quad: Quad,
    dtype_name: str,
    batch_first: bool,
    ceil: dict,
    gen,
    authors=None,
    max_call_ms=1500.0,
    dense_cache: dict | None = None,
    max_csr_ms: float = 500.0,
):
    """Checks and times every contender on one (pattern, dtype, layout); returns the JSON row. ``dense_cache``
    (updated in place) holds the dense timings by :func:`dense_key`; CSR is timed once after one warm-up."""
    from prunekit.formats.ks import blocks_to_dense
    from prunekit.kernels import ks

    t_start = time.perf_counter()
    a, b, c, d = quad
    _mark(quad, dtype_name, "batch_first" if batch_first else "batch_last", "setup")
    dtype = getattr(torch, dtype_name)
    m, k, n = a * b * d, a * c * d, BATCH
    blocks = (torch.randn(a, d, b, c, generator=gen, device=DEVICE) / math.sqrt(c)).to(dtype)
    if batch_first:
        x2d = torch.randn(n, k, generator=gen, device=DEVICE).to(dtype)
        x = x2d.t()
    else:
        x = torch.randn(k, n, generator=gen, device=DEVICE).to(dtype)
        x2d = None
    layout = "batch_first" if batch_first else "batch_last"
    row: dict = {"pattern": list(quad), "dtype": dtype_name, "layout": layout}
    estimates = contender_ms(quad, dtype_name)
    row["estimated_ms"] = {key: round(v, 4) for key, v in estimates.items()}

    # float64 reference, computed in chunks of N (no float64 copy of X)
    ref = torch.empty((m, n), dtype=torch.float64, device=DEVICE)
    w64 = blocks.double()
    step = max(1, (1 << 27) // max(1, k + m))
    for s in range(0, n, step):
        xs = (x2d[s : s + step].t() if batch_first else x[:, s : s + step]).double().reshape(a, c, d, -1)
        ref[:, s : s + step] = torch.einsum("adbc,acdn->abdn", w64, xs).reshape(m, -1)
    del w64
    ref_norm = float(ref.norm())

    def rel_error(y: torch.Tensor) -> float | None:
        """||y - ref|| / ||ref|| for y (M, N) any strides, chunked; None when y holds a NaN (a poisoned entry)."""
        sq = 0.0
        for s in range(0, n, step):
            sq += float((y[:, s : s + step].double() - ref[:, s : s + step]).square().sum())
        err = math.sqrt(sq) / max(ref_norm, 1e-30)
        return None if math.isnan(err) else err

    variants = prunekit_variants(dtype)
    if batch_first and dtype != torch.float32 and d % 2 == 0 and "dblock" not in SKIP_VARIANTS:
        variants["dblock"] = {"delta_block": True}  # 8, 4 or 2 deltas per CTA, X and Y in vectors (kernels/ks.py)
    default_tile, default_pipe = ks.pick_variant(b, c, d, dtype, batch_first)
    default_name = next(
        (v for v, kw in variants.items() if kw.get("tile_rows", default_tile) == default_tile
         and kw.get("pipelined", default_pipe) == default_pipe),
        next(iter(variants)),
    )  # fmt: skip
    if "dblock" in variants and ks.pick_delta_block_packed(b, c, d):  # X and Y here are packed and aligned
        default_name = "dblock"  # what ks_mm_cuda's defaults run (ks.uses_delta_block)
    if d == 1 and ks.BLOCK_DIAGONAL_TO_CUBLAS and "cublas" not in SKIP_VARIANTS:
        variants["cublas"] = {}  # ks_mm_cuda's defaults: block_diagonal_mm (torch.bmm on views)
        default_name = "cublas"
    row["default_variant"] = default_name
    errors: dict[str, str] = {}
    rel: dict[str, float | None] = {}
    for name, kwargs in variants.items():
        if _excluded(quad, dtype_name, layout, name):
            rel[name], errors[name] = None, HUNG
            continue
        _mark(quad, dtype_name, layout, name)
        out = (
            torch.full((n, m), float("nan"), dtype=dtype, device=DEVICE).t()
            if batch_first
            else torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
        )
        try:
            ks_call(blocks, x, out=out, **kwargs)
            _sync()
            rel[name] = rel_error(out)
        except Exception as exc:  # noqa: BLE001 - a failing variant is recorded, the run goes on
            rel[name] = None
            errors[name] = _first_line(exc)
        del out
    ok = {v: e is not None and e < TOL[dtype_name] for v, e in rel.items()}
    row["correct"] = all(ok[v] for v in variants if v not in EXPERIMENTAL_VARIANTS)
    row["experimental_correct"] = {v: ok[v] for v in variants if v in EXPERIMENTAL_VARIANTS}

    ms: dict[str, float | None] = {}
    for name, kwargs in variants.items():
        if name in errors:
            ms[name] = None
            continue
        _mark(quad, dtype_name, layout, name)
        ms[name] = median_ms(lambda kwargs=kwargs: ks_call(blocks, x, **kwargs))
    ms["prunekit"] = ms[default_name]
    timed_variants = {v: t for v, t in ms.items() if v in variants and t and ok.get(v)}  # correct ones only
    row["best_variant"] = min(timed_variants, key=timed_variants.get) if timed_variants else None
    ms["prunekit_best"] = timed_variants.get(row["best_variant"]) if row["best_variant"] else None

    # baselines
    skipped: dict[str, str] = {}
    contenders: dict = {}
    w_bmm = blocks.reshape(a * d, b, c)

    def bmm_call():
        xs = x2d.reshape(n, a, c, d).permute(1, 3, 2, 0) if batch_first else x.reshape(a, c, d, n).permute(0, 2, 1, 3)
        y = torch.bmm(w_bmm, xs.reshape(a * d, c, n))
        y = y.reshape(a, d, b, n).permute(3, 0, 2, 1) if batch_first else y.reshape(a, d, b, n).permute(0, 2, 1, 3)
        return y.reshape(n, m) if batch_first else y.reshape(m, n)

    def einsum_call():
        if batch_first:
            return torch.einsum("adbc,nacd->nabd", blocks, x2d.reshape(n, a, c, d)).reshape(n, m)
        return torch.einsum("adbc,acdn->abdn", blocks, x.reshape(a, c, d, n)).reshape(m, n)

    contenders["bmm"] = bmm_call
    contenders["einsum"] = einsum_call
    elt = torch.finfo(dtype).bits // 8
    dkey = dense_key(m, k, dtype_name, layout)
    if "dense" in skipped:
        pass
    elif dense_cache is not None and dkey in dense_cache:
        ms["dense"], row["dense_timed_on"] = dense_cache[dkey]
    elif estimates["dense"] > max_call_ms or m * k * elt > (8 << 30):
        skipped["dense"] = (
            f"estimated {estimates['dense']:.0f} ms per call (> {max_call_ms:.0f}), {m * k * elt / 2**30:.1f} GiB"
        )
    else:
        try:
            dense_w = blocks_to_dense(blocks)
            contenders["dense"] = (lambda: F.linear(x2d, dense_w)) if batch_first else (lambda: dense_w @ x)
        except Exception as exc:  # noqa: BLE001
            errors["dense"] = _first_line(exc)
    if "csr" in skipped:
        pass
    elif estimates["csr"] > min(max_call_ms, max_csr_ms):
        skipped["csr"] = f"estimated {estimates['csr']:.0f} ms per call (> {min(max_call_ms, max_csr_ms):.0f})"
    else:
        try:
            _mark(quad, dtype_name, layout, "csr")
            csr = csr_from_blocks(blocks)
            contenders["csr"] = (lambda: csr @ x2d.t()) if batch_first else (lambda: csr @ x)
        except Exception as exc:  # noqa: BLE001
            errors["csr"] = _first_line(exc)
    if "bsr" in skipped:
        pass
    elif d == 1 and math.gcd(b, c) >= (BSR_MAX_BLOCK_FP32 if dtype_name == "float32" else BSR_MAX_BLOCK):
        skipped["bsr"] = (
            f"blocks of {math.gcd(b, c)}: torch BSR with 512x512 blocks (and 256x256 in float32) ran over 60 s in its "
            "first call on the H100 (results/ks-h100-2026-11-25-part1of1.json, 'hung')"
        )
    elif d == 1:
        try:
            _mark(quad, dtype_name, layout, "bsr")
            bsr = bsr_from_blocks(blocks)
            contenders["bsr"] = (lambda: bsr @ x2d.t()) if batch_first else (lambda: bsr @ x)
        except Exception as exc:  # noqa: BLE001
            errors["bsr"] = _first_line(exc)
    else:
        skipped["bsr"] = "d > 1: K has no dense tiles without a permutation (that case is the bmm baseline)"
    for name in ("dense", "csr", "bsr", "authors"):
        if _excluded(quad, dtype_name, layout, name):
            skipped[name] = HUNG
    if "authors" in skipped:
        pass
    elif authors is None:
        skipped["authors"] = "not built (see the part's authors_build)"
    elif tuple(quad) in authors["missing"].get(f"{'bs_first' if batch_first else 'bs_last'}_"
                                               f"{'half' if dtype_name == 'float16' else 'float'}", set()):  # fmt: skip
        skipped["authors"] = "the authors' tuning files (*.best) have no tile sizes for this pattern at batch 25088"
    else:
        factor = blocks.permute(0, 1, 3, 2).reshape(a * d * c, b).contiguous()  # their (a*d*c, b) layout
        inp = x2d if batch_first else x
        bs_last = 0 if batch_first else 1

        def authors_call(factor=factor, inp=inp, bs_last=bs_last):
            return authors["module"].forward(inp, factor, bs_last, a, b, c, d, str(dtype), 4)

        try:
            _mark(quad, dtype_name, layout, "authors")
            poison = torch.full((m * n,), float("nan"), dtype=dtype, device=DEVICE)
            del poison  # its block returns to the caching allocator: their torch::empty output likely reuses it
            y = authors_call()
            _sync()
            rel["authors"] = rel_error(y.t() if batch_first else y)
            del y
            contenders["authors"] = authors_call
        except Exception as exc:  # noqa: BLE001
            errors["authors"] = _first_line(exc)
    for name, fn in contenders.items():
        if _excluded(quad, dtype_name, layout, name):
            skipped[name] = HUNG
            continue
        _mark(quad, dtype_name, layout, name)
        try:
            ms[name] = median_ms(fn, quick=name == "csr")
        except Exception as exc:  # noqa: BLE001
            ms[name] = None
            errors[name] = _first_line(exc)
        _empty_cache()
    if dense_cache is not None and ms.get("dense") and "dense_timed_on" not in row:
        dense_cache[dkey] = (ms["dense"], list(quad))
    row["rel_error"] = rel
    row["ms"] = ms
    row["errors"] = errors
    row["skipped"] = skipped
    base = {key: v for key, v in ms.items() if key in BASELINES and v}
    row["best_baseline"] = min(base, key=base.get) if base else None
    ours, ours_best = ms.get("prunekit"), ms.get("prunekit_best")
    row["speedup_vs_best"] = base[row["best_baseline"]] / ours if base and ours else None
    row["speedup_best_variant_vs_best"] = base[row["best_baseline"]] / ours_best if base and ours_best else None
    row["authors_correct"] = rel.get("authors") is not None and rel["authors"] < TOL[dtype_name] * 10
    row["speedup_vs_authors"] = ms["authors"] / ours if ms.get("authors") and ours else None
    flops = 2 * a * b * c * d * n
    nbytes = (k + m) * n * elt
    peak = ceil[f"matmul_{dtype_name}_tflops"] * 1e12
    floor_ms = max(flops / peak, nbytes / (ceil["copy_gbps"] * 1e9)) * 1e3
    row["floor_ms"] = floor_ms
    row["floor_fraction"] = floor_ms / ours if ours else None
    row["floor_fraction_best_variant"] = floor_ms / ours_best if ours_best else None
    row["elapsed_s"] = time.perf_counter() - t_start
    return row


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------


def contender_names(dtype_name: str, d: int) -> list[str]:
    """Every contender a row of this dtype runs, in run order (prunekit variants first)."""
    names = list(prunekit_variants(getattr(torch, dtype_name)))
    return [*names, "bmm", "einsum", "dense", "csr", *(["bsr"] if d == 1 else []), "authors"]


def _run_single(spec: list[str], authors) -> None:
    """--single: one contender of one row (the others excluded); prints ``SINGLE {json}``."""
    quad = tuple(int(v) for v in spec[0].split(","))
    dtype_name, layout, name = spec[1], spec[2], spec[3]
    _ONLY[:] = [name]
    if DEVICE == "cuda":
        from prunekit.kernels import ks

        ks.load()
        _FLUSH.append(torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda"))
    ceil = {"matmul_float16_tflops": 1.0, "matmul_float32_tflops": 1.0, "copy_gbps": 1.0}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    row = run_pattern(quad, dtype_name, layout == "batch_first", ceil, gen, authors, dense_cache=None)
    _sync()
    keep = {"ms": row["ms"].get(name), "rel_error": row["rel_error"].get(name), "error": row["errors"].get(name)}
    print("SINGLE " + json.dumps(keep), flush=True)


def _diagnose(args, argv) -> None:
    """--diagnose: each contender of each crashed row of ``--out`` alone in a subprocess (CUDA_LAUNCH_BLOCKING=1)."""
    import subprocess
    import sys

    path = args.out
    data = json.loads(path.read_text())
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for crash in data.get("crashed", []):
        if crash.get("diagnosis"):
            continue
        verdicts = {}
        names = contender_names(crash["dtype"], crash["pattern"][3])
        for name in [names[-1], *names[:-1]]:  # the authors' kernel first: the least known code
            cmd = [sys.executable, __file__, "--single", ",".join(map(str, crash["pattern"])), crash["dtype"],
                   crash["layout"], name]  # fmt: skip
            if DEVICE == "cpu":
                cmd.append("--dry-run")
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SINGLE ")), None)
                if proc.returncode == 0 and line:
                    verdicts[name] = json.loads(line[7:])
                else:
                    tail = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln][-1:]
                    verdicts[name] = {"exit_code": proc.returncode, "error": tail[0] if tail else None}
            except subprocess.TimeoutExpired:
                verdicts[name] = {"error": "timed out after 120 s"}
            print(crash["pattern"], crash["dtype"], crash["layout"], name, verdicts[name], flush=True)
        crash["diagnosis"] = verdicts
        path.write_text(json.dumps(data, indent=1) + "\n")
    return None


def device_tag() -> str:
    if DEVICE == "cpu":
        return "cpu-dryrun"
    name = torch.cuda.get_device_name().lower()
    return "h100" if "h100" in name else "h200" if "h200" in name else name.replace(" ", "-")


def parse_part(text: str) -> tuple[int, int]:
    i, k = (int(v) for v in text.split("/"))
    if not 1 <= i <= k:
        raise ValueError(f"--part {text}: expected i/k with 1 <= i <= k")
    return i, k


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subsample", type=Path, default=SUBSAMPLE_FILE)
    parser.add_argument("--patterns", type=Path, help="Pattern list for --write-subsample (default: shared, carry).")
    parser.add_argument("--write-subsample", action="store_true", help="Redraw --subsample from --patterns; exit.")
    parser.add_argument("--part", default="1/1", help="i/k: run part i of k (assign_parts).")
    parser.add_argument("--plan", type=int, metavar="K", help="Print the K parts with estimated seconds; exit.")
    parser.add_argument("--limit", type=int, help="Run only the first LIMIT patterns of the part.")
    parser.add_argument("--budget-s", type=float, default=460.0, help="Start no pattern after this many seconds.")
    parser.add_argument("--resume", action="store_true", help="Keep the rows already in the part's JSON.")
    parser.add_argument(
        "--resume-also", type=Path, nargs="*", default=[],
        help="With --resume: rows of these JSONs (earlier copies of this part) are kept too, not re-run.",
    )  # fmt: skip
    parser.add_argument(
        "--shuffle", type=int, metavar="SEED",
        help="Run the part's patterns in the order of random.Random(SEED).shuffle (a run cut by its budget then "
        "covers a random subset of the part, not its first (a, d) groups).",
    )  # fmt: skip
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--layouts", default="batch_last,batch_first")
    parser.add_argument("--max-call-ms", type=float, default=1500.0, help="Skip dense/CSR above this estimate.")
    parser.add_argument("--max-csr-ms", type=float, default=500.0, help="Skip CSR above this estimate.")
    parser.add_argument("--authors", type=Path, default=AUTHORS_DIR, help="The authors' sources ('' to skip).")
    parser.add_argument("--authors-build", type=Path, default=ROOT / ".carry" / "ksmm-build")
    parser.add_argument("--build-authors-only", action="store_true", help="Build the authors' extension; exit.")
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/ks-<dev>-<date>-partIofK).")
    parser.add_argument("--dry-run", action="store_true", help="CPU, batch 64, reference op: checks the script only.")
    parser.add_argument(
        "--single", nargs=4, metavar=("A,B,C,D", "DTYPE", "LAYOUT", "CONTENDER"),
        help="Run one contender on one (pattern, dtype, layout) and print its JSON line (used by --diagnose).",
    )  # fmt: skip
    parser.add_argument("--step-timeout-s", type=float, default=STEP_TIMEOUT_S, help="A step over this is hung.")
    parser.add_argument(
        "--diagnose", action="store_true",
        help="For each crashed row of --out: every contender alone, in its own process with CUDA_LAUNCH_BLOCKING=1; "
        "the verdicts go into the crashed entry ('diagnosis').",
    )  # fmt: skip
    args = parser.parse_args(argv)
    global DEVICE, BATCH
    if args.dry_run:
        DEVICE, BATCH = "cpu", 64
    dtypes = tuple(args.dtypes.split(","))
    layouts = args.layouts.split(",")
    if args.write_subsample:
        source = args.patterns or (PATTERNS_FILE if PATTERNS_FILE.is_file() else PATTERNS_CARRY)
        chosen = write_subsample(args.subsample, read_patterns(source), source, SUBSAMPLE_FRACTION, SUBSAMPLE_SEED)
        print(f"{len(chosen)} patterns -> {args.subsample}")
        return args.subsample
    quads = read_patterns(args.subsample)
    if args.plan:
        for i, part in enumerate(assign_parts(quads, args.plan, dtypes=dtypes, layouts=len(layouts)), 1):
            est = sum(estimate_pattern_s(q, dtypes=dtypes, layouts=len(layouts)) for q in part)
            print(f"part {i}/{args.plan}: {len(part)} patterns, estimated {est:.0f} s")
        return None
    if args.diagnose:
        return _diagnose(args, argv)
    part_i, part_k = parse_part(args.part)
    part = assign_parts(quads, part_k, dtypes=dtypes, layouts=len(layouts))[part_i - 1]
    if DEVICE == "cpu":  # dry run: the small patterns only (the CPU reference on the large ones takes minutes)
        part = [q for q in part if max(q[0] * q[1] * q[3], q[0] * q[2] * q[3]) <= 1024]
    if args.shuffle is not None:
        random.Random(args.shuffle).shuffle(part)
    if args.limit:
        part = part[: args.limit]

    started = time.perf_counter()  # the budget counts the authors' build too (a no-op when built before)
    authors = None
    authors_info: dict = {}
    if DEVICE == "cpu":
        authors_info = {"error": "dry run: not built"}
    elif str(args.authors) and args.authors.name:
        try:
            module, info = build_authors(args.authors, quads, args.authors_build)  # one build for the subsample
            missing = {key: {tuple(q) for q in v} for key, v in info["missing"].items()}
            authors = {"module": module, "missing": missing}
            authors_info = {**info, "missing": {key: len(v) for key, v in info["missing"].items()}}
        except Exception as exc:  # noqa: BLE001 - the run goes on without this baseline
            authors_info = {"error": _first_line(exc)}
    if args.build_authors_only:
        print(json.dumps(authors_info))
        return None

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.single:
        return _run_single(args.single, authors)
    if DEVICE == "cuda":
        from prunekit.kernels import ks

        ks.load()
        _FLUSH.append(torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda"))
    ceil = ceilings()
    print(json.dumps(ceil), flush=True)
    tag = device_tag()
    date = datetime.date.today().isoformat()
    out_path = args.out or RESULTS_DIR / f"ks-{tag}-{date}-part{part_i}of{part_k}.json"
    result = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run, not a measurement)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "date": date,
        "batch": BATCH,
        "part": [part_i, part_k],
        "subsample": {
            "file": str(args.subsample.relative_to(ROOT))
            if args.subsample.is_relative_to(ROOT)
            else str(args.subsample),
            "count": len(quads),
        },  # fmt: skip
        "part_patterns": [list(q) for q in part],
        "order": f"random.Random({args.shuffle}).shuffle" if args.shuffle is not None else "subsample order",
        "ceilings": ceil,
        "cost_model": {"constants": COST.__dict__ | {"flops": dict(COST.flops)}},
        "authors_build": authors_info,
        "prunekit_measured_variants": "none (a-priori rule)",
        "rows": [],
    }
    from prunekit.kernels import ks

    if ks.MEASURED_VARIANTS:
        result["prunekit_measured_variants"] = ks.MEASURED_SOURCE
    out_path.parent.mkdir(parents=True, exist_ok=True)
    marker = out_path.with_name(out_path.name + ".running")
    result["crashed"] = []
    if args.resume:
        seen: set = set()
        for path in [out_path, *args.resume_also]:
            if not path.is_file():
                continue
            earlier = json.loads(path.read_text())
            for c in earlier.get("crashed", []):
                if (c["pattern"], c["dtype"], c["layout"]) not in [
                    (e["pattern"], e["dtype"], e["layout"]) for e in result["crashed"]
                ]:
                    result["crashed"].append(c)
            for r in earlier.get("rows", []):
                key = (tuple(r["pattern"]), r["dtype"], r["layout"])
                if key not in seen:
                    seen.add(key)
                    result["rows"].append(r)
    result["hung"] = []
    if args.resume:
        for path in [out_path, *args.resume_also]:
            if path.is_file():
                for h in json.loads(path.read_text()).get("hung", []):
                    if h not in result["hung"]:
                        result["hung"].append(h)
    crash = json.loads(marker.read_text()) if marker.is_file() else None
    if crash and crash.get("hung") and crash["name"] != "setup":  # a contender that hung: only it is skipped
        result["hung"].append(crash)
        print(f"hung earlier, this contender is skipped on this row from now on: {crash}", flush=True)
    elif crash:  # the previous run of this part died inside this row: the CUDA context may be at fault, skip the row
        if (crash["pattern"], crash["dtype"], crash["layout"]) not in [
            (e["pattern"], e["dtype"], e["layout"]) for e in result["crashed"]
        ]:
            result["crashed"].append(crash)
        print(f"crashed earlier, excluded from now on: {crash}", flush=True)
    marker.unlink(missing_ok=True)
    crashed_keys = {(tuple(c["pattern"]), c["dtype"], c["layout"]) for c in result["crashed"]}
    _EXCLUDED.update((tuple(h["pattern"]), h["dtype"], h["layout"], h["name"]) for h in result["hung"])
    out_path.write_text(json.dumps(result, indent=1) + "\n")  # the crash record survives another crash
    _MARKER[:] = [marker]
    _STEP[:] = [None, 0.0]
    if DEVICE == "cuda":  # the GPU run only (a dry run inside pytest must never be exited by it)
        _watchdog(args.step_timeout_s)
    # dense timings of this date's parts (and of this part when resumed) are reused, not re-timed
    dense_cache = seed_dense_cache([*sorted(out_path.parent.glob(f"ks-{tag}-{date}-part*of*.json")), *args.resume_also])
    done_keys = {(tuple(r["pattern"]), r["dtype"], r["layout"]) for r in result["rows"]}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    not_run = []
    for quad in part:
        if time.perf_counter() - started > args.budget_s:
            not_run.append(list(quad))
            continue
        for dtype_name in dtypes:
            for layout in layouts:
                if (tuple(quad), dtype_name, layout) in done_keys | crashed_keys:
                    continue
                row = run_pattern(
                    quad, dtype_name, layout == "batch_first", ceil, gen, authors, args.max_call_ms, dense_cache,
                    args.max_csr_ms,
                )  # fmt: skip
                result["rows"].append(row)
                ms = row["ms"]
                print(
                    f"{quad} {dtype_name:8s} {layout:11s} ok={row['correct']} ours={ms.get('prunekit') or 0:.3f} "
                    f"({row['default_variant']}; best {row['best_variant']}) best={row['best_baseline']} "
                    f"x{row['speedup_vs_best'] or 0:.2f} vs-authors x{row['speedup_vs_authors'] or 0:.2f} "
                    f"floor={row['floor_fraction'] or 0:.2f} {row['elapsed_s']:.1f}s est "
                    f"{estimate_pattern_s(quad, (dtype_name,), 1):.1f}s",
                    flush=True,
                )
                _empty_cache()
        result["not_run"] = not_run
        result["elapsed_s"] = time.perf_counter() - started
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
    result["not_run"] = not_run
    result["elapsed_s"] = time.perf_counter() - started
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    marker.unlink(missing_ok=True)
    _MARKER.clear()
    _STEP[:] = [None, 0.0]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out_path, Path(os.environ["OUT"]) / out_path.name)
    print(f"{len(result['rows'])} rows, {len(not_run)} patterns not run -> {out_path}")
    return out_path


if __name__ == "__main__":
    main()
