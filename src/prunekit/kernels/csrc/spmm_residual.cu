// The residual of the `split24` SpMM variant: Y (M, N) row-major [+]= R @ X^T for a hypersparse R.
//
// A random unstructured weight at 90% sparsity is, along K, a 2:4 weight (the two largest of every group of 4; Hopper's
// sparse tensor cores through cuSPARSELt, prunekit_cslt) plus a residual R holding the rest: only groups with more
// than 2 non-zeros have any, 0.37% of them, so R has a density of about 0.1% (0.012% at 95%): a handful of non-zeros
// per row (docs/PERFORMANCE.md, "Twenty-eighth session" and "Twenty-ninth session"). Its product is a pass over Y, so
// it is bound by Y's bytes and X's, not by arithmetic. The general CSR kernels stage X per block of rows; for rows this
// short that reads X many times over (s28g: 87-235 us at N = 2048 where writing Y takes 6-15 us).
//
// Here each block owns TN tokens and every row: X's TN rows (N, K row-major, nn.Linear's activations) are staged once
// into shared memory transposed, xs[c][t], so that a non-zero's TN products read one contiguous 2 * TN bytes. R is
// stored as SELL (sliced ELLPACK, slices of 32 rows, kernels/split24.py residual_sell): a warp takes a slice, a lane
// a row, and each slot's 32 entries are one coalesced load. Each lane then writes Y[r, n0 : n0 + TN] (2 * TN
// contiguous bytes; 16-byte stores where aligned). X is read from memory once per call, R once per block (from L2),
// Y once (or read and written once when accumulating). TN: the largest of 16 / 8 / 4 whose tile fits a block's
// shared memory (16 up to K = 7264 in fp16).
//
// Where the time goes (H100, 4096 x 4096, N = 2048; split24-{stage,rows}-h100-2026-11-26-s29f.json): staging X
// takes 7.7 us, the rows 25 us in write mode whatever the number of non-zeros (16 K or 2 K). Y's rows are cuSPARSELt's
// fast layout (tokens contiguous), and a block of TN tokens writes each of them in a 16- or 32-byte piece. The first
// version (CSR rows, a lane per row, its non-zeros' loads scattered across the warp) took the same time in write mode.
//
// accumulate = false writes Y = R @ X^T (every row, zeros where R's row is empty): the C that cuSPARSELt then adds in
// its epilogue (beta = 1). accumulate = true adds into Y (rows without non-zeros are skipped unless relu), then ReLU.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <type_traits>

#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams
#include "common.cuh"
#include "kernels.h"

