// Host entry points of prunekit's CUDA kernels (registered as prunekit_ext::* ops in bindings.cpp).
#pragma once

#include <ATen/ATen.h>
#include <optional>
#include <vector>

namespace prunekit {

// Sputnik-style SpMM, one subwarp per (swizzled) row, memory-bound path for small N. See spmm_rowwarp.cu.
void spmm_csr_rowwarp(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                      const at::Tensor& row_indices, const at::Tensor& x, const at::Tensor& y,
                      const std::optional<at::Tensor>& bias, bool relu, int64_t subwarp, int64_t ntile,
                      bool stage_x);

// SpMV (N = 1) and its token tile NT = 4 (N = 2-4), rowwarp's path at those N: y (M, N) with strides (ys_m, ys_n) =
// act(A @ x + bias), x (K, N) with strides (xs_k, xs_n), T the CUDA type (float, __half, __nv_bfloat16), I int16_t or
// int32_t. Launches on the current stream and returns true, or returns false without launching where spmv_takes does
// not hold or N > NT. See spmv_csr.cu.
template <typename T, typename I, int NT>
bool spmv_csr(const T* values, const int* row_offsets, const I* cols, const T* x, int64_t xs_k, int64_t xs_n, T* y,
              int64_t ys_m, int64_t ys_n, const T* bias, bool relu, int m, int n, int k);
// Whether spmv_csr runs for A (M, K) and X (K, N) of esize-byte elements: N = 1 with X within 96 KB, or N = 2-4 with
// K * 4 * esize <= 48 KB and M >= 8 rows per SM; $PRUNEKIT_SPMV not 0. The callers then leave transposed activations
// as they are (the kernel reads each token's column along K) instead of making rowwarp's row-major copy.
bool spmv_takes(int64_t m, int64_t k, int64_t n, int64_t esize);

// SpMM with X tiles staged in shared memory and shared by a block of rows, large-N path. See spmm_tiled.cu.
void spmm_csr_tiled(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                    const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& bias, bool relu,
                    int64_t rows_per_warp);

// Row-major copy of x (K, N) of any strides (coalesced reads of column-major activations), or x itself where its rows
// are contiguous and N is a multiple of 8, or N <= 1. The copy's rows are padded to a multiple of 8 columns (zeros; the
// (K, N) view is returned) and `padded` is set: a 16-byte vector load at any column < N stays inside the buffer.
// $PRUNEKIT_ROWWARP_TRANSPOSE=0: torch's x.contiguous(), unpadded. See spmm_rowwarp.cu.
at::Tensor row_major_copy(const at::Tensor& x, bool& padded);

int sm_count(int device);  // streaming multiprocessors, cached per device (spmm_entry.cu)

// Sputnik's direct SpMM: 8 / 16 / 32 lanes per row, each a 16-byte vector of X's row-major columns; other layouts of X
// are copied with row_major_copy first. See spmm_direct.cu.
void spmm_csr_direct(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                     const at::Tensor& row_indices, const at::Tensor& x, const at::Tensor& y,
                     const std::optional<at::Tensor>& bias, bool relu);

// Tensor-core SpMM on condensed 16-row windows ("load sparse, compute dense"), plan from kernels/spmm_tc_plan.py:
// frag_values (ksteps, 32, 8) A fragments, slot_rows (ksteps, 16) uint8, kstep_offsets (windows * chunks + 1,)
// int32, window_rows (windows * 16,) int32; X row-major. See spmm_tc.cu.
void spmm_csr_tc(const at::Tensor& frag_values, const at::Tensor& slot_rows, const at::Tensor& kstep_offsets,
                 const at::Tensor& window_rows, const at::Tensor& x, const at::Tensor& y,
                 const std::optional<at::Tensor>& bias, bool relu, int64_t windows_per_warp, int64_t ntile);

// Tensor-core SpMM for N <= 16 from scatter records (plan from kernels/spmm_scatter_plan.py): records (nnz,) int32,
// group_offsets (ceil(M / R) * ceil(K / 128) + 1,) int32 for strips of R = strip_rows (8 or 16) rows; kr_groups
// 128-column groups per block; workspace (>= ceil(M / R) * R * 16,) float32 and counters (>= ceil(M / R),) int32 hold
// zeros and are left zero (the plan owns them). See spmm_scatter.cu.
void spmm_csr_scatter(const at::Tensor& records, const at::Tensor& group_offsets, const at::Tensor& x,
                      const at::Tensor& y, const std::optional<at::Tensor>& bias, bool relu, int64_t kr_groups,
                      const at::Tensor& workspace, const at::Tensor& counters, int64_t strip_rows);

// The `dense` variant's decompression: the CSR weight as a dense (M, K) tensor of the values' dtype (a view of an
// (M, K rounded up to 16 bytes) buffer from the caching allocator; columns unique within a row apart from zero
// padding, as the format stores them). See spmm_dense.cu.
at::Tensor csr_to_dense(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                        int64_t m, int64_t k);

// The `dense` SpMM variant: y (M, N) = act(A @ x + bias) as csr_to_dense, then one cuBLAS GEMM (bias and ReLU in its
// epilogue where y is the transposed view of a contiguous (N, M) buffer, nn.Linear's layout). See spmm_dense.cu.
void spmm_csr_dense(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                    const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& bias, bool relu);

// The `split24` variant's residual: y (M, N_out) row-major = act([y +] R @ X^T) for a hypersparse R (M, K) in the
// SELL layout of slices of 32 rows (kernels/split24.py, residual_sell): slice s holds slots slice_offsets[s] ..
// slice_offsets[s + 1] - 1, slot e's entry for row 32 s + l at values / column_indices[32 e + l] (column -1:
// padding); values fp16/bf16, column_indices int16/int32; x (N, K) row-major; X's rows from n_valid on count as zeros.
// row_parts splits the slices over blockIdx.y (X is then staged once per part); tile_n: tokens per block (0: the
// rule, else 4, 8 or 16); slices_per_warp: 1 or 2 slices a warp works on at once; phases: diagnostics (3: all).
// See spmm_residual.cu.
void spmm_residual_rows(const at::Tensor& values, const at::Tensor& column_indices, const at::Tensor& slice_offsets,
                        const at::Tensor& x, const at::Tensor& y, int64_t n_valid, bool accumulate, bool relu,
                        int64_t row_parts, int64_t tile_n, int64_t slices_per_warp, int64_t phases);

// Sputnik-style SDDMM: out[j] = dot(a[row(j)], b[col(j)]) at each stored CSR entry. See sddmm_csr.cu.
void sddmm_csr(const at::Tensor& row_offsets, const at::Tensor& column_indices, const at::Tensor& row_indices,
               const at::Tensor& a, const at::Tensor& b, const at::Tensor& out);

// Eager entry of the CUDA-core SpMM variants (rowwarp, direct, tiled): checks, output allocation by layout.py's rule,
// the variant/tiling choice of gpu.plan_spmm, X layout and launch in one call. variant: 0 auto (never tc nor dense), 1
// rowwarp, 2 rowwarp_global, 3 direct, 4 tiled, 8 dense (gpu.SPMM_VARIANT_CODES). Returns Y (m, N). See spmm_entry.cu.
at::Tensor spmm_csr_auto(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                         const at::Tensor& row_indices, const at::Tensor& x, int64_t m,
                         const std::optional<at::Tensor>& bias, bool relu, int64_t variant);

// gpu.plan_spmm in C++: {variant code, subwarp, ntile, rows_per_warp, stage_x, windows_per_warp} for A (m, k) with
// nnz_padded stored entries times X (k, n); dtype decides whether auto may take tc (with tc_auto). See spmm_entry.cu.
std::vector<int64_t> plan_spmm_code(int64_t m, int64_t k, int64_t n, int64_t nnz_padded, int64_t num_sms,
                                    int64_t variant, std::optional<at::ScalarType> dtype, bool tc_auto);

// Shared argument checks.
void check_csr(const at::Tensor& row_offsets, const at::Tensor& column_indices, const char* op);

}  // namespace prunekit
