#!/usr/bin/env bash
# GPU-machine runs for issue 5 (structured-sparse kernels), one subcommand per 10-minute device call. Logs and JSON go
# to $OUT (or ./out). Run from the repository root on a machine with a CUDA GPU, nvcc and ninja (PYTHONPATH=src, no
# install needed). Every subcommand builds first (a cache hit when the kernel cache in .carry/ survived).
#
#   scripts/gpu_structured.sh build-test   # build both libraries (~3-5 min cold), CUDA tests, compute-sanitizer
#                                          # memcheck of small cases (mma, wgmma, eager entries, 2:4 both layouts),
#                                          # host time per call of each layer of the eager paths
#   scripts/gpu_structured.sh bsr [args]   # benchmarks/bsr.py (quick grid, --time-limit-s 420 unless given)
#   scripts/gpu_structured.sh nm [args]    # benchmarks/nm.py (all points, --time-limit-s 420 unless given)
#   scripts/gpu_structured.sh nmconfigs    # the cuSPARSELt binding alone: test_nm_mm.py, benchmarks/nm_configs.py
#                                          # (layouts, X description, copy, W as the B operand, $NM_ALGS algorithm
#                                          # ids; $NM_CONFIG_POINTS, $TAG in the file name), nm.py points 0-4 (unless
#                                          # NM_BENCH=0)
#   scripts/gpu_structured.sh nm24 [args]  # the 2:4 decode kernel (kernels/nm24.py) alone: build it and the cuSPARSELt
#                                          # binding (not the BSR library), its tests and test_nm_mm.py, memcheck and
#                                          # racecheck of small decode cases, probes (no epilogue; atomics instead of
#                                          # clusters), benchmarks/nm24_sweep.py (k-chunk sweep), benchmarks/nm24_host.py
#                                          # (host time per call), then benchmarks/nm.py at the decode points (5-8, 12-17)
#   scripts/gpu_structured.sh nm24sp       # the decode kernel's mma.sp variant: metadata layout check, tests, sweeps of
#                                          # both variants, benchmarks/nm.py decode points with mma.sp
#   scripts/gpu_structured.sh nm24ring     # the decode kernel's weight rings: tests, sweep of $NM24_RINGS x $NM24_CHUNKS,
#                                          # probes at ring $NM24_PROBE_RING, host time per call (benchmarks/nm24_host.py)
#   scripts/gpu_structured.sh nm24prof     # Nsight Compute of the decode kernel ($NM24_PROFILE_CASES "M K N;..."), then
#                                          # the k-chunk sweep ($NM24_CHUNKS)
#   scripts/gpu_structured.sh nm24lean     # the lean decode kernels ($PRUNEKIT_NM24_LEAN=1; 2:4 and bitmap): tests,
#                                          # memcheck, racecheck, the 2:4 sweep against the ring kernel
#                                          # ($NM24_LEAN_WARPS, $NM24_LEAN_NS)
#   scripts/gpu_structured.sh bsrlean      # the lean BSR decode kernel ($PRUNEKIT_BSR_LEAN=1): tests, memcheck,
#                                          # racecheck, bsr.py at N = 16 with and without it ($BSR_LEAN_SHAPES, ...)
#   scripts/gpu_structured.sh bitmaplean   # the lean bitmap decode kernel: spmm.py, forced bitmap, without and with
#                                          # $PRUNEKIT_NM24_LEAN=1 ($BITMAP_LEAN_WARPS, _SHAPES, _NS, _SPARSITIES)
#   scripts/gpu_structured.sh leandefaults # the lean kernels as defaults: memcheck, racecheck, bsr.py at N = 1 / 16 and
#                                          # 50 / 70%, spmm.py at 3072 x 768, nm.py decode points
#   scripts/gpu_structured.sh tiles        # the wgmma kernels' tiles per CTA and stages: tests, memcheck, bsr.py
#                                          # sweeps ($BSR_TPC, $BSR_STAGES, $BSR_TILE_NS, $BSR_TPC_SHAPES, $BSR_TPC_NS,
#                                          # $BSR_TPC_BLOCKS, $BSR_TPC_SPARSITIES, $BSR_TPC_CONTROL, $BSR_CONTROL_NS,
#                                          # $BSR_CONTROL_BLOCKS, $BSR_WP / $BSR_WT (--warp-producer / --warp-tile-n),
#                                          # $BSR_TPC_TIME_LIMIT (bsr.py --time-limit-s), $TAG;
#                                          # BSR_TPC_BENCH=0: no benchmark)
#   scripts/gpu_structured.sh all          # all three in a row (only for a machine without the 10-minute limit)
set -uo pipefail
MODE=${1:-build-test}
shift || true
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# shellcheck source=scripts/out_pack.sh
source "$(dirname "${BASH_SOURCE[0]}")/out_pack.sh"; trap out_pack EXIT  # <= 8 files in $OUT
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export PRUNEKIT_KERNEL_CACHE=${PRUNEKIT_KERNEL_CACHE:-$PWD/.carry/kernel-cache}
export PRUNEKIT_CUDA_ARCHS=${PRUNEKIT_CUDA_ARCHS:-90}  # compiled as sm_90a for the structured library (wgmma)
export MAX_JOBS=${MAX_JOBS:-16}
# exercise the C++ eager entries (off by default until they have passed here; kernels/structured.py EAGER_CPP_DEFAULT)
export PRUNEKIT_STRUCTURED_CPP=${PRUNEKIT_STRUCTURED_CPP:-1}
DATE=$(date -u +%Y-%m-%d)
DEV=$(python3 -c "import torch; n=torch.cuda.get_device_name(0).lower(); print('h100' if 'h100' in n else 'h200' if 'h200' in n else n.replace(' ', '-'))")
step() { echo "=== $* ($(date -u +%H:%M:%S))"; }
has_arg() { local key=$1; shift; for a in "$@"; do [[ $a == "$key"* ]] && return 0; done; return 1; }

