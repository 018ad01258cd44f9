// 2:4 matmul for decode shapes (N <= 16): Y (M, N) = act(A @ X + bias), A 2:4-sparse, streamed from a repacked copy.
//
// At N <= 16 the weights' bytes set the time. A 2:4 weight needs 2 bytes per kept value plus 4 bits per group of 4
// (1.125 bytes per weight against dense's 2: at most 1.78x at the same bandwidth). cuSPARSELt's sparse tensor-core
// kernels are built for large N and ran at 0.42-0.89x of dense cuBLAS at N <= 16 on the H100
// (benchmarks/results/nm-h100-2026-11-25.json), so this kernel streams the compressed weight itself; the arithmetic
// is free at this N, the instructions that feed it are not.
//
// Format (kernels/nm24.py builds it once per weight): strips of 16 rows (the mma's m = 16 operand), k-steps of 16
// columns. Lane (g = lane / 4, t = lane % 4) owns 2:4 group t (columns 4t .. 4t + 3) of rows g and g + 8 in each
// k-step: one 32-bit word per group holding its two kept values, lower in-group index first. Values are stored per
// (strip, k-pair, lane) as one uint4 (k-step 2p row g, row g + 8, k-step 2p + 1 row g, row g + 8: 512 coalesced
// bytes per warp). That uint4 is exactly the A operand of the sparse mma.sp.m16n8k32 for the k-pair (m16n8k16's A
// layout over the 16 kept values: registers = rows g / g + 8 of hardware groups t and t + 4).
//
// Three inner products (template V):
// - SP (default, $PRUNEKIT_NM24_MMA=sp): the sparse tensor cores. The plan stores mma.sp's metadata: per (strip,
//   k-pair) 16 words, word g * 2 + t (t < 2) = the 4-bit index nibbles (i0 | i1 << 2) of groups 4t .. 4t + 3, row g in
//   bits 0-15 and row g + 8 in bits 16-31 (sparsity selector 0: threads 0 and 1 of each quad). That reading of the
//   PTX ISA's figure ("halves") was checked on the H100 against the other candidate ("rows", wrong: 407x the
//   tolerance) by scripts/nm24_sp_layout.py (benchmarks/results/nm24-sp-layout-h100-2026-11-25.log). X is staged as
//   m16n8k32's B fragments: lane (g, t) register i = X[token g][8i + 2t, 8i + 2t + 1]. Per k-pair and token tile:
//   one 16-byte X load and one mma.sp.
// - prmt ($PRUNEKIT_NM24_MMA=prmt): the dense tensor cores. Within a k-step the columns are permuted so that mma
//   fragment k-positions {2t, 2t + 1, 2t + 8, 2t + 9} of lane (g, t) hold columns 4t .. 4t + 3 (one group), the
//   nibbles are stored per (strip, k-quad, lane) as one uint32 (byte s = k-step s, low nibble row g), a nibble indexes
//   a 16-entry table of byte_perm selectors and prmt(word, 0, sel) places value 0 / value 1 / zero in each half of
//   the m16n8k16 A registers. About 20 instructions per k-step against SP's 3: 4-11% slower on the H100
//   (benchmarks/results/nm24-sweep-h100-2026-11-25-{sp,prmt}.json).
//
// - Bitmap (variant 2, prunekit::spmm_csr's "bitmap"; kernels/spmm_bitmap_plan.py): an unstructured weight as, per
//   16 x 16 tile, a mask of which of each lane's four m16n8k16 A registers (pairs of adjacent columns, in the prmt
//   path's column order) hold a non-zero, a count word, and the present pairs' words back to back. Per tile a lane
//   reads its mask nibble and its first word's position (a count byte plus the popcount of the lower nibbles) and
//   loads its present pairs from the ring slot; absent registers are zero. The batch's words are copied from a
//   16-byte boundary (the plan's batch offsets), so a slot holds the densest batch (its size is the plan's, not fixed).
//   Same X staging, mma.sync and k-chunk reductions as prmt. "Load sparse, compute dense" as in Flash-LLM (Xia et al.,
//   VLDB 2024) and SpInfer (Fan et al., EuroSys 2025); the layout is prunekit's own.
//   N > 16 (bitmap only; fourteenth session): a block multiplies its tiles by 32 tokens (N 17-32, NT = 4) or 64 (NT =
//   8, grid z over groups of 64 tokens, each decoding the weight again). X is staged batch by batch in 16-byte items
//   (the first two batches before the loop, each later one with the weights two batches ahead, then a block barrier
//   per batch: up to 7% faster than staging the whole chunk first), the next k-step's X fragments are loaded while the
//   current one is multiplied, and the cluster epilogue keeps token-major
//   partial sums where Y's rows are adjacent, read and written row-fastest. With the atomics reduction the call gets
//   its own zeroed workspace (the plan's holds 16 tokens per row). On the H100 at 4096 x 4096, 90%: 20.0 / 33.5 / 54.7
//   us at N = 32 / 64 / 128 against dense cuBLAS's 14.5-15.1 (benchmarks/results/spmm-widegrid-h100-2026-11-26-s14.json).
//   Blocks of 16 strips where that takes fewer waves (launch_wide; fifteenth session).
//
// Grid: (row blocks of 8 strips, k-chunks). Each warp streams its strip's chunk through a ring of R batches of B
// k-steps in shared memory (cp.async, R - 1 batches in flight while one is multiplied; each lane reads back only the
// bytes it copied; default 3 x 8, 2.25 KB per batch; 4 x 4 and 6 x 4 as options, nm24.RINGS). Its first batch is
// issued before the block stages its chunk of X (16 tokens, zero outside X) in shared memory in fragment order with
// cp.async. One chunk writes Y directly. With several on sm_90 (up to 16) the k-chunks of a row block form a
// thread-block cluster: each warp leaves its partial sums in its idle ring, and after the cluster barrier each block
// reads its share of the outputs from all blocks' shared memory (distributed shared memory), arrives at a second
// barrier, writes Y and waits there before leaving. Otherwise (sm_80, more than 16 chunks,
// $PRUNEKIT_NM24_CLUSTER=0) warps add fp32 partial sums into the plan's workspace with 8-byte reductions. On sm_90 at
// N <= 16 the blocks then leave, and a second kernel (nm24_finish_kernel, after the whole grid) adds bias, applies
// ReLU, writes Y and zeroes the workspace; else (or $PRUNEKIT_NM24_FINISH=0) the last block of a row block does that
// (counter after a fence, the threadFenceReduction pattern of the CUDA samples) and leaves the counter at zero. On
// sm_90 with the cluster reduction or the finishing kernel (default; $PRUNEKIT_NM24_PDL=0 turns it off), the launch
// allows programmatic dependent launch: the kernel issues its first weight batches, waits for the preceding kernel
// (griddepcontrol.wait) before it reads X or writes anything, and lets the next kernel launch once its loop is done.
//
// History on the H100 (docs/PERFORMANCE_STRUCTURED.md, "2:4 decode kernel"): v1 (register double buffer, X staged
// with plain loads, atomics) 18.9 us at 4096 x 4096, N = 16; the ring, cheaper staging and reductions, clusters and
// three blocks per SM 14.3 us; mma.sp 13.1 us; batch 0 before X and the split second barrier 12.7 us (dense cuBLAS
// 16.8 us; tenth session). Rejected there: deeper rings of 8-k-step batches (two blocks per SM, 4-38% slower) and
// clusters of at most 8 for more than 16 chunks (36.4 against 29.1 us with atomics at 4096 x 11008).
//
// Source: 2:4 structured sparsity (Mishra et al., "Accelerating Sparse Deep Neural Networks", 2021); streaming the
// compressed weight into mma.sp for decode follows the idea of Sparse-Marlin (Castro et al., 2024), with prunekit's
// own layout and kernel. sm_80+ (mma.sync and mma.sp with bf16; clusters on sm_90).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <type_traits>

#include "launch.cuh"  // programmatic dependent launch
#include "mma.cuh"
#include "../../check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams
#include "../../views.h"  // raw_t: the entries' views without the dispatcher

