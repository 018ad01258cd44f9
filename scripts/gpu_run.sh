#!/usr/bin/env bash
# One GPU-machine run for issue 4: build the kernels, run the kernel tests, `kernels check`, a compute-sanitizer
# memcheck of a small case, then the SpMM benchmark. Logs and JSON go to $OUT (or ./out).
#
#   scripts/gpu_run.sh [all|test|bench|variants|sanitize|tc|profile|tcloop|decode|...] [extra benchmark args...]
#
# `profile`: tc GPU tests at both prefetch depths, Nsight Compute reports of the tc kernel at 4096x4096, N = 4096
# (90% at depths 2 and 6, 95%), and the tc benchmark at both depths.
#
# `tcloop`: the tc tests with the first design's loop (PRUNEKIT_TC_PREFETCH=0), then the tc benchmark for the loop
# (first design / ring depth 6 / ring depth 2) x the plan's row reordering (on / off): which change cost the 9-10%.
#
# `tc` (tensor-core SpMM, one 10-minute device call): build, the tc GPU tests, a compute-sanitizer memcheck of small
# tc cases, and a short benchmark (4096x4096 and 11008x4096 at N = 4096, 90/95/98%, fp16; dense cuBLAS, torch.sparse,
# auto, tc and direct in the same run) into $OUT/spmm-tc-<dev>-<date>.json.
#
# `decode`: decode_chain.py (q / k / v and MLP blocks, PDL on and off), spmm.py --overhead at the decode points
# (N = 1 / 4 / 16, 80 / 90%) and a compute-sanitizer memcheck of the bitmap eager entry's tests. Build first.
#
# `spmv`: the N = 1 kernel (csrc/spmv_csr.cu): tests, memcheck, spmm.py at N = 1 with it (PDL on / off) and without.
#
# `spmv24`: the 2:4 N = 1 kernel (csrc/structured/nm24/nm24_spmv.cu): tests, memcheck, nm.py at N = 1 with it and
# without it, decode MLP chains at N = 1.
#
# `wide`: the bitmap kernel at N > 16: tests, memcheck, spmm.py at N = 32-256 (bitmap, direct, tc forced). Build first.
#
# `decodegrid`: spmm.py over the decode grid (N = 1 / 2 / 4 / 8 / 16, 70-95%, --overhead) and the MLP and q / k / v
# chains.
#
# `bitmap` (decode bitmap SpMM, variant "bitmap"): build, its GPU tests, sanitizers, decode benchmark ($BITMAP_SHAPES,
# $BITMAP_NS, $BITMAP_SPARSITIES) into $OUT/spmm-bitmap-<dev>-<date>.json.
#
# `scatter` (decode tensor-core SpMM, spmm_scatter.cu): build, its GPU tests, compute-sanitizer memcheck and racecheck
# of small scatter cases, then the decode benchmark (5 shapes, N = 1 / 16, fp16; dense, torch.sparse, auto, scatter
# and rowwarp forced in one run) into $OUT/spmm-scatter-<dev>-<date>.json, then the same with 16-row strips
# (PRUNEKIT_SCATTER_ROWS=16) into $OUT/spmm-scatter16-<dev>-<date>.json, and N = 16 with the k-splits reduced in
# thread-block clusters (PRUNEKIT_SCATTER_CLUSTER=1) into $OUT/spmm-scattercl-<dev>-<date>.json. Extra args go to the
# benchmarks.
#
# Run from the repository root on a machine with a CUDA GPU, nvcc and ninja (no install needed: PYTHONPATH=src).
set -uo pipefail
MODE=${1:-all}
shift || true
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# shellcheck source=scripts/out_pack.sh
source "$(dirname "${BASH_SOURCE[0]}")/out_pack.sh"; trap out_pack EXIT  # <= 8 files in $OUT
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export PRUNEKIT_KERNEL_CACHE=${PRUNEKIT_KERNEL_CACHE:-$PWD/.carry/kernel-cache}
export PRUNEKIT_CUDA_ARCHS=${PRUNEKIT_CUDA_ARCHS:-90}  # the H100/H200 only: half the build time (sm_80 is compile-checked by scripts/compile_check.py)
export MAX_JOBS=${MAX_JOBS:-8}
DATE=$(date -u +%Y-%m-%d)
DEV=$(python3 -c "import torch; n=torch.cuda.get_device_name(0).lower(); print('h100' if 'h100' in n else 'h200' if 'h200' in n else n.replace(' ', '-'))")

