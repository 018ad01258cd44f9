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
//   Two variants: one shared-memory stage (load, barrier, mma) or two stages with cp.async for the 16-byte paths
//   (the next k-step's tiles arrive while the tensor cores work on the current one).
// - fp32 (ks_mm.cu): CUDA-core FMAs, 128 x 128 x 8 tiles, 8 x 8 outputs per thread.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

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

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }

// One k-step's tiles: W (BM x BK, row-major (beta, gamma)) into a_dst and X (BK x BN, row-major (gamma, n)) into
// b_dst, zero-filled outside b, c and N. ASYNC: the 16-byte paths go through cp.async (completed by the caller's
// wait + barrier); the other paths are ordinary loads and stores in both modes.
template <typename T, int BM, bool ASYNC>
__device__ __forceinline__ void tc_load_tile(T* a_dst, T* b_dst, const KsArgs& args, const T* w_g, const T* x,
                                             int64_t x_row0, int beta0, int n0, int k0, int vec_w, int vec_x,
                                             int tid) {
  constexpr int LDA = TC_BK + TC_PAD;
  constexpr int LDB = TC_BN + TC_PAD;
  const int b = args.b, c = args.c, d = args.d, n_total = args.n;
  if (sizeof(T) == 2 && vec_w) {  // c % 8 == 0: a vector is all in or all out (16-bit types only)
    constexpr int VECS = BM * TC_BK / 8;
#pragma unroll
    for (int v = tid; v < VECS; v += TC_THREADS) {
      const int r = v / (TC_BK / 8), kv = (v % (TC_BK / 8)) * 8;
      const int beta = beta0 + r, gamma = k0 + kv;
      const bool in = beta < b && gamma < c;
      const T* src = in ? w_g + static_cast<int64_t>(beta) * c + gamma : w_g;
      if constexpr (ASYNC) {
        cp_async16(a_dst + r * LDA + kv, src, in ? 16 : 0);
      } else {
        *reinterpret_cast<uint4*>(a_dst + r * LDA + kv) =
            in ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
      }
    }
  } else {
#pragma unroll 4
    for (int e = tid; e < BM * TC_BK; e += TC_THREADS) {
      const int r = e / TC_BK, kk = e % TC_BK;
      const int beta = beta0 + r, gamma = k0 + kk;
      a_dst[r * LDA + kk] = (beta < b && gamma < c) ? w_g[static_cast<int64_t>(beta) * c + gamma] : zero_value<T>();
    }
  }
  if (sizeof(T) == 2 && vec_x == 1) {  // batch-last, 16-byte aligned rows
    constexpr int VECS = TC_BK * TC_BN / 8;
#pragma unroll
    for (int v = tid; v < VECS; v += TC_THREADS) {
      const int kk = v / (TC_BN / 8), nv = (v % (TC_BN / 8)) * 8;
      const int gamma = k0 + kk, n = n0 + nv;
      const int valid = gamma < c ? max(0, min(8, n_total - n)) : 0;
      const T* src = valid > 0 ? x + (x_row0 + static_cast<int64_t>(gamma) * d) * args.sxk + n : x;
      if constexpr (ASYNC) {
        cp_async16(b_dst + kk * LDB + nv, src, valid * static_cast<int>(sizeof(T)));
      } else {
        __align__(16) T tmp[8];
        if (valid == 8) {
          *reinterpret_cast<uint4*>(tmp) = *reinterpret_cast<const uint4*>(src);
        } else {
#pragma unroll
          for (int t = 0; t < 8; ++t) tmp[t] = t < valid ? src[t] : zero_value<T>();
        }
        *reinterpret_cast<uint4*>(b_dst + kk * LDB + nv) = *reinterpret_cast<const uint4*>(tmp);
      }
    }
  } else if (sizeof(T) == 2 && vec_x == 2) {  // batch-first, d == 1, c % 8 == 0: 8 consecutive gammas per load
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
      for (int t = 0; t < 8; ++t) b_dst[(kv + t) * LDB + nn] = tmp[t];
    }
  } else if (args.sxn == 1) {  // batch-last, unaligned: consecutive threads along n
#pragma unroll 4
    for (int e = tid; e < TC_BK * TC_BN; e += TC_THREADS) {
      const int kk = e / TC_BN, nn = e % TC_BN;
      const int gamma = k0 + kk, n = n0 + nn;
      b_dst[kk * LDB + nn] = (gamma < c && n < n_total)
                                 ? x[(x_row0 + static_cast<int64_t>(gamma) * d) * args.sxk + n]
                                 : zero_value<T>();
    }
  } else {  // batch-first (or any other strides): consecutive threads along gamma
#pragma unroll 4
    for (int e = tid; e < TC_BK * TC_BN; e += TC_THREADS) {
      const int kk = e % TC_BK, nn = e / TC_BK;
      const int gamma = k0 + kk, n = n0 + nn;
      b_dst[kk * LDB + nn] = (gamma < c && n < n_total) ? x[(x_row0 + static_cast<int64_t>(gamma) * d) * args.sxk +
                                                            static_cast<int64_t>(n) * args.sxn]
                                                        : zero_value<T>();
    }
  }
}

