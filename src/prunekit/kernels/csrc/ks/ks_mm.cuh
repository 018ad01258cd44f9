// Kronecker-sparse matmul Y = act(K X + bias) for one factor K with pattern (a, b, c, d) stored as blocks
// (a, d, b, c) (Gonon et al. 2024, "Fast inference with Kronecker-sparse matrices", arXiv 2405.15013, sections 2
// and 4). Every (alpha, delta) pair is one dense b x c tile W_g (g = alpha * d + delta) that multiplies the rows
// (alpha * c + gamma) * d + delta of X, gamma < c, and writes the rows (alpha * b + beta) * d + delta of Y. X and Y are
// read and written in place through their strides (batch-last: row-major, batch-first: column-major views), so no
// permutation pass is needed: a CTA computes a BM x BN tile of one group's GEMM Y_g (b x N) = W_g (b x c) X_g (c x N),
// gathering the strided rows of X_g into shared memory.
//
// - fp16 / bf16: tensor cores through WMMA 16x16x16 fragments with fp32 accumulators; BM in {64, 128}, BN = 128,
//   BK = 32, 8 warps; 16-byte loads where the layout allows (W rows when c % 8 == 0; X rows in batch-last when the
//   leading dimension is a multiple of 8; 8 gammas of a token in batch-first when d == 1, c % 8 == 0 and the
//   leading dimension is a multiple of 8), guarded scalar loads elsewhere (ragged b, c, N, strided gathers).
// - fp32: CUDA-core FMAs, 128 x 128 x 8 tiles, 8 x 8 outputs per thread.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cstdint>

