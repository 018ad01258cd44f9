// SpMM on tensor cores, "load sparse, compute dense": Y (M, N) = act(A @ X + bias), A condensed into 16-row windows.
//
// The plan (kernels/spmm_tc_plan.py) cuts A into windows of 16 rows (the m = 16 A operand of mma.sync.m16n8k16) and
// K into chunks of 256; per (window, chunk) segment it keeps the union of the columns the window's rows use, padded
// to k-steps of 16, with the condensed weights in A-fragment order (one 16-byte load per lane per k-step) and the
// chunk-local X row of every k slot (uint8).
//
// A block of 8 warps owns 8 * WPW windows x NT output columns. It walks K in chunks of 256: the dense X chunk
// (256 rows x NT columns, row-major, zero outside X) is copied to shared memory with 16-byte cp.async, double
// buffered, and reused by every window of the block, so X traffic is that of a dense GEMM with a (16 * 8 * WPW) x NT
// tile. Each warp multiplies its windows' k-steps in the chunk: per k-step one coalesced 16-byte load of the A
// fragment, then NT / 16 ldmatrix.x4.trans whose 32 row addresses are the gathered X rows (ldmatrix takes one
// arbitrary row address per lane, so the gather costs nothing) and NT / 8 mma.m16n8k16 with fp32 accumulators. The
// staged chunk is XOR-swizzled (16-byte column group c of row r at c ^ (r % 8)); the plan orders the gathered rows so
// that the 8 rows of one 8x8 matrix have distinct r % 8, which makes the gathers conflict-free. The epilogue adds
// bias, applies ReLU and writes each window row to its output row (window_rows: a row permutation is free), to a
// row-major Y (pairs of columns, 4-byte stores) or a transposed one (element stores).
//
// X must be row-major with a leading dimension that is a multiple of 8 elements and a 16-byte aligned base (the
// launcher in gpu.py copies other layouts). sm_80+ (cp.async, ldmatrix, mma.sync with bf16).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "common.cuh"
#include "kernels.h"
#include "mma.cuh"
#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit {
namespace {

constexpr int kTcWarps = 8;
constexpr int kTcThreads = 32 * kTcWarps;
constexpr int kTcChunk = 256;   // K rows per stage; = spmm_tc_plan.K_CHUNK
constexpr int kTcWindow = 16;   // rows per window; = spmm_tc_plan.WINDOW_ROWS
constexpr int kTcKStep = 16;    // k per mma; = spmm_tc_plan.K_STEP
constexpr int kTcStages = 2;

// 16-byte asynchronous global -> shared copy of `bytes` in [1, 16] bytes; the rest of the 16 is zero-filled (PTX
// cp.async src-size). Both addresses must be 16-byte aligned.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// Plain 16-byte zero store to shared memory (groups wholly outside X: no global address is formed at all, so an
// empty X, whose data pointer may be null, is never touched). Made visible by the same __syncthreads as the copies.
__device__ __forceinline__ void st_shared_zero16(uint32_t dst) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0u) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// Four 8x8 b16 matrices, transposed: lane l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// Stage X[ch * 256 : +256, n0 : n0 + NT] into one buffer (swizzled rows of NT elements), zero outside X.
template <typename T, int NT>
__device__ __forceinline__ void stage_chunk(uint32_t buf, const T* __restrict__ x, int64_t ldx, int k, int n, int ch,
                                            int n0) {
  constexpr int CPR = NT / 8;  // 16-byte groups per staged row
  const int k0 = ch * kTcChunk;
#pragma unroll 4
  for (int u = threadIdx.x; u < kTcChunk * CPR; u += kTcThreads) {
    const int r = u / CPR, c = u % CPR;
    const int gk = k0 + r, gn = n0 + c * 8;
    const uint32_t dst = buf + static_cast<uint32_t>(r * CPR + (c ^ (r & 7))) * 16u;
    if (gk < k && gn < n) {
      cp_async16(dst, x + static_cast<int64_t>(gk) * ldx + gn, min(16, (n - gn) * static_cast<int>(sizeof(T))));
    } else {
      st_shared_zero16(dst);
    }
  }
}

