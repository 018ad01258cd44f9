// SpMM, memory-bound path for small N (decode shapes): Y (M, N) = act(A @ X + bias), A in prunekit CSR.
//
// Design from Sputnik (Gale et al., SC 2020): one subwarp of SW lanes per output row (sec. 5.1 subwarp tiling),
// rows taken in the order of row_indices, longest first (sec. 5.3 row swizzle load balance), values and column
// indices read with 16-byte vector loads (sec. 5.2; the format pads each row to 16 bytes of values, so there is no
// residue inside a row), a 1-D tile of NT output columns per subwarp (sec. 4), fp32 accumulation.
//
// At small N the weights dominate the bytes moved (values + int16 indices, 4 bytes per non-zero in fp16), so every
// weight byte is read exactly once per NT columns and X (small) is gathered per non-zero: from a shared-memory copy
// of X[:, n0:n0+NT] made once per block when it fits (K * NT * 2 bytes <= 227 KB: K <= 7264 at NT = 16 in fp16),
// else with one global vector load of NT values when X is row-major with aligned rows, else element by element. X and Y take any
// strides (Y is written directly in the transposed (tokens, out_features) layout of nn.Linear).
//
// X that is not row-major (the runtime's x2d.t(), column-major) is first transposed here into a row-major (K, N rounded
// up to NT) buffer by rowwarp_transpose_kernel (N * K elements, tiny next to the weights at these N), so that a
// non-zero's NT values are one vector load. That kernel and the rowwarp kernel after it use programmatic dependent
// launch on sm_90: the rowwarp kernel starts while the transpose runs and loads its rows' offsets and first weight
// vectors before it waits for the transposed X. On the H100 (benchmarks/csr_decode_profile.py,
// benchmarks/results/csr-decode-profile-h100-2026-11-26-s22a.json) torch's copy there took 1.7-2.0 us per call, and
// graph-replayed calls with it 2.7-3.3 us more than the rowwarp kernel alone at N = 16, 98%.
// $PRUNEKIT_ROWWARP_TRANSPOSE=0 (read at each call) takes torch's copy (x.contiguous()) instead.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "common.cuh"
#include "kernels.h"
#include "launch.cuh"  // device properties, the shared-memory limit
#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit {

// How a subwarp reads X: element by element with any strides (global), one vector of NT values per non-zero
// (row-major global X), or one vector from the block's shared-memory copy of X[:, n0:n0+NT].
enum XMode { kXStrided = 0, kXVector = 1, kXShared = 2 };

// The shared-memory copy of X holds row k's NV 16-byte vectors at k * NV + (q ^ x_swizzle<NV>(k)). Without the XOR the
// first vector of every row sits at an even 16-byte slot of its 128-byte line when NV = 2 (NT = 16 in fp16), so the 32
// lanes' loads of one instruction (one random row each) share 4 of the 8 slots: Nsight Compute counted 11.6 shared
// wavefronts per load at 4096 x 4096, N = 16, 90% (ncu-spmm-h100-2026-11-27-s32a.txt; 4 is the least for 512 bytes).
// The XOR spreads a row's vectors over all 8 slots as the row varies.
template <int NV> __device__ __forceinline__ unsigned x_swizzle(unsigned k) {
  constexpr unsigned kRowsPerLine = NV >= 8 ? 1 : 8 / NV;  // rows of X per 128-byte line of shared memory
  return (k / kRowsPerLine) & (NV - 1);                    // unsigned: a shift and a mask
}

template <int BYTES> __device__ __forceinline__ void load_shared_words(Words<BYTES>& w, const void* base, int k) {
  constexpr int NV = BYTES / 16;
  // Byte offset of the row's first vector; the low bits of k * BYTES are zero, so OR and XOR place the vectors.
  const unsigned a0 = static_cast<unsigned>(k) * BYTES | x_swizzle<NV>(static_cast<unsigned>(k)) << 4;
#pragma unroll
  for (int q = 0; q < NV; ++q) {
    const uint4 t = *reinterpret_cast<const uint4*>(static_cast<const char*>(base) + (a0 ^ (q << 4)));
    w.w[4 * q + 0] = t.x;
    w.w[4 * q + 1] = t.y;
    w.w[4 * q + 2] = t.z;
    w.w[4 * q + 3] = t.w;
  }
}

