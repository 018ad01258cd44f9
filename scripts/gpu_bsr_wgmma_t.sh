#!/usr/bin/env bash
# The twenty-sixth session's device calls (bsr_mm's wgmma variant for 16- and 32-row blocks, the roles swapped):
# build the BSR library, its GPU tests, a compute-sanitizer memcheck of small wgmma cases, then benchmarks/bsr.py at
# the points given in BSR_ARGS (results JSON in $OUT).
#
#   OUT=$OUT BSR_ARGS="--blocks 16,32 --any-ns 32,64 ..." bash scripts/gpu_bsr_wgmma_t.sh [all|bench]
#   OUT=$OUT BSR_RUNS="PRUNEKIT_BSR_SPLIT=0 --ns 128 ...; --ns 2048 ..." bash scripts/gpu_bsr_wgmma_t.sh [all|bench]
#
# TEST_FILES overrides the test files; MEMCHECK=0 leaves the memcheck out.
set -uo pipefail
MODE=${1:-all}
OUT=${OUT:-$PWD/out}
export OUT
if [[ $MODE == all ]]; then
  NAMESPACES="prunekit_structured" MAX_JOBS=${MAX_JOBS:-14} \
    TEST_FILES=${TEST_FILES:-"tests/kernels/test_bsr_mm.py tests/kernels/test_structured_tiling.py"} \
    bash scripts/gpu_session.sh all > "$OUT/session.log" 2>&1
  rm -rf "$OUT"/prebuilt*
  tar xzf "$OUT/logs.tgz" -C /tmp summary.txt 2>/dev/null && cat /tmp/summary.txt
fi
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
if [[ $MODE == all && ${MEMCHECK:-1} != 0 ]]; then
  cat > /tmp/memcheck_wgmma_t.py <<'PY'
import os, sys, torch
sys.path.insert(0, "tests/kernels")
from test_bsr_mm import block_sparse_weight, _components
from prunekit.formats.bsr import static_schedule
from prunekit.kernels import structured
assert structured.wgmma_available()
for dtype in (torch.float16, torch.bfloat16):
    for r, c in ((16, 16), (16, 64), (32, 32), (32, 16), (64, 64), (64, 16)):
        m, k = 6 * r, 5 * c
        dense = block_sparse_weight(m, k, r, c, 0.5, dtype, heavy_rows=1)
        comp = {key: t.cuda() for key, t in _components(dense, r, c).items()}
        sched, split = (t.cuda() for t in static_schedule(comp["crow_indices"], chunk=1))
        base = (comp["blocks"], comp["crow_indices"], comp["col_indices"])
        bias = torch.randn(m, device="cuda").to(dtype)
        for n, xslabs in ((37, "0"), (300, "0"), (37, "1"), (300, "1")):
            os.environ["PRUNEKIT_BSR_XSLABS"] = xslabs
            x2d = torch.randn(n, k, device="cuda").to(dtype)
            for x in (x2d.t(), x2d.t().contiguous()):
                for tile_n in structured.WGMMA_TILE_NS:
                    for extra in ((None, None), (sched, split)):
                        structured.bsr_mm_cuda(*base, x, m, bias, "relu", *extra, tile_n=tile_n, variant="wgmma")
                structured.bsr_mm_eager(*base, x, m, bias, "relu", sched, split, variant="wgmma")
torch.cuda.synchronize()
print("memcheck cases ran")
PY
  timeout 200 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 python3 /tmp/memcheck_wgmma_t.py \
    > "$OUT/memcheck-wgmma-t.log" 2>&1
  echo "compute-sanitizer exit code $?"; grep -E "ERROR SUMMARY|ran|Error" "$OUT/memcheck-wgmma-t.log" | tail -4
fi
if [[ -n ${BSR_ARGS:-} ]]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT_S:-300}" python3 benchmarks/bsr.py $BSR_ARGS 2>&1 | grep -E "^(float16|bfloat16) " | cut -c1-220
fi
# BSR_RUNS: several benchmark runs in turn, separated by ';'. Each is optional VAR=value settings for that run, then
# benchmarks/bsr.py's arguments, e.g. "PRUNEKIT_BSR_SPLIT=0 --ns 128 --out $OUT/a.json; --ns 2048 --out $OUT/b.json".
if [[ -n ${BSR_RUNS:-} ]]; then
  IFS=';' read -ra runs <<< "$BSR_RUNS"
  for run in "${runs[@]}"; do
    read -ra toks <<< "$run"
    envs=()
    i=0
    while [[ $i -lt ${#toks[@]} && ${toks[$i]} =~ ^[A-Z_0-9]+= ]]; do envs+=("${toks[$i]}"); i=$((i + 1)); done
    echo "== run: $run"
    timeout "${BENCH_TIMEOUT_S:-300}" env "${envs[@]}" python3 benchmarks/bsr.py "${toks[@]:$i}" 2>&1 |
      grep -E "^(float16|bfloat16) |Error|error" | cut -c1-220
  done
fi
