#!/usr/bin/env bash
# Nsight Compute on one SpMM variant's kernel at chosen points (GPU machine, repository root, after
# `bash scripts/gpu_session.sh build`):
#
#   NCU_CASES="4096 4096 16 0.9 rowwarp;11008 4096 16 0.9 bitmap PRUNEKIT_X=1" OUT=$OUT bash scripts/ncu_spmm.sh
#
# Each case is "M K N sparsity variant[ VAR=value...]" (the settings apply to that case only). X is nn.Linear's
# activations seen as X (K, N) (`x2d.t()`), fp16, the weight i.i.d. random (`testing.random_sparse_weight`). The
# profiled kernel is the variant's main kernel (`NCU_KERNEL` overrides the regex), its third launch (plan build and
# warm-up before). Report: $OUT/ncu-spmm-<dev>-<date>[-$TAG].txt, and a summary of its main lines on stdout.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
dev=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr 'H' 'h')
NCU_OUT="$OUT/ncu-spmm-${dev:-gpu}-$(date -u +%F)${TAG:+-$TAG}.txt"
cat > /tmp/ncu_spmm_case.py <<'PY'
import sys, torch
from prunekit.kernels import gpu
from prunekit.kernels.testing import encode_csr, random_sparse_weight
m, k, n, sp, variant = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
c = encode_csr(random_sparse_weight(m, k, sp, torch.float16, "cuda"))
x = torch.randn(n, k, device="cuda").half().t()
for _ in range(5):  # plan build and warm-up around the profiled launch (ncu: --launch-skip 2)
    gpu.spmm_csr(**c, x=x, m=m, variant=variant)
torch.cuda.synchronize()
PY
METRICS=dram__bytes_read.sum,smsp__inst_executed.sum,smsp__sass_inst_executed_op_shared_ld.sum
METRICS+=,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
METRICS+=,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio
declare -A regex=([rowwarp]=spmm_rowwarp [direct]=spmm_direct [bitmap]=nm24_decode [tc]=spmm_tc [scatter]=spmm_scatter
  [dense]=csr_to_dense [tiled]=spmm_tiled)
: > "$NCU_OUT"
IFS=';' read -ra cases <<< "${NCU_CASES:?set NCU_CASES}"
for case in "${cases[@]}"; do
  read -ra words <<< "$case"
  kern=${NCU_KERNEL:-${regex[${words[4]}]:-${words[4]}}}
  echo "=== $case (kernel regex $kern)" | tee -a "$NCU_OUT"
  env "${words[@]:5}" timeout 150 ncu -k "regex:$kern" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
    --section InstructionStats --section ComputeWorkloadAnalysis \
    --metrics "$METRICS" \
    python3 /tmp/ncu_spmm_case.py "${words[@]:0:5}" >> "$NCU_OUT" 2>&1
  echo "ncu exit code $?" | tee -a "$NCU_OUT"
done
STALLS="stalled_.*(long|short|wait|barrier|mio|math|lg|dispatch|no_inst|not_sel|selected|branch|membar|tex)"
LAUNCH="Achieved Occupancy|Registers Per|Block Limit|Waves Per|Eligible Warps|Active Warps Per|Issued Warp"
LAUNCH+="|Executed Ipc A|Grid Size|Block Size|Dynamic Shared"
grep -E "===|  Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|inst_executed|wavefronts|bank_conflicts|$STALLS|$LAUNCH" \
  "$NCU_OUT" | head -150
