#!/usr/bin/env bash
# On the GPU machine: build the fused SpDNN kernel, run its CUDA tests, run the challenge benchmark.
# Usage (repo root): bash scripts/gpu_spdnn.sh   (logs and JSON under $OUT when set)
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 PRUNEKIT_CUDA_ARCHS=90
OUT=${OUT:-/tmp/spdnn-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
python3 -c "from prunekit.kernels import spdnn_cuda; spdnn_cuda.load(verbose=False); print('built in', $(date +%s) - $t0, 's')" 2>&1 | tail -3
python3 -m pytest -q -x tests/spdnn -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -5
python3 benchmarks/spdnn.py --budget-s "${BUDGET_S:-300}" --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -40
