// Host entry of the Kronecker-sparse matmul (tensor-core kernels in ks_mm.cuh, instantiated in ks_mm_f16.cu and
// ks_mm_bf16.cu; the fp32 CUDA-core kernel here) and its torch operator registration
// (namespace prunekit_ks; the Python op prunekit::ks_mm in kernels/ks.py calls ks_mm_out).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ks_mm.cuh"
#include "../check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit_ks {

extern template void launch_tc<__half>(const KsArgs&, int, int, int, int, cudaStream_t);
extern template void launch_tc<__nv_bfloat16>(const KsArgs&, int, int, int, int, cudaStream_t);

// ---------------------------------------------------------------------------------------------------------------
// CUDA-core kernel (fp32): 128 x 128 x 8 tiles, 8 x 8 outputs per thread
// ---------------------------------------------------------------------------------------------------------------

constexpr int F_BM = 128;
constexpr int F_BN = 128;
constexpr int F_BK = 8;
constexpr int F_THREADS = 256;

__global__ void __launch_bounds__(F_THREADS, 2) ks_mm_f32_kernel(KsArgs args) {
  __shared__ __align__(16) float a_s[F_BK][F_BM + 4];  // transposed: (gamma, beta)
  __shared__ __align__(16) float b_s[F_BK][F_BN + 4];

  const int tid = threadIdx.x;
  const int tx = tid % 16, ty = tid / 16;
  const int g = blockIdx.x;
  const int alpha = g / args.d, delta = g % args.d;
  const int n0 = blockIdx.y * F_BN;
  const int beta0 = blockIdx.z * F_BM;
  const int b = args.b, c = args.c, d = args.d, n_total = args.n;
  const float* w_g = static_cast<const float*>(args.w) + static_cast<int64_t>(g) * b * c;
  const float* x = static_cast<const float*>(args.x);
  const int64_t x_row0 = static_cast<int64_t>(alpha) * c * d + delta;
  const bool batch_last = args.sxn == 1;

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

  for (int k0 = 0; k0 < c; k0 += F_BK) {
#pragma unroll
    for (int t = 0; t < (F_BM * F_BK) / F_THREADS; ++t) {
      const int e = tid + t * F_THREADS;
      const int kk = e % F_BK, r = e / F_BK;
      const int beta = beta0 + r, gamma = k0 + kk;
      a_s[kk][r] = (beta < b && gamma < c) ? w_g[static_cast<int64_t>(beta) * c + gamma] : 0.0f;
    }
#pragma unroll
    for (int t = 0; t < (F_BK * F_BN) / F_THREADS; ++t) {
      const int e = tid + t * F_THREADS;
      const int kk = batch_last ? e / F_BN : e % F_BK;
      const int nn = batch_last ? e % F_BN : e / F_BK;
      const int gamma = k0 + kk, n = n0 + nn;
      b_s[kk][nn] = (gamma < c && n < n_total) ? x[(x_row0 + static_cast<int64_t>(gamma) * d) * args.sxk +
                                                   static_cast<int64_t>(n) * args.sxn]
                                               : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < F_BK; ++kk) {
      float ra[8], rb[8];
      const float4 a0 = *reinterpret_cast<const float4*>(&a_s[kk][ty * 4]);
      const float4 a1 = *reinterpret_cast<const float4*>(&a_s[kk][64 + ty * 4]);
      const float4 b0 = *reinterpret_cast<const float4*>(&b_s[kk][tx * 4]);
      const float4 b1 = *reinterpret_cast<const float4*>(&b_s[kk][64 + tx * 4]);
      ra[0] = a0.x, ra[1] = a0.y, ra[2] = a0.z, ra[3] = a0.w, ra[4] = a1.x, ra[5] = a1.y, ra[6] = a1.z, ra[7] = a1.w;
      rb[0] = b0.x, rb[1] = b0.y, rb[2] = b0.z, rb[3] = b0.w, rb[4] = b1.x, rb[5] = b1.y, rb[6] = b1.z, rb[7] = b1.w;
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(ra[i], rb[j], acc[i][j]);
    }
    __syncthreads();
  }

  float* y = static_cast<float*>(args.y);
  const float* bias = static_cast<const float*>(args.bias);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int beta = beta0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
    if (beta >= b) continue;
    const int64_t m = (static_cast<int64_t>(alpha) * b + beta) * d + delta;
    const float bv = bias != nullptr ? bias[m] : 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int n = n0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + (j - 4));
      if (n < n_total) {
        float v = acc[i][j] + bv;
        if (args.relu) v = fmaxf(v, 0.0f);
        y[m * args.sym + static_cast<int64_t>(n) * args.syn] = v;
      }
    }
  }
}


namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

