// SpMM, large-N path: Y (M, N) = act(A @ X + bias), A in prunekit CSR, X tiles shared by a block of rows.
//
// Each block owns ROWS = 8 * RPW consecutive rows (8 warps, RPW rows per warp) and NTILE = 128 output columns
// (Sputnik's 1-D output tiling, Gale et al. SC 2020 sec. 4, with the row dimension widened so one X tile serves many
// rows). K is walked in chunks of KC: the block stages X[k0:k0+KC, n0:n0+NTILE] in shared memory (one coalesced pass,
// from either a row-major X or the transposed view of nn.Linear activations), then every warp walks its rows'
// non-zeros that fall in the chunk: the 32 lanes load 32 (value, column) pairs at once, and each non-zero is
// broadcast with a shuffle and multiplied into 4 output columns per lane read from shared memory (fp32 accumulation).
// Row order within a block does not matter for load balance as rows are equally long on average; consecutive rows
// let the transposed output (tokens, out_features) be written coalesced through shared memory.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <climits>

#include "common.cuh"
#include "kernels.h"
#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit {

constexpr int kTiledWarps = 8;
constexpr int kTiledThreads = 32 * kTiledWarps;
constexpr int kNTile = 128;            // output columns per block: 4 per lane
constexpr int kLd = kNTile + 8;        // shared-memory row pitch (elements), keeps 16-byte alignment
constexpr int kSmemBytes = 34816;      // 128 rows of fp16 or 64 rows of fp32 at pitch kLd

template <typename T> __host__ __device__ constexpr int tile_k() { return kSmemBytes / (kLd * static_cast<int>(sizeof(T))); }

// Stage X[k0:k0+KC, n0:n0+NTILE] into xs (KC x kLd), zero outside X.
template <typename T, bool XT>
__device__ __forceinline__ void stage_x(T* xs, const T* __restrict__ x, int64_t xs_k, int64_t xs_n, int k, int n,
                                        int k0, int n0, bool vec_ok) {
  constexpr int KC = tile_k<T>();
  constexpr int V = 16 / sizeof(T);
  const T zero = from_f<T>(0.0f);
  if constexpr (!XT) {
    // Row-major X (xs_n == 1): each row of the tile is NTILE contiguous elements.
    constexpr int kVecPerRow = kNTile / V;
    for (int u = threadIdx.x; u < KC * kVecPerRow; u += kTiledThreads) {
      const int kk = u / kVecPerRow, nn = (u % kVecPerRow) * V;
      const int gk = k0 + kk, gn = n0 + nn;
      T* dst = xs + kk * kLd + nn;
      if (vec_ok && gk < k && gn + V <= n) {
        *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(x + gk * xs_k + gn));
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) dst[e] = (gk < k && gn + e < n) ? x[gk * xs_k + gn + e] : zero;
      }
    }
  } else {
    // Transposed X (xs_k == 1, element (k, n) at n * xs_n + k): lanes take consecutive n, each reads V consecutive k
    // (one 16-byte load) and writes them down a column of the tile (consecutive lanes hit consecutive banks).
    constexpr int kVecPerCol = KC / V;
    for (int u = threadIdx.x; u < kNTile * kVecPerCol; u += kTiledThreads) {
      const int nn = u % kNTile, kk = (u / kNTile) * V;
      const int gk = k0 + kk, gn = n0 + nn;
      if (vec_ok && gn < n && gk + V <= k) {
        Words<16> w;
        w.load(x + gn * xs_n + gk);
#pragma unroll
        for (int e = 0; e < V; ++e) xs[(kk + e) * kLd + nn] = from_f<T>(word_elem<T>(w.w, e));
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) xs[(kk + e) * kLd + nn] = (gn < n && gk + e < k) ? x[gn * xs_n + gk + e] : zero;
      }
    }
  }
}