namespace prunekit_nm24 {
namespace {

namespace cg = cooperative_groups;

using prunekit::Mma;
using prunekit::MmaSp;

constexpr int kWarps = 8;             // strips per row block (= nm24.STRIPS_PER_BLOCK)
constexpr int kThreads = 32 * kWarps;
constexpr int kBatch = 8;             // k-step alignment of K and of the chunks (= nm24.KSTEP_ALIGN)
constexpr int kTokens = 16;           // tokens per block at N <= 16, and per row of a plan's k-split workspace
constexpr int kWideNt = 8;            // bitmap at N > 32: mma n-tiles (8 tokens each) per block, grid z = token groups
                                      // (at N 17-32 half of it: one block of 32 tokens)
constexpr int kWideWarps = 16;        // bitmap at N > 16: strips per block where it takes fewer waves (launch_wide)
constexpr int kMaxChunk = 64;         // k-steps per block: 32 KB of staged X (= nm24.MAX_CHUNK)
constexpr int kMaxCluster = 16;       // k-chunks per cluster (= nm24.MAX_CLUSTER; over 8 is non-portable)
// inner products (template V, the plan's variant): register expansion of 2:4 groups + mma.sync, mma.sp, and the
// unstructured bitmap tiles (kernels/spmm_bitmap_plan.py) + mma.sync
constexpr int kPrmt = 0, kSp = 1, kBitmap = 2;
constexpr int kHeaderWords = 5;       // bitmap: per tile 4 mask words + 1 count word (= spmm_bitmap_plan.HEADER_WORDS)
// The weight ring (templates R, B; nm24.RINGS): R batches of B k-steps per warp in shared memory, R - 1 in flight
// while one is multiplied. A batch is B * 16 uint4 of values (B * 256 bytes) and B * 8 metadata words per warp.
// 3 x 8 and 6 x 4: 54 KB per block (three blocks per SM with 16 KB of X); 4 x 4: 36 KB (four blocks per SM).
__host__ __device__ constexpr int ring_bytes(int r, int b) { return kWarps * r * b * (16 * 16 + 8 * 4); }

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(prunekit::smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(prunekit::smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(prunekit::smem_u32(dst)), "l"(src));
}
// ws[0] += a, ws[1] += b (8-byte aligned): one vector reduction on sm_90, two scalar ones before
__device__ __forceinline__ void red_add2(float* ws, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(ws), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(ws, a);
  atomicAdd(ws + 1, b);
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Programmatic dependent launch (sm_90; launch.cuh): wait until the preceding kernel in the stream has finished and its
// writes are visible; let the next kernel launch while this one finishes. No-ops in a launch without the attribute.
using prunekit_launch::allow_dependent_launch;
using prunekit_launch::wait_preceding_grid;
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

struct Params {
  const uint4* vals;       // (strips, ksteps / 2, 32)
  const uint32_t* meta;    // (strips, ksteps / 4, 32)
  const void* x;           // (K, N), element strides x_sk, x_sn
  int64_t x_sk, x_sn;
  void* y;                 // (M, N), element strides y_sm, y_sn
  int64_t y_sm, y_sn;
  const void* bias;        // (M,) or null
  float* ws;               // (strips * 16, 16) fp32, zero between calls
  int* counters;           // (row blocks,), zero between calls
  int m, k, n, strips, ksteps, chunk, chunks, relu, x_vec;
  int cluster;  // 1: the grid's k-chunks are clusters, reduced through distributed shared memory (sm_90)
  int probe;  // diagnostics only ($PRUNEKIT_NM24_PROBE, wrong results): 1 no epilogue, 2 no math, 4 no weight loads,
              // 8 no X staging (bitmap at N > 16), 16 X staged with per-item addresses (the fourteenth session's loop)
  int pdl;    // launched with programmatic stream serialization (sm_90, cluster reduction; $PRUNEKIT_NM24_PDL=0: off)
  int finish;  // k-chunks added through global atomics, finished by nm24_finish_kernel (sm_90; no fence or counter)
  int ws_ld;  // floats per row of ws: kTokens (the plan's), or N rounded up to even (a per-call one at N > 16)
  // bitmap (V = kBitmap): vals are the present pair words, meta the tile headers (strips, ksteps, 5), boff the batch
  // offsets (strips, ksteps / 8 + 1); a ring slot is slot_bytes (headers, then words), a warp's ring wstride bytes
  const int* boff;
  int slot_bytes, wstride;
};

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// X[col], X[col + 1] of one token as a packed pair (element loads; zero past K)
template <typename T>
__device__ __forceinline__ uint32_t x_pair(const T* src, int col, int k, int64_t sk) {
  const T e0 = col < k ? src[0] : from_float<T>(0.f);
  const T e1 = col + 1 < k ? src[sk] : from_float<T>(0.f);
  const uint32_t lo = *reinterpret_cast<const uint16_t*>(&e0);
  const uint32_t hi = *reinterpret_cast<const uint16_t*>(&e1);
  return lo | (hi << 16);
}

// byte_perm selector (two 16-bit halves: columns 0-1, columns 2-3 of a group) for in-group indices i0 | i1 << 2: a
// column equal to i0 takes bytes 0-1 of the value word, one equal to i1 bytes 2-3, any other the zero word's 4-5.
__device__ __forceinline__ uint32_t selector(uint32_t nib) {
  const uint32_t i0 = nib & 3u, i1 = nib >> 2;
  uint32_t sel = 0;
#pragma unroll
  for (uint32_t c = 0; c < 4; ++c) {
    const uint32_t pair = c == i0 ? 0x10u : (c == i1 ? 0x32u : 0x54u);
    sel |= pair << (8 * c);
  }
  return sel;
}

// prmt.b32 d, v, 0, sel: PTX reads only sel[15:0] (four 3-bit selectors, sign bits clear in our table), so the
// masking __byte_perm adds is not needed
__device__ __forceinline__ uint32_t prmt0(uint32_t v, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, 0, %2;\n" : "=r"(d) : "r"(v), "r"(sel));
  return d;
}

// token tiles of 8 per k-step in the staged X: at least 2 (the 2:4 paths' layout at N <= 8 too)
__host__ __device__ constexpr int x_tiles(int nt) { return nt > 2 ? nt : 2; }

template <int NT>
__device__ __forceinline__ int stage_slot(int ks, int nt, int lane) {
  // fragment-order X: [k-step][token tile][lane], lanes XOR-swizzled by k-step (2-way store conflicts, reads free)
  return (ks * x_tiles(NT) + nt) * 32 + (lane ^ ((ks & 7) << 2));
}

template <typename T, int NT, int V, int R, int B, int W>
__global__ void __launch_bounds__(32 * W) nm24_decode_kernel(const Params p) {
  constexpr int kThr = 32 * W;  // W warps (strips) per block: kWarps, or kWideWarps for the bitmap at N > 16 (launch_wide)
  static_assert(W == kWarps || V == kBitmap, "the 2:4 rings (ring_bytes) and plan counters are per 8 strips");
  constexpr bool SP = V == kSp, BM = V == kBitmap;
  constexpr int kBatchVals = B * 16;  // uint4 per batch and warp
  constexpr int kBatchMeta = B * 8;   // uint32 per batch and warp
  constexpr int kMetaLane = B / 4;    // metadata words each lane copies per batch
  // dynamic shared memory: the weight ring (W x R batches: vals, then meta), then X in fragment order
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ uint32_t lut[16];
  __shared__ int last_flag;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint4* ring_v = reinterpret_cast<uint4*>(smem) + warp * R * kBatchVals;
  uint32_t* ring_m = reinterpret_cast<uint32_t*>(smem + W * R * kBatchVals * 16) + warp * R * kBatchMeta;
  uint2* xs = reinterpret_cast<uint2*>(smem + (BM ? W * p.wstride : ring_bytes(R, B)));
  unsigned char* wring = smem + warp * p.wstride;  // bitmap: this warp's ring of R slots
  const int strip = blockIdx.x * W + warp;
  const int ks0 = blockIdx.y * p.chunk;
  const int nks = min(p.chunk, p.ksteps - ks0);  // a multiple of kBatch, so of B
  const int batches = nks / B;
  const bool active = strip < p.strips;
  // this block's tokens: tok0 .. tok0 + NT * 8 - 1 (grid z: groups of NT * 8 tokens, bitmap at N > 16), nloc of them
  const int tok0 = blockIdx.z * NT * 8;
  const int nloc = min(NT * 8, p.n - tok0);
  const int kpairs = p.ksteps / 2, kquads = p.ksteps / 4;
  const uint4* vrow = p.vals + (static_cast<int64_t>(strip) * kpairs + ks0 / 2) * 32 + lane;
  // meta: 32 words per (strip, k-quad) (prmt), or 16 words per (strip, k32) (SP: lanes t < 2 of each quad)
  const uint32_t* mrow = SP ? p.meta + (static_cast<int64_t>(strip) * kpairs + ks0 / 2) * 16 + kMetaLane * lane
                            : p.meta + (static_cast<int64_t>(strip) * kquads + ks0 / 4) * 32 + lane;
  if (tid < 16) lut[tid] = selector(tid);
  // bitmap: lane i holds the word offset of this warp's batch i (i <= batches; read with a shuffle)
  int boff_lane = 0;
  if (BM && active && lane <= batches) {
    boff_lane = p.boff[static_cast<int64_t>(strip) * (p.ksteps / kBatch + 1) + ks0 / kBatch + lane];
  }

  // weight batch bb of this warp into ring slot bb % R (one commit group per batch, empty past the end)
  auto issue = [&](int bb) {
    if (BM) {
      // headers of the batch's B tiles (B * 20 bytes, 16-byte aligned), then its words from 16-byte boundaries
      const int v0 = __shfl_sync(0xffffffffu, boff_lane, bb & 31) & ~3;
      const int v1 = (__shfl_sync(0xffffffffu, boff_lane, (bb + 1) & 31) + 3) & ~3;
      if (active && bb < batches && !(p.probe & 4)) {
        unsigned char* slot = wring + (bb % R) * p.slot_bytes;
        const uint32_t* hsrc = p.meta + (static_cast<int64_t>(strip) * p.ksteps + ks0 + bb * B) * kHeaderWords;
        if (lane < B * kHeaderWords / 4) cp_async16(slot + lane * 16, hsrc + lane * 4);
        const uint32_t* wsrc = reinterpret_cast<const uint32_t*>(p.vals) + v0;
        uint32_t* wdst = reinterpret_cast<uint32_t*>(slot + B * kHeaderWords * 4);
        for (int i = lane * 4; i < v1 - v0; i += 128) cp_async16(wdst + i, wsrc + i);
      }
      cp_async_commit();
      return;
    }
    if (active && bb < batches && !(p.probe & 4)) {
      uint4* vdst = ring_v + (bb % R) * kBatchVals + lane;
      const uint4* vsrc = vrow + bb * kBatchVals;
#pragma unroll
      for (int i = 0; i < B / 2; ++i) cp_async16(vdst + i * 32, vsrc + i * 32);
      if (SP) {  // B / 2 k32 x 16 words, contiguous: B bytes per lane
        uint32_t* mdst = ring_m + (bb % R) * kBatchMeta + kMetaLane * lane;
        if (kMetaLane == 2) {
          cp_async8(mdst, mrow + bb * kBatchMeta);
        } else {
          cp_async4(mdst, mrow + bb * kBatchMeta);
        }
      } else {
        uint32_t* mdst = ring_m + (bb % R) * kBatchMeta + lane;
        const uint32_t* msrc = mrow + bb * kBatchMeta;
#pragma unroll
        for (int i = 0; i < kMetaLane; ++i) cp_async4(mdst + i * 32, msrc + i * 32);
      }
    }
    cp_async_commit();
  };
  // commit groups: batch 0 (DRAM) before X is staged (L2), then batches 1 .. R - 2. With programmatic dependent launch
  // the kernel may start while the preceding one (which may write X) still runs: all R - 1 batches go out (the plan is
  // never written by another kernel), then it waits for that kernel, and only then reads X and writes anything.
  issue(0);
  if (p.pdl) {
#pragma unroll
    for (int bb = 1; bb < R - 1; ++bb) issue(bb);
    wait_preceding_grid();
  }

  // X[k0 + c][token] for c < nks * 16, tokens < 16, zero outside X: cp.async where a whole 8-byte item is in X
  const T* x = static_cast<const T*>(p.x) + static_cast<int64_t>(tok0) * p.x_sn;
  const int groups = nks * 4;
  const int kcol0 = ks0 * 16;
  const bool vec = p.x_vec;
  if (SP) {
    // B of m16n8k32 (PTX layout): lane (g, t) register i holds X[token g][k32 * 32 + 8i + 2t + {0, 1}]; staged as
    // one 16-byte item per (k32, token tile, lane), 4-byte pieces
    uint32_t* xw = reinterpret_cast<uint32_t*>(xs);
    for (int pair = tid; pair < nks * 8; pair += kThr) {
      const int col = kcol0 + pair * 2;
      const int k32 = pair >> 4, q = pair & 15;
      const T* src = x + static_cast<int64_t>(col) * p.x_sk;
      const bool full = vec && col + 1 < p.k;
#pragma unroll
      for (int tok = 0; tok < NT * 8; ++tok) {
        uint32_t* dst = xw + ((k32 * 2 + (tok >> 3)) * 32 + (tok & 7) * 4 + (q & 3)) * 4 + (q >> 2);
        const T* s_tok = src + static_cast<int64_t>(tok) * p.x_sn;
        if (tok < nloc && full) {
          cp_async4(dst, s_tok);
          continue;
        }
        *dst = tok < nloc ? x_pair(s_tok, col, p.k, p.x_sk) : 0u;
      }
    }
  }
  // N > 16 (NT > 2): X staged batch by batch, the first R - 1 batches here, each later one in the weight batch's commit
  // group R - 1 batches ahead (the loop waits for it and syncs the block before reading it). 16-byte items, 8 columns
  // of one token = the fragment slots of groups t and t + 1 (t even: adjacent under the swizzle), consecutive threads
  // along K (coalesced), zero past X.
  constexpr bool kWideX = NT > 2;
  const bool vec16 = vec && p.x_sn % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  // A thread's items are the same in every batch: item i is q = tid % kXq (k-step q / 2 of the batch, 8 columns at
  // (q % 2) * 8) of token tid / kXq + i * kXTokStep. With B = 8 the swizzle ((ks & 7) << 2) is (q / 2) << 2 in every
  // batch, so batch bb's slots are batch 0's plus bb * B k-steps, and its source batch 0's plus bb * B * 16 columns:
  // the addresses are computed once (in the loop they took about 60 instructions per item).
  constexpr int kXq = B * 2, kXTokStep = kThr / kXq, kXItems = NT * 8 / kXTokStep;
  static_assert(!kWideX || (B == 8 && kThr % kXq == 0 && (NT * 8) % kXTokStep == 0 && kXTokStep % 8 == 0),
                "wide X staging: 8-k-step batches, whole items per thread");
  const int xq = tid % kXq, xtok = tid / kXq;
  const T* xsrc = x + static_cast<int64_t>(kcol0 + (xq >> 1) * 16 + (xq & 1) * 8) * p.x_sk +
                  static_cast<int64_t>(xtok) * p.x_sn;
  uint2* xdst = xs + stage_slot<NT>(xq >> 1, xtok >> 3, (xtok & 7) * 4 + (xq & 1) * 2);
  auto stage_x = [&](int bb) {  // X of batch bb (k-steps bb * B ..) of this chunk
    if (p.probe & 8) return;
    if (vec16 && !(p.probe & 16) && kcol0 + (bb + 1) * B * 16 <= p.k) {  // the whole batch inside X along K
      const T* src = xsrc + static_cast<int64_t>(bb) * (B * 16) * p.x_sk;
      uint2* dst = xdst + bb * B * x_tiles(NT) * 32;
#pragma unroll
      for (int i = 0; i < kXItems; ++i) {
        uint2* d = dst + i * (kXTokStep / 8) * 32;
        if (xtok + i * kXTokStep < nloc) {
          cp_async16(d, src + static_cast<int64_t>(i) * kXTokStep * p.x_sn);
        } else {
          *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
      return;
    }
    for (int it = tid; it < B * 2 * NT * 8; it += kThr) {
      const int q = it % (B * 2), tok = it / (B * 2);
      const int ks = bb * B + (q >> 1), t = (q & 1) * 2, col = kcol0 + ks * 16 + t * 4;
      uint2* dst = xs + stage_slot<NT>(ks, tok >> 3, (tok & 7) * 4 + t);
      const T* s_tok = x + static_cast<int64_t>(col) * p.x_sk + static_cast<int64_t>(tok) * p.x_sn;
      if (tok < nloc && vec16 && col + 7 < p.k) {
        cp_async16(dst, s_tok);
      } else if (tok < nloc) {
        dst[0] = make_uint2(x_pair(s_tok, col, p.k, p.x_sk), x_pair(s_tok + 2 * p.x_sk, col + 2, p.k, p.x_sk));
        dst[1] = make_uint2(x_pair(s_tok + 4 * p.x_sk, col + 4, p.k, p.x_sk),
                            x_pair(s_tok + 6 * p.x_sk, col + 6, p.k, p.x_sk));
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };
  if constexpr (kWideX) {
    for (int bb = 0; bb < R - 1 && bb < batches; ++bb) stage_x(bb);
  }
  for (int cg = tid; !SP && !kWideX && cg < groups; cg += kThr) {
    const int col = kcol0 + cg * 4;
    const int ks = cg >> 2, t = cg & 3;
    const T* src = x + static_cast<int64_t>(col) * p.x_sk;
    const bool full = vec && col + 3 < p.k;
#pragma unroll
    for (int tok = 0; tok < NT * 8; ++tok) {
      uint2* dst = xs + stage_slot<NT>(ks, tok >> 3, (tok & 7) * 4 + t);
      const T* s_tok = src + static_cast<int64_t>(tok) * p.x_sn;
      if (tok < nloc && full) {
        cp_async8(dst, s_tok);
        continue;
      }
      *dst = tok < nloc ? make_uint2(x_pair(s_tok, col, p.k, p.x_sk), x_pair(s_tok + 2 * p.x_sk, col + 2, p.k, p.x_sk))
                       : make_uint2(0u, 0u);
    }
  }
  cp_async_commit();
  if (p.pdl) {
    cp_async_wait<0>();  // batches 0 .. R - 2 and X have landed (each lane's own copies)
  } else {
#pragma unroll
    for (int bb = 1; bb < R - 1; ++bb) issue(bb);
    cp_async_wait<R - 2>();  // batch 0 and X have landed (each lane's own copies); batches 1 .. R - 2 may be in flight
  }
  __syncthreads();

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;

  // bitmap at N > 16: X fragments of the current k-step (the loop loads the next one's ahead). Every warp runs the
  // loop there (the block stages X and syncs per batch); inactive ones only copy and sync.
  uint2 bx[NT > 2 ? NT : 1];
  if (kWideX || (active && !(p.probe & 2))) {
    for (int b = 0; b < batches; ++b) {
      if (SP || BM) __syncwarp();  // the lanes are done reading the ring slot the next issue refills (shared data)
      if constexpr (kWideX) {
        if (b + R - 1 < batches) stage_x(b + R - 1);  // committed with the weights by issue()
      }
      issue(b + R - 1);
      cp_async_wait<R - 1>();  // batch b has landed: each lane's own copies (vals; prmt's meta; X at N > 16)
      if constexpr (kWideX) {
        __syncthreads();  // every thread's X copies of batch b
        if (!active || (p.probe & 2)) continue;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) bx[nt] = xs[stage_slot<NT>(b * B, nt, lane)];
      }
      if (SP || BM) __syncwarp();  // a lane reads words other lanes copied
      if (BM) {
        // lane (g, t): nibble of its four pair registers in mask word lane / 8, its first word after the pairs of
        // the lanes before it (count byte lane / 8 plus the lower nibbles' popcount); pairs absent are zero
        const unsigned char* slot = wring + (b % R) * p.slot_bytes;
        const uint32_t* hb = reinterpret_cast<const uint32_t*>(slot);
        const uint32_t* wb = reinterpret_cast<const uint32_t*>(slot + B * kHeaderWords * 4);
        const int w = lane >> 3, sh = 4 * (lane & 7), psh = 8 * w;
        const uint32_t lower = (1u << sh) - 1u, pmask = w ? 0xffu : 0u;
        int base = __shfl_sync(0xffffffffu, boff_lane, b) & 3;  // the batch's first word within the slot
        // Tile by tile; with the loop unrolled the compiler overlaps the tiles' loads itself (on the H100, loading
        // all headers, then all words per half batch, measured the same, and loading every word unpredicated and
        // masking it 5-10% slower: benchmarks/results/spmm-bitmap-{old,base,masked}-h100-2026-11-25-s11.json).
#pragma unroll
        for (int s = 0; s < B; ++s) {
          const int ks = b * B + s;
          // NT > 2: the next k-step's X fragments are loaded while this one's are multiplied (the batch's last
          // k-step loads its own again: the next batch's X may not have landed), so each fragment has its own
          // registers: loaded just before its mma, the compiler reused one register pair for all eight, and each
          // load waited for the previous mma (8 latencies per tile)
          uint2 bxn[NT > 2 ? NT : 1];
          if constexpr (NT > 2) {
            const int kn = min(ks + 1, b * B + B - 1);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) bxn[nt] = xs[stage_slot<NT>(kn, nt, lane)];
          }
          const uint32_t mw = hb[s * kHeaderWords + w];
          const uint32_t cw = hb[s * kHeaderWords + 4];
          const uint32_t nib = (mw >> sh) & 15u;
          int off = base + static_cast<int>(((cw >> psh) & pmask) + __popc(mw & lower));
          uint4 a;
          a.x = (nib & 1u) ? wb[off] : 0u;
          off += nib & 1u;
          a.y = (nib & 2u) ? wb[off] : 0u;
          off += (nib >> 1) & 1u;
          a.z = (nib & 4u) ? wb[off] : 0u;
          off += (nib >> 2) & 1u;
          a.w = (nib & 8u) ? wb[off] : 0u;
          base += static_cast<int>(cw & 0xffu);
          if constexpr (NT > 2) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              Mma<T>::run(acc[nt], a, bx[nt].x, bx[nt].y);
              bx[nt] = bxn[nt];
            }
          } else {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              const uint2 bx = xs[stage_slot<NT>(ks, nt, lane)];
              Mma<T>::run(acc[nt], a, bx.x, bx.y);
            }
          }
        }
        continue;
      }
      const uint4* vb = ring_v + (b % R) * kBatchVals + lane;
      const uint32_t* mb = ring_m + (b % R) * kBatchMeta + lane;
      uint4 v[B / 2];
      uint32_t mq[kMetaLane];
#pragma unroll
      for (int i = 0; i < B / 2; ++i) v[i] = vb[i * 32];
      if (SP) {
        const uint32_t* me = ring_m + (b % R) * kBatchMeta + (lane >> 2) * 2 + (lane & 1);
        const uint4* xq = reinterpret_cast<const uint4*>(xs);
#pragma unroll
        for (int j = 0; j < B / 2; ++j) {
          const uint32_t e = me[j * 16];  // lanes t >= 2 read a neighbour's word: selector 0 ignores them
          const int k32 = b * (B / 2) + j;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) MmaSp<T>::run(acc[nt], v[j], xq[(k32 * 2 + nt) * 32 + lane], e);
        }
        continue;
      }
#pragma unroll
      for (int i = 0; i < kMetaLane; ++i) mq[i] = mb[i * 32];
#pragma unroll
      for (int s = 0; s < B; ++s) {
        const uint4& vp = v[s >> 1];
        const uint32_t wg = (s & 1) ? vp.z : vp.x;
        const uint32_t wg8 = (s & 1) ? vp.w : vp.y;
        const uint32_t m8 = (mq[s >> 2] >> ((s & 3) * 8)) & 0xffu;
        const uint32_t sg = lut[m8 & 15u], sg8 = lut[m8 >> 4];
        uint4 a;
        a.x = prmt0(wg, sg);
        a.z = prmt0(wg, sg >> 16);
        a.y = prmt0(wg8, sg8);
        a.w = prmt0(wg8, sg8 >> 16);
        const int ks = b * B + s;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint2 bx = xs[stage_slot<NT>(ks, nt, lane)];
          Mma<T>::run(acc[nt], a, bx.x, bx.y);
        }
      }
    }
  }
  cp_async_wait<0>();
  // the next kernel (the finishing one, or the next layer's) may start during this epilogue
  if (p.pdl || p.finish) allow_dependent_launch();

