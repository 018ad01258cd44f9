#!/usr/bin/env bash
# The twenty-seventh session's probe of the static schedule's split rows (benchmarks/bsr_static_probe.py) on twelve
# patterns, random and with a few dense block rows; one JSON per pattern in $OUT and one summary line each.
#   OUT=$OUT TAG=h100-<date> bash scripts/gpu_bsr_static_probe.sh   (after a build: scripts/gpu_session.sh build)
source scripts/gpu_env.sh >/dev/null 2>&1
i=0
while read -r a; do
  i=$((i+1)); f=$OUT/bsr-static-probe-${TAG:-run}-$i.json
  python3 benchmarks/bsr_static_probe.py $a --out "$f" > "$OUT/probe-$i.log" 2>&1 || tail -3 "$OUT/probe-$i.log"
  tail -n 1 "$OUT/probe-$i.log"
done <<'ARGS'
--m 11008 --n 128 --sparsity 0.95 --heavy-rows 1 --heavy-blocks 16
--m 11008 --n 128 --sparsity 0.95 --heavy-rows 1 --heavy-blocks 32
--m 11008 --n 128 --sparsity 0.95 --heavy-rows 1 --heavy-blocks 64
--m 11008 --n 128 --sparsity 0.95 --heavy-rows 8 --heavy-blocks 64
--m 11008 --n 2048 --sparsity 0.95 --heavy-rows 1 --heavy-blocks 32
--m 11008 --n 2048 --sparsity 0.95 --heavy-rows 1 --heavy-blocks 64
--m 11008 --n 2048 --sparsity 0.95 --heavy-rows 8 --heavy-blocks 64
--m 11008 --n 16 --sparsity 0.95 --heavy-rows 1 --heavy-blocks 64
--m 4096 --k 8192 --block 32 --n 128 --sparsity 0.95 --heavy-rows 1 --heavy-blocks 256
--m 4096 --k 8192 --block 32 --n 2048 --sparsity 0.95 --heavy-rows 1 --heavy-blocks 256
--m 4096 --k 16384 --block 16 --n 2048 --sparsity 0.95 --heavy-rows 2 --heavy-blocks 1024
--m 16384 --k 16384 --block 64 --n 2048 --sparsity 0.9 --heavy-rows 2 --heavy-blocks 256
ARGS