// 3xTF32 split of a tf32 fragment loaded from fp32 values: hi = tf32(v), lo = tf32(v - hi); hi*hi + hi*lo + lo*hi
// accumulated in fp32 keeps fp32-level accuracy (the lo*lo term, ~2^-22 relative, is dropped; the "3xTF32" of
// NVIDIA's CUTLASS; Ootomo and Yokota 2022, "Recovering single precision accuracy from Tensor Cores while surpassing
// the FP32 theoretical peak performance").
template <typename Frag>
__device__ __forceinline__ void split_tf32(Frag& hi, Frag& lo) {
#pragma unroll
  for (int t = 0; t < hi.num_elements; ++t) {
    const float v = hi.x[t];
    const float h = nvcuda::wmma::__float_to_tf32(v);
    hi.x[t] = h;
    lo.x[t] = nvcuda::wmma::__float_to_tf32(v - h);
  }
}

// T = __half / __nv_bfloat16: WMMA 16 x 16 x 16; T = float: 3xTF32 (launch_tf32x3: BM = 64, one stage, scalar loads).
// PIPE: two shared-memory stages, the next k-step's tiles loaded (cp.async where 16-byte) while the tensor cores
// work on the current one; else one stage, load -> barrier -> mma -> barrier.
template <typename T, int BM, bool PIPE>
// (fp32, 3xTF32: 128 registers with 20 bytes of spills under this bound; bounded at one CTA per SM it took 208
// registers and no spills: which is faster is not measured)
__global__ void __launch_bounds__(TC_THREADS, 2) ks_mm_tc_kernel(KsArgs args, int vec_w, int vec_x) {
  using namespace nvcuda;
  constexpr int WARPS_M = BM / 32;
  constexpr int WARPS_N = 8 / WARPS_M;
  constexpr int WN = TC_BN / WARPS_N;
  constexpr int FRAG_M = 2;
  constexpr int FRAG_N = WN / 16;
  constexpr int LDA = TC_BK + TC_PAD;
  constexpr int LDB = TC_BN + TC_PAD;
  constexpr int STAGES = PIPE ? 2 : 1;

  __shared__ __align__(128) T a_s[STAGES][BM * LDA];
  __shared__ __align__(128) T b_s[STAGES][TC_BK * LDB];
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

  // T = float: 3xTF32 (16 x 16 x 8 tf32 fragments, each operand split into hi + lo, see split_tf32)
  constexpr bool TF32X3 = std::is_same<T, float>::value;
  using AccFrag = typename std::conditional<TF32X3, wmma::fragment<wmma::accumulator, 16, 16, 8, float>,
                                            wmma::fragment<wmma::accumulator, 16, 16, 16, float>>::type;
  AccFrag acc[FRAG_M][FRAG_N];
#pragma unroll
  for (int i = 0; i < FRAG_M; ++i)
#pragma unroll
    for (int j = 0; j < FRAG_N; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  auto mma_tile = [&](const T* as, const T* bs) {
    if constexpr (TF32X3) {
      // The tensor cores' fp32 accumulation truncates (round toward zero): summed into acc over all of c, its bias
      // grows with c (relative error 1.35e-5 against float64 for c = 903 on the H100). So the three products of each
      // 8-deep step go into a zeroed partial sum, added to acc with an ordinary round-to-nearest fp32 add (Ootomo and
      // Yokota 2022: avoiding RZ accumulation); the partial sums' own truncation errors then have random signs. One
      // partial fragment at a time: a tile's worth of them would spill at this kernel's 128-register bound.
#pragma unroll
      for (int kk = 0; kk < TC_BK; kk += 8) {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a_hi[FRAG_M], a_lo[FRAG_M];
#pragma unroll
        for (int i = 0; i < FRAG_M; ++i) {
          wmma::load_matrix_sync(a_hi[i], as + (warp_m * 32 + i * 16) * LDA + kk, LDA);
          split_tf32(a_hi[i], a_lo[i]);
        }
#pragma unroll
        for (int j = 0; j < FRAG_N; ++j) {  // one B fragment pair live at a time (registers)
          wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> b_hi, b_lo;
          wmma::load_matrix_sync(b_hi, bs + kk * LDB + warp_n * WN + j * 16, LDB);
          split_tf32(b_hi, b_lo);
#pragma unroll
          for (int i = 0; i < FRAG_M; ++i) {  // small terms first
            AccFrag part;
            wmma::fill_fragment(part, 0.0f);
            wmma::mma_sync(part, a_lo[i], b_hi, part);
            wmma::mma_sync(part, a_hi[i], b_lo, part);
            wmma::mma_sync(part, a_hi[i], b_hi, part);
#pragma unroll
            for (int t = 0; t < part.num_elements; ++t) acc[i][j].x[t] = __fadd_rn(acc[i][j].x[t], part.x[t]);
          }
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < TC_BK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[FRAG_M];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb[FRAG_N];
#pragma unroll
        for (int i = 0; i < FRAG_M; ++i) wmma::load_matrix_sync(fa[i], as + (warp_m * 32 + i * 16) * LDA + kk, LDA);
#pragma unroll
        for (int j = 0; j < FRAG_N; ++j) wmma::load_matrix_sync(fb[j], bs + kk * LDB + warp_n * WN + j * 16, LDB);
#pragma unroll
        for (int i = 0; i < FRAG_M; ++i)
#pragma unroll
          for (int j = 0; j < FRAG_N; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
      }
    }
  };

  const int k_steps = (c + TC_BK - 1) / TC_BK;
  if constexpr (PIPE) {
    tc_load_tile<T, BM, true>(a_s[0], b_s[0], args, w_g, x, x_row0, beta0, n0, 0, vec_w, vec_x, tid);
    cp_async_commit();
    for (int kt = 0; kt < k_steps; ++kt) {
      const int cur = kt & 1;
      if (kt + 1 < k_steps) {
        tc_load_tile<T, BM, true>(a_s[cur ^ 1], b_s[cur ^ 1], args, w_g, x, x_row0, beta0, n0, (kt + 1) * TC_BK,
                                  vec_w, vec_x, tid);
      }
      cp_async_commit();  // possibly empty: keeps "all but the newest group" = this step's tiles
      cp_async_wait_one();
      __syncthreads();
      mma_tile(a_s[cur], b_s[cur]);
      __syncthreads();
    }
  } else {
    for (int kt = 0; kt < k_steps; ++kt) {
      tc_load_tile<T, BM, false>(a_s[0], b_s[0], args, w_g, x, x_row0, beta0, n0, kt * TC_BK, vec_w, vec_x, tid);
      __syncthreads();
      mma_tile(a_s[0], b_s[0]);
      __syncthreads();
    }
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
// Batch-first delta-block kernel (fp16 / bf16): for batch-first X (x2d (N, a*c*d) row-major, read as X = x2d.t())
// the rows of one group X_g are d elements apart inside a token's row, so the one-group kernel above gathers them
// with 2-byte loads, each touching its own 32-byte sector once d >= 16 (and writes Y the same way). This kernel
// gives a CTA DT consecutive deltas of one alpha (DT = 8, 4 or 2, dividing d): for a token n and a gamma, the DT
// deltas' X values are one aligned vector of DT elements (16, 8 or 4 bytes), and so are the DT outputs of a
// (beta, n). The 8 warps: warp w computes group (alpha, delta0 + w % DT) on the token columns
// [(w / DT) * WN, + WN) of the CTA's DB_BN, WN = DB_BN * DT / 8, over the k loop (BK = 16, one shared-memory
// stage). The host checks d % DT == 0, x: sxk == 1, sxn % DT == 0; y: sym == 1, syn % DT == 0; X and Y aligned to
// DT elements, W 16-byte aligned.
// ---------------------------------------------------------------------------------------------------------------

constexpr int DB_BM = 64;  // rows of b per CTA
constexpr int DB_BN = 64;  // tokens per CTA
constexpr int DB_BK = 16;  // gammas per k-step
constexpr int DB_LDA = DB_BK + 8;
constexpr int DB_LDB = DB_BN + 8;

template <int BYTES>
struct VecOf;
template <>
struct VecOf<16> { using type = uint4; };
template <>
struct VecOf<8> { using type = uint2; };
template <>
struct VecOf<4> { using type = uint32_t; };

template <typename T, int DT>
__global__ void __launch_bounds__(TC_THREADS, 1) ks_mm_tc_dblock_kernel(KsArgs args, int vec_w) {
  using namespace nvcuda;
  using Vec = typename VecOf<DT * sizeof(T)>::type;
  constexpr int WPD = 8 / DT;           // warps per delta
  constexpr int WN = DB_BN / WPD;       // token columns per warp
  constexpr int FRAG_N = WN / 16;
  // W tiles (DT x BM x LDA) and X tiles (DT x BK x LDB); after the k loop the same bytes hold the epilogue's
  // per-warp 16 x 16 fp32 stages.
  constexpr int A_ELEMS = DT * DB_BM * DB_LDA;
  constexpr int B_ELEMS = DT * DB_BK * DB_LDB;
  static_assert((A_ELEMS + B_ELEMS) * sizeof(T) >= 8 * 256 * sizeof(float), "epilogue stage must fit");
  __shared__ __align__(128) T smem[A_ELEMS + B_ELEMS];
  T* a_s = smem;
  T* b_s = smem + A_ELEMS;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int di = warp % DT, sub = warp / DT;
  const int b = args.b, c = args.c, d = args.d, n_total = args.n;
  const int blocks_per_alpha = d / DT;
  const int alpha = blockIdx.x / blocks_per_alpha;
  const int delta0 = (blockIdx.x % blocks_per_alpha) * DT;
  const int n0 = blockIdx.y * DB_BN;
  const int beta0 = blockIdx.z * DB_BM;
  const T* w = static_cast<const T*>(args.w);
  const T* x = static_cast<const T*>(args.x);
  // group of delta0 + i: g = alpha * d + delta0 + i; its W tile starts at w + g * b * c
  const int64_t g0 = static_cast<int64_t>(alpha) * d + delta0;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[DB_BM / 16][FRAG_N];
#pragma unroll
  for (int i = 0; i < DB_BM / 16; ++i)
#pragma unroll
    for (int j = 0; j < FRAG_N; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const int k_steps = (c + DB_BK - 1) / DB_BK;
  for (int kt = 0; kt < k_steps; ++kt) {
    const int k0 = kt * DB_BK;
    // X: one vector per (token, gamma) = the DT deltas; consecutive threads along gamma (same token)
#pragma unroll
    for (int v = tid; v < DB_BN * DB_BK; v += TC_THREADS) {
      const int kk = v % DB_BK, nn = v / DB_BK;
      const int gamma = k0 + kk, n = n0 + nn;
      union {
        Vec vec;
        T val[DT];
      } tmp;
      if (gamma < c && n < n_total) {
        tmp.vec = *reinterpret_cast<const Vec*>(
            x + static_cast<int64_t>(n) * args.sxn + (static_cast<int64_t>(alpha) * c + gamma) * d + delta0);
      } else {
#pragma unroll
        for (int i = 0; i < DT; ++i) tmp.val[i] = zero_value<T>();
      }
#pragma unroll
      for (int i = 0; i < DT; ++i) b_s[(i * DB_BK + kk) * DB_LDB + nn] = tmp.val[i];
    }
    // W: the DT groups' BM x BK tiles
    if (vec_w) {  // c % 8 == 0: 16-byte vectors of 8 gammas, all in or all out
#pragma unroll
      for (int v = tid; v < DT * DB_BM * (DB_BK / 8); v += TC_THREADS) {
        const int kv = (v % (DB_BK / 8)) * 8, r = (v / (DB_BK / 8)) % DB_BM, i = v / (DB_BM * (DB_BK / 8));
        const int beta = beta0 + r, gamma = k0 + kv;
        const bool in = beta < b && gamma < c;
        *reinterpret_cast<uint4*>(a_s + (i * DB_BM + r) * DB_LDA + kv) =
            in ? *reinterpret_cast<const uint4*>(w + (g0 + i) * b * c + static_cast<int64_t>(beta) * c + gamma)
               : make_uint4(0, 0, 0, 0);
      }
    } else {
#pragma unroll 4
      for (int e = tid; e < DT * DB_BM * DB_BK; e += TC_THREADS) {
        const int kk = e % DB_BK, r = (e / DB_BK) % DB_BM, i = e / (DB_BM * DB_BK);
        const int beta = beta0 + r, gamma = k0 + kk;
        a_s[(i * DB_BM + r) * DB_LDA + kk] =
            (beta < b && gamma < c) ? w[(g0 + i) * b * c + static_cast<int64_t>(beta) * c + gamma] : zero_value<T>();
      }
    }
    __syncthreads();
    {  // warp (di, sub) multiplies its group's tiles: (BM x 16) x (16 x WN)
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[DB_BM / 16];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
#pragma unroll
      for (int i = 0; i < DB_BM / 16; ++i) wmma::load_matrix_sync(fa[i], a_s + (di * DB_BM + i * 16) * DB_LDA, DB_LDA);
#pragma unroll
      for (int j = 0; j < FRAG_N; ++j) {
        wmma::load_matrix_sync(fb, b_s + (di * DB_BK) * DB_LDB + sub * WN + j * 16, DB_LDB);
#pragma unroll
        for (int i = 0; i < DB_BM / 16; ++i) wmma::mma_sync(acc[i][j], fa[i], fb, acc[i][j]);
      }
    }
    __syncthreads();
  }

  // ---- epilogue: per 16 x 16 fragment, each warp stages its values; then the DT deltas of one (beta, n) go out as
  // one vector of Y (batch-first: y[m + n * syn], m = (alpha*b + beta)*d + delta0 + i); stage[warp] holds the
  // values of delta0 + warp % DT at columns (warp / DT) * WN + j*16 + cc
  float* stage = reinterpret_cast<float*>(smem);  // (8 warps, 16, 16)
  T* y = static_cast<T*>(args.y);
  const T* bias = static_cast<const T*>(args.bias);
#pragma unroll
  for (int i = 0; i < DB_BM / 16; ++i) {
#pragma unroll
    for (int j = 0; j < FRAG_N; ++j) {
      wmma::store_matrix_sync(stage + warp * 256, acc[i][j], 16, wmma::mem_row_major);
      __syncthreads();
#pragma unroll
      for (int q = 0; q < WPD; ++q) {
        const int idx = tid + q * TC_THREADS;  // (s, r, cc): s = warp column block, r = row, cc = column
        const int s_blk = idx / 256, r = (idx % 256) / 16, cc = idx % 16;
        const int beta = beta0 + i * 16 + r, n = n0 + s_blk * WN + j * 16 + cc;
        if (beta < b && n < n_total) {
          const int64_t m0 = (static_cast<int64_t>(alpha) * b + beta) * d + delta0;
          union {
            Vec vec;
            T val[DT];
          } out;
#pragma unroll
          for (int k = 0; k < DT; ++k) {
            float v = stage[(s_blk * DT + k) * 256 + r * 16 + cc];
            if (bias != nullptr) v += to_float<T>(bias[m0 + k]);
            if (args.relu) v = fmaxf(v, 0.0f);
            out.val[k] = from_float<T>(v);
          }
          *reinterpret_cast<Vec*>(y + m0 + static_cast<int64_t>(n) * args.syn) = out.vec;
        }
      }
      __syncthreads();
    }
  }
}

// Deltas per CTA of the delta-block kernel for this layout: the largest of 8, 4, 2 that divides d and the X / Y row
// strides, with X and Y aligned to that many elements (align_x, align_y: pointer alignment in elements); 0: none.
inline int dblock_width(int d, int64_t sxk, int64_t sxn, int64_t sym, int64_t syn, int align_x, int align_y) {
  if (sxk != 1 || sym != 1) return 0;
  for (int dt : {8, 4, 2}) {
    if (d % dt == 0 && sxn % dt == 0 && syn % dt == 0 && align_x % dt == 0 && align_y % dt == 0) return dt;
  }
  return 0;
}

// fp32 on tensor cores with 3xTF32 (ks_mm_tf32.cu): the host's entry passes pipelined == 3 for it.
void launch_tf32x3(const KsArgs& args, cudaStream_t stream);

// Host launcher of the tensor-core kernels (instantiated for __half in ks_mm_f16.cu and for __nv_bfloat16 in
// ks_mm_bf16.cu, so that the two compile in parallel). tile_rows: 64 or 128; pipelined: 0 or 1, or 2 for the
// batch-first delta-block kernel (tile_rows ignored; the caller checked its layout conditions).
template <typename T>
void launch_tc(const KsArgs& args, int tile_rows, int pipelined, int vec_w, int vec_x, cudaStream_t stream) {
  if (pipelined == 2) {  // vec_x carries the delta-block width (8, 4 or 2) chosen by the host
    const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(args.a) * (args.d / vec_x)),
                    static_cast<unsigned>((args.n + DB_BN - 1) / DB_BN), static_cast<unsigned>((args.b + DB_BM - 1) / DB_BM));
    if (vec_x == 8) {
      ks_mm_tc_dblock_kernel<T, 8><<<grid, TC_THREADS, 0, stream>>>(args, vec_w);
    } else if (vec_x == 4) {
      ks_mm_tc_dblock_kernel<T, 4><<<grid, TC_THREADS, 0, stream>>>(args, vec_w);
    } else {
      ks_mm_tc_dblock_kernel<T, 2><<<grid, TC_THREADS, 0, stream>>>(args, vec_w);
    }
    return;
  }
  const int64_t groups = static_cast<int64_t>(args.a) * args.d;
  const dim3 grid(static_cast<unsigned>(groups), static_cast<unsigned>((args.n + TC_BN - 1) / TC_BN),
                  static_cast<unsigned>((args.b + tile_rows - 1) / tile_rows));
  if (tile_rows == 128) {
    if (pipelined) {
      ks_mm_tc_kernel<T, 128, true><<<grid, TC_THREADS, 0, stream>>>(args, vec_w, vec_x);
    } else {
      ks_mm_tc_kernel<T, 128, false><<<grid, TC_THREADS, 0, stream>>>(args, vec_w, vec_x);
    }
  } else {
    if (pipelined) {
      ks_mm_tc_kernel<T, 64, true><<<grid, TC_THREADS, 0, stream>>>(args, vec_w, vec_x);
    } else {
      ks_mm_tc_kernel<T, 64, false><<<grid, TC_THREADS, 0, stream>>>(args, vec_w, vec_x);
    }
  }
}

}  // namespace prunekit_ks
