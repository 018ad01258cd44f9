// Host entry of the sm_90a wgmma + TMA BSR variant (kernel in bsr_mm_wgmma.cuh): tensor maps, the sm_90a probe and
// the launch by dtype, block columns and N tile.
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "bsr_mm_wgmma.cuh"
#include "../check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit_structured {
namespace wgmma_bsr {

extern template void dispatch_c<__half, 1, false>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&,
                                              int, int, cudaStream_t);
extern template void dispatch_c<__half, 1, true>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&,
                                              int, int, cudaStream_t);
extern template void dispatch_c<__half, 1, true, 64>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&,
                                              int, int, cudaStream_t);
extern template void dispatch_c<__half, 2, false>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&,
                                              int, int, cudaStream_t);
extern template void dispatch_c<__half, 2, true>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&,
                                              int, int, cudaStream_t);
extern template void dispatch_c<__nv_bfloat16, 1, false>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&,
                                              int, int, cudaStream_t);
extern template void dispatch_c<__nv_bfloat16, 1, true>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&,
                                              int, int, cudaStream_t);
extern template void dispatch_c<__nv_bfloat16, 1, true, 64>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&,
                                              int, int, cudaStream_t);
extern template void dispatch_c<__nv_bfloat16, 2, false>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&,
                                              int, int, cudaStream_t);
extern template void dispatch_c<__nv_bfloat16, 2, true>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&,
                                              int, int, cudaStream_t);
extern template void dispatch_rc_t<__half, 1, false>(int, int, const CUtensorMap&, const CUtensorMap&,
                                                  const BsrArgs&, int, int, int, cudaStream_t);
extern template void dispatch_rc_t<__half, 1, true>(int, int, const CUtensorMap&, const CUtensorMap&,
                                                  const BsrArgs&, int, int, int, cudaStream_t);
extern template void dispatch_rc_t<__half, 2, false>(int, int, const CUtensorMap&, const CUtensorMap&,
                                                  const BsrArgs&, int, int, int, cudaStream_t);
extern template void dispatch_rc_t<__half, 2, true>(int, int, const CUtensorMap&, const CUtensorMap&,
                                                  const BsrArgs&, int, int, int, cudaStream_t);
extern template void dispatch_rc_t<__nv_bfloat16, 1, false>(int, int, const CUtensorMap&, const CUtensorMap&,
                                                  const BsrArgs&, int, int, int, cudaStream_t);
extern template void dispatch_rc_t<__nv_bfloat16, 1, true>(int, int, const CUtensorMap&, const CUtensorMap&,
                                                  const BsrArgs&, int, int, int, cudaStream_t);
extern template void dispatch_rc_t<__nv_bfloat16, 2, false>(int, int, const CUtensorMap&, const CUtensorMap&,
                                                  const BsrArgs&, int, int, int, cudaStream_t);
extern template void dispatch_rc_t<__nv_bfloat16, 2, true>(int, int, const CUtensorMap&, const CUtensorMap&,
                                                  const BsrArgs&, int, int, int, cudaStream_t);

