// Fused Sparse DNN Graph Challenge layers (Kepner et al. 2019; design after Hidayetoglu et al., HPEC 2020):
// a thread block keeps BT inputs' feature vectors in shared memory across a chain of layers and applies,
// per layer, Y <- min(max(Y W + b on non-zeros, 0), cap) with W^T in ELL form (slot-major, so that the
// weights of consecutive output neurons are read coalesced and each is reused for the BT inputs held in
// registers). A block stops as soon as all its inputs are zero; the host compacts live inputs between
// chains. The kernel reads any ELL layer: it does not rely on the challenge generator's structure.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdlib>
#include <vector>
#include "../check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace {

constexpr int kThreads = 512;
// ELL slots per batch of (index, weight) loads, double-buffered (chain kernel). Few inputs per block (the late layers,
// where a block's time is the latency of its weight loads) take twice the batch: half the dependent steps per layer.
__host__ __device__ constexpr int slot_batch(int bt) { return bt <= 4 ? 16 : 8; }

// Row stride (floats) of one input neuron's BT features in shared memory. A lane reads the row of a random input
// neuron i as float4s at word i * stride: with stride 16 (BT = 16) those start on only 2 of the 8 four-bank
// groups, a 4x bank conflict that made the chain kernel shared-memory bound; a stride of BT + 4 for BT % 8 == 0
// spreads the rows over all 8 groups (BT = 4: stride 4 already does).
// For 16-bit features (the fp16 / bf16 option) the same stride in elements gives rows of 5 eight-byte units for BT =
// 16, read as 8-byte vectors in half-warp phases: 16 distinct starting units, as for float4.
__host__ __device__ constexpr int feature_stride(int bt) { return bt % 8 == 0 ? bt + 4 : bt; }

// Feature storage types: float32, or float16 / bfloat16 (the option of issue 7), always computed in float32.
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename FT>
__device__ __forceinline__ FT from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Four consecutive features (16-byte aligned for float, 8-byte for 16-bit types) as float32.
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const __half* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
  *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
template <typename FT>
__device__ __forceinline__ void store4(FT* p, float a, float b, float c, float d) {
  p[0] = from_f32<FT>(a);
  p[1] = from_f32<FT>(b);
  p[2] = from_f32<FT>(c);
  p[3] = from_f32<FT>(d);
}

// An ELL slot as stored: PACKED, one 32-bit word (input row in the low 16 bits, the float16 weight in the high 16;
// spdnn_cuda.pack_ell stores a layer so only when that is lossless), else the int32 row in `a` and the float32 weight
// in `b` (two arrays). Loads keep the raw words, so the prefetch is not held up by the decoding.
template <bool PACKED>
__device__ __forceinline__ int slot_row(uint32_t a) {
  return PACKED ? static_cast<int>(a & 0xffffu) : static_cast<int>(a);
}
template <bool PACKED>
__device__ __forceinline__ float slot_weight(uint32_t a, uint32_t b) {
  return PACKED ? __half2float(__ushort_as_half(static_cast<unsigned short>(a >> 16))) : __uint_as_float(b);
}

template <typename FT, int BT, bool PACKED>
__global__ void __launch_bounds__(kThreads) spdnn_chain_kernel(const FT* __restrict__ y, int batch, int n,
                                                               int slots, int layers,
                                                               const uint32_t* __restrict__ ell_a,
                                                               const uint32_t* __restrict__ ell_b, float bias,
                                                               float cap, FT* __restrict__ out,
                                                               int* __restrict__ alive,
                                                               const int* __restrict__ row_pos,
                                                               const int64_t* __restrict__ rows) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  FT* cur = reinterpret_cast<FT*>(smem_raw);
  constexpr int S = feature_stride(BT);
  constexpr int kSlotBatch = slot_batch(BT);
  // Input neuron i of layer l sits in shared-memory row row_pos[l * n + i] (nullptr: row i). The ELL indices are
  // those rows already (spdnn/slot_order.py chooses them at build time to spread reads over the bank groups), so
  // only the staging and the stores of a layer's outputs into the next layer's buffer look the table up.
  // The last layer writes its outputs straight to `out` from registers, so a one-layer chain needs one buffer
  // (half the shared memory: two blocks per SM, one staging while the other computes).
  FT* nxt = layers > 1 ? cur + static_cast<size_t>(n) * S : nullptr;
  __shared__ int live_bits;
  const int b0 = blockIdx.x * BT;

  // Stage the block's inputs feature-major: cur[j * S + b] = y[src[b], j], src[b] = rows[b0 + b] (the live inputs of
  // an earlier launch's output, gathered here instead of compacted by a copy) or b0 + b; -1 past the batch. A thread
  // owns whole feature rows j: its BT global loads (coalesced across the warp for each b) are all issued before the
  // row is stored as vectors, so a block waits for about one memory latency per row it owns, not one per element.
  int64_t src[BT];
