// SpMM, Sputnik's direct design for moderate/large N: Y (M, N) = act(A @ X + bias), A in prunekit CSR, X row-major.
//
// Gale et al., SC 2020: 1-D tiling of the output (sec. 4): LPR lanes (32, or 16 / 8 / 4 at smaller N: subwarp tiling,
// sec. 5.1) compute one row times a tile of LPR * VN output columns (VN = 16 bytes of X per lane: 8 fp16/bf16 or 4
// fp32 columns); the lanes load chunks of the row's (value, column) pairs with coalesced loads (LPR pairs, or U where
// U > LPR: U / LPR per lane) and broadcast each with a shuffle; every lane then reads the 16-byte vector of X's row at
// that column (vector memory instructions, sec. 5.2), U non-zeros' loads in flight before their FMAs (fp32
// accumulation; U = 4 / 8 / 16 / 32, the next chunk's pairs loaded ahead for U > 4: see direct_unroll_setting). Rows
// are taken in row_indices order (row swizzle, sec. 5.3) for a row-major Y. For the transposed Y of nn.Linear
// (tokens, out_features) a block takes consecutive rows (warps x 32 / LPR of them) and writes them through shared
// memory with 16-byte stores. X of another layout, and a row-major X whose N is not a multiple of VN, is copied first
// into row-major rows padded to whole vectors (row_major_copy), so every lane loads vectors: with element loads N = 17
// / 20 took 2.0-2.8x the time of N = 24 (spmm-lown-h100-2026-11-27-s32a.json). Residue: unaligned X/Y, and X as given
// with $PRUNEKIT_ROWWARP_TRANSPOSE=0, fall back to element loads/stores with bounds.
#include <cstdlib>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "common.cuh"
#include "kernels.h"
#include "check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit {

constexpr int kDirectWarps = 8;  // warps per block at most ($PRUNEKIT_DIRECT_WARPS: 2 / 4 / 8)

// Entry idx of a row's chunk, held by lane idx % LPR of the row's segment in its register idx / LPR, broadcast to the
// segment. Callers pass a compile-time idx where P > 1, so the select folds away.
template <int LPR, int P, typename V>
__device__ __forceinline__ V chunk_entry(const V (&r)[P], int idx, unsigned mask) {
  V s = r[0];
#pragma unroll
  for (int q = 1; q < P; ++q)
    if (idx / LPR == q) s = r[q];
  return __shfl_sync(mask, s, idx % LPR, LPR);
}

// Entries [e, e + G) of a chunk: G non-zeros' 16-byte X loads in flight, then their FMAs (fp32 accumulation).
template <typename T, int G, int LPR, int P>
__device__ __forceinline__ void mac_vec(float* acc, const float (&v)[P], const int (&c)[P], int e, unsigned mask,
                                        const T* xl, int64_t xs_k, bool lane_in) {
  constexpr int VN = 16 / sizeof(T);
  float a[G];
  int cc[G];
#pragma unroll
  for (int u = 0; u < G; ++u) {
    a[u] = chunk_entry<LPR>(v, e + u, mask);
    cc[u] = chunk_entry<LPR>(c, e + u, mask);
  }
  if (!lane_in) return;
  Words<16> w[G];
#pragma unroll
  for (int u = 0; u < G; ++u) w[u].load(xl + static_cast<int64_t>(cc[u]) * xs_k);
#pragma unroll
  for (int u = 0; u < G; ++u)
#pragma unroll
    for (int t = 0; t < VN; ++t) acc[t] = fmaf(a[u], word_elem<T>(w[u].w, t), acc[t]);
}

// Entry e alone, element loads with bounds: N not a multiple of VN or unaligned X, or a row not padded to 4 entries.
template <typename T, int LPR, int P>
__device__ __forceinline__ void mac_elem(float* acc, const float (&v)[P], const int (&c)[P], int e, unsigned mask,
                                         const T* xl, int64_t xs_k, int nl, int n) {
  constexpr int VN = 16 / sizeof(T);
  const float a = chunk_entry<LPR>(v, e, mask);
  const T* xp = xl + static_cast<int64_t>(chunk_entry<LPR>(c, e, mask)) * xs_k;
#pragma unroll
  for (int t = 0; t < VN; ++t)
    if (nl + t < n) acc[t] = fmaf(a, to_f(xp[t]), acc[t]);
}

