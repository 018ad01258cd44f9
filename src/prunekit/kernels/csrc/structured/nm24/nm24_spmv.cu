// 2:4 SpMV: y (M) = act(A @ x + bias) for one decode token, A 2:4 in the stored nm format (formats/nm.py): values
// (M, K / 2) fp16/bf16 and metadata (M, K / 8) uint8, four 2-bit in-group indices per byte, little end first.
//
// The tensor-core decode kernel (nm24_decode.cu) multiplies 16-row strips by 8 or 16 tokens; at N = 1 it moves the same
// weight bytes for one token and pays its fixed cost (X staging in fragment order, the cluster reduction): 0.8x of
// dense cuBLAS at 3072 x 768 and 1.25x at 4096 x 11008 on the H100. This kernel streams the stored format on the CUDA
// cores instead (1.25 bytes per weight against dense's 2), as spmv_csr.cu does for CSR:
// - R consecutive rows per warp (1, 2, 4 or 8: the fewest that fit one wave), read as one stream of 16-byte vectors
//   of 8 values (4 groups, 16 columns) and their 2-byte metadata, two vectors in flight per lane ahead of the one it
//   multiplies; every row has K / 16 vectors, so no offsets are read and the first loads go out at once;
// - with programmatic dependent launch (sm_90) those loads start before the preceding kernel has finished; the kernel
//   waits for it (griddepcontrol.wait) before it reads x, and writes only after that;
// - the block copies x to shared memory (16-byte loads where x is contiguous and aligned); value i of a vector at
//   vector column c multiplies x[16 c + 4 (i / 2) + index_i]: the lane reads x[16 c .. 16 c + 15] as two 16-byte
//   words and picks each group's pair with a byte permute (element reads at the lanes' 32-byte stride conflicted
//   8-way in shared memory: 34.4 against 23.1 us for the tensor-core kernel at 11008 x 4096, nm-n1-*-s13.json);
// - a warp reduction per row, fp32 throughout; lane q writes row r0 + q with bias and ReLU.
// $PRUNEKIT_NM24_PDL=0 turns the programmatic dependent launch off (read at each call), as for nm24_decode.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "check.h"   // PRUNEKIT_CHECK: TORCH_CHECK without iostreams
#include "launch.cuh"  // device properties, programmatic dependent launch