template <typename T, typename I, bool XT, bool YT, int RPW>
__global__ void __launch_bounds__(kTiledThreads)
spmm_tiled_kernel(const T* __restrict__ values, const int* __restrict__ row_offsets, const I* __restrict__ cols,
                  const T* __restrict__ x, int64_t xs_k, int64_t xs_n, bool x_vec_ok, T* __restrict__ y,
                  int64_t ys_m, int64_t ys_n, bool y_vec_ok, const T* __restrict__ bias, bool relu, int m, int k,
                  int n) {
  constexpr int KC = tile_k<T>();
  constexpr int ROWS = kTiledWarps * RPW;
  __shared__ __align__(16) unsigned char smem_raw[kSmemBytes];
  T* xs = reinterpret_cast<T*>(smem_raw);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r0 = blockIdx.x * ROWS, n0 = blockIdx.y * kNTile;

  // Per row: a window of 32 (value, column) pairs, one per lane, and how many of them are consumed.
  float win_val[RPW];
  int win_col[RPW], win_base[RPW], win_used[RPW], row_end[RPW];
  float acc[RPW][4];
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int row = r0 + warp * RPW + i;
    const int start = row < m ? __ldg(row_offsets + row) : 0;
    row_end[i] = row < m ? __ldg(row_offsets + row + 1) : 0;
    win_base[i] = start;
    win_used[i] = 0;
    const int j = start + lane;
    win_val[i] = j < row_end[i] ? to_f(values[j]) : 0.0f;
    win_col[i] = j < row_end[i] ? static_cast<int>(cols[j]) : INT_MAX;
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[i][q] = 0.0f;
  }

  for (int k0 = 0; k0 < k; k0 += KC) {
    __syncthreads();
    stage_x<T, XT>(xs, x, xs_k, xs_n, k, n, k0, n0, x_vec_ok);
    __syncthreads();
    const int kend = k0 + KC;
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      while (true) {
        // Columns ascend within a row, so the window's entries in this chunk are the lanes [used, used + cnt).
        const bool in = lane >= win_used[i] && win_col[i] < kend;
        const int cnt = __popc(__ballot_sync(0xffffffffu, in));
        const int stop = win_used[i] + cnt;
#pragma unroll 4
        for (int e = win_used[i]; e < stop; ++e) {
          const float a = __shfl_sync(0xffffffffu, win_val[i], e);
          const int c = __shfl_sync(0xffffffffu, win_col[i], e) - k0;
          float xv[4];
          load4(xs + c * kLd + lane * 4, xv);
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[i][q] = fmaf(a, xv[q], acc[i][q]);
        }
        win_used[i] = stop;
        if (stop < 32) break;
        win_base[i] += 32;  // window exhausted inside the chunk: load the next 32 pairs
        win_used[i] = 0;
        const int j = win_base[i] + lane;
        win_val[i] = j < row_end[i] ? to_f(values[j]) : 0.0f;
        win_col[i] = j < row_end[i] ? static_cast<int>(cols[j]) : INT_MAX;
      }
    }
  }

  // Epilogue: bias, activation, conversion to T, store.
  const int nl = n0 + lane * 4;
  if constexpr (!YT) {
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      const int row = r0 + warp * RPW + i;
      if (row >= m) continue;
      const float b = bias != nullptr ? to_f(bias[row]) : 0.0f;
      float o[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) o[q] = epilogue(acc[i][q], b, relu);
      T* dst = y + static_cast<int64_t>(row) * ys_m + nl;
      if (y_vec_ok && nl + 4 <= n) {
        store4<T>(dst, o[0], o[1], o[2], o[3]);
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (nl + q < n) y[static_cast<int64_t>(row) * ys_m + static_cast<int64_t>(nl + q) * ys_n] = from_f<T>(o[q]);
      }
    }
  } else {
    // Transposed Y (element (row, col) at col * ys_n + row): go through shared memory so that consecutive lanes write
    // consecutive rows.
    constexpr int kLo = ROWS + 2;
    static_assert(kNTile * kLo * sizeof(T) <= kSmemBytes, "output staging does not fit");
    __syncthreads();
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      const int rl = warp * RPW + i;
      const int row = r0 + rl;
      const float b = (bias != nullptr && row < m) ? to_f(bias[row]) : 0.0f;
#pragma unroll
      for (int q = 0; q < 4; ++q) xs[(lane * 4 + q) * kLo + rl] = from_f<T>(epilogue(acc[i][q], b, relu));
    }
    __syncthreads();
    for (int u = threadIdx.x; u < kNTile * ROWS; u += kTiledThreads) {
      const int rl = u % ROWS, nn = u / ROWS;
      if (r0 + rl < m && n0 + nn < n) {
        y[static_cast<int64_t>(n0 + nn) * ys_n + static_cast<int64_t>(r0 + rl) * ys_m] = xs[nn * kLo + rl];
      }
    }
  }
}

