// Lean BSR decode kernel (eighteenth session; the default at N <= lean_max_n: 32 for 16- and 32-row blocks, 16 for
// 64-row ones since the twenty-eighth session; $PRUNEKIT_BSR_LEAN=0: off): Y (M, N) = act(A @ X + bias) for
// 1 <= N <= 32, A in BSR with r x c blocks (r, c in {16, 32, 64}), fp16/bf16 with fp32 accumulation; static and dynamic
// mode alike (it reads crow_indices and col_indices only, never past crow_indices[M / r]).
//
// Why: at N = 16 the tiled kernel (bsr_mm.cuh) stages each block and a 32-token slab of X through a cp.async pipeline
// in shared memory, one CTA per block row or schedule item, and ends split rows in a second kernel after a zeroed fp32
// workspace (a third launch). On the H100 (benchmarks/results/bsr-decode-final-h100-2026-11-26-s17.json) it took
// 7.4 us at 4096 x 4096, 32 x 32 blocks, 95% (809 blocks: 1.7 MB, 0.55 us of HBM bandwidth) against 6.5 us for torch's
// Triton BSR kernel: the time is latency, not bytes.
//
// Here one CTA computes a 16-row strip of Y (rows 16 s .. 16 s + 15 of one block row) and its W warps take the block
// row's blocks in turn (warp w: blocks crow[row] + w, + W, ...). A warp loads a block's 16 x c slice straight into
// m16n8k16 A fragments (lane (g, t): rows g and g + 8, columns 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-column k-tile,
// 4-byte loads) and X's c x N slab as B fragments (token g of each 8-token tile, the same column pairs; X is
// K-contiguous, as bsr_mm_out requires), issues the next block's loads before it multiplies the current one, and
// takes its blocks' column indices 32 at a time (one load per lane, then shuffles; the next 32 loaded half a batch
// ahead), so only the first block waits for an index. The W partial sums meet in shared memory; the CTA adds bias,
// applies ReLU and writes its 16 x N outputs (row-fastest where Y's rows are adjacent). One launch, no workspace, no
// schedule: a block row much longer than the others (a static schedule's reason to exist) is walked by one CTA's W
// warps.
//
// Programmatic dependent launch (twenty-eighth session; sm_90, $PRUNEKIT_BSR_PDL=0: off): the kernel may start while
// the preceding kernel in the stream finishes, and waits for it (griddepcontrol.wait) before it reads anything: the
// preceding kernel may have written the pattern (dynamic mode), X, or even the weights of a static call (the op's
// wrappers convert non-int32 indices and copy unaligned blocks in kernels of their own just before). Reading a static
// call's indices and first block before the wait bought nothing measurable: with PDL, dynamic mode (waiting first)
// took 0.99-1.02x the time of static mode reading them early at all 12 points of
// benchmarks/results/bsr-pdl1-h100-2026-11-26-s28a.json. Once its loop is done the kernel lets the next kernel launch
// (griddepcontrol.launch_dependents); that kernel's own wait still covers these Y writes.
#include <cstdlib>
#include <cstring>

#include "bsr_mm.cuh"

