// BSR times dense matmul on Hopper's warpgroup tensor cores (sm_90a only): TMA loads, mbarrier pipeline, wgmma.
//
// Same operation, arguments and schedule as bsr_mm_kernel in bsr_mm.cuh (Y = act(A @ X + bias), A in BSR with
// 64 x C blocks, C in {16, 32, 64}; dynamic mode or PopSparse's static schedule, Li et al. 2023), restructured the way
// a Hopper dense GEMM is: every stored block is one k-step of a dense mainloop whose A tile is the block itself (one
// contiguous 64 x C tile of `blocks`) and whose B tile is the C x BN slab of X at the block's column, a TMA box load
// at a runtime coordinate (col * C, n0). One producer warpgroup (or, with WARP_PRODUCER, one warp after the consumers:
// fewer threads and stages per CTA, for short block rows) issues the TMA loads into a STAGES-deep ring of
// shared-memory stages guarded by mbarriers (full: TMA bytes landed; empty: every consumer warp is done with the
// stage); CONSUMERS warpgroups each own 64 x 128 of the CTA's 64 x BN output tile (BN = 128 * CONSUMERS) and run
// wgmma.mma_async m64n128k16 straight from shared memory (descriptors with the hardware swizzle TMA wrote: 128-,
// 64- or 32-byte for C = 64, 32, 16, so that no bank conflicts arise and no ldmatrix is needed).
//
// This header holds the kernel and its launch templates (instantiated per dtype in bsr_mm_wgmma_f16.cu and
// bsr_mm_wgmma_bf16.cu, which compile in parallel); bsr_mm_wgmma.cu holds the host entry. Compiled for every target
// like the rest of the library; the kernel body exists only in the sm_90a image
// (__CUDA_ARCH_FEAT_SM90_ALL), and bsr_wgmma_available() tells the host at run time (one probe launch per process).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "bsr_mm.cuh"
#include "../check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PK_SM90A 1
#endif

namespace prunekit_structured {
namespace wgmma_bsr {

constexpr int R = 64;      // block rows: wgmma's M
constexpr int WG_N = 128;  // output columns per consumer warpgroup (m64n128k16)

// WARP_PRODUCER: the TMA loads come from one warp after the consumers (128 * CONSUMERS + 32 threads) instead of a
// warpgroup before them, and the stage count is the launcher's (args.stages of BsrTArgs, at most STAGES): 96 fewer
// threads' registers and, with fewer stages, less shared memory per CTA, so that more CTAs fit an SM.
// WN: output columns (tokens) per consumer warpgroup, WG_N or, with WARP_PRODUCER, 64 (m64n64k16: half the
// accumulators and of the X slab, so that more CTAs fit an SM).
template <int C, int CONSUMERS, bool WARP_PRODUCER = false, int WN = WG_N>
struct WgConfig {
  static_assert(WN == WG_N || (WN == 64 && WARP_PRODUCER), "64-token consumers only with the producer warp");
  static constexpr int BN = WN * CONSUMERS;
  static constexpr int NACC = WN / 2;  // fp32 accumulators per thread
  static constexpr int THREADS = 128 * CONSUMERS + (WARP_PRODUCER ? 32 : 128);
  static constexpr int STAGES = C == 64 ? 4 : (C == 32 ? 6 : 8);  // the most (the only count without WARP_PRODUCER)
  static constexpr int A_BYTES = R * C * 2;
  static constexpr int B_BYTES = BN * C * 2;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;  // a multiple of 1024: every stage stays swizzle-aligned
  static constexpr int OUT_LD = R + 8;                   // epilogue tile, Y^T rows of R (+8 halves: no conflicts)
  static constexpr int smem_bytes(int stages) { return 1024 + stages * STAGE_BYTES + 2 * STAGES * 8; }
  static constexpr int SMEM_BYTES = smem_bytes(STAGES);
  // the fewest stages: two, and enough to hold the epilogue tile, which reuses the pipeline's memory
  static constexpr int EPI_STAGES = (BN * OUT_LD * 2 + STAGE_BYTES - 1) / STAGE_BYTES;
  static constexpr int MIN_STAGES = EPI_STAGES > 2 ? EPI_STAGES : 2;
  static_assert(STAGE_BYTES % 1024 == 0, "stages must keep 1024-byte alignment");
  static_assert(MIN_STAGES <= STAGES, "epilogue tile must fit in the pipeline's memory");
  static_assert(SMEM_BYTES <= 227 * 1024, "shared memory");
};

// Shared-memory matrix descriptor of a K-major tile whose rows are C halves (= the swizzle width, 2 * C bytes) and
// whose 8-row core-matrix groups are 8 * 2 * C bytes apart (PTX ISA, "Matrix Descriptor Format" of wgmma): start
// address >> 4 in bits 0-13, leading byte offset (unused for swizzled K-major; 1) in 16-29, stride byte offset >> 4
// in 32-45, swizzle mode in 62-63 (1: 128B, 2: 64B, 3: 32B). A k-step of 16 halves inside the swizzle atom is the
// start address plus 32 bytes; the hardware applies the XOR pattern to the computed addresses.
template <int C>
__host__ __device__ constexpr uint64_t make_desc(uint32_t smem_addr) {
  constexpr uint64_t mode = C == 64 ? 1 : (C == 32 ? 2 : 3);
  constexpr uint64_t sbo = 8 * 2 * C;
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | ((sbo >> 4) << 32) | (mode << 62);
}
// The exact bits at a 1024-byte-aligned tile (start 1024 >> 4 = 0x40, LBO 1, SBO 1024/512/256 >> 4, mode 1/2/3);
// tests/kernels/test_structured_tiling.py decodes the same literals with its address model of TMA + wgmma.
static_assert(make_desc<64>(1024) == 0x4000004000010040ull, "descriptor bits, C = 64 (128-byte swizzle)");
static_assert(make_desc<32>(1024) == 0x8000002000010040ull, "descriptor bits, C = 32 (64-byte swizzle)");
static_assert(make_desc<16>(1024) == 0xC000001000010040ull, "descriptor bits, C = 16 (32-byte swizzle)");
static_assert(make_desc<64>(1024 + 32) == make_desc<64>(1024) + 2, "a k-step of 16 halves adds 32 bytes >> 4");

#ifdef PK_SM90A
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// Bulk copy of `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned) from global `src` into
// `dst`, completing them on `bar` (the TMA engine's non-tensor copy).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, int bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
// 2-D TMA box load of `map` at (c0 inner, c1 outer) into `dst`, completing `bytes` on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void consumer_sync(int threads) {
  asm volatile("bar.sync 1, %0;\n" ::"r"(threads) : "memory");
}
// A copy of v the compiler cannot see through: per-tile values derived from it (the epilogue's addresses) are then
// computed in each tile instead of being hoisted out of bsr_wgmma_t_kernel's tile loop, which held them in registers
// (spills at its 80-register bound).
__device__ __forceinline__ int opaque(int v) {
  asm volatile("" : "+r"(v));
  return v;
}
// Accumulator registers the compiler must keep in place around the asynchronous wgmmas that read and write them.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One wgmma.mma_async m64nNk16 with fp32 accumulators (N / 2 per thread), both operands K-major in shared memory:
// D (64 x N) += A (64 x 16, descriptor) * B (16 x N, descriptor). N = 128 / 64: bsr_wgmma_kernel's consumers of
// WN tokens; N = 32 / 16: bsr_wgmma_t_kernel's blocks of RB rows. AB names the A/B element type in PTX.
template <typename T, int N>
struct WgmmaN;
#define PRUNEKIT_WGMMA_M64N128K16(AB) \
  static __device__ __forceinline__ void run(float (&d)[64], uint64_t desc_a, uint64_t desc_b) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
        "%64, %65, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "l"(desc_a), "l"(desc_b), "r"(1)); \
  }

#define PRUNEKIT_WGMMA_M64N64K16(AB) \
  static __device__ __forceinline__ void run(float (&d)[32], uint64_t desc_a, uint64_t desc_b) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
        "%32, %33, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "l"(desc_a), "l"(desc_b), "r"(1)); \
  }
#define PRUNEKIT_WGMMA_M64N32K16(AB) \
  static __device__ __forceinline__ void run(float (&d)[16], uint64_t desc_a, uint64_t desc_b) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." AB "." AB " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, " \
        "%16, %17, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
        : "l"(desc_a), "l"(desc_b), "r"(1)); \
  }