namespace prunekit {

namespace {

constexpr int kResidualThreads = 512;
constexpr int kSliceRows = 32;  // rows per slice of the SELL layout: one warp, a lane per row
constexpr int kSlotUnroll = 4;  // slots whose entries a lane loads before it uses them

template <int BYTES> struct VecOf;
template <> struct VecOf<8> { using type = uint2; };
template <> struct VecOf<16> { using type = uint4; };

// Load X's rows [n0, n0 + TN) (zero beyond n_valid) into xs[c * TN + t]: each thread copies columns c, c + 1 (one
// 4-byte load per token where `pairs`, else two 2-byte loads), 2 * TN * 2 bytes, stored as 16-byte (or 8-byte) vectors;
// where a column spans two vectors, lanes 4-7 of each group of 8 store the second one first, so that a warp's stores
// fall on distinct banks.
template <int TN>
__device__ __forceinline__ void store_column(uint16_t* xs, int c, const uint32_t* words) {
  constexpr int kBytes = TN * 2;
  constexpr int kVecBytes = kBytes < 16 ? kBytes : 16;
  constexpr int kVecs = kBytes / kVecBytes;
  using V = typename VecOf<kVecBytes>::type;
  V* dst = reinterpret_cast<V*>(xs + static_cast<int64_t>(c) * TN);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int q = kVecs == 2 ? (i + ((threadIdx.x >> 2) & 1)) & 1 : i;
    V v;
    if constexpr (kVecBytes == 16) {
      v = make_uint4(words[4 * q], words[4 * q + 1], words[4 * q + 2], words[4 * q + 3]);
    } else {
      v = make_uint2(words[2 * q], words[2 * q + 1]);
    }
    dst[q] = v;
  }
}

template <int TN>
__device__ __forceinline__ void stage_x(uint16_t* xs, const uint16_t* __restrict__ x, int64_t ldx, int k, int n0,
                                        int n_valid, bool pairs) {
  constexpr int kPairs = 32 / TN;  // column pairs per thread whose loads are all issued before the first store
  const int nt = min(TN, n_valid - n0);
  const uint16_t* xb = x + static_cast<int64_t>(n0) * ldx;
  const int step = 2 * static_cast<int>(blockDim.x);
  for (int c0 = 2 * threadIdx.x; c0 < k; c0 += step * kPairs) {
    uint32_t v[kPairs][TN];  // columns c and c + 1 of token t in one word
#pragma unroll
    for (int u = 0; u < kPairs; ++u) {
      const int c = c0 + u * step;
#pragma unroll
      for (int t = 0; t < TN; ++t) {
        const uint16_t* p = xb + static_cast<int64_t>(t) * ldx + c;
        if (pairs) {  // K even, rows 4-byte aligned: c + 1 < k
          v[u][t] = t < nt && c < k ? __ldg(reinterpret_cast<const unsigned int*>(p)) : 0u;
        } else {
          const uint32_t lo = t < nt && c < k ? __ldg(p) : 0u;
          const uint32_t hi = t < nt && c + 1 < k ? __ldg(p + 1) : 0u;
          v[u][t] = lo | (hi << 16);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kPairs; ++u) {
      const int c = c0 + u * step;
      if (c >= k) break;
      uint32_t lo_words[TN / 2], hi_words[TN / 2];  // columns c and c + 1, two tokens per word
#pragma unroll
      for (int t = 0; t < TN; t += 2) {
        lo_words[t / 2] = (v[u][t] & 0xffffu) | (v[u][t + 1] << 16);
        hi_words[t / 2] = (v[u][t] >> 16) | (v[u][t + 1] & 0xffff0000u);
      }
      store_column<TN>(xs, c, lo_words);
      if (c + 1 < k) store_column<TN>(xs, c + 1, hi_words);
    }
  }
}

// Y's TN values of row r (its row pointer yr): acc (+ the old values where accumulate), ReLU, stored.
template <typename T, int TN>
__device__ __forceinline__ void finish_row(T* yr, float* acc, int nt, bool vec, bool accumulate, bool relu) {
  constexpr int kWords = TN / 2;
  if (accumulate) {  // Y's old values, read only for rows that change
    if (vec) {
      uint32_t yw[kWords];
      if constexpr (TN >= 8) {
#pragma unroll
        for (int q = 0; q < kWords; q += 4) {
          const uint4 t4 = *reinterpret_cast<const uint4*>(reinterpret_cast<const uint32_t*>(yr) + q);
          yw[q] = t4.x, yw[q + 1] = t4.y, yw[q + 2] = t4.z, yw[q + 3] = t4.w;
        }
      } else {
        const uint2 t2 = *reinterpret_cast<const uint2*>(yr);
        yw[0] = t2.x, yw[1] = t2.y;
      }
#pragma unroll
      for (int t = 0; t < TN; ++t) acc[t] += word_elem<T>(yw, t);
    } else {
#pragma unroll
      for (int t = 0; t < TN; ++t) acc[t] += t < nt ? to_f(yr[t]) : 0.f;
    }
  }
  if (relu) {
#pragma unroll
    for (int t = 0; t < TN; ++t) acc[t] = fmaxf(acc[t], 0.f);
  }
  if (vec) {
    if constexpr (TN >= 8) {
#pragma unroll
      for (int t = 0; t < TN; t += 8) store_vec16<T>(yr + t, acc + t);
    } else {
      store4<T>(yr, acc[0], acc[1], acc[2], acc[3]);
    }
  } else {
#pragma unroll
    for (int t = 0; t < TN; ++t) {
      if (t < nt) yr[t] = from_f<T>(acc[t]);
    }
  }
}

// One warp per slice of 32 rows (lane = row), P slices at a time (their loads interleaved, so that more of them are
// in flight), slices strided over the block's warps; slot after slot, each lane loads its row's entry (coalesced
// across the warp), then reads the TN values of X's column from shared memory. `phases` (diagnostics,
// $PRUNEKIT_SPLIT24_PHASES): bit 0 stages X, bit 1 runs the rows; the result is only right with both.
template <typename T, typename I, int TN, int P>
__global__ void __launch_bounds__(kResidualThreads, 2)
residual_rows_kernel(const T* __restrict__ values, const I* __restrict__ cols, const int* __restrict__ slice_offsets,
                     const T* __restrict__ x, int64_t ldx, T* __restrict__ y, int64_t ldy, int m, int k, int n,
                     int n_valid, bool accumulate, bool relu, bool vec_y, bool pairs, int phases) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);
  const int n0 = blockIdx.x * TN;
  if (phases & 1) stage_x<TN>(xs, reinterpret_cast<const uint16_t*>(x), ldx, k, n0, n_valid, pairs);  // zeros past n_valid
  __syncthreads();
  if (!(phases & 2)) return;
  const int nt = min(TN, n - n0);
  const bool vec = vec_y && nt == TN;
  const int slices = (m + kSliceRows - 1) / kSliceRows;
  const int per_part = (slices + gridDim.y - 1) / gridDim.y;
  const int s_begin = blockIdx.y * per_part, s_end = min(slices, s_begin + per_part);
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  constexpr int kWords = TN / 2;
  for (int s = s_begin + static_cast<int>(threadIdx.x >> 5); s < s_end; s += P * warps) {
    int base[P], len[P];
    int longest = 0;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int sp = s + p * warps;
      base[p] = sp < s_end ? __ldg(slice_offsets + sp) : 0;
      len[p] = sp < s_end ? __ldg(slice_offsets + sp + 1) - base[p] : 0;
      longest = max(longest, len[p]);
    }
    float acc[P][TN];
    bool any[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      any[p] = false;
#pragma unroll
      for (int t = 0; t < TN; ++t) acc[p][t] = 0.f;
    }
    for (int q = 0; q < longest; q += kSlotUnroll) {
      int c[P][kSlotUnroll];
      float v[P][kSlotUnroll];
#pragma unroll
      for (int p = 0; p < P; ++p) {
#pragma unroll
        for (int u = 0; u < kSlotUnroll; ++u) {  // the loads first, so that their latencies overlap
          const bool in = q + u < len[p];
          const int64_t e = static_cast<int64_t>(base[p] + q + u) * kSliceRows + lane;
          c[p][u] = in ? static_cast<int>(__ldg(cols + e)) : -1;
          v[p][u] = in ? to_f(__ldg(values + e)) : 0.f;
        }
      }
#pragma unroll
      for (int p = 0; p < P; ++p) {
#pragma unroll
        for (int u = 0; u < kSlotUnroll; ++u) {
          if (c[p][u] < 0) continue;  // padding (or past the slice's last slot)
          any[p] = true;
          const uint32_t* xc = reinterpret_cast<const uint32_t*>(xs + static_cast<int64_t>(c[p][u]) * TN);
          uint32_t w[kWords];
#pragma unroll
          for (int qq = 0; qq < kWords; qq += (kWords >= 4 ? 4 : 2)) {
            if constexpr (kWords >= 4) {
              const uint4 t4 = *reinterpret_cast<const uint4*>(xc + qq);
              w[qq] = t4.x, w[qq + 1] = t4.y, w[qq + 2] = t4.z, w[qq + 3] = t4.w;
            } else {
              const uint2 t2 = *reinterpret_cast<const uint2*>(xc + qq);
              w[qq] = t2.x, w[qq + 1] = t2.y;
            }
          }
#pragma unroll
          for (int t = 0; t < TN; ++t) acc[p][t] = fmaf(v[p][u], word_elem<T>(w, t), acc[p][t]);
        }
      }
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int r = (s + p * warps) * kSliceRows + lane;
      if (r >= m || (accumulate && !relu && !any[p])) continue;  // rows past M; rows with nothing to add
      finish_row<T, TN>(y + static_cast<int64_t>(r) * ldy + n0, acc[p], nt, vec, accumulate, relu);
    }
  }
}

}  // namespace

