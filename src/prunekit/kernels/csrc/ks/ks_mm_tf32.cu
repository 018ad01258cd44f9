// fp32 Kronecker-sparse matmul on tensor cores with 3xTF32 (its own translation unit): ks_mm_tc_kernel<float, 64,
// one stage> of ks_mm.cuh, whose mma step splits each fp32 operand into tf32 hi + lo (split_tf32) and accumulates
// hi*hi + hi*lo + lo*hi in fp32. Loads take the guarded scalar paths (the 16-byte paths are for 16-bit types).
#include "ks_mm.cuh"

namespace prunekit_ks {

void launch_tf32x3(const KsArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(args.a) * args.d),
                  static_cast<unsigned>((args.n + TC_BN - 1) / TC_BN), static_cast<unsigned>((args.b + 63) / 64));
  ks_mm_tc_kernel<float, 64, false><<<grid, TC_THREADS, 0, stream>>>(args, 0, 0);
}

}  // namespace prunekit_ks