step() { echo "=== $* ($(date -u +%H:%M:%S))"; }

# compute-sanitizer memcheck and racecheck of a decode SpMM variant ($1: scatter or bitmap) on small cases: empty and
# single-entry rows, a dense weight, N = 1 / 16, both X layouts, fp16 / bf16. Logs: $OUT/$1-{memcheck,racecheck}.log.
sanitize_decode() {
  cat > /tmp/sanitize_decode.py <<'PY'
import sys, torch
from prunekit.kernels import gpu
from prunekit.kernels.testing import encode_csr, random_sparse_weight
for dtype in (torch.float16, torch.bfloat16):
    for m, k, sp in ((45, 301, 0.8), (300, 2500, 0.9), (40, 200, 0.0)):
        w = random_sparse_weight(m, k, sp, dtype, "cuda", empty_rows=9, single_rows=2)
        c = encode_csr(w)
        for n in (1, 16):
            x2d = torch.randn(n, k, device="cuda").to(dtype)
            for x in (x2d.t(), x2d.t().contiguous()):
                gpu.spmm_csr(**c, x=x, m=m, bias=torch.randn(m, device="cuda").to(dtype), activation="relu",
                             variant=sys.argv[1])
torch.cuda.synchronize()
print("sanitize case ran")
PY
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 /tmp/sanitize_decode.py "$1" \
      > "$OUT/$1-$tool.log" 2>&1
    echo "compute-sanitizer $tool exit code $?" | tee -a "$OUT/$1-$tool.log"
    tail -3 "$OUT/$1-$tool.log"
  done
}

step build
/usr/bin/time -f "build wall %es" python3 -c "
import logging, time; logging.basicConfig(level=logging.INFO)
from prunekit.kernels import build
t = time.time(); print(build.load(verbose=False), f'{time.time() - t:.1f}s')" 2>&1 | tee "$OUT/build.log" || exit 1

if [[ $MODE == all || $MODE == test ]]; then
  step tests
  # Issue 4's tests only (tests/kernels also holds other issues' kernels, whose failures must not mask ours).
  # PRUNEKIT_SPMM_CPP=1 for these tests only: the runtime's eager CSR layers take the C++ entry (spmm_entry.cu).
  PRUNEKIT_SPMM_CPP=1 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_build.py \
    tests/kernels/test_cli_kernels.py tests/kernels/test_ops_cpu.py tests/kernels/test_reference.py \
    tests/kernels/test_spmm_csr_cuda.py tests/kernels/test_sddmm_csr_cuda.py tests/kernels/test_spmm_tc.py \
    tests/kernels/test_spmm_entry.py 2>&1 | tee "$OUT/tests.log" | tail -25
  step check
  python3 -c "from prunekit.cli_kernels import app; app()" check 2>&1 | tee "$OUT/check.log"
fi

if [[ $MODE == all || $MODE == sanitize ]]; then
  step compute-sanitizer memcheck
  cat > /tmp/sanitize_case.py <<'PY'
import torch
from prunekit.kernels import gpu
from prunekit.kernels.testing import encode_csr, random_sparse_weight
for dtype in (torch.float16, torch.float32):
    w = random_sparse_weight(45, 77, 0.8, dtype, "cuda", empty_rows=2, single_rows=2)
    c = encode_csr(w)
    x2d = torch.randn(16, 77, device="cuda").to(dtype)
    for variant in ("rowwarp", "rowwarp_global", "direct", "tiled"):
        for x in (x2d.t(), x2d.t().contiguous()):
            gpu.spmm_csr(**c, x=x, m=45, bias=torch.randn(45, device="cuda").to(dtype), activation="relu", variant=variant)
    gpu.sddmm_csr(c["row_offsets"], c["column_indices"], c["row_indices"], torch.randn(45, 13, device="cuda").to(dtype),
                  torch.randn(77, 13, device="cuda").to(dtype))
torch.cuda.synchronize()
print("sanitize case ran")
PY
  timeout 150 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 python3 /tmp/sanitize_case.py \
    > "$OUT/memcheck.log" 2>&1
  echo "compute-sanitizer exit code $?" | tee -a "$OUT/memcheck.log"
  tail -4 "$OUT/memcheck.log"
fi