// U: X loads in flight per lane (vector path). Chunks hold CH = max(LPR, U) entries of a row, P = CH / LPR (value,
// column) pairs per lane; U > 4 also loads the next chunk's pairs before this chunk's X loads (software pipelining).
template <typename T, typename I, bool YT, bool VEC, int LPR, int U>
__global__ void __launch_bounds__(32 * kDirectWarps, (U >= 32 ? 1 : 2))
spmm_direct_kernel(const T* __restrict__ values, const int* __restrict__ row_offsets, const I* __restrict__ cols,
                   const int* __restrict__ row_indices, const T* __restrict__ x, int64_t xs_k,
                   T* __restrict__ y, int64_t ys_m, int64_t ys_n, bool y_vec_ok, const T* __restrict__ bias,
                   bool relu, int m, int n) {
  constexpr int VN = 16 / sizeof(T);
  constexpr int NTILE = LPR * VN;            // output columns per row tile
  constexpr int RPW = 32 / LPR;              // rows per warp (one per segment of LPR lanes)
  constexpr int kMaxRows = kDirectWarps * RPW;
  constexpr int kPitch = NTILE + VN;         // shared-memory pitch of the YT staging tile
  constexpr int P = VEC && U > LPR ? U / LPR : 1;
  constexpr int CH = LPR * P;
  constexpr bool kPipe = VEC && U > 4;
  __shared__ __align__(16) T stage[YT ? kMaxRows * kPitch : 1];

  const int rows = static_cast<int>(blockDim.x / 32) * RPW;  // rows per block
  const int warp = threadIdx.x / 32;
  const int seg = (threadIdx.x % 32) / LPR, lane = threadIdx.x % LPR;
  // Segments of one warp walk different rows (different trip counts): shuffles use the segment's lanes only.
  const unsigned mask = LPR == 32 ? 0xffffffffu : (((1u << LPR) - 1u) << (seg * LPR));
  const int rl = warp * RPW + seg;
  const int slot = blockIdx.x * rows + rl;
  const bool active = slot < m;
  const int row = active ? (YT ? slot : __ldg(row_indices + slot)) : 0;
  const int start = active ? __ldg(row_offsets + row) : 0;
  const int end = active ? __ldg(row_offsets + row + 1) : 0;
  const int tile0 = blockIdx.y * NTILE;
  const int nl = tile0 + lane * VN;  // this lane's first output column
  const bool lane_in = nl < n;
  const T* xl = x + nl;

  float acc[VN];
#pragma unroll
  for (int t = 0; t < VN; ++t) acc[t] = 0.0f;

  float v[P], v_next[P];
  int c[P], c_next[P];
  auto load_pairs = [&](int base, float (&vv)[P], int (&cc)[P]) {
#pragma unroll
    for (int q = 0; q < P; ++q) {
      const int j = base + q * LPR + lane;
      vv[q] = j < end ? to_f(values[j]) : 0.0f;
      cc[q] = j < end ? static_cast<int>(cols[j]) : 0;
    }
  };
  if constexpr (kPipe) load_pairs(start, v_next, c_next);
  for (int base = start; base < end; base += CH) {
    if constexpr (kPipe) {
#pragma unroll
      for (int q = 0; q < P; ++q) {
        v[q] = v_next[q];
        c[q] = c_next[q];
      }
      load_pairs(base + CH, v_next, c_next);
    } else {
      load_pairs(base, v, c);
    }
    const int cnt = min(CH, end - base);
    int e = 0;  // the next entry of the chunk (P = 1)
    if constexpr (VEC) {
      if constexpr (P > 1) {
        // Entry indices stay compile-time constants (a runtime index into v / c would put them in local memory):
        // a full chunk is one group; a row's last, partial chunk takes groups of 4, then single entries.
        if (cnt == CH) {
          mac_vec<T, CH, LPR>(acc, v, c, 0, mask, xl, xs_k, lane_in);
        } else {
#pragma unroll
          for (int g = 0; g < CH; g += 4)
            if (g + 4 <= cnt) mac_vec<T, 4, LPR>(acc, v, c, g, mask, xl, xs_k, lane_in);
#pragma unroll
          for (int q = 0; q < CH; ++q)
            if (q >= (cnt & ~3) && q < cnt) mac_elem<T, LPR>(acc, v, c, q, mask, xl, xs_k, nl, n);
        }
      } else {
        if constexpr (U > 4) {
          for (; e + U <= cnt; e += U) mac_vec<T, U, LPR>(acc, v, c, e, mask, xl, xs_k, lane_in);
        }
        // Rows are padded to multiples of 4 entries or more (formats/csr.py), so groups of 4 cover every row.
        for (; e + 4 <= cnt; e += 4) mac_vec<T, 4, LPR>(acc, v, c, e, mask, xl, xs_k, lane_in);
        for (; e < cnt; ++e) mac_elem<T, LPR>(acc, v, c, e, mask, xl, xs_k, nl, n);
      }
    } else {
      for (; e + 4 <= cnt; e += 4)
#pragma unroll
        for (int u = 0; u < 4; ++u) mac_elem<T, LPR>(acc, v, c, e + u, mask, xl, xs_k, nl, n);
      for (; e < cnt; ++e) mac_elem<T, LPR>(acc, v, c, e, mask, xl, xs_k, nl, n);
    }
  }

  const float b = (bias != nullptr && active) ? to_f(bias[row]) : 0.0f;
  float o[VN];
#pragma unroll
  for (int t = 0; t < VN; ++t) o[t] = epilogue(acc[t], b, relu);

  if constexpr (!YT) {
    if (!active || !lane_in) return;
    T* dst = y + static_cast<int64_t>(row) * ys_m + static_cast<int64_t>(nl) * ys_n;
    if (y_vec_ok && nl + VN <= n) {
      store_vec16<T>(dst, o);
    } else {
#pragma unroll
      for (int t = 0; t < VN; ++t)
        if (nl + t < n) y[static_cast<int64_t>(row) * ys_m + static_cast<int64_t>(nl + t) * ys_n] = from_f<T>(o[t]);
    }
  } else {
    // Transposed Y (element (row, col) at col * ys_n + row): stage the block's rows x NTILE, then one thread per
    // output column writes the block's consecutive rows.
#pragma unroll
    for (int t = 0; t < VN; ++t) stage[rl * kPitch + lane * VN + t] = from_f<T>(o[t]);
    __syncthreads();
    const int r0 = blockIdx.x * rows;
    for (int nn = threadIdx.x; nn < NTILE; nn += blockDim.x) {
      const int col = tile0 + nn;
      if (col >= n) break;
      T* dst = y + static_cast<int64_t>(col) * ys_n + r0;
      if (y_vec_ok && r0 + rows <= m && rows % VN == 0) {
        for (int q = 0; q < rows / VN; ++q) {  // VN rows per 16-byte store
          float vals[VN];
#pragma unroll
          for (int r = 0; r < VN; ++r) vals[r] = to_f(stage[(q * VN + r) * kPitch + nn]);
          store_vec16<T>(dst + q * VN, vals);
        }
      } else {
        for (int r = 0; r < rows && r0 + r < m; ++r) dst[r] = stage[r * kPitch + nn];
      }
    }
  }
}

