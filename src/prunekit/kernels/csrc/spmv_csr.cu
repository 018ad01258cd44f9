// SpMV, rowwarp's path at N = 1, and the same with a tile of NT = 4 tokens at N = 2-4 (where spmv_takes: X within 48 KB,
// M >= 8 rows per SM): Y (M, N) = act(A @ X + bias), A in prunekit CSR, X (K, N) with any strides.
//
// rowwarp (spmm_rowwarp.cu) gives every row its own warp and reads x from L2 per non-zero. At N = 1 on the H100 its
// time was about 4.5-7 us plus the weight bytes at ~3.3 TB/s (benchmarks/results/spmm-bitmap-nopdl-h100-2026-11-26-
// s12.json: 8.9 us at 4096 x 4096 80% against 6.9 us at 90%, half the bytes): the warp's chain row_indices ->
// row_offsets -> values -> x costs three to four memory latencies before it streams, a second wave of warps pays it
// again (11008 rows), and each x gather is one more L2 latency per vector. Here:
// - rows in storage order, R consecutive rows per warp (R = 1, 2, 4 or 8, enough to fit one wave; at most 4 for NT = 4,
//   for the registers of the R x NT sums), read as one
//   contiguous stream of 16-byte vectors of values and column indices (rows are padded to 16 bytes, so a vector
//   belongs to one row; the lane finds its row among the R + 1 offsets it holds in registers), two vectors in flight
//   per lane ahead of the one it multiplies (Sputnik's vector loads, Gale et al. SC 2020 sec. 5.2; the contiguous
//   stream of several rows is the CSR-stream idea of Greathouse and Daga, SC 2014);
// - the offsets and the first weight vectors are loaded before x, and with programmatic dependent launch (sm_90) before
//   the preceding kernel has finished: the kernel waits for it (griddepcontrol.wait) only before it reads x, and every
//   write comes after that;
// - the block copies X into shared memory once as [K][NT] (zero for tokens >= N; 16-byte loads along K where each
//   token's column is contiguous and aligned, as the runtime's x2d.t() is), so the gathers are shared-memory reads of
//   NT * esize bytes per non-zero;
// - per row and token, a warp reduction of the lanes' fp32 partial sums; lane q writes row r0 + q with bias and ReLU.
// Not taken (the caller keeps rowwarp): X larger than kSpmvMaxSmem bytes (K * NT * esize). $PRUNEKIT_SPMV=0 turns this path off,
// $PRUNEKIT_SPMV_PDL=0 the programmatic dependent launch (both read at each call, for A/B runs).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common.cuh"
#include "kernels.h"
#include "launch.cuh"  // device properties, programmatic dependent launch
#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit {

namespace {

constexpr int kSpmvMaxSmem = 96 * 1024;  // bytes of x staged per block: fp16 K <= 49152, fp32 K <= 24576
constexpr int kSpmvMinBlocksPerSm = 4;   // launch bounds: at most 64 registers per thread at 256 threads
// The token tile (N = 2-4) only where its copy of X leaves 4 blocks per SM (K * 4 * esize <= 48 KB) and M gives every SM
// 8 rows: on the H100 (benchmarks/results/spmm-n248-tiles2-h100-2026-11-26-s13.json against -rowwarp-...) it was
// slower than rowwarp's own kernel at 4096 x 11008 (88 KB of X, 2 blocks per SM: 41.0 against 37.3 us at N = 2, 70%)
// and 768 x 3072 (M = 768: 13.2 against 10.6 us), faster at 4096 x 4096, 11008 x 4096 and 3072 x 768 (3072 x 768, 90%,
// N = 2: 2.8 against 5.8 us). A tile of 8 tokens was slower than rowwarp's kernel at 3 of 4 shapes (4096 x 4096, 90%,
// N = 8: 20.4 against 12.7 us), so N = 5-8 stay with it.
constexpr int kSpmvMaxTile = 4;
constexpr int64_t kSpmvTileMaxSmem = 48 * 1024;
constexpr int kSpmvTileMinRowsPerSm = 8;

// The NT values x[col][0 .. NT) from the block's shared copy (row-major [K][NT]) as floats.
template <typename T, int NT>
__device__ __forceinline__ void read_xrow(const T* p, float* out) {
  constexpr int B = NT * static_cast<int>(sizeof(T));
  if constexpr (B >= 16) {
#pragma unroll
    for (int q = 0; q < B / 16; ++q) {
      const uint4 u = reinterpret_cast<const uint4*>(p)[q];
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int e = 0; e < 16 / static_cast<int>(sizeof(T)); ++e) out[q * (16 / sizeof(T)) + e] = word_elem<T>(w, e);
    }
  } else if constexpr (B == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const uint32_t w[2] = {u.x, u.y};
#pragma unroll
    for (int e = 0; e < NT; ++e) out[e] = word_elem<T>(w, e);
  } else {
    static_assert(NT == 1, "x rows of 2 or 4 bytes are single elements here");
    out[0] = to_f(p[0]);
  }
}

