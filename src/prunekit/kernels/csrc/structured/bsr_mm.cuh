#pragma once
// Block-sparse (BSR) times dense matmul on tensor cores: Y = act(A @ X + bias), A (M, K) in BSR with r x c blocks.
//
// One CTA computes an r x BN tile of Y: one block row of A against BN columns of X, looping over the block row's
// non-zero blocks (or, with a static schedule, over one precomputed slice of them; PopSparse, Li et al. 2023).
// Per block, the r x c block (contiguous in memory) and the c x BN slab of X are staged into shared memory with
// cp.async (a STAGES-deep pipeline over blocks), read with ldmatrix and multiplied with mma.sync m16n8k16
// (fp16/bf16 in, fp32 accumulate). X is read "K-contiguous": X(k, n) at x[n * ldx + k], which is the transposed view
// x2d.t() that nn.Linear activations give (the launcher copies any other X into this layout). Y is written with
// runtime strides, so the (N, M) row-major output that layout.py asks for needs no copy.
//
// Static-schedule items whose block row was split over several items add fp32 partial sums into a workspace with
// atomics; bsr_finalize applies bias and activation to those rows and converts them.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include "../check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams
#include "../launch.cuh"  // the dynamic shared-memory limit

namespace prunekit_structured {

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

template <typename T>
struct Mma;
template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Tiling of one (r, c) block shape and N tile: CTA tile R x BN, warp tile WM x WN, STAGES-deep cp.async pipeline.
// BN = 32 is the decode-shape tile (N <= 32: less wasted mma work), 128 and 256 the large-N tiles (256 halves the
// re-reads of A blocks per output column; L2 traffic per flop is about 1/BN + 1/R bytes, see PERFORMANCE_STRUCTURED).
template <int R, int C, int BN_>
struct BsrConfig {
  static constexpr int BN = BN_;
  static constexpr int WM = (BN >= 128 && R >= 32) ? 32 : 16;
  static constexpr int WN = (BN >= 128 && R == 64) ? 64 : 32;
  static constexpr int WARPS_M = R / WM;
  static constexpr int WARPS_N = BN / WN;
  static constexpr int THREADS = WARPS_M * WARPS_N * 32;
  static constexpr int STAGES = C == 64 ? 3 : 4;
  static constexpr int PAD = 8;  // halves of padding per smem row: ldmatrix rows land in distinct banks
  static constexpr int LDS = C + PAD;
  static constexpr int A_ELEMS = R * LDS;
  static constexpr int B_ELEMS = BN * LDS;
  static constexpr int STAGE_ELEMS = A_ELEMS + B_ELEMS;
  static constexpr int SMEM_BYTES = STAGES * STAGE_ELEMS * 2;
};

struct BsrArgs {
  const void* blocks;        // (nblocks, R, C)
  const int* crow;           // (M/R + 1)
  const int* cols;           // (nblocks)
  const int4* schedule;      // (n_items) of (block_row, start, end, slot), or nullptr (dynamic mode)
  const void* x;             // X(k, n) at x[n * ldx + k]
  void* y;                   // Y(m, n) at y[m * sym + n * syn]
  const void* bias;          // (M) or nullptr
  float* ws;                 // (n_split, R, N) fp32 partial sums of split rows, or nullptr
  long long ldx, sym, syn;
  int n;
  int relu;
  int staged;  // epilogue: 0 scalar stores; 1 Y^T rows (sym == 1) and 2 Y rows (syn == 1) staged in smem, 16-byte stores
  long long xr_npad;  // > 0: x is the wgmma kernel's X slabs (bsr_x_slabs_kernel), tokens padded to this; else 0
  int pdl;            // host only: launch the wgmma kernels with programmatic dependent launch (bsr_pdl)
  // (bsr_wgmma_t_kernel's launch plan is in BsrTArgs, bsr_mm_wgmma.cuh: this struct's size is part of how nvcc
  // compiles the kernels that take it)
};

// Programmatic dependent launch of the lean decode and wgmma kernels: on sm_90 and newer unless $PRUNEKIT_BSR_PDL=0
// (read at each call; unset, "" or "1": on; another value raises). The kernels wait for the preceding kernel
// (griddepcontrol.wait) before they read or write anything.
inline bool bsr_pdl(int device) {
  const char* v = std::getenv("PRUNEKIT_BSR_PDL");
  PRUNEKIT_CHECK(v == nullptr || *v == '\0' || std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0,
                 "bsr_mm: $PRUNEKIT_BSR_PDL must be 0 or 1, got '", v, "'");
  return !(v != nullptr && std::strcmp(v, "0") == 0) && prunekit_launch::device_props(device).major >= 9;
}

// The work of this CTA: one schedule item (static mode: block row, block range, split-row slot or -1) or, without a
// schedule (dynamic mode), the whole block row blockIdx.x read from crow on the device.
struct BsrWork {
  int block_row, start, end, slot;
};
__device__ __forceinline__ BsrWork bsr_work_item(const BsrArgs& args) {
  if (args.schedule != nullptr) {
    const int4 item = args.schedule[blockIdx.x];
    return {item.x, item.y, item.z, item.w};
  }
  const int block_row = blockIdx.x;
  return {block_row, args.crow[block_row], args.crow[block_row + 1], -1};
}
// The same for work item `index` (bsr_wgmma_t_kernel, whose CTAs may take several); bsr_work_item is kept apart from
// it because the kernels that call it compile to other code through this one (cuobjdump -sass).
__device__ __forceinline__ BsrWork bsr_work_at(const BsrArgs& args, int index) {
  if (args.schedule != nullptr) {
    const int4 item = args.schedule[index];
    return {item.x, item.y, item.z, item.w};
  }
  return {index, args.crow[index], args.crow[index + 1], -1};
}

template <typename T, int R, int C, int BN_>
__global__ void __launch_bounds__(BsrConfig<R, C, BN_>::THREADS) bsr_mm_kernel(const BsrArgs args) {
  using Cfg = BsrConfig<R, C, BN_>;
  constexpr int BN = Cfg::BN, WM = Cfg::WM, WN = Cfg::WN, STAGES = Cfg::STAGES, LDS = Cfg::LDS;
  constexpr int MI = WM / 16, NI = WN / 8, THREADS = Cfg::THREADS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);