#define PRUNEKIT_WGMMA_M64N16K16(AB) \
  static __device__ __forceinline__ void run(float (&d)[8], uint64_t desc_a, uint64_t desc_b) { \
    asm volatile( \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n16k16.f32." AB "." AB " " \
        "{%0, %1, %2, %3, %4, %5, %6, %7}, " \
        "%8, %9, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
        : "l"(desc_a), "l"(desc_b), "r"(1)); \
  }

// WgmmaN<__half, N> and WgmmaN<__nv_bfloat16, N> from one of the macros above
#define PRUNEKIT_WGMMA_N(N, MMA) \
  template <> \
  struct WgmmaN<__half, N> { \
    MMA("f16") \
  }; \
  template <> \
  struct WgmmaN<__nv_bfloat16, N> { \
    MMA("bf16") \
  };
PRUNEKIT_WGMMA_N(128, PRUNEKIT_WGMMA_M64N128K16)
PRUNEKIT_WGMMA_N(64, PRUNEKIT_WGMMA_M64N64K16)
PRUNEKIT_WGMMA_N(32, PRUNEKIT_WGMMA_M64N32K16)
PRUNEKIT_WGMMA_N(16, PRUNEKIT_WGMMA_M64N16K16)
#endif  // PK_SM90A

// Accumulator element i of lane `lane` in warp `warp` (0-3) of a consumer warpgroup, m64nNk16 fp32 layout (PTX ISA,
// "Register Fragments" of wgmma .m64nNk16): row 16 * warp + lane / 4 + 8 * ((i / 2) % 2), column
// 8 * (i / 4) + 2 * (lane % 4) + i % 2. (tests/kernels/test_structured_tiling.py checks the map is a bijection.)
__host__ __device__ constexpr int acc_row(int warp, int lane, int i) { return 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1); }
__host__ __device__ constexpr int acc_col(int lane, int i) { return 8 * (i >> 2) + 2 * (lane & 3) + (i & 1); }

// bsr_wgmma_t_kernel's arguments (and bsr_wgmma_kernel's with WARP_PRODUCER, which reads `stages` only): BsrArgs and
// the launch plan, work items (schedule items or block rows), pipeline stages and whether Y^T is staged in a tile of
// its own. A struct of its own so that BsrArgs keeps its size: 16 more bytes in BsrArgs changed how nvcc compiled
// bsr_wgmma_kernel's epilogue (half its stores; cuobjdump -sass), a kernel this plan does not reach.
struct BsrTArgs : BsrArgs {
  int n_items, stages, own_tile;
};