namespace prunekit_nm24 {
namespace {

constexpr int kThreads = 256;
constexpr int kMinBlocksPerSm = 4;         // launch bounds; one wave counts 4 blocks of 8 warps per SM
constexpr int kMaxSmem = 96 * 1024;        // bytes of x per block: K <= 49152

template <typename T> __device__ __forceinline__ float half_lo(uint32_t w);
template <typename T> __device__ __forceinline__ float half_hi(uint32_t w);
template <> __device__ __forceinline__ float half_lo<__half>(uint32_t w) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
}
template <> __device__ __forceinline__ float half_hi<__half>(uint32_t w) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}
template <> __device__ __forceinline__ float half_lo<__nv_bfloat16>(uint32_t w) { return __uint_as_float(w << 16); }
template <> __device__ __forceinline__ float half_hi<__nv_bfloat16>(uint32_t w) {
  return __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T, int R>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
spmv24_kernel(const uint4* __restrict__ values, const uint16_t* __restrict__ meta, const T* __restrict__ x,
              int64_t xs_k, T* __restrict__ y, int64_t ys_m, const T* __restrict__ bias, bool relu, int m, int k,
              bool x_vec) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);
  const int lane = threadIdx.x & 31;
  const int r0 = static_cast<int>((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5) * R;
  const int rows = max(0, min(R, m - r0));  // whole warps stay to the barrier below
  const int per_row = k >> 4;               // vectors per row
  const int total = rows * per_row;         // vectors of this warp, from (r0, 0) on: rows are contiguous
  const int64_t base = static_cast<int64_t>(r0) * per_row;

  // lane's vectors: f = lane + 32 i; (row r, column c) tracked incrementally (c < per_row)
  int f = lane, r = 0, c = lane;
  while (c >= per_row && per_row > 0) {
    c -= per_row;
    ++r;
  }
  uint4 va = make_uint4(0, 0, 0, 0), vb = va;
  uint32_t ma = 0, mb = 0;
  if (f < total) {
    va = __ldg(values + base + f);
    ma = __ldg(meta + base + f);
  }
  if (f + 32 < total) {
    vb = __ldg(values + base + f + 32);
    mb = __ldg(meta + base + f + 32);
  }

  prunekit_launch::wait_preceding_grid();  // programmatic dependent launch: the preceding kernel (which may write x or read y) is done
  if (x_vec) {
    for (int i = threadIdx.x; i < k / 8; i += blockDim.x) {
      reinterpret_cast<uint4*>(xs)[i] = __ldg(reinterpret_cast<const uint4*>(x) + i);
    }
  } else {
    for (int i = threadIdx.x; i < k; i += blockDim.x) xs[i] = x[static_cast<int64_t>(i) * xs_k];
  }
  __syncthreads();

  float acc[R];
#pragma unroll
  for (int q = 0; q < R; ++q) acc[q] = 0.0f;
  while (f < total) {
    uint4 vc = make_uint4(0, 0, 0, 0);
    uint32_t mc = 0;
    if (f + 64 < total) {
      vc = __ldg(values + base + f + 64);
      mc = __ldg(meta + base + f + 64);
    }
    // x[16 c .. 16 c + 15] as two 16-byte shared loads (element gathers at a 32-byte lane stride conflict 8-way); the
    // pair of x a group multiplies is picked from its two words with one byte permute
    const uint4 x0 = reinterpret_cast<const uint4*>(xs)[2 * c], x1 = reinterpret_cast<const uint4*>(xs)[2 * c + 1];
    const uint32_t w[4] = {va.x, va.y, va.z, va.w};
    const uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    float s = 0.0f;
#pragma unroll
    for (int g = 0; g < 4; ++g) {  // group g: values 2g, 2g + 1 (word g), indices in meta bits 4g .. 4g + 3
      const uint32_t i0 = (ma >> (4 * g)) & 3u, i1 = (ma >> (4 * g + 2)) & 3u;
      // selector: bytes 2 i0, 2 i0 + 1 of (xw[2g + 1]:xw[2g]) into the low half, bytes 2 i1, 2 i1 + 1 into the high
      const uint32_t sel = (i0 * 0x22u + 0x10u) | ((i1 * 0x22u + 0x10u) << 8);
      const uint32_t xp = __byte_perm(xw[2 * g], xw[2 * g + 1], sel);
      s = fmaf(half_lo<T>(w[g]), half_lo<T>(xp), s);
      s = fmaf(half_hi<T>(w[g]), half_hi<T>(xp), s);
    }
    if constexpr (R == 1) {
      acc[0] += s;
    } else {
#pragma unroll
      for (int q = 0; q < R; ++q) acc[q] += q == r ? s : 0.0f;
    }
    va = vb;
    ma = mb;
    vb = vc;
    mb = mc;
    f += 32;
    c += 32;
    while (c >= per_row) {
      c -= per_row;
      ++r;
    }
  }
  prunekit_launch::allow_dependent_launch();  // the next kernel may start its own loads during this epilogue

  float mine = 0.0f;
#pragma unroll
  for (int q = 0; q < R; ++q) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[q] += __shfl_xor_sync(0xffffffffu, acc[q], o);
    if (lane == q) mine = acc[q];
  }
  if (lane < rows) {
    const int row = r0 + lane;
    float v = mine + (bias != nullptr ? to_float(bias[row]) : 0.0f);
    if (relu) v = fmaxf(v, 0.0f);
    y[static_cast<int64_t>(row) * ys_m] = from_float<T>(v);
  }
}

template <typename T, int R>
void launch(const prunekit_launch::RowGrid& g, int64_t smem, const at::Tensor& values, const at::Tensor& meta,
            const at::Tensor& x, int64_t xs_k, const at::Tensor& y, int64_t ys_m, const void* bias, bool relu, int m,
            int k, bool x_vec, bool pdl) {
  auto kernel = spmv24_kernel<T, R>;
  if (smem > 48 * 1024) {
    static bool configured[64] = {};
    prunekit_launch::raise_smem_limit(kernel, kMaxSmem, configured);
  }
  prunekit_launch::launch(kernel, dim3(g.blocks), dim3(g.threads), static_cast<size_t>(smem),
                          c10::cuda::getCurrentCUDAStream(), pdl, reinterpret_cast<const uint4*>(values.data_ptr()),
                          reinterpret_cast<const uint16_t*>(meta.data_ptr()), reinterpret_cast<const T*>(x.data_ptr()),
                          xs_k, reinterpret_cast<T*>(y.data_ptr()), ys_m, reinterpret_cast<const T*>(bias), relu, m, k,
                          x_vec);
}

}  // namespace