// One k-step of a warp: the A fragment `a` times the X slot row `r` of the staged chunk (swizzled 16-byte columns),
// NT / 8 mma.m16n8k16 into acc; lanes 16..31 (half = 1) address the second n8 tile of each pair.
template <typename T, int NT>
__device__ __forceinline__ void kstep_mma(float (&acc)[NT / 8][4], const uint4& a, int r, uint32_t xbuf, int half) {
  constexpr int CPR = NT / 8;
  const uint32_t row_addr = xbuf + static_cast<uint32_t>(r * CPR) * 16u;
  const int sw = r & 7;
#pragma unroll
  for (int j2 = 0; j2 < NT / 16; ++j2) {
    const int c = 2 * j2 + half;
    uint32_t b0, b1, b2, b3;
    ldmatrix_x4_trans(row_addr + static_cast<uint32_t>(c ^ sw) * 16u, b0, b1, b2, b3);
    Mma<T>::run(acc[2 * j2], a, b0, b1);
    Mma<T>::run(acc[2 * j2 + 1], a, b2, b3);
  }
}

// One segment (window x chunk): k-steps [t0, t1), each k-step's A fragment and X slot row loaded PF k-steps ahead
// into a ring of registers (slot s of the ring holds k-step t0 + s, t0 + s + PF, ...; static indices after
// unrolling). PF = 2 was the first design; the loads come from L2 (hundreds of cycles), and a k-step of one warp
// is NT / 8 mma, so a deeper ring (PF = 6, the default since its H100 run) hides more of that latency for 15-31 more
// registers.
template <typename T, int NT, int PF>
__device__ __forceinline__ void segment_mma(float (&acc)[NT / 8][4], const uint4* __restrict__ frags,
                                            const uint8_t* __restrict__ slot_rows, int t0, int t1, uint32_t xbuf,
                                            int lane) {
  const int slot = lane & (kTcKStep - 1);  // ldmatrix row of this lane: slot (l % 8) + 8 * ((l / 8) % 2)
  const int half = lane >> 4;              // lanes 16..31 address the second n8 tile of each pair
  if constexpr (PF == 0) {
    // The first design (timed on the H100 at 07:57 on 2026-11-25, before the ring): a rolling pair of registers,
    // fragments and slot rows loaded two k-steps ahead. $PRUNEKIT_TC_PREFETCH=0 selects it; the ring build measured
    // 9-10% slower at depth 6 than that first timing, with the plan's slot order and row reordering also changed
    // in between (docs/PERFORMANCE.md), so this loop is kept to tell the causes apart.
    uint4 a_cur = make_uint4(0, 0, 0, 0), a_nxt = make_uint4(0, 0, 0, 0);
    int r_cur = 0, r_nxt = 0;
    if (t0 < t1) {
      a_cur = __ldg(frags + static_cast<int64_t>(t0) * 32 + lane);
      r_cur = __ldg(slot_rows + static_cast<int64_t>(t0) * kTcKStep + slot);
    }
    if (t0 + 1 < t1) {
      a_nxt = __ldg(frags + static_cast<int64_t>(t0 + 1) * 32 + lane);
      r_nxt = __ldg(slot_rows + static_cast<int64_t>(t0 + 1) * kTcKStep + slot);
    }
    for (int t = t0; t < t1; ++t) {
      uint4 a_pre = make_uint4(0, 0, 0, 0);
      int r_pre = 0;
      if (t + 2 < t1) {
        a_pre = __ldg(frags + static_cast<int64_t>(t + 2) * 32 + lane);
        r_pre = __ldg(slot_rows + static_cast<int64_t>(t + 2) * kTcKStep + slot);
      }
      kstep_mma<T, NT>(acc, a_cur, r_cur, xbuf, half);
      a_cur = a_nxt;
      r_cur = r_nxt;
      a_nxt = a_pre;
      r_nxt = r_pre;
    }
    return;
  } else {
    uint4 ring_a[PF];
    int ring_r[PF];
#pragma unroll
    for (int s = 0; s < PF; ++s) {
      ring_a[s] = make_uint4(0, 0, 0, 0);
      ring_r[s] = 0;
      if (t0 + s < t1) {
        ring_a[s] = __ldg(frags + static_cast<int64_t>(t0 + s) * 32 + lane);
        ring_r[s] = __ldg(slot_rows + static_cast<int64_t>(t0 + s) * kTcKStep + slot);
      }
    }
    for (int tb = t0; tb < t1; tb += PF) {
#pragma unroll
      for (int s = 0; s < PF; ++s) {
        const int t = tb + s;
        if (t < t1) {
          const uint4 a_cur = ring_a[s];
          const int r_cur = ring_r[s];
          if (t + PF < t1) {
            ring_a[s] = __ldg(frags + static_cast<int64_t>(t + PF) * 32 + lane);
            ring_r[s] = __ldg(slot_rows + static_cast<int64_t>(t + PF) * kTcKStep + slot);
          }
          kstep_mma<T, NT>(acc, a_cur, r_cur, xbuf, half);
        }
      }
    }
  }  // PF > 0
}