// An empty block row's tile of Y^T rows (args.staged == 1: y[n * syn + m], sym == 1, syn % 8 == 0, 16-byte aligned):
// act(bias) or zeros for rows m0 ... m0 + RB - 1 and tokens n0 ... n0 + BN - 1 (those below args.n), one 16-byte store
// per 8 rows, by `threads` threads (a multiple of RB / 8, so each thread keeps the same 8 rows) numbered from `tid`.
// No pipeline, no accumulators and no shared memory: the tile has no block to multiply.
template <typename T, int RB, int BN>
__device__ __forceinline__ void fill_empty_tile(const BsrArgs& args, long long m0, int n0, int tid, int threads) {
  constexpr int PER_ROW = RB / 8;
  const int ml = (tid % PER_ROW) * 8;
  const T* bias = static_cast<const T*>(args.bias);
  alignas(16) T v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float b = bias != nullptr ? to_f(bias[m0 + ml + j]) : 0.f;
    if (args.relu) b = fmaxf(b, 0.f);
    v[j] = from_f<T>(b);
  }
  const int4 value = *reinterpret_cast<const int4*>(v);
  T* y = static_cast<T*>(args.y);
  const int tokens = min(BN, args.n - n0);
  for (int nl = tid / PER_ROW; nl < tokens; nl += threads / PER_ROW)
    *reinterpret_cast<int4*>(y + static_cast<long long>(n0 + nl) * args.syn + m0 + ml) = value;
}

// The position in a ring of `stages` pipeline stages (a run-time count), advanced one use at a time: the stage and the
// parity of its mbarriers' current phase, without the integer division per use that g % stages and g / stages cost.
// In bsr_wgmma_t_kernel, whose stages carry little math (one or two m64n16k16 / m64n32k16 per consumer), those
// divisions had made it 1.04-1.50x slower (H100, fp16, same call: 16-row blocks at N = 2048, 32-row at N = 128;
// benchmarks/results/bsr-ab-{base,fix}{16,32}-h100-2026-11-27-s36e.json, scripts/bsr_ab.sh). bsr_wgmma_kernel (64-row
// blocks) with a producer warp took 0.95-0.99x of the time with it at 3072 x 768 @ 2048 / 4096, 90 / 95%
// (bsr-ab-{base,new}0-h100-2026-11-27-s37{a,d}.json).
struct StageRing {
  int stage = 0, phase = 0;
  __device__ __forceinline__ void next(int stages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// The arguments of bsr_wgmma_kernel: BsrArgs, or BsrTArgs (its `stages`) with WARP_PRODUCER.
template <bool WARP_PRODUCER>
using WgArgs = std::conditional_t<WARP_PRODUCER, BsrTArgs, BsrArgs>;
// Pipeline stages of bsr_wgmma_kernel: Cfg::STAGES, a constant, or the launcher's count with WARP_PRODUCER.
template <typename Cfg, bool WARP_PRODUCER>
__device__ __forceinline__ int wg_stages(const WgArgs<WARP_PRODUCER>& args) {
  if constexpr (WARP_PRODUCER) {
    return args.stages;
  } else {
    return Cfg::STAGES;
  }
}

template <typename T, int C, int CONSUMERS, bool WARP_PRODUCER, int WN = WG_N>
__global__ void __launch_bounds__(WgConfig<C, CONSUMERS, WARP_PRODUCER, WN>::THREADS, 1)
    bsr_wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_x,
                     const WgArgs<WARP_PRODUCER> args) {
#ifdef PK_SM90A
  using Cfg = WgConfig<C, CONSUMERS, WARP_PRODUCER, WN>;
  constexpr int NACC = Cfg::NACC;
  constexpr int BN = Cfg::BN;
  const int STAGES = wg_stages<Cfg, WARP_PRODUCER>(args);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * Cfg::STAGE_BYTES);
  uint64_t* empty = full + Cfg::STAGES;

  // programmatic dependent launch (args.pdl): anything below may be the preceding kernel's output (the pattern, X, a
  // schedule or indices the op's wrappers converted just before), so wait before reading or writing anything
  prunekit_launch::wait_preceding_grid();
  const BsrWork work = bsr_work_item(args);
  const int block_row = work.block_row, start = work.start, end = work.end, slot = work.slot;
  const int count = end - start;
  const int n0 = blockIdx.y * BN;
  const int wg = threadIdx.x >> 7;
  if constexpr (WARP_PRODUCER) {  // an empty block row: act(bias), straight to Y^T, without the pipeline
    if (count == 0 && slot < 0 && args.staged == 1) {
      prunekit_launch::allow_dependent_launch();
      fill_empty_tile<T, R, BN>(args, static_cast<long long>(block_row) * R, n0, threadIdx.x, Cfg::THREADS);
      return;
    }
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 4 * CONSUMERS);  // lane 0 of every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // producer: the warpgroup before the consumers, or with WARP_PRODUCER the warp after them; one thread issues every
  // TMA load
  constexpr int PRODUCER0 = WARP_PRODUCER ? 128 * CONSUMERS : 0;  // its first thread
  if (WARP_PRODUCER ? threadIdx.x >= PRODUCER0 : wg == 0) {
    if (threadIdx.x == PRODUCER0) {
      StageRing ring;  // (a run-time stage count with WARP_PRODUCER: no division per stage)
      for (int it = 0; it < count; ++it, ring.next(STAGES)) {
        const int s = ring.stage;
        if (it >= STAGES) mbar_wait(&empty[s], ring.phase ^ 1);  // the consumers' previous release of stage s
        unsigned char* a_dst = smem + s * Cfg::STAGE_BYTES;
        const int b = start + it;
        mbar_expect_tx(&full[s], Cfg::STAGE_BYTES);
        tma_load_2d(a_dst, &map_a, 0, b * R, &full[s]);
        tma_load_2d(a_dst + Cfg::A_BYTES, &map_x, __ldg(args.cols + b) * C, n0, &full[s]);
      }
    }
    return;
  }

