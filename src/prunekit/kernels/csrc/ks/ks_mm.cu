// Host entry of the Kronecker-sparse matmul (kernels in ks_mm.cuh) and its torch operator registration
// (namespace prunekit_ks; the Python op prunekit::ks_mm in kernels/ks.py calls ks_mm_out).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ks_mm.cuh"

namespace prunekit_ks {

namespace {

template <typename T>
void launch_tc(const KsArgs& args, int tile_rows, int vec_w, int vec_x, cudaStream_t stream) {
  const int64_t groups = static_cast<int64_t>(args.a) * args.d;
  const dim3 grid(static_cast<unsigned>(groups), static_cast<unsigned>((args.n + TC_BN - 1) / TC_BN),
                  static_cast<unsigned>((args.b + tile_rows - 1) / tile_rows));
  if (tile_rows == 128) {
    ks_mm_tc_kernel<T, 128><<<grid, TC_THREADS, 0, stream>>>(args, vec_w, vec_x);
  } else {
    ks_mm_tc_kernel<T, 64><<<grid, TC_THREADS, 0, stream>>>(args, vec_w, vec_x);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

// w: (a, d, b, c) contiguous; x: (a*c*d, N) any strides; y: (a*b*d, N) any strides; bias: (a*b*d,) or none.
void ks_mm_out(const at::Tensor& w, const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& bias,
               bool relu, int64_t tile_rows) {
  TORCH_CHECK(w.is_cuda() && x.is_cuda() && y.is_cuda(), "ks_mm: tensors must be on the GPU");
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous(), "ks_mm: blocks must be a contiguous (a, d, b, c) tensor");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && y.scalar_type() == x.scalar_type(),
              "ks_mm: blocks, x and y must have one dtype");
  const int64_t a = w.size(0), d = w.size(1), b = w.size(2), c = w.size(3);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == a * c * d, "ks_mm: x must be (a*c*d, N)");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == a * b * d && y.size(1) == x.size(1), "ks_mm: y must be (a*b*d, N)");
  TORCH_CHECK(tile_rows == 64 || tile_rows == 128, "ks_mm: tile_rows must be 64 or 128");
  TORCH_CHECK(x.size(1) <= INT32_MAX && b <= INT32_MAX && c <= INT32_MAX && a * d <= INT32_MAX,
              "ks_mm: sizes exceed the kernel's 32-bit tile indices");
  TORCH_CHECK((x.size(1) + TC_BN - 1) / TC_BN <= 65535 && (b + 63) / 64 <= 65535, "ks_mm: grid too large");
  if (y.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  KsArgs args{};
  args.w = w.data_ptr();
  args.x = x.data_ptr();
  args.y = y.data_ptr();
  args.sxk = x.stride(0);
  args.sxn = x.stride(1);
  args.sym = y.stride(0);
  args.syn = y.stride(1);
  args.a = static_cast<int>(a);
  args.b = static_cast<int>(b);
  args.c = static_cast<int>(c);
  args.d = static_cast<int>(d);
  args.n = static_cast<int>(x.size(1));
  args.relu = relu ? 1 : 0;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == a * b * d &&
                    bias->is_cuda(),
                "ks_mm: bias must be a contiguous (a*b*d,) GPU tensor of x's dtype");
    args.bias = bias->data_ptr();
  }
  if (x.scalar_type() == at::kFloat) {
    const int64_t groups = a * d;
    const dim3 grid(static_cast<unsigned>(groups), static_cast<unsigned>((args.n + F_BN - 1) / F_BN),
                    static_cast<unsigned>((b + F_BM - 1) / F_BM));
    ks_mm_f32_kernel<<<grid, F_THREADS, 0, stream>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int vec_w = (c % 8 == 0 && aligned16(args.w)) ? 1 : 0;
  int vec_x = 0;  // 1: batch-last 16-byte rows; 2: batch-first, d == 1, 16-byte runs of gamma
  if (args.sxn == 1 && args.sxk % 8 == 0 && aligned16(args.x)) {
    vec_x = 1;
  } else if (args.sxk == 1 && args.sxn % 8 == 0 && d == 1 && c % 8 == 0 && aligned16(args.x)) {
    vec_x = 2;
  }
  if (x.scalar_type() == at::kHalf) {
    launch_tc<__half>(args, static_cast<int>(tile_rows), vec_w, vec_x, stream);
  } else if (x.scalar_type() == at::kBFloat16) {
    launch_tc<__nv_bfloat16>(args, static_cast<int>(tile_rows), vec_w, vec_x, stream);
  } else {
    TORCH_CHECK(false, "ks_mm: CUDA kernel takes float32, float16 or bfloat16, got ", x.scalar_type());
  }
}

}  // namespace prunekit_ks

TORCH_LIBRARY(prunekit_ks, m) {
  m.def("ks_mm_out(Tensor blocks, Tensor x, Tensor(a!) y, Tensor? bias, bool relu, int tile_rows) -> ()");
}

TORCH_LIBRARY_IMPL(prunekit_ks, CUDA, m) { m.impl("ks_mm_out", &prunekit_ks::ks_mm_out); }