  const BsrWork work = bsr_work_item(args);
  const int block_row = work.block_row, start = work.start, end = work.end, slot = work.slot;
  const int n0 = blockIdx.y * BN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / Cfg::WARPS_N, warp_n = warp % Cfg::WARPS_N;
  const T* blocks = static_cast<const T*>(args.blocks);
  const T* x = static_cast<const T*>(args.x);

  auto load_stage = [&](int b, int stage) {
    T* as = smem + stage * Cfg::STAGE_ELEMS;
    T* bs = as + Cfg::A_ELEMS;
    const T* ablk = blocks + static_cast<long long>(b) * (R * C);
    constexpr int A_CHUNKS = R * C / 8;
#pragma unroll
    for (int i = tid; i < A_CHUNKS; i += THREADS) {
      const int row = i / (C / 8), col = (i % (C / 8)) * 8;
      cp_async16(as + row * LDS + col, ablk + row * C + col, true);
    }
    const long long k0 = static_cast<long long>(__ldg(args.cols + b)) * C;
    constexpr int B_CHUNKS = BN * C / 8;
#pragma unroll
    for (int i = tid; i < B_CHUNKS; i += THREADS) {
      const int nn = i / (C / 8), col = (i % (C / 8)) * 8;
      const bool ok = n0 + nn < args.n;
      const T* src = ok ? x + static_cast<long long>(n0 + nn) * args.ldx + k0 + col : x;
      cp_async16(bs + nn * LDS + col, src, ok);
    }
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  const int count = end - start;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < count) load_stage(start + s, s);
    cp_async_commit();
  }
  for (int it = 0; it < count; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int next = it + STAGES - 1;
    if (next < count) load_stage(start + next, next % STAGES);
    cp_async_commit();
    const T* as = smem + (it % STAGES) * Cfg::STAGE_ELEMS;
    const T* bs = as + Cfg::A_ELEMS;
#pragma unroll
    for (int kk = 0; kk < C; kk += 16) {
      uint32_t af[MI][4];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const int row = warp_m * WM + i * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
        const int col = kk + (lane >> 4) * 8;
        ldmatrix_x4(af[i], as + row * LDS + col);
      }
      uint32_t bf[NI / 2][4];
#pragma unroll
      for (int j = 0; j < NI / 2; ++j) {
        const int nn = warp_n * WN + j * 16 + (lane >> 4) * 8 + (lane & 7);
        const int col = kk + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(bf[j], bs + nn * LDS + col);
      }
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) Mma<T>::run(acc[i][j], af[i], bf[j / 2][(j & 1) * 2], bf[j / 2][(j & 1) * 2 + 1]);
    }
  }
  cp_async_wait<0>();

  const int g = lane >> 2, t = lane & 3;
  if (slot >= 0) {  // a slice of a split block row: fp32 partial sums, finished by bsr_finalize_kernel
    float* ws = args.ws + static_cast<long long>(slot) * R * args.n;
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = warp_m * WM + i * 16 + g + (e >> 1) * 8;
          const int nn = n0 + warp_n * WN + j * 8 + 2 * t + (e & 1);
          if (nn < args.n) atomicAdd(ws + static_cast<long long>(r) * args.n + nn, acc[i][j][e]);
        }
    return;
  }
  T* y = static_cast<T*>(args.y);
  const T* bias = static_cast<const T*>(args.bias);
  if (args.staged != 0) {
    // The CTA's R x BN output tile goes through shared memory (the pipeline buffers, free now) so that global stores
    // are 16-byte vectors along the output's unit-stride dimension: m for Y^T (the runtime's (N, M) output), n for Y.
    static_assert(BN_ * (R + 8) <= STAGES * Cfg::STAGE_ELEMS && R * (BN_ + 8) <= STAGES * Cfg::STAGE_ELEMS,
                  "output tile must fit in the pipeline's shared memory");
    const bool yt = args.staged == 1;
    const int ldc_n = yt ? R + 8 : 1, ldc_m = yt ? 1 : BN + 8;  // smem element (m, n) at m * ldc_m + n * ldc_n
    __syncthreads();  // every warp is done reading the pipeline buffers
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int ml = warp_m * WM + i * 16 + g + h * 8;
        const float b = bias != nullptr ? to_f(bias[block_row * R + ml]) : 0.f;
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int nl = warp_n * WN + j * 8 + 2 * t + e;
            float v = acc[i][j][h * 2 + e] + b;
            if (args.relu) v = fmaxf(v, 0.f);
            smem[ml * ldc_m + nl * ldc_n] = from_f<T>(v);
          }
      }
    __syncthreads();
    const long long m0 = static_cast<long long>(block_row) * R;
    if (yt) {
      constexpr int PER_ROW = R / 8;
      for (int cidx = tid; cidx < BN * PER_ROW; cidx += THREADS) {
        const int nl = cidx / PER_ROW, ml = (cidx % PER_ROW) * 8;
        if (n0 + nl < args.n)
          *reinterpret_cast<int4*>(y + static_cast<long long>(n0 + nl) * args.syn + m0 + ml) =
              *reinterpret_cast<const int4*>(smem + nl * (R + 8) + ml);
      }
    } else {
      constexpr int PER_ROW = BN / 8;
      for (int cidx = tid; cidx < R * PER_ROW; cidx += THREADS) {
        const int ml = cidx / PER_ROW, nl = (cidx % PER_ROW) * 8;
        T* dst = y + (m0 + ml) * args.sym + n0 + nl;
        const T* src = smem + ml * (BN + 8) + nl;
        if (n0 + nl + 8 <= args.n) {
          *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(src);
        } else {
          for (int e = 0; e < 8 && n0 + nl + e < args.n; ++e) dst[e] = src[e];
        }
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < MI; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = block_row * R + warp_m * WM + i * 16 + g + h * 8;
      const float b = bias != nullptr ? to_f(bias[m]) : 0.f;
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int nn = n0 + warp_n * WN + j * 8 + 2 * t + e;
          if (nn < args.n) {
            float v = acc[i][j][h * 2 + e] + b;
            if (args.relu) v = fmaxf(v, 0.f);
            y[m * args.sym + nn * args.syn] = from_f<T>(v);
          }
        }
    }
  }
}