// Reduce-scatter of a subwarp's NT partial sums: at each butterfly level a lane keeps half of its live columns and
// sends the other half to its partner, so a level costs one shuffle per kept column, and once one column is left the
// levels below add it whole. Afterwards a lane holds the full sums of kOut = max(1, NT / SW) consecutive columns
// starting at the returned column; lanes that differ only in the low kSame bits hold the same columns. It replaces
// NT full butterflies (NT * log2(SW) shuffles) and the NT one-lane stores after them: at NT = 16, SW = 32 that epilogue
// was about 490 of a row's instructions in SASS, against 313 per pass of its non-zero loop (8 non-zeros per lane).
template <int NT, int SW> struct ReduceScatter {
  static constexpr int kOut = NT > SW ? NT / SW : 1;
  static constexpr int kSame = NT >= SW ? 0 : SW / NT - 1;  // lanes with (lane & kSame) != 0 hold duplicates
};

template <int C, int OFF, int SW>
__device__ __forceinline__ void reduce_scatter_level(float* acc, int lane, int& t0) {
  if constexpr (OFF > 0) {
    if constexpr (C > 1) {
      constexpr int H = C / 2;
      const bool upper = (lane & OFF) != 0;
#pragma unroll
      for (int i = 0; i < H; ++i) {
        const float send = upper ? acc[i] : acc[i + H];
        const float keep = upper ? acc[i + H] : acc[i];
        acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF, SW);
      }
      if (upper) t0 += H;
      reduce_scatter_level<H, OFF / 2, SW>(acc, lane, t0);
    } else {
      acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], OFF, SW);
      reduce_scatter_level<1, OFF / 2, SW>(acc, lane, t0);
    }
  }
}

// One output row (row_indices[sub]) times NT columns starting at n0, computed by the SW lanes of a subwarp.
// Every lane of the warp must call this (shuffles); inactive subwarps pass sub >= m.
template <typename T, typename I, int NT, int SW, int XMODE>
__device__ __forceinline__ void rowwarp_row(int sub, int lane, const T* __restrict__ values,
                                            const int* __restrict__ row_offsets, const I* __restrict__ cols,
                                            const int* __restrict__ row_indices, const T* __restrict__ xb,
                                            int64_t xs_k, int64_t xs_n, T* __restrict__ y, int64_t ys_m,
                                            int64_t ys_n, const T* __restrict__ bias, bool relu, int m, int n,
                                            int n0) {
  constexpr int V = 16 / sizeof(T);  // non-zeros per 16-byte vector of values
  const bool active = sub < m;       // no early return: whole warps take part in the shuffles below
  const int row = active ? __ldg(row_indices + sub) : 0;
  const int start = active ? __ldg(row_offsets + row) : 0;
  const int end = active ? __ldg(row_offsets + row + 1) : 0;
  const bool full = n0 + NT <= n;

  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;

  // Software pipeline: the next vector of values/indices is in flight while the current one is consumed.
  int j = start + lane * V;
  Words<16> vals;
  Words<V * sizeof(I)> idx;
  if (j < end) {
    vals.load(values + j);
    idx.load(cols + j);
  }
  // Programmatic dependent launch: the preceding kernel (the transpose of X, which waited for everything before it)
  // must be done before X is read. A no-op in a launch without the attribute.
  if constexpr (XMODE != kXShared) prunekit_launch::wait_preceding_grid();
  while (j < end) {
    const int jn = j + SW * V;
    Words<16> vals_next;
    Words<V * sizeof(I)> idx_next;
    if (jn < end) {
      vals_next.load(values + jn);
      idx_next.load(cols + jn);
    }
#pragma unroll
    for (int v = 0; v < V; ++v) {
      const float a = word_elem<T>(vals.w, v);
      const int col = word_index<I>(idx.w, v);
      if constexpr (XMODE == kXShared) {
        Words<NT * sizeof(T)> xw;
        load_shared_words(xw, xb, col);
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = fmaf(a, word_elem<T>(xw.w, t), acc[t]);
      } else if constexpr (XMODE == kXVector) {
        // X row-major with 16-byte aligned rows and N a multiple of NT: the NT values are one vector load.
        Words<NT * sizeof(T)> xw;
        xw.load(xb + static_cast<int64_t>(col) * xs_k);
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = fmaf(a, word_elem<T>(xw.w, t), acc[t]);
      } else {
        const T* xp = xb + static_cast<int64_t>(col) * xs_k;
        if (full) {
#pragma unroll
          for (int t = 0; t < NT; ++t) acc[t] = fmaf(a, to_f(xp[t * xs_n]), acc[t]);
        } else {
#pragma unroll
          for (int t = 0; t < NT; ++t)
            if (n0 + t < n) acc[t] = fmaf(a, to_f(xp[t * xs_n]), acc[t]);
        }
      }
    }
    vals = vals_next;
    idx = idx_next;
    j = jn;
  }

  int t0 = 0;  // the first of this lane's columns after the reduce-scatter
  reduce_scatter_level<NT, SW / 2, SW>(acc, lane, t0);
  using RS = ReduceScatter<NT, SW>;
  if (!active || (lane & RS::kSame) != 0) return;
  const float b = bias != nullptr ? to_f(bias[row]) : 0.0f;
#pragma unroll
  for (int j = 0; j < RS::kOut; ++j) {
    const int t = n0 + t0 + j;
    if (t < n) {
      y[static_cast<int64_t>(row) * ys_m + static_cast<int64_t>(t) * ys_n] = from_f<T>(epilogue(acc[j], b, relu));
    }
  }
}