// Lanes per row (LPR): $PRUNEKIT_DIRECT_LPR (4 / 8 / 16 / 32, read at each call) forces it; by default rows get 32 lanes
// (32 * VN columns) when N fills them, else 16 lanes (two rows per warp) so that no lane idles, and 16-bit types 8
// lanes up to N = 64 (4 up to 32, below). Fewer lanes per row make narrower column tiles (LPR * VN columns): more blocks over N, and a
// smaller slice of X per tile. At N = 32 / 64 (direct-u32-h100-2026-11-27-s31a.json, both layouts, each lane count at
// its fastest loads in flight) 16 lanes took 1.03-1.30 of 8's time at 4096 x 4096, 1.47-1.80 at 11008 x 4096 and
// 1.09-1.45 at 4096 x 11008; 0.96-1.15 at 3072 x 768, and 0.87-0.98 at 768 x 3072 (24 blocks of 32 rows at 8 lanes).
// Up to N = 32 16-bit types take 4 lanes (32 columns, eight rows per warp): at N = 16 / 24 / 32
// (direct-lpr4-h100-2026-11-27-s31e.json, both layouts, each at its fastest loads in flight) 4 lanes took 0.67-0.83 of
// 8's time at 11008 x 4096, the shape where "auto" takes direct at these N (gpu.DIRECT_LOW_N_MIN_ROWS_PER_SM), and
// 0.95-1.11 on the other four shapes.
inline int direct_lpr_setting() {
  const char* v = std::getenv("PRUNEKIT_DIRECT_LPR");
  if (v == nullptr) return 0;
  const int lpr = std::atoi(v);
  return (lpr == 4 || lpr == 8 || lpr == 16 || lpr == 32) ? lpr : 0;
}

