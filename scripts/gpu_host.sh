#!/usr/bin/env bash
# Device calls for the eager layers' host time and the BSR eager-overhead target (thirty-eighth session), one
# subcommand per 10-minute call, from the repository root (PYTHONPATH=src, nothing installed). Outputs in $OUT.
#
#   OUT=$OUT bash scripts/gpu_host.sh probe   # build the ext, structured and nm24 libraries and the fast-call module,
#                                             # then benchmarks/entry_host_probe.py against the base module's source
#                                             # ab_base/fastcall.cpp (carried: `git show REV:src/prunekit/kernels/csrc/
#                                             # fastcall/fastcall.cpp > ab_base/fastcall.cpp`), then $TEST_FILES
#   OUT=$OUT bash scripts/gpu_host.sh grid    # benchmarks/bsr.py on the 225-point fp16 grid of the thirty-seventh
#                                             # session (-s37c) with layer_eager_overhead_paired_us ($GRID_BLOCKS)
#   OUT=$OUT bash scripts/gpu_host.sh tests   # the GPU test files of the changed paths ($TEST_FILES, $TEST_BUDGET_S)
#   OUT=$OUT bash scripts/gpu_host.sh ops     # build, the GPU tests of the custom ops' eager direct path
#                                             # ($OPS_TEST_FILES), then benchmarks/spmm.py at decode points with
#                                             # --op-rounds (ops.spmm_csr's direct call against the registered op)
#   OUT=$OUT bash scripts/gpu_host.sh gap     # build (ext, structured, nm24), then benchmarks/eager_gap.py: the eager
#                                             # loops' device and wall time against a graph of the same calls, layer
#                                             # and nn.Linear ($GAP_POINTS), then `sparse` for $SPARSE_BUDGET_S
#   OUT=$OUT bash scripts/gpu_host.sh long    # benchmarks/bsr.py at the grid's long kernels (16/32-row blocks, 50-80%, N =
#                                             # 2048 / 4096 on the three large shapes) with overhead_pair's eager loops
#                                             # of at least 64 calls (bsr-long-...json)
#   OUT=$OUT bash scripts/gpu_host.sh direct  # build (ext, nm24), the GPU tests of the ops' eager direct path, then
#                                             # dense_host_probe.py and `sparse` for $SPARSE_BUDGET_S (the op's host
#                                             # time after the thirty-ninth session's trims of its Python)
#   OUT=$OUT bash scripts/gpu_host.sh sparse  # benchmarks/spmm.py at N = 1 / 16 / 128, 70-98%, the five shapes
#                                             # ($SPARSE_SHAPES): issue 4's targets against torch.sparse.mm with the
#                                             # eager direct calls; --time-budget-s $SPARSE_BUDGET_S
#
# TAG (default s39) names the result files.
set -uo pipefail
MODE=${1:-probe}
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"  # OUT, PYTHONPATH, the kernel cache and archs
export PYTHONUNBUFFERED=1 PRUNEKIT_STRUCTURED_CPP=${PRUNEKIT_STRUCTURED_CPP:-1}
TAG=${TAG:-s39}
dev=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr 'H' 'h')
date=$(date -u +%F)
TEST_FILES=${TEST_FILES:-"tests/kernels/test_fastcall.py tests/kernels/test_bsr_mm.py tests/kernels/test_bsr_pdl.py \
tests/kernels/test_structured_tiling.py tests/kernels/test_spmm_entry.py tests/kernels/test_spmm_bitmap.py \
tests/kernels/test_nm24_decode.py tests/kernels/test_nm24_spmv.py"}

build() {
  NAMESPACES=${NAMESPACES:-"prunekit_ext prunekit_structured prunekit_nm24"} bash scripts/gpu_session.sh build
  rm -rf "$OUT"/prebuilt*  # over what the device tool returns
}