if [[ $MODE == scatter ]]; then
  step scatter tests
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_spmm_scatter.py 2>&1 | tee "$OUT/scatter-tests.log" | tail -25
  step scatter compute-sanitizer
  sanitize_decode scatter
  step scatter benchmark
  python3 benchmarks/spmm.py --out "$OUT/spmm-scatter-$DEV-$DATE.json" --dtypes float16 --ns 1,16 \
    --sparsities 0.5,0.7,0.8,0.9,0.95,0.98 "$@" 2>&1 | tee "$OUT/scatter-bench.log" | tail -60
  if [[ ${SCATTER16:-1} != 0 ]]; then  # SCATTER16=0 skips the 16-row strips (measured slower, docs/KERNELS.md)
    step "scatter benchmark, 16-row strips (PRUNEKIT_SCATTER_ROWS=16)"
    PRUNEKIT_SCATTER_ROWS=16 python3 benchmarks/spmm.py --out "$OUT/spmm-scatter16-$DEV-$DATE.json" --dtypes float16 \
      --ns 1,16 --sparsities 0.5,0.7,0.8,0.9,0.95,0.98 "$@" > "$OUT/scatter16-bench.log" 2>&1
    echo "exit code $?"
  fi
  step "scatter benchmark, k-splits reduced in clusters (PRUNEKIT_SCATTER_CLUSTER=1)"
  PRUNEKIT_SCATTER_CLUSTER=1 python3 benchmarks/spmm.py --out "$OUT/spmm-scattercl-$DEV-$DATE.json" --dtypes float16 \
    --ns 16 --sparsities 0.5,0.7,0.8,0.9 "$@" > "$OUT/scattercl-bench.log" 2>&1
  echo "exit code $?"
fi

if [[ $MODE == bitmap ]]; then
  # Decode bitmap SpMM (spmm_bitmap_plan.py + the nm24 library's variant 2): both libraries, its GPU tests,
  # compute-sanitizer memcheck and racecheck of small cases, then the decode benchmark (dense, torch.sparse, auto,
  # scatter, rowwarp and bitmap forced in one run; $BITMAP_SHAPES, N = $BITMAP_NS, $BITMAP_SPARSITIES, fp16) into
  # $OUT/spmm-bitmap-<dev>-<date>.json. Extra args go to the benchmark.
  step build nm24
  timeout 300 python3 -c "from prunekit.kernels import nm24; print(nm24.load())" > "$OUT/build-nm24.log" 2>&1 ||
    { tail -40 "$OUT/build-nm24.log"; exit 1; }
  step bitmap tests
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_spmm_bitmap.py \
    tests/kernels/test_spmm_bitmap_plan.py tests/kernels/test_nm24_decode.py 2>&1 | tee "$OUT/bitmap-tests.log" | tail -15
  step bitmap compute-sanitizer
  sanitize_decode bitmap
  step bitmap benchmark
  timeout 400 python3 benchmarks/spmm.py --out "$OUT/spmm-bitmap-$DEV-$DATE.json" --dtypes float16 \
    --shapes "${BITMAP_SHAPES:-4096x4096,11008x4096}" --ns "${BITMAP_NS:-16}" \
    --sparsities "${BITMAP_SPARSITIES:-0.5,0.7,0.8,0.9,0.95}" "$@" 2>&1 | tee "$OUT/bitmap-bench.log" | tail -30
fi

if [[ $MODE == decode ]]; then
  # decode end to end: the q / k / v and MLP chains (PDL on / off), the host overhead of each call layer at the decode
  # points, and a compute-sanitizer memcheck of the bitmap kernel's eager C++ entry (SparseLinear -> bitmap_linear)
  step decode chains
  python3 benchmarks/decode_chain.py --block qkv --out "$OUT/decode-chain-qkv-$DEV-$DATE.json" "$@"
  python3 benchmarks/decode_chain.py --block mlp --out "$OUT/decode-chain-mlp-$DEV-$DATE.json" "$@"
  step decode overhead
  python3 benchmarks/spmm.py --overhead --dtypes float16 --shapes 4096x4096,11008x4096,4096x11008,768x3072,3072x768 \
    --ns 1,4,16 --sparsities 0.8,0.9 --time-budget-s 240 --out "$OUT/spmm-overhead-$DEV-$DATE.json"
  step bitmap_linear compute-sanitizer memcheck
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_spmm_bitmap.py -k "entry" > "$OUT/bitmap-linear-memcheck.log" 2>&1
  echo "compute-sanitizer memcheck exit code $?" | tee -a "$OUT/bitmap-linear-memcheck.log"
  tail -3 "$OUT/bitmap-linear-memcheck.log"