// R consecutive rows per warp times NT tokens (N <= NT; NT = 1 is the SpMV).
template <typename T, typename I, int R, int NT>
__global__ void __launch_bounds__(256, kSpmvMinBlocksPerSm)
spmv_csr_kernel(const T* __restrict__ values, const int* __restrict__ row_offsets, const I* __restrict__ cols,
                const T* __restrict__ x, int64_t xs_k, int64_t xs_n, T* __restrict__ y, int64_t ys_m, int64_t ys_n,
                const T* __restrict__ bias, bool relu, int m, int n, int k, bool x_vec) {
  constexpr int V = 16 / sizeof(T);  // non-zeros per 16-byte vector of values
  constexpr int kStep = 32 * V;      // non-zeros per warp step
  extern __shared__ __align__(16) unsigned char spmv_smem[];
  T* xs = reinterpret_cast<T*>(spmv_smem);  // x as [K][NT], zero for tokens >= n
  const int lane = threadIdx.x & 31;
  const int r0 = static_cast<int>((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5) * R;
  const int rows = max(0, min(R, m - r0));  // whole warps stay to the barrier below

  // Row boundaries of this warp's rows: lane q <= rows loads row_offsets[r0 + q]; bnd[q] for q > rows is the end.
  int off = 0;
  if (rows > 0 && lane <= rows) off = __ldg(row_offsets + r0 + lane);
  int bnd[R + 1];
#pragma unroll
  for (int q = 0; q <= R; ++q) bnd[q] = __shfl_sync(0xffffffffu, off, min(q, rows));
  const int end = bnd[R];

  // The first two vectors per lane go out before x is read (weights are never written by another kernel).
  int j = bnd[0] + lane * V;
  Words<16> va, vb;
  Words<V * sizeof(I)> ia, ib;
  if (j < end) {
    va.load(values + j);
    ia.load(cols + j);
  }
  if (j + kStep < end) {
    vb.load(values + j + kStep);
    ib.load(cols + j + kStep);
  }

  prunekit_launch::wait_preceding_grid();  // programmatic dependent launch: the preceding kernel (which may write x or read y) is done
  if constexpr (NT == 1) {
    if (x_vec) {
      for (int i = threadIdx.x; i < k / V; i += blockDim.x) {
        reinterpret_cast<uint4*>(xs)[i] = __ldg(reinterpret_cast<const uint4*>(x) + i);
      }
    } else {
      for (int i = threadIdx.x; i < k; i += blockDim.x) xs[i] = x[static_cast<int64_t>(i) * xs_k];
    }
  } else if (x_vec) {
    // each token's column of x contiguous (the runtime's x2d.t()): a thread takes one k, reads its NT values (each
    // load coalesced across the warp's consecutive k) and writes them as one NT * esize-byte vector, so the warp's
    // stores are contiguous (16-byte loads along K scattered into [K][NT] conflicted 16-32-way: 4x slower)
    for (int kk = threadIdx.x; kk < k; kk += blockDim.x) {
      float e[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t) e[t] = t < n ? to_f(x[static_cast<int64_t>(t) * xs_n + kk]) : 0.0f;
      store_xrow<T, NT>(xs + static_cast<int64_t>(kk) * NT, e);
    }
  } else {
    for (int i = threadIdx.x; i < k * NT; i += blockDim.x) {
      const int kk = i / NT, t = i - kk * NT;
      xs[i] = t < n ? x[static_cast<int64_t>(kk) * xs_k + static_cast<int64_t>(t) * xs_n] : from_f<T>(0.0f);
    }
  }
  __syncthreads();

  float acc[R][NT];
#pragma unroll
  for (int q = 0; q < R; ++q)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[q][t] = 0.0f;
  while (j < end) {
    const int j2 = j + 2 * kStep;
    Words<16> vc;
    Words<V * sizeof(I)> ic;
    if (j2 < end) {
      vc.load(values + j2);
      ic.load(cols + j2);
    }
    float s[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) s[t] = 0.0f;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const float a = word_elem<T>(va.w, v);
      float xv[NT];
      read_xrow<T, NT>(xs + word_index<I>(ia.w, v) * NT, xv);
#pragma unroll
      for (int t = 0; t < NT; ++t) s[t] = fmaf(a, xv[t], s[t]);
    }
    if constexpr (R == 1) {
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[0][t] += s[t];
    } else {
      int r = 0;
#pragma unroll
      for (int q = 1; q < R; ++q) r += j >= bnd[q];
#pragma unroll
      for (int q = 0; q < R; ++q)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[q][t] += q == r ? s[t] : 0.0f;
    }
    va = vb;
    ia = ib;
    vb = vc;
    ib = ic;
    j += kStep;
  }
  prunekit_launch::allow_dependent_launch();  // the next kernel may start its own prologue during this epilogue

  float mine[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) mine[t] = 0.0f;
#pragma unroll
  for (int q = 0; q < R; ++q) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[q][t] += __shfl_xor_sync(0xffffffffu, acc[q][t], o);
      if (lane == q) mine[t] = acc[q][t];
    }
  }
  if (lane < rows) {
    const int row = r0 + lane;
    const float b = bias != nullptr ? to_f(bias[row]) : 0.0f;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < n) {
        y[static_cast<int64_t>(row) * ys_m + static_cast<int64_t>(t) * ys_n] = from_f<T>(epilogue(mine[t], b, relu));
      }
    }
  }
}