namespace prunekit_ks {

struct KsArgs {
  const void* w;     // (a, d, b, c) contiguous
  const void* x;     // x[k * sxk + n * sxn], k < a*c*d, n < N
  void* y;           // y[m * sym + n * syn], m < a*b*d
  const void* bias;  // (a*b*d,) contiguous, or nullptr
  int64_t sxk, sxn, sym, syn;
  int a, b, c, d, n;
  int relu;
};

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__device__ __forceinline__ T zero_value() { return from_float<T>(0.0f); }

// ---------------------------------------------------------------------------------------------------------------
// Tensor-core kernel (fp16 / bf16)
// ---------------------------------------------------------------------------------------------------------------

constexpr int TC_BN = 128;
constexpr int TC_BK = 32;
constexpr int TC_THREADS = 256;
constexpr int TC_PAD = 8;  // keeps 16-byte rows and 32-byte fragment alignment, breaks bank conflicts

template <typename T, int BM>
__global__ void __launch_bounds__(TC_THREADS) ks_mm_tc_kernel(KsArgs args, int vec_w, int vec_x) {
  using namespace nvcuda;
  constexpr int WARPS_M = BM / 32;
  constexpr int WARPS_N = 8 / WARPS_M;
  constexpr int WN = TC_BN / WARPS_N;
  constexpr int FRAG_M = 2;
  constexpr int FRAG_N = WN / 16;
  constexpr int LDA = TC_BK + TC_PAD;
  constexpr int LDB = TC_BN + TC_PAD;

  __shared__ __align__(128) T a_s[BM * LDA];
  __shared__ __align__(128) T b_s[TC_BK * LDB];
  __shared__ __align__(128) float stage[8][16 * 16];

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
  const int g = blockIdx.x;
  const int alpha = g / args.d, delta = g % args.d;
  const int n0 = blockIdx.y * TC_BN;
  const int beta0 = blockIdx.z * BM;
  const int b = args.b, c = args.c, d = args.d, n_total = args.n;

  const T* w_g = static_cast<const T*>(args.w) + static_cast<int64_t>(g) * b * c;
  const T* x = static_cast<const T*>(args.x);
  // X row of (gamma) for this group: (alpha * c + gamma) * d + delta
  const int64_t x_row0 = static_cast<int64_t>(alpha) * c * d + delta;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FRAG_M][FRAG_N];
#pragma unroll
  for (int i = 0; i < FRAG_M; ++i)
#pragma unroll
    for (int j = 0; j < FRAG_N; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  for (int k0 = 0; k0 < c; k0 += TC_BK) {
    // ---- W tile: BM x BK, row-major (beta, gamma)
    if (vec_w) {
      constexpr int VECS = BM * TC_BK / 8;
#pragma unroll
      for (int v = tid; v < VECS; v += TC_THREADS) {
        const int r = v / (TC_BK / 8), kv = (v % (TC_BK / 8)) * 8;
        const int beta = beta0 + r, gamma = k0 + kv;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (beta < b && gamma < c) {  // c % 8 == 0: a vector is all in or all out
          val = *reinterpret_cast<const uint4*>(w_g + static_cast<int64_t>(beta) * c + gamma);
        }
        *reinterpret_cast<uint4*>(a_s + r * LDA + kv) = val;
      }
    } else {
#pragma unroll 4
      for (int e = tid; e < BM * TC_BK; e += TC_THREADS) {
        const int r = e / TC_BK, kk = e % TC_BK;
        const int beta = beta0 + r, gamma = k0 + kk;
        a_s[r * LDA + kk] = (beta < b && gamma < c) ? w_g[static_cast<int64_t>(beta) * c + gamma] : zero_value<T>();
      }
    }
    // ---- X tile: BK x BN, row-major (gamma, n)
    if (vec_x == 1) {  // batch-last, 16-byte aligned rows
      constexpr int VECS = TC_BK * TC_BN / 8;
#pragma unroll
      for (int v = tid; v < VECS; v += TC_THREADS) {
        const int kk = v / (TC_BN / 8), nv = (v % (TC_BN / 8)) * 8;
        const int gamma = k0 + kk, n = n0 + nv;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (gamma < c) {
          const T* src = x + (x_row0 + static_cast<int64_t>(gamma) * d) * args.sxk + n;
          if (n + 8 <= n_total) {
            val = *reinterpret_cast<const uint4*>(src);
          } else {
            __align__(16) T tmp[8];
#pragma unroll
            for (int t = 0; t < 8; ++t) tmp[t] = (n + t < n_total) ? src[t] : zero_value<T>();
            val = *reinterpret_cast<const uint4*>(tmp);
          }
        }
        *reinterpret_cast<uint4*>(b_s + kk * LDB + nv) = val;
      }
    } else if (vec_x == 2) {  // batch-first, d == 1, c % 8 == 0: 8 consecutive gammas of one token per load
      constexpr int VECS = TC_BK * TC_BN / 8;
#pragma unroll
      for (int v = tid; v < VECS; v += TC_THREADS) {
        const int nn = v / (TC_BK / 8), kv = (v % (TC_BK / 8)) * 8;
        const int gamma = k0 + kv, n = n0 + nn;
        __align__(16) T tmp[8];
        if (gamma < c && n < n_total) {
          *reinterpret_cast<uint4*>(tmp) =
              *reinterpret_cast<const uint4*>(x + x_row0 + gamma + static_cast<int64_t>(n) * args.sxn);
        } else {
          *reinterpret_cast<uint4*>(tmp) = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int t = 0; t < 8; ++t) b_s[(kv + t) * LDB + nn] = tmp[t];
      }
    } else if (args.sxn == 1) {  // batch-last, unaligned: consecutive threads along n
#pragma unroll 4
      for (int e = tid; e < TC_BK * TC_BN; e += TC_THREADS) {
        const int kk = e / TC_BN, nn = e % TC_BN;
        const int gamma = k0 + kk, n = n0 + nn;
        b_s[kk * LDB + nn] = (gamma < c && n < n_total)
                                 ? x[(x_row0 + static_cast<int64_t>(gamma) * d) * args.sxk + n]
                                 : zero_value<T>();
      }
    } else {  // batch-first (or any other strides): consecutive threads along gamma
#pragma unroll 4
      for (int e = tid; e < TC_BK * TC_BN; e += TC_THREADS) {
        const int kk = e % TC_BK, nn = e / TC_BK;
        const int gamma = k0 + kk, n = n0 + nn;
        b_s[kk * LDB + nn] = (gamma < c && n < n_total)
                                 ? x[(x_row0 + static_cast<int64_t>(gamma) * d) * args.sxk +
                                     static_cast<int64_t>(n) * args.sxn]
                                 : zero_value<T>();
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < TC_BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[FRAG_M];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb[FRAG_N];
#pragma unroll
      for (int i = 0; i < FRAG_M; ++i) wmma::load_matrix_sync(fa[i], a_s + (warp_m * 32 + i * 16) * LDA + kk, LDA);
#pragma unroll
      for (int j = 0; j < FRAG_N; ++j) wmma::load_matrix_sync(fb[j], b_s + kk * LDB + warp_n * WN + j * 16, LDB);
#pragma unroll
      for (int i = 0; i < FRAG_M; ++i)
#pragma unroll
        for (int j = 0; j < FRAG_N; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }

  // ---- epilogue: fragment -> per-warp stage -> global with bias, ReLU, conversion
  T* y = static_cast<T*>(args.y);
  const T* bias = static_cast<const T*>(args.bias);
  const bool rows_contiguous = args.sym == 1;  // batch-first output: consecutive lanes along beta
  float* st = stage[warp];
#pragma unroll
  for (int i = 0; i < FRAG_M; ++i) {
#pragma unroll
    for (int j = 0; j < FRAG_N; ++j) {
      wmma::store_matrix_sync(st, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        const int e = lane + t * 32;
        const int r = rows_contiguous ? e % 16 : e / 16;
        const int cc = rows_contiguous ? e / 16 : e % 16;
        const int beta = beta0 + warp_m * 32 + i * 16 + r;
        const int n = n0 + warp_n * WN + j * 16 + cc;
        if (beta < b && n < n_total) {
          const int64_t m = (static_cast<int64_t>(alpha) * b + beta) * d + delta;
          float v = st[r * 16 + cc];
          if (bias != nullptr) v += to_float<T>(bias[m]);
          if (args.relu) v = fmaxf(v, 0.0f);
          y[m * args.sym + static_cast<int64_t>(n) * args.syn] = from_float<T>(v);
        }
      }
      __syncwarp();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// CUDA-core kernel (fp32): 128 x 128 x 8 tiles, 8 x 8 outputs per thread
// ---------------------------------------------------------------------------------------------------------------

constexpr int F_BM = 128;
constexpr int F_BN = 128;
constexpr int F_BK = 8;
constexpr int F_THREADS = 256;

__global__ void __launch_bounds__(F_THREADS, 2) ks_mm_f32_kernel(KsArgs args) {
  __shared__ __align__(16) float a_s[F_BK][F_BM + 4];  // transposed: (gamma, beta)
  __shared__ __align__(16) float b_s[F_BK][F_BN + 4];

  const int tid = threadIdx.x;
  const int tx = tid % 16, ty = tid / 16;
  const int g = blockIdx.x;
  const int alpha = g / args.d, delta = g % args.d;
  const int n0 = blockIdx.y * F_BN;
  const int beta0 = blockIdx.z * F_BM;
  const int b = args.b, c = args.c, d = args.d, n_total = args.n;
  const float* w_g = static_cast<const float*>(args.w) + static_cast<int64_t>(g) * b * c;
  const float* x = static_cast<const float*>(args.x);
  const int64_t x_row0 = static_cast<int64_t>(alpha) * c * d + delta;
  const bool batch_last = args.sxn == 1;

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

  for (int k0 = 0; k0 < c; k0 += F_BK) {
#pragma unroll
    for (int t = 0; t < (F_BM * F_BK) / F_THREADS; ++t) {
      const int e = tid + t * F_THREADS;
      const int kk = e % F_BK, r = e / F_BK;
      const int beta = beta0 + r, gamma = k0 + kk;
      a_s[kk][r] = (beta < b && gamma < c) ? w_g[static_cast<int64_t>(beta) * c + gamma] : 0.0f;
    }
#pragma unroll
    for (int t = 0; t < (F_BK * F_BN) / F_THREADS; ++t) {
      const int e = tid + t * F_THREADS;
      const int kk = batch_last ? e / F_BN : e % F_BK;
      const int nn = batch_last ? e % F_BN : e / F_BK;
      const int gamma = k0 + kk, n = n0 + nn;
      b_s[kk][nn] = (gamma < c && n < n_total) ? x[(x_row0 + static_cast<int64_t>(gamma) * d) * args.sxk +
                                                   static_cast<int64_t>(n) * args.sxn]
                                               : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < F_BK; ++kk) {
      float ra[8], rb[8];
      const float4 a0 = *reinterpret_cast<const float4*>(&a_s[kk][ty * 4]);
      const float4 a1 = *reinterpret_cast<const float4*>(&a_s[kk][64 + ty * 4]);
      const float4 b0 = *reinterpret_cast<const float4*>(&b_s[kk][tx * 4]);
      const float4 b1 = *reinterpret_cast<const float4*>(&b_s[kk][64 + tx * 4]);
      ra[0] = a0.x, ra[1] = a0.y, ra[2] = a0.z, ra[3] = a0.w, ra[4] = a1.x, ra[5] = a1.y, ra[6] = a1.z, ra[7] = a1.w;
      rb[0] = b0.x, rb[1] = b0.y, rb[2] = b0.z, rb[3] = b0.w, rb[4] = b1.x, rb[5] = b1.y, rb[6] = b1.z, rb[7] = b1.w;
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(ra[i], rb[j], acc[i][j]);
    }
    __syncthreads();
  }

  float* y = static_cast<float*>(args.y);
  const float* bias = static_cast<const float*>(args.bias);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int beta = beta0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
    if (beta >= b) continue;
    const int64_t m = (static_cast<int64_t>(alpha) * b + beta) * d + delta;
    const float bv = bias != nullptr ? bias[m] : 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int n = n0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + (j - 4));
      if (n < n_total) {
        float v = acc[i][j] + bv;
        if (args.relu) v = fmaxf(v, 0.0f);
        y[m * args.sym + static_cast<int64_t>(n) * args.syn] = v;
      }
    }
  }
}

}  // namespace prunekit_ks
