#!/usr/bin/env bash
# The twenty-seventh session's probe of the static schedule's split rows (scripts/bsr_static_probe.py) on twelve
# patterns, random and with a few dense block rows; one JSON per pattern in $OUT and one summary line each.
#   OUT=$OUT bash scripts/gpu_bsr_static_probe.sh   (after a build: scripts/gpu_session.sh build)
source scripts/gpu_env.sh >/dev/null 2>&1
i=0
while read -r a; do
  i=$((i+1)); f=$OUT/bsr-static-probe-h100-2026-11-26-s27c-$i.json
  python3 scripts/bsr_static_probe.py $a --out $f > $OUT/probe-$i.log 2>&1 || tail -3 $OUT/probe-$i.log
  python3 -c "
import json
d=json.load(open('$f'))
g=lambda k: 1e3*min(d[k+'_gpu_ms_round0'],d[k+'_gpu_ms_round1'])
print(d['m'],d['k'],'N',d['n'],'b',d['block'],d['sparsity'],'heavy',d['heavy_rows'],'x',d['heavy_blocks'],'longest',d['longest_row'],'median',d['median_row'],'split',d['split_rows'],'| stored %.1f unsplit %.1f dynamic %.1f eager_stored %.1f'%(g('stored'),g('natural_unsplit'),g('dynamic'),g('eager_stored')))
" 2>/dev/null
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