__global__ void sm90a_probe_kernel(int* out) {
#ifdef PK_SM90A
  *out = 1;
#else
  *out = 0;
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status));
#else
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &status));
#endif
    PRUNEKIT_CHECK(status == cudaDriverEntryPointSuccess && ptr != nullptr, "bsr_mm wgmma: no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// Row-major 2-D tensor map: `outer` rows of `inner` elements, rows `row_bytes` apart, boxes of box_inner x box_outer
// with the swizzle of a box_inner * 2-byte row; out-of-range elements read as zero.
CUtensorMap encode_map(const void* ptr, bool half, uint64_t inner, uint64_t outer, uint64_t row_bytes,
                       uint32_t box_inner, uint32_t box_outer) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUtensorMapSwizzle swizzle = box_inner == 64   ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : box_inner == 32 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                       : CU_TENSOR_MAP_SWIZZLE_32B;
  const CUresult res = encode_fn()(&map, half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                                   const_cast<void*>(ptr), dims, strides, box, elem_strides,
                                   CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  PRUNEKIT_CHECK(res == CUDA_SUCCESS, "bsr_mm wgmma: cuTensorMapEncodeTiled failed with error ", static_cast<int>(res));
  return map;
}

// encode_map's result, remembered per thread for the last MAP_CACHE_SLOTS distinct arguments (direct-mapped by a hash
// of them). A tensor map holds the address, sizes, strides, box and swizzle, not the data, so the same arguments
// always give the same map: an eager layer's weight (and its activations, when the caching allocator hands the same
// block back) skip cuTensorMapEncodeTiled on every call after the first. $PRUNEKIT_BSR_MAP_CACHE=0: encode at every
// call (read at each call).
constexpr int MAP_CACHE_SLOTS = 16;
struct MapKey {
  const void* ptr;
  uint64_t inner, outer, row_bytes;
  uint32_t box_inner, box_outer;
  bool half;
  bool operator==(const MapKey& o) const {
    return ptr == o.ptr && inner == o.inner && outer == o.outer && row_bytes == o.row_bytes &&
           box_inner == o.box_inner && box_outer == o.box_outer && half == o.half;
  }
};
struct MapSlot {
  MapKey key;
  CUtensorMap map;
  bool used = false;
};

CUtensorMap make_map(const void* ptr, bool half, uint64_t inner, uint64_t outer, uint64_t row_bytes,
                     uint32_t box_inner, uint32_t box_outer) {
  if (prunekit_launch::env_off("PRUNEKIT_BSR_MAP_CACHE"))
    return encode_map(ptr, half, inner, outer, row_bytes, box_inner, box_outer);
  thread_local MapSlot slots[MAP_CACHE_SLOTS];
  const MapKey key{ptr, inner, outer, row_bytes, box_inner, box_outer, half};
  uint64_t h = reinterpret_cast<uintptr_t>(ptr) >> 4;
  h = h * 0x9E3779B97F4A7C15ull ^ (inner * 31 + outer) ^ (row_bytes << 7) ^ (uint64_t{box_inner} << 20) ^
      (uint64_t{box_outer} << 29) ^ (half ? 1u : 0u);
  MapSlot& slot = slots[(h ^ (h >> 32)) % MAP_CACHE_SLOTS];
  if (!(slot.used && slot.key == key)) {
    slot.map = encode_map(ptr, half, inner, outer, row_bytes, box_inner, box_outer);  // throws before the slot changes
    slot.key = key;
    slot.used = true;
  }
  return slot.map;
}

}  // namespace wgmma_bsr

// Whether the X-slab kernels pay for their copy of X (structured.x_slabs_rule, the same rule; measured on the H100,
// benchmarks/results/bsr-xslabs-h100-2026-11-26-s26c.json): each X slab is read `reuse` = nblocks * c / K times on
// average (stored blocks per block column), the copy reads and writes X once. At N >= XSLABS_SMALL_N the copy won
// from a reuse of 12.8 with 16-row blocks (1.27-1.85x) and 25.6 with 32-row ones (1.08-1.23x; 0.87-1.05x at 6.4-17.2);
// at N = 128 it won from a reuse of 34 (16-row) / 51 (32-row) and lost or tied at 12.8-25.6 (32-row: also at 34). At
// N = 256 and 512 (bsr-xslabs-mid-h100-2026-11-26-s27a.json) it won with 16-row blocks at every reuse timed, 12.7-69
// (0.62-0.86x of the time), and with 32-row blocks at 34 (0.89-0.96x), tied at 17.8 and lost at 6.2-13 (1.09-1.15x):
// the large-N thresholds. So did N = 160, 192 and 224 (bsr-xslabs-lown-h100-2026-11-26-s27h.json: 16-row blocks
// 0.49-0.87x at a reuse of 12.7-69, 32-row blocks 0.89-0.95x at 34-35 and 1.02-1.24x at 6.2-17.7). XSLABS_SMALL_N is
// therefore 160 (it was 1024, from N = 128 data only); N = 129-159 are not measured.
constexpr int64_t XSLABS_SMALL_N = 160;
constexpr int64_t XSLABS_MIN_REUSE_16 = 12, XSLABS_MIN_REUSE_32 = 24, XSLABS_MIN_REUSE_SMALL_N = 48;
bool x_slabs_rule(int64_t r, int64_t c, int64_t k, int64_t nblocks, int64_t n) {
  if (!(r == 16 || r == 32) || k <= 0) return false;
  const int64_t min_reuse = n < XSLABS_SMALL_N ? XSLABS_MIN_REUSE_SMALL_N
                                               : (r == 16 ? XSLABS_MIN_REUSE_16 : XSLABS_MIN_REUSE_32);
  return nblocks * c >= min_reuse * k;
}