// w: (a, d, b, c) contiguous; x: (a*c*d, N) any strides; y: (a*b*d, N) any strides; bias: (a*b*d,) or none.
void ks_mm_out(const at::Tensor& w, const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& bias,
               bool relu, int64_t tile_rows, int64_t pipelined) {
  PRUNEKIT_CHECK(w.is_cuda() && x.is_cuda() && y.is_cuda(), "ks_mm: tensors must be on the GPU");
  PRUNEKIT_CHECK(w.dim() == 4 && w.is_contiguous(), "ks_mm: blocks must be a contiguous (a, d, b, c) tensor");
  PRUNEKIT_CHECK(w.scalar_type() == x.scalar_type() && y.scalar_type() == x.scalar_type(),
              "ks_mm: blocks, x and y must have one dtype");
  const int64_t a = w.size(0), d = w.size(1), b = w.size(2), c = w.size(3);
  PRUNEKIT_CHECK(x.dim() == 2 && x.size(0) == a * c * d, "ks_mm: x must be (a*c*d, N)");
  PRUNEKIT_CHECK(y.dim() == 2 && y.size(0) == a * b * d && y.size(1) == x.size(1), "ks_mm: y must be (a*b*d, N)");
  PRUNEKIT_CHECK(tile_rows == 64 || tile_rows == 128, "ks_mm: tile_rows must be 64 or 128");
  PRUNEKIT_CHECK(x.size(1) <= INT32_MAX && b <= INT32_MAX && c <= INT32_MAX && a * d <= INT32_MAX,
              "ks_mm: sizes exceed the kernel's 32-bit tile indices");
  PRUNEKIT_CHECK((x.size(1) + TC_BN - 1) / TC_BN <= 65535 && (b + 63) / 64 <= 65535, "ks_mm: grid too large");
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
    PRUNEKIT_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == a * b * d &&
                    bias->is_cuda(),
                "ks_mm: bias must be a contiguous (a*b*d,) GPU tensor of x's dtype");
    args.bias = bias->data_ptr();
  }
  if (x.scalar_type() == at::kFloat && pipelined == 3) {  // 3xTF32 on tensor cores (ks_mm_tf32.cu)
    PRUNEKIT_CHECK((args.n + 127) / 128 <= 65535, "ks_mm: grid too large");
    launch_tf32x3(args, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  PRUNEKIT_CHECK(pipelined != 3, "ks_mm: the 3xTF32 kernel takes float32 only");
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
  if (pipelined == 2) {  // batch-first delta-block kernel: its width and layout conditions (ks_mm.cuh)
    const int elt = static_cast<int>(x.element_size());
    const auto align_elems = [elt](const void* p) {
      const auto a = reinterpret_cast<uintptr_t>(p);
      const int bytes = a % 16 == 0 ? 16 : a % 8 == 0 ? 8 : a % 4 == 0 ? 4 : a % 2 == 0 ? 2 : 1;
      return bytes >= elt ? bytes / elt : 1;  // 1: no vector width divides it
    };
    // one column (n == 1): the column strides are never used, any value fits
    vec_x = dblock_width(args.d, args.sxk, args.n > 1 ? args.sxn : 0, args.sym, args.n > 1 ? args.syn : 0,
                         align_elems(args.x), align_elems(args.y));
    PRUNEKIT_CHECK(vec_x != 0 && aligned16(args.w),
                "ks_mm: the delta-block kernel needs batch-first x and y, d, the row strides and the data pointers "
                "divisible by 2 elements or more, and 16-byte aligned blocks");
    PRUNEKIT_CHECK((args.n + DB_BN - 1) / DB_BN <= 65535, "ks_mm: grid too large");
  }
  const int pipe = pipelined == 2 ? 2 : (pipelined ? 1 : 0);
  if (x.scalar_type() == at::kHalf) {
    launch_tc<__half>(args, static_cast<int>(tile_rows), pipe, vec_w, vec_x, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else if (x.scalar_type() == at::kBFloat16) {
    launch_tc<__nv_bfloat16>(args, static_cast<int>(tile_rows), pipe, vec_w, vec_x, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    PRUNEKIT_CHECK(false, "ks_mm: CUDA kernel takes float32, float16 or bfloat16, got ", x.scalar_type());
  }
}

}  // namespace prunekit_ks

TORCH_LIBRARY(prunekit_ks, m) {
  m.def(
      "ks_mm_out(Tensor blocks, Tensor x, Tensor(a!) y, Tensor? bias, bool relu, int tile_rows, int pipelined) -> ()");
}

TORCH_LIBRARY_IMPL(prunekit_ks, CUDA, m) { m.impl("ks_mm_out", &prunekit_ks::ks_mm_out); }
