// The `dense` SpMM variant: decompress the CSR weight into a dense (M, K) scratch buffer, then one cuBLAS GEMM.
//
// "Load sparse, compute dense" (Flash-LLM, Xia et al., VLDB 2024, does it per tile inside its GEMM) at the scale of a
// whole layer. At large N an unstructured product is bound by the
// tensor cores, and a sparse kernel only gains where it skips whole mma tiles, which a random pattern at 90-95% does
// not allow (docs/KERNELS.md, "Bounds": the condensed-window `tc` design's ceiling is 0.70x / 0.90x of dense there).
// The decompression writes M * K elements once (32 MB for 4096 x 4096 fp16, about 12 us at the H100's 3 TB/s),
// which is small against the GEMM at N >= 128, so the product runs at nearly the speed of dense cuBLAS while the
// weight stays stored as CSR. The scratch buffer comes from torch's caching allocator for the call and is freed at its
// end: it adds M * K elements to the peak memory of one layer call, not to the weights held.
//
// Decompression: one block of 128 threads per row (a warp per row where rows are at most 4 KB). The row (in chunks of
// 48 KB) is assembled in shared memory: cleared with 16-byte stores, each non-zero's bits stored at its column, then
// copied out with 16-byte stores. Values and column indices are read as 16-byte vectors of values (the format pads
// every row to 16 bytes), each thread's first two before the row is cleared, so that their latency overlaps the
// clearing. Plain stores, no atomics: the format's
// columns are unique within a row apart from its padding entries, which repeat a real column with value 0 and are
// skipped (a zero is never stored; the cleared row holds it). The buffer's row stride is K rounded up to 16 bytes; the
// padding columns hold zeros and are not seen by the GEMM (it gets the (M, K) view).
//
// The first two versions (s25a, s25b) accumulated in fp32 with shared-memory atomicAdd, one block of 256 threads per
// row, and reached 1.2-2.1 TB/s; their time grew with the non-zeros per row (s25a: 49 us at 50%, 25 at 90%, 19 at 98% on
// 4096 x 4096, against 16 at 90% now; docs/PERFORMANCE.md, "Twenty-fifth session").
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams
#include "common.cuh"
#include "kernels.h"
#include "views.h"  // raw_t

namespace prunekit {

namespace {

constexpr int kDenseThreads = 128;
constexpr int kDensePrefetch = 2;             // 16-byte vectors per thread loaded before the row is cleared
constexpr int kDenseChunkBytes = 48 * 1024;  // shared memory per block, the limit without an opt-in
// Rows of at most this many bytes (K <= 2048 in fp16) take one warp each, kDenseShortRows per block: at one block per
// row, 3072 x 768 (rows of 1.5 KB) decompressed at 1.1 TB/s against 2.4-2.75 on the large shapes (s25c).
constexpr int64_t kDenseShortRowBytes = 4096;
constexpr int kDenseShortRows = kDenseThreads / 32;

template <typename T> struct BitsOf { using type = uint16_t; };
template <> struct BitsOf<float> { using type = uint32_t; };

// The bits of element j of a 16-byte vector of T.
template <typename T>
__device__ __forceinline__ typename BitsOf<T>::type vector_bits(const Words<16>& v, int j) {
  if constexpr (sizeof(T) == 4) {
    return v.w[j];
  } else {
    return static_cast<uint16_t>(v.w[j >> 1] >> (16 * (j & 1)));
  }
}

// Whether bits hold a value other than +0 or -0.
template <typename B> __device__ __forceinline__ bool nonzero_bits(B bits) {
  return (bits & static_cast<B>(~(B{1} << (8 * sizeof(B) - 1)))) != 0;
}

// Store the non-zeros of one 16-byte vector of values (and its column indices) into the row's chunk [c0, c0 + width).
template <typename T, typename I, int IB>
__device__ __forceinline__ void place_vector(typename BitsOf<T>::type* row, const Words<16>& v, const Words<IB>& c,
                                             int c0, int width) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const auto bits = vector_bits<T>(v, j);
    const int col = word_index<I>(c.w, j) - c0;
    if (nonzero_bits(bits) && col >= 0 && col < width) row[col] = bits;
  }
}