// $PRUNEKIT_BSR_XSLABS: "1" the X-slab kernels (XR) for 16- and 32-row blocks, "0" never, unset / "" / "auto" the
// rule (structured.XSLABS_ENV). In dynamic mode nblocks is the declared maximum.
// 64-row blocks never: their TMA boxes have 128-byte rows, and the copy lost at all 18 points tried (0.58-0.92x of the
// time; bsr-xslabs64-h100-2026-11-26-s26f.json, with a version of bsr_wgmma_kernel that read it).
bool use_x_slabs(int64_t r, int64_t c, int64_t k, int64_t nblocks, int64_t n) {
  if (r != 16 && r != 32) return false;
  const char* v = std::getenv("PRUNEKIT_BSR_XSLABS");
  if (v != nullptr && std::strcmp(v, "0") == 0) return false;
  if (v != nullptr && std::strcmp(v, "1") == 0) return true;
  PRUNEKIT_CHECK(v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0,
                 "bsr_mm: $PRUNEKIT_BSR_XSLABS must be 0, 1 or auto, got '", v, "'");
  return x_slabs_rule(r, c, k, nblocks, n);
}

// Short rows (structured.short_rows, the same rule): at most SHORT_ROWS_MAX_BLOCKS_PER_ROW stored blocks per block row
// on average (dynamic mode: the declared maximum). There a CTA's tile is a block or two and its time mostly latency:
// 32-row blocks take the 128 N tile (plan_tile_n_wgmma) with 3 stages, three one-consumer CTAs per SM instead of two.
// Measured on the H100 (fp16, N = 2048 / 4096, 90 / 95%, against the former 256 tile and 6 stages through the same call
// path; benchmarks/results/bsr-tiles-h100-2026-11-27-s34e.json): at 3072 x 768 (1.1-2.4 blocks per row) 0.88-0.91x of
// the time; where rows held more (11008 x 4096 at 6.4 blocks per row, -s34d) the same settings took 1.13x. In-sample;
// the edge lies between 2.4 and 6.4 blocks per row.
// 64-row blocks (bsr_wgmma_kernel) are left as they were: a version of that kernel that looped over several tiles per
// CTA, with one wave of CTAs in short rows, took 0.88-0.95x of the time at 3072 x 768 (-s34e) but stayed 1.10-1.27x
// slower than torch's Triton BSR there (-s34f), and across the session's runs it was 6-12% slower against Triton at
// 11008 x 4096 with 64-row blocks at 90% (0.81-0.86 of Triton's time in -s34a/b/d, 0.76 in the thirtieth session;
// those builds also compiled bsr_wgmma_kernel's epilogue otherwise, see BsrTArgs in bsr_mm_wgmma.cuh).
constexpr int64_t SHORT_ROWS_MAX_BLOCKS_PER_ROW = 4;
bool short_rows(int64_t m, int64_t r, int64_t nblocks) {
  return r > 0 && nblocks <= SHORT_ROWS_MAX_BLOCKS_PER_ROW * std::max<int64_t>(1, m / r);
}

// A whole number from `lo` to `hi` in the environment variable `name`; `fallback` where it is unset, "" or "auto".
int env_count(const char* name, int lo, int hi, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return fallback;
  char* end = nullptr;
  const long value = std::strtol(v, &end, 10);
  PRUNEKIT_CHECK(end != v && *end == '\0' && value >= lo && value <= hi, "bsr_mm: $", name,
                 " must be auto or a whole number from ", lo, " to ", hi, ", got '", v, "'");
  return static_cast<int>(value);
}

// $PRUNEKIT_BSR_TILES_PER_CTA: unset / "" / "auto" the rule, "wave" one wave of resident CTAs, else 1-64 tiles per
// CTA. $PRUNEKIT_BSR_STAGES: unset / "" / "auto" the rule, else 2-12 (capped at the kernel's most, raised to its
// fewest). Both are read at each call and checked for every block shape; tiles per CTA reach the 16- and 32-row kernel
// (bsr_wgmma_t_kernel) only, stages that kernel and the 64-row one with a producer warp. The rules: one tile per CTA;
// in short rows 3 stages for 32-row blocks and 2 for 64-row ones, else the kernel's most (0).
int bsr_tiles_per_cta() {
  const char* v = std::getenv("PRUNEKIT_BSR_TILES_PER_CTA");
  if (v != nullptr && std::strcmp(v, "wave") == 0) return wgmma_bsr::TILES_WAVE;
  return env_count("PRUNEKIT_BSR_TILES_PER_CTA", 1, 64, 1);
}
int bsr_stages(int64_t r, bool short_rows_) {
  int rule = 0;                                  // the kernel's most
  if (short_rows_ && r == 32) rule = 3;          // three one-consumer CTAs per SM
  if (short_rows_ && r == 64) rule = 2;          // the producer warp's fewest (wp_stages: enough for its epilogue)
  return env_count("PRUNEKIT_BSR_STAGES", 2, 12, rule);
}