template <typename T, typename I, int NT, int SW, int XMODE>
__global__ void __launch_bounds__(256)
spmm_rowwarp_kernel(const T* __restrict__ values, const int* __restrict__ row_offsets, const I* __restrict__ cols,
                    const int* __restrict__ row_indices, const T* __restrict__ x, int64_t xs_k, int64_t xs_n,
                    T* __restrict__ y, int64_t ys_m, int64_t ys_n, const T* __restrict__ bias, bool relu, int m,
                    int n) {
  const int sub = (blockIdx.x * blockDim.x + threadIdx.x) / SW;
  const int n0 = blockIdx.y * NT;
  rowwarp_row<T, I, NT, SW, XMODE>(sub, threadIdx.x % SW, values, row_offsets, cols, row_indices,
                                   x + static_cast<int64_t>(n0) * xs_n, xs_k, xs_n, y, ys_m, ys_n, bias, relu, m, n,
                                   n0);
}

// Shared-memory variant: the block first copies X[:, n0:n0+NT] (K x NT, row-major, 16-byte vectors) into shared
// memory, then its subwarps walk rows in a grid-stride loop, so each X element crosses L2 once per block instead of
// once per non-zero that uses it. One block of 1024 threads per SM.
constexpr int kSmemThreads = 1024;

template <typename T, typename I, int NT, int SW>
__global__ void __launch_bounds__(kSmemThreads, 1)
spmm_rowwarp_smem_kernel(const T* __restrict__ values, const int* __restrict__ row_offsets,
                         const I* __restrict__ cols, const int* __restrict__ row_indices, const T* __restrict__ x,
                         int64_t xs_k, T* __restrict__ y, int64_t ys_m, int64_t ys_n, const T* __restrict__ bias,
                         bool relu, int m, int n, int k) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* xsm = reinterpret_cast<T*>(smem_raw);
  constexpr int NV = NT * sizeof(T) / 16;  // 16-byte vectors per X row segment
  const int n0 = blockIdx.y * NT;
  prunekit_launch::wait_preceding_grid();  // programmatic dependent launch: X (the transpose's output) is complete
  constexpr int kInFlight = 8;  // independent 16-byte loads per thread before their stores
  for (int base = threadIdx.x; base < k * NV; base += kSmemThreads * kInFlight) {
    uint4 r[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int u = base + i * kSmemThreads;
      if (u < k * NV) r[i] = __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(u / NV) * xs_k + n0) + u % NV);
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int u = base + i * kSmemThreads;
      const int q = u % NV;  // vector q of row u / NV, at its swizzled slot
      if (u < k * NV) reinterpret_cast<uint4*>(xsm)[u - q + (q ^ x_swizzle<NV>(static_cast<unsigned>(u / NV)))] = r[i];
    }
  }
  __syncthreads();
  constexpr int kSubs = kSmemThreads / SW;
  const int local = threadIdx.x / SW, lane = threadIdx.x % SW;
  for (int base = blockIdx.x * kSubs; base < m; base += gridDim.x * kSubs) {
    rowwarp_row<T, I, NT, SW, kXShared>(base + local, lane, values, row_offsets, cols, row_indices, xsm, NT, 1, y,
                                        ys_m, ys_n, bias, relu, m, n, n0);
  }
}