template <typename T, bool YT, int WPW, int NT, int PF>
__global__ void __launch_bounds__(kTcThreads, 1)
spmm_tc_kernel(const uint4* __restrict__ frags, const uint8_t* __restrict__ slot_rows,
               const int* __restrict__ kstep_offsets, const int* __restrict__ window_rows, const T* __restrict__ x,
               int64_t ldx, T* __restrict__ y, int64_t ys_m, int64_t ys_n, bool y_pair_ok,
               const T* __restrict__ bias, bool relu, int k, int n, int num_windows, int num_chunks) {
  constexpr int NTILES = NT / 8;
  constexpr int STAGE_BYTES = kTcChunk * NT * static_cast<int>(sizeof(T));
  extern __shared__ __align__(128) unsigned char tc_smem[];
  const uint32_t xs = smem_u32(tc_smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = blockIdx.y * NT;
  const int win0 = blockIdx.x * (kTcWarps * WPW) + warp * WPW;

  float acc[WPW][NTILES][4];
#pragma unroll
  for (int wi = 0; wi < WPW; ++wi)
#pragma unroll
    for (int j = 0; j < NTILES; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[wi][j][q] = 0.0f;

  stage_chunk<T, NT>(xs, x, ldx, k, n, 0, n0);
  cp_async_commit();
  for (int ch = 0; ch < num_chunks; ++ch) {
    if (ch + 1 < num_chunks) stage_chunk<T, NT>(xs + ((ch + 1) & 1) * STAGE_BYTES, x, ldx, k, n, ch + 1, n0);
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of chunk ch have landed
    __syncthreads();     // ... and everyone's
    const uint32_t xbuf = xs + (ch & 1) * STAGE_BYTES;
#pragma unroll
    for (int wi = 0; wi < WPW; ++wi) {
      const int w = win0 + wi;
      if (w < num_windows) {
        const int seg = w * num_chunks + ch;
        segment_mma<T, NT, PF>(acc[wi], frags, slot_rows, __ldg(kstep_offsets + seg), __ldg(kstep_offsets + seg + 1),
                           xbuf, lane);
      }
    }
    __syncthreads();  // the buffer of chunk ch is refilled with chunk ch + 2 in the next iteration
  }

  // Epilogue. Accumulator c0, c1: window row lane / 4, columns 2 * (lane % 4) + {0, 1}; c2, c3: row + 8.
  const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int wi = 0; wi < WPW; ++wi) {
    const int w = win0 + wi;
    if (w >= num_windows) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = __ldg(window_rows + w * kTcWindow + gid + 8 * h);
      if (row < 0) continue;
      const float b = bias != nullptr ? to_f(bias[row]) : 0.0f;
#pragma unroll
      for (int j = 0; j < NTILES; ++j) {
        const int col = n0 + 8 * j + 2 * tig;
        const float v0 = epilogue(acc[wi][j][2 * h], b, relu);
        const float v1 = epilogue(acc[wi][j][2 * h + 1], b, relu);
        if constexpr (!YT) {
          T* dst = y + static_cast<int64_t>(row) * ys_m + col;
          if (y_pair_ok && col + 1 < n) {
            *reinterpret_cast<uint32_t*>(dst) = pack2(T{}, v0, v1);
          } else {
            if (col < n) dst[0] = from_f<T>(v0);
            if (col + 1 < n) dst[1] = from_f<T>(v1);
          }
        } else {
          const int64_t base = static_cast<int64_t>(row) * ys_m;
          if (col < n) y[base + static_cast<int64_t>(col) * ys_n] = from_f<T>(v0);
          if (col + 1 < n) y[base + static_cast<int64_t>(col + 1) * ys_n] = from_f<T>(v1);
        }
      }
    }
  }
}