namespace prunekit_structured {
namespace {

constexpr int kLeanMaxTokens = 32;  // the kernel's capacity: up to 4 n-tiles of 8 tokens (lean_max_n: what it takes)
constexpr int kLeanNarrowMaxTokens = 16;  // lean_max_n for 64-row blocks; lean_warps: 8 warps only up to this N

__device__ __forceinline__ uint32_t ldg32(const void* p) { return __ldg(static_cast<const uint32_t*>(p)); }

template <typename T, int NT, int C, int W>
__global__ void __launch_bounds__(32 * W)
    bsr_lean_kernel(const T* __restrict__ blocks, const int* __restrict__ crow, const int* __restrict__ cols,
                    const T* __restrict__ x, int64_t ldx, T* __restrict__ y, int64_t sym, int64_t syn,
                    const T* __restrict__ bias, int relu, int r, int n) {
  constexpr int KT = C / 16;  // 16-column k-tiles of a block
  prunekit_launch::wait_preceding_grid();  // everything below may be the preceding kernel's output
  __shared__ float part[W][16][NT * 8 + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int strip = blockIdx.x;
  const int strips_per_row = r / 16;
  const int brow = strip / strips_per_row, row0 = (strip % strips_per_row) * 16;  // block row; first row in its blocks
  const int j1 = __ldg(crow + brow + 1);
  const int jfirst = __ldg(crow + brow) + warp;  // this warp's first block; then every W-th
  const int64_t block_elems = static_cast<int64_t>(r) * C;

  // column indices of the warp's blocks 32 at a time: lane l of batch q holds that of block jfirst + (32 q + l) W; the
  // next batch is loaded half a batch ahead (iteration 32 q + 16) into my_col_next
  auto fetch_cols = [&](int base) {
    const int j = jfirst + (base + lane) * W;
    return j < j1 ? __ldg(cols + j) : 0;
  };
  int my_col = fetch_cols(0), my_col_next = 0;
  uint32_t a[KT][4], an[KT][4];
  uint32_t b[KT][NT][2], bn[KT][NT][2];
  // block j's 16 x C slice (rows row0 .. row0 + 15) as A fragments and X's rows col * C .. col * C + C - 1 as B
  // fragments; zeros for j past the block row (warp-uniform) and for tokens past N
  auto load = [&](int j, int col, uint32_t (&av)[KT][4], uint32_t (&bv)[KT][NT][2]) {
    const bool on = j < j1;
    const T* blk = blocks + static_cast<int64_t>(j) * block_elems + static_cast<int64_t>(row0 + g) * C + 2 * t;
    const T* xk = x + static_cast<int64_t>(col) * C + 2 * t;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      av[kt][0] = on ? ldg32(blk + kt * 16) : 0u;
      av[kt][1] = on ? ldg32(blk + 8 * C + kt * 16) : 0u;
      av[kt][2] = on ? ldg32(blk + kt * 16 + 8) : 0u;
      av[kt][3] = on ? ldg32(blk + 8 * C + kt * 16 + 8) : 0u;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int tok = nt * 8 + g;
        const bool live = on && tok < n;
        const T* src = xk + static_cast<int64_t>(tok) * ldx + kt * 16;
        bv[kt][nt][0] = live ? ldg32(src) : 0u;
        bv[kt][nt][1] = live ? ldg32(src + 8) : 0u;
      }
    }
  };

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;

  load(jfirst, __shfl_sync(0xffffffffu, my_col, 0), a, b);
  int it = 0;  // the warp's iteration; block jfirst + it W is the one loaded ahead
  for (int j = jfirst; j < j1; j += W) {
    ++it;
    const bool more = j + W < j1;  // warp-uniform
    if (more) {
      if ((it & 31) == 16) my_col_next = fetch_cols((it & ~31) + 32);
      if ((it & 31) == 0) my_col = my_col_next;
      load(j + W, __shfl_sync(0xffffffffu, my_col, it & 31), an, bn);
    }
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) Mma<T>::run(acc[nt], a[kt], b[kt][nt][0], b[kt][nt][1]);
    if (more) {
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
        for (int q = 0; q < 4; ++q) a[kt][q] = an[kt][q];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          b[kt][nt][0] = bn[kt][nt][0];
          b[kt][nt][1] = bn[kt][nt][1];
        }
      }
    }
  }

  prunekit_launch::allow_dependent_launch();
  // accumulator (PTX m16n8k16 D): register i of tile nt is row g + (i / 2) * 8, token nt * 8 + 2t + i % 2
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) part[warp][g + (i >> 1) * 8][nt * 8 + 2 * t + (i & 1)] = acc[nt][i];
  __syncthreads();
  constexpr int kTok = NT * 8;
  const bool row_fast = sym == 1;
  for (int o = tid; o < 16 * kTok; o += 32 * W) {
    const int rr = row_fast ? o & 15 : o / kTok, tok = row_fast ? o >> 4 : o % kTok;
    if (tok < n) {
      const int64_t row = static_cast<int64_t>(strip) * 16 + rr;
      float val = bias != nullptr ? to_f(bias[row]) : 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) val += part[w][rr][tok];
      if (relu) val = fmaxf(val, 0.f);
      y[row * sym + tok * syn] = from_f<T>(val);
    }
  }
}

template <typename T, int NT, int C, int W>
void launch_lean(const at::Tensor& blocks, const at::Tensor& crow, const at::Tensor& cols, const at::Tensor& x,
                 const at::Tensor& y, const T* bias, bool relu, bool pdl, cudaStream_t stream) {
  const int64_t m = y.size(0);
  prunekit_launch::launch(bsr_lean_kernel<T, NT, C, W>, dim3(static_cast<unsigned>(m / 16)), dim3(32 * W), 0, stream,
                          pdl, static_cast<const T*>(blocks.data_ptr()), crow.data_ptr<int>(),
                          cols.data_ptr<int>(), static_cast<const T*>(x.data_ptr()), x.stride(1),
                          static_cast<T*>(y.data_ptr()), y.stride(0), y.stride(1), bias, relu ? 1 : 0,
                          static_cast<int>(blocks.size(1)), static_cast<int>(y.size(1)));
}