template <typename T, typename I, bool XT, bool YT, int RPW>
static void launch_tiled(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& cols,
                         const at::Tensor& x, bool x_vec_ok, const at::Tensor& y, bool y_vec_ok, const T* bias,
                         bool relu, int m, int k, int n) {
  constexpr int ROWS = kTiledWarps * RPW;
  const dim3 grid((m + ROWS - 1) / ROWS, (n + kNTile - 1) / kNTile);
  PRUNEKIT_CHECK(grid.y <= 65535, "spmm_csr_tiled: N too large");
  auto stream = c10::cuda::getCurrentCUDAStream();
  spmm_tiled_kernel<T, I, XT, YT, RPW><<<grid, kTiledThreads, 0, stream>>>(
      reinterpret_cast<const T*>(values.data_ptr()), row_offsets.data_ptr<int>(),
      reinterpret_cast<const I*>(cols.data_ptr()), reinterpret_cast<const T*>(x.data_ptr()), x.stride(0),
      x.stride(1), x_vec_ok, reinterpret_cast<T*>(y.data_ptr()), y.stride(0), y.stride(1), y_vec_ok, bias, relu, m,
      k, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, typename I, int RPW>
static void dispatch_layout(bool xt, bool yt, const at::Tensor& values, const at::Tensor& row_offsets,
                            const at::Tensor& cols, const at::Tensor& x, bool x_vec_ok, const at::Tensor& y,
                            bool y_vec_ok, const T* bias, bool relu, int m, int k, int n) {
  if (xt) {
    if (yt) return launch_tiled<T, I, true, true, RPW>(values, row_offsets, cols, x, x_vec_ok, y, y_vec_ok, bias, relu, m, k, n);
    return launch_tiled<T, I, true, false, RPW>(values, row_offsets, cols, x, x_vec_ok, y, y_vec_ok, bias, relu, m, k, n);
  }
  if (yt) return launch_tiled<T, I, false, true, RPW>(values, row_offsets, cols, x, x_vec_ok, y, y_vec_ok, bias, relu, m, k, n);
  return launch_tiled<T, I, false, false, RPW>(values, row_offsets, cols, x, x_vec_ok, y, y_vec_ok, bias, relu, m, k, n);
}

static bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void spmm_csr_tiled(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                    const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& bias, bool relu,
                    int64_t rows_per_warp) {
  check_csr(row_offsets, column_indices, "spmm_csr_tiled");
  PRUNEKIT_CHECK(x.is_cuda() && y.is_cuda() && values.is_cuda(), "spmm_csr_tiled: tensors must be on the GPU");
  PRUNEKIT_CHECK(x.dim() == 2 && y.dim() == 2, "spmm_csr_tiled: x and y must be 2-D");
  PRUNEKIT_CHECK(values.scalar_type() == x.scalar_type() && y.scalar_type() == x.scalar_type(),
              "spmm_csr_tiled: values, x and y must share one dtype");
  PRUNEKIT_CHECK(values.is_contiguous(), "spmm_csr_tiled: values must be contiguous");
  const int64_t m = y.size(0), n = y.size(1), k = x.size(0);
  PRUNEKIT_CHECK(row_offsets.numel() == m + 1 && x.size(1) == n, "spmm_csr_tiled: shapes disagree");
  PRUNEKIT_CHECK(m < (int64_t(1) << 31) && k < (int64_t(1) << 31) && n < (int64_t(1) << 31), "spmm_csr_tiled: too large");
  // X layouts: row-major (unit stride along N) or the transposed view of a row-major (N, K) buffer (unit stride
  // along K). Y layouts: row-major or transposed.
  const bool xt = x.stride(1) != 1 && x.stride(0) == 1;
  PRUNEKIT_CHECK(xt || x.stride(1) == 1 || n <= 1, "spmm_csr_tiled: x must have unit stride along K or along N");
  const bool yt = y.stride(1) != 1 && y.stride(0) == 1;
  PRUNEKIT_CHECK(yt || y.stride(1) == 1 || n <= 1, "spmm_csr_tiled: y must have unit stride along M or along N");
  const int64_t x_lead = xt ? x.stride(1) : x.stride(0);
  const bool x_vec_ok = aligned16(x.data_ptr()) && (x_lead * x.element_size()) % 16 == 0;
  const bool y_vec_ok = !yt && reinterpret_cast<uintptr_t>(y.data_ptr()) % (4 * y.element_size()) == 0 &&
                        (y.stride(0) % 4) == 0 && y.stride(1) == 1;
  if (bias) {
    PRUNEKIT_CHECK(bias->is_cuda() && bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                    bias->numel() == m,
                "spmm_csr_tiled: bias must be a contiguous (M,) tensor of x's dtype");
  }
  if (m == 0 || n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  PRUNEKIT_DISPATCH_FLOAT(x.scalar_type(), [&] {
    PRUNEKIT_DISPATCH_INDEX(column_indices.scalar_type(), [&] {
      const scalar_t* b = bias ? reinterpret_cast<const scalar_t*>(bias->data_ptr()) : nullptr;
      if (rows_per_warp == 2) {
        dispatch_layout<scalar_t, index_t, 2>(xt, yt, values, row_offsets, column_indices, x, x_vec_ok, y, y_vec_ok,
                                              b, relu, m, k, n);
      } else {
        PRUNEKIT_CHECK(rows_per_warp == 8, "spmm_csr_tiled: rows_per_warp must be 2 or 8, got ", rows_per_warp);
        dispatch_layout<scalar_t, index_t, 8>(xt, yt, values, row_offsets, column_indices, x, x_vec_ok, y, y_vec_ok,
                                              b, relu, m, k, n);
      }
    });
  });
}

}  // namespace prunekit