// Tokens per block: the largest of 16 / 8 / 4 whose X tile (tile_n * K 16-bit elements) fits a block's shared
// memory (one block per SM where it takes most of it); 0 where none does. `forced` (16 / 8 / 4, from
// $PRUNEKIT_SPLIT24_TILE_N through the op's tile_n argument) takes that one where it fits. A tile small enough for two
// blocks per SM was slower in add mode at all 10 points timed against it (split24-t{8,16}-h100-2026-11-26-s29{c,e}).
int64_t residual_tile_n(int64_t k, int64_t smem_block, int64_t forced) {
  if (forced > 0) return k * forced * 2 <= smem_block ? forced : 0;
  for (int64_t tn : {16, 8, 4}) {
    if (k * tn * 2 <= smem_block) return tn;
  }
  return 0;
}

void spmm_residual_rows(const at::Tensor& values, const at::Tensor& column_indices, const at::Tensor& slice_offsets,
                        const at::Tensor& x, const at::Tensor& y, int64_t n_valid, bool accumulate, bool relu,
                        int64_t row_parts, int64_t tile_n, int64_t slices_per_warp, int64_t phases) {
  constexpr const char* op = "spmm_residual_rows";
  PRUNEKIT_CHECK(slice_offsets.is_cuda() && column_indices.is_cuda() && values.is_cuda(), op,
                 ": the residual's tensors must be on the GPU");
  PRUNEKIT_CHECK(slice_offsets.scalar_type() == at::kInt && slice_offsets.dim() == 1 && slice_offsets.is_contiguous(),
                 op, ": slice_offsets must be a contiguous 1-D int32 tensor");
  PRUNEKIT_CHECK(column_indices.dim() == 1 && column_indices.is_contiguous() && values.dim() == 1 &&
                     values.is_contiguous() && values.numel() == column_indices.numel(),
                 op, ": values and column_indices must be contiguous 1-D tensors of one length");
  PRUNEKIT_CHECK(x.dim() == 2 && y.dim() == 2, op, ": x (N, K) and y (M, N_out) must be 2-D");
  const auto dtype = values.scalar_type();
  PRUNEKIT_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op, ": values must be float16 or bfloat16, got ", dtype);
  PRUNEKIT_CHECK(x.scalar_type() == dtype && y.scalar_type() == dtype, op, ": values, x and y must share one dtype");
  PRUNEKIT_CHECK(x.device() == values.device() && y.device() == values.device() &&
                     slice_offsets.device() == values.device() && column_indices.device() == values.device(),
                 op, ": every tensor must be on one GPU");
  PRUNEKIT_CHECK(x.stride(1) == 1 || x.size(1) <= 1, op, ": x must be row-major (N, K) (unit stride along K)");
  PRUNEKIT_CHECK(y.stride(1) == 1 || y.size(1) <= 1, op, ": y must be row-major (M, N_out) (unit stride along N)");
  const int64_t m = y.size(0), n = y.size(1), k = x.size(1);
  const int64_t slices = (m + kSliceRows - 1) / kSliceRows;
  PRUNEKIT_CHECK(slice_offsets.numel() == slices + 1, op, ": slice_offsets has ", slice_offsets.numel(),
                 " entries, expected ceil(M / 32) + 1 = ", slices + 1);
  PRUNEKIT_CHECK(values.numel() % kSliceRows == 0, op, ": values must hold whole slots of 32 entries, got ",
                 values.numel());
  PRUNEKIT_CHECK(n_valid >= 0 && n_valid <= x.size(0) && n_valid <= n, op, ": n_valid (", n_valid,
                 ") must be at most x's rows (", x.size(0), ") and y's columns (", n, ")");
  PRUNEKIT_CHECK(m < (int64_t{1} << 31) && n < (int64_t{1} << 31) && k < (int64_t{1} << 31) &&
                     values.numel() < (int64_t{1} << 31),
                 op, ": M, N, K and the slots must be < 2^31");
  PRUNEKIT_CHECK(row_parts >= 1 && row_parts <= 65535, op, ": row_parts must be in [1, 65535], got ", row_parts);
  PRUNEKIT_CHECK(tile_n == 0 || tile_n == 4 || tile_n == 8 || tile_n == 16, op,
                 ": tile_n must be 0 (the rule), 4, 8 or 16, got ", tile_n);
  PRUNEKIT_CHECK(slices_per_warp == 1 || slices_per_warp == 2, op, ": slices_per_warp must be 1 or 2, got ",
                 slices_per_warp);
  PRUNEKIT_CHECK(phases >= 0 && phases <= 3, op, ": phases must be in [0, 3], got ", phases);
  if (m == 0 || n == 0) return;
  const c10::cuda::CUDAGuard guard(values.device());
  int device = 0, smem_block = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int64_t tn = residual_tile_n(std::max<int64_t>(k, 1), smem_block, tile_n);
  PRUNEKIT_CHECK(tn > 0, op, ": K = ", k, " is too large: ", std::max<int64_t>(tile_n, 4),
                 " rows of X must fit in shared memory (", smem_block, " bytes)");
  const size_t smem = static_cast<size_t>(std::max<int64_t>(k, 1) * tn * 2);
  const bool vec_y = reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0 && (y.stride(0) * 2) % 16 == 0;
  const dim3 grid(static_cast<unsigned>((n + tn - 1) / tn), static_cast<unsigned>(std::min(row_parts, slices)));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t ldx = x.size(0) > 1 ? x.stride(0) : k, ldy = y.size(0) > 1 ? y.stride(0) : n;
  const bool pairs = k % 2 == 0 && ldx % 2 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0;
  PRUNEKIT_DISPATCH_INDEX(column_indices.scalar_type(), [&] {
    auto run = [&](auto tag) {
      using scalar_t = decltype(tag);
      const auto* vals = reinterpret_cast<const scalar_t*>(values.data_ptr());
      const auto* cols = reinterpret_cast<const index_t*>(column_indices.data_ptr());
      const auto* xp = reinterpret_cast<const scalar_t*>(x.data_ptr());
      auto* yp = reinterpret_cast<scalar_t*>(y.data_ptr());
      auto go = [&](auto kernel) {
        C10_CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
        kernel<<<grid, kResidualThreads, smem, stream>>>(vals, cols, slice_offsets.data_ptr<int>(), xp, ldx, yp, ldy,
                                                         static_cast<int>(m), static_cast<int>(k), static_cast<int>(n),
                                                         static_cast<int>(n_valid), accumulate, relu, vec_y, pairs,
                                                         static_cast<int>(phases));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      auto tiles = [&](auto p_tag) {
        constexpr int P = decltype(p_tag)::value;
        if (tn == 16) {
          go(residual_rows_kernel<scalar_t, index_t, 16, P>);
        } else if (tn == 8) {
          go(residual_rows_kernel<scalar_t, index_t, 8, P>);
        } else {
          go(residual_rows_kernel<scalar_t, index_t, 4, P>);
        }
      };
      if (slices_per_warp == 2) {
        tiles(std::integral_constant<int, 2>{});
      } else {
        tiles(std::integral_constant<int, 1>{});
      }
    };
    if (dtype == at::kHalf) {
      run(__half{});
    } else {
      run(__nv_bfloat16{});
    }
  });
}

}  // namespace prunekit