// Bias, activation and conversion of the split block rows' fp32 partial sums.
template <typename T>
__global__ void bsr_finalize_kernel(const float* ws, const int* split_rows, int r, int n, const T* bias, T* y,
                                    long long sym, long long syn, int relu) {
  const int slot = blockIdx.y;
  const int block_row = split_rows[slot];
  const long long total = static_cast<long long>(r) * n;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int rr = static_cast<int>(i / n), nn = static_cast<int>(i % n);
    const int m = block_row * r + rr;
    float v = ws[static_cast<long long>(slot) * total + i] + (bias != nullptr ? to_f(bias[m]) : 0.f);
    if (relu) v = fmaxf(v, 0.f);
    y[m * sym + nn * syn] = from_f<T>(v);
  }
}

template <typename T, int R, int C, int BN>
void launch_bsr(const BsrArgs& args, int grid_rows, cudaStream_t stream) {
  using Cfg = BsrConfig<R, C, BN>;
  auto kernel = bsr_mm_kernel<T, R, C, BN>;
  static bool configured[64] = {};  // per instantiation: the attribute is a per-device setting
  prunekit_launch::raise_smem_limit(kernel, Cfg::SMEM_BYTES, configured);
  const dim3 grid(grid_rows, (args.n + Cfg::BN - 1) / Cfg::BN);
  kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launch the kernel for blocks of r x c and an N tile of BN (instantiated per dtype and BN in bsr_mm_<dtype>_n<BN>.cu).
template <typename T, int BN>
void dispatch_rc(int r, int c, const BsrArgs& args, int grid_rows, cudaStream_t stream) {
#define PK_BSR_CASE(RR, CC) \
  if (r == RR && c == CC) return launch_bsr<T, RR, CC, BN>(args, grid_rows, stream);
  PK_BSR_CASE(16, 16) PK_BSR_CASE(16, 32) PK_BSR_CASE(16, 64)
  PK_BSR_CASE(32, 16) PK_BSR_CASE(32, 32) PK_BSR_CASE(32, 64)
  PK_BSR_CASE(64, 16) PK_BSR_CASE(64, 32) PK_BSR_CASE(64, 64)
#undef PK_BSR_CASE
  PRUNEKIT_CHECK(false, "bsr_mm: blocks must be r x c with r, c in {16, 32, 64}, got ", r, "x", c);
}

}  // namespace prunekit_structured