// y = act(A x + bias) for A 2:4 as stored (values (M, K / 2), metadata (M, K / 8) uint8 with 2-bit indices). With
// `rows`, x is (1, K) and y (1, M) (nn.Linear's layout), else x is (K, 1) and y (M, 1). K: a multiple of 16, at most
// 49152 (x in shared memory).
at::Tensor spmv24(const at::Tensor& values, const at::Tensor& metadata, const at::Tensor& x,
                  const c10::optional<at::Tensor>& bias, bool relu, bool rows) {
  PRUNEKIT_CHECK(values.dim() == 2 && metadata.dim() == 2 && x.dim() == 2, "spmv24: values, metadata and x must be 2-D");
  const int64_t m = values.size(0), k = values.size(1) * 2;
  PRUNEKIT_CHECK(values.scalar_type() == at::kHalf || values.scalar_type() == at::kBFloat16,
                 "spmv24: values must be float16 or bfloat16, got ", values.scalar_type());
  PRUNEKIT_CHECK(x.scalar_type() == values.scalar_type(), "spmv24: x (", x.scalar_type(), ") and values (",
                 values.scalar_type(), ") must share one dtype");
  PRUNEKIT_CHECK(k > 0 && k % 16 == 0 && k <= kMaxSmem / 2, "spmv24: K must be a positive multiple of 16 and at most ", kMaxSmem / 2,
                 ", got ", k);
  PRUNEKIT_CHECK(metadata.scalar_type() == at::kByte && metadata.size(0) == m && metadata.size(1) == k / 8,
                 "spmv24: metadata must be uint8 (M, K / 8) = (", m, ", ", k / 8, ")");
  PRUNEKIT_CHECK(values.is_contiguous() && metadata.is_contiguous() &&
                     reinterpret_cast<uintptr_t>(values.data_ptr()) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(metadata.data_ptr()) % 2 == 0,
                 "spmv24: values and metadata must be contiguous, values 16-byte aligned");
  const int64_t xk = rows ? x.size(1) : x.size(0), xn = rows ? x.size(0) : x.size(1);
  PRUNEKIT_CHECK(xk == k && xn == 1, "spmv24: x must be ", rows ? "(1, K)" : "(K, 1)", " with K = ", k, ", got ",
                 x.sizes());
  PRUNEKIT_CHECK(values.is_cuda() && metadata.device() == values.device() && x.device() == values.device(),
                 "spmv24: values, metadata and x must be on one GPU");
  if (bias.has_value()) {
    PRUNEKIT_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == m &&
                       bias->device() == x.device(),
                   "spmv24: bias must be a contiguous (M,) tensor of x's dtype on x's GPU");
  }
  at::Tensor y = rows ? at::empty({1, m}, x.options()) : at::empty({m, 1}, x.options());
  if (m == 0) return y;
  const int64_t xs_k = rows ? x.stride(1) : x.stride(0);
  const bool x_vec = xs_k == 1 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  const c10::cuda::CUDAGuard guard(x.device());
  const int dev = x.get_device();
  const prunekit_launch::DeviceProps d = prunekit_launch::device_props(dev);
  const int64_t smem = k * 2;
  PRUNEKIT_CHECK(smem <= d.max_smem, "spmv24: K = ", k, " needs ", smem, " bytes of shared memory, the GPU has ",
                 d.max_smem);
  const prunekit_launch::RowGrid g = prunekit_launch::row_grid(m, d.sms, kMinBlocksPerSm, 8);
  const char* pdl_var = std::getenv("PRUNEKIT_NM24_PDL");
  const bool pdl = d.major >= 9 && (pdl_var == nullptr || std::strcmp(pdl_var, "0") != 0);
  const void* b = bias.has_value() ? bias->data_ptr() : nullptr;
  const int mi = static_cast<int>(m), ki = static_cast<int>(k);
  const int64_t ys_m = rows ? y.stride(1) : y.stride(0);
  auto go = [&](auto tag) {
    using T = decltype(tag);
    switch (g.rows_per_warp) {
      case 1: return launch<T, 1>(g, smem, values, metadata, x, xs_k, y, ys_m, b, relu, mi, ki, x_vec, pdl);
      case 2: return launch<T, 2>(g, smem, values, metadata, x, xs_k, y, ys_m, b, relu, mi, ki, x_vec, pdl);
      case 4: return launch<T, 4>(g, smem, values, metadata, x, xs_k, y, ys_m, b, relu, mi, ki, x_vec, pdl);
      default: return launch<T, 8>(g, smem, values, metadata, x, xs_k, y, ys_m, b, relu, mi, ki, x_vec, pdl);
    }
  };
  if (x.scalar_type() == at::kHalf) {
    go(__half{});
  } else {
    go(__nv_bfloat16{});
  }
  return y;
}

}  // namespace prunekit_nm24

TORCH_LIBRARY_FRAGMENT(prunekit_nm24, m) {
  m.def("spmv24(Tensor values, Tensor metadata, Tensor x, Tensor? bias, bool relu, bool rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(prunekit_nm24, CUDA, m) { m.impl("spmv24", &prunekit_nm24::spmv24); }
