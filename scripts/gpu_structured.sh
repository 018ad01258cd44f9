#!/usr/bin/env bash
# One GPU-machine run for issue 5: build the structured-sparse extension (BSR tensor-core matmul; 2:4 uses torch's
# cuSPARSELt), run the BSR / N:M tests (CUDA ones included), a compute-sanitizer memcheck of small cases, then the
# BSR and 2:4 benchmarks. Logs and JSON go to $OUT (or ./out).
#
#   scripts/gpu_structured.sh [all|test|bench] [bsr benchmark args...]
#
# Run from the repository root on a machine with a CUDA GPU, nvcc and ninja (no install needed: PYTHONPATH=src).
set -uo pipefail
MODE=${1:-all}
shift || true
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export PRUNEKIT_KERNEL_CACHE=${PRUNEKIT_KERNEL_CACHE:-$PWD/.carry/kernel-cache}
export PRUNEKIT_CUDA_ARCHS=${PRUNEKIT_CUDA_ARCHS:-90}
export MAX_JOBS=${MAX_JOBS:-8}
DATE=$(date -u +%Y-%m-%d)
DEV=$(python3 -c "import torch; n=torch.cuda.get_device_name(0).lower(); print('h100' if 'h100' in n else 'h200' if 'h200' in n else n.replace(' ', '-'))")
step() { echo "=== $* ($(date -u +%H:%M:%S))"; }

step build
python3 -c "
import logging, time; logging.basicConfig(level=logging.INFO)
import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), 'cusparselt', torch.backends.cusparselt.is_available())
from prunekit.kernels import structured
t = time.time(); print(structured.load(verbose=False), f'{time.time() - t:.1f}s')
print('cuSPARSELt wheel folder', structured.cusparselt_dir())
t = time.time()
try:
    structured.load_cslt(verbose=True); print('cuSPARSELt binding built', f'{time.time() - t:.1f}s')
except Exception as exc:
    print('cuSPARSELt binding FAILED:', exc)
" > "$OUT/build.log" 2>&1
rc=$?; grep -E "^2\.|\.so |wheel folder|binding" "$OUT/build.log" | tail -6; [[ $rc == 0 ]] || { tail -60 "$OUT/build.log"; exit 1; }

if [[ $MODE == all || $MODE == test ]]; then
  step tests
  timeout 240 python3 -m pytest -q --maxfail=6 -p no:cacheprovider tests/kernels/test_bsr_mm.py tests/kernels/test_nm_mm.py \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit code $?"; tail -15 "$OUT/tests.log"
  step compute-sanitizer memcheck
  cat > /tmp/sanitize_structured.py <<'PY'
import sys, torch
sys.path.insert(0, "tests/kernels")
from test_bsr_mm import block_sparse_weight, _components
from prunekit.formats.bsr import static_schedule
from prunekit.kernels import structured
for dtype in (torch.float16, torch.bfloat16):
    for r, c in ((16, 16), (32, 64), (64, 32), (64, 64)):
        m, k, n = 4 * r, 3 * c, 37
        dense = block_sparse_weight(m, k, r, c, 0.5, dtype, heavy_rows=1)
        comp = {key: t.cuda() for key, t in _components(dense, r, c).items()}
        sched, split = (t.cuda() for t in static_schedule(comp["crow_indices"], chunk=1))
        x2d = torch.randn(n, k, device="cuda").to(dtype)
        bias = torch.randn(m, device="cuda").to(dtype)
        for x in (x2d.t(), x2d.t().contiguous()):
            for tile_n in structured.TILE_NS:
                structured.bsr_mm_cuda(comp["blocks"], comp["crow_indices"], comp["col_indices"], x, m, bias, "relu", tile_n=tile_n)
                structured.bsr_mm_cuda(comp["blocks"], comp["crow_indices"], comp["col_indices"], x, m, bias, "relu", sched, split, tile_n=tile_n)
torch.cuda.synchronize()
print("sanitize case ran")
PY
  timeout 120 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 9 python3 /tmp/sanitize_structured.py \
    > "$OUT/memcheck.log" 2>&1
  echo "compute-sanitizer exit code $?" | tee -a "$OUT/memcheck.log"; tail -3 "$OUT/memcheck.log"
fi

if [[ $MODE == all || $MODE == bench ]]; then
  step host overhead per call
  cat > /tmp/overhead_structured.py <<'PY'