  if (p.probe & 1) return;
  const int g = lane >> 2, t = lane & 3;
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y) + static_cast<int64_t>(tok0) * p.y_sn;
  // Wide blocks (NT > 2: bitmap at N > 16) read their outputs back row-fastest where Y's rows are adjacent (y_sm == 1:
  // the transposed output of nn.Linear-shaped calls), so a warp writes 32 consecutive outputs of one token instead of
  // 32 tokens M elements apart. Their warps' partial sums are then token-major (16 rows + 1 pad per token), so that
  // those reads are contiguous too (row-major reads 260 bytes apart cost one distributed-shared-memory transaction per
  // lane: 43 of 69 us at 4096 x 4096, N = 64 on the H100); else row-major, 64 tokens + 1 pad per row.
  constexpr bool kWide = NT > 2;
  constexpr int kTok = kWide ? NT * 8 : kTokens;   // tokens per block
  constexpr int kPartLd = kWide ? kTok + 1 : kTok;  // floats per row of a warp's row-major partial sums
  constexpr int kPartTd = 17;                       // floats per token of a warp's token-major partial sums
  const bool row_fast = kWide && p.y_sm == 1;
  // where partial sum (row r of the warp's 16, token c) lives in the warp's buffer
  auto part_at = [&](int r, int c) { return row_fast ? c * kPartTd + r : r * kPartLd + c; };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster) {
    // The k-chunks of this row block are one thread-block cluster: each warp leaves its 16 x kTok partial sums in its
    // own (now idle) ring, and after the cluster barrier block rank r adds up its share of the 128 x kTok outputs from
    // every block's shared memory (distributed shared memory), with no global atomics, fences or counters.
    float* part = reinterpret_cast<float*>(BM ? wring : reinterpret_cast<unsigned char*>(ring_v));
    __syncwarp();  // other lanes' ring reads are done before this warp overwrites the ring
    if (active) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[part_at(g + (i >> 1) * 8, nt * 8 + 2 * t + (i & 1))] = acc[nt][i];
    }
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    // each thread's outputs (at most kMaxOuts for 2+ chunks): the sums are read from every block first, then this
    // block tells the cluster it is done reading (arrive) and writes Y while the others finish; it leaves only after
    // every block has arrived (wait), so no shared memory is read after its block left
    constexpr int kOuts = W * 16 * kTok;
    constexpr int kMaxOuts = kOuts / (2 * kThr);
    const int rank = static_cast<int>(cluster.block_rank());
    const int stride = kThr * p.chunks;
    const int warp_floats = BM ? p.wstride / 4 : R * kBatchVals * 4;  // one warp's ring, in floats
    float sums[kMaxOuts];