  const int cw = WARP_PRODUCER ? wg : wg - 1;  // consumer index: columns cw * WN ... of the CTA tile
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  StageRing ring;
  int prev = 0;  // the stage before ring.stage, released once its wgmmas are done
  for (int it = 0; it < count; ++it, prev = ring.stage, ring.next(STAGES)) {
    const int s = ring.stage;
    mbar_wait(&full[s], ring.phase);
    const uint32_t a_addr = smem_u32(smem + s * Cfg::STAGE_BYTES);
    const uint32_t b_addr = a_addr + Cfg::A_BYTES + cw * WN * C * 2;
    fence_regs(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk)
      WgmmaN<T, WN>::run(acc, make_desc<C>(a_addr + kk * 32), make_desc<C>(b_addr + kk * 32));
    wgmma_commit();
    fence_regs(acc);
    wgmma_wait<1>();  // the previous stage's wgmmas are done: release it to the producer
    if (it > 0 && lane == 0) mbar_arrive(&empty[prev]);
  }
  wgmma_wait<0>();
  fence_regs(acc);
  prunekit_launch::allow_dependent_launch();  // the next kernel may start; its wait still covers these writes

  const long long m0 = static_cast<long long>(block_row) * R;
  if (slot >= 0) {  // a slice of a split block row: fp32 partial sums, finished by bsr_finalize_kernel
    float* ws = args.ws + static_cast<long long>(slot) * R * args.n;
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      const int nn = n0 + cw * WN + acc_col(lane, i);
      if (nn < args.n) atomicAdd(ws + static_cast<long long>(acc_row(warp, lane, i)) * args.n + nn, acc[i]);
    }
    return;
  }
  T* y = static_cast<T*>(args.y);
  const T* bias = static_cast<const T*>(args.bias);
  float bias_v[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) bias_v[h] = bias != nullptr ? to_f(bias[m0 + acc_row(warp, lane, 2 * h)]) : 0.f;
  if (args.staged == 1) {  // Y^T (the runtime's (N, M) output): through shared memory, 16-byte stores along m
    T* tile = reinterpret_cast<T*>(smem);
    consumer_sync(128 * CONSUMERS);  // every consumer's wgmmas have finished reading the pipeline stages
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      float v = acc[i] + bias_v[(i >> 1) & 1];
      if (args.relu) v = fmaxf(v, 0.f);
      tile[(cw * WN + acc_col(lane, i)) * Cfg::OUT_LD + acc_row(warp, lane, i)] = from_f<T>(v);
    }
    consumer_sync(128 * CONSUMERS);
    constexpr int PER_ROW = R / 8;
    for (int idx = threadIdx.x - (WARP_PRODUCER ? 0 : 128); idx < BN * PER_ROW; idx += 128 * CONSUMERS) {
      const int nl = idx / PER_ROW, ml = (idx % PER_ROW) * 8;
      if (n0 + nl < args.n)
        *reinterpret_cast<int4*>(y + static_cast<long long>(n0 + nl) * args.syn + m0 + ml) =
            *reinterpret_cast<const int4*>(tile + nl * Cfg::OUT_LD + ml);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < NACC; ++i) {
    const int nn = n0 + cw * WN + acc_col(lane, i);
    if (nn < args.n) {
      float v = acc[i] + bias_v[(i >> 1) & 1];
      if (args.relu) v = fmaxf(v, 0.f);
      y[(m0 + acc_row(warp, lane, i)) * args.sym + static_cast<long long>(nn) * args.syn] = from_f<T>(v);
    }
  }
#endif  // PK_SM90A
}

// The launch of bsr_wgmma_t_kernel (16- and 32-row blocks; bsr_wgmma_kernel above keeps one tile per CTA): its grid
// (a CTA per output tile, or per group of tiles_per_cta tiles, or for tiles_per_cta == TILES_WAVE one wave of resident
// CTAs where that gives each at least WAVE_MIN_TILES tiles: with fewer, the CTAs holding one tile more would leave a
// tail), stages and staging tile, set in `args`. resident(smem): CTAs of the kernel that the GPU holds at once with
// that much dynamic shared memory each; smem_of(stages, own_tile): the kernel's dynamic shared memory. single_stages /
// multi_stages: the most stages of CTAs of one tile / of several (which keep a staging tile of their own);
// stages_wanted: $PRUNEKIT_BSR_STAGES or the rule (0: the most); stage_bytes: bytes per stage; epi_bytes: the Y^T
// staging tile (0: the epilogue needs none).
constexpr int TILES_WAVE = -1;  // tiles_per_cta: as many CTAs as one wave holds, each looping over tiles
constexpr int WAVE_MIN_TILES = 2;
struct WgLaunch {
  int ctas, smem;
};
template <typename Resident, typename SmemOf>
WgLaunch plan_launch(BsrTArgs& args, int tiles_per_cta, int grid_rows, int bn, int single_stages, int multi_stages,
                     int stages_wanted, int epi_bytes, int stage_bytes, const Resident& resident,
                     const SmemOf& smem_of) {
  const long long units = static_cast<long long>(grid_rows) * ((args.n + bn - 1) / bn);
  PRUNEKIT_CHECK(units < (1LL << 31), "bsr_mm wgmma: too many output tiles (", units, ")");
  const auto stages_of = [&](int most) { return std::max(2, std::min(stages_wanted > 0 ? stages_wanted : most, most)); };
  long long ctas = units;
  if (tiles_per_cta == TILES_WAVE) {
    const long long wave = resident(smem_of(stages_of(multi_stages), epi_bytes > 0));
    if (units >= WAVE_MIN_TILES * wave) ctas = wave;
  } else if (tiles_per_cta > 1) {
    ctas = (units + tiles_per_cta - 1) / tiles_per_cta;
  }
  const bool grouped = ctas < units;
  args.n_items = grid_rows;
  args.stages = stages_of(grouped ? multi_stages : single_stages);
  // Y^T is staged in the pipeline's memory only with one tile per CTA and room for the tile there
  args.own_tile = epi_bytes > 0 && (grouped || args.stages * stage_bytes < epi_bytes) ? 1 : 0;
  return {static_cast<int>(std::max<long long>(ctas, 1)), smem_of(args.stages, args.own_tile != 0)};
}

