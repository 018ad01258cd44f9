// Host entry of the BSR tensor-core matmul (mma.sync kernels in bsr_mm.cuh, instantiated per dtype and N tile in
// bsr_mm_<dtype>_n<BN>.cu so that they compile in parallel; the sm_90a wgmma variant in bsr_mm_wgmma.cu) and the
// torch operator registration. Two entries: bsr_mm_out (writes a given Y; benchmarks and tests force tile and
// epilogue through it) and bsr_mm (the eager call: output allocation, X layout, N-tile and variant choice all here,
// so that the runtime's eager forward is one dispatcher call with no Python-side tensor work).
#include <torch/library.h>

#include <algorithm>
#include <mutex>

#include "bsr_mm.cuh"
#include "../check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams
#include "../views.h"  // raw_t / raw_view: the entry's views without the dispatcher

namespace prunekit_structured {

extern template void dispatch_rc<__half, 32>(int, int, const BsrArgs&, int, cudaStream_t);
extern template void dispatch_rc<__half, 128>(int, int, const BsrArgs&, int, cudaStream_t);
extern template void dispatch_rc<__half, 256>(int, int, const BsrArgs&, int, cudaStream_t);
extern template void dispatch_rc<__nv_bfloat16, 32>(int, int, const BsrArgs&, int, cudaStream_t);
extern template void dispatch_rc<__nv_bfloat16, 128>(int, int, const BsrArgs&, int, cudaStream_t);
extern template void dispatch_rc<__nv_bfloat16, 256>(int, int, const BsrArgs&, int, cudaStream_t);

// bsr_mm_wgmma.cu
bool bsr_wgmma_available();
bool x_slabs_rule(int64_t r, int64_t c, int64_t k, int64_t nblocks, int64_t n);
void launch_bsr_wgmma(const at::Tensor& blocks, const at::Tensor& x, const BsrArgs& args, int grid_rows, int tile_n,
                      int64_t m, cudaStream_t stream);
bool short_rows(int64_t m, int64_t r, int64_t nblocks);
bool warp_producer_rule(int64_t m, int64_t r, int64_t n, int64_t nblocks, int64_t tile_n, int64_t sms);
bool warp_tile_n_rule(int64_t m, int64_t r, int64_t nblocks);

// bsr_decode_lean.cu: the lean decode kernel where it takes the call (N <= lean_max_n unless $PRUNEKIT_BSR_LEAN=0)
int64_t lean_warps(int64_t m, int64_t num_sms, int64_t n);  // bsr_decode_lean.cu
int64_t lean_max_n(int64_t r, int64_t c);        // bsr_decode_lean.cu
bool bsr_lean_run(const at::Tensor& blocks, const at::Tensor& crow, const at::Tensor& cols, const at::Tensor& x,
                  const at::Tensor& y, const c10::optional<at::Tensor>& bias, bool relu, cudaStream_t stream);

// Kernel variants (the `variant` argument; structured.py VARIANTS holds the same numbers).
constexpr int64_t VARIANT_AUTO = 0;   // wgmma where it takes the block shape on sm_90a, else mma.sync
constexpr int64_t VARIANT_MMA = 1;    // bsr_mm.cuh, sm_80+
constexpr int64_t VARIANT_WGMMA = 2;  // bsr_mm_wgmma.cu, sm_90a, blocks {16, 32, 64} x {16, 32, 64}
// Flag or-ed into bsr_mm's variant (structured.ROWS): x is the activations (N, K) and the result Y^T (N, M), nn.Linear's
// layout; the transposes are made here (each costs about a microsecond of host time when made in Python).
constexpr int64_t ROWS_FLAG = int64_t{1} << 8;
constexpr int DECODE_MAX_N = 32;                // structured.DECODE_MAX_N
constexpr int WIDE_TILE_MIN_BLOCKS_PER_ROW = 10;  // structured.WIDE_TILE_MIN_BLOCKS_PER_ROW
constexpr int64_t AUTO_WGMMA_16_MIN_N = 33;       // structured.AUTO_WGMMA_16_MIN_N

// N tile of the mma.sync kernel: the same rule as structured.plan_tile_n (tests compare the two on the GPU).
int64_t plan_tile_n(int64_t m, int64_t r, int64_t n, int64_t num_sms, int64_t nblocks) {
  if (n <= DECODE_MAX_N) return 32;
  const int64_t rows = std::max<int64_t>(1, m / r);
  if (r == 64 && nblocks >= 0 && nblocks < WIDE_TILE_MIN_BLOCKS_PER_ROW * rows) return 128;
  return rows * ((n + 255) / 256) >= 2 * num_sms ? 256 : 128;
}

// N tile of the wgmma variant: the same rule as structured.plan_tile_n_wgmma (a CUDA test compares the two).
int64_t plan_tile_n_wgmma(int64_t m, int64_t r, int64_t n, int64_t num_sms, int64_t nblocks) {
  const int64_t rows = std::max<int64_t>(1, m / r);
  if (r == 64 && nblocks >= 0 && nblocks < WIDE_TILE_MIN_BLOCKS_PER_ROW * rows) return 128;
  if (r == 32 && nblocks >= 0 && short_rows(m, r, nblocks)) return 128;  // with 3 stages: 3 CTAs per SM
  return n > 128 && rows * ((n + 255) / 256) >= num_sms ? 256 : 128;
}

int sm_count(int device) {
  static std::mutex mutex;
  static int counts[64] = {0};
  const std::lock_guard<std::mutex> lock(mutex);
  if (device < 0 || device >= 64) return 132;
  if (counts[device] == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
  return counts[device];
}

// y: (M, N) output with any strides; x: (K, N) with x.stride(0) == 1 and x.stride(1) % 8 == 0, 16-byte aligned.
void bsr_mm_out(const at::Tensor& blocks, const at::Tensor& crow, const at::Tensor& cols,
                const c10::optional<at::Tensor>& schedule, const c10::optional<at::Tensor>& split_rows,
                const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& bias, bool relu,
                int64_t tile_n, bool staged_epilogue, int64_t variant) {
  PRUNEKIT_CHECK(blocks.is_cuda() && x.is_cuda() && y.is_cuda(), "bsr_mm: tensors must be on the GPU");
  PRUNEKIT_CHECK(blocks.dim() == 3 && blocks.is_contiguous(), "bsr_mm: blocks must be a contiguous (nblocks, r, c)");
  PRUNEKIT_CHECK(blocks.scalar_type() == x.scalar_type() && y.scalar_type() == x.scalar_type(),
              "bsr_mm: blocks, x and y must have one dtype");
  PRUNEKIT_CHECK(crow.scalar_type() == at::kInt && cols.scalar_type() == at::kInt && crow.is_contiguous() &&
                  cols.is_contiguous(),
              "bsr_mm: crow_indices and col_indices must be contiguous int32");
  PRUNEKIT_CHECK(x.dim() == 2 && x.stride(0) == 1 && x.stride(1) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "bsr_mm: x must be K-contiguous with a leading dimension that is a multiple of 8");
  PRUNEKIT_CHECK(reinterpret_cast<uintptr_t>(blocks.data_ptr()) % 16 == 0, "bsr_mm: blocks must be 16-byte aligned");
  const int r = static_cast<int>(blocks.size(1)), c = static_cast<int>(blocks.size(2));
  const int64_t m = y.size(0), n = y.size(1);
  PRUNEKIT_CHECK(m % r == 0 && x.size(0) % c == 0 && crow.numel() == m / r + 1, "bsr_mm: shapes do not match the blocks");
  if (m == 0 || n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  BsrArgs args{};
  args.blocks = blocks.data_ptr();
  args.crow = crow.data_ptr<int>();
  args.cols = cols.data_ptr<int>();
  args.x = x.data_ptr();
  args.y = y.data_ptr();
  args.ldx = x.stride(1);
  args.sym = y.stride(0);
  args.syn = y.stride(1);
  args.n = static_cast<int>(n);
  args.relu = relu ? 1 : 0;
  const bool y16 = reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0;
  if (staged_epilogue && y16 && y.stride(0) == 1 && y.stride(1) % 8 == 0 && n > 1) {
    args.staged = 1;  // Y^T rows: the runtime's (N, M) output of x2d.t()
  } else if (staged_epilogue && y16 && y.stride(1) == 1 && y.stride(0) % 8 == 0) {
    args.staged = 2;
  }
  if (bias.has_value()) {
    PRUNEKIT_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == m,
                "bsr_mm: bias must be a contiguous (M,) tensor of x's dtype");
    args.bias = bias->data_ptr();
  }
  int grid_rows = static_cast<int>(m / r);
  at::Tensor ws;
  int64_t n_split = 0;
  if (schedule.has_value()) {
    PRUNEKIT_CHECK(schedule->scalar_type() == at::kInt && schedule->dim() == 2 && schedule->size(1) == 4 &&
                    schedule->is_contiguous(),
                "bsr_mm: schedule must be a contiguous (n_items, 4) int32 tensor");
    args.schedule = reinterpret_cast<const int4*>(schedule->data_ptr<int>());
    grid_rows = static_cast<int>(schedule->size(0));
    n_split = split_rows.has_value() ? split_rows->numel() : 0;
  }
  if (n_split > 0) {
    PRUNEKIT_CHECK(split_rows->scalar_type() == at::kInt && split_rows->is_contiguous(), "bsr_mm: split_rows int32");
  }
  // the lean decode kernel reads crow_indices and col_indices only: the (checked) schedule, the N tile and the
  // variant do not apply to it
  if (bsr_lean_run(blocks, crow, cols, x, y, bias, relu, stream)) return;
  if (n_split > 0) {
    ws = at::zeros({n_split, r, n}, x.options().dtype(at::kFloat));
    args.ws = ws.data_ptr<float>();
  }
  const bool wgmma = variant == VARIANT_WGMMA && blocks.size(0) > 0;
  args.pdl = wgmma && bsr_pdl(x.get_device()) ? 1 : 0;
  if (grid_rows > 0 && wgmma) {
    launch_bsr_wgmma(blocks, x, args, grid_rows, static_cast<int>(tile_n), m, stream);
  } else if (grid_rows > 0) {
    const bool half = x.scalar_type() == at::kHalf;
    if (half || x.scalar_type() == at::kBFloat16) {
      PRUNEKIT_CHECK(tile_n == 32 || tile_n == 128 || tile_n == 256, "bsr_mm: tile_n must be 32, 128 or 256");
      if (half) {
        tile_n == 32    ? dispatch_rc<__half, 32>(r, c, args, grid_rows, stream)
        : tile_n == 128 ? dispatch_rc<__half, 128>(r, c, args, grid_rows, stream)
                        : dispatch_rc<__half, 256>(r, c, args, grid_rows, stream);
      } else {
        tile_n == 32    ? dispatch_rc<__nv_bfloat16, 32>(r, c, args, grid_rows, stream)
        : tile_n == 128 ? dispatch_rc<__nv_bfloat16, 128>(r, c, args, grid_rows, stream)
                        : dispatch_rc<__nv_bfloat16, 256>(r, c, args, grid_rows, stream);
      }
    } else {
      PRUNEKIT_CHECK(false, "bsr_mm: CUDA kernel takes float16 or bfloat16, got ", x.scalar_type());
    }
  }
  if (n_split > 0) {
    const int64_t per_slot = static_cast<int64_t>(r) * n;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>((per_slot + 255) / 256, 1024)),
                    static_cast<unsigned>(n_split));
    const void* bptr = bias.has_value() ? bias->data_ptr() : nullptr;
    if (x.scalar_type() == at::kHalf) {
      bsr_finalize_kernel<__half><<<grid, 256, 0, stream>>>(args.ws, split_rows->data_ptr<int>(), r,
                                                             static_cast<int>(n), static_cast<const __half*>(bptr),
                                                             static_cast<__half*>(args.y), args.sym, args.syn,
                                                             args.relu);
    } else {
      bsr_finalize_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(
          args.ws, split_rows->data_ptr<int>(), r, static_cast<int>(n), static_cast<const __nv_bfloat16*>(bptr),
          static_cast<__nv_bfloat16*>(args.y), args.sym, args.syn, args.relu);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}


// The eager entry: Y (M, N) = act(A @ X + bias), allocated here by layout.py's rule (X (K, N) with unit stride along
// K and N > 1: Y is the transposed view of a contiguous (N, M); else a contiguous (M, N)). X is read in place when
// K-contiguous with a leading dimension that is a multiple of 8 (the runtime's x2d.t()), else copied once. variant:
// VARIANT_AUTO / _MMA / _WGMMA, or-ed with ROWS_FLAG for x (N, K) and the result (N, M). No host synchronisation,
// one kernel launch (two for static schedules with split rows).
at::Tensor bsr_mm(const at::Tensor& blocks, const at::Tensor& crow, const at::Tensor& cols,
                  const c10::optional<at::Tensor>& schedule, const c10::optional<at::Tensor>& split_rows,
                  const at::Tensor& x_in, int64_t m, const c10::optional<at::Tensor>& bias, bool relu, int64_t variant) {
  const bool rows = variant & ROWS_FLAG;
  variant &= ~ROWS_FLAG;
  PRUNEKIT_CHECK(x_in.dim() == 2 && blocks.dim() == 3, "bsr_mm: x must be 2-D and blocks (nblocks, r, c)");
  const at::Tensor x = rows ? prunekit::raw_t(x_in) : x_in;
  const int64_t k = x.size(0), n = x.size(1);
  const bool transposed_io = n > 1 && x.stride(0) == 1 && x.stride(1) != 1;
  const at::Tensor buf = transposed_io ? at::empty({n, m}, x.options()) : at::empty({m, n}, x.options());
  const at::Tensor y = transposed_io ? prunekit::raw_t(buf) : buf;
  // rows: the (N, M) buffer itself where Y is its transposed view (one view fewer per call)
  const at::Tensor out = rows ? (transposed_io ? buf : prunekit::raw_t(y)) : y;
  if (m == 0 || n == 0) return out;
  at::Tensor xk = x;
  const bool aligned = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  if (n == 1 && x.stride(0) == 1 && aligned && k % 8 == 0) {
    const int64_t sizes[2] = {k, 1}, strides[2] = {1, k};
    xk = prunekit::raw_view(x, sizes, strides);  // one column: its leading dimension never addresses memory
  } else if (!(x.stride(0) == 1 && x.stride(1) % 8 == 0 && x.stride(1) >= k && aligned)) {
    xk = at::empty({n, k}, x.options()).copy_(x.t()).t();
  }
  at::Tensor blocks_c = blocks;
  if (!blocks.is_contiguous() || reinterpret_cast<uintptr_t>(blocks.data_ptr()) % 16 != 0)
    blocks_c = blocks.contiguous().clone();
  auto as_int = [](const at::Tensor& t) {
    return t.scalar_type() == at::kInt && t.is_contiguous() ? t : t.to(at::kInt).contiguous();
  };
  c10::optional<at::Tensor> bias_c = bias;
  if (bias.has_value() && (bias->scalar_type() != x.scalar_type() || !bias->is_contiguous()))
    bias_c = bias->to(x.scalar_type()).contiguous();
  c10::optional<at::Tensor> sched_c, split_c;
  if (schedule.has_value()) sched_c = as_int(*schedule);
  if (split_rows.has_value()) split_c = as_int(*split_rows);
  const int64_t r = blocks.size(1);
  const int sms = sm_count(x.get_device());
  int64_t tile_n;
  // auto: the wgmma variant on an sm_90a build for 32- and 64-row blocks, and for 16-row blocks at
  // N >= AUTO_WGMMA_16_MIN_N (structured.auto_takes_wgmma, measured)
  const int64_t c = blocks.size(2);
  const bool rows_take = r == 64 || r == 32 || (r == 16 && n >= AUTO_WGMMA_16_MIN_N);
  if (variant == VARIANT_AUTO && rows_take && (c == 16 || c == 32 || c == 64) && blocks.size(0) > 0 &&
      bsr_wgmma_available())
    variant = VARIANT_WGMMA;
  if (variant == VARIANT_WGMMA) {
    tile_n = plan_tile_n_wgmma(m, r, n, sms, blocks.size(0));
  } else {
    PRUNEKIT_CHECK(variant == VARIANT_AUTO || variant == VARIANT_MMA, "bsr_mm: unknown variant ", variant);
    variant = VARIANT_MMA;
    tile_n = plan_tile_n(m, r, n, sms, blocks.size(0));
  }
  bsr_mm_out(blocks_c, as_int(crow), as_int(cols), sched_c, split_c, xk, y, bias_c, relu, tile_n, true, variant);
  return out;
}

bool wgmma_available_op() { return bsr_wgmma_available(); }

}  // namespace prunekit_structured

TORCH_LIBRARY(prunekit_structured, m) {
  m.def(
      "bsr_mm_out(Tensor blocks, Tensor crow_indices, Tensor col_indices, Tensor? schedule, Tensor? split_rows, "
      "Tensor x, Tensor(a!) y, Tensor? bias, bool relu, int tile_n, bool staged_epilogue, int variant=0) -> ()");
  m.def(
      "bsr_mm(Tensor blocks, Tensor crow_indices, Tensor col_indices, Tensor? schedule, Tensor? split_rows, Tensor x, "
      "int m, Tensor? bias, bool relu, int variant=0) -> Tensor");
  // No tensor arguments: catch-all kernels.
  m.def("plan_tile_n(int m, int r, int n, int num_sms, int nblocks) -> int", &prunekit_structured::plan_tile_n);
  m.def("plan_tile_n_wgmma(int m, int r, int n, int num_sms, int nblocks) -> int",
        &prunekit_structured::plan_tile_n_wgmma);
  m.def("lean_warps(int m, int num_sms, int n=16) -> int", &prunekit_structured::lean_warps);
  m.def("lean_max_n(int r, int c) -> int", &prunekit_structured::lean_max_n);
  m.def("wgmma_available() -> bool", &prunekit_structured::wgmma_available_op);
  m.def("x_slabs_rule(int r, int c, int k, int nblocks, int n) -> bool", &prunekit_structured::x_slabs_rule);
  m.def("short_rows(int m, int r, int nblocks) -> bool", &prunekit_structured::short_rows);
  m.def("warp_producer_rule(int m, int r, int n, int nblocks, int tile_n, int num_sms) -> bool",
        &prunekit_structured::warp_producer_rule);
  m.def("warp_tile_n_rule(int m, int r, int nblocks) -> bool", &prunekit_structured::warp_tile_n_rule);
}

TORCH_LIBRARY_IMPL(prunekit_structured, CUDA, m) {
  m.impl("bsr_mm_out", &prunekit_structured::bsr_mm_out);
  m.impl("bsr_mm", &prunekit_structured::bsr_mm);
}