#pragma unroll
    for (int o = 0; o < kMaxOuts; ++o) {
      const int e = rank * kThr + tid + o * stride;
      const int row_local = row_fast ? e % (W * 16) : e / kTok;
      const int tok = row_fast ? e / (W * 16) : e % kTok;
      sums[o] = 0.f;
      if (e < kOuts && tok < nloc) {
        float* local = reinterpret_cast<float*>(smem) + (row_local >> 4) * warp_floats + part_at(row_local & 15, tok);
        float parts[kMaxCluster];
#pragma unroll
        for (int r = 0; r < kMaxCluster; ++r) parts[r] = r < p.chunks ? *cluster.map_shared_rank(local, r) : 0.f;
#pragma unroll
        for (int r = 0; r < kMaxCluster; ++r) sums[o] += parts[r];
      }
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#pragma unroll
    for (int o = 0; o < kMaxOuts; ++o) {
      const int e = rank * kThr + tid + o * stride;
      const int row = blockIdx.x * W * 16 + (row_fast ? e % (W * 16) : e / kTok);
      const int tok = row_fast ? e / (W * 16) : e % kTok;
      if (e < kOuts && row < p.m && tok < nloc) {
        float val = sums[o] + (bias ? to_float(bias[row]) : 0.f);
        if (p.relu) val = fmaxf(val, 0.f);
        y[static_cast<int64_t>(row) * p.y_sm + static_cast<int64_t>(tok) * p.y_sn] = from_float<T>(val);
      }
    }
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    return;
  }
#endif
  if (p.chunks == 1) {
    if (!active) return;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = strip * 16 + g + (i >> 1) * 8, tok = nt * 8 + 2 * t + (i & 1);
        if (row < p.m && tok < nloc) {
          float val = acc[nt][i] + (bias ? to_float(bias[row]) : 0.f);
          if (p.relu) val = fmaxf(val, 0.f);
          y[static_cast<int64_t>(row) * p.y_sm + static_cast<int64_t>(tok) * p.y_sn] = from_float<T>(val);
        }
      }
    return;
  }
  // k-chunks added in the workspace (tokens tok0 ..: ws_ld is even, so tok0 + tok is 8-byte aligned); the last block
  // of this row block and token group finishes
  float* ws = p.ws + tok0;
  int* counter = p.counters + static_cast<int64_t>(blockIdx.z) * gridDim.x + blockIdx.x;
  if (active) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // tokens 2t, 2t + 1 of one row are adjacent in ws: one 8-byte reduction
        const int row = strip * 16 + g + h * 8, tok = nt * 8 + 2 * t;
        if (row < p.m && tok < nloc) {
          red_add2(ws + static_cast<int64_t>(row) * p.ws_ld + tok, acc[nt][2 * h], acc[nt][2 * h + 1]);
        }
      }
  }
  // nm24_finish_kernel adds bias and writes Y once this grid has ended: the block leaves with its reductions in flight
  if (p.finish) return;
  __threadfence();
  __syncthreads();
  if (tid == 0) last_flag = atomicAdd(counter, 1) == p.chunks - 1;
  __syncthreads();
  if (!last_flag) return;
  __threadfence();
  const int row0 = blockIdx.x * W * 16;
  for (int idx = tid; idx < W * 16 * kTok; idx += kThr) {
    const int row = row0 + idx / kTok, tok = idx % kTok;
    if (row < p.m && tok < nloc) {
      float* cell = ws + static_cast<int64_t>(row) * p.ws_ld + tok;
      float val = __ldcg(cell) + (bias ? to_float(bias[row]) : 0.f);
      *cell = 0.f;
      if (p.relu) val = fmaxf(val, 0.f);
      y[static_cast<int64_t>(row) * p.y_sm + static_cast<int64_t>(tok) * p.y_sn] = from_float<T>(val);
    }
  }
  if (tid == 0) *counter = 0;
}

// The last step of the k-chunk sums where a second kernel takes it (Params::finish; sm_90): Y = act(ws + bias), and ws
// back to zero for the next call. It is launched with programmatic dependent launch and waits for the decode grid
// (griddepcontrol.wait: that grid has ended and its reductions are visible), so the decode blocks need no fence, no
// counter and no last-block pass, and leave right after issuing their reductions. Y is written row-fastest where its
// rows are adjacent (y_sm == 1, nn.Linear's transposed output).
template <typename T>
__global__ void __launch_bounds__(256) nm24_finish_kernel(Params p) {
  wait_preceding_grid();
  allow_dependent_launch();
  const bool row_fast = p.y_sm == 1;
  const int64_t total = static_cast<int64_t>(p.m) * p.n;
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = row_fast ? e % p.m : e / p.n, tok = row_fast ? e / p.m : e % p.n;
    float* cell = p.ws + row * p.ws_ld + tok;
    float val = __ldcg(cell) + (bias ? to_float(bias[row]) : 0.f);
    __stcg(cell, 0.f);
    if (p.relu) val = fmaxf(val, 0.f);
    y[row * p.y_sm + tok * p.y_sn] = from_float<T>(val);
  }
}

template <typename T>
void launch_finish(const Params& p, cudaStream_t stream) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const int64_t total = static_cast<int64_t>(p.m) * p.n;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 4 * prunekit_launch::device_props(device).sms);
  prunekit_launch::launch(nm24_finish_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, true, p);
}

// Lean decode kernel (eighteenth session; mma.sp plans at N <= 16 where lean_takes, below). The ring kernel
// gives 8 strips (128 rows) to a block and splits K into chunks of up to 64 k-steps, so a small weight makes a small
// grid: 3072 x 768 is 24 row blocks x 3 chunks = 72 blocks of 8 warps on 132 SMs, 0.88-0.90x of dense cuBLAS at N = 16
// on the H100 (benchmarks/results/nm24-sweep-base-h100-2026-11-26-s17.json), where the 2:4 SpMV kernel, whose warps
// each take a few rows, reaches 1.71x at N = 1. Here a block holds SB strips (16 rows each) and KW warps per strip,
// which split the strip's k32 steps into KW contiguous ranges (the warps of the SB strips with the same range read the
// same X, so L1 serves all but the first). A warp keeps no ring and no staged X: it loads kLeanBatch k32 steps of
// weights (one uint4 of values and one metadata word per lane, the plan's mma.sp layout) and of X (m16n8k32's B
// fragments, read from X in global memory as 4-byte pairs) into registers, issues the next batch's loads before it
// multiplies the current one, and runs one mma.sp per k32 step and token tile. The KW partial sums of a strip meet in
// shared memory; the block adds them, adds bias, applies ReLU and writes Y (row-fastest where Y's rows are adjacent).
// No workspace, counters, clusters or second kernel. With programmatic dependent launch (sm_90; $PRUNEKIT_NM24_PDL=0:
// off) the first weight batch is loaded before the kernel waits for the preceding one.
constexpr int kLeanBatch = 4;  // k32 steps whose loads go out together

// The lean kernels' epilogue: the warps' 16 x (NT * 8) sums (acc: m16n8 D fragments, register i of tile nt = row g + (i
// / 2) * 8, token nt * 8 + 2t + i % 2) of strip `strip`; KW warps per strip (K ranges) and SB strips per block (warp =
// strip in block * KW + K range). KW == 1: written directly; else added up in `part` (every thread of the block must
// call this: it synchronises) and written row-fastest where Y's rows are adjacent. Bias, then ReLU.
template <typename T, int NT, int KW, int SB>
__device__ __forceinline__ void lean_epilogue(const Params& p, const float (&acc)[NT][4],
                                              float (&part)[KW > 1 ? SB * KW : 1][16][kTokens + 1], int strip) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  if constexpr (KW == 1) {  // one warp per strip: its sums are final
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = strip * 16 + g + (i >> 1) * 8, tok = nt * 8 + 2 * t + (i & 1);
        if (row < p.m && tok < p.n) {
          float val = acc[nt][i] + (bias ? to_float(bias[row]) : 0.f);
          if (p.relu) val = fmaxf(val, 0.f);
          y[static_cast<int64_t>(row) * p.y_sm + static_cast<int64_t>(tok) * p.y_sn] = from_float<T>(val);
        }
      }
    return;
  } else {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) part[warp][g + (i >> 1) * 8][nt * 8 + 2 * t + (i & 1)] = acc[nt][i];
    __syncthreads();
    constexpr int kTok = NT * 8, kRows = SB * 16;
    const bool row_fast = p.y_sm == 1;
    for (int o = tid; o < kRows * kTok; o += 32 * KW * SB) {
      const int r = row_fast ? o % kRows : o / kTok, tok = row_fast ? o / kRows : o % kTok;
      const int row = blockIdx.x * kRows + r;
      if (row < p.m && tok < p.n) {
        float val = bias ? to_float(bias[row]) : 0.f;
#pragma unroll
        for (int w = 0; w < KW; ++w) val += part[(r >> 4) * KW + w][r & 15][tok];
        if (p.relu) val = fmaxf(val, 0.f);
        y[static_cast<int64_t>(row) * p.y_sm + static_cast<int64_t>(tok) * p.y_sn] = from_float<T>(val);
      }
    }
  }
}

template <typename T, int NT, int KW, int SB>
__global__ void __launch_bounds__(32 * KW * SB) nm24_lean_kernel(const Params p) {
  __shared__ float part[KW > 1 ? SB * KW : 1][16][kTokens + 1];  // each warp's 16 x (NT * 8) partial sums (KW > 1)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int strip = blockIdx.x * SB + warp / KW, kpart = warp % KW;
  const int kpairs = p.ksteps / 2;  // k32 steps of a strip
  const int per = (kpairs + KW - 1) / KW;
  const int kp0 = min(kpart * per, kpairs);
  const int kp1 = strip < p.strips ? min(kp0 + per, kpairs) : kp0;  // a strip past M: no loads, zero sums
  const uint4* vsrc = p.vals + static_cast<int64_t>(strip) * kpairs * 32 + lane;
  // lanes t >= 2 read their neighbour's word (selector 0 ignores it), as the ring kernel does
  const uint32_t* msrc = p.meta + static_cast<int64_t>(strip) * kpairs * 16 + g * 2 + (t & 1);
  const T* x = static_cast<const T*>(p.x);

  uint4 a[kLeanBatch], an[kLeanBatch];
  uint32_t e[kLeanBatch], en[kLeanBatch];
  uint4 b[kLeanBatch][NT], bn[kLeanBatch][NT];
  auto load_w = [&](int kp, uint4 (&av)[kLeanBatch], uint32_t (&ev)[kLeanBatch]) {
#pragma unroll
    for (int u = 0; u < kLeanBatch; ++u) {
      const int q = kp + u;
      av[u] = q < kp1 ? __ldg(vsrc + static_cast<int64_t>(q) * 32) : make_uint4(0u, 0u, 0u, 0u);
      ev[u] = q < kp1 ? __ldg(msrc + static_cast<int64_t>(q) * 16) : 0u;
    }
  };
  // B of m16n8k32 (PTX layout): lane (g, t) register i holds X[token nt * 8 + g][32 q + 8i + 2t + {0, 1}], zero past
  // K and N (the plan's padded columns hold zero weights, but 0 x NaN is not 0)
  auto load_x = [&](int kp, uint4 (&bv)[kLeanBatch][NT]) {
#pragma unroll
    for (int u = 0; u < kLeanBatch; ++u) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int q = kp + u, tok = nt * 8 + g;
        uint32_t r[4] = {0u, 0u, 0u, 0u};
        if (q < kp1 && tok < p.n) {
          const T* row = x + static_cast<int64_t>(tok) * p.x_sn;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int col = q * 32 + 8 * i + 2 * t;
            const T* src = row + static_cast<int64_t>(col) * p.x_sk;
            // x_vec (the lean launcher's: unit stride along K, even row stride, 4-byte aligned base): one aligned word
            // a plain load, not __ldg: with programmatic dependent launch the preceding kernel may have written X
            // while this grid ran (the read-only path is for data read-only for the kernel's whole lifetime)
            r[i] = p.x_vec && col + 1 < p.k ? *reinterpret_cast<const uint32_t*>(src) : x_pair(src, col, p.k, p.x_sk);
          }
        }
        bv[u][nt] = make_uint4(r[0], r[1], r[2], r[3]);
      }
    }
  };

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;

  load_w(kp0, a, e);
  wait_preceding_grid();  // programmatic dependent launch: the preceding kernel (which may write X or read Y) is done
  load_x(kp0, b);
  for (int kp = kp0; kp < kp1; kp += kLeanBatch) {
    const bool more = kp + kLeanBatch < kp1;  // warp-uniform
    if (more) {
      load_w(kp + kLeanBatch, an, en);
      load_x(kp + kLeanBatch, bn);
    }
#pragma unroll
    for (int u = 0; u < kLeanBatch; ++u) {
      if (kp + u < kp1) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) MmaSp<T>::run(acc[nt], a[u], b[u][nt], e[u]);
      }
    }
    if (more) {
#pragma unroll
      for (int u = 0; u < kLeanBatch; ++u) {
        a[u] = an[u];
        e[u] = en[u];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) b[u][nt] = bn[u][nt];
      }
    }
  }
  if (p.pdl) allow_dependent_launch();  // the next kernel may start during this epilogue
  lean_epilogue<T, NT, KW, SB>(p, acc, part, strip);
}

