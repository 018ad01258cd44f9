// Launch helpers shared by the decode kernels of two libraries (prunekit_ext's spmv_csr.cu, prunekit_nm24's
// nm24_decode.cu and nm24_spmv.cu): the device properties they size their grids by, and programmatic dependent launch
// (PDL, sm_90): a kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start while the preceding
// kernel in the stream finishes. It must call wait_preceding_grid() before it reads what that kernel may write or
// writes what it may read; allow_dependent_launch() lets the next kernel start early. Both are no-ops below sm_90 and
// in a launch without the attribute (CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization").
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace prunekit_launch {

__device__ __forceinline__ void wait_preceding_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Whether the environment variable `name` is "0" (a kernel's A/B switch, read at each call: about 0.1 us).
inline bool env_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") == 0;
}

// SM count, compute capability major, opt-in shared memory per block and shared memory per SM (bytes) of device `dev`,
// queried once per device (up to 64) per library.
struct DeviceProps {
  int sms = 0, major = 0, max_smem = 0, smem_per_sm = 0;
};

inline DeviceProps device_props(int dev) {
  static DeviceProps cache[64];
  if (dev >= 0 && dev < 64 && cache[dev].sms != 0) return cache[dev];
  DeviceProps d;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  if (dev >= 0 && dev < 64) cache[dev] = d;
  return d;
}

// Let `kernel` use `bytes` of dynamic shared memory (over the 48 KB default) on the current device, once per device:
// `configured` is the call site's own static flag array (one per kernel instantiation).
template <typename Kernel>
void raise_smem_limit(Kernel kernel, int bytes, bool (&configured)[64]) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64 && configured[dev]) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  if (dev < 64) configured[dev] = true;
}

// Grid of a kernel that gives each warp R consecutive rows of an M-row output (the SpMV kernels): R is the fewest of
// 1, 2, 4, 8 (at most max_r) that fit M rows into one wave of `blocks_per_sm` 8-warp blocks per SM; blocks have 8 warps,
// or 4 or 2 where fewer rows per SM would leave SMs idle.
struct RowGrid {
  int rows_per_warp, threads;
  unsigned blocks;
};

inline RowGrid row_grid(int64_t m, int sms, int blocks_per_sm, int max_r) {
  const int64_t wave = static_cast<int64_t>(sms) * blocks_per_sm * 8;
  int r = m <= wave ? 1 : m <= 2 * wave ? 2 : m <= 4 * wave ? 4 : 8;
  r = r < max_r ? r : max_r;
  const int64_t per_sm = (m + static_cast<int64_t>(r) * sms - 1) / (static_cast<int64_t>(r) * sms);
  const int threads = per_sm >= 8 ? 256 : per_sm >= 4 ? 128 : 64;
  const int64_t warps = (m + r - 1) / r;
  return {r, threads, static_cast<unsigned>((warps * 32 + threads - 1) / threads)};
}

// Launch kernel<<<grid, block, smem, stream>>>(args...), allowing programmatic dependent launch when `pdl` (the caller
// checks the device is sm_90 or newer).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
            Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace prunekit_launch