// CTAs of `kernel` that one SM holds with `threads` threads and `smem` bytes of dynamic shared memory, times the SMs of
// the current device: the occupancy query once per kernel, device and size.
template <typename Kernel>
int wave_ctas(Kernel kernel, int threads, int smem) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, smem);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int ctas = std::max(1, per_sm) * prunekit_launch::device_props(device).sms;
  cache.emplace(key, ctas);
  return ctas;
}

// Pipeline stages of bsr_wgmma_kernel with WARP_PRODUCER: `wanted` ($PRUNEKIT_BSR_STAGES or the rule; 0: the most)
// between the kernel's fewest and most.
template <int C, int CONSUMERS, int WN>
constexpr int wp_stages(int wanted) {
  using Cfg = WgConfig<C, CONSUMERS, true, WN>;
  return std::max(Cfg::MIN_STAGES, std::min(wanted > 0 ? wanted : Cfg::STAGES, Cfg::STAGES));
}

// The launch of bsr_wgmma_kernel: a CTA per output tile (work item, N tile); with WARP_PRODUCER `stages` pipeline
// stages (wp_stages), else the kernel's constant count (`stages` unused).
template <typename T, int C, int CONSUMERS, bool WARP_PRODUCER, int WN>
void launch(const CUtensorMap& map_a, const CUtensorMap& map_x, const BsrArgs& base, int grid_rows, int stages,
            cudaStream_t stream) {
  using Cfg = WgConfig<C, CONSUMERS, WARP_PRODUCER, WN>;
  auto kernel = bsr_wgmma_kernel<T, C, CONSUMERS, WARP_PRODUCER, WN>;
  constexpr int MAX_DEVICES = 64;
  static std::once_flag once[MAX_DEVICES];  // per instantiation and device: the attribute is set per device
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  PRUNEKIT_CHECK(device >= 0 && device < MAX_DEVICES, "bsr_mm wgmma: device index ", device, " out of range");
  std::call_once(once[device], [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM_BYTES));
  });
  const dim3 grid(grid_rows, (base.n + Cfg::BN - 1) / Cfg::BN);
  if constexpr (WARP_PRODUCER) {
    BsrTArgs args{};
    static_cast<BsrArgs&>(args) = base;
    args.n_items = grid_rows;
    args.stages = wp_stages<C, CONSUMERS, WN>(stages);
    prunekit_launch::launch(kernel, grid, dim3(Cfg::THREADS), Cfg::smem_bytes(args.stages), stream, args.pdl != 0,
                            map_a, map_x, args);
  } else {
    prunekit_launch::launch(kernel, grid, dim3(Cfg::THREADS), Cfg::SMEM_BYTES, stream, base.pdl != 0, map_a, map_x,
                            base);
  }
}

// WN: tokens per consumer warpgroup (WG_N; 64 with WARP_PRODUCER and one consumer: the 64-token N tile)
template <typename T, int CONSUMERS, bool WARP_PRODUCER, int WN = WG_N>
void dispatch_c(int c, const CUtensorMap& map_a, const CUtensorMap& map_x, const BsrArgs& args, int grid_rows,
                int stages, cudaStream_t stream) {
  if (c == 64) return launch<T, 64, CONSUMERS, WARP_PRODUCER, WN>(map_a, map_x, args, grid_rows, stages, stream);
  if (c == 32) return launch<T, 32, CONSUMERS, WARP_PRODUCER, WN>(map_a, map_x, args, grid_rows, stages, stream);
  return launch<T, 16, CONSUMERS, WARP_PRODUCER, WN>(map_a, map_x, args, grid_rows, stages, stream);
}


// ---- 16- and 32-row blocks: the roles swapped -----------------------------------------------------------------------
//
// wgmma's A operand has 64 rows, so a 16- or 32-row block cannot be it. This kernel computes the transposed product of
// the same CTA tile, Y^T tile (BN tokens x R) += X slab^T (BN x C) * block^T (C x R): the X slab that TMA writes
// (BN rows of C halves, K-major) is the A operand, 64 tokens per wgmma, and the block (R rows of C halves, K-major)
// is the B operand, wgmma's N = R (m64n32k16 / m64n16k16). Schedule, split rows and the mbarrier protocol are
// bsr_wgmma_kernel's; a consumer warpgroup owns WG_M = 128 tokens (two m64 wgmmas per k-step, R fp32 accumulators per
// thread). Unlike that kernel, a CTA may take several output tiles (plan_launch) and the stage count is the launcher's.
// The X slab is every stored block's traffic either way (1/R bytes per flop from L2); TMA and wgmma replace mma.sync's
// cp.async + ldmatrix path for it.
//
// XR (X slabs): x is not the activations but their copy by bsr_x_slabs_kernel, in which every block column's C x npad
// slab is contiguous and already in the byte order TMA's swizzle gives the box in shared memory, so that one bulk copy
// of BN * C * 2 contiguous bytes replaces the box load of BN rows of 2 * C bytes (32 bytes for C = 16: TMA's requests
// per row, not bytes, bound that box load).
constexpr int WG_M = 128;  // tokens per consumer warpgroup: two m64 tiles
constexpr int T_SMEM_BUDGET = 110 * 1024;  // per CTA: two CTAs fit an SM (228 KB)