#pragma unroll
  for (int b = 0; b < BT; ++b) src[b] = b0 + b >= batch ? -1 : rows != nullptr ? __ldg(rows + b0 + b) : b0 + b;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const int r = row_pos != nullptr ? __ldg(row_pos + j) : j;
    FT v[BT];
#pragma unroll
    for (int b = 0; b < BT; ++b) v[b] = src[b] >= 0 ? y[src[b] * n + j] : from_f32<FT>(0.f);
    if constexpr (BT % 4 == 0) {
#pragma unroll
      for (int b = 0; b < BT; b += 4)
        store4(cur + r * S + b, to_f32(v[b]), to_f32(v[b + 1]), to_f32(v[b + 2]), to_f32(v[b + 3]));
    } else {
#pragma unroll
      for (int b = 0; b < BT; ++b) cur[r * S + b] = v[b];
    }
  }
  __syncthreads();

  int bits = 0, computed = 0;
  for (int l = 0; l < layers; ++l) {
    const bool last = l == layers - 1;
    if (threadIdx.x == 0) live_bits = 0;
    __syncthreads();
    const uint32_t* la = ell_a + static_cast<size_t>(l) * slots * n;
    const uint32_t* lb = PACKED ? nullptr : ell_b + static_cast<size_t>(l) * slots * n;
    int my_bits = 0;
    // The thread's (output, slot batch) steps in one flat loop: step t is output j = threadIdx.x + (t / nb) *
    // blockDim.x, slots [(t % nb) * kSlotBatch, +kSlotBatch). A batch's (index, weight) pairs are loaded one step
    // ahead (register double buffer), so their L2/HBM latency overlaps the previous batch's shared-memory reads and
    // FMAs; before, each batch waited for its loads (16 warps per SM could not hide it). Slots past the row's end
    // read as weight 0 at index 0 and add exact zeros (features are finite). Per output, slots are summed in order.
    const int nb = (slots + kSlotBatch - 1) / kSlotBatch;
    const int outputs = threadIdx.x < n ? (n - 1 - threadIdx.x) / blockDim.x + 1 : 0;
    const int steps = outputs * nb;
    uint32_t ii[kSlotBatch];
    uint32_t ww[kSlotBatch];  // unused when PACKED
    const auto load = [&](int t, uint32_t (&ri)[kSlotBatch], uint32_t (&rw)[kSlotBatch]) {
      const int jt = threadIdx.x + (t / nb) * blockDim.x;
      const int k0 = (t % nb) * kSlotBatch;
#pragma unroll
      for (int u = 0; u < kSlotBatch; ++u) {
        const bool in = k0 + u < slots;  // a missing slot: row 0, weight +0 (both encodings are all-zero bits)
        ri[u] = in ? __ldg(la + static_cast<size_t>(k0 + u) * n + jt) : 0u;
        if constexpr (!PACKED) rw[u] = in ? __ldg(lb + static_cast<size_t>(k0 + u) * n + jt) : 0u;
      }
    };
    if (steps > 0) load(0, ii, ww);
    float acc[BT];
#pragma unroll
    for (int b = 0; b < BT; ++b) acc[b] = 0.f;
    for (int t = 0; t < steps; ++t) {
      uint32_t ni[kSlotBatch];
      uint32_t nw[kSlotBatch];
      if (t + 1 < steps) {
        load(t + 1, ni, nw);
      } else {
#pragma unroll
        for (int u = 0; u < kSlotBatch; ++u) {
          ni[u] = 0u;
          nw[u] = 0u;
        }
      }
#pragma unroll
      for (int u = 0; u < kSlotBatch; ++u) {
        const float w = slot_weight<PACKED>(ii[u], ww[u]);
        const FT* src = cur + static_cast<size_t>(slot_row<PACKED>(ii[u])) * S;
        if constexpr (BT % 4 == 0) {
#pragma unroll
          for (int b = 0; b < BT; b += 4) {
            const float4 v = load4(src + b);
            acc[b] = fmaf(w, v.x, acc[b]);
            acc[b + 1] = fmaf(w, v.y, acc[b + 1]);
            acc[b + 2] = fmaf(w, v.z, acc[b + 2]);
            acc[b + 3] = fmaf(w, v.w, acc[b + 3]);
          }
        } else {
#pragma unroll
          for (int b = 0; b < BT; ++b) acc[b] = fmaf(w, to_f32(src[b]), acc[b]);
        }
      }
#pragma unroll
      for (int u = 0; u < kSlotBatch; ++u) {
        ii[u] = ni[u];
        ww[u] = nw[u];
      }
      if (t % nb != nb - 1) continue;
      const int j = threadIdx.x + (t / nb) * blockDim.x;
#pragma unroll
      for (int b = 0; b < BT; ++b) {
        float z = acc[b];
        z = (z != 0.f) ? z + bias : 0.f;  // the challenge adds the bias to non-zero entries only
        z = fminf(fmaxf(z, 0.f), cap);
        z = to_f32(from_f32<FT>(z));  // the stored value decides liveness (a 16-bit type may round it to 0)
        acc[b] = z;
        if (z != 0.f) my_bits |= 1 << b;
      }
      if (last) {
        // row-major output: for each b the warp's 32 consecutive j are one coalesced 128-byte (fp32) store
#pragma unroll
        for (int b = 0; b < BT; ++b)
          if (b0 + b < batch) out[static_cast<size_t>(b0 + b) * n + j] = from_f32<FT>(acc[b]);
      } else {
        const int r = row_pos != nullptr ? __ldg(row_pos + static_cast<size_t>(l + 1) * n + j) : j;
        if constexpr (BT % 4 == 0) {
#pragma unroll
          for (int b = 0; b < BT; b += 4) store4(nxt + r * S + b, acc[b], acc[b + 1], acc[b + 2], acc[b + 3]);
        } else {
#pragma unroll
          for (int b = 0; b < BT; ++b) nxt[r * S + b] = from_f32<FT>(acc[b]);
        }
      }
#pragma unroll
      for (int b = 0; b < BT; ++b) acc[b] = 0.f;
    }
    if (my_bits) atomicOr(&live_bits, my_bits);
    __syncthreads();
    bits = live_bits;
    computed = l + 1;
    FT* t = cur;
    cur = nxt;
    nxt = t;
    __syncthreads();  // every thread has read live_bits before thread 0 resets it
    if (bits == 0) break;  // all BT inputs are zero: they stay zero in every later layer
  }

  if (computed < layers) {  // stopped early: the inputs are zero from here on, and the last layer wrote nothing
    for (int j = threadIdx.x; j < n; j += blockDim.x)
      for (int b = 0; b < BT && b0 + b < batch; ++b) out[static_cast<size_t>(b0 + b) * n + j] = from_f32<FT>(0.f);
  }
  const int b = threadIdx.x;
  if (b < BT && b0 + b < batch) alive[b0 + b] = (bits >> b) & 1;
}

