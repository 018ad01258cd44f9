// The `dense` SpMM variant: decompress the CSR weight into a dense (M, K) scratch buffer, then one cuBLAS GEMM.
//
// "Load sparse, compute dense" at the scale of a whole layer. At large N an unstructured product is bound by the
// tensor cores, and a sparse kernel only gains where it skips whole mma tiles, which a random pattern at 90-95% does
// not allow (docs/KERNELS.md, "Bounds": the condensed-window `tc` design's ceiling is 0.70x / 0.90x of dense there).
// The decompression writes M * K elements once (32 MB for 4096 x 4096 fp16, about 12 us at the H100's 3 TB/s),
// which is small against the GEMM at N >= 128, so the product runs at nearly the speed of dense cuBLAS while the
// weight stays stored as CSR. The scratch buffer comes from torch's caching allocator for the call and is freed at its
// end: it adds M * K elements to the peak memory of one layer call, not to the weights held.
//
// Decompression: one block per row; the row (in chunks of kDenseChunk columns) is accumulated in shared memory in
// fp32 (atomicAdd: repeated columns add up, as in the reference, so the padding entries, zeros on a real column,
// are harmless; zeros are skipped), then written with 16-byte stores. Values and column indices are read as 16-byte
// vectors (the format pads each row to 16 bytes of values), each thread's first one before the shared row is cleared. The buffer's row stride is K rounded up to 16 bytes; the padding
// columns hold zeros and are not seen by the GEMM (it gets the (M, K) view).
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

constexpr int kDenseThreads = 256;
// fp32 accumulators per block: 48 KB of shared memory, the limit without an opt-in; longer rows take several chunks
// (each chunk reads the row's entries again).
constexpr int kDenseChunk = 12288;

// Add V entries (one 16-byte vector of values and its column indices) into the row's chunk [c0, c0 + width).
template <typename T, typename I, int IB>
__device__ __forceinline__ void scatter_vector(float* acc, const Words<16>& v, const Words<IB>& c, int c0, int width) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float value = word_elem<T>(v.w, j);
    const int col = word_index<I>(c.w, j) - c0;
    if (value != 0.0f && col >= 0 && col < width) atomicAdd(acc + col, value);  // padding entries hold zeros
  }
}

template <typename T, typename I>
__global__ void __launch_bounds__(kDenseThreads)
csr_to_dense_kernel(const T* __restrict__ values, const int* __restrict__ row_offsets, const I* __restrict__ cols,
                    T* __restrict__ dense, int64_t ld, int k, int chunk, bool vec_ok) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
  constexpr int IB = V * static_cast<int>(sizeof(I));   // bytes of V column indices: 8, 16 or 32
  extern __shared__ float4 acc4[];
  float* acc = reinterpret_cast<float*>(acc4);
  const int row = blockIdx.x;
  const int start = __ldg(row_offsets + row), end = __ldg(row_offsets + row + 1);
  // Vector loads where the row starts and ends on 16 bytes of values (the format pads every row so), else elements.
  const bool vec = vec_ok && start % V == 0 && end % V == 0;
  T* out = dense + static_cast<int64_t>(row) * ld;
  // Each thread's first vector is loaded before the shared memory is cleared, so that its latency overlaps the
  // clearing; a row of up to kDenseThreads * V entries (2048 in fp16) needs no other load.
  const int e0 = start + static_cast<int>(threadIdx.x) * V;
  const bool first = vec && e0 < end;
  Words<16> v0;
  Words<IB> i0;
  if (first) {
    v0.load(values + e0);
    i0.load(cols + e0);
  }
  for (int c0 = 0; c0 < k; c0 += chunk) {
    const int width = min(chunk, k - c0);
    const int padded = (width + V - 1) / V * V;  // c0 + padded <= ld: ld is K rounded up to V, chunk a multiple of V
    for (int i = threadIdx.x; i < padded / 4; i += kDenseThreads) acc4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    __syncthreads();
    if (vec) {
      if (first) scatter_vector<T, I, IB>(acc, v0, i0, c0, width);
      for (int e = e0 + kDenseThreads * V; e < end; e += kDenseThreads * V) {
        Words<16> v;
        Words<IB> i;
        v.load(values + e);
        i.load(cols + e);
        scatter_vector<T, I, IB>(acc, v, i, c0, width);
      }
    } else {
      for (int e = start + threadIdx.x; e < end; e += kDenseThreads) {
        const int c = static_cast<int>(cols[e]) - c0;
        if (c >= 0 && c < width) atomicAdd(acc + c, to_f(values[e]));
      }
    }
    __syncthreads();
    for (int i = threadIdx.x * V; i < padded; i += kDenseThreads * V) store_vec16<T>(out + c0 + i, acc + i);
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
  const int chunk = static_cast<int>(std::min<int64_t>(ld, kDenseChunk));
  const size_t smem = static_cast<size_t>(chunk) * sizeof(float);
  const bool vec_ok = reinterpret_cast<uintptr_t>(values.data_ptr()) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(column_indices.data_ptr()) % 16 == 0;
  PRUNEKIT_DISPATCH_FLOAT(dtype, [&] {
    PRUNEKIT_DISPATCH_INDEX(column_indices.scalar_type(), [&] {
      csr_to_dense_kernel<scalar_t, index_t><<<static_cast<unsigned>(m), kDenseThreads, smem,
                                               c10::cuda::getCurrentCUDAStream()>>>(
          reinterpret_cast<const scalar_t*>(values.data_ptr()), row_offsets.data_ptr<int>(),
          reinterpret_cast<const index_t*>(column_indices.data_ptr()), reinterpret_cast<scalar_t*>(buf.data_ptr()),
          ld, static_cast<int>(k), chunk, vec_ok);
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