build() {
  step build
  timeout 420 python3 -c "
import logging, time; logging.basicConfig(level=logging.INFO)
import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), 'cusparselt', torch.backends.cusparselt.is_available())
from prunekit.kernels import structured
t = time.time(); print(structured.load(verbose=False), f'{time.time() - t:.1f}s')
print('wgmma variant available:', structured.wgmma_available())
print('cuSPARSELt wheel folder', structured.cusparselt_dir())
t = time.time()
try:
    structured.load_cslt(verbose=True); print('cuSPARSELt binding built', f'{time.time() - t:.1f}s')
except Exception as exc:
    print('cuSPARSELt binding FAILED:', exc)
" > "$OUT/build.log" 2>&1
  local rc=$?
  grep -E "^2\.|\.so |wgmma|wheel folder|binding" "$OUT/build.log" | tail -6
  [[ $rc == 0 ]] || { tail -60 "$OUT/build.log"; exit 1; }
}

build_test() {
  step tests
  timeout 240 python3 -m pytest -q --maxfail=10 -p no:cacheprovider -rs tests/kernels/test_bsr_mm.py \
    tests/kernels/test_nm_mm.py tests/kernels/test_structured_tiling.py > "$OUT/tests.log" 2>&1
  echo "pytest exit code $?"; grep -E "passed|failed|SKIPPED.*wgmma" "$OUT/tests.log" | tail -8
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
  step compute-sanitizer memcheck
  cat > /tmp/sanitize_structured.py <<'PY'
import sys, torch
sys.path.insert(0, "tests/kernels")
from test_bsr_mm import block_sparse_weight, _components
from prunekit import formats
from prunekit.formats.bsr import static_schedule
from prunekit.kernels import structured
wgmma = structured.wgmma_available()
print("wgmma variant available:", wgmma)
for dtype in (torch.float16, torch.bfloat16):
    for r, c in ((16, 16), (32, 64), (64, 16), (64, 32), (64, 64)):
        m, k, n = 4 * r, 3 * c, 37
        dense = block_sparse_weight(m, k, r, c, 0.5, dtype, heavy_rows=1)
        comp = {key: t.cuda() for key, t in _components(dense, r, c).items()}
        sched, split = (t.cuda() for t in static_schedule(comp["crow_indices"], chunk=1))
        x2d = torch.randn(n, k, device="cuda").to(dtype)
        bias = torch.randn(m, device="cuda").to(dtype)
        base = (comp["blocks"], comp["crow_indices"], comp["col_indices"])
        for x in (x2d.t(), x2d.t().contiguous()):
            for tile_n in structured.TILE_NS:
                structured.bsr_mm_cuda(*base, x, m, bias, "relu", tile_n=tile_n, variant="mma")
                structured.bsr_mm_cuda(*base, x, m, bias, "relu", sched, split, tile_n=tile_n, variant="mma")
            if wgmma and (r, c) in structured.WGMMA_BLOCKS:
                for tile_n in structured.WGMMA_TILE_NS:
                    structured.bsr_mm_cuda(*base, x, m, bias, "relu", tile_n=tile_n, variant="wgmma")
                    structured.bsr_mm_cuda(*base, x, m, bias, "relu", sched, split, tile_n=tile_n, variant="wgmma")
            for variant in ("mma", "wgmma") if wgmma and (r, c) in structured.WGMMA_BLOCKS else ("mma",):
                structured.bsr_mm_eager(*base, x, m, bias, "relu", sched, split, variant=variant)
                structured.bsr_mm_eager(*base, x2d[:1].t(), m, bias, "relu", variant=variant)  # N = 1
if structured.cusparselt_available():
    w = torch.randn(128, 64, 4)
    w = (w * torch.zeros_like(w, dtype=torch.bool).scatter_(2, w.abs().topk(2, dim=2).indices, True)).reshape(128, 256)
    e = formats.encode("nm", w.half(), {"n": 2, "m": 4})
    v, md, bits = e.components["values"].cuda(), e.components["metadata"].cuda(), int(e.params["bits"])
    for output in ("row", "col"):
        for n in (1, 16, 37):
            x2d = torch.randn(n, 256, device="cuda", dtype=torch.float16)
            structured.nm_mm_cuda(v, md, x2d.t(), 2, 4, bits, torch.randn(128, device="cuda").half(), "relu", output=output)
torch.cuda.synchronize()
print("sanitize cases ran")
PY
  timeout 150 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 python3 /tmp/sanitize_structured.py \
    > "$OUT/memcheck.log" 2>&1
  echo "compute-sanitizer exit code $?" | tee -a "$OUT/memcheck.log"; grep -E "available|ERROR SUMMARY|ran" "$OUT/memcheck.log" | tail -4
  step host time per call
  cat > /tmp/overhead_structured.py <<'PY'
# Host time per eager call (perf_counter over 400 calls, fewer than the launch queue holds) of each layer of the
# BSR and 2:4 eager paths at a decode shape, to see where eager time goes.
import time, torch, torch.nn.functional as F
from prunekit import formats
from prunekit.deploy.runtime.sparse_linear import SparseLinear
from prunekit.kernels import structured
def host_us(fn, n=400):
    for _ in range(30): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6
torch.manual_seed(0)
m = k = 4096; n = 16; r = 64
keep = torch.rand(m // r, k // r) > 0.9
w = (torch.randn(m, k) * keep.repeat_interleave(r, 0).repeat_interleave(r, 1)).half()
enc = formats.encode("bsr", w, {"block_rows": r, "block_cols": r})
c = {key: t.cuda() for key, t in enc.components.items()}
layer = SparseLinear(enc).cuda()
x2d = torch.randn(n, k, device="cuda", dtype=torch.float16)
y = torch.empty(n, m, device="cuda", dtype=torch.float16).t()
wd = w.cuda()
structured.load()
base = (c["blocks"], c["crow_indices"], c["col_indices"])
rows = {
  "bsr SparseLinear.forward (eager, C++ entry)": lambda: layer(x2d),
  "bsr C++ entry alone (torch.ops.prunekit_structured.bsr_mm)": lambda: torch.ops.prunekit_structured.bsr_mm.default(*base, c["schedule"], c["split_rows"], x2d.t(), m, None, False, 0),
  "bsr structured.bsr_mm_eager": lambda: structured.bsr_mm_eager(*base, x2d.t(), m, None, "none", c["schedule"], c["split_rows"]),
  "bsr structured.bsr_mm_cuda (Python dispatch)": lambda: structured.bsr_mm_cuda(*base, x2d.t(), m, None, "none", c["schedule"], c["split_rows"]),
  "bsr custom op (prunekit::bsr_mm_static)": lambda: structured.bsr_mm_static(*base, c["schedule"], c["split_rows"], x2d.t(), m),
  "bsr bsr_mm_out alone": lambda: torch.ops.prunekit_structured.bsr_mm_out.default(*base, c["schedule"], c["split_rows"], x2d.t(), y, None, False, 32, True, 1),
  "dense F.linear (cuBLAS)": lambda: F.linear(x2d, wd),
  "empty launch reference: torch.empty + add_": lambda: torch.empty(n, m, device="cuda", dtype=torch.float16).add_(1),
}
w24 = torch.randn(m, k // 4, 4)
w24 = (w24 * torch.zeros_like(w24, dtype=torch.bool).scatter_(2, w24.abs().topk(2, dim=2).indices, True)).reshape(m, k).half()
e24 = formats.encode("nm", w24, {"n": 2, "m": 4})
v, md, bits = e24.components["values"].cuda(), e24.components["metadata"].cuda(), int(e24.params["bits"])
print("native cuSPARSELt binding:", structured.native_cslt_available())
if structured.native_cslt_available():
    import os
    wid = structured.native_weight_24(v, md, bits, k).id
    for output in ("row", "col"):
        os.environ[structured.CSLT_OUTPUT_ENV] = output  # read once per layer, on its first call
        layer24 = SparseLinear(e24).cuda()
        layer24(x2d)
        rows[f"2:4 SparseLinear.forward (eager, binding, {output})"] = lambda l=layer24: l(x2d)
        rows[f"2:4 prunekit_cslt.linear alone ({output})"] = lambda o=output: torch.ops.prunekit_cslt.linear.default(wid, x2d.t(), None, False, structured.CSLT_OUTPUTS[o])
        rows[f"2:4 structured.nm_mm_cuda ({output})"] = lambda o=output: structured.nm_mm_cuda(v, md, x2d.t(), 2, 4, bits, output=o)
before = structured.compress_calls
for name, fn in rows.items():
    print(f"{host_us(fn):9.1f} us  {name}")
print("compressions during the loops:", structured.compress_calls - before)
PY
  timeout 90 python3 /tmp/overhead_structured.py > "$OUT/overhead.log" 2>&1; echo "overhead exit code $?"; cat "$OUT/overhead.log"
}

bench_bsr() {
  step bsr benchmark
  local extra=()
  has_arg --time-limit-s "$@" || extra=(--time-limit-s 420)
  timeout 540 python3 benchmarks/bsr.py --out "$OUT/bsr-$DEV-$DATE.json" "${extra[@]}" "$@" > "$OUT/bench_bsr.log" 2>&1
  echo "bsr benchmark exit code $?"; grep -v "^\s*$" "$OUT/bench_bsr.log" | tail -45
}

# CTAs of several output tiles in the wgmma BSR kernels ($PRUNEKIT_BSR_TILES_PER_CTA) and their stages
# ($PRUNEKIT_BSR_STAGES): build, the BSR CUDA tests, a memcheck of grouped tiles, then bsr.py with --tiles-per-cta
# $BSR_TPC x --stages $BSR_STAGES x --wgmma-tile-ns $BSR_TILE_NS at $BSR_TPC_SHAPES (the six points where torch's Triton
# BSR was faster in the thirtieth session) and at $BSR_TPC_CONTROL (large shapes, to see what the rule must leave).
tiles() {
  build
  step tests
  timeout 240 python3 -m pytest -q --maxfail=10 -p no:cacheprovider -rs tests/kernels/test_bsr_mm.py \
    tests/kernels/test_structured_tiling.py ${BSR_TPC_TESTS:-tests/kernels/test_bsr_pdl.py} > "$OUT/tests-bsr.log" 2>&1
  echo "pytest exit code $?"; grep -E "passed|failed" "$OUT/tests-bsr.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/tests-bsr.log" | head -20
  step memcheck of grouped tiles
  cat > /tmp/sanitize_tiles.py <<'PY'
import os, sys, torch
sys.path.insert(0, "tests/kernels")
from test_bsr_mm import block_sparse_weight, _components
from prunekit.formats.bsr import static_schedule
from prunekit.kernels import structured
for per_cta, stages, producer, warp_tile in (("1", "auto", "0", "128"), ("3", "auto", "1", "128"), ("wave", "2", "1", "64")):
    os.environ[structured.TILES_PER_CTA_ENV] = per_cta
    os.environ[structured.STAGES_ENV] = stages
    os.environ[structured.WARP_PRODUCER_ENV] = producer
    os.environ[structured.WARP_TILE_N_ENV] = warp_tile
    for r, c in ((16, 16), (32, 64), (64, 16), (64, 64)):
        m, k, n = 6 * r, 3 * c, 700
        dense = block_sparse_weight(m, k, r, c, 0.5, torch.float16, heavy_rows=1)
        comp = {key: t.cuda() for key, t in _components(dense, r, c).items()}
        sched, split = (t.cuda() for t in static_schedule(comp["crow_indices"], chunk=1))
        x = torch.randn(n, k, device="cuda").half().t()
        bias = torch.randn(m, device="cuda").half()
        base = (comp["blocks"], comp["crow_indices"], comp["col_indices"], x, m, bias, "relu")
        for tile_n in structured.WGMMA_TILE_NS:
            for staged in (True, False):
                structured.bsr_mm_cuda(*base, tile_n=tile_n, staged_epilogue=staged, variant="wgmma")
                structured.bsr_mm_cuda(*base, sched, split, tile_n=tile_n, staged_epilogue=staged, variant="wgmma")
torch.cuda.synchronize()
print("sanitize cases ran")
PY
  timeout 90 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 python3 /tmp/sanitize_tiles.py \
    > "$OUT/memcheck-tiles.log" 2>&1
  echo "compute-sanitizer exit code $?"; grep -E "ERROR SUMMARY|ran" "$OUT/memcheck-tiles.log" | tail -3
  [[ ${BSR_TPC_BENCH:-1} == 0 ]] && return 0  # tests and memcheck only
  step bsr benchmark, tiles per CTA
  timeout "${BSR_TPC_TIMEOUT:-200}" python3 benchmarks/bsr.py --out "$OUT/bsr-tiles-$DEV-$DATE${TAG:-}.json" \
    --shapes "${BSR_TPC_SHAPES:-3072x768}" --any-ns "${BSR_TPC_NS:-2048,4096}" --blocks "${BSR_TPC_BLOCKS:-32,64}" \
    --sparsities "${BSR_TPC_SPARSITIES:-0.9,0.95}" --time-limit-s "${BSR_TPC_TIME_LIMIT:-1e9}" \
    --dtypes float16 --tiles-per-cta "${BSR_TPC:-1,2,wave}" --stages "${BSR_STAGES:-auto,2,3}" \
    ${BSR_WP:+--warp-producer "$BSR_WP"} ${BSR_WT:+--warp-tile-n "$BSR_WT"} --wgmma-tile-ns "${BSR_TILE_NS-128,256}" \
    > "$OUT/bench-tiles.log" 2>&1
  echo "exit code $?"; grep -E "static" "$OUT/bench-tiles.log" | tail -12
  if [[ -n ${BSR_TPC_CONTROL:-11008x4096} ]]; then
    timeout "${BSR_TPC_CONTROL_TIMEOUT:-120}" python3 benchmarks/bsr.py \
      --out "$OUT/bsr-tiles-control-$DEV-$DATE${TAG:-}.json" --shapes "${BSR_TPC_CONTROL:-11008x4096}" \
      --any-ns "${BSR_CONTROL_NS:-2048}" --blocks "${BSR_CONTROL_BLOCKS:-32,64}" --sparsities 0.9,0.95 --dtypes float16 \
      --tiles-per-cta "${BSR_TPC:-1,2,wave}" \
      --stages "${BSR_STAGES:-auto,2,3}" ${BSR_WP:+--warp-producer "$BSR_WP"} ${BSR_WT:+--warp-tile-n "$BSR_WT"} \
      --wgmma-tile-ns "${BSR_TILE_NS-128,256}" > "$OUT/bench-tiles-control.log" 2>&1
    echo "exit code $?"; grep -E "static" "$OUT/bench-tiles-control.log" | tail -8
  fi
  python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("bsr-tiles*.json")):
    for r in json.loads(f.read_text())["results"]:
        tpc = {k[10:-7]: round(v * 1e3, 2) for k, v in r.items() if k.startswith("static_tpc") and k.endswith("_gpu_ms")}
        print(r["m"], r["k"], r["n"], r["block"], r["sparsity"], "static", round(r["static_gpu_ms"] * 1e3, 2),
              "triton", round(r.get("torch_bsr_gpu_ms", float("nan")) * 1e3, 2), "tpc", tpc)
PY
}

bench_nm() {
  step nm benchmark
  local extra=()
  has_arg --time-limit-s "$@" || extra=(--time-limit-s 420)
  timeout 540 python3 benchmarks/nm.py --out "$OUT/nm-$DEV-$DATE.json" "${extra[@]}" "$@" > "$OUT/bench_nm.log" 2>&1
  echo "nm benchmark exit code $?"; tail -30 "$OUT/bench_nm.log"
}

# The cuSPARSELt binding at the large 2:4 GEMMs: build it alone, test_nm_mm.py, benchmarks/nm_configs.py (operand
# layouts, X description, output copy, algorithm ids $NM_ALGS) and benchmarks/nm.py at the large points (0-4).
nmconfigs() {
  step build the cuSPARSELt binding
  timeout 200 python3 -c "from prunekit.kernels import structured; structured.load_cslt(); print('cslt ok')" \
    > "$OUT/build-cslt.log" 2>&1 || { tail -30 "$OUT/build-cslt.log"; return 1; }
  step 2:4 tests
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_nm_mm.py > "$OUT/tests-nm.log" 2>&1
  echo "tests exit code $?"; tail -3 "$OUT/tests-nm.log"
  step cuSPARSELt configurations
  timeout "${NM_CONFIGS_TIMEOUT:-240}" python3 benchmarks/nm_configs.py --out "$OUT/nm-configs-$DEV-$DATE${TAG:+-$TAG}.json" \
    --algs "${NM_ALGS:-0}" --points "${NM_CONFIG_POINTS:-}" > "$OUT/nm-configs.log" 2>&1
  echo "nm_configs exit code $?"; tail -12 "$OUT/nm-configs.log"
  [[ ${NM_BENCH:-1} == 0 ]] || bench_nm --points 0,1,2,3,4 "$@"
}

nm24() {
  step build nm24 + cuSPARSELt binding
  timeout 300 python3 -c "
import time, torch
from prunekit.kernels import nm24, structured
t = time.time(); print(nm24.load(verbose=False), f'{time.time() - t:.1f}s')
t = time.time(); structured.load_cslt(); print('cuSPARSELt binding', f'{time.time() - t:.1f}s')
" > "$OUT/build_nm24.log" 2>&1 || { tail -40 "$OUT/build_nm24.log"; exit 1; }
  tail -2 "$OUT/build_nm24.log"
  step nm24 tests
  timeout 240 python3 -m pytest -q --maxfail=10 -p no:cacheprovider -rs tests/kernels/test_nm24_decode.py \
    tests/kernels/test_nm_mm.py > "$OUT/tests_nm24.log" 2>&1
  echo "pytest exit code $?"; grep -E "passed|failed" "$OUT/tests_nm24.log" | tail -3
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests_nm24.log" | head -20
  step compute-sanitizer memcheck nm24
  cat > /tmp/sanitize_nm24.py <<'PY'
import sys, torch
sys.path.insert(0, "tests/kernels")
from test_nm24_decode import _cuda24, _run_mm
from prunekit.kernels import nm24
nm24.load()
for m, k, n in ((37, 132, 5), (64, 4096, 16), (300, 1000, 9), (2048, 2048, 16)):
    dense, values, metadata, bits = _cuda24(m, k, torch.float16, 1)
    plan = nm24.get_plan(values, metadata, bits, k)
    x = torch.randn(n, k, device="cuda").half().t()
    _run_mm(plan, x, torch.randn(m, device="cuda").half(), True, "t")
print("sanitize run done")
PY
  timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 python3 /tmp/sanitize_nm24.py > "$OUT/memcheck_nm24.log" 2>&1
  echo "memcheck exit code $?"; tail -3 "$OUT/memcheck_nm24.log"
  timeout 180 compute-sanitizer --tool racecheck --error-exitcode 9 python3 /tmp/sanitize_nm24.py > "$OUT/racecheck_nm24.log" 2>&1
  echo "racecheck exit code $?"; tail -3 "$OUT/racecheck_nm24.log"
  nm24_probes "${NM24_PROBES:-1 c0}"
  step nm24 sweep
  timeout 300 python3 benchmarks/nm24_sweep.py --chunks "${NM24_CHUNKS:-auto,32,64}" \
    --out "$OUT/nm24-sweep-$DEV-$DATE.json" > "$OUT/nm24_sweep.log" 2>&1
  echo "sweep exit code $?"; tail -60 "$OUT/nm24_sweep.log"
  nm24_host
  local extra=()
  has_arg --points "$@" || extra=(--points 5,6,7,8,12,13,14,15,16,17)
  bench_nm "${extra[@]}" "$@"
}

nm24_probes() {
  step nm24 probes  # where the time goes: 1 no epilogue, 2 no math, 4 no weight loads (wrong results, timing only)
  mkdir -p "$OUT/probe"
  for probe in $1; do  # c0: the atomic k-chunk reduction instead of clusters
    local env=(PRUNEKIT_NM24_PROBE="$probe")
    [[ $probe == c0 ]] && env=(PRUNEKIT_NM24_PROBE=0 PRUNEKIT_NM24_CLUSTER=0)
    env "${env[@]}" timeout 100 python3 benchmarks/nm24_sweep.py --chunks auto --rings "${PRUNEKIT_NM24_RING:-auto}" --ns 16 \
      --shapes 4096x4096,11008x4096,4096x11008,768x3072 --out "$OUT/probe/nm24-probe$probe.json" > "$OUT/probe_$probe.log" 2>&1
    python3 -c "
import json; d = json.load(open('$OUT/probe/nm24-probe$probe.json'))
print('probe $probe', ' | '.join(f\"{r['m']}x{r['k']} {r['decode_gpu_ms'] * 1e3:.1f} us (dense {r['dense_gpu_ms'] * 1e3:.1f})\" for r in d['results']))"
  done
}

nm24prof() {
  step build nm24
  timeout 300 python3 -c "from prunekit.kernels import nm24; print(nm24.load())" 2>&1 | tail -1
  step nm24 tests
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_nm24_decode.py > "$OUT/tests_nm24.log" 2>&1
  echo "pytest exit code $?"; grep -E "passed|failed|^(FAILED|ERROR)|Error|assert" "$OUT/tests_nm24.log" | head -12
  nm24_probes "${NM24_PROBES:-0 1 2 4 3 6 7}"
  cat > /tmp/profile_nm24.py <<'PY'
import sys, torch
sys.path.insert(0, "tests/kernels")
from test_nm24_decode import _cuda24
from prunekit.kernels import nm24
nm24.load()
m, k, n = (int(v) for v in sys.argv[1:4])
dense, values, metadata, bits = _cuda24(m, k, torch.float16, 1)
x = torch.randn(n, k, device="cuda").half().t()
for _ in range(3):
    nm24.decode_mm(values, metadata, x, bits)
torch.cuda.synchronize()
print("profiled", m, k, n, "chunk", nm24.get_plan(values, metadata, bits, k).chunk)
PY
  local ncu_out="$OUT/ncu-nm24-$DEV-$DATE.txt"
  : > "$ncu_out"
  IFS=';' read -ra CASES <<< "${NM24_PROFILE_CASES:-4096 4096 16}"
  for case in "${CASES[@]}"; do
    echo "=== $case" | tee -a "$ncu_out"
    timeout 150 ncu -k regex:nm24_decode --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
      --section Occupancy --section LaunchStats --section InstructionStats \
      --metrics dram__bytes_read.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
      python3 /tmp/profile_nm24.py $case >> "$ncu_out" 2>&1
    echo "ncu exit code $?" | tee -a "$ncu_out"
  done
  grep -E "===|profiled|Duration|Throughput|DRAM|dram__|inst_executed|stalled|Stall|Occupancy|Registers|Shared Memory|Block Limit|Waves|Eligible|Active Warps|Issued" "$ncu_out" | head -90
  step nm24 sweep
  timeout 200 python3 benchmarks/nm24_sweep.py --chunks "${NM24_CHUNKS:-auto,16,32,64}" \
    --out "$OUT/nm24-sweep-$DEV-$DATE.json" > "$OUT/nm24_sweep.log" 2>&1
  echo "sweep exit code $?"
}

nm24ring() {
  step build nm24
  timeout 300 python3 -c "from prunekit.kernels import nm24; print(nm24.load())" > "$OUT/build_nm24.log" 2>&1 ||
    { tail -40 "$OUT/build_nm24.log"; exit 1; }
  tail -1 "$OUT/build_nm24.log"
  step nm24 tests
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_nm24_decode.py > "$OUT/tests_nm24.log" 2>&1
  echo "pytest exit code $?"; grep -E "passed|failed" "$OUT/tests_nm24.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/tests_nm24.log" | head -12
  step nm24 sweep of ring depths
  timeout 300 python3 benchmarks/nm24_sweep.py --chunks "${NM24_CHUNKS:-auto,64}" --rings "${NM24_RINGS:-3x8,4x4,6x4}" \
    --out "$OUT/nm24-sweep-ring-$DEV-$DATE.json" > "$OUT/nm24_sweep.log" 2>&1
  echo "sweep exit code $?"; tail -100 "$OUT/nm24_sweep.log"
  PRUNEKIT_NM24_RING=${NM24_PROBE_RING:-3x8} nm24_probes "${NM24_PROBES:-1}"
  nm24_host
}

nm24_host() {
  step nm24 host time per call
  timeout 120 python3 benchmarks/nm24_host.py --out "$OUT/nm24-host-$DEV-$DATE.json" > "$OUT/nm24_host.log" 2>&1
  echo "host exit code $?"; tail -50 "$OUT/nm24_host.log"
}

nm24sp() {
  # mma.sp variant of the decode kernel: which metadata layout the GPU reads, the tests of both variants, then the
  # sweep and the decode benchmark with mma.sp in that layout (or timing only, layout "halves", if none matched)
  step build nm24 + cuSPARSELt binding
  timeout 300 python3 -c "
from prunekit.kernels import nm24, structured
print(nm24.load()); structured.load_cslt()" > "$OUT/build_nm24.log" 2>&1 || { tail -40 "$OUT/build_nm24.log"; exit 1; }
  step mma.sp metadata layout
  timeout 120 python3 scripts/nm24_sp_layout.py 2>&1 | tee "$OUT/sp_layout.log" | tail -5
  local layout; layout=$(sed -n 's/^best_layout=//p' "$OUT/sp_layout.log")
  [[ -z $layout || $layout == none ]] && layout=halves
  export PRUNEKIT_NM24_SP_LAYOUT=$layout
  step nm24 tests "(sp layout $layout)"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_nm24_decode.py > "$OUT/tests_nm24.log" 2>&1
  echo "pytest exit code $?"; grep -E "passed|failed" "$OUT/tests_nm24.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/tests_nm24.log" | head -12
  for mma in sp prmt; do
    step "nm24 sweep ($mma)"
    PRUNEKIT_NM24_MMA=$mma timeout 200 python3 benchmarks/nm24_sweep.py --chunks "${NM24_CHUNKS:-auto,16}" \
      --out "$OUT/nm24-sweep-$mma-$DEV-$DATE.json" > "$OUT/nm24_sweep_$mma.log" 2>&1
    echo "sweep exit code $?"
  done
  PRUNEKIT_NM24_MMA=sp bench_nm --points 5,6,7,8,12,13,14,15,16,17
}

# Build (or find in the kernel cache) one library: prunekit.kernels.MODULE.load() (build: SpMM, structured: BSR, nm24).
# Log: $OUT/build_NAME.log, whose last line is the library and the seconds taken. Exit status: the load's.
load_lib() {
  local name=$1 module=$2
  timeout 400 python3 -c "import time; from prunekit.kernels import $module; t = time.time(); print($module.load(), f'{time.time() - t:.1f}s')" \
    > "$OUT/build_$name.log" 2>&1
}

# The tests of FILES whose names contain "lean": log $OUT/tests_NAME.log, the counts and the first failures printed.
lean_tests() {
  local name=$1; shift
  timeout 300 python3 -m pytest -q --maxfail=10 -p no:cacheprovider -k lean "$@" > "$OUT/tests_$name.log" 2>&1
  echo "pytest exit code $?"; grep -E "passed|failed" "$OUT/tests_$name.log" | tail -2
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests_$name.log" | head -20
}

# compute-sanitizer memcheck and racecheck of one script: logs $OUT/{memcheck,racecheck}_NAME.log
sanitize() {
  local name=$1 script=$2
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 python3 "$script" > "$OUT/${tool}_$name.log" 2>&1
    echo "$tool exit code $?"; tail -2 "$OUT/${tool}_$name.log"
  done
}

# Writes /tmp/sanitize_lean.py: small lean 2:4 and bitmap decode calls at every forced shape (the bitmap kernel at the
# one-strip shapes), for sanitize.
lean_sanitize_script() {
  cat > /tmp/sanitize_lean.py <<'PY'
import os, sys, torch
sys.path.insert(0, "tests/kernels")
from test_nm24_decode import _cuda24, _run_mm
from prunekit.kernels import nm24
os.environ[nm24.LEAN_ENV] = "1"
nm24.load()
from prunekit.kernels import gpu
from prunekit.kernels.testing import random_spmm_case
for warps in ("1", "4", "6", "8", "4x2"):
    os.environ[nm24.LEAN_WARPS_ENV] = warps
    for m, k, n in ((37, 132, 5), (64, 4096, 16), (300, 1000, 9)):
        dense, values, metadata, bits = _cuda24(m, k, torch.float16, 1)
        plan = nm24.get_plan(values, metadata, bits, k)
        x = torch.randn(n, k, device="cuda").half().t()
        _run_mm(plan, x, torch.randn(m, device="cuda").half(), True, "t")
        if "x" not in warps:  # the bitmap kernel has one strip per block
            _, c, x2d, bias = random_spmm_case(m, k, n, 0.85, 2, torch.float16, m + k, "cuda")
            gpu.spmm_csr(**c, x=x2d.t(), m=m, bias=bias, activation="relu", variant="bitmap")
torch.cuda.synchronize()
print("sanitize run done")
PY
}

# The lean 2:4 and bitmap decode kernels (forced on with $PRUNEKIT_NM24_LEAN=1, as in their tests; the default at
# K <= 1024 since the nineteenth session): build nm24 (and the SpMM and BSR libraries beside it), their tests (float64, layer, graph, PDL chains), memcheck
# and racecheck of small cases, then the 2:4 sweep of the ring kernel against the lean one at $NM24_LEAN_WARPS, N in
# $NM24_LEAN_NS, the five decode shapes (the bitmap timings: bitmaplean).
nm24lean() {
  # the BSR library builds beside it (bsrlean, the next call on the warm machine, then finds it in the kernel cache;
  # NM24LEAN_PREBUILD_BSR=0: not)
  local bsr_pid="" ext_pid=""
  if [[ ${NM24LEAN_PREBUILD_BSR:-1} == 1 ]]; then
    load_lib bsr structured &
    bsr_pid=$!
  fi
  load_lib ext build &  # the SpMM library: the bitmap tests go through gpu.spmm_csr, which loads it
  ext_pid=$!
  step build nm24
  load_lib nm24 nm24 || { tail -40 "$OUT/build_nm24.log"; exit 1; }
  tail -1 "$OUT/build_nm24.log"
  wait "$ext_pid"; echo "SpMM library build exit code $?"; tail -1 "$OUT/build_ext.log"
  step lean kernel tests
  lean_tests lean tests/kernels/test_nm24_decode.py tests/kernels/test_nm24_pdl.py tests/kernels/test_spmm_bitmap.py
  step compute-sanitizer memcheck and racecheck, lean kernel
  lean_sanitize_script
  sanitize lean /tmp/sanitize_lean.py
  step lean vs ring sweep
  timeout 300 python3 benchmarks/nm24_sweep.py --chunks auto --ns "${NM24_LEAN_NS:-2,8,16}" \
    --lean-warps "${NM24_LEAN_WARPS:-auto,2,4,8,2x2,4x2}" --out "$OUT/nm24-sweep-lean-$DEV-$DATE.json" > "$OUT/nm24_sweep_lean.log" 2>&1
  echo "sweep exit code $?"; tail -70 "$OUT/nm24_sweep_lean.log"
  python3 benchmarks/lean_compare.py nm24 "$OUT/nm24-sweep-lean-$DEV-$DATE.json" 2>&1 | tail -30
  if [[ -n $bsr_pid ]]; then
    wait "$bsr_pid"; echo "BSR library build (for bsrlean) exit code $?"; tail -1 "$OUT/build_bsr.log"
  fi
}

# The lean BSR decode kernel (the default at N <= 16 since the nineteenth session; $PRUNEKIT_BSR_LEAN=1 / 0): build,
# its tests, memcheck and racecheck of small cases, then benchmarks/bsr.py at N = 16 on the two decode shapes with the
# lean kernel (torch's Triton BSR in the same run) and without it.
bsrlean() {
  step build the BSR library
  load_lib bsr structured || { tail -40 "$OUT/build_bsr.log"; exit 1; }
  tail -1 "$OUT/build_bsr.log"
  step lean BSR tests
  lean_tests bsr_lean tests/kernels/test_bsr_mm.py
  step compute-sanitizer memcheck and racecheck, lean BSR kernel
  cat > /tmp/sanitize_bsr_lean.py <<'PY'
import os, sys, torch
sys.path.insert(0, "tests/kernels")
from test_bsr_mm import _components, block_sparse_weight
from prunekit.kernels import structured
os.environ[structured.LEAN_ENV] = "1"
for m, k, r, c, density in ((192, 256, 16, 16, 0.4), (192, 256, 32, 32, 0.4), (192, 256, 64, 64, 0.4),
                            (192, 256, 32, 16, 0.4), (256, 4800, 16, 16, 0.05)):  # the last: a 300-block row
    dense = block_sparse_weight(m, k, r, c, density, torch.float16, "cuda", seed=1, heavy_rows=1)
    comp = {key: v.cuda() for key, v in _components(dense.cpu(), r, c).items()}
    for n in (3, 16):
        x = torch.randn(n, k, device="cuda").half().t()
        structured.bsr_mm_cuda(comp["blocks"], comp["crow_indices"], comp["col_indices"], x, m,
                               torch.randn(m, device="cuda").half(), "relu")
torch.cuda.synchronize()
print("sanitize run done")
PY
  sanitize bsr_lean /tmp/sanitize_bsr_lean.py
  local grid=(--shapes "${BSR_LEAN_SHAPES:-4096x4096,11008x4096}" --ns "${BSR_LEAN_NS:-16}" --blocks "${BSR_LEAN_BLOCKS:-16,32,64}"
    --sparsities 0.9,0.95)
  step bsr.py with the lean kernel
  PRUNEKIT_BSR_LEAN=1 timeout 240 python3 benchmarks/bsr.py "${grid[@]}" --out "$OUT/bsr-decode-lean-$DEV-$DATE.json" \
    > "$OUT/bench_bsr_lean.log" 2>&1
  echo "bsr (lean) exit code $?"; grep -v "^\s*$" "$OUT/bench_bsr_lean.log" | tail -20
  step bsr.py without it
  PRUNEKIT_BSR_LEAN=0 timeout 200 python3 benchmarks/bsr.py "${grid[@]}" --no-torch-bsr \
    --out "$OUT/bsr-decode-tiled-$DEV-$DATE.json" > "$OUT/bench_bsr_tiled.log" 2>&1
  echo "bsr (tiled) exit code $?"; grep -v "^\s*$" "$OUT/bench_bsr_tiled.log" | tail -20
  python3 benchmarks/lean_compare.py bsr "$OUT/bsr-decode-lean-$DEV-$DATE.json" "$OUT/bsr-decode-tiled-$DEV-$DATE.json" 2>&1 | tail -30
}

# The lean bitmap decode kernel against the ring kernel: benchmarks/spmm.py, forced bitmap, with $PRUNEKIT_NM24_LEAN=1
# and without (tests: nm24lean). Builds prunekit_ext and nm24 (cache hits after nm24lean on the warm machine).
bitmaplean() {
  local grid=(--shapes "${BITMAP_LEAN_SHAPES:-4096x4096,11008x4096,4096x11008,768x3072,3072x768}" --ns "${BITMAP_LEAN_NS:-2,8,16}"
    --sparsities "${BITMAP_LEAN_SPARSITIES:-0.8,0.9}" --dtypes float16 --forced bitmap)
  # the ring kernel (lean0), then the lean kernel at each warps setting of $BITMAP_LEAN_WARPS (lean1-<warps>)
  local runs=("0:auto")
  for warps in ${BITMAP_LEAN_WARPS:-auto 8}; do runs+=("1:$warps"); done
  for run in "${runs[@]}"; do
    local lean=${run%%:*} warps=${run#*:} tag
    tag=lean$lean$([[ $lean == 1 ]] && echo "-$warps")
    step "spmm.py, forced bitmap, PRUNEKIT_NM24_LEAN=$lean, warps $warps"
    PRUNEKIT_NM24_LEAN=$lean PRUNEKIT_NM24_LEAN_WARPS=$warps timeout 200 python3 benchmarks/spmm.py "${grid[@]}" \
      --out "$OUT/spmm-bitmap-$tag-$DEV-$DATE.json" > "$OUT/bench_bitmap_$tag.log" 2>&1
    echo "spmm.py exit code $?"; grep -v "^\s*$" "$OUT/bench_bitmap_$tag.log" | tail -12
    if [[ $lean == 1 ]]; then
      python3 benchmarks/lean_compare.py bitmap "$OUT/spmm-bitmap-$tag-$DEV-$DATE.json" \
        "$OUT/spmm-bitmap-lean0-$DEV-$DATE.json" 2>&1 | tail -40
    fi
  done
}

# The lean kernels' measured defaults (nineteenth session: BSR lean at N <= 16; 2:4 and bitmap lean at K <= 1024):
# builds the three libraries, memcheck and racecheck of the lean 2:4 and bitmap kernels at every
# forced shape, bsr.py at N = 1 / 16 and 50 / 70% block sparsity with and without the lean BSR kernel (the rule's
# unmeasured range), spmm.py's own choice at 3072 x 768 (N 2-16), then nm.py at the decode points, all as users get them.
# LEAN_DEFAULTS_BSR=0 leaves out the BSR library and bsr.py; LEAN_DEFAULTS_TESTS=1 adds the lean 2:4 / bitmap tests.
leandefaults() {
  local bsr=${LEAN_DEFAULTS_BSR:-1} bsr_pid="" ext_pid
  if [[ $bsr == 1 ]]; then
    load_lib bsr structured &
    bsr_pid=$!
  fi
  load_lib ext build &
  ext_pid=$!
  step build nm24, SpMM, BSR
  load_lib nm24 nm24 || { tail -40 "$OUT/build_nm24.log"; exit 1; }
  wait "$ext_pid"; echo "SpMM library build exit code $?"
  if [[ ${LEAN_DEFAULTS_TESTS:-0} == 1 ]]; then
    step lean kernel tests
    lean_tests lean tests/kernels/test_nm24_decode.py tests/kernels/test_nm24_pdl.py tests/kernels/test_spmm_bitmap.py
  fi
  step compute-sanitizer memcheck and racecheck, lean 2:4 and bitmap kernels
  lean_sanitize_script
  sanitize lean /tmp/sanitize_lean.py
  [[ $bsr == 1 ]] && leandefaults_bsr "$bsr_pid"
  leandefaults_spmm_nm
}

# leandefaults' BSR part: bsr.py at N = 1 / 16 and 50 / 70%, lean and tiled, after the BSR build (pid $1).
leandefaults_bsr() {
  wait "$1"; echo "BSR library build exit code $?"
  local grid=(--shapes "${LEAN_DEFAULTS_BSR_SHAPES:-4096x4096,3072x768}" --ns 1,16 --blocks 16,32,64 --sparsities 0.5,0.7)
  step bsr.py, N = 1 / 16, 50 / 70%, lean and tiled
  PRUNEKIT_BSR_LEAN=1 timeout 150 python3 benchmarks/bsr.py "${grid[@]}" --out "$OUT/bsr-decode-lowsp-lean-$DEV-$DATE.json" \
    > "$OUT/bench_bsr_lowsp_lean.log" 2>&1
  echo "bsr (lean) exit code $?"
  PRUNEKIT_BSR_LEAN=0 timeout 120 python3 benchmarks/bsr.py "${grid[@]}" --no-torch-bsr \
    --out "$OUT/bsr-decode-lowsp-tiled-$DEV-$DATE.json" > "$OUT/bench_bsr_lowsp_tiled.log" 2>&1
  echo "bsr (tiled) exit code $?"
  python3 benchmarks/lean_compare.py bsr "$OUT/bsr-decode-lowsp-lean-$DEV-$DATE.json" \
    "$OUT/bsr-decode-lowsp-tiled-$DEV-$DATE.json" 2>&1 | tail -30
}

# leandefaults' SpMM and 2:4 part: spmm.py at 3072 x 768 ("auto"), nm.py at the decode points.
leandefaults_spmm_nm() {
  step "spmm.py at 3072 x 768, the launcher's own choice"
  timeout 120 python3 benchmarks/spmm.py --shapes 3072x768 --ns "${LEAN_DEFAULTS_SPMM_NS:-2,4,8,16}" \
    --sparsities "${LEAN_DEFAULTS_SPMM_SPARSITIES:-0.8,0.9}" --dtypes float16 \
    --out "$OUT/spmm-decode3072-$DEV-$DATE.json" > "$OUT/bench_spmm_3072.log" 2>&1
  echo "spmm.py exit code $?"; grep -v "^\s*$" "$OUT/bench_spmm_3072.log" | tail -14
  step nm.py at the decode points
  timeout 150 python3 benchmarks/nm.py --points "${LEAN_DEFAULTS_NM_POINTS:-5,6,7,8,12,13,14,15,16,17}" \
    --time-limit-s 120 --out "$OUT/nm-decode-$DEV-$DATE.json" > "$OUT/bench_nm_decode.log" 2>&1
  echo "nm.py exit code $?"; grep -v "^\s*$" "$OUT/bench_nm_decode.log" | tail -16
}

case $MODE in
  build-test) build; build_test ;;
  tiles) tiles ;;
  nm24lean) nm24lean ;;
  bsrlean) bsrlean ;;
  bitmaplean) bitmaplean ;;
  leandefaults) leandefaults ;;
  nm24sp) nm24sp ;;
  nm24ring) nm24ring ;;
  nm24prof) nm24prof ;;
  nm24) nm24 "$@" ;;
  bsr) build; bench_bsr "$@" ;;
  nm) build; bench_nm "$@" ;;
  nmconfigs) nmconfigs "$@" ;;
  all) build; build_test; bench_bsr "$@"; bench_nm ;;
  *) echo "usage: $0 build-test|bsr|nm|nmconfigs|nm24|nm24sp|nm24ring|nm24prof|nm24lean|bsrlean|bitmaplean|leandefaults|all [benchmark args]" >&2; exit 2 ;;
esac
step done