// Threads per block: a one-layer chain keeps one feature buffer; where two such blocks fit in an SM's shared memory
// (N = 1024: 80 KiB each) they take half the threads each (the same 16 warps per SM), and one block's staging and
// output stores overlap the other's compute.
constexpr int kSingleLayerThreads = kThreads / 2;

// One chain launch's operands (the host side of the kernel's arguments).
struct ChainArgs {
  const torch::Tensor& y;
  const torch::Tensor& idx;  // int32 rows, or the packed words (then val is undefined)
  const torch::Tensor& val;
  double bias, cap;
  torch::Tensor& out;
  torch::Tensor& alive;
  const int* row_pos;   // (layers, N) or nullptr
  const int64_t* rows;  // (batch,) or nullptr
};

template <typename FT, int BT, bool PACKED>
void launch(const ChainArgs& a) {
  const torch::Tensor &y = a.y, &idx = a.idx, &val = a.val;
  const int batch = a.out.size(0), n = y.size(1), layers = idx.size(0), slots = idx.size(1);
  const int buffers = layers > 1 ? 2 : 1;
  const size_t smem = buffers * static_cast<size_t>(n) * feature_stride(BT) * sizeof(FT);
  auto kernel = spdnn_chain_kernel<FT, BT, PACKED>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      static_cast<int>(cudaSharedmemCarveoutMaxShared)));
  const int blocks = (batch + BT - 1) / BT;
  int device = 0, smem_sm = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  const bool two_per_sm = layers == 1 && 2 * (smem + 2048) <= static_cast<size_t>(smem_sm);  // + reserved + static
  const int threads = two_per_sm ? kSingleLayerThreads : kThreads;
  kernel<<<blocks, threads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const FT*>(y.data_ptr()), batch, n, slots, layers,
      reinterpret_cast<const uint32_t*>(idx.data_ptr<int>()),
      PACKED ? nullptr : reinterpret_cast<const uint32_t*>(val.data_ptr<float>()),
      static_cast<float>(a.bias), static_cast<float>(a.cap), reinterpret_cast<FT*>(a.out.data_ptr()),
      a.alive.data_ptr<int>(), a.row_pos, a.rows);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename FT, bool PACKED>