case $MODE in
  probe)
    build
    base=()
    [[ -f ab_base/fastcall.cpp ]] && base=(--base-fastcall ab_base/fastcall.cpp)
    timeout "${PROBE_TIMEOUT_S:-240}" python3 benchmarks/entry_host_probe.py "${base[@]}" \
      --trials "${PROBE_TRIALS:-21}" --out "$OUT/entry-host-${dev:-gpu}-$date-$TAG.json" > "$OUT/entry-host-$TAG.log" 2>&1
    echo "entry_host_probe.py: rc=$?"
    tail -n 80 "$OUT/entry-host-$TAG.log"
    TEST_BUDGET_S=${TEST_BUDGET_S:-150} TEST_FILES=$TEST_FILES bash scripts/gpu_session.sh tests
    ;;
  grid)
    NAMESPACES=prunekit_structured build
    timeout "${GRID_TIMEOUT_S:-520}" python3 benchmarks/bsr.py --out "$OUT/bsr-final-${dev:-gpu}-$date-$TAG.json" \
      --blocks "${GRID_BLOCKS:-64,32,16}" --dtypes float16 --sparsities 0.95,0.9,0.8,0.7,0.5 \
      --shapes 3072x768,11008x4096,4096x4096,768x3072,4096x11008 --any-ns 4096,2048,128 \
      --time-limit-s "${GRID_TIME_LIMIT_S:-460}" > "$OUT/bsr-grid-$TAG.log" 2>&1
    echo "bsr.py: rc=$?"
    tail -n 5 "$OUT/bsr-grid-$TAG.log"
    ;;
  tests)
    TEST_BUDGET_S=${TEST_BUDGET_S:-480} TEST_FILES=$TEST_FILES bash scripts/gpu_session.sh tests
    ;;
  ops)
    MAX_JOBS=${MAX_JOBS:-5} build
    TEST_BUDGET_S=${TEST_BUDGET_S:-170} TEST_FILES=${OPS_TEST_FILES:-"tests/kernels/test_spmm_csr_cuda.py tests/kernels/test_sddmm_csr_cuda.py \
tests/kernels/test_spmm_autograd.py tests/kernels/test_bsr_mm.py tests/kernels/test_nm_mm.py"} \
      bash scripts/gpu_session.sh tests
    timeout "${OPS_TIMEOUT_S:-150}" python3 benchmarks/spmm.py --out "$OUT/spmm-opdirect-${dev:-gpu}-$date-$TAG.json" \
      --dtypes float16 --shapes "${OPS_SHAPES:-4096x4096,768x3072,11008x4096}" --ns "${OPS_NS:-1,16}" \
      --sparsities "${OPS_SPARSITIES:-0.7,0.9}" --op-rounds "${OPS_ROUNDS:-9}" --forced bitmap \
      > "$OUT/spmm-opdirect-$TAG.log" 2>&1
    echo "spmm.py: rc=$?"
    tail -n 30 "$OUT/spmm-opdirect-$TAG.log"
    ;;
  gap)
    MAX_JOBS=${MAX_JOBS:-5} build
    timeout "${GAP_TIMEOUT_S:-200}" python3 benchmarks/eager_gap.py --out "$OUT/eager-gap-${dev:-gpu}-$date-$TAG.json" \
      ${GAP_POINTS:+--points "$GAP_POINTS"} > "$OUT/eager-gap-$TAG.log" 2>&1
    echo "eager_gap.py: rc=$?"
    tail -n 40 "$OUT/eager-gap-$TAG.log"
    timeout 120 python3 benchmarks/dense_host_probe.py --out "$OUT/dense-host-${dev:-gpu}-$date-$TAG.json" \
      > "$OUT/dense-host-$TAG.log" 2>&1
    echo "dense_host_probe.py: rc=$?"
    SPARSE_BUDGET_S=${SPARSE_BUDGET_S:-120} bash "$0" sparse
    ;;
  long)
    NAMESPACES=prunekit_structured build
    timeout "${LONG_TIMEOUT_S:-480}" python3 benchmarks/bsr.py --out "$OUT/bsr-long-${dev:-gpu}-$date-$TAG.json" \
      --blocks "${LONG_BLOCKS:-16,32}" --dtypes float16 --sparsities 0.8,0.7,0.5 \
      --shapes 11008x4096,4096x4096,4096x11008 --any-ns 4096,2048 --no-torch-bsr \
      --time-limit-s "${LONG_TIME_LIMIT_S:-420}" > "$OUT/bsr-long-$TAG.log" 2>&1
    echo "bsr.py: rc=$?"
    tail -n 5 "$OUT/bsr-long-$TAG.log"
    ;;
  direct)
    NAMESPACES="prunekit_ext prunekit_nm24" MAX_JOBS=${MAX_JOBS:-8} build
    TEST_BUDGET_S=${TEST_BUDGET_S:-150} TEST_FILES=${DIRECT_TEST_FILES:-"tests/kernels/test_eager_direct.py \
tests/kernels/test_spmm_csr_cuda.py tests/kernels/test_spmm_entry.py tests/kernels/test_spmm_dense.py \
tests/kernels/test_sddmm_csr_cuda.py tests/kernels/test_spmm_autograd.py"} bash scripts/gpu_session.sh tests
    timeout 120 python3 benchmarks/dense_host_probe.py --out "$OUT/dense-host-${dev:-gpu}-$date-$TAG.json" \
      > "$OUT/dense-host-$TAG.log" 2>&1
    echo "dense_host_probe.py: rc=$?"
    head -n 5 "$OUT/dense-host-$TAG.log"
    SPARSE_BUDGET_S=${SPARSE_BUDGET_S:-90} bash "$0" sparse
    ;;
  sparse)
    timeout "$((${SPARSE_BUDGET_S:-420} + 90))" python3 benchmarks/spmm.py \
      --out "$OUT/spmm-tsparse-${dev:-gpu}-$date-$TAG.json" --dtypes float16 \
      --shapes "${SPARSE_SHAPES:-4096x4096,11008x4096,4096x11008,768x3072,3072x768}" --ns 1,16,128 \
      --sparsities 0.7,0.8,0.9,0.95,0.98 --forced bitmap --time-budget-s "${SPARSE_BUDGET_S:-420}" \
      > "$OUT/spmm-tsparse-$TAG.log" 2>&1
    echo "spmm.py: rc=$?"
    tail -n 12 "$OUT/spmm-tsparse-$TAG.log"
    ;;
  *)
    echo "usage: bash scripts/gpu_host.sh probe|grid|tests|ops|gap|long|direct|sparse" >&2
    exit 2
    ;;
esac
ls -la "$OUT"
