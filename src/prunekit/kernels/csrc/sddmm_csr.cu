// SDDMM: out[j] = dot(A[row(j), :], B[col(j), :]) for every stored entry j of a prunekit CSR pattern, i.e.
// (A @ B^T) sampled at the pattern (Sputnik, Gale et al. SC 2020, sec. 6). With A = dY^T and B = X^T this is the
// gradient of a sparse Linear's stored values.
//
// One block of 4 warps per row, rows in row_indices order (longest first: sec. 5.3 load balance); each warp takes
// every 4th entry of the row and computes its dot product over K with 16-byte vector loads of A's row (reused from L1
// by the 4 warps) and B's row, then a warp reduction. Padding entries (a repeat of the previous column) give 0.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "common.cuh"
#include "kernels.h"
#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit {

constexpr int kSddmmWarps = 4;

template <typename T, typename I>
__global__ void __launch_bounds__(32 * kSddmmWarps)
sddmm_kernel(const int* __restrict__ row_offsets, const I* __restrict__ cols, const int* __restrict__ row_indices,
             const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int kin, bool vec_ok) {
  constexpr int V = 16 / sizeof(T);
  const int row = __ldg(row_indices + blockIdx.x);
  const int start = __ldg(row_offsets + row), end = __ldg(row_offsets + row + 1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* arow = a + static_cast<int64_t>(row) * kin;
  for (int j = start + warp; j < end; j += kSddmmWarps) {
    const int col = static_cast<int>(cols[j]);
    if (j > start && static_cast<int>(cols[j - 1]) == col) {  // padding entry (warp-uniform branch)
      if (lane == 0) out[j] = from_f<T>(0.0f);
      continue;
    }
    const T* brow = b + static_cast<int64_t>(col) * kin;
    float sum = 0.0f;
    int kk = 0;
    if (vec_ok) {
      for (kk = lane * V; kk + V <= kin; kk += 32 * V) {
        Words<16> wa, wb;
        wa.load(arow + kk);
        wb.load(brow + kk);
#pragma unroll
        for (int e = 0; e < V; ++e) sum = fmaf(word_elem<T>(wa.w, e), word_elem<T>(wb.w, e), sum);
      }
      kk = (kin / V) * V;  // residue (kin % V elements) below
      for (int r = kk + lane; r < kin; r += 32) sum = fmaf(to_f(arow[r]), to_f(brow[r]), sum);
    } else {
      for (int r = lane; r < kin; r += 32) sum = fmaf(to_f(arow[r]), to_f(brow[r]), sum);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) out[j] = from_f<T>(sum);
  }
}

void sddmm_csr(const at::Tensor& row_offsets, const at::Tensor& column_indices, const at::Tensor& row_indices,
               const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  check_csr(row_offsets, column_indices, "sddmm_csr");
  PRUNEKIT_CHECK(a.is_cuda() && b.is_cuda() && out.is_cuda(), "sddmm_csr: tensors must be on the GPU");
  PRUNEKIT_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1), "sddmm_csr: a (M, K) and b (N, K) expected");
  PRUNEKIT_CHECK(a.is_contiguous() && b.is_contiguous() && out.is_contiguous(), "sddmm_csr: a, b, out must be contiguous");
  PRUNEKIT_CHECK(a.scalar_type() == b.scalar_type() && out.scalar_type() == a.scalar_type(),
              "sddmm_csr: a, b and out must share one dtype");
  PRUNEKIT_CHECK(row_indices.scalar_type() == at::kInt && row_indices.is_contiguous(),
              "sddmm_csr: row_indices must be contiguous int32");
  const int64_t m = a.size(0), kin = a.size(1);
  PRUNEKIT_CHECK(row_offsets.numel() == m + 1 && row_indices.numel() == m, "sddmm_csr: row_offsets must be (M + 1,)");
  PRUNEKIT_CHECK(out.numel() == column_indices.numel(), "sddmm_csr: out must have one entry per stored value");
  PRUNEKIT_CHECK(m < (int64_t(1) << 31) && kin < (int64_t(1) << 31), "sddmm_csr: too large");
  if (m == 0 || out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const bool vec_ok = reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(b.data_ptr()) % 16 == 0 && (kin * a.element_size()) % 16 == 0;
  PRUNEKIT_DISPATCH_FLOAT(a.scalar_type(), [&] {
    PRUNEKIT_DISPATCH_INDEX(column_indices.scalar_type(), [&] {
      sddmm_kernel<scalar_t, index_t><<<m, 32 * kSddmmWarps, 0, c10::cuda::getCurrentCUDAStream()>>>(
          row_offsets.data_ptr<int>(), reinterpret_cast<const index_t*>(column_indices.data_ptr()),
          row_indices.data_ptr<int>(), reinterpret_cast<const scalar_t*>(a.data_ptr()),
          reinterpret_cast<const scalar_t*>(b.data_ptr()), reinterpret_cast<scalar_t*>(out.data_ptr()),
          static_cast<int>(kin), vec_ok);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace prunekit