void launch_bt(int bt, const ChainArgs& a) {
  switch (bt) {
    case 16: launch<FT, 16, PACKED>(a); break;
    case 8: launch<FT, 8, PACKED>(a); break;
    case 4: launch<FT, 4, PACKED>(a); break;
    case 2: launch<FT, 2, PACKED>(a); break;
    default: launch<FT, 1, PACKED>(a); break;
  }
}

// Inputs per block for N features of element_size bytes (4: float32, 2: the 16-bit option); 0 when none fit.
int64_t max_block_inputs(int64_t n, int64_t element_size, int64_t buffers) {
  PRUNEKIT_CHECK(element_size == 4 || element_size == 2, "max_block_inputs: element_size must be 4 or 2");
  PRUNEKIT_CHECK(buffers == 1 || buffers == 2, "max_block_inputs: buffers must be 1 or 2");
  int device;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  int smem_optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int64_t usable = smem_optin - 1024;  // static shared memory of the kernel
  for (int bt : {16, 8, 4, 2, 1})
    if (buffers * n * feature_stride(bt) * element_size <= usable) return bt;
  return 0;
}

// Features y (inputs, N) float32 on the GPU (chain: also float16 / bfloat16, with_16bit); ELL layers (layers, slots,
// N): int32 indices, float32 values.
static void check_chain_inputs(const torch::Tensor& y, const torch::Tensor& ell_idx, const torch::Tensor& ell_val,
                               bool with_16bit = false) {
  const auto t = y.scalar_type();
  const bool dtype_ok = t == torch::kFloat || (with_16bit && (t == torch::kHalf || t == torch::kBFloat16));
  PRUNEKIT_CHECK(y.is_cuda() && y.dim() == 2 && dtype_ok,
              with_16bit ? "y must be a 2-D float32, float16 or bfloat16 CUDA tensor"
                         : "y must be a 2-D float32 CUDA tensor");
  PRUNEKIT_CHECK(ell_idx.dim() == 3 && ell_idx.scalar_type() == torch::kInt, "ell_idx must be (layers, slots, N) int32");
  PRUNEKIT_CHECK(ell_val.sizes() == ell_idx.sizes() && ell_val.scalar_type() == torch::kFloat,
              "ell_val must be float32 and shaped like ell_idx");
  PRUNEKIT_CHECK(ell_idx.size(2) == y.size(1), "ELL layers must have N = y.size(1) outputs");
}

// row_pos (layers, N) int32, optional: each layer's permutation of the shared-memory rows (see the kernel); the ELL
// indices must already name those rows. rows (batch,) int64, optional: the rows of y to run (output row b is input
// rows[b]), so that the caller drops dead inputs without copying the live ones. Neither is checked on the device: a
// row_pos that is not a permutation, or a row out of range, reads garbage.
// ell_val undefined: ell_idx holds packed words (chain_packed).
std::tuple<torch::Tensor, torch::Tensor> chain_impl(const torch::Tensor& y, const torch::Tensor& ell_idx,
                                                    const torch::Tensor& ell_val, double bias, double cap,
                                                    const std::optional<torch::Tensor>& row_pos,
                                                    const std::optional<torch::Tensor>& rows) {
  const bool packed = !ell_val.defined();
  check_chain_inputs(y, ell_idx, packed ? ell_idx.view(torch::kFloat) : ell_val, /*with_16bit=*/true);
  PRUNEKIT_CHECK(!packed || y.size(1) <= 65536, "packed ELL layers address at most 65536 input rows");
  const c10::cuda::CUDAGuard guard(y.device());
  auto yc = y.contiguous();
  auto idx = ell_idx.contiguous();
  auto val = packed ? torch::Tensor() : ell_val.contiguous();
  torch::Tensor pos;
  if (row_pos.has_value()) {
    pos = row_pos->contiguous();
    PRUNEKIT_CHECK(pos.device() == y.device() && pos.scalar_type() == torch::kInt && pos.dim() == 2 &&
                    pos.size(0) == idx.size(0) && pos.size(1) == y.size(1),
                "row_pos must be (layers, N) int32 on the features' device");
  }
  torch::Tensor picked;
  if (rows.has_value()) {
    picked = rows->contiguous();
    PRUNEKIT_CHECK(picked.device() == y.device() && picked.scalar_type() == torch::kLong && picked.dim() == 1,
                "rows must be a 1-D int64 tensor on the features' device");
  }
  const int* pos_ptr = pos.defined() ? pos.data_ptr<int>() : nullptr;
  const int64_t batch = picked.defined() ? picked.size(0) : yc.size(0);
  auto out = torch::empty({batch, yc.size(1)}, yc.options());
  auto alive = torch::empty({batch}, yc.options().dtype(torch::kInt));
  if (batch == 0) return {out, alive};
  const int64_t* rows_ptr = picked.defined() ? picked.data_ptr<int64_t>() : nullptr;
  const ChainArgs args{yc, idx, val, bias, cap, out, alive, pos_ptr, rows_ptr};
  const auto dtype = yc.scalar_type();
  // Fewer inputs per block while there would be fewer than min_blocks blocks: once few inputs are alive (the late
  // layers), BT = 16 would run them on a handful of SMs. Each block streams every layer's weights from L2, so one
  // input per block pays that traffic per input. Default: half the SMs. Measured on the H100 (N = 1024 x 480, 141
  // inputs alive after layer 8; benchmarks/results/spdnn-profile-chain-h100-2026-11-25.json): per late layer
  // 10.7 us at 1 input per block (132 blocks), 8.2 us at 2 (66), 9.8 us at 4 (33), 13.6 us at 8, 24 us at 16.
  // $PRUNEKIT_SPDNN_MIN_BLOCKS overrides. Per-input arithmetic (slot order) does not depend on BT: same results.
  // A one-layer chain keeps one feature buffer, so it may hold more inputs per block (N = 4096: 8 instead of 4).
  int bt = static_cast<int>(max_block_inputs(yc.size(1), dtype == torch::kFloat ? 4 : 2, idx.size(0) > 1 ? 2 : 1));
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int64_t min_blocks = std::max(1, sms / 2);
  if (const char* env = std::getenv("PRUNEKIT_SPDNN_MIN_BLOCKS")) min_blocks = std::max<int64_t>(1, std::atoll(env));
  while (bt > 1 && (batch + bt - 1) / bt < min_blocks) bt /= 2;
  PRUNEKIT_CHECK(bt > 0, "N = ", yc.size(1), " features do not fit in shared memory for the fused chain");
  if (dtype == torch::kHalf) {
    packed ? launch_bt<__half, true>(bt, args) : launch_bt<__half, false>(bt, args);
  } else if (dtype == torch::kBFloat16) {
    packed ? launch_bt<__nv_bfloat16, true>(bt, args) : launch_bt<__nv_bfloat16, false>(bt, args);
  } else {
    packed ? launch_bt<float, true>(bt, args) : launch_bt<float, false>(bt, args);
  }
  return {out, alive};
}