// X (K, N) of any strides -> xt (K, n_pad) row-major, zero past N: thread (k, token group of G) reads its G values
// (coalesced across the warp's consecutive k where X is column-major) and writes them as one vector. Waits for the
// preceding kernel before it reads X (launched with programmatic dependent launch), then lets the rowwarp kernel start.
constexpr int kTransposeThreads = 256;

template <typename T, int G>
__global__ void __launch_bounds__(kTransposeThreads)
rowwarp_transpose_kernel(const T* __restrict__ x, int64_t xs_k, int64_t xs_n, T* __restrict__ xt, int k, int n,
                         int n_pad) {
  prunekit_launch::wait_preceding_grid();
  prunekit_launch::allow_dependent_launch();
  const int kk = blockIdx.x * kTransposeThreads + threadIdx.x;
  const int t0 = blockIdx.y * G;
  if (kk >= k) return;
  float e[G];
#pragma unroll
  for (int i = 0; i < G; ++i) {
    e[i] = t0 + i < n ? to_f(x[static_cast<int64_t>(kk) * xs_k + static_cast<int64_t>(t0 + i) * xs_n]) : 0.0f;
  }
  store_xrow<T, G>(xt + static_cast<int64_t>(kk) * n_pad + t0, e);
}

// Whether programmatic dependent launch is used (sm_90 and newer; $PRUNEKIT_ROWWARP_PDL=0 turns it off).
static bool rowwarp_pdl() {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  return prunekit_launch::device_props(dev).major >= 9 && !prunekit_launch::env_off("PRUNEKIT_ROWWARP_PDL");
}

// The row-major X the rowwarp kernels read: x itself where its rows are contiguous (or N = 1), else a transposed copy
// (rowwarp_transpose_kernel, N rounded up to NT with zeros, `pdl` set where the kernel after it may launch early; or
// torch's x.contiguous() with $PRUNEKIT_ROWWARP_TRANSPOSE=0). `padded`: the copy's rows hold whole NT tiles.
template <typename T, int NT>
static at::Tensor row_major_x(const at::Tensor& x, int64_t n, bool& pdl, bool& padded, bool pad_row_major = false) {
  pdl = padded = false;
  // pad_row_major: a row-major X whose N is not a multiple of NT is copied too, into rows of whole NT tiles.
  if (n <= 1 || (x.stride(1) == 1 && !(pad_row_major && n % NT != 0))) return x;
  if constexpr (NT < 4) {
    return x.contiguous();  // a forced 1-column tile: no vector loads to gain
  } else {
    if (prunekit_launch::env_off("PRUNEKIT_ROWWARP_TRANSPOSE")) return x.contiguous();
    const int64_t k = x.size(0);
    PRUNEKIT_CHECK(k <= INT32_MAX, "spmm_csr_rowwarp: K too large, got ", k);
    const int64_t n_pad = (n + NT - 1) / NT * NT;
    at::Tensor xt = at::empty({k, n_pad}, x.options());
    if (k == 0) return xt;
    constexpr int G = NT % 8 == 0 ? 8 : 4;
    static_assert(NT % G == 0, "token groups must tile NT");
    pdl = rowwarp_pdl();
    const dim3 grid(static_cast<unsigned>((k + kTransposeThreads - 1) / kTransposeThreads),
                    static_cast<unsigned>(n_pad / G));
    PRUNEKIT_CHECK(grid.y <= 65535, "spmm_csr_rowwarp: N too large to transpose");
    prunekit_launch::launch(rowwarp_transpose_kernel<T, G>, grid, dim3(kTransposeThreads), 0,
                            c10::cuda::getCurrentCUDAStream(), pdl, reinterpret_cast<const T*>(x.data_ptr()),
                            x.stride(0), x.stride(1), reinterpret_cast<T*>(xt.data_ptr()), static_cast<int>(k),
                            static_cast<int>(n), static_cast<int>(n_pad));
    padded = true;
    return xt;
  }
}

