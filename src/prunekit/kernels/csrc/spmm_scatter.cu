// SpMM for decode shapes (N <= 16) on tensor cores: Y (M, N) = act(A @ X + bias), A given as scatter records.
//
// "Load sparse, compute dense" for small N, where the weights' bytes set the time: the plan
// (kernels/spmm_scatter_plan.py) cuts A into strips of 8 rows and groups of 128 columns and stores, per (strip,
// group), one 32-bit record per non-zero: its 16-bit value and its position in the group's dense 8 x 128 tile as
// laid out in shared memory (4 bytes per non-zero, like CSR with int16 indices, and no padding). Each warp owns one
// strip and a range of groups; per group it scatters the records into a zeroed 2 KB shared-memory tile (one 2-byte
// store per non-zero, 32 per instruction), reads the tile back as mma B fragments with ldmatrix.x4 (the tile's
// 16-byte column groups are XOR-swizzled by row so the eight rows of an 8x8 matrix hit distinct banks; the plan
// stores positions already swizzled) and multiplies it on tensor cores with X: mma.sync.m16n8k16 with the N <= 16
// tokens as the m = 16 A operand and the strip's 8 rows as n = 8, fp32 accumulators. Within each 16-column k-step the
// plan permutes the slots (slot 2q + j holds column 4q + j, slot 8 + 2q + j column 4q + 2 + j, q < 4, j < 2) so that
// a lane's four A elements of one token are four adjacent columns of X.
//
// A block of 8 warps owns 8 strips and a range of kr_groups groups (grid: k-splits x strip blocks). It first copies
// that X range (kr_groups * 128 columns x 16 tokens, zero outside X) into shared memory in A-fragment order, one
// conflict-free 16-byte store per lane and k-step (read back with one 16-byte load, or 8 bytes when N <= 8). Each
// warp reads its groups' records as one stream, 32 per step, through a ring of 8 loads in flight per lane (1 KB per
// warp), independent of where the groups end: a group's tile is multiplied and cleared as soon as the stream passes
// its end. With several k-splits the warps add their fp32 partial sums into a workspace with atomics; the last warp
// of a strip (a per-strip counter, after a fence) reads the sums, adds bias, applies ReLU, writes Y and sets the
// workspace and counter back to zero, so the next call finds them clean (the threadFenceReduction pattern of the
// CUDA samples). One split writes Y directly. On sm_90 with 2-16 splits, where measured faster (rule at the launch;
// $PRUNEKIT_SCATTER_CLUSTER=1 / 0 forces it on / off): the k-splits of a strip block form a thread-block cluster and
// are added up through distributed shared memory instead (as the 2:4 decode kernel does, structured/nm24).
//
// History (docs/KERNELS.md): a first version loaded one group ahead and read each group's end just before, two
// dependent memory latencies per group. Nsight Compute then showed the kernel bound by shared-memory wavefronts, 123
// per group, a quarter of them bank conflicts of the X copy and of the scatter; hence the conflict-free copy, the
// 8-byte X loads for N <= 8 and the bank-round-robin record order of the plan.
//
// ROWS = 16 (opt-in, $PRUNEKIT_SCATTER_ROWS=16; passed the H100 tests, slower than 8 at most decode points): strips
// of 16 rows, the tile read with ldmatrix.x4 as the mma's A operand (rows 0-7 / 8-15 at column groups 2t, 2t + 1)
// and the staged X items as its B operands (tokens 0-7, and 8-15 for N > 8): half the X loads and flushes per weight.
//
// Sources: the tile format follows the "load as sparse, compute as dense" idea of Flash-LLM (Xia et al., VLDB 2024)
// and the bitmap-per-tile SpInfer (Fan et al., EuroSys 2025); this kernel's records and scatter are prunekit's own.
// sm_80+ (ldmatrix, mma.sync with bf16).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common.cuh"
#include "kernels.h"
#include "mma.cuh"
#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit {
namespace {

constexpr int kScWarps = 8;
constexpr int kScThreads = 32 * kScWarps;
// Strip rows ROWS (template): 8 (the mma's n operand, the default) or 16 (the m operand, opt-in: see gpu.py).
constexpr int kScGroupCols = 128;   // = spmm_scatter_plan.GROUP_COLS
constexpr int kScTokens = 16;       // mma m: N <= 16
constexpr int kScPrefetch = 8;      // record loads in flight per lane (256 records = 1 KB per warp)
constexpr int kScMaxCluster = 16;   // k-splits one cluster reduces (over 8: non-portable cluster size)
constexpr int kScMaxKrGroups = 12;  // shared memory: 4 KB of X per group + 16 KB of tiles

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ uint32_t pack2(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// A fragment of one k-step from the staged X (registers stored as 0, 2, 1, 3): for N <= 8 (NARROW) tokens 8-15 are
// zero and one 8-byte shared load gets registers 0 and 2.
template <bool NARROW> __device__ __forceinline__ uint4 x_frag(const uint4* p) {
  if constexpr (NARROW) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    return make_uint4(v.x, 0u, v.y, 0u);
  } else {
    const uint4 v = *p;
    return make_uint4(v.x, v.z, v.y, v.w);
  }
}

__device__ __forceinline__ void scatter_one(uint16_t* tile, uint32_t rec) {
  tile[rec >> 16] = static_cast<uint16_t>(rec);
}

template <typename T, bool SPLIT, bool XVEC, bool NARROW, int ROWS>
__global__ void __launch_bounds__(kScThreads) spmm_scatter_kernel(
    const uint32_t* __restrict__ records, const int* __restrict__ group_offsets, const T* __restrict__ x,
    int64_t sxk, int64_t sxn, T* __restrict__ y, int64_t sym, int64_t syn, const T* __restrict__ bias, bool relu,
    int m, int k, int n, int strips, int groups, int kr_groups, float* __restrict__ workspace,
    int* __restrict__ counters, int ksplit, int cluster) {
  extern __shared__ uint4 smem[];
  const int g0 = blockIdx.x * kr_groups;
  const int g1 = min(groups, g0 + kr_groups);
  const int ng = g1 - g0;
  const int ksteps = ng * (kScGroupCols / 16);
  uint4* xs = smem;                          // (kr_groups * 8 k-steps, 32 lanes) A fragments
  uint4* tiles = smem + kr_groups * 8 * 32;  // 8 warps x (ROWS rows x 128 columns) fp16/bf16
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint4* tile4 = tiles + warp * (ROWS * kScGroupCols / 8);
  uint16_t* tile = reinterpret_cast<uint16_t*>(tile4);
  const int strip = blockIdx.y * kScWarps + warp;
  const bool active = strip < strips;

  // Record offsets of this warp's groups: lane i <= ng holds the start of group g0 + i (lane ng: the range's end).
  int bnd = 0;
  if (active && lane <= ng) bnd = __ldg(group_offsets + static_cast<int64_t>(strip) * groups + g0 + lane);

  // The warp's records form one stream r0 .. r1 (its groups in order), read 32 at a time through a ring of
  // kScPrefetch loads in flight per lane, independent of where the groups end. Issued before the X copy, whose L2
  // reads then overlap their latency.
  const int r0 = __shfl_sync(0xffffffffu, bnd, 0);
  const int r1 = __shfl_sync(0xffffffffu, bnd, ng);
  uint32_t ring[kScPrefetch];
#pragma unroll
  for (int d = 0; d < kScPrefetch; ++d) {
    const int i = r0 + 32 * d + lane;
    ring[d] = i < r1 ? __ldg(records + i) : 0u;
  }

  // X[g0 * 128 : g1 * 128, :16] in A-fragment order: item (k-step t, lane L) is lane L's 16 bytes, tokens j = L / 4
  // and j + 8 at columns k0 + 16 t + 4 (L % 4) + 0..3 (the slot order makes them A elements (j, 2q, 2q + 1) ->
  // register 0, (j + 8, ...) -> 1, (j, 2q + 8, 2q + 9) -> 2, (j + 8, ...) -> 3). Stored as registers 0, 2, 1, 3, so
  // that for N <= 8 an 8-byte load gets the two non-zero ones; one 16-byte store per item, conflict-free.
  {
    const int k0 = g0 * kScGroupCols;
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x);
    const auto load4 = [&](int col, int j) -> uint2 {
      if (j >= n) return make_uint2(0u, 0u);
      if (XVEC && col + 3 < k) return __ldg(reinterpret_cast<const uint2*>(xb + col + j * sxn));
      uint16_t e[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) e[c] = col + c < k ? __ldg(xb + (col + c) * sxk + j * sxn) : uint16_t(0);
      return make_uint2(pack2(e[0], e[1]), pack2(e[2], e[3]));
    };
#pragma unroll 4
    for (int it = threadIdx.x; it < ksteps * 32; it += kScThreads) {
      const int L = it & 31, t = it >> 5;
      const int col = k0 + t * 16 + 4 * (L & 3);
      const uint2 lo = load4(col, L >> 2);
      const uint2 hi = NARROW ? make_uint2(0u, 0u) : load4(col, (L >> 2) + 8);
      xs[it] = make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
  }

#pragma unroll
  for (int i = 0; i < ROWS / 2; ++i) tile4[lane + 32 * i] = make_uint4(0u, 0u, 0u, 0u);
  __syncthreads();
  if (!active && !(SPLIT && cluster)) return;  // in a cluster every warp reaches the cluster barriers (no records here)

  // Accumulators of even and odd k-steps (two chains of dependent mma per group), per 8-token half for ROWS = 16.
  constexpr int kHalves = ROWS == 16 ? 2 : 1;
  float acc[kHalves][4] = {}, acc2[kHalves][4] = {};
  // ldmatrix.x4 row address of this lane. ROWS = 8 (tile as B fragments of k-steps 2 jj, 2 jj + 1): matrix lane / 8
  // is 16-byte column group 4 jj + lane / 8 of row lane % 8. ROWS = 16 (tile as the A fragment of k-step t): matrix
  // lane / 8 is rows 8 ((lane / 8) % 2) + 0..7 at column group 2 t + lane / 16. Column groups swizzled by row % 8.
  const int lrow = ROWS == 16 ? (lane & 7) + ((lane >> 3) & 1) * 8 : lane & 7;
  const int lmat = ROWS == 16 ? lane >> 4 : lane >> 3;
  const uint32_t tile_row = smem_u32(tile) + static_cast<uint32_t>(lrow * kScGroupCols * 2);
  const int lswz = lrow & 7;
  int gi = 0;  // current group (relative to g0), its records gbeg .. gend
  int gbeg = r0;
  int gend = __shfl_sync(0xffffffffu, bnd, 1);
  const int nchunks = (r1 - r0 + 31) / 32;
  for (int c0 = 0; c0 < nchunks; c0 += kScPrefetch) {
#pragma unroll
    for (int d = 0; d < kScPrefetch; ++d) {
      const int c = c0 + d;
      if (c >= nchunks) break;
      const uint32_t rec = ring[d];
      {
        const int i = r0 + 32 * (c + kScPrefetch) + lane;
        ring[d] = i < r1 ? __ldg(records + i) : 0u;
      }
      const int idx = r0 + 32 * c + lane;
      const int cend = min(r0 + 32 * c + 32, r1);
      if (cend < gend) {  // the whole chunk lies in group gi (it starts at or after gbeg): the common case
        if (idx < cend) scatter_one(tile, rec);
        continue;
      }
      while (true) {
        if (idx >= gbeg && idx < gend) scatter_one(tile, rec);
        if (gend > cend) break;  // the group goes on in the next chunk
        if (gend > gbeg) {       // group gi complete: multiply its tile, then clear it
          __syncwarp();
          const uint4* xg = xs + gi * 8 * 32 + lane;
          if constexpr (ROWS == 16) {
            // Tile = A (16 rows x 16 k), X = B: registers 0-1 of the staged item are tokens 0-7, 2-3 tokens 8-15.
#pragma unroll
            for (int t = 0; t < 8; ++t) {
              uint4 a;
              ldmatrix_x4(tile_row + static_cast<uint32_t>(((2 * t + lmat) ^ lswz) * 16), a.x, a.y, a.z, a.w);
              float(&c)[kHalves][4] = (t & 1) ? acc2 : acc;
              if constexpr (NARROW) {
                const uint2 v = *reinterpret_cast<const uint2*>(xg + t * 32);
                Mma<T>::run(c[0], a, v.x, v.y);
              } else {
                const uint4 v = xg[t * 32];
                Mma<T>::run(c[0], a, v.x, v.y);
                Mma<T>::run(c[kHalves - 1], a, v.z, v.w);
              }
            }
          } else {
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
              uint32_t b0, b1, b2, b3;
              ldmatrix_x4(tile_row + static_cast<uint32_t>(((4 * jj + lmat) ^ lswz) * 16), b0, b1, b2, b3);
              Mma<T>::run(acc[0], x_frag<NARROW>(xg + (2 * jj) * 32), b0, b1);
              Mma<T>::run(acc2[0], x_frag<NARROW>(xg + (2 * jj + 1) * 32), b2, b3);
            }
          }
          __syncwarp();
#pragma unroll
          for (int i = 0; i < ROWS / 2; ++i) tile4[lane + 32 * i] = make_uint4(0u, 0u, 0u, 0u);
          __syncwarp();
        }
        if (++gi >= ng) break;
        gbeg = gend;
        gend = __shfl_sync(0xffffffffu, bnd, gi + 1);
      }
    }
  }