std::tuple<torch::Tensor, torch::Tensor> chain(const torch::Tensor& y, const torch::Tensor& ell_idx,
                                               const torch::Tensor& ell_val, double bias, double cap,
                                               const std::optional<torch::Tensor>& row_pos,
                                               const std::optional<torch::Tensor>& rows) {
  PRUNEKIT_CHECK(ell_val.defined(), "ell_val must be a tensor");
  return chain_impl(y, ell_idx, ell_val, bias, cap, row_pos, rows);
}

// ell (layers, slots, N) int32 words: input row in the low 16 bits, float16 weight bits in the high 16
// (spdnn_cuda.pack_ell). Half the weight bytes of the (int32, float32) pair.
std::tuple<torch::Tensor, torch::Tensor> chain_packed(const torch::Tensor& y, const torch::Tensor& ell, double bias,
                                                      double cap, const std::optional<torch::Tensor>& row_pos,
                                                      const std::optional<torch::Tensor>& rows) {
  return chain_impl(y, ell, torch::Tensor(), bias, cap, row_pos, rows);
}

// ---------------------------------------------------------------------------------------------------------------
// Tiled layers for any N (features in global memory / L2; used when one input's features do not fit in shared
// memory, e.g. N = 65536). Features are kept in a blocked layout: tile t holds inputs t*BT .. t*BT+BT-1
// feature-major, x[(t * n + i) * BT + b], so the BT values of one input neuron are one 64-byte read. One launch
// per layer: block (x = 256 output neurons, y = tile) computes those outputs for the tile's BT inputs from the
// layer's ELL (slot-major, coalesced); a general sparse layer, nothing assumed about its structure.
// Output order: thread j of the layer computes output out_pos[j] (out_pos = null: output j), whose inputs are ELL
// column j. Putting outputs with the same inputs next to each other (spdnn_cuda.tiled_output_order_) makes the lanes
// of a warp gather the same feature rows at the same slot, so one 64-byte load serves them all.
// Dead inputs: stamp[b] = number of layers after which input b was last non-zero. A block whose BT inputs all
// have stamp < layer skips the layer (its buffers hold stale values that are never read again: a dead input
// stays dead, and a live tile is recomputed in full every layer, so its dead inputs' rows are exact zeros).
constexpr int kTiledThreads = 256;
constexpr int kTileInputs = 16;
constexpr int kTiledSlotBatch = 8;  // as kSlotBatch, for the tiled kernel
// Tile groups, each on its own stream: a layer's launch waits for the previous layer of its own tiles only. With few
// live tiles a layer is a few waves of blocks (N = 16384, 29 tiles: 1856 blocks, 3.5 waves of the 528 that fit the
// H100 at 4 blocks per SM), and the last, partial wave took as long as a full one: a layer's time went with the wave
// count rounded up (benchmarks/results/spdnn-split-16384-h100-2026-11-25-order.json). Independent groups let one
// group's blocks fill the SMs that another's last wave leaves idle. Two groups: N = 16384 x 1920 took 0.2884 s against
// 0.3382 with one and 0.2892 with four on an H200, and each half of the inputs 0.79-0.81x of the time with one
// (benchmarks/results/spdnn-split-streams-16384-h200-2026-11-27-s33a.json). $PRUNEKIT_SPDNN_TILED_STREAMS overrides.
constexpr int kTiledStreams = 2;
cudaEvent_t recorded_event(cudaStream_t stream) {
  cudaEvent_t event;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(event, stream));
  return event;
}
int tiled_streams() {
  int s = kTiledStreams;
  if (const char* env = std::getenv("PRUNEKIT_SPDNN_TILED_STREAMS")) s = std::atoi(env);
  return std::min(std::max(s, 1), 16);
}