fi

if [[ $MODE == spmv ]]; then
  # N = 1 (csrc/spmv_csr.cu): its tests and rowwarp's, a compute-sanitizer memcheck of its small cases, then the decode
  # benchmark at N = 1 with it ($PRUNEKIT_SPMV=1, PDL on and off) and without it (rowwarp's own kernel), one JSON each.
  step spmv tests
  [[ -n ${SPMV_SKIP_TESTS:-} ]] || python3 -m pytest -q -p no:cacheprovider tests/kernels/test_spmv.py tests/kernels/test_spmm_csr_cuda.py \
    tests/kernels/test_spmm_entry.py 2>&1 | tail -15
  step spmv compute-sanitizer memcheck
  [[ -n ${SPMV_SKIP_TESTS:-} ]] || timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_spmv.py -k "matches_float64 or strided or several" > "$OUT/spmv-memcheck.log" 2>&1
  echo "compute-sanitizer memcheck exit code $?" | tee -a "$OUT/spmv-memcheck.log"
  tail -3 "$OUT/spmv-memcheck.log"
  for cfg in ${SPMV_CONFIGS:-"spmv:PRUNEKIT_SPMV=1" "spmvnopdl:PRUNEKIT_SPMV_PDL=0" "rowwarp:PRUNEKIT_SPMV=0"}; do
    name=${cfg%%:*}
    step "N = 1 benchmark, $name"
    env $(tr , " " <<< "${cfg#*:}") python3 benchmarks/spmm.py --dtypes float16 --ns 1 --sparsities ${SPMV_SPARSITIES:-0.7,0.8,0.9,0.95} \
      --out "$OUT/spmm-n1-$name-$DEV-$DATE.json" "$@" | tail -${SPMV_TAIL:-3}
  done
fi

if [[ $MODE == wide ]]; then
  # The bitmap kernel at N > 16 (blocks of 64 tokens over grid z): its tests, a compute-sanitizer memcheck of the wide
  # cases (clusters, atomics with the per-call workspace), then spmm.py at $WIDE_NS (default 32 / 64 / 128 / 256), where
  # the bitmap, direct and tc kernels are forced beside "auto", dense cuBLAS and torch.sparse. Build both libraries first
  # (NAMESPACES="prunekit_ext prunekit_nm24" bash scripts/gpu_session.sh build).
  step wide tests
  [[ -n ${WIDE_SKIP_TESTS:-} ]] || python3 -m pytest -q -p no:cacheprovider tests/kernels/test_spmm_bitmap.py 2>&1 | tail -15
  step wide compute-sanitizer memcheck
  [[ -n ${WIDE_SKIP_TESTS:-} ]] || timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/kernels/test_spmm_bitmap.py -k "wide_n_k_chunks or (wide_n_matches and float16 and transposed)" \
    > "$OUT/wide-memcheck.log" 2>&1
  echo "compute-sanitizer memcheck exit code $?" | tee -a "$OUT/wide-memcheck.log"
  tail -3 "$OUT/wide-memcheck.log"
  step wide benchmark
  python3 benchmarks/spmm.py --dtypes float16 --ns "${WIDE_NS:-32,64,128,256}" \
    --sparsities "${WIDE_SPARSITIES:-0.7,0.8,0.9,0.95}" --time-budget-s "${WIDE_BUDGET_S:-300}" \
    --out "$OUT/spmm-wide${WIDE_TAG:-}-$DEV-$DATE.json" "$@" | tail -${WIDE_TAIL:-3}
fi