template <typename T, typename I, int NT, int SW>
static void launch_rowwarp(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& cols,
                           const at::Tensor& row_indices, const at::Tensor& x_in, const at::Tensor& y, const T* bias,
                           bool relu, int m, int n, bool stage_x) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t k = x_in.size(0);
  if constexpr (NT <= 4) {
    // N <= 4: the SpMV kernel and its token tile (spmv_csr.cu; rows in storage order, x in shared memory), where it
    // applies; it reads x in any layout
    if (n <= NT && k <= INT32_MAX &&
        spmv_csr<T, I, NT>(reinterpret_cast<const T*>(values.data_ptr()), row_offsets.data_ptr<int>(),
                           reinterpret_cast<const I*>(cols.data_ptr()), reinterpret_cast<const T*>(x_in.data_ptr()),
                           x_in.stride(0), x_in.stride(1), reinterpret_cast<T*>(y.data_ptr()), y.stride(0),
                           y.stride(1), bias, relu, m, n, static_cast<int>(k))) {
      return;
    }
  }
  bool pdl = false, padded = false;
  const at::Tensor x = row_major_x<T, NT>(x_in, n, pdl, padded);
  // Vector X loads: unit stride along N, rows 16-byte aligned, whole tiles only (the transposed copy's rows hold them).
  const bool xv = NT >= 4 && x.stride(1) == 1 && (n % NT == 0 || padded) &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  (x.stride(0) * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  if constexpr (NT * sizeof(T) % 16 == 0) {
    const int64_t smem_bytes = k * NT * static_cast<int64_t>(sizeof(T));
    if (stage_x && xv && k > 0) {  // the device's limit is read only where the copy of X is possible
      int dev = 0;
      C10_CUDA_CHECK(cudaGetDevice(&dev));
      const prunekit_launch::DeviceProps props = prunekit_launch::device_props(dev);
      if (smem_bytes <= props.max_smem) {
        auto kernel = spmm_rowwarp_smem_kernel<T, I, NT, SW>;
        static bool configured[64] = {};
        prunekit_launch::raise_smem_limit(kernel, props.max_smem, configured);
        const int64_t blocks_needed = (static_cast<int64_t>(m) * SW + 31) / 32;  // at least a warp of rows per block
        const dim3 grid(static_cast<unsigned>(std::min<int64_t>(props.sms, blocks_needed)),
                        (n + NT - 1) / NT);
        PRUNEKIT_CHECK(grid.y <= 65535, "spmm_csr_rowwarp: N too large for ntile ", NT);
        prunekit_launch::launch(kernel, grid, dim3(kSmemThreads), static_cast<size_t>(smem_bytes), stream, pdl,
                                reinterpret_cast<const T*>(values.data_ptr()), row_offsets.data_ptr<int>(),
                                reinterpret_cast<const I*>(cols.data_ptr()), row_indices.data_ptr<int>(),
                                reinterpret_cast<const T*>(x.data_ptr()), x.stride(0),
                                reinterpret_cast<T*>(y.data_ptr()), y.stride(0), y.stride(1), bias, relu, m, n,
                                static_cast<int>(k));
        return;
      }
    }
  }
  constexpr int kThreads = 256;
  const dim3 grid((static_cast<int64_t>(m) * SW + kThreads - 1) / kThreads, (n + NT - 1) / NT);
  PRUNEKIT_CHECK(grid.y <= 65535, "spmm_csr_rowwarp: N too large for ntile ", NT);
  auto kernel = spmm_rowwarp_kernel<T, I, NT, SW, kXStrided>;
  if constexpr (NT >= 4) {
    if (xv) kernel = spmm_rowwarp_kernel<T, I, NT, SW, kXVector>;
  }
  prunekit_launch::launch(kernel, grid, dim3(kThreads), 0, stream, pdl, reinterpret_cast<const T*>(values.data_ptr()),
                          row_offsets.data_ptr<int>(), reinterpret_cast<const I*>(cols.data_ptr()),
                          row_indices.data_ptr<int>(), reinterpret_cast<const T*>(x.data_ptr()), x.stride(0),
                          x.stride(1), reinterpret_cast<T*>(y.data_ptr()), y.stride(0), y.stride(1), bias, relu, m, n);
}

template <typename T, typename I, int SW>
static void dispatch_ntile(int64_t ntile, const at::Tensor& values, const at::Tensor& row_offsets,
                           const at::Tensor& cols, const at::Tensor& row_indices, const at::Tensor& x,
                           const at::Tensor& y, const T* bias, bool relu, int m, int n, bool stage_x) {
  switch (ntile) {
    case 1: return launch_rowwarp<T, I, 1, SW>(values, row_offsets, cols, row_indices, x, y, bias, relu, m, n, stage_x);
    case 4: return launch_rowwarp<T, I, 4, SW>(values, row_offsets, cols, row_indices, x, y, bias, relu, m, n, stage_x);
    case 8: return launch_rowwarp<T, I, 8, SW>(values, row_offsets, cols, row_indices, x, y, bias, relu, m, n, stage_x);
    case 16: return launch_rowwarp<T, I, 16, SW>(values, row_offsets, cols, row_indices, x, y, bias, relu, m, n, stage_x);
    default: PRUNEKIT_CHECK(false, "spmm_csr_rowwarp: ntile must be 1, 4, 8 or 16, got ", ntile);
  }
}

