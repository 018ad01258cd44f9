// Shared device helpers for prunekit's sparse kernels: fp16/bf16/fp32 conversion and 16-byte vector loads.
//
// Sputnik (Gale et al., SC 2020, sec. 5.2) loads values and column indices with 128-bit vector instructions; the
// prunekit CSR format pads every row to a multiple of 16 bytes of values so these loads are always aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include <ATen/ATen.h>
#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit {

// Map ATen scalar types to the CUDA native types the kernels use.
template <typename T> struct Native { using type = T; };
template <> struct Native<at::Half> { using type = __half; };
template <> struct Native<at::BFloat16> { using type = __nv_bfloat16; };

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Element e of a value packed in 32-bit words (e is a compile-time constant after unrolling).
template <typename T> __device__ __forceinline__ float word_elem(const uint32_t* w, int e);
template <> __device__ __forceinline__ float word_elem<float>(const uint32_t* w, int e) { return __uint_as_float(w[e]); }
template <> __device__ __forceinline__ float word_elem<__half>(const uint32_t* w, int e) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w[e >> 1] >> (16 * (e & 1)))));
}
template <> __device__ __forceinline__ float word_elem<__nv_bfloat16>(const uint32_t* w, int e) {
  return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(w[e >> 1] >> (16 * (e & 1)))));
}

// Index element e of packed int16 or int32 words.
template <typename I> __device__ __forceinline__ int word_index(const uint32_t* w, int e);
template <> __device__ __forceinline__ int word_index<int16_t>(const uint32_t* w, int e) {
  return static_cast<int>(static_cast<int16_t>(static_cast<uint16_t>(w[e >> 1] >> (16 * (e & 1)))));
}
template <> __device__ __forceinline__ int word_index<int32_t>(const uint32_t* w, int e) {
  return static_cast<int>(w[e]);
}

// Load BYTES (4, 8, 16 or a multiple of 16) bytes from an address aligned to min(BYTES, 16) into 32-bit words.
template <int BYTES> struct Words {
  uint32_t w[BYTES / 4];
  __device__ __forceinline__ void load(const void* p) {
    if constexpr (BYTES % 16 == 0) {
#pragma unroll
      for (int q = 0; q < BYTES / 16; ++q) {
        const uint4 t = __ldg(reinterpret_cast<const uint4*>(p) + q);
        w[4 * q + 0] = t.x;
        w[4 * q + 1] = t.y;
        w[4 * q + 2] = t.z;
        w[4 * q + 3] = t.w;
      }
    } else if constexpr (BYTES == 8) {
      const uint2 t = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = t.x;
      w[1] = t.y;
    } else {
      static_assert(BYTES == 4, "unsupported vector width");
      w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    }
  }
};

// Pack 4 floats into T and store them (8 bytes for 16-bit types, 16 bytes for fp32); p aligned to that size.
template <typename T> __device__ __forceinline__ void store4(T* p, float a, float b, float c, float d);
template <> __device__ __forceinline__ void store4<float>(float* p, float a, float b, float c, float d) {
  *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
template <> __device__ __forceinline__ void store4<__half>(__half* p, float a, float b, float c, float d) {
  __half2 lo = __floats2half2_rn(a, b), hi = __floats2half2_rn(c, d);
  uint2 t;
  t.x = *reinterpret_cast<uint32_t*>(&lo);
  t.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(p) = t;
}
template <> __device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* p, float a, float b, float c, float d) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
  uint2 t;
  t.x = *reinterpret_cast<uint32_t*>(&lo);
  t.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(p) = t;
}

// Load 4 consecutive T from shared memory (8 or 16 bytes, aligned) as floats.
__device__ __forceinline__ void load4(const float* p, float* o) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  o[0] = t.x; o[1] = t.y; o[2] = t.z; o[3] = t.w;
}
__device__ __forceinline__ void load4(const __half* p, float* o) {
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&t.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&t.y));
  o[0] = lo.x; o[1] = lo.y; o[2] = hi.x; o[3] = hi.y;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float* o) {
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.y));
  o[0] = lo.x; o[1] = lo.y; o[2] = hi.x; o[3] = hi.y;
}

// Pack 16 / sizeof(T) floats into T and store them as one 16-byte vector (p 16-byte aligned).
template <typename T> __device__ __forceinline__ void store_vec16(T* p, const float* o);
template <> __device__ __forceinline__ void store_vec16<float>(float* p, const float* o) {
  *reinterpret_cast<float4*>(p) = make_float4(o[0], o[1], o[2], o[3]);
}
__device__ __forceinline__ uint32_t pack2(__half, float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack2(__nv_bfloat16, float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ void store_vec16<__half>(__half* p, const float* o) {
  const __half tag{};
  *reinterpret_cast<uint4*>(p) =
      make_uint4(pack2(tag, o[0], o[1]), pack2(tag, o[2], o[3]), pack2(tag, o[4], o[5]), pack2(tag, o[6], o[7]));
}
template <> __device__ __forceinline__ void store_vec16<__nv_bfloat16>(__nv_bfloat16* p, const float* o) {
  const __nv_bfloat16 tag{};
  *reinterpret_cast<uint4*>(p) =
      make_uint4(pack2(tag, o[0], o[1]), pack2(tag, o[2], o[3]), pack2(tag, o[4], o[5]), pack2(tag, o[6], o[7]));
}

// Write NT values (exact in T: they were read from T) as one row of a [K][NT] copy of X: 8, 16, 32 or 64 bytes, p
// aligned to 8 bytes (NT * sizeof(T) == 8) or 16 (more). spmv_csr.cu stages x so; spmm_rowwarp.cu transposes it so.
template <typename T, int NT>
__device__ __forceinline__ void store_xrow(T* p, const float* e) {
  constexpr int W = NT * static_cast<int>(sizeof(T)) / 4;
  uint32_t w[W];
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = __float_as_uint(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = pack2(T{}, e[2 * i], e[2 * i + 1]);
  }
  if constexpr (W == 2) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      reinterpret_cast<uint4*>(p)[q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
    }
  }
}

__device__ __forceinline__ float epilogue(float acc, float bias, bool relu) {
  acc += bias;
  return relu ? fmaxf(acc, 0.0f) : acc;
}

}  // namespace prunekit

// Dispatch helpers: run BODY with scalar_t (CUDA native type) and index_t bound.
#define PRUNEKIT_DISPATCH_FLOAT(DTYPE, ...)                                               \
  [&] {                                                                                   \
    switch (DTYPE) {                                                                      \
      case at::kHalf: { using scalar_t = __half; return __VA_ARGS__(); }                  \
      case at::kBFloat16: { using scalar_t = __nv_bfloat16; return __VA_ARGS__(); }       \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }                  \
      default: PRUNEKIT_CHECK(false, "prunekit kernels support float16, bfloat16 and float32, got ", DTYPE); \
    }                                                                                     \
  }()

#define PRUNEKIT_DISPATCH_INDEX(DTYPE, ...)                                               \
  [&] {                                                                                   \
    switch (DTYPE) {                                                                      \
      case at::kShort: { using index_t = int16_t; return __VA_ARGS__(); }                 \
      case at::kInt: { using index_t = int32_t; return __VA_ARGS__(); }                   \
      default: PRUNEKIT_CHECK(false, "column_indices must be int16 or int32, got ", DTYPE);  \
    }                                                                                     \
  }()