  // Output element e of this lane: ROWS = 8: token gid + 8 (e / 2), strip row 2 tig + e % 2 (tokens are the mma's
  // m). ROWS = 16: token 8 (e / 4) + 2 tig + e % 2, strip row gid + 8 ((e / 2) % 2) (rows are the m).
  constexpr int kOut = 4 * kHalves;
  float out[kOut];
#pragma unroll
  for (int e = 0; e < kOut; ++e) out[e] = acc[e / 4][e % 4] + acc2[e / 4][e % 4];
  const int gid = lane >> 2, tig = lane & 3;
  const auto token_of = [&](int e) { return ROWS == 16 ? 8 * (e >> 2) + 2 * tig + (e & 1) : gid + 8 * (e >> 1); };
  const auto row_of = [&](int e) { return ROWS == 16 ? gid + 8 * ((e >> 1) & 1) : 2 * tig + (e & 1); };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (SPLIT && cluster) {
    // The k-splits of a strip block are one thread-block cluster (launch rule, or $PRUNEKIT_SCATTER_CLUSTER). Each warp
    // leaves its partial sums in its own tile (idle now), and after the cluster barrier block rank r adds up its share
    // of the block's 8 strips from every block's shared memory (distributed shared memory): no atomics, fences or
    // counters. The 2:4 decode kernel (structured/nm24) measured its atomic epilogue at about 6 us of 17 on the H100.
    float* part = reinterpret_cast<float*>(tile4);
    __syncwarp();
#pragma unroll
    for (int e = 0; e < kOut; ++e) part[token_of(e) * ROWS + row_of(e)] = out[e];
    cooperative_groups::cluster_group cl = cooperative_groups::this_cluster();
    cl.sync();
    const int rank = static_cast<int>(cl.block_rank());
    constexpr int kPerWarp = kScTokens * ROWS;
    for (int idx = rank * kScThreads + static_cast<int>(threadIdx.x); idx < kScWarps * kPerWarp;
         idx += kScThreads * ksplit) {
      const int w = idx / kPerWarp, tok = (idx % kPerWarp) / ROWS, r = idx % ROWS;
      const int s = blockIdx.y * kScWarps + w;
      const int row = s * ROWS + r;
      if (s < strips && tok < n && row < m) {
        float* local = reinterpret_cast<float*>(tiles + w * (ROWS * kScGroupCols / 8)) + tok * ROWS + r;
        float parts[kScMaxCluster];
#pragma unroll
        for (int q = 0; q < kScMaxCluster; ++q) parts[q] = q < ksplit ? *cl.map_shared_rank(local, q) : 0.f;
        float v = bias != nullptr ? to_f(bias[row]) : 0.f;
#pragma unroll
        for (int q = 0; q < kScMaxCluster; ++q) v += parts[q];
        if (relu) v = fmaxf(v, 0.f);
        y[static_cast<int64_t>(row) * sym + static_cast<int64_t>(tok) * syn] = from_f<T>(v);
      }
    }
    cl.sync();  // no block leaves while another still reads its shared memory
    return;
  }
#endif
  if constexpr (SPLIT) {
    float* ws = workspace + static_cast<int64_t>(strip) * (kScTokens * ROWS);
#pragma unroll
    for (int e = 0; e < kOut; ++e) {
      const int tok = token_of(e);
      if (tok < n) atomicAdd(ws + tok * ROWS + row_of(e), out[e]);
    }
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(counters + strip, 1) == ksplit - 1;
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int e = 0; e < kOut; ++e) {
      const int tok = token_of(e);
      float* p = ws + tok * ROWS + row_of(e);
      out[e] = tok < n ? __ldcg(p) : 0.f;
      if (tok < n) __stcg(p, 0.f);
    }
    if (lane == 0) counters[strip] = 0;
  }