// Whether the 64-row kernel runs with a producer warp (bsr_wgmma_kernel's WARP_PRODUCER; structured.warp_producer_rule,
// the same rule): 64-row blocks in short rows whose launch has at least WARP_PRODUCER_MIN_CTAS_PER_SM CTAs per SM for
// every stored block per block row (and at least that many where rows hold fewer than one): CTAs = M / 64 block rows x
// N tiles of tile_n. There the kernel's two stages (short_rows: bsr_stages) fit four CTAs per SM instead of two, and
// empty block rows skip the pipeline. Measured against the producer warpgroup in the same runs, fp16, N = 128 / 2048 /
// 4096, 50-95% and 99%, three runs on the H100 and one on an H200 (benchmarks/results/: bsr-tiles-h100-2026-11-27-s35a
// and its -control- file, bsr-wp-h200-2026-11-27-s35b, bsr-wp-tiles-h100-2026-11-27-s35c):
// - where the rule holds, 0.80-0.99x of the time at 25 of 26 points (3072 x 768 @ 2048 / 4096 at 80-99%, 11008 x 4096
//   at 95 / 99%, 4096 x 4096 at 95 / 99%); the miss is 3072 x 768 @ 2048 at 99% (0.17 blocks per row, 1.11x);
// - in short rows where it fails, the warp lost at 13 of 16 points (1.02-1.51x: N = 128, 768 x 3072 @ 2048, or 2.5-3.8
//   blocks per row at 6-8 CTAs per SM; the three wins 0.98-0.99x), and with longer rows at all 63 (1.03-1.24x).
// In-sample.
constexpr int64_t WARP_PRODUCER_MIN_CTAS_PER_SM = 4;
bool warp_producer_rule(int64_t m, int64_t r, int64_t n, int64_t nblocks, int64_t tile_n, int64_t sms) {
  if (r != 64 || tile_n <= 0 || sms <= 0 || !short_rows(m, r, nblocks)) return false;
  const int64_t rows = std::max<int64_t>(1, m / r);
  const int64_t ctas = rows * ((n + tile_n - 1) / tile_n);
  // ctas >= MIN * sms * max(1, nblocks / rows), without the division
  return ctas * rows >= WARP_PRODUCER_MIN_CTAS_PER_SM * sms * std::max(rows, nblocks);
}

// The 64-token N tile for the 64-row kernel with a producer warp, where the plan gives 128 (structured.warp_tile_n_rule,
// the same rule): at most 1.5 stored blocks per block row. Consumers of 64 tokens (m64n64k16: 58 registers, two stages
// of 16 KB) fit six CTAs per SM instead of four. Against the 128 tile in the same run (H100, fp16, 2 stages;
// benchmarks/results/bsr-tiles{,-control}-h100-2026-11-27-s35j.json): 0.90-0.99x of the time at all 10 points with
// 0.1-1.35 blocks per row (3072 x 768 @ 2048 / 4096 at 90-99%; 11008 x 4096 and 4096 x 4096 at 99%), 0.99-1.25x at
// the 16 with 2.4-13.5 (0.99-1.16x at the 7 short-row points among them, 2.4-3.6 blocks per row). In-sample.
bool warp_tile_n_rule(int64_t m, int64_t r, int64_t nblocks) {
  return r == 64 && 2 * nblocks <= 3 * std::max<int64_t>(1, m / r);
}

// $PRUNEKIT_BSR_WARP_TILE_N: the N tile of the 64-row kernel with a producer warp where the plan gives 128: "64"
// (consumers of 64 tokens, m64n64k16) or "128"; unset / "" / "auto": warp_tile_n_rule.
int bsr_warp_tile_n(int64_t m, int64_t r, int64_t nblocks) {
  const char* v = std::getenv("PRUNEKIT_BSR_WARP_TILE_N");
  if (v != nullptr && std::strcmp(v, "64") == 0) return 64;
  if (v != nullptr && std::strcmp(v, "128") == 0) return 128;
  PRUNEKIT_CHECK(v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0,
                 "bsr_mm: $PRUNEKIT_BSR_WARP_TILE_N must be 64, 128 or auto, got '", v, "'");
  return warp_tile_n_rule(m, r, nblocks) ? 64 : 128;
}