template <typename T, bool YT, int WPW, int NT, int PF>
void launch_tc(const at::Tensor& frag_values, const at::Tensor& slot_rows, const at::Tensor& kstep_offsets,
               const at::Tensor& window_rows, const at::Tensor& x, int64_t ldx, const at::Tensor& y, bool y_pair_ok,
               const T* bias, bool relu, int k, int n, int num_windows, int num_chunks) {
  constexpr int kSmem = kTcStages * kTcChunk * NT * static_cast<int>(sizeof(T));
  auto kernel = spmm_tc_kernel<T, YT, WPW, NT, PF>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const int64_t grid_y = (static_cast<int64_t>(n) + NT - 1) / NT;  // int64: n + NT - 1 may pass INT_MAX
  PRUNEKIT_CHECK(grid_y <= 65535, "spmm_csr_tc: N = ", n, " needs ", grid_y, " column tiles of ", NT, "; at most 65535");
  const dim3 grid((num_windows + kTcWarps * WPW - 1) / (kTcWarps * WPW), static_cast<unsigned>(grid_y));
  auto stream = c10::cuda::getCurrentCUDAStream();
  kernel<<<grid, kTcThreads, kSmem, stream>>>(
      reinterpret_cast<const uint4*>(frag_values.data_ptr()), slot_rows.data_ptr<uint8_t>(),
      kstep_offsets.data_ptr<int>(), window_rows.data_ptr<int>(), reinterpret_cast<const T*>(x.data_ptr()), ldx,
      reinterpret_cast<T*>(y.data_ptr()), y.stride(0), y.stride(1), y_pair_ok, bias, relu, k, n, num_windows,
      num_chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Tile configurations (Sputnik style: template arguments picked by a small dispatch, gpu.plan_spmm chooses).
// NT = 128 stages 2 x 64 KB of X: more than the 99 KB a block may opt into on sm_86 / sm_89 (RTX 30xx / 40xx, L4,
// L40), which would fail at cudaFuncSetAttribute; there the (1, 64) tile (64 KB) is taken instead.
template <typename T, bool YT>
void dispatch_tile(int64_t wpw, int64_t ntile, const at::Tensor& frag_values, const at::Tensor& slot_rows,
                   const at::Tensor& kstep_offsets, const at::Tensor& window_rows, const at::Tensor& x, int64_t ldx,
                   const at::Tensor& y, bool y_pair_ok, const T* bias, bool relu, int k, int n, int num_windows,
                   int num_chunks) {
  PRUNEKIT_CHECK((wpw == 2 && ntile == 128) || (wpw == 1 && ntile == 128) || (wpw == 1 && ntile == 64),
              "spmm_csr_tc: (windows_per_warp, ntile) must be (2, 128), (1, 128) or (1, 64), got (", wpw, ", ", ntile,
              ")");
  int smem_optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, x.get_device()));
  const auto stage_bytes = [](int nt) { return kTcStages * kTcChunk * nt * static_cast<int>(sizeof(T)); };
  if (ntile == 128 && smem_optin < stage_bytes(128)) {
    wpw = 1;
    ntile = 64;
  }
  PRUNEKIT_CHECK(smem_optin >= stage_bytes(64), "spmm_csr_tc: needs ", stage_bytes(64),
              " bytes of shared memory per block, the device allows ", smem_optin);
  // The deep prefetch ring (6 k-steps) for the 128-column tiles by default: on the H100 (2026-11-25, fifth
  // session; benchmarks/results/spmm-tc-pf{2,6}-h100-2026-11-25.json) it passed the tc tests and ran 8-15% faster
  // than depth 2 at 4096x4096 and 11008x4096, N = 4096, 90 / 95%. $PRUNEKIT_TC_PREFETCH=2 keeps the shallow ring.
  // $PRUNEKIT_TC_PREFETCH=0: the first design's rolling pair (see segment_mma), for every tile.
  const char* pf_env = std::getenv("PRUNEKIT_TC_PREFETCH");
  const bool classic = pf_env != nullptr && std::string(pf_env) == "0";
  const bool deep = !classic && (pf_env == nullptr || std::string(pf_env) != "2");
  if (classic) {
    if (wpw == 2 && ntile == 128) {
      return launch_tc<T, YT, 2, 128, 0>(frag_values, slot_rows, kstep_offsets, window_rows, x, ldx, y, y_pair_ok,
                                         bias, relu, k, n, num_windows, num_chunks);
    }
    if (wpw == 1 && ntile == 128) {
      return launch_tc<T, YT, 1, 128, 0>(frag_values, slot_rows, kstep_offsets, window_rows, x, ldx, y, y_pair_ok,
                                         bias, relu, k, n, num_windows, num_chunks);
    }
    return launch_tc<T, YT, 1, 64, 0>(frag_values, slot_rows, kstep_offsets, window_rows, x, ldx, y, y_pair_ok, bias,
                                      relu, k, n, num_windows, num_chunks);
  }
  if (wpw == 2 && ntile == 128) {
    if (deep) {
      return launch_tc<T, YT, 2, 128, 6>(frag_values, slot_rows, kstep_offsets, window_rows, x, ldx, y, y_pair_ok,
                                         bias, relu, k, n, num_windows, num_chunks);
    }
    return launch_tc<T, YT, 2, 128, 2>(frag_values, slot_rows, kstep_offsets, window_rows, x, ldx, y, y_pair_ok, bias,
                                       relu, k, n, num_windows, num_chunks);
  }
  if (wpw == 1 && ntile == 128) {
    if (deep) {
      return launch_tc<T, YT, 1, 128, 6>(frag_values, slot_rows, kstep_offsets, window_rows, x, ldx, y, y_pair_ok,
                                         bias, relu, k, n, num_windows, num_chunks);
    }
    return launch_tc<T, YT, 1, 128, 2>(frag_values, slot_rows, kstep_offsets, window_rows, x, ldx, y, y_pair_ok, bias,
                                       relu, k, n, num_windows, num_chunks);
  }
  return launch_tc<T, YT, 1, 64, 2>(frag_values, slot_rows, kstep_offsets, window_rows, x, ldx, y, y_pair_ok, bias,
                                    relu, k, n, num_windows, num_chunks);
}

}  // namespace