template <typename T, int NT>
void dispatch_lean(int c, int w, const at::Tensor& blocks, const at::Tensor& crow, const at::Tensor& cols,
                   const at::Tensor& x, const at::Tensor& y, const T* bias, bool relu, bool pdl,
                   cudaStream_t stream) {
  if (c == 16) {
    w == 8 ? launch_lean<T, NT, 16, 8>(blocks, crow, cols, x, y, bias, relu, pdl, stream)
           : launch_lean<T, NT, 16, 4>(blocks, crow, cols, x, y, bias, relu, pdl, stream);
  } else if (c == 32) {
    w == 8 ? launch_lean<T, NT, 32, 8>(blocks, crow, cols, x, y, bias, relu, pdl, stream)
           : launch_lean<T, NT, 32, 4>(blocks, crow, cols, x, y, bias, relu, pdl, stream);
  } else {
    w == 8 ? launch_lean<T, NT, 64, 8>(blocks, crow, cols, x, y, bias, relu, pdl, stream)
           : launch_lean<T, NT, 64, 4>(blocks, crow, cols, x, y, bias, relu, pdl, stream);
  }
}

}  // namespace

int sm_count(int device);  // bsr_mm.cu

// Warps per CTA of the lean kernel (structured.lean_warps, the same rule; a CUDA test compares them): 8 where the
// M / 16 strips are at most two per SM, else 4. On the H100 at N = 16 (blocks 16 / 32 / 64, 90 / 95%, static mode;
// benchmarks/results/bsr-lean-w{4,8}-h100-2026-11-26-s27e.json): 4096 x 4096 (256 strips) took 0.82-0.98x the 4-warp
// time with 8 warps at all 6 points, 11008 x 4096 (688 strips) 1.05-1.20x at all 6. (The eighteenth session's rule,
// not measured, took 8 where a block row held over 8 blocks on average: 11008 x 4096, 16-row blocks at 90%, 10.1 us
// against 9.0 with 4 warps.) Calls of more than 16 tokens (the 4-n-tile instances) take 4 warps: at N = 32 (blocks
// 16 / 32, 90 / 95%; bsr-lean-w{4,8}-n32-h100-2026-11-26-s28h.json) 8 warps took 1.00-1.11x the 4-warp time at the 4
// points of 4096 x 4096 and 1.09-1.30x at the 4 of 11008 x 4096.
int64_t lean_warps(int64_t m, int64_t num_sms, int64_t n) {
  if (n > kLeanNarrowMaxTokens) return 4;
  return m / 16 <= 2 * num_sms ? 8 : 4;
}

// The most tokens per call the lean kernel takes (structured.lean_max_n, the same rule; a CUDA test compares them):
// $PRUNEKIT_BSR_LEAN_MAX_N, 16 or 32 (read at each call; unset, "" or "auto": the rule). The rule: 32 for blocks of 16
// and 32 rows, 16 for 64 rows. On the H100 at N = 17 and 32 (4096 x 4096 and 11008 x 4096, square blocks, 90 / 95%,
// static mode; benchmarks/results/bsr-lmax{16,32}-h100-2026-11-26-s28c.json) the lean kernel took 0.26-0.56x the time
// of the mma.sync tiled kernel (16-row blocks) and 0.67-0.99x of the wgmma kernel (32-row) at all 16 such points, and
// 1.15-1.41x of the wgmma kernel at all 8 points with 64-row blocks (each of the four 16-row strips of a block row
// reads the X slab again).
int64_t lean_max_n(int64_t r, int64_t c) {
  const char* v = std::getenv("PRUNEKIT_BSR_LEAN_MAX_N");
  if (v != nullptr && *v != '\0' && std::strcmp(v, "auto") != 0) {
    PRUNEKIT_CHECK(std::strcmp(v, "16") == 0 || std::strcmp(v, "32") == 0,
                   "bsr_mm: $PRUNEKIT_BSR_LEAN_MAX_N must be auto, 16 or 32, got '", v, "'");
    return v[0] == '1' ? kLeanNarrowMaxTokens : kLeanMaxTokens;
  }
  (void)c;
  return r <= 32 ? kLeanMaxTokens : kLeanNarrowMaxTokens;
}