prunekit_launch::DeviceProps device_info() {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  return prunekit_launch::device_props(dev);
}

template <typename T, typename I, int R, int NT>
void launch_spmv(const prunekit_launch::DeviceProps& info, const prunekit_launch::RowGrid& g, int64_t smem,
                 const T* values, const int* row_offsets, const I* cols, const T* x, int64_t xs_k, int64_t xs_n, T* y,
                 int64_t ys_m, int64_t ys_n, const T* bias, bool relu, int m, int n, int k, bool x_vec) {
  auto kernel = spmv_csr_kernel<T, I, R, NT>;
  if (smem > 48 * 1024) {
    static bool configured[64] = {};
    prunekit_launch::raise_smem_limit(kernel, kSpmvMaxSmem, configured);
  }
  const bool pdl = info.major >= 9 && !prunekit_launch::env_off("PRUNEKIT_SPMV_PDL");
  prunekit_launch::launch(kernel, dim3(g.blocks), dim3(g.threads), static_cast<size_t>(smem),
                          c10::cuda::getCurrentCUDAStream(), pdl, values, row_offsets, cols, x, xs_k, xs_n, y, ys_m,
                          ys_n, bias, relu, m, n, k, x_vec);
}

// spmv_takes on known device properties.
bool takes(const prunekit_launch::DeviceProps& info, int64_t m, int64_t k, int64_t n, int64_t esize) {
  if (prunekit_launch::env_off("PRUNEKIT_SPMV") || k <= 0 || n < 1 || n > kSpmvMaxTile) return false;
  if (n == 1) return k * esize <= std::min<int64_t>(kSpmvMaxSmem, info.max_smem);
  return k * kSpmvMaxTile * esize <= kSpmvTileMaxSmem && m >= static_cast<int64_t>(kSpmvTileMinRowsPerSm) * info.sms;
}

}  // namespace