// PACKED: ell_a holds the packed words (slot_row / slot_weight) and ell_b is unused; else ell_a the int32 rows and
// ell_b the float32 weights' bits.
template <int BT, bool PACKED>
__global__ void __launch_bounds__(kTiledThreads) spdnn_tiled_layer_kernel(
    const float* __restrict__ x, float* __restrict__ x_next, int batch, int n, int slots,
    const uint32_t* __restrict__ ell_a, const uint32_t* __restrict__ ell_b, const int* __restrict__ out_pos,
    float bias, float cap, int* stamp, int layer, int tile0) {
  static_assert(BT % 4 == 0 && BT <= 32, "BT: a multiple of 4, at most 32 (bit mask)");
  __shared__ int block_bits;
  const int t = tile0 + static_cast<int>(blockIdx.y);
  const int b0 = t * BT;
  if (threadIdx.x == 0) block_bits = 0;
  int live = 0;
  if (threadIdx.x < BT) {
    const int b = b0 + threadIdx.x;
    live = b < batch && stamp[b] >= layer;
  }
  if (!__syncthreads_or(live)) return;  // every input of the tile is dead (uniform: the whole block returns)

  const int j = blockIdx.x * kTiledThreads + threadIdx.x;
  unsigned bits = 0;
  if (j < n) {
    float acc[BT];
#pragma unroll
    for (int b = 0; b < BT; ++b) acc[b] = 0.f;
    const float* tile = x + static_cast<size_t>(t) * n * BT;
    // As in the chain kernel: a batch of slots' (index, weight) pairs in flight at once, then their features
    // (kTiledSlotBatch float4 rows of the tile) loaded together before the FMAs.
    for (int k0 = 0; k0 < slots; k0 += kTiledSlotBatch) {
      int ii[kTiledSlotBatch];
      float ww[kTiledSlotBatch];
#pragma unroll
      for (int u = 0; u < kTiledSlotBatch; ++u) {
        const bool in = k0 + u < slots;
        const size_t at = static_cast<size_t>(k0 + u) * n + j;
        const uint32_t a = in ? __ldg(ell_a + at) : 0u;
        const uint32_t b = in && !PACKED ? __ldg(ell_b + at) : 0u;
        ii[u] = slot_row<PACKED>(a);
        ww[u] = slot_weight<PACKED>(a, b);
      }
#pragma unroll
      for (int q = 0; q < BT / 4; ++q) {
        float4 v[kTiledSlotBatch];
#pragma unroll
        for (int u = 0; u < kTiledSlotBatch; ++u)
          v[u] = __ldg(reinterpret_cast<const float4*>(tile + static_cast<size_t>(ii[u]) * BT) + q);
#pragma unroll
        for (int u = 0; u < kTiledSlotBatch; ++u) {
          acc[4 * q] = fmaf(ww[u], v[u].x, acc[4 * q]);
          acc[4 * q + 1] = fmaf(ww[u], v[u].y, acc[4 * q + 1]);
          acc[4 * q + 2] = fmaf(ww[u], v[u].z, acc[4 * q + 2]);
          acc[4 * q + 3] = fmaf(ww[u], v[u].w, acc[4 * q + 3]);
        }
      }
    }
    const int o = out_pos != nullptr ? __ldg(out_pos + j) : j;
    float4* dst = reinterpret_cast<float4*>(x_next + (static_cast<size_t>(t) * n + o) * BT);
#pragma unroll
    for (int q = 0; q < BT / 4; ++q) {
      float z[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = acc[4 * q + e];
        v = (v != 0.f) ? v + bias : 0.f;  // the challenge adds the bias to non-zero entries only
        v = fminf(fmaxf(v, 0.f), cap);
        z[e] = v;
        if (v != 0.f) bits |= 1u << (4 * q + e);
      }
      dst[q] = make_float4(z[0], z[1], z[2], z[3]);
    }
  }
  bits = __reduce_or_sync(0xffffffffu, bits);
  if ((threadIdx.x & 31) == 0 && bits) atomicOr(&block_bits, static_cast<int>(bits));
  __syncthreads();
  if (threadIdx.x < BT) {
    const int b = b0 + threadIdx.x;
    // stamp only grows (layer -> layer + 1) within a launch, so a plain read decides whether the atomic is needed
    if (b < batch && ((block_bits >> threadIdx.x) & 1) && *reinterpret_cast<volatile int*>(stamp + b) <= layer)
      atomicMax(stamp + b, layer + 1);
  }
}