// Runs the lean kernel and returns true where it takes the call: 1 <= N <= lean_max_n, r and c in {16, 32, 64},
// fp16/bf16, unless $PRUNEKIT_BSR_LEAN=0 (read per call; unset, "" or "1": on). On by default since the nineteenth
// session: on the H100 at N = 16 it took 0.26-0.93x of the tiled kernel's time in static mode at all 12 points of
// 4096 x 4096 and 11008 x 4096, blocks 16 / 32 / 64, 90 / 95%
// (benchmarks/results/bsr-decode-{lean,tiled}-h100-2026-11-26-s19.json),
// and in dynamic mode at 10 of 12 (at 11008 x 4096 with 64-row blocks 11.61 / 7.62 against 10.50 / 7.46 us). Warps per
// CTA: $PRUNEKIT_BSR_LEAN_WARPS (4 or 8; auto), else lean_warps (by the number of strips and N). The schedule, N tile
// and variant arguments of bsr_mm_out do not apply to it. Programmatic dependent launch on sm_90 unless
// $PRUNEKIT_BSR_PDL=0 (bsr_pdl). Arguments as bsr_mm_out has checked them (x K-contiguous with an even leading
// dimension, 16-byte aligned; bias contiguous, x's dtype).
bool bsr_lean_run(const at::Tensor& blocks, const at::Tensor& crow, const at::Tensor& cols, const at::Tensor& x,
                  const at::Tensor& y, const c10::optional<at::Tensor>& bias, bool relu, cudaStream_t stream) {
  const char* on = std::getenv("PRUNEKIT_BSR_LEAN");
  if (on != nullptr && std::strcmp(on, "0") == 0) return false;
  PRUNEKIT_CHECK(on == nullptr || *on == '\0' || std::strcmp(on, "1") == 0,
                 "bsr_mm: $PRUNEKIT_BSR_LEAN must be 0 or 1, got '", on, "'");
  const int64_t m = y.size(0), n = y.size(1);
  const int64_t r = blocks.size(1), c = blocks.size(2);
  const bool half = x.scalar_type() == at::kHalf;
  if (n < 1 || n > lean_max_n(r, c) || !(r == 16 || r == 32 || r == 64) || !(c == 16 || c == 32 || c == 64) ||
      !(half || x.scalar_type() == at::kBFloat16)) {
    return false;
  }
  const char* warps_var = std::getenv("PRUNEKIT_BSR_LEAN_WARPS");
  int w = 0;
  if (warps_var != nullptr && *warps_var != '\0' && std::strcmp(warps_var, "auto") != 0) {  // "", "auto": the rule
    char* end = nullptr;
    const long forced = std::strtol(warps_var, &end, 10);
    PRUNEKIT_CHECK(end != warps_var && *end == '\0' && (forced == 4 || forced == 8),
                   "bsr_mm: $PRUNEKIT_BSR_LEAN_WARPS must be auto, 4 or 8, got '", warps_var, "'");
    w = static_cast<int>(forced);
  } else {
    w = static_cast<int>(lean_warps(m, sm_count(x.get_device()), n));
  }
  const bool pdl = bsr_pdl(x.get_device());
  const void* bptr = bias.has_value() ? bias->data_ptr() : nullptr;
  const int ci = static_cast<int>(c);
  if (half) {
    const auto* b = static_cast<const __half*>(bptr);
    n > 16  ? dispatch_lean<__half, 4>(ci, w, blocks, crow, cols, x, y, b, relu, pdl, stream)
    : n > 8 ? dispatch_lean<__half, 2>(ci, w, blocks, crow, cols, x, y, b, relu, pdl, stream)
            : dispatch_lean<__half, 1>(ci, w, blocks, crow, cols, x, y, b, relu, pdl, stream);
  } else {
    const auto* b = static_cast<const __nv_bfloat16*>(bptr);
    n > 16  ? dispatch_lean<__nv_bfloat16, 4>(ci, w, blocks, crow, cols, x, y, b, relu, pdl, stream)
    : n > 8 ? dispatch_lean<__nv_bfloat16, 2>(ci, w, blocks, crow, cols, x, y, b, relu, pdl, stream)
            : dispatch_lean<__nv_bfloat16, 1>(ci, w, blocks, crow, cols, x, y, b, relu, pdl, stream);
  }
  return true;
}

}  // namespace prunekit_structured
