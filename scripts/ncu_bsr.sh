#!/usr/bin/env bash
# Nsight Compute on prunekit's BSR kernel and on torch's Triton bsr_dense_mm at chosen points (GPU machine, repository
# root; builds the structured library on first use):
#
#   NCU_CASES="3072 768 4096 32 0.95 ours;3072 768 4096 32 0.95 triton PRUNEKIT_X=1" OUT=$OUT bash scripts/ncu_bsr.sh
#
# Each case is "M K N block sparsity ours|triton[ VAR=value...]" (the settings apply to that case only): the weight
# keeps each square block with probability 1 - sparsity (N(0, 1) inside), X is nn.Linear's activations x2d (N, K) seen
# as x2d.t(), fp16. "ours" runs the runtime's eager call (structured.bsr_mm_eager with the static schedule), "triton"
# torch.sparse._triton_ops.bsr_dense_mm; the profiled launch is the third of the kernel (`NCU_KERNEL` overrides the
# regex). Report: $OUT/ncu-bsr-<dev>-<date>[-$TAG].txt, and a summary of its main lines on stdout.
set -uo pipefail
# shellcheck source=scripts/gpu_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
dev=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr 'H' 'h')
NCU_OUT="$OUT/ncu-bsr-${dev:-gpu}-$(date -u +%F)${TAG:+-$TAG}.txt"
python3 -c "from prunekit.kernels import structured; structured.load()" || exit 1
cat > /tmp/ncu_bsr_case.py <<'PY'
import sys, torch
from prunekit import formats
from prunekit.formats.bsr import static_schedule
from prunekit.kernels import structured
m, k, n, r, sp, who = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
g = torch.Generator().manual_seed(0)
keep = (torch.rand(m // r, k // r, generator=g) >= sp).repeat_interleave(r, 0).repeat_interleave(r, 1)
w = (torch.randn(m, k, generator=g) * keep).half().cuda()
x2d = torch.randn(n, k, device="cuda").half()
if who == "ours":
    c = {key: t.cuda() for key, t in formats.encode("bsr", w.cpu(), {"block_rows": r, "block_cols": r}).components.items()}
    call = lambda: structured.bsr_mm_eager(c["blocks"], c["crow_indices"], c["col_indices"], x2d.t(), m, None, "none",
                                           c["schedule"], c["split_rows"])
else:
    from torch.sparse._triton_ops import bsr_dense_mm
    wb = w.to_sparse_bsr((r, r))
    call = lambda: bsr_dense_mm(wb, x2d.t())
for _ in range(5):  # compilation and warm-up around the profiled launch (ncu: --launch-skip 2)
    call()
torch.cuda.synchronize()
PY
METRICS=dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum,lts__t_bytes.sum
METRICS+=,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio
: > "$NCU_OUT"
IFS=';' read -ra cases <<< "${NCU_CASES:?set NCU_CASES}"
for case in "${cases[@]}"; do
  read -ra words <<< "$case"
  kern=${NCU_KERNEL:-$([[ ${words[5]} == triton ]] && echo _bsr_strided || echo bsr_wgmma)}
  echo "=== $case (kernel regex $kern)" | tee -a "$NCU_OUT"
  env "${words[@]:6}" timeout 150 ncu -k "regex:$kern" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --section Occupancy --section LaunchStats --metrics "$METRICS" \
    python3 /tmp/ncu_bsr_case.py "${words[@]:0:6}" >> "$NCU_OUT" 2>&1
  echo "ncu exit code $?" | tee -a "$NCU_OUT"
done
STALLS="stalled_.*(long|short|wait|barrier|mio|math|lg|dispatch|no_inst|not_sel|selected|branch|membar|tex|sleep)"
LAUNCH="Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Waves Per|Eligible Warps|Active Warps Per"
LAUNCH+="|Issued Warp|Grid Size|Block Size|Dynamic Shared|Static Shared|Threads"
grep -E "===|  Duration|DRAM Throughput|Memory Throughput|dram__bytes|lts__t_bytes|inst_executed|$STALLS|$LAUNCH" \
  "$NCU_OUT" | head -200
