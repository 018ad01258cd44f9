#!/usr/bin/env bash
# One short device call that re-measures the headline figures of issues 5, 6 and 7 when little device time is left
# (the machine starts bare: nothing is cached). It overlaps what does not compete for the same resource:
#   1. the quality fine-tuning of issue 6 (both GMP + distillation recipes, STEPS each, default 1500) runs on the GPU
#      while the spdnn, structured and prunekit_ext libraries build on the CPUs, in parallel;
#   2. then, alone on the GPU (timings), the BSR headline points of issue 5 (16384x16384 @ 8192 first, blocks 64 and
#      32, 90 and 95%), the N=4096 SpDNN networks of issue 7 (plan n4096: 120/480/1920 layers, PASS check), and the
#      tensor-core SpMM points of issue 4 if time is left.
# Every step has a deadline inside TOTAL_S (default 420 s); a step cut short keeps what its JSON holds.
# Results JSON (at most 5 files) and one log go to $OUT (or ./out).
#
# One device call, carry [".whl", ".carry/quality"], timeout_s about TOTAL_S + 30:
#   bash scripts/gpu_remeasure.sh
# .whl and .carry/quality are made as scripts/gpu_finetune.sh says.
set -uo pipefail
OUT=${OUT:-$PWD/out}
TOTAL_S=${TOTAL_S:-420}
STEPS=${STEPS:-1500}
mkdir -p "$OUT"
# shellcheck source=scripts/out_pack.sh
source "$(dirname "${BASH_SOURCE[0]}")/out_pack.sh"; trap out_pack EXIT  # <= 8 files in $OUT
exec > >(tee -a "$OUT/remeasure.log") 2>&1
step() { echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s)"; }
left() { echo $(( TOTAL_S - SECONDS )); }

step setup
if ! python3 -c "import pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed: is .whl carried?"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PRUNEKIT_CUDA_ARCHS=90
export PRUNEKIT_KERNEL_CACHE=${PRUNEKIT_KERNEL_CACHE:-/tmp/prunekit-kernel-cache}
DATE=$(date -u +%Y-%m-%d)
DEV=$(python3 -c "import torch; n=torch.cuda.get_device_name(0).lower(); print('h100' if 'h100' in n else 'h200' if 'h200' in n else n.replace(' ', '-'))")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

step "quality fine-tuning ($STEPS steps per recipe) in the background"
qpid=
if [[ -f .carry/quality/minilm/model.safetensors ]]; then
  rm -rf /tmp/prunekit-quality
  timeout 270 python3 scripts/quality.py finetune --model .carry/quality/minilm --texts .carry/quality/texts.json \
    --out-dir "$OUT" --log-every 250 --workdir /tmp/prunekit-quality --steps "$STEPS" > /tmp/quality.log 2>&1 &
  qpid=$!
else
  echo ".carry/quality missing: quality skipped"
fi

step "build spdnn, structured, prunekit_ext in parallel"
pids=()
for ns in prunekit_spdnn prunekit_structured prunekit_ext; do
  MAX_JOBS=5 python3 - "$ns" > "/tmp/build-$ns.log" 2>&1 <<'PY' &
import sys, time
from prunekit.kernels import build, spdnn_cuda, structured  # noqa: F401  (registers every extension)
ext = next(e for e in build.extensions() if e.namespace == sys.argv[1])
t = time.time()
build.load_extension(ext, verbose=False)
print(f"built {ext.namespace} in {time.time() - t:.0f} s")
PY
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
for ns in prunekit_spdnn prunekit_structured prunekit_ext; do echo "$ns: $(tail -1 /tmp/build-$ns.log)"; done

if [[ -n $qpid ]]; then
  step "waiting for the quality run"
  wait "$qpid"; echo "quality exit code $?"
  grep -E "cosine|Spearman|^\s*\|" /tmp/quality.log | tail -12
fi

step "bsr headline points (left $(left) s)"
if (( $(left) > 60 )); then
  timeout $(( $(left) - 40 )) python3 benchmarks/bsr.py --out "$OUT/bsr-$DEV-$DATE.json" --blocks 64,32 \
    --sparsities 0.9,0.95 --time-limit-s $(( $(left) / 3 )) > /tmp/bsr.log 2>&1
  echo "bsr exit code $?"; grep -E "^float16" /tmp/bsr.log
fi

step "spdnn N=4096 (left $(left) s)"
if (( $(left) > 40 )); then
  timeout $(( $(left) - 15 )) python3 benchmarks/spdnn.py --plan n4096 --budget-s $(( $(left) - 50 )) --out "$OUT" \
    > /tmp/spdnn.log 2>&1
  echo "spdnn exit code $?"; tail -14 /tmp/spdnn.log
fi

step "tensor-core SpMM (left $(left) s)"
if (( $(left) > 45 )); then
  timeout $(( $(left) - 5 )) python3 benchmarks/spmm.py --dtypes float16 --shapes 4096x4096,11008x4096 --ns 4096 \
    --sparsities 0.9,0.95,0.98 --time-budget-s $(( $(left) - 35 )) --out "$OUT/spmm-tc-$DEV-$DATE.json" \
    > /tmp/spmm.log 2>&1
  echo "spmm exit code $?"; tail -20 /tmp/spmm.log
fi
cp /tmp/quality.log "$OUT/quality-run.log" 2>/dev/null
step done