// $PRUNEKIT_BSR_WARP_PRODUCER: "1" the 64-row kernel with a producer warp, "0" with a producer warpgroup, unset / "" /
// "auto" warp_producer_rule.
bool bsr_warp_producer(int64_t m, int64_t r, int64_t n, int64_t nblocks, int64_t tile_n, int64_t sms) {
  const char* v = std::getenv("PRUNEKIT_BSR_WARP_PRODUCER");
  if (v != nullptr && std::strcmp(v, "0") == 0) return false;
  if (v != nullptr && std::strcmp(v, "1") == 0) return true;
  PRUNEKIT_CHECK(v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0,
                 "bsr_mm: $PRUNEKIT_BSR_WARP_PRODUCER must be 0, 1 or auto, got '", v, "'");
  return warp_producer_rule(m, r, n, nblocks, tile_n, sms);
}

namespace wgmma_bsr {

// Copies x (K, N) into the XR kernels' X slabs (bsr_x_slabs_kernel) of `slabs` (K * npad elements).
void make_x_slabs(const at::Tensor& x, int c, int64_t n, int64_t npad, const at::Tensor& slabs, cudaStream_t stream) {
  const int64_t k = x.size(0);
  const long long total16 = static_cast<long long>(k) * npad / 8;
  const int threads = 256;
  const int grid = static_cast<int>(std::min<long long>((total16 + threads - 1) / threads, 132LL * 32));
  const auto* src = reinterpret_cast<const uint4*>(x.data_ptr());
  auto* dst = reinterpret_cast<uint4*>(slabs.data_ptr());
  const long long ldx16 = x.stride(1) / 8;
  const int kc = static_cast<int>(k / c), nn = static_cast<int>(n);
  if (c == 64) {
    bsr_x_slabs_kernel<64><<<grid, threads, 0, stream>>>(src, ldx16, nn, npad, kc, dst);
  } else if (c == 32) {
    bsr_x_slabs_kernel<32><<<grid, threads, 0, stream>>>(src, ldx16, nn, npad, kc, dst);
  } else {
    bsr_x_slabs_kernel<16><<<grid, threads, 0, stream>>>(src, ldx16, nn, npad, kc, dst);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace wgmma_bsr

bool bsr_wgmma_available() {
  static int state = -1;  // per process (one GPU kind per process is assumed, as for the rest of the library)
  static std::mutex mutex;
  const std::lock_guard<std::mutex> lock(mutex);
  if (state < 0) {
    int device = 0, major = 0, minor = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    state = 0;
    if (major == 9 && minor == 0) {
      at::Tensor flag = at::zeros({1}, at::TensorOptions().device(at::kCUDA).dtype(at::kInt));
      wgmma_bsr::sm90a_probe_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(flag.data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      state = flag.item<int>();  // one host sync, once per process
    }
  }
  return state == 1;
}

void launch_bsr_wgmma(const at::Tensor& blocks, const at::Tensor& x, const BsrArgs& args, int grid_rows, int tile_n,
                      int64_t m, cudaStream_t stream) {
  using namespace wgmma_bsr;
  const int r = static_cast<int>(blocks.size(1)), c = static_cast<int>(blocks.size(2));
  PRUNEKIT_CHECK((r == 16 || r == 32 || r == 64) && (c == 16 || c == 32 || c == 64),
                 "bsr_mm wgmma: blocks must be {16, 32, 64} x {16, 32, 64}, got ", r, "x", c);
  PRUNEKIT_CHECK(tile_n == 128 || tile_n == 256, "bsr_mm wgmma: tile_n must be 128 or 256");
  PRUNEKIT_CHECK(bsr_wgmma_available(), "bsr_mm wgmma: needs an sm_90 GPU and a library built for sm_90a");
  // The tensor maps are encoded as FLOAT16 or BFLOAT16 from x's dtype: any other dtype would be read as bf16.
  PRUNEKIT_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "bsr_mm wgmma: takes float16 or bfloat16, got ", x.scalar_type());
  // TMA: rows of X (its columns n) at a byte stride that is a multiple of 16 and covers a row of K elements.
  PRUNEKIT_CHECK(x.stride(0) == 1 && x.stride(1) % 8 == 0 && x.stride(1) >= x.size(0),
              "bsr_mm wgmma: x must be K-contiguous with a leading dimension >= K and a multiple of 8");
  const bool half = x.scalar_type() == at::kHalf;
  const uint64_t capacity_rows = static_cast<uint64_t>(std::max<int64_t>(blocks.size(0), 1)) * r;
  // the launch plan: tiles per CTA (bsr_wgmma_t_kernel; 64-row blocks: checked, not used), stages (both kernels; the
  // 64-row kernel with a producer warp only), the producer (64-row blocks) and its N tile
  const bool short_ = short_rows(m, r, blocks.size(0));
  const int tiles_per_cta = bsr_tiles_per_cta(), stages = bsr_stages(r, short_);
  const bool warp_producer = bsr_warp_producer(m, r, args.n, blocks.size(0), tile_n,
                                                prunekit_launch::device_props(x.get_device()).sms);
  const int warp_tile_n = bsr_warp_tile_n(m, r, blocks.size(0));  // read and checked at every call, as above
  const bool narrow = r == R && warp_producer && tile_n == 128 && warp_tile_n == 64;  // 64-token consumers
  // 64-row blocks: box of one block (the A operand). 16 / 32 rows: box of one block too, the B operand of
  // bsr_wgmma_t_kernel (X's slab is then the A operand). X: boxes of the N tile (64 tokens where `narrow`).
  const CUtensorMap map_a = make_map(blocks.data_ptr(), half, c, capacity_rows, static_cast<uint64_t>(c) * 2, c, r);
  const CUtensorMap map_x = make_map(x.data_ptr(), half, x.size(0), x.size(1), static_cast<uint64_t>(x.stride(1)) * 2,
                                     c, narrow ? 64 : tile_n);
  // The X-slab copy (use_x_slabs): tokens padded to the largest N tile, so every bulk copy stays inside its slab; freed
  // after the launch (the caching allocator reuses it only for later work on this stream).
  at::Tensor slabs;
  BsrArgs xr_args = args;
  const bool xr = use_x_slabs(r, c, x.size(0), blocks.size(0), args.n);
  if (xr) {
    const int64_t npad = (static_cast<int64_t>(args.n) + 255) / 256 * 256;
    slabs = at::empty({x.size(0) * npad}, x.options());
    make_x_slabs(x, c, args.n, npad, slabs, stream);
    xr_args.x = slabs.data_ptr();
    xr_args.xr_npad = npad;
  }
  const BsrArgs& run_args = xr ? xr_args : args;
  auto run = [&](auto xr_tag) {
    constexpr bool XR = decltype(xr_tag)::value;
    if (r != R) {  // 16- and 32-row blocks: bsr_wgmma_t_kernel
      auto t = half ? (tile_n == 256 ? dispatch_rc_t<__half, 2, XR> : dispatch_rc_t<__half, 1, XR>)
                    : (tile_n == 256 ? dispatch_rc_t<__nv_bfloat16, 2, XR> : dispatch_rc_t<__nv_bfloat16, 1, XR>);
      t(r, c, map_a, map_x, run_args, grid_rows, tiles_per_cta, stages, stream);
    } else {  // 64-row blocks: bsr_wgmma_kernel, X through TMA boxes (use_x_slabs is false for them)
      auto k = half ? (tile_n == 256 ? (warp_producer ? dispatch_c<__half, 2, true> : dispatch_c<__half, 2, false>)
                                     : (narrow          ? dispatch_c<__half, 1, true, 64>
                                        : warp_producer ? dispatch_c<__half, 1, true>
                                                        : dispatch_c<__half, 1, false>))
                    : (tile_n == 256 ? (warp_producer ? dispatch_c<__nv_bfloat16, 2, true>
                                                      : dispatch_c<__nv_bfloat16, 2, false>)
                                     : (narrow          ? dispatch_c<__nv_bfloat16, 1, true, 64>
                                        : warp_producer ? dispatch_c<__nv_bfloat16, 1, true>
                                                        : dispatch_c<__nv_bfloat16, 1, false>));
      k(c, map_a, map_x, run_args, grid_rows, stages, stream);
    }
  };
  if (xr) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}

}  // namespace prunekit_structured