// ell_val undefined: ell_idx holds packed words (tiled_packed).
std::tuple<torch::Tensor, torch::Tensor> tiled_impl(const torch::Tensor& y, const torch::Tensor& ell_idx,
                                                    const torch::Tensor& ell_val, double bias, double cap,
                                                    const c10::optional<torch::Tensor>& out_pos) {
  const bool packed = !ell_val.defined();
  check_chain_inputs(y, ell_idx, packed ? ell_idx.view(torch::kFloat) : ell_val);
  PRUNEKIT_CHECK(!packed || y.size(1) <= 65536, "packed ELL layers address at most 65536 input rows");
  PRUNEKIT_CHECK(ell_idx.size(0) >= 1, "tiled: give at least one layer");
  torch::Tensor pos;
  if (out_pos.has_value()) {
    pos = out_pos->contiguous();
    PRUNEKIT_CHECK(pos.scalar_type() == torch::kInt && pos.device() == y.device() && pos.dim() == 2 &&
                    pos.size(0) == ell_idx.size(0) && pos.size(1) == y.size(1),
                "tiled: out_pos must be a (layers, N) int32 tensor on the features' device");
  }
  constexpr int BT = kTileInputs;
  const c10::cuda::CUDAGuard guard(y.device());
  auto yc = y.contiguous();
  auto idx = ell_idx.contiguous();
  auto val = packed ? torch::Tensor() : ell_val.contiguous();
  const int64_t batch = yc.size(0), n = yc.size(1);
  const int layers = static_cast<int>(idx.size(0)), slots = static_cast<int>(idx.size(1));
  PRUNEKIT_CHECK(n * BT < (int64_t{1} << 31) && batch < (int64_t{1} << 31), "tiled: N or the batch is too large");
  const int64_t tiles = (batch + BT - 1) / BT;
  PRUNEKIT_CHECK(tiles <= 65535, "tiled: at most 65535 tiles of ", BT, " inputs per call (split the batch)");
  auto alive = torch::zeros({batch}, yc.options().dtype(torch::kInt));
  if (batch == 0) return {torch::empty_like(yc), alive};

  // Blocked layout: a[t, i, b] = y[t * BT + b, i]; the last tile's missing inputs are zeros (they stay zero).
  auto a = torch::empty({tiles, n, BT}, yc.options());
  const int64_t full = batch / BT, rem = batch - full * BT;
  if (full) a.narrow(0, 0, full).copy_(yc.narrow(0, 0, full * BT).view({full, BT, n}).transpose(1, 2));
  if (rem) {
    auto last = a.select(0, full);
    last.zero_();
    last.narrow(1, 0, rem).copy_(yc.narrow(0, full * BT, rem).t());
  }
  auto b = torch::empty_like(a);
  auto stamp = torch::zeros({batch}, yc.options().dtype(torch::kInt));
  const unsigned blocks_x = static_cast<unsigned>((n + kTiledThreads - 1) / kTiledThreads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  // Tile groups g = 0 .. groups-1 hold tiles [tiles * g / groups, tiles * (g + 1) / groups): disjoint inputs, rows of
  // a / b and stamps, so each group runs its layers on its own stream; the caller's stream waits for all at the end.
  const int groups = static_cast<int>(std::min<int64_t>(tiled_streams(), tiles));
  std::vector<c10::cuda::CUDAStream> streams(groups, stream);
  if (groups > 1) {
    const cudaEvent_t ready = recorded_event(stream);
    for (int g = 0; g < groups; ++g) {
      streams[g] = c10::cuda::getStreamFromPool(false, y.device().index());
      C10_CUDA_CHECK(cudaStreamWaitEvent(streams[g], ready, 0));
    }
    C10_CUDA_CHECK(cudaEventDestroy(ready));  // released once recorded: the waits already enqueued still hold
  }
  for (int l = 0; l < layers; ++l) {
    const size_t layer_at = static_cast<size_t>(l) * slots * n;
    const auto* ell_a = reinterpret_cast<const uint32_t*>(idx.data_ptr<int>()) + layer_at;
    const auto* ell_b = packed ? nullptr : reinterpret_cast<const uint32_t*>(val.data_ptr<float>()) + layer_at;
    const int* pos_l = pos.defined() ? pos.data_ptr<int>() + static_cast<size_t>(l) * n : nullptr;
    for (int g = 0; g < groups; ++g) {
      const int64_t t0 = tiles * g / groups, t1 = tiles * (g + 1) / groups;
      const dim3 grid(blocks_x, static_cast<unsigned>(t1 - t0));
      auto kernel = packed ? spdnn_tiled_layer_kernel<BT, true> : spdnn_tiled_layer_kernel<BT, false>;
      kernel<<<grid, kTiledThreads, 0, streams[g]>>>(a.data_ptr<float>(), b.data_ptr<float>(),
                                                    static_cast<int>(batch), static_cast<int>(n), slots, ell_a, ell_b,
                                                    pos_l, static_cast<float>(bias), static_cast<float>(cap),
                                                    stamp.data_ptr<int>(), l, static_cast<int>(t0));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    std::swap(a, b);
  }
  if (groups > 1) {
    for (int g = 0; g < groups; ++g) {
      const cudaEvent_t done = recorded_event(streams[g]);
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream, done, 0));
      C10_CUDA_CHECK(cudaEventDestroy(done));
    }
  }
  b = torch::Tensor();  // release the other ping-pong buffer before the row-major copy
  alive = stamp.eq(layers).to(torch::kInt);
  auto out = torch::empty({tiles * BT, n}, yc.options());
  out.view({tiles, BT, n}).copy_(a.transpose(1, 2));
  a = torch::Tensor();
  out = out.narrow(0, 0, batch);
  out.masked_fill_(alive.eq(0).unsqueeze(1), 0.f);  // dead inputs of skipped tiles hold stale values
  return {out, alive};
}