template <int RB, int C, int CONSUMERS>
struct WgtConfig {
  static constexpr int BN = WG_M * CONSUMERS;  // tokens (columns of Y) per CTA
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  static constexpr int X_BYTES = BN * C * 2;                   // A operand: a multiple of 1024
  static constexpr int BLOCK_TX = RB * C * 2;                  // bytes TMA writes for the block
  static constexpr int BLOCK_BYTES = (BLOCK_TX + 1023) / 1024 * 1024;  // its slot, kept swizzle-aligned
  static constexpr int STAGE_BYTES = X_BYTES + BLOCK_BYTES;
  static constexpr int STAGES_FIT = T_SMEM_BUDGET / STAGE_BYTES;
  static constexpr int STAGES = STAGES_FIT > 12 ? 12 : (STAGES_FIT < 2 ? 2 : STAGES_FIT);
  // Y^T's staging tile (args.staged == 1): BN token rows of RB outputs, OUT_LD apart (+8 halves: the pair writes of
  // a warp's 8 tokens x 4 lanes land in 32 distinct banks); in the stages, or after the barriers where own_tile
  static constexpr int OUT_LD = RB + 8;
  static constexpr int EPI_BYTES = BN * OUT_LD * 2;
  static constexpr int smem_bytes(int stages, bool own_tile) {
    return 1024 + stages * STAGE_BYTES + 2 * STAGES * 8 + (own_tile ? EPI_BYTES : 0);
  }
  static constexpr int SMEM_BYTES = smem_bytes(STAGES, false);
  // stages of CTAs of several tiles (a staging tile of their own): two such CTAs still fit an SM (228 KB, 1 KB each)
  static constexpr int MULTI_FIT = (114 * 1024 - 1024 - 2 * STAGES * 8 - EPI_BYTES) / STAGE_BYTES;
  static constexpr int MULTI_STAGES = MULTI_FIT > STAGES ? STAGES : (MULTI_FIT < 2 ? 2 : MULTI_FIT);
  static constexpr int NACC = RB / 2;  // fp32 accumulators per thread of one m64nRBk16 tile
  static_assert(X_BYTES % 1024 == 0 && STAGE_BYTES % 1024 == 0, "stages must keep 1024-byte alignment");
  static_assert(smem_bytes(STAGES, true) <= 227 * 1024, "shared memory");
};