void spmm_csr_tc(const at::Tensor& frag_values, const at::Tensor& slot_rows, const at::Tensor& kstep_offsets,
                 const at::Tensor& window_rows, const at::Tensor& x, const at::Tensor& y,
                 const std::optional<at::Tensor>& bias, bool relu, int64_t windows_per_warp, int64_t ntile) {
  const char* op = "spmm_csr_tc";
  PRUNEKIT_CHECK(frag_values.is_cuda() && slot_rows.is_cuda() && kstep_offsets.is_cuda() && window_rows.is_cuda() &&
                  x.is_cuda() && y.is_cuda(),
              op, ": tensors must be on the GPU");
  const auto device = x.device();
  PRUNEKIT_CHECK(frag_values.device() == device && slot_rows.device() == device && kstep_offsets.device() == device &&
                  window_rows.device() == device && y.device() == device && (!bias || bias->device() == device),
              op, ": the plan, x, y and bias must be on one GPU (x is on ", device, ")");
  const auto dtype = x.scalar_type();
  PRUNEKIT_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op, ": tensor cores take float16 or bfloat16, got ",
              dtype);
  PRUNEKIT_CHECK(frag_values.scalar_type() == dtype && y.scalar_type() == dtype, op,
              ": frag_values, x and y must share one dtype");
  PRUNEKIT_CHECK(frag_values.dim() == 3 && frag_values.size(1) == 32 && frag_values.size(2) == 8 &&
                  frag_values.is_contiguous() && reinterpret_cast<uintptr_t>(frag_values.data_ptr()) % 16 == 0,
              op, ": frag_values must be a contiguous, 16-byte aligned (ksteps, 32, 8) tensor");
  const int64_t ksteps = frag_values.size(0);
  PRUNEKIT_CHECK(slot_rows.scalar_type() == at::kByte && slot_rows.dim() == 2 && slot_rows.size(0) == ksteps &&
                  slot_rows.size(1) == kTcKStep && slot_rows.is_contiguous(),
              op, ": slot_rows must be a contiguous (ksteps, 16) uint8 tensor");
  PRUNEKIT_CHECK(window_rows.scalar_type() == at::kInt && window_rows.dim() == 1 && window_rows.is_contiguous() &&
                  window_rows.numel() % kTcWindow == 0,
              op, ": window_rows must be a contiguous int32 tensor of num_windows * 16 entries");
  PRUNEKIT_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(1) == y.size(1), op, ": x (K, N) and y (M, N) expected");
  const int64_t m = y.size(0), n = y.size(1), k = x.size(0);
  const int64_t num_windows = window_rows.numel() / kTcWindow;
  const int64_t num_chunks = std::max<int64_t>(1, (k + kTcChunk - 1) / kTcChunk);
  PRUNEKIT_CHECK(num_windows == (m + kTcWindow - 1) / kTcWindow, op, ": window_rows has ", window_rows.numel(),
              " entries; a plan for M = ", m, " has ", (m + kTcWindow - 1) / kTcWindow * kTcWindow);
  PRUNEKIT_CHECK(kstep_offsets.scalar_type() == at::kInt && kstep_offsets.dim() == 1 && kstep_offsets.is_contiguous() &&
                  kstep_offsets.numel() == num_windows * num_chunks + 1,
              op, ": kstep_offsets must be a contiguous int32 tensor of num_windows * ceil(K / 256) + 1 entries "
              "(was the plan built for this K?)");
  // int32 index math in the kernel: window slot w * 16 + 15, segment w * num_chunks + ch (+ 1), k-step * 32 + 31.
  constexpr int64_t kInt32Max = (int64_t(1) << 31) - 1;
  PRUNEKIT_CHECK(num_windows * kTcWindow <= kInt32Max && k <= kInt32Max && n <= kInt32Max &&
                  num_windows * num_chunks < kInt32Max && ksteps * 32 <= kInt32Max,
              op, ": problem too large for int32 indexing");
  // X: row-major, leading dimension a multiple of 8 elements (16 bytes), 16-byte aligned base.
  const int64_t ldx = x.stride(0);
  PRUNEKIT_CHECK((x.stride(1) == 1 || n <= 1) && ldx % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              op, ": x must be row-major with a leading dimension that is a multiple of 8 and a 16-byte aligned base");
  // Y: row-major (unit stride along N) or any other strides (element stores).
  const bool yt = !(y.stride(1) == 1 || n <= 1);
  const bool y_pair_ok = !yt && y.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(y.data_ptr()) % 4 == 0;
  if (bias) {
    PRUNEKIT_CHECK(bias->is_cuda() && bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == m, op,
                ": bias must be a contiguous (M,) tensor of x's dtype");
  }
  if (m == 0 || n == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* b = bias ? reinterpret_cast<const scalar_t*>(bias->data_ptr()) : nullptr;
    if (yt) {
      dispatch_tile<scalar_t, true>(windows_per_warp, ntile, frag_values, slot_rows, kstep_offsets, window_rows, x,
                                    ldx, y, y_pair_ok, b, relu, k, n, num_windows, num_chunks);
    } else {
      dispatch_tile<scalar_t, false>(windows_per_warp, ntile, frag_values, slot_rows, kstep_offsets, window_rows, x,
                                     ldx, y, y_pair_ok, b, relu, k, n, num_windows, num_chunks);
    }
  };
  if (dtype == at::kHalf) {
    run(__half{});
  } else {
    run(__nv_bfloat16{});
  }
}

}  // namespace prunekit