std::tuple<torch::Tensor, torch::Tensor> tiled(const torch::Tensor& y, const torch::Tensor& ell_idx,
                                               const torch::Tensor& ell_val, double bias, double cap,
                                               const c10::optional<torch::Tensor>& out_pos) {
  PRUNEKIT_CHECK(ell_val.defined(), "ell_val must be a tensor");
  return tiled_impl(y, ell_idx, ell_val, bias, cap, out_pos);
}

// ell (layers, slots, N) int32 words (spdnn_cuda.pack_ell): half the bytes every tile streams per layer.
std::tuple<torch::Tensor, torch::Tensor> tiled_packed(const torch::Tensor& y, const torch::Tensor& ell, double bias,
                                                      double cap, const c10::optional<torch::Tensor>& out_pos) {
  return tiled_impl(y, ell, torch::Tensor(), bias, cap, out_pos);
}

int64_t tile_inputs() { return kTileInputs; }

}  // namespace

TORCH_LIBRARY(prunekit_spdnn, m) {
  m.def(
      "chain(Tensor y, Tensor ell_idx, Tensor ell_val, float bias, float cap, Tensor? row_pos=None, Tensor? "
      "rows=None) -> (Tensor, Tensor)");
  m.def(
      "chain_packed(Tensor y, Tensor ell, float bias, float cap, Tensor? row_pos=None, Tensor? rows=None) -> "
      "(Tensor, Tensor)");
  m.def(
      "tiled(Tensor y, Tensor ell_idx, Tensor ell_val, float bias, float cap, Tensor? out_pos=None) -> (Tensor, "
      "Tensor)");
  m.def("tiled_packed(Tensor y, Tensor ell, float bias, float cap, Tensor? out_pos=None) -> (Tensor, Tensor)");
  m.def("max_block_inputs(int n, int element_size=4, int buffers=2) -> int");
  m.def("tile_inputs() -> int");
}

TORCH_LIBRARY_IMPL(prunekit_spdnn, CUDA, m) {
  m.impl("chain", &chain);
  m.impl("chain_packed", &chain_packed);
  m.impl("tiled", &tiled);
  m.impl("tiled_packed", &tiled_packed);
}

TORCH_LIBRARY_IMPL(prunekit_spdnn, CompositeExplicitAutograd, m) {
  m.impl("max_block_inputs", &max_block_inputs);
  m.impl("tile_inputs", &tile_inputs);
}
