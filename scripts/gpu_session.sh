#!/usr/bin/env bash
# First call of a GPU session: build every prunekit CUDA library at once, then run every GPU test file in its own
# process (a crash such as an illegal instruction in one file cannot hide the others), and write a one-line-per-file
# summary. Fits one 10-minute device call; the per-issue scripts (gpu_run.sh, gpu_structured.sh, gpu_ks.sh,
# gpu_spdnn.sh, gpu_finetune.sh) then benchmark on the warm machine, whose kernel cache they share.
#
#   bash scripts/gpu_session.sh [build|tests|all|cli|clitests]        (default all)
#
# `cli` runs the user's documented commands instead of the build step: `prunekit kernels build` (every library side by
# side) then `prunekit kernels check` (every op against float64), timed, their tables in cli-build.log / cli-check.log;
# `clitests` runs the test files after them.
#
# `TEST_FILES="tests/a.py tests/b.py"` runs those files only (e.g. the ones a change touched, on a warm machine).
# `TEST_K="not lean"` passes `-k "not lean"` to every test file (e.g. to leave out tests a dedicated call already ran).
# A file that selects no test then exits 5 ("no tests ran").
#
# `NAMESPACES="prunekit_ext prunekit_nm24"` builds only those libraries (the others build on first use).
#
# Outputs in $OUT (default ./out), packed at exit by out_pack.sh: logs.tgz (build-<namespace>.log, tests-<file>.log,
# summary.txt) and prebuilt.tgz[.partNN] (prebuilt/*.so, the built libraries named by their build keys: unpack with
# `cat prebuilt.tgz* | tar xz -C .carry` and carry .carry/prebuilt with PRUNEKIT_KERNEL_PREBUILT=$PWD/.carry/prebuilt
# to skip the build on a fresh machine).
# Run from the repository root on a machine with a CUDA GPU, nvcc and ninja (no install needed: PYTHONPATH=src).
set -uo pipefail
MODE=${1:-all}
OUT=${OUT:-$PWD/out}
# shellcheck source=scripts/out_pack.sh
source "$(dirname "${BASH_SOURCE[0]}")/out_pack.sh"; trap out_pack EXIT  # <= 8 files in $OUT
mkdir -p "$OUT/prebuilt"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# The GPU image has no pydantic (recipes, fine-tuning tests): carry .whl (scripts/gpu_finetune.sh's header) to add it.
if ! python3 -c "import pydantic" 2>/dev/null; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site
  else
    echo "no pydantic and no .whl carried: the test files that import the recipes will fail to collect"
  fi
fi
export PYTHONUNBUFFERED=1
export PRUNEKIT_KERNEL_CACHE=${PRUNEKIT_KERNEL_CACHE:-$PWD/.carry/kernel-cache}
export PRUNEKIT_CUDA_ARCHS=${PRUNEKIT_CUDA_ARCHS:-90}  # the H100/H200 only: half the build time (sm_80 is compile-checked by scripts/compile_check.py)
MAX_JOBS_USER=${MAX_JOBS:-}
[[ $MODE == cli* ]] || export MAX_JOBS=${MAX_JOBS:-4}  # per library; the libraries build in parallel (cli: kernels build shares the CPUs itself)
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
step() { echo "=== $* ($(date -u +%H:%M:%S))"; }

if [[ $MODE == all || $MODE == build ]]; then
  step build every extension in parallel
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$SUMMARY"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$SUMMARY"
  namespaces=${NAMESPACES:-$(python3 -c "from prunekit.kernels import build; print(' '.join(e.namespace for e in build.extensions()))")}
  pids=()
  for ns in $namespaces; do
    python3 - "$ns" "$OUT/prebuilt" > "$OUT/build-$ns.log" 2>&1 <<'PY' &
import logging, shutil, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO)
from prunekit.kernels import build
ext = next(e for e in build.extensions() if e.namespace == sys.argv[1])
start = time.time()
try:
    path = build.load_extension(ext, verbose=True)
except Exception as exc:
    print(f"BUILD FAILED {ext.namespace}: {exc}")
    raise SystemExit(1)
print(f"built {ext.namespace} in {time.time() - start:.0f} s: {path}")
if path is not None and Path(path).is_file() and ext.prebuilt:
    shutil.copy2(path, Path(sys.argv[2]) / Path(path).name)
    print(f"copied {Path(path).stat().st_size} bytes")
PY
    pids+=($!)
  done
  # the fast-call module (kernels/fastcall.py: host C++ only, about a minute), beside the libraries
  python3 -c "
import logging, time; logging.basicConfig(level=logging.INFO)
from prunekit.kernels import fastcall
start = time.time(); module = fastcall.load()
print(f'built prunekit_fastcall in {time.time() - start:.0f} s: {fastcall.loaded_path()}' if module else 'BUILD FAILED prunekit_fastcall')
" > "$OUT/build-prunekit_fastcall.log" 2>&1 &
  pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid"; done
  namespaces="$namespaces prunekit_fastcall"
  for ns in $namespaces; do
    line=$(grep -E "^(built|BUILD FAILED)" "$OUT/build-$ns.log" | tail -1)
    size=$(grep -E "^copied" "$OUT/build-$ns.log" | tail -1)
    echo "build $ns: ${line:-no result (see build-$ns.log)} ${size}" | tee -a "$SUMMARY"
  done
fi

if [[ $MODE == cli || $MODE == clitests ]]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$SUMMARY"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$SUMMARY"
  echo "PRUNEKIT_CUDA_ARCHS=$PRUNEKIT_CUDA_ARCHS MAX_JOBS=${MAX_JOBS_USER:-unset} cpus=$(nproc)" | tee -a "$SUMMARY"
  for cmd in build check; do
    step prunekit kernels $cmd
    start=$(date +%s)
    COLUMNS=200 python3 -m prunekit kernels $cmd > "$OUT/cli-$cmd.log" 2>&1
    rc=$?
    echo "prunekit kernels $cmd: rc=$rc $(( $(date +%s) - start ))s $(tail -1 "$OUT/cli-$cmd.log")" | tee -a "$SUMMARY"
  done
fi

if [[ $MODE == all || $MODE == tests || $MODE == clitests ]]; then
  step GPU test files, one process each
  files=${TEST_FILES:-$(grep -l "pytest.mark.cuda\|cuda_only\|requires_cuda\|torch.cuda.is_available" -r tests --include="test_*.py" | sort)}
  deadline=$(( SECONDS + ${TEST_BUDGET_S:-420} ))
  for f in $files; do
    name=$(basename "$f" .py)
    if (( SECONDS >= deadline )); then
      echo "tests $f: skipped (TEST_BUDGET_S spent)" | tee -a "$SUMMARY"
      continue
    fi
    start=$(date +%s)
    timeout $(( deadline - SECONDS > 30 ? deadline - SECONDS : 30 )) python3 -m pytest -q -p no:cacheprovider --maxfail=10 \
      ${TEST_K:+-k "$TEST_K"} "$f" > "$OUT/tests-$name.log" 2>&1
    rc=$?
    tail_line=$(grep -E "passed|failed|error|skipped" "$OUT/tests-$name.log" | tail -1)
    echo "tests $f: rc=$rc $(( $(date +%s) - start ))s ${tail_line}" | tee -a "$SUMMARY"
  done
fi
step done