// (at most 80 registers either way: two CTAs of two consumers, or three of one, fit an SM's registers)
template <typename T, int RB, int C, int CONSUMERS, bool XR>
__global__ void __launch_bounds__(WgtConfig<RB, C, CONSUMERS>::THREADS, CONSUMERS == 1 ? 3 : 2)
    bsr_wgmma_t_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_x,
                       const BsrTArgs args) {
#ifdef PK_SM90A
  using Cfg = WgtConfig<RB, C, CONSUMERS>;
  constexpr int BN = Cfg::BN, NACC = Cfg::NACC;
  const int stages = args.stages;  // the launcher's choice, at most Cfg::STAGES (WgtConfig::smem_bytes)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * Cfg::STAGE_BYTES);
  uint64_t* empty = full + Cfg::STAGES;

  // programmatic dependent launch (args.pdl): anything below may be the preceding kernel's output (the pattern, X, a
  // schedule or indices the op's wrappers converted just before), so wait before reading or writing anything
  prunekit_launch::wait_preceding_grid();
  // output tiles u = (N tile u / n_items, work item u % n_items), so that CTAs launched together share an X tile; this
  // CTA's are blockIdx.x, + gridDim.x, ... The stage uses g count on across them: the producer loads the next tile's
  // blocks while the consumers finish a tile.
  const int ntiles = (args.n + BN - 1) / BN;
  const int units = args.n_items * ntiles;
  const int wg = threadIdx.x >> 7;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 4 * CONSUMERS);  // lane 0 of every consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer warpgroup: one thread issues every TMA load
    if (threadIdx.x == 0) {
      int g = 0;
      StageRing ring;
      for (int u = blockIdx.x; u < units; u += gridDim.x) {
        const int tile = u / args.n_items;
        const BsrWork work = bsr_work_at(args, u - tile * args.n_items);
        const int n0 = tile * BN;
        for (int b = work.start; b < work.end; ++b, ++g, ring.next(stages)) {
          const int s = ring.stage;
          if (g >= stages) mbar_wait(&empty[s], ring.phase ^ 1);  // the (g / stages - 1)-th release
          unsigned char* dst = smem + s * Cfg::STAGE_BYTES;
          mbar_expect_tx(&full[s], Cfg::X_BYTES + Cfg::BLOCK_TX);
          if constexpr (XR) {
            const T* slab = static_cast<const T*>(args.x) + (__ldg(args.cols + b) * args.xr_npad + n0) * C;
            bulk_load(dst, slab, Cfg::X_BYTES, &full[s]);
          } else {
            tma_load_2d(dst, &map_x, __ldg(args.cols + b) * C, n0, &full[s]);
          }
          tma_load_2d(dst + Cfg::X_BYTES, &map_a, 0, b * RB, &full[s]);
        }
      }
    }
    return;
  }

  T* y = static_cast<T*>(args.y);
  const T* bias = static_cast<const T*>(args.bias);
  // Y^T's staging tile: the pipeline's memory (one output tile per CTA), else a tile of its own after the barriers
  T* const out_tile = reinterpret_cast<T*>(args.own_tile ? reinterpret_cast<unsigned char*>(empty + Cfg::STAGES) : smem);
  StageRing ring;
  int prev = 0;  // the stage used last (released when the next one's wgmmas are in flight, or at the tile's end)
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const int tile = u / args.n_items;
    const BsrWork work = bsr_work_at(args, u - tile * args.n_items);
    const int count = work.end - work.start, slot = work.slot;
    const long long m0 = static_cast<long long>(work.block_row) * RB;
    const int n0 = tile * BN;
    // the next kernel may start once every CTA has reached its last tile's epilogue; its wait still covers the writes
    const bool last = u + static_cast<int>(gridDim.x) >= units;
    if (count == 0 && slot < 0 && args.staged == 1) {  // an empty block row: act(bias), straight to Y^T
      if (last) prunekit_launch::allow_dependent_launch();
      fill_empty_tile<T, RB, BN>(args, m0, n0, threadIdx.x - 128, 128 * CONSUMERS);
      continue;
    }
    const int cw = opaque(wg - 1);  // consumer index: tokens cw * WG_M ... of the CTA tile
    const int warp = opaque((threadIdx.x >> 5) & 3), lane = opaque(threadIdx.x & 31);
    float acc[2][NACC];
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int i = 0; i < NACC; ++i) acc[t][i] = 0.f;
    for (int it = 0; it < count; ++it, ring.next(stages)) {
      const int s = ring.stage;
      mbar_wait(&full[s], ring.phase);
      const uint32_t x_addr = smem_u32(smem + s * Cfg::STAGE_BYTES) + cw * WG_M * C * 2;
      const uint32_t b_addr = smem_u32(smem + s * Cfg::STAGE_BYTES + Cfg::X_BYTES);
      fence_regs(acc[0]);
      fence_regs(acc[1]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < C / 16; ++kk) {
#pragma unroll
        for (int t = 0; t < 2; ++t)
          WgmmaN<T, RB>::run(acc[t], make_desc<C>(x_addr + t * 64 * C * 2 + kk * 32), make_desc<C>(b_addr + kk * 32));
      }
      wgmma_commit();
      fence_regs(acc[0]);
      fence_regs(acc[1]);
      wgmma_wait<1>();  // the previous stage's wgmmas are done: release it to the producer
      if (it > 0 && lane == 0) mbar_arrive(&empty[prev]);
      prev = s;
    }
    wgmma_wait<0>();
    fence_regs(acc[0]);
    fence_regs(acc[1]);
    if (count > 0 && lane == 0) mbar_arrive(&empty[prev]);  // the tile's last stage
    if (last) prunekit_launch::allow_dependent_launch();

    // acc[t][i] is Y(m0 + acc_col(lane, i), n0 + cw * WG_M + 64 t + acc_row(warp, lane, i)): D's rows are tokens
    const int tok0 = n0 + cw * WG_M;
    if (slot >= 0) {  // a slice of a split block row: fp32 partial sums (n_split, RB, N), finished by bsr_finalize_kernel
      float* ws = args.ws + static_cast<long long>(slot) * RB * args.n;
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < NACC; ++i) {
          const int nn = tok0 + 64 * t + acc_row(warp, lane, i);
          if (nn < args.n) atomicAdd(ws + static_cast<long long>(acc_col(lane, i)) * args.n + nn, acc[t][i]);
        }
      continue;
    }
    float bias_v[NACC];  // read per tile: kept out of the main loop's registers
#pragma unroll
    for (int i = 0; i < NACC; ++i) bias_v[i] = bias != nullptr ? to_f(bias[m0 + acc_col(lane, i)]) : 0.f;
    if (args.staged == 1) {
      // Y^T rows (sym == 1, syn % 8 == 0, 16-byte aligned) through shared memory: 16-byte stores that fill whole
      // 32-byte sectors (the pairs' 4-byte stores filled half of one each, doubling the L2 traffic of Y: Nsight
      // Compute, 3072 x 768 @ 4096, 32-row blocks at 95%, benchmarks/results/ncu-bsr-h100-2026-11-27-s34c.txt)
      consumer_sync(128 * CONSUMERS);  // the stages are read (one tile per CTA), or the previous tile is stored
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < NACC; i += 2) {
          float v0 = acc[t][i] + bias_v[i], v1 = acc[t][i + 1] + bias_v[i + 1];
          if (args.relu) {
            v0 = fmaxf(v0, 0.f);
            v1 = fmaxf(v1, 0.f);
          }
          T pair[2] = {from_f<T>(v0), from_f<T>(v1)};
          const int tl = cw * WG_M + 64 * t + acc_row(warp, lane, i);
          *reinterpret_cast<uint32_t*>(out_tile + tl * Cfg::OUT_LD + acc_col(lane, i)) =
              *reinterpret_cast<const uint32_t*>(pair);
        }
      consumer_sync(128 * CONSUMERS);
      constexpr int PER_ROW = RB / 8;
      for (int idx = threadIdx.x - 128; idx < BN * PER_ROW; idx += 128 * CONSUMERS) {
        const int nl = idx / PER_ROW, ml = (idx % PER_ROW) * 8;
        if (n0 + nl < args.n)
          *reinterpret_cast<int4*>(y + static_cast<long long>(n0 + nl) * args.syn + m0 + ml) =
              *reinterpret_cast<const int4*>(out_tile + nl * Cfg::OUT_LD + ml);
      }
      continue;
    }
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int i = 0; i < NACC; i += 2) {  // registers i, i + 1: columns m, m + 1 of one token
        const int nn = tok0 + 64 * t + acc_row(warp, lane, i);
        if (nn >= args.n) continue;
        float v0 = acc[t][i] + bias_v[i], v1 = acc[t][i + 1] + bias_v[i + 1];
        if (args.relu) {
          v0 = fmaxf(v0, 0.f);
          v1 = fmaxf(v1, 0.f);
        }
        const long long mm = m0 + acc_col(lane, i);
        y[mm * args.sym + static_cast<long long>(nn) * args.syn] = from_f<T>(v0);
        y[(mm + 1) * args.sym + static_cast<long long>(nn) * args.syn] = from_f<T>(v1);
      }
  }