// X loads in flight per lane (U): $PRUNEKIT_DIRECT_UNROLL (4 / 8 / 16 / 32, read at each call) forces it; 4 is the
// original loop, 8 and more also load the next chunk's (value, column) pairs ahead (the kernel's kPipe), and above the
// lanes per row each lane holds U / LPR pairs of a chunk. Default: direct_default_unroll. Measured on the H100
// (benchmarks/direct_lpr.py, direct-tiles-h100-2026-11-27-s30g.json; 5 shapes, 90 / 95 / 98%, fp16): at N = 64 and
// 128, 8 was faster than 4 at 30 of 30 points in either X layout (0.76-1.00 of the time); at N = 256 (32 lanes) it was
// faster at 8 / 6 of 15 (up to 1.22x slower), 16 at 5 / 3.
inline int direct_unroll_setting() {
  const char* v = std::getenv("PRUNEKIT_DIRECT_UNROLL");
  if (v == nullptr) return 0;
  const int u = std::atoi(v);
  return (u == 4 || u == 8 || u == 16 || u == 32) ? u : 0;
}

// The default X loads in flight (U) where $PRUNEKIT_DIRECT_UNROLL is unset: 16-bit types at 8 or 16 lanes per row take
// 16 where the grid has fewer than 16 warps of work per SM (few warps to hide latency with, so more loads per lane)
// and X's rows are long (K > 1024: a tile's slice of X does not stay in L1), else 8; 32 lanes (and fp32) take 4. The
// sweep below counted blocks of 8 warps (two per SM: the same line). Measured on
// the H100 (benchmarks/direct_lpr.py, direct-u32-h100-2026-11-27-s31a.json; 5 shapes, N = 32 / 64 / 128, 90-98%,
// fp16, both X layouts, 8 lanes up to N = 64 and 16 above): 16 loads took 0.71-1.01 of 8's time at 4096 x 4096 (128
// blocks at 8 lanes, 256 at 16), 0.66-0.95 at 4096 x 11008 and 0.76-1.02 at 768 x 3072 (24 / 48 blocks), but
// 1.04-1.38 at 11008 x 4096 (344 / 688 blocks) and 0.86-1.18 at 3072 x 768 (K = 768). 32 loads were the fastest only
// on the under-filled shapes with row-major X, and lost in nn.Linear's layout (one block per SM at 200+ registers).
// (warps: the grid's warps of work; 16 per SM = two blocks of 8 warps, whatever $PRUNEKIT_DIRECT_WARPS.)
template <typename T, int LPR>
inline int direct_default_unroll(int64_t warps, int64_t k, int num_sms) {
  if (sizeof(T) != 2 || LPR == 32) return 4;
  return warps < 2 * kDirectWarps * static_cast<int64_t>(num_sms) && k > 1024 ? 16 : 8;
}

