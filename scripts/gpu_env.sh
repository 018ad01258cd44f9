# Sourced by scripts/gpu_fastcall.sh and scripts/gpu_rowwarp.sh (run from the repository root on the GPU machine): the
# output folder, the source tree on the path (no install), and the kernel cache and archs gpu_session.sh builds with
# (another PRUNEKIT_CUDA_ARCHS gives another cache key, and every library would build again).
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PRUNEKIT_KERNEL_CACHE=${PRUNEKIT_KERNEL_CACHE:-$PWD/.carry/kernel-cache}
export PRUNEKIT_CUDA_ARCHS=${PRUNEKIT_CUDA_ARCHS:-90}
