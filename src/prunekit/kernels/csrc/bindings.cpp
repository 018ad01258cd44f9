// Registers prunekit's CUDA kernels as torch operators in the prunekit_ext namespace.
//
// The .so has no Python bindings: it is loaded with torch.ops.load_library, so a prebuilt copy works with any Python
// version of the same torch build. The public ops (prunekit::spmm_csr, prunekit::sddmm_csr) are defined in
// kernels/ops.py and call these after choosing the variant and allocating the output.
#include <torch/library.h>

#include "kernels.h"
#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit {

void check_csr(const at::Tensor& row_offsets, const at::Tensor& column_indices, const char* op) {
  PRUNEKIT_CHECK(row_offsets.is_cuda() && column_indices.is_cuda(), op, ": CSR tensors must be on the GPU");
  PRUNEKIT_CHECK(row_offsets.scalar_type() == at::kInt && row_offsets.dim() == 1 && row_offsets.is_contiguous(), op,
              ": row_offsets must be a contiguous 1-D int32 tensor");
  PRUNEKIT_CHECK(column_indices.dim() == 1 && column_indices.is_contiguous(), op,
              ": column_indices must be a contiguous 1-D tensor");
  PRUNEKIT_CHECK(reinterpret_cast<uintptr_t>(column_indices.data_ptr()) % 16 == 0, op,
              ": column_indices must be 16-byte aligned (pass the stored tensor, not an offset view)");
}

}  // namespace prunekit

TORCH_LIBRARY(prunekit_ext, m) {
  m.def(
      "spmm_csr_rowwarp(Tensor values, Tensor row_offsets, Tensor column_indices, Tensor row_indices, Tensor x, "
      "Tensor(a!) y, Tensor? bias, bool relu, int subwarp, int ntile, bool stage_x) -> ()");
  m.def(
      "spmm_csr_tiled(Tensor values, Tensor row_offsets, Tensor column_indices, Tensor x, Tensor(a!) y, "
      "Tensor? bias, bool relu, int rows_per_warp) -> ()");
  m.def(
      "spmm_csr_direct(Tensor values, Tensor row_offsets, Tensor column_indices, Tensor row_indices, Tensor x, "
      "Tensor(a!) y, Tensor? bias, bool relu) -> ()");
  m.def(
      "spmm_csr_tc(Tensor frag_values, Tensor slot_rows, Tensor kstep_offsets, Tensor window_rows, Tensor x, "
      "Tensor(a!) y, Tensor? bias, bool relu, int windows_per_warp, int ntile) -> ()");
  m.def(
      "spmm_csr_scatter(Tensor records, Tensor group_offsets, Tensor x, Tensor(a!) y, Tensor? bias, bool relu, "
      "int kr_groups, Tensor(b!) workspace, Tensor(c!) counters, int strip_rows=8) -> ()");
  m.def(
      "spmm_csr_dense(Tensor values, Tensor row_offsets, Tensor column_indices, Tensor x, Tensor(a!) y, Tensor? bias, "
      "bool relu) -> ()");
  m.def("csr_to_dense(Tensor values, Tensor row_offsets, Tensor column_indices, int m, int k) -> Tensor");
  m.def(
      "spmm_residual_rows(Tensor values, Tensor column_indices, Tensor slice_offsets, Tensor x, Tensor(a!) y, "
      "int n_valid, bool accumulate, bool relu, int row_parts, int tile_n=0, int slices_per_warp=1, int phases=3) -> ()");
  m.def("sddmm_csr(Tensor row_offsets, Tensor column_indices, Tensor row_indices, Tensor a, Tensor b, Tensor(a!) out) -> ()");
  // The runtime's eager CSR call (spmm_entry.cu): allocates Y, chooses the CUDA-core variant, launches.
  m.def(
      "spmm_csr_auto(Tensor values, Tensor row_offsets, Tensor column_indices, Tensor row_indices, Tensor x, int m, "
      "Tensor? bias, bool relu, int variant=0) -> Tensor");
  // No tensor arguments: a catch-all kernel (gpu.plan_spmm in C++, compared with it by a GPU test).
  m.def("plan_spmm_code(int m, int k, int n, int nnz_padded, int num_sms, int variant, ScalarType? dtype, bool tc_auto) -> int[]",
        &prunekit::plan_spmm_code);
}

TORCH_LIBRARY_IMPL(prunekit_ext, CUDA, m) {
  m.impl("spmm_csr_rowwarp", &prunekit::spmm_csr_rowwarp);
  m.impl("spmm_csr_tiled", &prunekit::spmm_csr_tiled);
  m.impl("spmm_csr_direct", &prunekit::spmm_csr_direct);
  m.impl("spmm_csr_tc", &prunekit::spmm_csr_tc);
  m.impl("spmm_csr_scatter", &prunekit::spmm_csr_scatter);
  m.impl("spmm_csr_dense", &prunekit::spmm_csr_dense);
  m.impl("csr_to_dense", &prunekit::csr_to_dense);
  m.impl("spmm_residual_rows", &prunekit::spmm_residual_rows);
  m.impl("sddmm_csr", &prunekit::sddmm_csr);
  m.impl("spmm_csr_auto", &prunekit::spmm_csr_auto);
}
