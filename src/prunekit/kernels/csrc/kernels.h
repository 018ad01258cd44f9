// Host entry points of prunekit's CUDA kernels (registered as prunekit_ext::* ops in bindings.cpp).
#pragma once

#include <ATen/ATen.h>
#include <optional>

namespace prunekit {

// Sputnik-style SpMM, one subwarp per (swizzled) row, memory-bound path for small N. See spmm_rowwarp.cu.
void spmm_csr_rowwarp(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                      const at::Tensor& row_indices, const at::Tensor& x, const at::Tensor& y,
                      const std::optional<at::Tensor>& bias, bool relu, int64_t subwarp, int64_t ntile,
                      bool stage_x);

// SpMM with X tiles staged in shared memory and shared by a block of rows, large-N path. See spmm_tiled.cu.
void spmm_csr_tiled(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                    const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& bias, bool relu,
                    int64_t rows_per_warp);

// Sputnik's direct SpMM: one warp per row times 32 16-byte vectors of X's row-major columns. See spmm_direct.cu.
void spmm_csr_direct(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                     const at::Tensor& row_indices, const at::Tensor& x, const at::Tensor& y,
                     const std::optional<at::Tensor>& bias, bool relu);

// Tensor-core SpMM on condensed 16-row windows ("load sparse, compute dense"), plan from kernels/spmm_tc_plan.py:
// frag_values (ksteps, 32, 8) A fragments, slot_rows (ksteps, 16) uint8, kstep_offsets (windows * chunks + 1,)
// int32, window_rows (windows * 16,) int32; X row-major. See spmm_tc.cu.
void spmm_csr_tc(const at::Tensor& frag_values, const at::Tensor& slot_rows, const at::Tensor& kstep_offsets,
                 const at::Tensor& window_rows, const at::Tensor& x, const at::Tensor& y,
                 const std::optional<at::Tensor>& bias, bool relu, int64_t windows_per_warp, int64_t ntile);

// Sputnik-style SDDMM: out[j] = dot(a[row(j)], b[col(j)]) at each stored CSR entry. See sddmm_csr.cu.
void sddmm_csr(const at::Tensor& row_offsets, const at::Tensor& column_indices, const at::Tensor& row_indices,
               const at::Tensor& a, const at::Tensor& b, const at::Tensor& out);

// Shared argument checks.
void check_csr(const at::Tensor& row_offsets, const at::Tensor& column_indices, const char* op);

}  // namespace prunekit