// Warps per block: $PRUNEKIT_DIRECT_WARPS (2 / 4 / 8, read at each call) forces it; default 4 at 8 lanes per row (16
// rows per block), else 8. Fewer warps make blocks of fewer rows: more blocks where M / rows per block leaves SMs idle
// (768 rows at 8 lanes: 24 blocks of 32 rows). Measured on the H100 (benchmarks/direct_lpr.py,
// direct-warps-h100-2026-11-27-s31b.json; 768 x 3072, 3072 x 768, 4096 x 4096, N = 64, 90-98%, fp16, both X layouts):
// at 8 lanes 4 warps took 0.88-0.94 of 8's time on 768 x 3072 and 0.97-1.00 on the other two. 2 warps were no faster
// than 4 (their 4096 x 4096 figures ran at 8 loads in flight: the sweep's loads rule counted blocks then).
inline int direct_warps_setting() {
  const char* v = std::getenv("PRUNEKIT_DIRECT_WARPS");
  if (v == nullptr) return 0;
  const int w = std::atoi(v);
  return (w == 2 || w == 4 || w == 8) ? w : 0;
}

template <typename T, typename I, bool YT, int LPR>
static void launch_direct_lpr(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& cols,
                              const at::Tensor& row_indices, const at::Tensor& x, bool x_padded, const at::Tensor& y,
                              bool y_vec_ok, const T* bias, bool relu, int m, int n) {
  constexpr int VN = 16 / sizeof(T);
  int warps = direct_warps_setting();
  if (warps == 0) warps = LPR <= 8 ? 4 : kDirectWarps;
  const int rows = warps * (32 / LPR);
  // Vector loads: rows of whole 16-byte vectors (N a multiple of VN, or a padded copy: the last vector of a row reads
  // zeros past N, and the kernel stores no column past N), 16-byte aligned.
  const bool vec = (n % VN == 0 || x_padded) && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                   (x.stride(0) * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  const dim3 grid((m + rows - 1) / rows, (n + LPR * VN - 1) / (LPR * VN));
  PRUNEKIT_CHECK(grid.y <= 65535, "spmm_csr_direct: N too large");
  int unroll = direct_unroll_setting();
  if (unroll == 0) unroll = direct_default_unroll<T, LPR>(static_cast<int64_t>(grid.x) * grid.y * warps, x.size(0),
                                                          sm_count(x.get_device()));
  if (LPR == 4 && unroll == 32) unroll = 16;  // 4 lanes per row hold at most 4 pairs each: U = 32 is not built there
  auto kernel = !vec           ? spmm_direct_kernel<T, I, YT, false, LPR, 4>
                : unroll == 32 ? spmm_direct_kernel<T, I, YT, true, LPR, (LPR > 4 ? 32 : 16)>
                : unroll == 16 ? spmm_direct_kernel<T, I, YT, true, LPR, 16>
                : unroll == 8  ? spmm_direct_kernel<T, I, YT, true, LPR, 8>
                               : spmm_direct_kernel<T, I, YT, true, LPR, 4>;
  kernel<<<grid, 32 * warps, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(values.data_ptr()), row_offsets.data_ptr<int>(),
      reinterpret_cast<const I*>(cols.data_ptr()), row_indices.data_ptr<int>(),
      reinterpret_cast<const T*>(x.data_ptr()), x.stride(0), reinterpret_cast<T*>(y.data_ptr()), y.stride(0),
      y.stride(1), y_vec_ok, bias, relu, m, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, typename I, bool YT>
static void launch_direct(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& cols,
                          const at::Tensor& row_indices, const at::Tensor& x, bool x_padded, const at::Tensor& y,
                          bool y_vec_ok, const T* bias, bool relu, int m, int n) {
  constexpr int VN = 16 / sizeof(T);
  int lpr = direct_lpr_setting();
  if (lpr == 0) lpr = sizeof(T) == 2 && n <= 4 * VN ? 4 : sizeof(T) == 2 && n <= 8 * VN ? 8 : n <= 16 * VN ? 16 : 32;
  switch (lpr) {
    case 4:
      launch_direct_lpr<T, I, YT, 4>(values, row_offsets, cols, row_indices, x, x_padded, y, y_vec_ok, bias, relu, m,
                                          n);
      break;
    case 8:
      launch_direct_lpr<T, I, YT, 8>(values, row_offsets, cols, row_indices, x, x_padded, y, y_vec_ok, bias, relu, m,
                                          n);
      break;
    case 16:
      launch_direct_lpr<T, I, YT, 16>(values, row_offsets, cols, row_indices, x, x_padded, y, y_vec_ok, bias, relu, m,
                                          n);
      break;
    default:
      launch_direct_lpr<T, I, YT, 32>(values, row_offsets, cols, row_indices, x, x_padded, y, y_vec_ok, bias, relu, m,
                                          n);
  }
}

void spmm_csr_direct(const at::Tensor& values, const at::Tensor& row_offsets, const at::Tensor& column_indices,
                     const at::Tensor& row_indices, const at::Tensor& x_in, const at::Tensor& y,
                     const std::optional<at::Tensor>& bias, bool relu) {
  check_csr(row_offsets, column_indices, "spmm_csr_direct");
  PRUNEKIT_CHECK(x_in.is_cuda() && y.is_cuda() && values.is_cuda(), "spmm_csr_direct: tensors must be on the GPU");
  PRUNEKIT_CHECK(x_in.dim() == 2 && y.dim() == 2, "spmm_csr_direct: x and y must be 2-D");
  PRUNEKIT_CHECK(values.scalar_type() == x_in.scalar_type() && y.scalar_type() == x_in.scalar_type(),
              "spmm_csr_direct: values, x and y must share one dtype");
  PRUNEKIT_CHECK(values.is_contiguous(), "spmm_csr_direct: values must be contiguous");
  PRUNEKIT_CHECK(row_indices.scalar_type() == at::kInt && row_indices.is_contiguous(),
              "spmm_csr_direct: row_indices must be contiguous int32");
  const int64_t m = y.size(0), n = y.size(1);
  PRUNEKIT_CHECK(row_offsets.numel() == m + 1 && row_indices.numel() == m && x_in.size(1) == n,
              "spmm_csr_direct: shapes disagree");
  PRUNEKIT_CHECK(m < (int64_t(1) << 31) && n < (int64_t(1) << 31), "spmm_csr_direct: too large");
  const bool yt = y.stride(1) != 1 && y.stride(0) == 1;
  PRUNEKIT_CHECK(yt || y.stride(1) == 1 || n <= 1, "spmm_csr_direct: y must have unit stride along M or along N");
  const int64_t esize = x_in.element_size();
  const bool y_vec_ok = reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0 &&
                        (yt ? (y.stride(1) * esize) % 16 == 0 : (y.stride(0) * esize) % 16 == 0 && y.stride(1) == 1);
  if (bias) {
    PRUNEKIT_CHECK(bias->is_cuda() && bias->scalar_type() == x_in.scalar_type() && bias->is_contiguous() &&
                    bias->numel() == m,
                "spmm_csr_direct: bias must be a contiguous (M,) tensor of x's dtype");
  }
  if (m == 0 || n == 0) return;
  const c10::cuda::CUDAGuard guard(x_in.device());
  // X of any other layout (nn.Linear's x2d.t() above all): a row-major copy by the coalescing transpose kernel of
  // spmm_rowwarp.cu (one extra pass over X, 2 * N * K elements moved), in place of x.contiguous().
  bool x_padded = false;
  const at::Tensor x = row_major_copy(x_in, x_padded);
  PRUNEKIT_DISPATCH_FLOAT(x.scalar_type(), [&] {
    PRUNEKIT_DISPATCH_INDEX(column_indices.scalar_type(), [&] {
      const scalar_t* b = bias ? reinterpret_cast<const scalar_t*>(bias->data_ptr()) : nullptr;
      if (yt) {
        launch_direct<scalar_t, index_t, true>(values, row_offsets, column_indices, row_indices, x, x_padded, y,
                                               y_vec_ok, b, relu, m, n);
      } else {
        launch_direct<scalar_t, index_t, false>(values, row_offsets, column_indices, row_indices, x, x_padded, y,
                                                y_vec_ok, b, relu, m, n);
      }
    });
  });
}

}  // namespace prunekit