// Lean bitmap decode kernel (eighteenth session; bitmap plans at N <= 16 where lean_takes, below, the same rule): the lean 2:4 kernel's structure on the bitmap format (kernels/spmm_bitmap_plan.py). A block is one strip;
// its KW warps split the strip's batches of 8 k-steps into contiguous ranges. Per batch a warp loads the 8 tiles'
// headers (40 words: lane l word l, lanes 0-7 also word 32 + l) and the batch's first word index (boff), two batches
// ahead. Per tile each lane then takes its mask word and the tile's count word by shuffles and finds its words as
// spmm_bitmap_plan documents (the batch's first word, plus the earlier tiles' totals, plus the prefix count of its
// lane group, plus the popcount of the lower lanes' nibbles), loads its present pairs from global memory (absent ones
// are zero), and loads X as m16n8k16 B fragments in the permuted column order (lane (g, t): X[token g][4t .. 4t + 3],
// one 8-byte load where X allows). Two-deep pipeline: while a batch is multiplied, the next one's pairs and X are in
// flight and the one after's headers are loading, so a warp with two batches waits about two dependent round trips
// (headers, then words), not three. SB is 1.
template <typename T, int NT, int KW>
__global__ void __launch_bounds__(32 * KW) nm24_lean_bitmap_kernel(const Params p) {
  __shared__ float part[KW > 1 ? KW : 1][16][kTokens + 1];  // each warp's partial sums (KW > 1)
  constexpr int kHdr = kBatch * kHeaderWords;                // 40 header words per batch
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3, grp = lane >> 3, sh = 4 * (lane & 7);
  const int strip = blockIdx.x;
  const int nb = p.ksteps / kBatch;  // batches of a strip
  const int per = (nb + KW - 1) / KW;
  const int b0 = min(warp * per, nb), b1 = min(b0 + per, nb);
  const uint32_t* hdr = p.meta + static_cast<int64_t>(strip) * p.ksteps * kHeaderWords;
  const int* boff = p.boff + static_cast<int64_t>(strip) * (nb + 1);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(p.vals);
  const T* x = static_cast<const T*>(p.x);
  const uint32_t lower = (1u << sh) - 1u;  // the nibbles of the lanes before this one in its mask word

  // batch b's headers and first word index (zeros at and past the warp's end)
  auto load_hdr = [&](int b, uint32_t& h0, uint32_t& h1, int& first) {
    const bool on = b < b1;
    const uint32_t* hb = hdr + static_cast<int64_t>(b) * kHdr;
    h0 = on ? __ldg(hb + lane) : 0u;
    h1 = on && lane < kHdr - 32 ? __ldg(hb + 32 + lane) : 0u;
    first = on ? __ldg(boff + b) : 0;
  };

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;

  // batch b's present pairs (A registers) and X (B registers) from its headers: the pairs first (warp-uniform: every
  // lane takes part in the shuffles), then X; zeros for a batch at or past the warp's end (its headers are zero)
  auto load_batch = [&](int b, uint32_t h0, uint32_t h1, int first, uint4 (&a)[kBatch], uint2 (&bx)[kBatch][NT]) {
    int tile_first = first;
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      const int ci = s * kHeaderWords + 4;  // the tile's count word (a constant: s is unrolled)
      const uint32_t cw = __shfl_sync(0xffffffffu, ci < 32 ? h0 : h1, ci & 31);
      const int mi = s * kHeaderWords + grp;  // this lane's mask word
      const uint32_t m0 = __shfl_sync(0xffffffffu, h0, mi & 31), m1 = __shfl_sync(0xffffffffu, h1, mi & 31);
      const uint32_t mw = mi < 32 ? m0 : m1;
      const uint32_t nib = (mw >> sh) & 15u;
      int off = tile_first + static_cast<int>((grp ? (cw >> (8 * grp)) & 0xffu : 0u) + __popc(mw & lower));
      a[s].x = (nib & 1u) ? __ldg(words + off) : 0u;
      off += nib & 1u;
      a[s].y = (nib & 2u) ? __ldg(words + off) : 0u;
      off += (nib >> 1) & 1u;
      a[s].z = (nib & 4u) ? __ldg(words + off) : 0u;
      off += (nib >> 2) & 1u;
      a[s].w = (nib & 8u) ? __ldg(words + off) : 0u;
      tile_first += static_cast<int>(cw & 0xffu);
    }
    const bool on = b < b1;  // warp-uniform
#pragma unroll
    for (int s = 0; s < kBatch; ++s) {
      const int col = (b * kBatch + s) * 16 + 4 * t;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int tok = nt * 8 + g;
        uint2 v = make_uint2(0u, 0u);
        if (on && tok < p.n) {
          const T* src = x + static_cast<int64_t>(tok) * p.x_sn + static_cast<int64_t>(col) * p.x_sk;
          // x_vec (8-byte aligned base, unit stride along K, row stride a multiple of 4): one aligned 8-byte load; a
          // plain load, not __ldg (with programmatic dependent launch the preceding kernel may have written X)
          v = p.x_vec && col + 3 < p.k ? *reinterpret_cast<const uint2*>(src)
                                       : make_uint2(x_pair(src, col, p.k, p.x_sk),
                                                    x_pair(src + 2 * p.x_sk, col + 2, p.k, p.x_sk));
        }
        bx[s][nt] = v;
      }
    }
  };

  // Two-deep pipeline: while batch b is multiplied, batch b + 1's pairs and X are in flight (issued from its headers,
  // loaded one iteration earlier) and batch b + 2's headers are loading.
  uint32_t h0 = 0u, h1 = 0u, n0 = 0u, n1 = 0u;
  int first = 0, nfirst = 0;
  load_hdr(b0, h0, h1, first);
  load_hdr(b0 + 1, n0, n1, nfirst);
  uint4 a[kBatch], an[kBatch];
  uint2 bx[kBatch][NT], bxn[kBatch][NT];
  wait_preceding_grid();  // programmatic dependent launch: the preceding kernel (which may write X or read Y) is done
  load_batch(b0, h0, h1, first, a, bx);
  for (int b = b0; b < b1; ++b) {
    const bool more = b + 1 < b1;  // warp-uniform
    if (more) {
      uint32_t f0 = 0u, f1 = 0u;
      int ffirst = 0;
      load_hdr(b + 2, f0, f1, ffirst);  // zeros past the warp's end
      load_batch(b + 1, n0, n1, nfirst, an, bxn);
      n0 = f0;
      n1 = f1;
      nfirst = ffirst;
    }
#pragma unroll
    for (int s = 0; s < kBatch; ++s)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) Mma<T>::run(acc[nt], a[s], bx[s][nt].x, bx[s][nt].y);
    if (more) {
#pragma unroll
      for (int s = 0; s < kBatch; ++s) {
        a[s] = an[s];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) bx[s][nt] = bxn[s][nt];
      }
    }
  }
  if (p.pdl) allow_dependent_launch();  // the next kernel may start during this epilogue
  lean_epilogue<T, NT, KW, 1>(p, acc, part, strip);
}

// Whether the lean kernels take a call at N <= 16. $PRUNEKIT_NM24_LEAN (read per call): "1" every such call of an mma.sp
// or bitmap plan, "0" none; unset, "" or "auto": the measured rule, K <= kLeanMaxK. On the H100 (nineteenth session,
// benchmarks/results/nm24-sweep-lean{,6}-h100-2026-11-26-s19.json and spmm-bitmap6-lean{0,1-6,1-8}-...-s19.json, the
// ring kernel in the same run), at 3072 x 768 (K = 768), with lean_shape's warps:
// - 2:4 at N = 2 / 8 / 16: 2.24 / 2.38 / 3.56 us against 4.06 / 4.21 / 4.91 (1.83 / 1.75 / 1.24x of dense);
// - bitmap at N = 2 / 8 / 16, 80 and 90%: 2.86-3.89 us against 5.10-5.81.
// At K >= 3072 (768 x 3072, 4096 x 4096, 11008 x 4096, 4096 x 11008) the lean 2:4 kernel is within 2% of the ring one
// at N = 2 / 8 with 8 warps (but 0.91x at 4096 x 4096, N = 2) and 1.3-1.7x slower at N = 16; the bitmap one up to 2x
// slower. One shape in the rule's range: in-sample.
constexpr int64_t kLeanMaxK = 1024;

inline bool lean_takes(int64_t k, int64_t n) {
  const char* var = std::getenv("PRUNEKIT_NM24_LEAN");
  if (var != nullptr && std::strcmp(var, "1") == 0) return n <= kTokens;
  if (var != nullptr && std::strcmp(var, "0") == 0) return false;
  PRUNEKIT_CHECK(var == nullptr || *var == '\0' || std::strcmp(var, "auto") == 0,
                 "nm24: $PRUNEKIT_NM24_LEAN must be 0, 1 or auto, got '", var, "'");
  return k <= kLeanMaxK && n <= kTokens;
}

// The lean kernel's shape: KW warps per strip and SB strips per block. $PRUNEKIT_NM24_LEAN_WARPS = "KW" or "KWxSB"
// (KW 1, 2, 4, 6 or 8; SB 1 or 2, SB = 2 with KW <= 4: a block stays within 256 threads at ~150 registers) forces it;
// unset, "" or "auto": the rule measured on the H100 (the files above):
// - K <= kLeanMaxK: 6 warps (at K = 768 one batch of 4 k32 steps each, and at N > 8 two 192-thread blocks fit an SM
//   where one 256-thread block does), except 2:4 at N <= 2: 8. 3072 x 768, 2:4 at N = 8 / 16: 2.38 / 3.56 us against
//   3.14 / 3.70 with 4 x 2 and 2.77 / 4.58 with 8; at N = 2 2.24 with 8, 2.29 with 6. Bitmap at N = 2 / 8 / 16:
//   2.86-3.89 us against 3.21-5.98 with 8;
// - otherwise at N <= 8: 8 warps, one strip (4096 x 4096, 2:4, N = 2: 8.82 against 12.10 us with 4);
// - at N > 8 and K > kLeanMaxK (taken only when $PRUNEKIT_NM24_LEAN=1 forces it): SB = 1 and the fewest KW of 1, 2, 4, 8
//   that give the grid at least 4 warps per SM while each warp keeps at least min_per_warp of the strip's units (2:4:
//   2 k32 steps; bitmap: 1 batch of 8 k-steps). Unmeasured beyond the five shapes of the sweep.
// Without strips_per_block (the bitmap kernel) a forced SB other than 1 raises.
struct LeanShape {
  int kw, sb;
};