// R rows per block, kDenseThreads / R threads per row, each row with its own slice of `chunk` elements of shared memory.
template <typename T, typename I, int R>
__global__ void __launch_bounds__(kDenseThreads)
csr_to_dense_kernel(const T* __restrict__ values, const int* __restrict__ row_offsets, const I* __restrict__ cols,
                    T* __restrict__ dense, int m, int64_t ld, int k, int chunk, bool vec_ok) {
  using B = typename BitsOf<T>::type;
  constexpr int V = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
  constexpr int IB = V * static_cast<int>(sizeof(I));   // bytes of V column indices: 8, 16 or 32
  constexpr int TPR = kDenseThreads / R;                // threads per row
  extern __shared__ uint4 smem4[];
  const int t = static_cast<int>(threadIdx.x) % TPR;
  const int slot = static_cast<int>(threadIdx.x) / TPR;
  uint4* row4 = smem4 + static_cast<int64_t>(slot) * (chunk / V);
  B* row = reinterpret_cast<B*>(row4);
  const int r = blockIdx.x * R + slot;
  const bool live = r < m;  // a block's last rows may lie past M: they join the barriers and write nothing
  const int start = live ? __ldg(row_offsets + r) : 0, end = live ? __ldg(row_offsets + r + 1) : 0;
  // Vector loads where the row starts and ends on 16 bytes of values (the format pads every row so), else elements.
  const bool vec = vec_ok && start % V == 0 && end % V == 0;
  Words<16> v[kDensePrefetch];
  Words<IB> c[kDensePrefetch];
#pragma unroll
  for (int p = 0; p < kDensePrefetch; ++p) {
    const int e = start + (t + p * TPR) * V;
    if (vec && e < end) {
      v[p].load(values + e);
      c[p].load(cols + e);
    }
  }
  for (int c0 = 0; c0 < k; c0 += chunk) {
    const int width = min(chunk, k - c0);
    const int vecs = (width + V - 1) / V;  // 16-byte vectors of the chunk: c0 + vecs * V <= ld
    for (int i = t; i < vecs; i += TPR) row4[i] = make_uint4(0u, 0u, 0u, 0u);
    __syncthreads();
    if (vec) {
#pragma unroll
      for (int p = 0; p < kDensePrefetch; ++p) {
        const int e = start + (t + p * TPR) * V;
        if (e < end) place_vector<T, I, IB>(row, v[p], c[p], c0, width);
      }
      for (int e = start + (t + kDensePrefetch * TPR) * V; e < end; e += TPR * V) {
        Words<16> vv;
        Words<IB> cc;
        vv.load(values + e);
        cc.load(cols + e);
        place_vector<T, I, IB>(row, vv, cc, c0, width);
      }
    } else {
      for (int e = start + t; e < end; e += TPR) {
        const B bits = reinterpret_cast<const B*>(values)[e];
        const int col = static_cast<int>(cols[e]) - c0;
        if (nonzero_bits(bits) && col >= 0 && col < width) row[col] = bits;
      }
    }
    __syncthreads();
    if (live) {
      uint4* out = reinterpret_cast<uint4*>(dense + static_cast<int64_t>(r) * ld + c0);
      for (int i = t; i < vecs; i += TPR) out[i] = row4[i];
    }
    __syncthreads();
  }
}

// cuBLAS reads a matrix with one unit stride and the other at least its extent. torch lets a size-1 dimension carry
// any stride (a (K, 1) column seen as (1, K) has strides (1, 1)), which cuBLASLt's heuristic refuses
// (CUBLAS_STATUS_INVALID_VALUE): give such a view the strides of a contiguous layout.
at::Tensor blas_view(const at::Tensor& t) {
  const int64_t r = t.size(0), c = t.size(1);
  if (r == 1 && t.stride(1) == 1) return raw_view(t, {r, c}, {std::max<int64_t>(c, 1), 1});
  if (c == 1 && t.stride(0) == 1) return raw_view(t, {r, c}, {1, std::max<int64_t>(r, 1)});
  return t;
}

}  // namespace