#endif  // PK_SM90A
}

template <typename T, int RB, int C, int CONSUMERS, bool XR>
void launch_t(const CUtensorMap& map_a, const CUtensorMap& map_x, const BsrArgs& base, int grid_rows,
              int tiles_per_cta, int stages, cudaStream_t stream) {
  using Cfg = WgtConfig<RB, C, CONSUMERS>;
  auto kernel = bsr_wgmma_t_kernel<T, RB, C, CONSUMERS, XR>;
  constexpr int MAX_DEVICES = 64;
  static std::once_flag once[MAX_DEVICES];
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  PRUNEKIT_CHECK(device >= 0 && device < MAX_DEVICES, "bsr_mm wgmma: device index ", device, " out of range");
  std::call_once(once[device], [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Cfg::smem_bytes(Cfg::STAGES, true)));
  });
  BsrTArgs args{};
  static_cast<BsrArgs&>(args) = base;
  const auto smem_of = [](int n_stages, bool own) { return Cfg::smem_bytes(n_stages, own); };
  const auto resident = [&](int smem) { return wave_ctas(kernel, Cfg::THREADS, smem); };
  // a staging tile only for the Y^T epilogue; MULTI_STAGES where CTAs of several tiles keep one of their own
  const int epi = args.staged == 1 ? Cfg::EPI_BYTES : 0;
  const WgLaunch plan = plan_launch(args, tiles_per_cta, grid_rows, Cfg::BN, Cfg::STAGES,
                                    epi > 0 ? Cfg::MULTI_STAGES : Cfg::STAGES, stages, epi, Cfg::STAGE_BYTES, resident,
                                    smem_of);
  prunekit_launch::launch(kernel, dim3(plan.ctas), dim3(Cfg::THREADS), plan.smem, stream, args.pdl != 0, map_a, map_x,
                          args);
}

// Blocks of r in {16, 32} rows and c in {16, 32, 64} columns.
template <typename T, int CONSUMERS, bool XR>
void dispatch_rc_t(int r, int c, const CUtensorMap& map_a, const CUtensorMap& map_x, const BsrArgs& args,
                   int grid_rows, int tiles_per_cta, int stages, cudaStream_t stream) {
  if (r == 32) {
    if (c == 64) return launch_t<T, 32, 64, CONSUMERS, XR>(map_a, map_x, args, grid_rows, tiles_per_cta, stages,
                                                           stream);
    if (c == 32) return launch_t<T, 32, 32, CONSUMERS, XR>(map_a, map_x, args, grid_rows, tiles_per_cta, stages,
                                                           stream);
    return launch_t<T, 32, 16, CONSUMERS, XR>(map_a, map_x, args, grid_rows, tiles_per_cta, stages, stream);
  }
  if (c == 64) return launch_t<T, 16, 64, CONSUMERS, XR>(map_a, map_x, args, grid_rows, tiles_per_cta, stages, stream);
  if (c == 32) return launch_t<T, 16, 32, CONSUMERS, XR>(map_a, map_x, args, grid_rows, tiles_per_cta, stages, stream);
  return launch_t<T, 16, 16, CONSUMERS, XR>(map_a, map_x, args, grid_rows, tiles_per_cta, stages, stream);
}

// The X slabs of the XR kernels: x (N tokens of K, at x[n * ldx + k], 16-byte aligned, ldx % 8 == 0) into xr of
// (K / C) * npad * C elements, where block column j's slab starts at j * npad * C and token n's C elements at n * C in
// it, its 16-byte chunk h stored at chunk h ^ ((n * C / 64) & (C / 8 - 1)): where TMA's 2C-byte swizzle puts it in a
// 1024-byte aligned box (PTX ISA, tensor copy swizzling; the CPU emulation in test_structured_tiling.py checks the
// two agree). Tokens n >= N are zero. One thread per 16-byte chunk of xr, so the writes are contiguous.
template <int C>
__global__ void bsr_x_slabs_kernel(const uint4* __restrict__ x, long long ldx16, int n, long long npad, int kc,
                                   uint4* __restrict__ xr) {
  constexpr int H = C / 8;  // 16-byte chunks per token and block column
  const long long total = static_cast<long long>(kc) * npad * H;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int h = static_cast<int>(i % H);
    const long long rest = i / H;
    const long long t = rest % npad;
    const long long j = rest / npad;
    const int hs = h ^ static_cast<int>((t * C / 64) & (H - 1));  // the chunk of token t that lands at chunk h
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (t < n) v = __ldg(x + t * ldx16 + j * H + hs);
    xr[i] = v;
  }
}

}  // namespace wgmma_bsr
}  // namespace prunekit_structured