#pragma unroll
  for (int e = 0; e < kOut; ++e) {
    const int tok = token_of(e);
    const int row = strip * ROWS + row_of(e);
    if (tok < n && row < m) {
      float v = out[e] + (bias != nullptr ? to_f(bias[row]) : 0.f);
      if (relu) v = fmaxf(v, 0.f);
      y[static_cast<int64_t>(row) * sym + static_cast<int64_t>(tok) * syn] = from_f<T>(v);
    }
  }
}

template <typename T, bool SPLIT, bool XVEC, bool NARROW, int ROWS>
void launch_scatter(const at::Tensor& records, const at::Tensor& group_offsets, const at::Tensor& x,
                    const at::Tensor& y,
                    const T* bias, bool relu, int m, int k, int n, int strips, int groups, int kr_groups, int ksplit,
                    float* workspace, int* counters, bool cluster) {
  const size_t smem = static_cast<size_t>(kr_groups) * 8 * 32 * 16 + kScWarps * ROWS * kScGroupCols * 2;
  auto kernel = spmm_scatter_kernel<T, SPLIT, XVEC, NARROW, ROWS>;
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  const dim3 grid(ksplit, (strips + kScWarps - 1) / kScWarps);
  if (!cluster) {
    kernel<<<grid, kScThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const uint32_t*>(records.data_ptr()), group_offsets.data_ptr<int>(),
        reinterpret_cast<const T*>(x.data_ptr()), x.stride(0), x.stride(1), reinterpret_cast<T*>(y.data_ptr()),
        y.stride(0), y.stride(1), bias, relu, m, k, n, strips, groups, kr_groups, workspace, counters, ksplit, 0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (ksplit > 8) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kScThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = ksplit;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, reinterpret_cast<const uint32_t*>(records.data_ptr()),
                                    group_offsets.data_ptr<int>(), reinterpret_cast<const T*>(x.data_ptr()),
                                    x.stride(0), x.stride(1), reinterpret_cast<T*>(y.data_ptr()), y.stride(0),
                                    y.stride(1), bias, relu, m, k, n, strips, groups, kr_groups, workspace, counters,
                                    ksplit, 1));
}

}  // namespace