# Host time per eager call (perf_counter over 400 calls, fewer than the launch queue holds) of each layer of the
# BSR and 2:4 paths at a decode shape, to see where eager time goes.
import time, torch, torch.nn.functional as F
from prunekit import formats
from prunekit.kernels import structured
from prunekit.formats.bsr import static_schedule
def host_us(fn, n=400):
    for _ in range(30): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6
torch.manual_seed(0)
m = k = 4096; n = 16; r = 64
keep = torch.rand(m // r, k // r) > 0.9
w = (torch.randn(m, k) * keep.repeat_interleave(r, 0).repeat_interleave(r, 1)).half()
c = {key: t.cuda() for key, t in formats.encode("bsr", w, {"block_rows": r, "block_cols": r}).components.items()}
x2d = torch.randn(n, k, device="cuda", dtype=torch.float16)
y = torch.empty(n, m, device="cuda", dtype=torch.float16).t()
wd = w.cuda()
structured.load()
raw = torch.ops.prunekit_structured.bsr_mm_out.default
rows = {
  "bsr direct (structured.bsr_mm_cuda, static)": lambda: structured.bsr_mm_cuda(c["blocks"], c["crow_indices"], c["col_indices"], x2d.t(), m, None, "none", c["schedule"], c["split_rows"]),
  "bsr custom op (prunekit::bsr_mm_static)": lambda: structured.bsr_mm_static(c["blocks"], c["crow_indices"], c["col_indices"], c["schedule"], c["split_rows"], x2d.t(), m),
  "bsr raw extension op (torch.ops..bsr_mm_out.default)": lambda: raw(c["blocks"], c["crow_indices"], c["col_indices"], c["schedule"], c["split_rows"], x2d.t(), y, None, False, 32, True),
  "dense F.linear (cuBLAS)": lambda: F.linear(x2d, wd),
}
w24 = torch.randn(m, k // 4, 4)
w24 = (w24 * torch.zeros_like(w24, dtype=torch.bool).scatter_(2, w24.abs().topk(2, dim=2).indices, True)).reshape(m, k).half().cuda()
e = formats.encode("nm", w24, {"n": 2, "m": 4})
v, md, bits = e.components["values"], e.components["metadata"], int(e.params["bits"])
packed = structured.compressed_24(v, md, bits, k)
y24 = torch.empty(n, m, device="cuda", dtype=torch.float16).t()
print("native cuSPARSELt binding:", structured.native_cslt_available())
rows["2:4 direct, own cuSPARSELt binding (structured.nm_mm_cuda)"] = lambda: structured.nm_mm_cuda(v, md, x2d.t(), 2, 4, bits)
rows["2:4 direct, backend=torch"] = lambda: structured.nm_mm_cuda(v, md, x2d.t(), 2, 4, bits, backend="torch")
rows["2:4 raw binding op (torch.ops.prunekit_cslt.mm.default)"] = lambda: torch.ops.prunekit_cslt.mm.default(structured.native_weight_24(v, md, bits, k).id, x2d.t(), y24, None, False)
rows["2:4 compressed_24 cache hit"] = lambda: structured.compressed_24(v, md, bits, k)
rows["2:4 torch._cslt_sparse_mm alone"] = lambda: torch._cslt_sparse_mm(packed, x2d.t(), transpose_result=True)
before = structured.compress_calls
for name, fn in rows.items():
    print(f"{host_us(fn):9.1f} us  {name}")
print("compressions during the loops:", structured.compress_calls - before)
PY
  timeout 90 python3 /tmp/overhead_structured.py > "$OUT/overhead.log" 2>&1; echo "overhead exit code $?"; cat "$OUT/overhead.log"
  step bsr benchmark
  timeout ${BSR_TIMEOUT:-200} python3 benchmarks/bsr.py --out "$OUT/bsr-$DEV-$DATE.json" "$@" > "$OUT/bench_bsr.log" 2>&1
  echo "bsr benchmark exit code $?"; grep -v "^\s*$" "$OUT/bench_bsr.log" | tail -40
  step nm benchmark
  timeout ${NM_TIMEOUT:-120} python3 benchmarks/nm.py --out "$OUT/nm-$DEV-$DATE.json" > "$OUT/bench_nm.log" 2>&1
  echo "nm benchmark exit code $?"; tail -25 "$OUT/bench_nm.log"
fi
step done
