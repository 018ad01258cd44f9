#!/usr/bin/env bash
# One device call for the fast-call module (kernels/fastcall.py): build the three libraries the runtime's eager paths
# use and the module, time the layer with and without the module (benchmarks/layer_host.py --base-no-fastcall, with
# the per-layer breakdown), then run the GPU test files of those paths with the time left.
#
#   OUT=$OUT bash scripts/gpu_fastcall.sh            (from the repository root; carry .whl for pydantic)
#
# LAYER_SHAPES / LAYER_NS / LAYER_FORMATS / LAYER_TRIALS shape the timing, LAYER_TIMEOUT_S bounds it (default 200),
# TEST_BUDGET_S the tests (default 240), TAG names the result file (default s21).
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"  # OUT, PYTHONPATH, the kernel cache and archs
TAG=${TAG:-s21}
NAMESPACES=${NAMESPACES:-"prunekit_ext prunekit_structured prunekit_nm24"} bash scripts/gpu_session.sh build
rm -rf "$OUT"/prebuilt*  # over what the device tool returns
dev=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr 'H' 'h')
timeout "${LAYER_TIMEOUT_S:-200}" python3 benchmarks/layer_host.py --base-no-fastcall --breakdown \
  --formats "${LAYER_FORMATS:-bsr,nm,csr}" --shapes "${LAYER_SHAPES:-3072x768,4096x4096,768x3072}" \
  --ns "${LAYER_NS:-1,16}" --trials "${LAYER_TRIALS:-15}" \
  --out "$OUT/layer-host-${dev:-gpu}-$(date -u +%F)-$TAG.json" > "$OUT/layer-host-$TAG.log" 2>&1
echo "layer_host.py: rc=$?"
TEST_BUDGET_S=${TEST_BUDGET_S:-240} TEST_FILES=${TEST_FILES:-"tests/kernels/test_fastcall.py tests/kernels/test_bsr_mm.py \
tests/kernels/test_nm24_decode.py tests/kernels/test_nm24_spmv.py tests/kernels/test_spmm_entry.py \
tests/kernels/test_spmm_bitmap.py tests/kernels/test_nm_mm.py"} bash scripts/gpu_session.sh tests
rm -rf "$OUT"/prebuilt*
ls -la "$OUT"