void spmm_csr_scatter(const at::Tensor& records, const at::Tensor& group_offsets, const at::Tensor& x,
                      const at::Tensor& y, const std::optional<at::Tensor>& bias, bool relu, int64_t kr_groups,
                      const at::Tensor& workspace, const at::Tensor& counters, int64_t strip_rows) {
  const char* op = "spmm_csr_scatter";
  PRUNEKIT_CHECK(strip_rows == 8 || strip_rows == 16, op, ": strip_rows must be 8 or 16, got ", strip_rows);
  PRUNEKIT_CHECK(records.is_cuda() && group_offsets.is_cuda() && x.is_cuda() && y.is_cuda() && workspace.is_cuda() &&
                  counters.is_cuda(),
              op, ": tensors must be on the GPU");
  const auto device = x.device();
  PRUNEKIT_CHECK(records.device() == device && group_offsets.device() == device && y.device() == device &&
                  workspace.device() == device && counters.device() == device &&
                  (!bias || bias->device() == device),
              op, ": the plan, x, y, bias and workspace must be on one GPU (x is on ", device, ")");
  const auto dtype = x.scalar_type();
  PRUNEKIT_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op, ": tensor cores take float16 or bfloat16, got ",
              dtype);
  PRUNEKIT_CHECK(y.scalar_type() == dtype, op, ": x and y must share one dtype");
  PRUNEKIT_CHECK(records.scalar_type() == at::kInt && records.dim() == 1 && records.is_contiguous(), op,
              ": records must be a contiguous 1-D int32 tensor");
  PRUNEKIT_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(1) == y.size(1), op, ": x (K, N) and y (M, N) expected");
  const int64_t m = y.size(0), n = y.size(1), k = x.size(0);
  PRUNEKIT_CHECK(n <= kScTokens, op, ": takes N <= ", kScTokens, " columns of X, got ", n);
  const int64_t strips = (m + strip_rows - 1) / strip_rows;
  const int64_t groups = std::max<int64_t>(1, (k + kScGroupCols - 1) / kScGroupCols);
  PRUNEKIT_CHECK(group_offsets.scalar_type() == at::kInt && group_offsets.dim() == 1 && group_offsets.is_contiguous() &&
                  group_offsets.numel() == strips * groups + 1,
              op, ": group_offsets must be a contiguous int32 tensor of ceil(M / strip_rows) * ceil(K / 128) + 1 "
              "entries (was the plan built for this M, K and strip_rows?)");
  PRUNEKIT_CHECK(kr_groups >= 1 && kr_groups <= kScMaxKrGroups, op, ": kr_groups must be in [1, ", kScMaxKrGroups,
              "], got ", kr_groups);
  const int64_t ksplit = (groups + kr_groups - 1) / kr_groups;
  constexpr int64_t kInt32Max = (int64_t(1) << 31) - 1;
  // Record indices run up to 32 * (kScPrefetch + 1) past the last record in the ring refill: keep them in int.
  PRUNEKIT_CHECK(records.numel() <= kInt32Max - 32 * (kScPrefetch + 1) && strips * groups < kInt32Max &&
                  k <= kInt32Max && m <= kInt32Max && (strips + kScWarps - 1) / kScWarps <= 65535,
              op, ": problem too large for this kernel's indexing");
  if (ksplit > 1) {
    PRUNEKIT_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous() &&
                    workspace.numel() >= strips * kScTokens * strip_rows,
                op, ": workspace must be a contiguous float32 tensor of at least ",
                "ceil(M / strip_rows) * strip_rows * 16 zeros");
    PRUNEKIT_CHECK(counters.scalar_type() == at::kInt && counters.is_contiguous() && counters.numel() >= strips, op,
                ": counters must be a contiguous int32 tensor of at least ceil(M / strip_rows) zeros");
  }
  if (bias) {
    PRUNEKIT_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == m, op,
                ": bias must be a contiguous (M,) tensor of x's dtype");
  }
  if (m == 0 || n == 0) return;
  // 8-byte loads of four adjacent columns: X unit-stride along K (the runtime's transposed activations), every
  // token's column 8-byte aligned.
  const bool xvec = (x.stride(0) == 1 || k == 1) && (n == 1 || x.stride(1) % 4 == 0) &&
                    reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0;
  const c10::cuda::CUDAGuard guard(device);
  // k-splits reduced in a thread-block cluster instead of atomics (sm_90, 2..16 splits). $PRUNEKIT_SCATTER_CLUSTER=1
  // forces it, 0 forbids it; by default for N > 8 with at most 6 splits or more than 1024 blocks, the cases it was
  // faster in on the H100 at N = 16 (benchmarks/results/spmm-scattercl-h100-2026-11-25-s10.json against
  // spmm-scatter-...-s10.json: 3072 x 768 with 6 splits 1.23-1.39x, 11008 x 4096 with 8 splits and 1376 blocks
  // 1.07-1.10x; 4096 x 4096 with 8 splits and 512 blocks 0.72-0.88x). Not timed at N <= 8.
  const char* cluster_env = std::getenv("PRUNEKIT_SCATTER_CLUSTER");
  const int64_t blocks = ksplit * ((strips + kScWarps - 1) / kScWarps);
  const bool cluster_auto = n > 8 && (ksplit <= 6 || blocks > 1024);
  bool cluster = ksplit > 1 && ksplit <= kScMaxCluster &&
                 (cluster_env == nullptr ? cluster_auto : std::strcmp(cluster_env, "1") == 0);
  if (cluster) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index()));
    cluster = major >= 9;
  }
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* b = bias ? reinterpret_cast<const scalar_t*>(bias->data_ptr()) : nullptr;
    float* ws = ksplit > 1 ? workspace.data_ptr<float>() : nullptr;
    int* cnt = ksplit > 1 ? counters.data_ptr<int>() : nullptr;
    const auto go = [&](auto split, auto vec, auto narrow) {
      const auto launch = [&](auto rows) {
        launch_scatter<scalar_t, decltype(split)::value, decltype(vec)::value, decltype(narrow)::value,
                       decltype(rows)::value>(records, group_offsets, x, y, b, relu, static_cast<int>(m),
                                              static_cast<int>(k), static_cast<int>(n), static_cast<int>(strips),
                                              static_cast<int>(groups), static_cast<int>(kr_groups),
                                              static_cast<int>(ksplit), ws, cnt, cluster);
      };
      strip_rows == 16 ? launch(std::integral_constant<int, 16>{}) : launch(std::integral_constant<int, 8>{});
    };
    using T_ = std::true_type;
    using F_ = std::false_type;
    const auto go2 = [&](auto split, auto vec) { n <= 8 ? go(split, vec, T_{}) : go(split, vec, F_{}); };
    if (ksplit > 1) {
      xvec ? go2(T_{}, T_{}) : go2(T_{}, F_{});
    } else {
      xvec ? go2(F_{}, T_{}) : go2(F_{}, F_{});
    }
  };
  if (dtype == at::kHalf) {
    run(__half{});
  } else {
    run(__nv_bfloat16{});
  }
}

}  // namespace prunekit