inline LeanShape lean_shape(int strips, int units, int min_per_warp, int sms, int64_t k, int n,
                            bool strips_per_block = true) {
  const char* var = std::getenv("PRUNEKIT_NM24_LEAN_WARPS");
  if (var != nullptr && *var != '\0' && std::strcmp(var, "auto") != 0) {  // "" and "auto": the rule below
    char* end = nullptr;
    const long kw = std::strtol(var, &end, 10);
    long sb = 1;
    bool ok = end != var;
    if (ok && *end == 'x') {
      const char* sb_text = end + 1;
      sb = std::strtol(sb_text, &end, 10);
      ok = end != sb_text;
    }
    ok = ok && *end == '\0' && (kw == 1 || kw == 2 || kw == 4 || kw == 6 || kw == 8) &&
         (sb == 1 || (sb == 2 && kw <= 4));
    PRUNEKIT_CHECK(ok, "nm24: $PRUNEKIT_NM24_LEAN_WARPS must be auto, KW or KWxSB with KW 1, 2, 4, 6 or 8 and SB 1 or 2 ",
                   "(SB 2 with KW <= 4), got '", var, "'");
    PRUNEKIT_CHECK(sb == 1 || strips_per_block, "nm24: the lean bitmap kernel takes one strip per block: ",
                   "$PRUNEKIT_NM24_LEAN_WARPS must be KW (or KWx1), got '", var, "'");
    return {static_cast<int>(kw), static_cast<int>(sb)};
  }
  if (k <= kLeanMaxK) return {strips_per_block && n <= 2 ? 8 : 6, 1};
  if (n <= 8) return {8, 1};
  int kw = 1;
  while (kw < 8 && static_cast<int64_t>(strips) * kw < 4LL * sms && units >= 2 * kw * min_per_warp) kw *= 2;
  return {kw, 1};
}

template <typename T, int NT, int KW, int SB>
void launch_lean_as(const Params& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.strips + SB - 1) / SB));
  prunekit_launch::launch(nm24_lean_kernel<T, NT, KW, SB>, grid, dim3(32 * KW * SB), 0, stream, p.pdl != 0, p);
}

template <typename T, int NT>
void launch_lean_bitmap(const Params& p, cudaStream_t stream, int kw) {
  const dim3 grid(static_cast<unsigned>(p.strips));
  const bool pdl = p.pdl != 0;
  kw == 1   ? prunekit_launch::launch(nm24_lean_bitmap_kernel<T, NT, 1>, grid, dim3(32), 0, stream, pdl, p)
  : kw == 2 ? prunekit_launch::launch(nm24_lean_bitmap_kernel<T, NT, 2>, grid, dim3(64), 0, stream, pdl, p)
  : kw == 4 ? prunekit_launch::launch(nm24_lean_bitmap_kernel<T, NT, 4>, grid, dim3(128), 0, stream, pdl, p)
  : kw == 6 ? prunekit_launch::launch(nm24_lean_bitmap_kernel<T, NT, 6>, grid, dim3(192), 0, stream, pdl, p)
            : prunekit_launch::launch(nm24_lean_bitmap_kernel<T, NT, 8>, grid, dim3(256), 0, stream, pdl, p);
}

template <typename T, int NT>
void launch_lean(const Params& p, cudaStream_t stream, LeanShape shape) {
  if (shape.sb == 2) {
    shape.kw == 1   ? launch_lean_as<T, NT, 1, 2>(p, stream)
    : shape.kw == 2 ? launch_lean_as<T, NT, 2, 2>(p, stream)
                    : launch_lean_as<T, NT, 4, 2>(p, stream);
    return;
  }
  shape.kw == 1   ? launch_lean_as<T, NT, 1, 1>(p, stream)
  : shape.kw == 2 ? launch_lean_as<T, NT, 2, 1>(p, stream)
  : shape.kw == 4 ? launch_lean_as<T, NT, 4, 1>(p, stream)
  : shape.kw == 6 ? launch_lean_as<T, NT, 6, 1>(p, stream)
                  : launch_lean_as<T, NT, 8, 1>(p, stream);
}

// Dynamic shared memory of a block: the weight rings (the bitmap's sized by the weight's densest batch), then the
// chunk's X in fragment order.
template <int NT, int V, int R, int B, int W>
size_t dyn_smem(const Params& p) {
  return (V == kBitmap ? static_cast<size_t>(W) * p.wstride : ring_bytes(R, B)) +
         static_cast<size_t>(p.chunk) * x_tiles(NT) * 32 * sizeof(uint2);
}

// Blocks of an instance resident per SM with `smem` bytes of dynamic shared memory: the least of what the registers
// (65536 per SM, allocated per warp in units of 256), the shared memory (1 KB reserved per block on sm_80 / sm_90)
// and 2048 threads allow; 0 if one block does not fit. Not cudaOccupancyMaxActiveBlocksPerMultiprocessor: over 48 KB
// it may check the request against the instance's opt-in attribute, which launch() sets only when the instance first
// runs, and the 16-strip instance is asked before it ever has.
template <typename T, int NT, int V, int R, int B, int W>
int blocks_per_sm(size_t smem) {
  static std::atomic<int> regs_of[64] = {};  // registers per thread of this instance, 0: not asked yet
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int regs = regs_of[device & 63].load(std::memory_order_relaxed);
  if (regs == 0) {
    cudaFuncAttributes attrs{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attrs, nm24_decode_kernel<T, NT, V, R, B, W>));
    regs = std::max(1, attrs.numRegs);
    regs_of[device & 63].store(regs, std::memory_order_relaxed);
  }
  const auto& props = prunekit_launch::device_props(device);
  const int by_regs = 65536 / ((regs * 32 + 255) / 256 * 256 * W);
  const int by_smem = static_cast<int>(static_cast<size_t>(props.smem_per_sm) / (smem + 1024));
  return std::min({by_regs, by_smem, 2048 / (32 * W)});
}

