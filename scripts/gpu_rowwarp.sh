#!/usr/bin/env bash
# One device call for rowwarp's own transpose of X (csrc/spmm_rowwarp.cu, row_major_x): build the two libraries the
# eager CSR layer uses and the fast-call module, run the GPU test files of the rowwarp paths, then time the layer with
# the transpose against torch's copy (benchmarks/layer_host.py --base-env PRUNEKIT_ROWWARP_TRANSPOSE=0, device time
# and eager time of both in the same trials) and the device-side profile (benchmarks/csr_decode_profile.py).
#
#   OUT=$OUT bash scripts/gpu_rowwarp.sh            (from the repository root; carry .whl for pydantic)
#
# STEPS (default "build tests layer profile") picks steps; TEST_FILES / TEST_BUDGET_S the tests; LAYER_SHAPES,
# LAYER_NS, LAYER_SPARSITIES, LAYER_TRIALS the timing (LAYER_TIMEOUT_S bounds it, default 240); TAG names the files.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"  # OUT, PYTHONPATH, the kernel cache and archs
TAG=${TAG:-s22}
STEPS=${STEPS:-"build tests layer profile"}
dev=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr 'H' 'h')
date_tag="${dev:-gpu}-$(date -u +%F)-$TAG"
if [[ " $STEPS " == *" build "* ]]; then
  NAMESPACES=${NAMESPACES:-"prunekit_ext prunekit_nm24"} bash scripts/gpu_session.sh build
  rm -rf "$OUT"/prebuilt*  # over what the device tool returns
fi
if [[ " $STEPS " == *" tests "* ]]; then
  TEST_BUDGET_S=${TEST_BUDGET_S:-240} TEST_FILES=${TEST_FILES:-"tests/kernels/test_rowwarp_transpose.py \
tests/kernels/test_spmm_entry.py tests/kernels/test_spmv.py"} bash scripts/gpu_session.sh tests
  rm -rf "$OUT"/prebuilt*
fi
if [[ " $STEPS " == *" layer "* ]]; then
  for sp in ${LAYER_SPARSITIES:-0.98 0.95}; do
    timeout "${LAYER_TIMEOUT_S:-240}" python3 benchmarks/layer_host.py --formats csr --sparsity "$sp" \
      --base-env PRUNEKIT_ROWWARP_TRANSPOSE=0 \
      --shapes "${LAYER_SHAPES:-4096x4096,11008x4096,4096x11008,768x3072,3072x768}" \
      --ns "${LAYER_NS:-8,16}" --trials "${LAYER_TRIALS:-15}" \
      --out "$OUT/layer-host-rowwarp-$date_tag-$sp.json" > "$OUT/layer-host-rowwarp-$TAG-$sp.log" 2>&1
    echo "layer_host.py $sp: rc=$?"
    tail -16 "$OUT/layer-host-rowwarp-$TAG-$sp.log"
  done
fi
if [[ " $STEPS " == *" profile "* ]]; then
  timeout 200 python3 benchmarks/csr_decode_profile.py --out "$OUT/csr-decode-profile-$date_tag.json" \
    --points "${PROFILE_POINTS:-11008x4096x16x0.98,4096x11008x16x0.98,4096x4096x16x0.98,3072x768x16x0.98}" 2>&1 \
    | grep -v Warning | tail -30
fi
rm -rf "$OUT"/prebuilt*
# shellcheck source=scripts/out_pack.sh
source scripts/out_pack.sh && out_pack  # the logs into one more logs-N.tgz: at most 8 files come back
