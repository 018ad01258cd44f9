// Fused Sparse DNN Graph Challenge layers (Kepner et al. 2019; design after Hidayetoglu et al., HPEC 2020):
// a thread block keeps BT inputs' feature vectors in shared memory across a chain of layers and applies,
// per layer, Y <- min(max(Y W + b on non-zeros, 0), cap) with W^T in ELL form (slot-major, so that the
// weights of consecutive output neurons are read coalesced and each is reused for the BT inputs held in
// registers). A block stops as soon as all its inputs are zero; the host compacts live inputs between
// chains. The kernel reads any ELL layer: it does not rely on the challenge generator's structure.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

namespace {

constexpr int kThreads = 512;

template <int BT>
__global__ void __launch_bounds__(kThreads) spdnn_chain_kernel(const float* __restrict__ y, int batch, int n,
                                                               int slots, int layers,
                                                               const int* __restrict__ ell_idx,
                                                               const float* __restrict__ ell_val, float bias,
                                                               float cap, float* __restrict__ out,
                                                               int* __restrict__ alive) {
  extern __shared__ float smem[];
  float* cur = smem;
  float* nxt = smem + static_cast<size_t>(n) * BT;
  __shared__ int live_bits;
  const int b0 = blockIdx.x * BT;

  // Stage the block's inputs feature-major: cur[j * BT + b] = y[b0 + b, j].
  for (int b = 0; b < BT; ++b) {
    const bool valid = b0 + b < batch;
    const float* row = y + static_cast<size_t>(b0 + b) * n;
    for (int j = threadIdx.x; j < n; j += blockDim.x) cur[j * BT + b] = valid ? row[j] : 0.f;
  }
  __syncthreads();

  for (int l = 0; l < layers; ++l) {
    if (threadIdx.x == 0) live_bits = 0;
    __syncthreads();
    const int* idx = ell_idx + static_cast<size_t>(l) * slots * n;
    const float* val = ell_val + static_cast<size_t>(l) * slots * n;
    int my_bits = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      float acc[BT];
#pragma unroll
      for (int b = 0; b < BT; ++b) acc[b] = 0.f;
      for (int k = 0; k < slots; ++k) {
        const int i = __ldg(idx + static_cast<size_t>(k) * n + j);
        const float w = __ldg(val + static_cast<size_t>(k) * n + j);
        const float* src = cur + static_cast<size_t>(i) * BT;
        if constexpr (BT % 4 == 0) {
#pragma unroll
          for (int b = 0; b < BT; b += 4) {
            const float4 v = *reinterpret_cast<const float4*>(src + b);
            acc[b] = fmaf(w, v.x, acc[b]);
            acc[b + 1] = fmaf(w, v.y, acc[b + 1]);
            acc[b + 2] = fmaf(w, v.z, acc[b + 2]);
            acc[b + 3] = fmaf(w, v.w, acc[b + 3]);
          }
        } else {
#pragma unroll
          for (int b = 0; b < BT; ++b) acc[b] = fmaf(w, src[b], acc[b]);
        }
      }
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        float z = acc[b];
        z = (z != 0.f) ? z + bias : 0.f;  // the challenge adds the bias to non-zero entries only
        z = fminf(fmaxf(z, 0.f), cap);
        nxt[j * BT + b] = z;
        if (z != 0.f) my_bits |= 1 << b;
      }
    }
    if (my_bits) atomicOr(&live_bits, my_bits);
    __syncthreads();
    const int bits = live_bits;
    float* t = cur;
    cur = nxt;
    nxt = t;
    __syncthreads();  // every thread has read live_bits before thread 0 resets it
    if (bits == 0) break;  // all BT inputs are zero: they stay zero in every later layer
  }

  for (int b = 0; b < BT; ++b) {
    if (b0 + b >= batch) break;
    float* row = out + static_cast<size_t>(b0 + b) * n;
    int any = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
      const float v = cur[j * BT + b];
      row[j] = v;
      any |= v != 0.f;
    }
    any = __syncthreads_or(any);
    if (threadIdx.x == 0) alive[b0 + b] = any;
  }
}

template <int BT>
void launch(const torch::Tensor& y, const torch::Tensor& idx, const torch::Tensor& val, double bias, double cap,
            torch::Tensor& out, torch::Tensor& alive) {
  const int batch = y.size(0), n = y.size(1), layers = idx.size(0), slots = idx.size(1);
  const size_t smem = 2 * static_cast<size_t>(n) * BT * sizeof(float);
  auto kernel = spdnn_chain_kernel<BT>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int blocks = (batch + BT - 1) / BT;
  kernel<<<blocks, kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      y.data_ptr<float>(), batch, n, slots, layers, idx.data_ptr<int>(), val.data_ptr<float>(),
      static_cast<float>(bias), static_cast<float>(cap), out.data_ptr<float>(), alive.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t max_block_inputs(int64_t n) {
  int device;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int smem_optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int64_t usable = smem_optin - 1024;  // static shared memory of the kernel
  for (int bt : {16, 8, 4, 2, 1})
    if (2 * n * bt * static_cast<int64_t>(sizeof(float)) <= usable) return bt;
  return 0;
}

std::tuple<torch::Tensor, torch::Tensor> chain(const torch::Tensor& y, const torch::Tensor& ell_idx,
                                               const torch::Tensor& ell_val, double bias, double cap) {
  TORCH_CHECK(y.is_cuda() && y.dim() == 2 && y.scalar_type() == torch::kFloat, "y must be a 2-D float32 CUDA tensor");
  TORCH_CHECK(ell_idx.dim() == 3 && ell_idx.scalar_type() == torch::kInt, "ell_idx must be (layers, slots, N) int32");
  TORCH_CHECK(ell_val.sizes() == ell_idx.sizes() && ell_val.scalar_type() == torch::kFloat,
              "ell_val must be float32 and shaped like ell_idx");
  TORCH_CHECK(ell_idx.size(2) == y.size(1), "ELL layers must have N = y.size(1) outputs");
  const c10::cuda::CUDAGuard guard(y.device());
  auto yc = y.contiguous();
  auto idx = ell_idx.contiguous();
  auto val = ell_val.contiguous();
  auto out = torch::empty_like(yc);
  auto alive = torch::empty({yc.size(0)}, yc.options().dtype(torch::kInt));
  if (yc.size(0) == 0) return {out, alive};
  switch (max_block_inputs(yc.size(1))) {
    case 16: launch<16>(yc, idx, val, bias, cap, out, alive); break;
    case 8: launch<8>(yc, idx, val, bias, cap, out, alive); break;
    case 4: launch<4>(yc, idx, val, bias, cap, out, alive); break;
    case 2: launch<2>(yc, idx, val, bias, cap, out, alive); break;
    case 1: launch<1>(yc, idx, val, bias, cap, out, alive); break;
    default: TORCH_CHECK(false, "N = ", yc.size(1), " features do not fit in shared memory for the fused chain");
  }
  return {out, alive};
}

}  // namespace

TORCH_LIBRARY(prunekit_spdnn, m) {
  m.def("chain(Tensor y, Tensor ell_idx, Tensor ell_val, float bias, float cap) -> (Tensor, Tensor)");
  m.def("max_block_inputs(int n) -> int");
}

TORCH_LIBRARY_IMPL(prunekit_spdnn, CUDA, m) { m.impl("chain", &chain); }

TORCH_LIBRARY_IMPL(prunekit_spdnn, CompositeExplicitAutograd, m) { m.impl("max_block_inputs", &max_block_inputs); }