bool spmv_takes(int64_t m, int64_t k, int64_t n, int64_t esize) { return takes(device_info(), m, k, n, esize); }

template <typename T, typename I, int NT>
bool spmv_csr(const T* values, const int* row_offsets, const I* cols, const T* x, int64_t xs_k, int64_t xs_n, T* y,
              int64_t ys_m, int64_t ys_n, const T* bias, bool relu, int m, int n, int k) {
  static_assert(NT == 1 || NT == kSpmvMaxTile, "token tiles of 1 or 4");
  const prunekit_launch::DeviceProps info = device_info();
  if (n > NT || !takes(info, m, k, n, sizeof(T))) return false;
  const int64_t smem = ((static_cast<int64_t>(k) * NT * static_cast<int64_t>(sizeof(T)) + 15) / 16) * 16;
  constexpr int V = 16 / sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && k % V == 0;
  const bool x_vec = NT == 1 ? aligned && xs_k == 1 : xs_k == 1;  // NT > 1: element loads along K, coalesced
  // Blocks per SM of the wave: kSpmvMinBlocksPerSm, fewer where the copy of X limits them (1 KB reserved per block).
  // At most 4 rows per warp with the token tile, for the registers of the R x NT sums.
  const int blocks_per_sm = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(kSpmvMinBlocksPerSm, info.smem_per_sm / (smem + 1024))));
  constexpr int kMaxR = NT == 1 ? 8 : 4;
  const prunekit_launch::RowGrid g = prunekit_launch::row_grid(m, info.sms, blocks_per_sm, kMaxR);
#define PRUNEKIT_SPMV_GO(RR)                                                                                        \
  launch_spmv<T, I, (RR <= kMaxR ? RR : kMaxR), NT>(info, g, smem, values, row_offsets, cols, x, xs_k, xs_n, y, ys_m, \
                                                    ys_n, bias, relu, m, n, k, x_vec)
  switch (g.rows_per_warp) {
    case 1: PRUNEKIT_SPMV_GO(1); break;
    case 2: PRUNEKIT_SPMV_GO(2); break;
    case 4: PRUNEKIT_SPMV_GO(4); break;
    default: PRUNEKIT_SPMV_GO(8); break;
  }
#undef PRUNEKIT_SPMV_GO
  return true;
}

#define PRUNEKIT_SPMV_INSTANCE(T, I, NT)                                                                         \
  template bool spmv_csr<T, I, NT>(const T*, const int*, const I*, const T*, int64_t, int64_t, T*, int64_t, int64_t, \
                                   const T*, bool, int, int, int);
#define PRUNEKIT_SPMV_INSTANCES(T, I) \
  PRUNEKIT_SPMV_INSTANCE(T, I, 1)     \
  PRUNEKIT_SPMV_INSTANCE(T, I, 4)
PRUNEKIT_SPMV_INSTANCES(float, int16_t)
PRUNEKIT_SPMV_INSTANCES(float, int32_t)
PRUNEKIT_SPMV_INSTANCES(__half, int16_t)
PRUNEKIT_SPMV_INSTANCES(__half, int32_t)
PRUNEKIT_SPMV_INSTANCES(__nv_bfloat16, int16_t)
PRUNEKIT_SPMV_INSTANCES(__nv_bfloat16, int32_t)
#undef PRUNEKIT_SPMV_INSTANCES
#undef PRUNEKIT_SPMV_INSTANCE

}  // namespace prunekit