at::Tensor csr_to_dense(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                        int64_t m, int64_t k) {
  constexpr const char* op = "csr_to_dense";
  check_csr(row_offsets, column_indices, op);
  PRUNEKIT_CHECK(values.is_cuda() && values.device() == row_offsets.device() &&
                     values.device() == column_indices.device(),
                 op, ": values, row_offsets and column_indices must be on one GPU");
  PRUNEKIT_CHECK(values.dim() == 1 && values.is_contiguous(), op, ": values must be a contiguous 1-D tensor");
  PRUNEKIT_CHECK(values.numel() == column_indices.numel(), op, ": values (", values.numel(), ") and column_indices (",
                 column_indices.numel(), ") must have one length");
  PRUNEKIT_CHECK(m >= 0 && k >= 0, op, ": m and k must be >= 0, got ", m, " and ", k);
  PRUNEKIT_CHECK(row_offsets.numel() == m + 1, op, ": row_offsets has ", row_offsets.numel(),
                 " entries, expected M + 1 = ", m + 1);
  PRUNEKIT_CHECK(m < (int64_t{1} << 31) && k < (int64_t{1} << 31), op, ": M and K must be < 2^31");
  const auto dtype = values.scalar_type();
  PRUNEKIT_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, op,
                 ": values must be float16, bfloat16 or float32, got ", dtype);
  const int64_t v = 16 / values.element_size();
  const int64_t ld = std::max<int64_t>(v, (k + v - 1) / v * v);
  const at::Tensor buf = at::empty({m, ld}, values.options());
  const at::Tensor dense = ld == k ? buf : buf.narrow(1, 0, k);
  if (m == 0 || k == 0) return dense;
  const c10::cuda::CUDAGuard guard(values.device());
  const int chunk = static_cast<int>(std::min<int64_t>(ld, kDenseChunkBytes / values.element_size()));
  const size_t smem = static_cast<size_t>(chunk) * values.element_size();
  const bool vec_ok = reinterpret_cast<uintptr_t>(values.data_ptr()) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(column_indices.data_ptr()) % 16 == 0;
  // Short rows (at most kDenseShortRowBytes) take one warp each, four rows per block; longer rows a whole block.
  const bool short_rows = ld * values.element_size() <= kDenseShortRowBytes;
  const int rows_per_block = short_rows ? kDenseShortRows : 1;
  const unsigned blocks = static_cast<unsigned>((m + rows_per_block - 1) / rows_per_block);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  PRUNEKIT_DISPATCH_FLOAT(dtype, [&] {
    PRUNEKIT_DISPATCH_INDEX(column_indices.scalar_type(), [&] {
      const auto* vals = reinterpret_cast<const scalar_t*>(values.data_ptr());
      const auto* cols = reinterpret_cast<const index_t*>(column_indices.data_ptr());
      auto* out = reinterpret_cast<scalar_t*>(buf.data_ptr());
      if (short_rows) {
        csr_to_dense_kernel<scalar_t, index_t, kDenseShortRows><<<blocks, kDenseThreads, smem * kDenseShortRows, stream>>>(
            vals, row_offsets.data_ptr<int>(), cols, out, static_cast<int>(m), ld, static_cast<int>(k), chunk, vec_ok);
      } else {
        csr_to_dense_kernel<scalar_t, index_t, 1><<<blocks, kDenseThreads, smem, stream>>>(
            vals, row_offsets.data_ptr<int>(), cols, out, static_cast<int>(m), ld, static_cast<int>(k), chunk, vec_ok);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return dense;
}

void spmm_csr_dense(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                    const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& bias, bool relu) {
  constexpr const char* op = "spmm_csr_dense";
  PRUNEKIT_CHECK(x.dim() == 2 && y.dim() == 2, op, ": x (K, N) and y (M, N) must be 2-D");
  const int64_t k = x.size(0), n = x.size(1), m = y.size(0);
  PRUNEKIT_CHECK(y.size(1) == n, op, ": y has ", y.size(1), " columns, x has ", n);
  PRUNEKIT_CHECK(x.scalar_type() == values.scalar_type() && y.scalar_type() == values.scalar_type(), op,
                 ": values, x and y must share one dtype");
  PRUNEKIT_CHECK(x.device() == values.device() && y.device() == values.device(), op,
                 ": every tensor must be on the values' device");
  PRUNEKIT_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->numel() == m && bias->is_contiguous() &&
                                       bias->scalar_type() == values.scalar_type()),
                 op, ": bias must be a contiguous (M,) tensor of the values' dtype");
  if (m == 0 || n == 0) return;
  const at::Tensor w = csr_to_dense(values, row_offsets, column_indices, m, k);  // (M, K)
  const at::Tensor yt = raw_t(y);                                               // (N, M)
  if (yt.is_contiguous()) {
    // nn.Linear's layout (the runtime's): Y^T = X^T W^T + bias, with bias and ReLU in cuBLASLt's epilogue where
    // torch's addmm takes that path (a 1-D bias along the result's rows).
    at::Tensor out = blas_view(yt);
    const at::Tensor xt = blas_view(raw_t(x)), wt = raw_t(w);
    if (bias.has_value() && relu) {
      at::_addmm_activation_out(out, *bias, xt, wt, 1, 1, /*use_gelu=*/false);
    } else if (bias.has_value()) {
      at::addmm_out(out, *bias, xt, wt);
    } else {
      at::mm_out(out, xt, wt);
      if (relu) out.relu_();
    }
    return;
  }
  at::Tensor out = blas_view(y);
  at::mm_out(out, w, blas_view(x));
  if (bias.has_value()) out.add_(bias->unsqueeze(1));
  if (relu) out.relu_();
}

}  // namespace prunekit