if [[ $MODE == spmv24 ]]; then
  # N = 1 for 2:4 (csrc/structured/nm24/nm24_spmv.cu): its tests with the decode kernel's, a compute-sanitizer memcheck
  # of its small cases, benchmarks/nm.py at the five N = 1 points with it and without it ($PRUNEKIT_NM24_SPMV=0: the
  # tensor-core decode kernel), and decode MLP chains at N = 1 (dense, 2:4).
  step spmv24 tests
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_nm24_spmv.py tests/kernels/test_nm24_decode.py \
    tests/kernels/test_nm24_pdl.py 2>&1 | tail -15
  step spmv24 compute-sanitizer memcheck
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_nm24_spmv.py -k "matches_float64 or strided or several" > "$OUT/spmv24-memcheck.log" 2>&1
  echo "compute-sanitizer memcheck exit code $?" | tee -a "$OUT/spmv24-memcheck.log"
  tail -3 "$OUT/spmv24-memcheck.log"
  for cfg in spmv24:1 decode:0; do
    step "2:4 N = 1 benchmark, ${cfg%%:*}"
    PRUNEKIT_NM24_SPMV=${cfg#*:} python3 benchmarks/nm.py --points 8,12,13,15,17 \
      --out "$OUT/nm-n1-${cfg%%:*}-$DEV-$DATE.json" | tail -12
  done
  step "decode chain, N = 1"
  python3 benchmarks/decode_chain.py --kinds dense,nm --ns 1 --out "$OUT/decode-chain-n1-$DEV-$DATE.json"
fi

if [[ $MODE == decodegrid ]]; then
  # the decode grid as "auto" runs it (5 shapes x N = 1 / 2 / 4 / 8 / 16 x 70-95%, fp16, forced variants beside), then
  # the MLP and q / k / v chains at N = 1 / 16 (dense, CSR 90%, 2:4). Build prunekit_ext, prunekit_nm24 and
  # prunekit_structured first.
  step decode grid
  python3 benchmarks/spmm.py --dtypes float16 --ns ${GRID_NS:-1,2,4,8,16} --sparsities ${GRID_SPARSITIES:-0.7,0.8,0.9,0.95} \
    --overhead --out "$OUT/spmm-decode-$DEV-$DATE.json" "$@" | tail -3
  step decode chains
  python3 benchmarks/decode_chain.py --block mlp --out "$OUT/decode-chain-mlp-$DEV-$DATE.json" | tail -16
  python3 benchmarks/decode_chain.py --block qkv --out "$OUT/decode-chain-qkv-$DEV-$DATE.json" | tail -16
fi

if [[ $MODE == bitmapsweep ]]; then
  # The bitmap decode kernel under settings read from the environment, one benchmark run each, into
  # $OUT/spmm-bitmap-<name>-<dev>-<date>.json: $BITMAP_CONFIGS is a space-separated list of name:VAR=value,VAR=value
  # (e.g. "c16:PRUNEKIT_NM24_CHUNK=16 p1:PRUNEKIT_NM24_PROBE=1"; "base:" for none; each run stops after
  # $BITMAP_SWEEP_TIMEOUT_S, default 120). Probes give wrong results.
  step build nm24
  timeout 300 python3 -c "from prunekit.kernels import nm24; print(nm24.load())" > "$OUT/build-nm24.log" 2>&1 ||
    { tail -40 "$OUT/build-nm24.log"; exit 1; }
  if [[ ${BITMAP_TESTS:-1} != 0 ]]; then
    step bitmap tests
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_spmm_bitmap.py 2>&1 |
      tee "$OUT/bitmap-tests.log" | tail -4
  fi
  for cfg in ${BITMAP_CONFIGS:-base:}; do
    name=${cfg%%:*}
    vars=${cfg#*:}
    step "bitmap sweep $name ($vars)"
    env ${vars//,/ } timeout "${BITMAP_SWEEP_TIMEOUT_S:-120}" python3 benchmarks/spmm.py --out "$OUT/spmm-bitmap-$name-$DEV-$DATE.json" \
      --dtypes float16 --shapes "${BITMAP_SHAPES:-4096x4096,11008x4096}" --ns "${BITMAP_NS:-1,16}" \
      --sparsities "${BITMAP_SPARSITIES:-0.8,0.9}" "$@" > "$OUT/bitmap-sweep-$name.log" 2>&1
    echo "exit code $?"
    python3 - "$OUT/spmm-bitmap-$name-$DEV-$DATE.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"  {r['m']}x{r['k']} N={r['n']} sp={r['sparsity']}: bitmap {1e3 * r['bitmap_gpu_ms']:.1f} us, "
          f"dense {1e3 * r['dense_gpu_ms']:.1f} us, x{r['speedup_bitmap_vs_dense']:.2f}, err {r['bitmap_rel_error']:.1e}")
PY
  done
fi

if [[ $MODE == bitmapsweep || $MODE == bitmapprof ]] && [[ -n ${BITMAP_PROFILE_CASES:-} ]]; then
  # Nsight Compute on the bitmap kernel: $BITMAP_PROFILE_CASES is "M K N sparsity[ VAR=value...];..." (the settings
  # apply to that case only). Reports in $OUT/ncu-bitmap-<dev>-<date>.txt.
  cat > /tmp/profile_bitmap.py <<'PY'
import sys, torch
from prunekit.kernels import gpu
from prunekit.kernels.testing import encode_csr, random_sparse_weight
m, k, n, sp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
c = encode_csr(random_sparse_weight(m, k, sp, torch.float16, "cuda"))
x = torch.randn(n, k, device="cuda").half().t()
for _ in range(4):  # plan build and warm-up outside the profiled launch (ncu: --launch-skip)
    gpu.spmm_csr(**c, x=x, m=m, variant="bitmap")
torch.cuda.synchronize()
PY
  NCU_OUT="$OUT/ncu-bitmap-$DEV-$DATE.txt"
  : > "$NCU_OUT"
  IFS=';' read -ra cases <<< "$BITMAP_PROFILE_CASES"
  for case in "${cases[@]}"; do
    read -ra words <<< "$case"
    echo "=== $case" | tee -a "$NCU_OUT"
    env "${words[@]:4}" timeout 150 ncu -k regex:nm24_decode --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
      --section Occupancy --section LaunchStats --section InstructionStats \
      --metrics dram__bytes_read.sum,smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
      python3 /tmp/profile_bitmap.py "${words[@]:0:4}" >> "$NCU_OUT" 2>&1
    echo "ncu exit code $?" | tee -a "$NCU_OUT"
  done
  grep -E "===|Duration|DRAM Throughput|Memory Throughput|inst_executed|stalled_.*(long|short|wait|barrier|mio|math|lg|dispatch|no_inst|not_sel|selected|branch|membar|sleep|tex|drain|imc)|Occupancy|Registers|Block Limit|Waves|Eligible|Active Warps|Issued Warp" "$NCU_OUT" | head -120
fi

if [[ $MODE == scatterkr ]]; then
  # The scatter kernel's k-split forced (PRUNEKIT_SCATTER_KR = groups of 128 columns per block) at decode points.
  for kr in ${SCATTER_KRS:-1 2 4 8 12}; do
    step "scatter, kr_groups $kr"
    PRUNEKIT_SCATTER_KR=$kr python3 benchmarks/spmm.py --out "$OUT/spmm-scatter-kr$kr-$DEV-$DATE.json" --dtypes float16 \
      --shapes 4096x4096,11008x4096 --ns 16 --sparsities 0.8,0.9 "$@" > "$OUT/scatter-kr$kr.log" 2>&1
    echo "exit code $?"
  done
fi

if [[ $MODE == scatterprof ]]; then
  # Nsight Compute on the scatter kernel: where its sparsity-independent time goes (shared-memory wavefronts, stalls,
  # occupancy). One report per case in $OUT/ncu-scatter-<dev>-<date>.txt.
  cat > /tmp/profile_scatter.py <<'PY'
import sys
import torch
from prunekit.kernels import gpu
from prunekit.kernels.testing import encode_csr, random_sparse_weight
m, k, n, sparsity = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
g = torch.Generator(device="cuda").manual_seed(0)
c = encode_csr(random_sparse_weight(m, k, sparsity, torch.float16, "cuda", generator=g))
x2d = torch.randn(n, k, device="cuda", dtype=torch.float16)
for _ in range(3):  # plan build and warm-up outside the profiled launch (ncu: --launch-skip)
    gpu.spmm_csr(**c, x=x2d.t(), m=m, variant="scatter")
torch.cuda.synchronize()
print("profiled case ran", m, k, n, sparsity)
PY
  NCU_OUT="$OUT/ncu-scatter-$DEV-$DATE.txt"
  : > "$NCU_OUT"
  IFS=';' read -ra CASES <<< "${SCATTER_PROFILE_CASES:-4096 4096 16 0.9;4096 4096 1 0.9;11008 4096 1 0.98}"
  for case in "${CASES[@]}"; do
    echo "=== $case" | tee -a "$NCU_OUT"
    timeout 120 ncu -k regex:spmm_scatter --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
      --section WarpStateStats --section Occupancy --section LaunchStats --section SourceCounters --section InstructionStats \
      --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
      python3 /tmp/profile_scatter.py $case >> "$NCU_OUT" 2>&1
    echo "ncu exit code $?" | tee -a "$NCU_OUT"
  done
  grep -E "===|Duration|Throughput|wavefronts|bank_conflicts|inst_executed|hmma|Stall|Achieved Occupancy|Theoretical Occupancy|Registers|Issue Slots|Eligible|Active Warps" "$NCU_OUT" | head -120
fi

if [[ $MODE == tc ]]; then
  step tc tests
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_spmm_tc.py 2>&1 | tee "$OUT/tc-tests.log" | tail -25
  step tc compute-sanitizer memcheck
  cat > /tmp/sanitize_tc.py <<'PY'
import torch
from prunekit.kernels import gpu
from prunekit.kernels.spmm_tc_plan import get_tc_plan
from prunekit.kernels.testing import encode_csr, random_sparse_weight
for dtype in (torch.float16, torch.bfloat16):
    w = random_sparse_weight(45, 301, 0.8, dtype, "cuda", empty_rows=2, single_rows=2)
    c = encode_csr(w)
    x2d = torch.randn(37, 301, device="cuda").to(dtype)
    bias = torch.randn(45, device="cuda").to(dtype)
    plan = get_tc_plan(c["values"], c["row_offsets"], c["column_indices"], 45, 301)
    for x in (x2d.t(), x2d.t().contiguous()):
        gpu.spmm_csr(**c, x=x, m=45, bias=bias, activation="relu", variant="tc")
        xr = gpu._tc_operand(x)
        for wpw, ntile in gpu.TC_TILES:
            for y in (torch.empty(45, 37, device="cuda", dtype=dtype), torch.empty(37, 45, device="cuda", dtype=dtype).t()):
                torch.ops.prunekit_ext.spmm_csr_tc(plan.frag_values, plan.slot_rows, plan.kstep_offsets,
                                                   plan.window_rows, xr, y, bias, True, wpw, ntile)
torch.cuda.synchronize()
print("sanitize tc case ran")
PY
  timeout 150 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 python3 /tmp/sanitize_tc.py \
    > "$OUT/tc-memcheck.log" 2>&1
  echo "compute-sanitizer exit code $?" | tee -a "$OUT/tc-memcheck.log"
  tail -4 "$OUT/tc-memcheck.log"
  step tc compute-sanitizer racecheck
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 python3 /tmp/sanitize_tc.py \
    > "$OUT/tc-racecheck.log" 2>&1
  echo "compute-sanitizer racecheck exit code $?" | tee -a "$OUT/tc-racecheck.log"
  tail -4 "$OUT/tc-racecheck.log"
  step tc benchmark
  python3 benchmarks/spmm.py --dtypes float16 --shapes 4096x4096,11008x4096 --ns 4096 --sparsities 0.9,0.95,0.98 \
    --time-budget-s 240 --out "$OUT/spmm-tc-$DEV-$DATE.json" "$@" 2>&1 | tee "$OUT/tc-bench.log" | tail -40
fi

if [[ $MODE == profile ]]; then
  # Nsight Compute on the tensor-core SpMM (issue 4: tc reached 28-32% of its design ceiling, docs/KERNELS.md) at
  # 4096x4096, N = 4096: 90% at prefetch depths 2 and 6, and 95%, without row reordering: where its time goes (tensor pipe,
  # shared-memory wavefronts and bank conflicts, stalls). One report per case in $OUT/ncu-tc-<dev>-<date>.txt.
  step "tc GPU tests with both prefetch depths (the k-step loop became a ring after the last GPU run)"
  for pf in 2 6; do
    PRUNEKIT_TC_PREFETCH=$pf timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_spmm_tc.py \
      tests/kernels/test_spmm_autograd.py > "$OUT/tc-tests-pf$pf.log" 2>&1
    echo "PRUNEKIT_TC_PREFETCH=$pf pytest exit code $?"; tail -1 "$OUT/tc-tests-pf$pf.log"
  done
  step tc profile
  cat > /tmp/profile_tc.py <<'PY'
import sys
import torch
from prunekit.kernels import gpu
from prunekit.kernels.testing import encode_csr, random_sparse_weight
sparsity, reorder = float(sys.argv[1]), sys.argv[2] == "1"
import os
os.environ["PRUNEKIT_TC_REORDER"] = "1" if reorder else "0"
g = torch.Generator(device="cuda").manual_seed(0)
w = random_sparse_weight(4096, 4096, sparsity, torch.float16, "cuda", generator=g)
c = encode_csr(w)
x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
for _ in range(3):  # plan build and warm-up outside the profiled launch (ncu: --launch-skip)
    gpu.spmm_csr(**c, x=x, m=4096, variant="tc")
torch.cuda.synchronize()
print("profiled case ran", sparsity, "reorder", reorder)
PY
  NCU_OUT="$OUT/ncu-tc-$DEV-$DATE.txt"
  : > "$NCU_OUT"
  for case in "0.9 0 2" "0.9 0 6" "0.95 0 2"; do
    set -- $case
    echo "=== 4096x4096 N=4096 fp16 sparsity $1 reorder $2 prefetch $3" | tee -a "$NCU_OUT"
    PRUNEKIT_TC_PREFETCH=$3 timeout 120 ncu -k regex:spmm_tc --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section Occupancy --section LaunchStats \
      --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_op_ldsm.sum \
      python3 /tmp/profile_tc.py "$1" "$2" >> "$NCU_OUT" 2>&1
    echo "ncu exit code $?" | tee -a "$NCU_OUT"
  done
  grep -E "===|Duration|Throughput|bank_conflicts|wavefronts|hmma|Stall|Achieved Occupancy|Registers" "$NCU_OUT" | head -80
  # the prefetch ring's depth timed both ways in the benchmark (same shapes, dense cuBLAS in each run)
  for pf in 2 6; do
    step "tc benchmark, PRUNEKIT_TC_PREFETCH=$pf"
    PRUNEKIT_TC_PREFETCH=$pf timeout 150 python3 benchmarks/spmm.py --dtypes float16 --shapes 4096x4096,11008x4096 \
      --ns 4096 --sparsities 0.9,0.95 --time-budget-s 60 --out "$OUT/spmm-tc-pf$pf-$DEV-$DATE.json" \
      2>&1 | tail -8
  done
fi

if [[ $MODE == tcloop ]]; then
  # Which change made tc slower than its first timing (07:57, 2026-11-25): the register ring (depth 2 / 6) or the
  # plan's row reordering. Tests of the first design's loop ($PRUNEKIT_TC_PREFETCH=0), then the same tc benchmark
  # for loop x reordering; one JSON per case (benchmarks/spmm.py, dense cuBLAS in each run).
  step "tc GPU tests with the first design's loop (PRUNEKIT_TC_PREFETCH=0)"
  PRUNEKIT_TC_PREFETCH=0 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_spmm_tc.py \
    > "$OUT/tc-tests-pf0.log" 2>&1
  rc=$?; echo "PRUNEKIT_TC_PREFETCH=0 pytest exit code $rc"; tail -1 "$OUT/tc-tests-pf0.log"
  cases="6:1 2:1 6:0 2:0"
  [ $rc -eq 0 ] && cases="0:1 0:0 $cases"  # the first design is timed only when its tests pass
  for case in $cases; do
    pf=${case%%:*}; ro=${case##*:}
    step "tc benchmark, PRUNEKIT_TC_PREFETCH=$pf PRUNEKIT_TC_REORDER=$ro"
    PRUNEKIT_TC_PREFETCH=$pf PRUNEKIT_TC_REORDER=$ro timeout 100 python3 benchmarks/spmm.py --dtypes float16 \
      --shapes 4096x4096,11008x4096 --ns 4096 --sparsities 0.9,0.95 --time-budget-s 45 \
      --out "$OUT/spmm-tc-pf$pf-ro$ro-$DEV-$DATE.json" 2>&1 | tail -7
  done
fi

if [[ $MODE == variants ]]; then
  step variant sweep
  python3 benchmarks/spmm.py --variants --out "$OUT/spmm-variants-$DEV-$DATE.json" "$@" 2>&1 | tee "$OUT/variants.log" | tail -60
fi

if [[ $MODE == all || $MODE == bench ]]; then
  step benchmark
  python3 benchmarks/spmm.py --out "$OUT/spmm-$DEV-$DATE.json" "$@" 2>&1 | tee "$OUT/bench.log" | tail -120
fi
step done