void spmm_csr_rowwarp(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                      const at::Tensor& row_indices, const at::Tensor& x, const at::Tensor& y,
                      const std::optional<at::Tensor>& bias, bool relu, int64_t subwarp, int64_t ntile,
                      bool stage_x) {
  check_csr(row_offsets, column_indices, "spmm_csr_rowwarp");
  PRUNEKIT_CHECK(x.is_cuda() && y.is_cuda() && values.is_cuda(), "spmm_csr_rowwarp: tensors must be on the GPU");
  PRUNEKIT_CHECK(x.dim() == 2 && y.dim() == 2, "spmm_csr_rowwarp: x and y must be 2-D");
  PRUNEKIT_CHECK(values.scalar_type() == x.scalar_type() && y.scalar_type() == x.scalar_type(),
              "spmm_csr_rowwarp: values, x and y must share one dtype");
  PRUNEKIT_CHECK(values.is_contiguous() && reinterpret_cast<uintptr_t>(values.data_ptr()) % 16 == 0,
              "spmm_csr_rowwarp: values must be contiguous and 16-byte aligned");
  PRUNEKIT_CHECK(row_indices.scalar_type() == at::kInt && row_indices.is_contiguous(),
              "spmm_csr_rowwarp: row_indices must be contiguous int32");
  const int64_t m = y.size(0), n = y.size(1);
  PRUNEKIT_CHECK(row_offsets.numel() == m + 1 && row_indices.numel() == m && x.size(1) == n,
              "spmm_csr_rowwarp: shapes disagree");
  PRUNEKIT_CHECK(m < (int64_t(1) << 31) / 32 && n < (int64_t(1) << 31), "spmm_csr_rowwarp: too large");
  if (bias) {
    PRUNEKIT_CHECK(bias->is_cuda() && bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                    bias->numel() == m,
                "spmm_csr_rowwarp: bias must be a contiguous (M,) tensor of x's dtype");
  }
  if (m == 0 || n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  PRUNEKIT_DISPATCH_FLOAT(x.scalar_type(), [&] {
    PRUNEKIT_DISPATCH_INDEX(column_indices.scalar_type(), [&] {
      const scalar_t* b = bias ? reinterpret_cast<const scalar_t*>(bias->data_ptr()) : nullptr;
      if (subwarp == 8) {
        dispatch_ntile<scalar_t, index_t, 8>(ntile, values, row_offsets, column_indices, row_indices, x, y, b, relu,
                                             m, n, stage_x);
      } else {
        PRUNEKIT_CHECK(subwarp == 32, "spmm_csr_rowwarp: subwarp must be 8 or 32, got ", subwarp);
        dispatch_ntile<scalar_t, index_t, 32>(ntile, values, row_offsets, column_indices, row_indices, x, y, b, relu,
                                              m, n, stage_x);
      }
    });
  });
}

// Row-major copy of x (K, N) of any strides for the kernels that need unit stride along N (spmm_direct.cu): the
// transpose kernel above with 8-token groups, rows padded to a multiple of 8 (zeros), returned as the (K, N) view. It
// coalesces the reads of column-major activations (nn.Linear's x2d.t()), which a generic x.contiguous() does not.
at::Tensor row_major_copy(const at::Tensor& x, bool& padded) {
  PRUNEKIT_CHECK(x.is_cuda() && x.dim() == 2, "row_major_copy: x must be a 2-D CUDA tensor");
  padded = false;
  const int64_t n = x.size(1);
  if (n <= 1 || (x.stride(1) == 1 && n % 8 == 0)) return x;
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out;
  PRUNEKIT_DISPATCH_FLOAT(x.scalar_type(), [&] {
    bool pdl = false;
    out = row_major_x<scalar_t, 8>(x, n, pdl, padded, /*pad_row_major=*/true).narrow(1, 0, n);
  });
  return out;
}

}  // namespace prunekit
