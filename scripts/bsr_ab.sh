#!/usr/bin/env bash
# An A/B timing of the BSR kernels in one device call: the working tree against a base tree of the same repository
# (GPU machine, repository root). Both structured libraries build side by side into the kernel cache, the working
# tree's wgmma tests run, then benchmarks/bsr.py runs each argument set on the base tree (without torch's Triton
# BSR) and on the working tree (with it), and a table of the two static times per point is printed.
#
#   git archive <base commit> src benchmarks/bsr.py | (mkdir -p ab_base && tar -x -C ab_base)   # here; git-ignored
#   BSR_AB_SETS="--shapes 4096x4096 --blocks 16 --sparsities 0.9 --any-ns 2048;..." OUT=$OUT bash scripts/bsr_ab.sh
#   (device call with carry ["ab_base"])
#
# $BSR_AB_BASE: the base tree (default ab_base). $TAG: file-name suffix. Files: $OUT/bsr-ab-{base,new}<i>-<dev>-<date>
# $TAG.json, one pair per argument set i. (The thirty-sixth session's -s36e files came from a first, fixed-argument
# version of this script, which named the working tree's files "fix" and its two sets "16" and "32".)
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"  # $OUT, kernel cache, archs (each command below sets PYTHONPATH)
BASE=${BSR_AB_BASE:-ab_base}
export PRUNEKIT_STRUCTURED_CPP=1 MAX_JOBS=${MAX_JOBS:-16}
ROOT=$PWD
DEV=$(python3 -c "import torch; n=torch.cuda.get_device_name(0).lower(); print('h100' if 'h100' in n else 'h200' if 'h200' in n else 'gpu')")
SUFFIX=$DEV-$(date -u +%F)${TAG:-}
load='from prunekit.kernels import structured; structured.load()'
(cd "$BASE" && PYTHONPATH=$ROOT/$BASE/src python3 -c "$load" > "$OUT/build-base.log" 2>&1; echo "base build rc $?") &
(PYTHONPATH=$ROOT/src python3 -c "$load" > "$OUT/build-new.log" 2>&1; echo "new build rc $?") &
wait
PYTHONPATH=$ROOT/src timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_bsr_mm.py \
  -k "tiles_per_cta or warp_producer or wgmma_matches" > "$OUT/tests-new.log" 2>&1
echo "tests rc $?"; tail -1 "$OUT/tests-new.log"
IFS=';' read -ra sets <<< "${BSR_AB_SETS:?set BSR_AB_SETS}"
for i in "${!sets[@]}"; do
  read -ra words <<< "${sets[$i]}"
  (cd "$BASE" && PYTHONPATH=$ROOT/$BASE/src timeout 150 python3 benchmarks/bsr.py --dtypes float16 --no-torch-bsr \
    --out "$OUT/bsr-ab-base$i-$SUFFIX.json" "${words[@]}" > "$OUT/bench-base$i.log" 2>&1; echo "base set $i rc $?")
  PYTHONPATH=$ROOT/src timeout 150 python3 benchmarks/bsr.py --dtypes float16 --out "$OUT/bsr-ab-new$i-$SUFFIX.json" \
    "${words[@]}" > "$OUT/bench-new$i.log" 2>&1
  echo "new set $i rc $?"
done
python3 - "$OUT" "$SUFFIX" "${#sets[@]}" <<'PY'
import json, sys
out, suffix, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(count):
    load = lambda who: json.load(open(f"{out}/bsr-ab-{who}{i}-{suffix}.json"))["results"]
    base = {(r["m"], r["k"], r["n"], r["block"], r["sparsity"]): r for r in load("base")}
    for r in load("new"):
        key = (r["m"], r["k"], r["n"], r["block"], r["sparsity"])
        old = base.get(key, {}).get("static_gpu_ms", float("nan"))
        print(key, "base us", round(old * 1e3, 2), "new us", round(r["static_gpu_ms"] * 1e3, 2),
              "triton us", round(r.get("torch_bsr_gpu_ms", float("nan")) * 1e3, 2),
              "dense us", round(r["dense_gpu_ms"] * 1e3, 2))
PY
