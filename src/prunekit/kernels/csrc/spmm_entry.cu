// Eager host entry of the CUDA-core SpMM kernels: prunekit_ext::spmm_csr_auto does in one dispatcher call what the
// Python launcher gpu.spmm_csr does for the rowwarp, direct, tiled and dense variants (argument checks, output allocation by
// layout.py's rule, the variant and tiling choice of gpu.plan_spmm, a row-major copy of X where the variant needs
// one, the launch on the current stream), so that the runtime's eager forward of a CSR layer costs no Python-side
// tensor work. No host synchronisation, no .item(). The tensor-core variant (tc) is not taken here: its plan is a
// Python object built once per weight (spmm_tc_plan.py), so gpu.py's decision function sends those calls to the
// Python launcher. prunekit_ext::plan_spmm_code exports the plan so that a GPU test checks it equals gpu.plan_spmm.
// Host code only, in a .cu file: nvcc supplies the CUDA runtime headers of the SM-count query, so that
// scripts/compile_check.py compiles it on machines where torch has no CUDA_HOME.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <vector>

#include "kernels.h"
#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams
#include "views.h"  // raw_t: the entry's views without the dispatcher

namespace prunekit {

namespace {

// Variant codes: gpu.py SPMM_VARIANT_CODES holds the same numbers (the `variant` argument of both ops, and the
// first entry of plan_spmm_code's result, where rowwarp_global comes back as rowwarp with stage_x = 0).
constexpr int64_t kAuto = 0;
constexpr int64_t kRowwarp = 1;
constexpr int64_t kRowwarpGlobal = 2;
constexpr int64_t kDirect = 3;
constexpr int64_t kTiled = 4;
constexpr int64_t kTc = 5;
constexpr int64_t kScatter = 6;  // decode tensor-core variant (spmm_scatter.cu): planned here, run by gpu.spmm_csr
constexpr int64_t kBitmap = 7;   // decode bitmap variant (structured/nm24/nm24_decode.cu): likewise
// The weight decompressed, then cuBLAS (spmm_dense.cu): run here when forced; "auto" never takes it here (its density
// rule is gpu.py's, which passes this code where it chooses dense).
constexpr int64_t kDense = 8;
// Flag or-ed into spmm_csr_auto's variant (gpu.SPMM_ROWS): x is the activations (N, K) and the result Y^T (N, M),
// nn.Linear's layout; the transposes are made here (each costs about a microsecond of host time when made in Python).
constexpr int64_t kRowsFlag = int64_t{1} << 8;

// gpu.py's tiling constants (same names there).
constexpr int64_t ROWWARP_MAX_N = 64;
constexpr int64_t TC_MIN_N = 65;
constexpr int64_t TC_MIN_DENSITY_DENOMINATOR = 16;  // gpu.tc_min_density_denominator: N > 128, K > 1024
constexpr int64_t TC_SMALL_N = 128;
constexpr int64_t TC_MIN_DENSITY_DENOMINATOR_SMALL_N = 4;
constexpr int64_t TC_SMALL_K = 1024;
constexpr int64_t TC_MIN_DENSITY_DENOMINATOR_SMALL_K = 8;
constexpr int64_t SUBWARP_MIN_NNZ = 128;
constexpr int64_t STAGE_X_MIN_N = 32;
constexpr int64_t STAGE_X_MIN_ROWS_PER_SM = 16;
// gpu.decode_stages_x (thirty-second session): at N 9-16 in 16-bit types, the shared copy of X where K x 16 tokens fit,
// M gives enough rows per SM and the padded density is at least 1 / DECODE_STAGE_X_MIN_DENSITY_DENOMINATOR
constexpr int64_t DECODE_STAGE_X_MIN_N = 9;   // gpu.SCATTER_MIN_N
constexpr int64_t DECODE_STAGE_X_MAX_N = 16;  // gpu.BITMAP_MAX_N
constexpr int64_t DECODE_STAGE_X_MAX_BYTES = 232448;  // 227 KB
constexpr int64_t DECODE_STAGE_X_MIN_ROWS_PER_SM = 31;
constexpr int64_t DECODE_STAGE_X_MIN_DENSITY_DENOMINATOR = 30;
constexpr int64_t DECODE_STAGE_X_SHORT_ROWS_MIN_ROWS_PER_SM = 100;  // any rows from here (thirty-third session)
constexpr int64_t TILED_BIG_ROWS_PER_BLOCK = 64;  // TILED_ROWS_PER_BLOCK[8]
constexpr int64_t TILED_N_TILE = 128;
constexpr int64_t TC_WARPS = 8;
constexpr std::array<std::array<int64_t, 2>, 3> TC_TILES{{{2, 128}, {1, 128}, {1, 64}}};  // (windows_per_warp, ntile)

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

}  // namespace

// Streaming multiprocessors of a device (kernels.h), cached per device.
int sm_count(int device) {
  static std::array<std::atomic<int>, 64> counts{};  // per device, filled on first use (a race writes one value)
  if (device < 0 || device >= 64) {
    int value = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device));
    return value;
  }
  int value = counts[device].load(std::memory_order_relaxed);
  if (value == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device));
    counts[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

std::array<int64_t, 6> plan_spmm(int64_t m, int64_t k, int64_t n, int64_t nnz_padded, int64_t num_sms,
                                 int64_t variant, bool tensor_core_dtype, bool tc_auto) {
  // Result: {variant, subwarp, ntile, rows_per_warp, stage_x, windows_per_warp}, the fields of gpu.SpmmPlan with its
  // defaults {-, 32, 16, 8, 1, 1} where a variant leaves one unset.
  PRUNEKIT_CHECK(variant >= kAuto && variant <= kDense, "plan_spmm_code: unknown variant code ", variant,
              " (0 auto, 1 rowwarp, 2 rowwarp_global, 3 direct, 4 tiled, 5 tc, 6 scatter, 7 bitmap, 8 dense)");
  bool stage_x;
  if (variant == kAuto) {
    variant = n <= ROWWARP_MAX_N ? kRowwarp : kDirect;
    const int64_t tc_den = n <= TC_SMALL_N   ? TC_MIN_DENSITY_DENOMINATOR_SMALL_N
                           : k <= TC_SMALL_K ? TC_MIN_DENSITY_DENOMINATOR_SMALL_K
                                             : TC_MIN_DENSITY_DENOMINATOR;
    if (tensor_core_dtype && n >= TC_MIN_N && tc_auto && nnz_padded * tc_den >= m * k) variant = kTc;
    stage_x = n >= STAGE_X_MIN_N && m >= STAGE_X_MIN_ROWS_PER_SM * num_sms && nnz_padded >= 2 * k * num_sms;
    if (tensor_core_dtype && n >= DECODE_STAGE_X_MIN_N && n <= DECODE_STAGE_X_MAX_N &&
        k * DECODE_STAGE_X_MAX_N * 2 <= DECODE_STAGE_X_MAX_BYTES && m >= DECODE_STAGE_X_MIN_ROWS_PER_SM * num_sms) {
      // 32-lane rows from density 1/30; any rows from DECODE_STAGE_X_SHORT_ROWS_MIN_ROWS_PER_SM rows per SM
      stage_x = m >= DECODE_STAGE_X_SHORT_ROWS_MIN_ROWS_PER_SM * num_sms ||
                (nnz_padded * DECODE_STAGE_X_MIN_DENSITY_DENOMINATOR >= m * k &&
                 nnz_padded >= SUBWARP_MIN_NNZ * std::max<int64_t>(1, m));
    }
  } else {
    stage_x = variant != kRowwarpGlobal;
  }
  if (variant == kDirect || variant == kDense) return {variant, 32, 16, 8, 1, 1};
  // Forced only: "auto" never takes scatter or bitmap here (gpu.eager_spmm_code sends such calls to gpu.spmm_csr), and its
  // k-split (gpu.scatter_kr_groups) is not part of this result.
  if (variant == kScatter || variant == kBitmap) return {variant, 32, 16, 8, 1, 1};
  if (variant == kTc) {
    const int64_t windows = ceil_div(m, 16);
    int64_t wpw = 0, ntile = 0;
    for (const auto& tile : TC_TILES) {  // largest tile giving at least one block per SM, else the smallest
      wpw = tile[0];
      ntile = tile[1];
      if (ceil_div(windows, TC_WARPS * wpw) * ceil_div(n, ntile) >= num_sms) break;
    }
    return {kTc, 32, ntile, 8, 1, wpw};
  }
  if (variant == kRowwarp || variant == kRowwarpGlobal) {
    // gpu.py: nnz_padded / max(1, m) >= SUBWARP_MIN_NNZ, exact in integers.
    const int64_t subwarp = nnz_padded >= SUBWARP_MIN_NNZ * std::max<int64_t>(1, m) ? 32 : 8;
    const int64_t ntile = n <= 1 ? 1 : n <= 4 ? 4 : n <= 8 ? 8 : 16;
    return {kRowwarp, subwarp, ntile, 8, stage_x ? 1 : 0, 1};
  }
  const int64_t big_blocks = ceil_div(m, TILED_BIG_ROWS_PER_BLOCK) * ceil_div(n, TILED_N_TILE);
  return {kTiled, 32, 16, big_blocks >= 2 * num_sms ? 8 : 2, 1, 1};
}

std::vector<int64_t> plan_spmm_code(int64_t m, int64_t k, int64_t n, int64_t nnz_padded, int64_t num_sms,
                                    int64_t variant, std::optional<at::ScalarType> dtype, bool tc_auto) {
  const bool tensor_core_dtype = dtype.has_value() && (*dtype == at::kHalf || *dtype == at::kBFloat16);
  const auto plan = plan_spmm(m, k, n, nnz_padded, num_sms, variant, tensor_core_dtype, tc_auto);
  return std::vector<int64_t>(plan.begin(), plan.end());
}

at::Tensor spmm_csr_auto(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                         const at::Tensor& row_indices, const at::Tensor& x_in, int64_t m,
                         const std::optional<at::Tensor>& bias, bool relu, int64_t variant) {
  constexpr const char* op = "spmm_csr_auto";
  const bool rows = variant & kRowsFlag;
  variant &= ~kRowsFlag;
  PRUNEKIT_CHECK(x_in.dim() == 2, op, ": x must be 2-D (", rows ? "N, K" : "K, N", "), got shape ", x_in.sizes());
  const at::Tensor x = rows ? prunekit::raw_t(x_in) : x_in;
  PRUNEKIT_CHECK(values.dim() == 1 && column_indices.dim() == 1 && row_offsets.dim() == 1 && row_indices.dim() == 1, op,
              ": values, column_indices, row_offsets and row_indices must be 1-D");
  PRUNEKIT_CHECK(x.is_cuda(), op, ": x must be on the GPU, got ", x.device());
  const auto device = x.device();
  PRUNEKIT_CHECK(values.device() == device && row_offsets.device() == device && column_indices.device() == device &&
                  row_indices.device() == device && (!bias.has_value() || bias->device() == device),
              op, ": every tensor must be on x's device (", device, ")");
  const auto dtype = x.scalar_type();
  PRUNEKIT_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, op,
              ": x must be float16, bfloat16 or float32, got ", dtype);
  PRUNEKIT_CHECK(values.scalar_type() == dtype, op, ": values (", values.scalar_type(), ") and x (", dtype,
              ") must share one dtype (gpu.spmm_csr converts mixed precision)");
  PRUNEKIT_CHECK(row_offsets.scalar_type() == at::kInt && row_indices.scalar_type() == at::kInt, op,
              ": row_offsets and row_indices must be int32");
  PRUNEKIT_CHECK(column_indices.scalar_type() == at::kShort || column_indices.scalar_type() == at::kInt, op,
              ": column_indices must be int16 or int32, got ", column_indices.scalar_type());
  PRUNEKIT_CHECK((variant >= kAuto && variant <= kTiled) || variant == kDense, op,
              ": variant code must be 0-4 or 8 (auto, rowwarp, rowwarp_global, direct, tiled, dense), got ", variant,
              "; the tensor-core variants (tc, scatter) run through gpu.spmm_csr");
  PRUNEKIT_CHECK(m >= 0, op, ": m must be >= 0, got ", m);
  PRUNEKIT_CHECK(row_offsets.numel() == m + 1, op, ": row_offsets has ", row_offsets.numel(), " entries, expected M + 1 = ",
              m + 1);
  PRUNEKIT_CHECK(row_indices.numel() == m, op, ": row_indices has ", row_indices.numel(), " entries, expected M = ", m);
  PRUNEKIT_CHECK(column_indices.numel() == values.numel(), op, ": column_indices (", column_indices.numel(),
              ") and values (", values.numel(), ") must have one length");
  PRUNEKIT_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->numel() == m), op, ": bias must be (M,) = (", m, ",)");

  // Output by layout.py's rule: a column-major X (the runtime's x2d.t(), N > 1) gives the transposed view of a
  // contiguous (N, M) buffer, anything else a contiguous (M, N).
  const int64_t k = x.size(0), n = x.size(1);
  const bool transposed_io = n > 1 && x.stride(0) == 1 && x.stride(1) != 1;
  const at::Tensor buf = transposed_io ? at::empty({n, m}, x.options()) : at::empty({m, n}, x.options());
  const at::Tensor y = transposed_io ? prunekit::raw_t(buf) : buf;
  // rows: the (N, M) buffer itself where Y is its transposed view (one view op fewer per call)
  const at::Tensor out = rows ? (transposed_io ? buf : prunekit::raw_t(y)) : y;
  if (m == 0 || n == 0) return out;

  std::optional<at::Tensor> bias_c = bias;
  if (bias.has_value() && (bias->scalar_type() != dtype || !bias->is_contiguous()))
    bias_c = bias->to(dtype).contiguous();
  // Copy only what the kernels cannot take as stored (16-byte vector loads of values and column indices).
  const at::Tensor values_c =
      values.is_contiguous() && aligned16(values) ? values : values.clone(at::MemoryFormat::Contiguous);
  const at::Tensor cols_c = column_indices.is_contiguous() && aligned16(column_indices)
                                ? column_indices
                                : column_indices.clone(at::MemoryFormat::Contiguous);
  const at::Tensor offsets_c = row_offsets.contiguous();
  const at::Tensor rows_c = row_indices.contiguous();

  // tc_auto false: the entry never takes the tensor-core plan; the 16-bit flag still decides the decode copy of X
  // (plan_spmm_code(..., dtype, tc_auto=False) gives this same plan)
  const bool half_dtype = dtype == at::kHalf || dtype == at::kBFloat16;
  const auto plan = plan_spmm(m, k, n, values_c.numel(), sm_count(x.get_device()), variant, half_dtype, false);
  switch (plan[0]) {
    case kRowwarp:
      // X as it is: the launcher transposes transposed activations itself (spmm_rowwarp.cu, row_major_x), except where
      // the SpMV kernel takes them as they are (spmv_csr.cu).
      spmm_csr_rowwarp(values_c, offsets_c, cols_c, rows_c, x, y, bias_c, relu, plan[1], plan[2], plan[4] != 0);
      break;
    case kDirect:
      // X as it is: the launcher copies other layouts to row-major itself (spmm_direct.cu, row_major_copy).
      spmm_csr_direct(values_c, offsets_c, cols_c, rows_c, x, y, bias_c, relu);
      break;
    case kTiled: {
      // The tiled kernel reads row-major X and the transposed view of a row-major (N, K) buffer.
      const at::Tensor xr = x.stride(1) == 1 || transposed_io ? x : x.contiguous();
      spmm_csr_tiled(values_c, offsets_c, cols_c, xr, y, bias_c, relu, plan[3]);
      break;
    }
    case kDense:  // X as it is: cuBLAS reads either layout
      spmm_csr_dense(values_c, offsets_c, cols_c, x, y, bias_c, relu);
      break;
    default:
      PRUNEKIT_CHECK(false, op, ": internal error, plan chose variant code ", plan[0]);
  }
  return out;
}

}  // namespace prunekit