template <typename T, int NT, int V, int R, int B, int W = kWarps>
void launch(Params p, cudaStream_t stream) {
  const int row_blocks = (p.strips + W - 1) / W;
  const int token_groups = (p.n + NT * 8 - 1) / (NT * 8);  // grid z: 1 at N <= 16
  static std::atomic<uint64_t> opted_in{0};  // above the default 48 KB: opt in once per instance and device
  static std::atomic<int> optin_of[64] = {};  // dynamic shared memory this instance may opt in to, 0: not asked yet
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int optin = optin_of[device & 63].load(std::memory_order_relaxed);
  if (optin == 0) {  // the device's limit (launch.cuh) less the kernel's static arrays
    optin = prunekit_launch::device_props(device).max_smem;
    cudaFuncAttributes attrs{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attrs, nm24_decode_kernel<T, NT, V, R, B, W>));
    optin -= static_cast<int>(attrs.sharedSizeBytes);
    optin_of[device & 63].store(optin, std::memory_order_relaxed);
  }
  // the bitmap ring's size depends on the weight (its densest batch): up to the device's limit
  const size_t max_smem = V == kBitmap ? static_cast<size_t>(optin)
                                       : ring_bytes(R, B) + static_cast<size_t>(kMaxChunk) * 2 * 32 * sizeof(uint2);
  const size_t smem = dyn_smem<NT, V, R, B, W>(p);
  PRUNEKIT_CHECK(smem <= max_smem, "nm24: the weight's densest batch needs ", smem, " bytes of shared memory per block, ",
              "over the device's ", max_smem, " (too dense for the bitmap decode kernel)");
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(opted_in.load(std::memory_order_relaxed) & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(nm24_decode_kernel<T, NT, V, R, B, W>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_smem)));
    // all of L1 as shared memory: two or three blocks of 62-122 KB per SM (the driver may otherwise size it for one)
    C10_CUDA_CHECK(cudaFuncSetAttribute(nm24_decode_kernel<T, NT, V, R, B, W>,
                                        cudaFuncAttributePreferredSharedMemoryCarveout,
                                        static_cast<int>(cudaSharedmemCarveoutMaxShared)));
    opted_in.fetch_or(bit, std::memory_order_relaxed);
  }
  if (!p.cluster && !p.pdl) {  // run() sets either only on sm_90 and newer
    nm24_decode_kernel<T, NT, V, R, B, W><<<dim3(row_blocks, p.chunks, token_groups), 32 * W, smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  static std::atomic<uint64_t> non_portable{0};  // clusters of 9-16 blocks: opt in once per instance and device
  if (p.cluster && p.chunks > 8 && !(non_portable.load(std::memory_order_relaxed) & bit)) {
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(nm24_decode_kernel<T, NT, V, R, B, W>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    non_portable.fetch_or(bit, std::memory_order_relaxed);
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(row_blocks, p.chunks, token_groups);
  cfg.blockDim = dim3(32 * W, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n_attrs = 0;
  if (p.cluster) {
    attr[n_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[n_attrs].val.clusterDim.x = 1;
    attr[n_attrs].val.clusterDim.y = p.chunks;
    attr[n_attrs].val.clusterDim.z = 1;
    ++n_attrs;
  }
  if (p.pdl) {  // may start before the preceding kernel in the stream ends (the kernel waits for it before reading X)
    attr[n_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++n_attrs;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n_attrs;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, nm24_decode_kernel<T, NT, V, R, B, W>, p));
}

// Bitmap at N > 16 (NT = 4 or 8 token tiles, the 3 x 8 ring): blocks of kWideWarps strips (256 rows) stage each
// token's X once per 256 rows instead of 128, but every warp of the block waits at the per-batch barrier for the
// slowest of 16. On the H100 (benchmarks/results/spmm-bitmap-wide-w{8,16}-h100-2026-11-26-s15.json; 4 shapes, N =
// 32-256, 70-90%), 16 strips were 0.69-0.91x as fast where both fill the SMs in the same number of waves, and 1.07-1.30x
// where 8-strip blocks need about twice as many (dense rings: one block of 8 warps per SM). So: 16 strips where the grid
// of 16-strip blocks takes fewer than 4 / 5 of the waves of 8-strip ones. $PRUNEKIT_NM24_WIDE_WARPS=8 or 16 forces one
// (16 only where a block fits).
template <typename T, int NT>
void launch_wide(const Params& p, cudaStream_t stream) {
  const char* warps_var = std::getenv("PRUNEKIT_NM24_WIDE_WARPS");  // per call, as the other switches (tests)
  const int forced = warps_var == nullptr ? 0 : std::atoi(warps_var);
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const int sms = prunekit_launch::device_props(device).sms;
  const int64_t per_row = static_cast<int64_t>(p.chunks) * ((p.n + NT * 8 - 1) / (NT * 8));  // blocks per row block
  constexpr int64_t kNoFit = int64_t{1} << 40;
  auto waves = [&](int warps, int per_sm) {
    return per_sm == 0 ? kNoFit : ((p.strips + warps - 1) / warps * per_row + sms * per_sm - 1) / (sms * per_sm);
  };
  const int64_t w8 = waves(kWarps, blocks_per_sm<T, NT, kBitmap, 3, 8, kWarps>(dyn_smem<NT, kBitmap, 3, 8, kWarps>(p)));
  const int64_t w16 = waves(kWideWarps, blocks_per_sm<T, NT, kBitmap, 3, 8, kWideWarps>(
                                            dyn_smem<NT, kBitmap, 3, 8, kWideWarps>(p)));
  const bool sixteen = w16 != kNoFit && (forced == 16 || (forced != 8 && 5 * w16 < 4 * w8));
  sixteen ? launch<T, NT, kBitmap, 3, 8, kWideWarps>(p, stream) : launch<T, NT, kBitmap, 3, 8>(p, stream);
}

// one instance per (token tiles, inner product, ring): the register expansion with the 3 x 8 ring only, the bitmap with
// 3 x 8 and 5 x 8; at N > 16 the bitmap with blocks of 8 or 16 strips
template <typename T>
void dispatch(const Params& p, cudaStream_t stream, int variant, bool two, int ring, int batch) {
  if (variant == kBitmap && p.n > 2 * kTokens) {
    launch_wide<T, kWideNt>(p, stream);  // N > 32: blocks of 64 tokens, the 3-batch ring
  } else if (variant == kBitmap && p.n > kTokens) {
    launch_wide<T, kWideNt / 2>(p, stream);  // N 17-32: one block of 32 tokens
  } else if (variant == kPrmt) {
    two ? launch<T, 2, kPrmt, 3, 8>(p, stream) : launch<T, 1, kPrmt, 3, 8>(p, stream);
  } else if (variant == kBitmap && ring == 5) {
    two ? launch<T, 2, kBitmap, 5, 8>(p, stream) : launch<T, 1, kBitmap, 5, 8>(p, stream);
  } else if (variant == kBitmap) {
    two ? launch<T, 2, kBitmap, 3, 8>(p, stream) : launch<T, 1, kBitmap, 3, 8>(p, stream);
  } else if (ring == 6 && batch == 4) {
    two ? launch<T, 2, kSp, 6, 4>(p, stream) : launch<T, 1, kSp, 6, 4>(p, stream);
  } else if (ring == 4 && batch == 4) {
    two ? launch<T, 2, kSp, 4, 4>(p, stream) : launch<T, 1, kSp, 4, 4>(p, stream);
  } else {
    two ? launch<T, 2, kSp, 3, 8>(p, stream) : launch<T, 1, kSp, 3, 8>(p, stream);
  }
}

// A plan's device pointers and sizes (kernels/nm24.py: Nm24Plan), from its four tensors (mm) or its one buffer
// (linear).
struct PlanView {
  const void* vals;  // (strips, ksteps / 2, 32, 4) int32; bitmap: the present pair words
  const void* meta;  // strips * ksteps * 8 int32; bitmap: the headers (strips, ksteps, 5)
  float* ws;         // (strips * 16, 16), zero between calls
  int* counters;     // (row blocks,), zero between calls
  int64_t strips, ksteps, m, chunk, variant, ring, batch;
  const int* boff = nullptr;  // bitmap: batch offsets (strips, ksteps / 8 + 1)
  int64_t slot_words = 0;     // bitmap: words of the densest batch (spmm_bitmap_plan.BitmapPlan.slot_words)
};

// Y (M, N) = act(A @ x + bias) into y (any strides) on a checked plan.
void run(const PlanView& v, const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& bias,
         bool relu) {
  PRUNEKIT_CHECK(v.variant >= kPrmt && v.variant <= kBitmap,
              "nm24: variant must be 0 (register expansion), 1 (mma.sp) or 2 (bitmap)");
  const bool sp = v.variant == kSp;
  PRUNEKIT_CHECK((v.ring == 3 && v.batch == 8) || (sp && v.batch == 4 && (v.ring == 4 || v.ring == 6)) ||
                  (v.variant == kBitmap && v.ring == 5 && v.batch == 8),
              "nm24: the ring must be 3 x 8, or 4 x 4 or 6 x 4 with mma.sp (batches x k-steps)");
  PRUNEKIT_CHECK(x.is_cuda() && x.dim() == 2 && y.dim() == 2, "nm24: x (K, N) and y (M, N) must be 2-D GPU tensors");
  PRUNEKIT_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "nm24: x must be fp16 or bf16");
  PRUNEKIT_CHECK(y.scalar_type() == x.scalar_type() && y.device() == x.device(), "nm24: y must have x's dtype and GPU");
  const int64_t k = x.size(0), n = x.size(1), m = v.m;
  PRUNEKIT_CHECK(n >= 1 && (n <= kTokens || v.variant == kBitmap), "nm24: N must be 1..16 (any N >= 1 with the ",
                 "bitmap variant), got ", n);
  PRUNEKIT_CHECK(n <= kTokens || (n + kWideNt * 8 - 1) / (kWideNt * 8) <= 65535, "nm24: N = ", n, " is too large");
  PRUNEKIT_CHECK(v.ksteps % kBatch == 0 && k <= v.ksteps * 16 && k > (v.ksteps - kBatch) * 16,
              "nm24: x has ", k, " rows, the plan ", v.ksteps, " k-steps");
  PRUNEKIT_CHECK(m >= 1 && m <= v.strips * 16 && m > (v.strips - 1) * 16 && y.size(0) == m && y.size(1) == n,
              "nm24: y must be (M, N) with M matching the plan");
  PRUNEKIT_CHECK(v.chunk % kBatch == 0 && v.chunk >= kBatch && v.chunk <= kMaxChunk, "nm24: bad chunk ", v.chunk);
  if (bias.has_value()) {
    PRUNEKIT_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == m &&
                    bias->device() == x.device(),
                "nm24: bias must be a contiguous (M,) tensor of x's dtype");
  }
  const int64_t row_blocks = (v.strips + kWarps - 1) / kWarps;
  const int64_t chunks = (v.ksteps + v.chunk - 1) / v.chunk;
  Params p{};
  p.vals = static_cast<const uint4*>(v.vals);
  p.meta = static_cast<const uint32_t*>(v.meta);
  p.x = x.data_ptr();
  p.x_sk = x.stride(0);
  p.x_sn = x.stride(1);
  p.y = y.data_ptr();
  p.y_sm = y.stride(0);
  p.y_sn = y.stride(1);
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.ws = v.ws;
  p.counters = v.counters;
  p.m = static_cast<int>(m);
  p.k = static_cast<int>(k);
  p.n = static_cast<int>(n);
  p.strips = static_cast<int>(v.strips);
  p.ksteps = static_cast<int>(v.ksteps);
  p.chunk = static_cast<int>(v.chunk);
  p.chunks = static_cast<int>(chunks);
  p.relu = relu ? 1 : 0;
  if (v.variant == kBitmap) {
    PRUNEKIT_CHECK(v.slot_words >= 4 && v.slot_words % 4 == 0 && v.slot_words <= (1 << 20) && v.boff != nullptr,
                "nm24: bad bitmap slot size ", v.slot_words);
    // a slot: the batch's headers, then its words; the warp's ring also holds the cluster epilogue's partial sums:
    // 16 x 16 floats (1 KB) at N <= 16, 64 x 17 above (token-major, padded; row-major needs 16 x 65)
    const int64_t ring = n > kTokens ? 3 : v.ring;  // N > 16: the 3-batch ring only (dispatch)
    const int64_t part_bytes = n > kTokens ? std::max(16 * (kWideNt * 8 + 1), kWideNt * 8 * 17) * 4 : 16 * kTokens * 4;
    const int64_t slot = std::max<int64_t>(kBatch * kHeaderWords * 4 + v.slot_words * 4, (part_bytes + ring - 1) / ring);
    p.boff = v.boff;
    p.slot_bytes = static_cast<int>((slot + 15) / 16 * 16);
    p.wstride = static_cast<int>(ring) * p.slot_bytes;
  }
  static const int probe = [] {
    const char* env = std::getenv("PRUNEKIT_NM24_PROBE");
    return env == nullptr ? 0 : std::atoi(env);
  }();
  p.probe = probe;
  // k-chunks reduced in a cluster on sm_90 (2..16 chunks; $PRUNEKIT_NM24_CLUSTER=0: global atomics, as on sm_80)
  const char* cluster_var = std::getenv("PRUNEKIT_NM24_CLUSTER");
  const bool cluster_env = cluster_var == nullptr || std::strcmp(cluster_var, "0") != 0;
  const c10::cuda::CUDAGuard guard(x.device());
  p.cluster = cluster_env && chunks > 1 && chunks <= kMaxCluster && prunekit_launch::device_props(x.get_device()).major >= 9;
  // N > 16 (bitmap) with k-chunks added through global atomics: the plan's workspace holds 16 tokens per row, so this
  // call gets its own zeroed (M, N rounded up to even) fp32 workspace and counters per (row block, token group)
  at::Tensor call_ws, call_counters;
  p.ws_ld = kTokens;
  if (n > kTokens && chunks > 1 && !p.cluster) {
    const int64_t ld = (n + 1) / 2 * 2, groups = (n + kWideNt * 8 - 1) / (kWideNt * 8);
    call_ws = at::zeros({v.strips * 16 * ld}, x.options().dtype(at::kFloat));
    call_counters = at::zeros({row_blocks * groups}, x.options().dtype(at::kInt));
    p.ws = call_ws.data_ptr<float>();
    p.counters = call_counters.data_ptr<int>();
    p.ws_ld = static_cast<int>(ld);
  }
  // On sm_90, k-chunks added with atomics end in a second kernel (nm24_finish_kernel) instead of fences, counters and
  // the last block ($PRUNEKIT_NM24_FINISH=0: the latter). On the H100 at 4096 x 11008 (22 k-chunks), 2:4, N = 16:
  // 26.5 against 28.7 us (benchmarks/results/nm24-sweep-{fin,base}-h100-2026-11-26-s17.json). Where the k-chunks fit
  // a cluster, the cluster reduction stays faster (4096 x 4096: 11.6 against 14.7 us, nm24-sweep-c0fin-...). The
  // bitmap at 4096 x 11008, N = 16: 25.9 / 23.4 against 27.3 / 25.0 us at 80 / 90% (spmm-bitmap16-{fin,nofin}-...).
  // N <= 16 only: at N = 128 / 256 (bitmap, 90%) it was 2% / 10% slower (spmm-bitmapwide-{fin,nofin}-...-s17.json),
  // its workspace reads being a row apart.
  const char* finish_var = std::getenv("PRUNEKIT_NM24_FINISH");
  p.finish = chunks > 1 && !p.cluster && n <= kTokens && prunekit_launch::device_props(x.get_device()).major >= 9 &&
             !(finish_var != nullptr && std::strcmp(finish_var, "0") == 0);
  // Programmatic dependent launch, on by default with the cluster reduction and the finishing kernel, so on sm_90 and
  // newer only ($PRUNEKIT_NM24_PDL=0: off). On the H100, calls of one layer back to back took 0.1-1.8 us less each (of
  // 4-28 us) with clusters (benchmarks/results/{spmm-bitmap,nm24-sweep}-{pdl,nopdl}-h100-2026-11-26-s12.json), but
  // 1-1.5 us more with the fence-and-counter atomics; with the finishing kernel 26.4 against 26.7 us at 4096 x 11008
  // (nm24-sweep-c0fin{,nopdl}-h100-2026-11-26-s17.json; the finishing kernel itself always waits through
  // griddepcontrol). In decode q / k / v blocks (three projections back to back) the chain took 6-10% less time (graph;
  // 2:4 at N = 1 / 16, bitmap at N = 16: decode-chain-qkv-h100-2026-11-26-s13.json); in MLP blocks, where norms,
  // activations and adds come between the sparse layers, -3% to +0% (decode-chain-mlp-...).
  const char* pdl_var = std::getenv("PRUNEKIT_NM24_PDL");
  p.pdl = (p.cluster || p.finish) && (pdl_var == nullptr || std::strcmp(pdl_var, "0") != 0) ? 1 : 0;
  p.x_vec = x.stride(0) == 1 && (n == 1 || x.stride(1) % 4 == 0) && reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool two = n > 8;
  // The lean kernels (mma.sp and bitmap plans at N <= 16 where lean_takes: no workspace or second kernel);
  // programmatic dependent launch on sm_90 unless $PRUNEKIT_NM24_PDL=0.
  const bool bitmap = v.variant == kBitmap;
  if ((sp || bitmap) && lean_takes(k, n)) {
    p.cluster = 0;
    p.finish = 0;
    p.pdl = prunekit_launch::device_props(x.get_device()).major >= 9 &&
                    (pdl_var == nullptr || std::strcmp(pdl_var, "0") != 0)
                ? 1
                : 0;
    const int sms = prunekit_launch::device_props(x.get_device()).sms;
    if (bitmap) {  // X as 8-byte pieces: the x_vec above
      const int kw = lean_shape(p.strips, p.ksteps / kBatch, 1, sms, k, p.n, false).kw;
      if (x.scalar_type() == at::kHalf) {
        two ? launch_lean_bitmap<__half, 2>(p, stream, kw) : launch_lean_bitmap<__half, 1>(p, stream, kw);
      } else {
        two ? launch_lean_bitmap<__nv_bfloat16, 2>(p, stream, kw) : launch_lean_bitmap<__nv_bfloat16, 1>(p, stream, kw);
      }
      return;
    }
    // 2:4: X as 4-byte pairs; unit stride along K, an even row stride and a 4-byte aligned base suffice
    p.x_vec =
        x.stride(0) == 1 && (n == 1 || x.stride(1) % 2 == 0) && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0;
    const LeanShape shape = lean_shape(p.strips, p.ksteps / 2, 2, sms, k, p.n);
    if (x.scalar_type() == at::kHalf) {
      two ? launch_lean<__half, 2>(p, stream, shape) : launch_lean<__half, 1>(p, stream, shape);
    } else {
      two ? launch_lean<__nv_bfloat16, 2>(p, stream, shape) : launch_lean<__nv_bfloat16, 1>(p, stream, shape);
    }
    return;
  }
  const int ring = static_cast<int>(v.ring), batch = static_cast<int>(v.batch);
  if (x.scalar_type() == at::kHalf) {
    dispatch<__half>(p, stream, static_cast<int>(v.variant), two, ring, batch);
    if (p.finish) launch_finish<__half>(p, stream);
  } else {
    dispatch<__nv_bfloat16>(p, stream, static_cast<int>(v.variant), two, ring, batch);
    if (p.finish) launch_finish<__nv_bfloat16>(p, stream);
  }
}

// The k-split workspace and counters of a plan with `strips` strips, on x's GPU (both ops' plans hold them).
void check_workspace(const at::Tensor& ws, const at::Tensor& counters, int64_t strips, const at::Tensor& x,
                     const char* op) {
  PRUNEKIT_CHECK(ws.scalar_type() == at::kFloat && ws.numel() >= strips * 16 * kTokens &&
                     counters.scalar_type() == at::kInt && counters.numel() >= (strips + kWarps - 1) / kWarps,
                 op, ": workspace or counters too small");
  PRUNEKIT_CHECK(ws.device() == x.device() && counters.device() == x.device(), op,
                 ": all tensors must be on one GPU");
}

// The plan as four tensors: vals / meta / ws / counters (kernels/nm24.py), Y into y.
void nm24_mm(const at::Tensor& vals, const at::Tensor& meta, const at::Tensor& ws, const at::Tensor& counters,
             const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& bias, bool relu, int64_t m,
             int64_t chunk, int64_t variant, int64_t ring, int64_t batch) {
  PRUNEKIT_CHECK(vals.dim() == 4 && vals.size(2) == 32 && vals.size(3) == 4 && vals.scalar_type() == at::kInt &&
                  vals.is_contiguous(),
              "nm24_mm: vals must be a contiguous int32 (strips, ksteps / 2, 32, 4)");
  const int64_t strips = vals.size(0), ksteps = vals.size(1) * 2;
  PRUNEKIT_CHECK(meta.scalar_type() == at::kInt && meta.is_contiguous() && meta.numel() == strips * ksteps * 8,
              "nm24_mm: meta must be a contiguous int32 (strips, ksteps / 4, 32), or (strips, ksteps / 2, 16) for ",
              "mma.sp");
  check_workspace(ws, counters, strips, x, "nm24_mm");
  PRUNEKIT_CHECK(vals.device() == x.device() && meta.device() == x.device(), "nm24_mm: all tensors must be on one GPU");
  run(PlanView{vals.data_ptr(), meta.data_ptr(), ws.data_ptr<float>(), counters.data_ptr<int>(), strips, ksteps, m,
               chunk, variant, ring, batch},
      x, y, bias, relu);
}

// The unstructured bitmap plan (kernels/spmm_bitmap_plan.py: vals, hdr, boff, ws, counters), Y into y; ring: 3 or 5
// batches of 8 k-steps per warp in shared memory.
void bitmap_mm(const at::Tensor& vals, const at::Tensor& hdr, const at::Tensor& boff, const at::Tensor& ws,
               const at::Tensor& counters, const at::Tensor& x, const at::Tensor& y,
               const c10::optional<at::Tensor>& bias, bool relu, int64_t m, int64_t chunk, int64_t slot_words,
               int64_t ring) {
  PRUNEKIT_CHECK(hdr.dim() == 3 && hdr.size(2) == kHeaderWords && hdr.scalar_type() == at::kInt && hdr.is_contiguous() &&
                  hdr.size(1) % kBatch == 0,
              "bitmap_mm: hdr must be a contiguous int32 (strips, ksteps, 5) with ksteps a multiple of 8");
  const int64_t strips = hdr.size(0), ksteps = hdr.size(1);
  PRUNEKIT_CHECK(boff.dim() == 2 && boff.size(0) == strips && boff.size(1) == ksteps / kBatch + 1 &&
                  boff.scalar_type() == at::kInt && boff.is_contiguous(),
              "bitmap_mm: boff must be a contiguous int32 (strips, ksteps / 8 + 1)");
  PRUNEKIT_CHECK(vals.dim() == 1 && vals.numel() >= 4 && vals.scalar_type() == at::kInt && vals.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(vals.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(hdr.data_ptr()) % 16 == 0,
              "bitmap_mm: vals must be a contiguous 16-byte aligned int32 vector");
  check_workspace(ws, counters, strips, x, "bitmap_mm");
  PRUNEKIT_CHECK(vals.device() == x.device() && hdr.device() == x.device() && boff.device() == x.device(),
                 "bitmap_mm: all tensors must be on one GPU");
  PlanView v{vals.data_ptr(), hdr.data_ptr(), ws.data_ptr<float>(), counters.data_ptr<int>(), strips, ksteps, m,
             chunk, kBitmap, ring, 8};
  v.boff = boff.data_ptr<int>();
  v.slot_words = slot_words;
  run(v, x, y, bias, relu);
}

// The eager entry: the plan as one int32 buffer (vals, meta, ws, counters back to back; kernels/nm24.py build_plan)
// and its settings packed into one integer (nm24.plan_cfg: M in bits 0-31, chunk 32-39, variant 40, ring 44-47, batch
// 48-51), so that a call converts five arguments instead of thirteen. Allocates Y by layout.py's rule (x (K, N) with
// unit stride along K and N > 1: the transposed view of a contiguous (N, M); else a contiguous (M, N)). With bit 56
// of cfg set (nm24.ROWS), x_in is the activations (N, K) as nn.Linear takes them and the result is Y^T (N, M): the
// two transposes are views made here instead of in Python.
at::Tensor nm24_linear(const at::Tensor& plan, const at::Tensor& x_in, const c10::optional<at::Tensor>& bias,
                       bool relu, int64_t cfg) {
  PRUNEKIT_CHECK(x_in.dim() == 2, "nm24_linear: x must be 2-D");
  const bool rows = (cfg >> 56) & 1;
  const at::Tensor x = rows ? prunekit::raw_t(x_in) : x_in;
  const int64_t m = cfg & 0xffffffffLL, k = x.size(0), n = x.size(1);
  const int64_t strips = (m + 15) / 16, ksteps = (k + 16 * kBatch - 1) / (16 * kBatch) * kBatch;
  const int64_t row_blocks = (strips + kWarps - 1) / kWarps;
  const int64_t n_vals = strips * ksteps * 64, n_meta = strips * ksteps * 8, n_ws = strips * 16 * kTokens;
  PRUNEKIT_CHECK(plan.scalar_type() == at::kInt && plan.is_contiguous() && plan.device() == x.device() &&
                  plan.numel() == n_vals + n_meta + n_ws + row_blocks &&
                  reinterpret_cast<uintptr_t>(plan.data_ptr()) % 16 == 0,
              "nm24_linear: the plan buffer does not match M = ", m, " and x's K = ", k);
  int32_t* base = plan.data_ptr<int32_t>();
  const PlanView v{base, base + n_vals, reinterpret_cast<float*>(base + n_vals + n_meta), base + n_vals + n_meta + n_ws,
                   strips, ksteps, m, (cfg >> 32) & 0xff, (cfg >> 40) & 1, (cfg >> 44) & 0xf, (cfg >> 48) & 0xf};
  const bool transposed = n > 1 && x.stride(0) == 1 && x.stride(1) != 1;
  const at::Tensor buf = transposed ? at::empty({n, m}, x.options()) : at::empty({m, n}, x.options());
  const at::Tensor y = transposed ? prunekit::raw_t(buf) : buf;
  run(v, x, y, bias, relu);
  // rows: the (N, M) buffer itself where Y is its transposed view
  return rows ? (transposed ? buf : prunekit::raw_t(y)) : y;
}

// The bitmap plan's eager entry: the plan as its one int32 buffer (spmm_bitmap_plan.buffer_layout: hdr, boff, ws,
// counters, each padded to 4 words, then vals; found from M and K), cfg packed as nm24_linear's (M, chunk, ring;
// bit 56: x_in is the activations (N, K) and the result Y^T (N, M)), and shape = the slot size in words | K << 32.
// Allocates Y as nm24_linear.
at::Tensor bitmap_linear(const at::Tensor& plan, const at::Tensor& x_in, const c10::optional<at::Tensor>& bias,
                         bool relu, int64_t cfg, int64_t shape) {
  PRUNEKIT_CHECK(x_in.dim() == 2, "bitmap_linear: x must be 2-D");
  const bool rows = (cfg >> 56) & 1;
  const at::Tensor x = rows ? prunekit::raw_t(x_in) : x_in;
  const int64_t m = cfg & 0xffffffffLL, k = x.size(0), n = x.size(1);
  const int64_t slot_words = shape & 0xffffffffLL;
  PRUNEKIT_CHECK(k == (shape >> 32), "bitmap_linear: x has K = ", k, ", the plan ", shape >> 32);
  const int64_t strips = (m + 15) / 16, ksteps = (k + 16 * kBatch - 1) / (16 * kBatch) * kBatch;
  auto pad4 = [](int64_t words) { return (words + 3) / 4 * 4; };
  const int64_t n_hdr = strips * ksteps * kHeaderWords, n_boff = pad4(strips * (ksteps / kBatch + 1));
  const int64_t n_ws = strips * 16 * kTokens, n_cnt = pad4((strips + kWarps - 1) / kWarps);
  const int64_t fixed = n_hdr + n_boff + n_ws + n_cnt;
  PRUNEKIT_CHECK(plan.scalar_type() == at::kInt && plan.dim() == 1 && plan.is_contiguous() &&
                  plan.device() == x.device() && plan.numel() >= fixed + 4 &&
                  reinterpret_cast<uintptr_t>(plan.data_ptr()) % 16 == 0,
              "bitmap_linear: the plan buffer does not match M = ", m, " and x's K = ", k);
  int32_t* base = plan.data_ptr<int32_t>();
  PlanView v{base + fixed, base, reinterpret_cast<float*>(base + n_hdr + n_boff), base + n_hdr + n_boff + n_ws,
             strips, ksteps, m, (cfg >> 32) & 0xff, kBitmap, (cfg >> 44) & 0xf, 8};
  v.boff = base + n_hdr;
  v.slot_words = slot_words;
  const bool transposed = n > 1 && x.stride(0) == 1 && x.stride(1) != 1;
  const at::Tensor buf = transposed ? at::empty({n, m}, x.options()) : at::empty({m, n}, x.options());
  const at::Tensor y = transposed ? prunekit::raw_t(buf) : buf;
  run(v, x, y, bias, relu);
  // rows: the (N, M) buffer itself where Y is its transposed view
  return rows ? (transposed ? buf : prunekit::raw_t(y)) : y;
}

}  // namespace
}  // namespace prunekit_nm24

TORCH_LIBRARY(prunekit_nm24, m) {
  m.def(
      "mm(Tensor vals, Tensor meta, Tensor(a!) ws, Tensor(b!) counters, Tensor x, Tensor(c!) y, Tensor? bias, bool "
      "relu, int m, int chunk, int variant=0, int ring=3, int batch=8) -> ()");
  m.def("linear(Tensor(a!) plan, Tensor x, Tensor? bias, bool relu, int cfg) -> Tensor");
  m.def(
      "bitmap_mm(Tensor vals, Tensor hdr, Tensor boff, Tensor(a!) ws, Tensor(b!) counters, Tensor x, Tensor(c!) y, "
      "Tensor? bias, bool relu, int m, int chunk, int slot_words, int ring=3) -> ()");
  m.def("bitmap_linear(Tensor(a!) plan, Tensor x, Tensor? bias, bool relu, int cfg, int shape) -> Tensor");
}

TORCH_LIBRARY_IMPL(prunekit_nm24, CUDA, m) {
  m.impl("mm", &prunekit_nm24::nm24_mm);
  m.impl("linear", &prunekit_nm24::nm24_linear);
  m.impl("bitmap_mm", &prunekit_nm24::bitmap_mm);
  m.impl("bitmap_linear", &prunekit_nm24::bitmap_linear);
}
