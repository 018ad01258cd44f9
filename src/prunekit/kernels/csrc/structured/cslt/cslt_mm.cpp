// 2:4 matmul on sparse tensor cores through cuSPARSELt, with the compressed weight and the matmul plans built once.
//
// NVIDIA's 2:4 structured sparsity (Mishra et al., "Accelerating Sparse Deep Neural Networks", 2021). torch's
// torch._cslt_sparse_mm sets up descriptors, algorithm selection and plan on every call (hundreds of microseconds of
// host time); here a weight is compressed once (prepare) and each (N, leading dimensions, bias, ReLU) gets its plan
// once, so a call is one cusparseLtMatmul. Layouts: A = W (M, K) row-major, B = X (K, N) column-major (the
// transposed view x2d.t() of nn.Linear activations), D = Y (M, N) column-major (the (N, M) row-major layer output)
// or row-major (cuSPARSELt's faster configuration on the H100; a transposing copy then gives the layer output).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cusparseLt.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>
#include "../../check.h"  // PRUNEKIT_CHECK: TORCH_CHECK without iostreams

namespace prunekit_cslt {

#define PK_CSLT_CHECK(expr)                                                                                       \
  do {                                                                                                           \
    const cusparseStatus_t status_ = (expr);                                                                     \
    PRUNEKIT_CHECK(status_ == CUSPARSE_STATUS_SUCCESS, "cuSPARSELt call ", #expr, " failed: ",                      \
                cusparseLtGetErrorString(status_));                                                              \
  } while (0)

// $PRUNEKIT_CSLT_SEARCH=1: each new plan runs cusparseLtMatmulSearch once (on the first call's own operands) and keeps
// the fastest algorithm configuration, instead of CUSPARSELT_MATMUL_ALG_DEFAULT's. Off by default until timed on the
// H100 (docs/PERFORMANCE_STRUCTURED.md: torch's 2:4 path was 0.17x faster than this binding at the largest GEMM).
bool search_plans() {
  const char* env = std::getenv("PRUNEKIT_CSLT_SEARCH");
  return env != nullptr && std::strcmp(env, "1") == 0;
}

// $PRUNEKIT_CSLT_ALG / $PRUNEKIT_CSLT_SPLIT_K (integers; read when a plan is built and part of its key): the
// algorithm configuration id (CUSPARSELT_MATMUL_ALG_CONFIG_ID, 0 = the default's) and split-K factor (1 = none) of new
// plans, so that benchmarks/nm_configs.py can time configurations one by one without cusparseLtMatmulSearch (which
// failed on the H100 at large GEMMs). -1 (unset) leaves cuSPARSELt's default choice.
int64_t env_int(const char* name) {
  const char* env = std::getenv(name);
  return env == nullptr || *env == '\0' ? -1 : std::strtoll(env, nullptr, 10);
}

cusparseLtHandle_t* handle() {
  static cusparseLtHandle_t h;
  static std::once_flag once;
  std::call_once(once, [] { PK_CSLT_CHECK(cusparseLtInit(&h)); });
  return &h;
}

struct Plan {
  cusparseLtMatDescriptor_t mat_b{}, mat_c{};
  cusparseLtMatmulDescriptor_t matmul{};
  cusparseLtMatmulAlgSelection_t alg{};
  cusparseLtMatmulPlan_t plan{};
  size_t workspace = 0;
  int config_id = -1;  // CUSPARSELT_MATMUL_ALG_CONFIG_ID set on the plan (-1: cuSPARSELt's default choice)
  // where config_id came from under $PRUNEKIT_CSLT_TUNE=1: kConfigSearched (tune_config_id timed the configurations
  // on this plan's first call), kConfigFromBucket (the id an earlier plan's search chose for the same N bucket),
  // kConfigStored (the id store_config gave for the bucket: a package's search at export, kernels/cslt_tune.py)
  int config_source = 0;
  bool ready = false;
  ~Plan() {
    if (ready) {
      cusparseLtMatmulPlanDestroy(&plan);
      cusparseLtMatmulAlgSelectionDestroy(&alg);
    }
    cusparseLtMatDescriptorDestroy(&mat_b);
    cusparseLtMatDescriptorDestroy(&mat_c);
  }
};

// How X (K, N) is described to cuSPARSELt: as itself with opB = N (`false`), or as the (N, K) matrix it is the
// transpose of, in the other storage order, with opB = T (`true`; what torch._cslt_sparse_mm does for the transposed
// view of nn.Linear activations). Same bytes, same product; on the H100 the two ran at the same speed at four of five
// large GEMMs and `true` 8% faster at 16384 x 16384 x 8192 (benchmarks/results/nm-configs-bt-h100-2026-11-26-s16.json).
// $PRUNEKIT_CSLT_B_T (0 / 1) overrides kDescribeXTransposed, read when a plan is built.
constexpr bool kDescribeXTransposed = true;

bool describe_x_transposed() {
  const int64_t env = env_int("PRUNEKIT_CSLT_B_T");
  return env < 0 ? kDescribeXTransposed : env != 0;
}

// $PRUNEKIT_CSLT_TUNE: "1" (kTuneDefault) times cuSPARSELt's configuration ids (tune_config_id) on the first call of
// a plan with N >= kTuneMinN and a row-major Y (the runtime layer's output) whose shape, layouts and N bucket no
// earlier plan in the process searched, and keeps the fastest; "0" keeps cuSPARSELt's default selection. Read when a
// plan is built. On the H100 this search (benchmarks/results/nm-kernels-*-s23l.json: 19 points, fp16 and bf16,
// N = 128-8192) kept another id at 16 of them, up to 2.26x faster than the default selection by graph time and never
// more than 2% slower. With earlier versions of it (-s23e, -s23i: bf16 at large GEMMs 1.00-1.21x -> 1.43-1.45x of
// dense) 35 points ran. Risk: cuSPARSELt's configurations for a column-major Y include one that ended the process
// with an illegal instruction (nm-configs-col-h100-2026-11-26-s23g.log), so that layout is never searched; no
// row-major configuration failed at any of those points.
constexpr bool kTuneDefault = true;
constexpr int64_t kTuneMinN = 128;  // 2:4 at N <= 16 runs prunekit's decode kernel; the ids differ at large GEMMs
constexpr int kTuneRounds = 5, kTuneReps = 2;
constexpr float kTuneMargin = 0.03f;  // a configuration id replaces the default only if this much faster
constexpr int kConfigNone = 0, kConfigSearched = 1, kConfigFromBucket = 2, kConfigStored = 3;  // Plan::config_source

// The token counts that share a searched configuration: N rounded up to a power of two, so that a layer called with
// varying N searches once per bucket, not once per N (a search takes 0.01-2.6 s on the H100).
int64_t n_bucket_of(int64_t n) {
  int64_t b = 1;
  while (b < n) b <<= 1;
  return b;
}

bool tune_plans(int64_t n) {
  const int64_t env = env_int("PRUNEKIT_CSLT_TUNE");
  return (env < 0 ? kTuneDefault : env != 0) && n >= kTuneMinN;
}

// M, K, dtype, X row-major, X described transposed, bias set, relu, N bucket (the search runs for W as the A operand
// and a row-major Y only): its choices are kept per key for the whole process (searched_configs), so layers of one
// shape search once
using TuneKey = std::tuple<int64_t, int64_t, int, bool, bool, bool, bool, int64_t>;
struct Choice {
  int id = -1;          // the configuration id (-1: the default selection)
  bool stored = false;  // given by store_config, not searched in this process
};
std::map<TuneKey, Choice> searched_configs;  // per key; guarded by registry_mutex

// n, ld X, X row-major, X described transposed, ld Y, Y row-major, bias, relu, algorithm configuration id, split-K
using PlanKey = std::tuple<int64_t, int64_t, bool, bool, int64_t, bool, uintptr_t, bool, int64_t, int64_t, int64_t>;

struct Weight {
  int64_t m = 0, k = 0;
  at::ScalarType dtype = at::kHalf;
  // The structured operand's role. sparse_b: W is cuSPARSELt's B operand, Y^T (N, M) = X^T (N, K) @ W^T (prepare_b),
  // described as the (M, K) row-major W with opB = T, or (b_col) as the (K, M) column-major W^T with opB = N.
  bool sparse_b = false, b_col = false;
  cusparseLtMatDescriptor_t mat_a{};  // the structured descriptor of W, whichever operand it is
  at::Tensor compressed;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  Plan* last = nullptr;  // the plan of the latest call (cslt_max_alg_id)
  ~Weight() {
    plans.clear();
    cusparseLtMatDescriptorDestroy(&mat_a);
  }
};

std::mutex registry_mutex;
std::map<int64_t, std::unique_ptr<Weight>> registry;
int64_t next_id = 1;

cudaDataType cuda_type(at::ScalarType t) {
  PRUNEKIT_CHECK(t == at::kHalf || t == at::kBFloat16, "cslt: float16 or bfloat16 expected, got ", t);
  return t == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
}

// Compress a 2:4 weight (M, K) (row-major, every group of 4 along K holding at most 2 non-zeros); returns its id.
// With `compressed` (benchmarks/nm_configs.py: torch._cslt_compress's output of the same weight) that buffer is used
// as it is instead, after a size check.
// An algorithm selection for `matmul` with configuration `id` (-1: cuSPARSELt's default selection) and split-K `mode` /
// `factor` (-1: unset), and its plan. Returns the first failing call's status; on failure nothing is left to destroy.
cusparseStatus_t plan_config(const cusparseLtMatmulDescriptor_t& matmul, int id, int mode, int factor,
                             cusparseLtMatmulAlgSelection_t* alg, cusparseLtMatmulPlan_t* plan) {
  cusparseStatus_t status = cusparseLtMatmulAlgSelectionInit(handle(), alg, &matmul, CUSPARSELT_MATMUL_ALG_DEFAULT);
  if (status != CUSPARSE_STATUS_SUCCESS) return status;
  if (id >= 0) {
    status = cusparseLtMatmulAlgSetAttribute(handle(), alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &id, sizeof(id));
  }
  if (status == CUSPARSE_STATUS_SUCCESS && mode >= 0) {
    // cusparseLtSplitKMode_t as its integer value (the modes differ between cuSPARSELt versions)
    status = cusparseLtMatmulAlgSetAttribute(handle(), alg, CUSPARSELT_MATMUL_SPLIT_K_MODE, &mode, sizeof(mode));
  }
  if (status == CUSPARSE_STATUS_SUCCESS && factor >= 1) {
    status = cusparseLtMatmulAlgSetAttribute(handle(), alg, CUSPARSELT_MATMUL_SPLIT_K, &factor, sizeof(factor));
  }
  if (status == CUSPARSE_STATUS_SUCCESS) status = cusparseLtMatmulPlanInit(handle(), plan, &matmul, alg);
  if (status != CUSPARSE_STATUS_SUCCESS) cusparseLtMatmulAlgSelectionDestroy(alg);
  return status;
}

// A tensor of y's sizes and strides for a configuration search to overwrite (y keeps its values).
at::Tensor search_scratch(const at::Tensor& y) { return at::empty_strided(y.sizes(), y.strides(), y.options()); }

// Our own configuration search (cusparseLtMatmulSearch returned "internal error" on the H100 at large GEMMs, then
// the next CUDA call hit an illegal instruction: docs/PERFORMANCE_STRUCTURED.md). Every configuration id cuSPARSELt
// offers for `matmul` (up to CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID) gets a plan; each that plans and runs is timed on
// these operands with CUDA events, beside cuSPARSELt's default selection, kTuneReps calls per round over kTuneRounds
// rounds, the order rotated by one per round so that a drift of the GPU's speed falls on all alike. The id with the
// lowest median time per call is returned if it beat the default's median by kTuneMargin; else -1 (the default). y is
// overwritten. Also -1 while the stream is being captured into a CUDA graph, where nothing can be timed, or when fewer
// than two configurations run. *searched tells whether the configurations were timed. Cost, once per plan: a plan and
// kTuneRounds * kTuneReps + 1 calls per id (27 ids on the H100 with cuSPARSELt 0.8: the first call took 0.12-0.58 s
// at the GEMMs of 4096 x 4096 to 11008 x 4096, 2.5 s at 16384^2 x 8192; nm-kernels-h100-2026-11-26-s23e.json).
int tune_config_id(const Weight& w, const cusparseLtMatmulDescriptor_t& matmul, const at::Tensor& x,
                   const at::Tensor& y, bool* searched) {
  *searched = false;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) return -1;
  cusparseLtMatmulAlgSelection_t probe;
  PK_CSLT_CHECK(cusparseLtMatmulAlgSelectionInit(handle(), &probe, &matmul, CUSPARSELT_MATMUL_ALG_DEFAULT));
  int max_id = 0;
  const cusparseStatus_t got =
      cusparseLtMatmulAlgGetAttribute(handle(), &probe, CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID, &max_id, sizeof(max_id));
  cusparseLtMatmulAlgSelectionDestroy(&probe);
  if (got != CUSPARSE_STATUS_SUCCESS) return -1;
  struct Trial {
    int id = 0;
    cusparseLtMatmulAlgSelection_t alg{};
    cusparseLtMatmulPlan_t plan{};
    size_t workspace = 0;
    bool runs = true;
    std::vector<float> ms;
  };
  std::vector<Trial> trials;
  trials.reserve(static_cast<size_t>(std::max(max_id, 0)));
  for (int id = -1; id < max_id; ++id) {  // -1: the default selection, no id set
    Trial t;
    t.id = id;
    if (plan_config(matmul, id, -1, -1, &t.alg, &t.plan) != CUSPARSE_STATUS_SUCCESS) continue;
    if (cusparseLtMatmulGetWorkspace(handle(), &t.plan, &t.workspace) != CUSPARSE_STATUS_SUCCESS) {
      cusparseLtMatmulPlanDestroy(&t.plan);
      cusparseLtMatmulAlgSelectionDestroy(&t.alg);
      continue;
    }
    trials.push_back(t);
  }
  size_t ws_bytes = 16;
  for (const Trial& t : trials) ws_bytes = std::max(ws_bytes, t.workspace);
  at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  const float alpha = 1.f, beta = 0.f;
  const void* a_ptr = w.sparse_b ? x.data_ptr() : w.compressed.data_ptr();
  const void* b_ptr = w.sparse_b ? w.compressed.data_ptr() : x.data_ptr();
  auto run = [&](Trial& t) {
    return cusparseLtMatmul(handle(), &t.plan, &alpha, a_ptr, b_ptr, &beta, y.data_ptr(), y.data_ptr(), ws.data_ptr(),
                            &stream, 1) == CUSPARSE_STATUS_SUCCESS;
  };
  for (Trial& t : trials) t.runs = run(t);  // warm-up; a configuration that does not run is dropped
  std::vector<cudaEvent_t> events(2 * trials.size());
  for (cudaEvent_t& e : events) PRUNEKIT_CHECK(cudaEventCreate(&e) == cudaSuccess, "cslt: cudaEventCreate failed");
  const size_t count = trials.size();
  for (int round = 0; round < kTuneRounds && count > 0; ++round) {
    for (size_t j = 0; j < count; ++j) {
      const size_t i = (j + static_cast<size_t>(round)) % count;
      if (!trials[i].runs) continue;
      cudaEventRecord(events[2 * i], stream);
      for (int r = 0; r < kTuneReps; ++r) trials[i].runs = run(trials[i]) && trials[i].runs;
      cudaEventRecord(events[2 * i + 1], stream);
    }
    PRUNEKIT_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "cslt: the configuration search failed on the GPU");
    for (size_t i = 0; i < count; ++i) {
      float ms = 0.f;
      if (trials[i].runs && cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]) == cudaSuccess) {
        trials[i].ms.push_back(ms / kTuneReps);
      }
    }
  }
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
  *searched = true;
  int best = -1, timed = 0;
  float best_ms = 0.f, default_ms = 0.f;
  for (Trial& t : trials) {
    if (t.runs && t.ms.size() == static_cast<size_t>(kTuneRounds)) {
      std::sort(t.ms.begin(), t.ms.end());
      const float median = t.ms[t.ms.size() / 2];
      if (t.id < 0) default_ms = median;
      ++timed;
      if (timed == 1 || median < best_ms) {
        best = t.id;
        best_ms = median;
      }
    }
    cusparseLtMatmulPlanDestroy(&t.plan);
    cusparseLtMatmulAlgSelectionDestroy(&t.alg);
  }
  // another id only where it beat the default selection by kTuneMargin: at 16384^2 x 8192 the search once kept an id
  // 4% slower than the default by graph time (benchmarks/results/nm-kernels-h100-2026-11-26-s23e.json)
  if (timed < 2 || best < 0 || (default_ms > 0.f && best_ms > default_ms * (1.f - kTuneMargin))) return -1;
  return best;
}

// With `sparse_b` (prepare_b) W is compressed as cuSPARSELt's structured B operand (isSparseA = 0) instead.
int64_t prepare_weight(const at::Tensor& dense, const c10::optional<at::Tensor>& compressed, bool sparse_b,
                       bool b_col) {
  PRUNEKIT_CHECK(dense.is_cuda() && dense.dim() == 2 && dense.is_contiguous(), "cslt_prepare: contiguous 2-D GPU tensor");
  const c10::cuda::CUDAGuard guard(dense.device());
  auto w = std::make_unique<Weight>();
  w->m = dense.size(0);
  w->k = dense.size(1);
  w->dtype = dense.scalar_type();
  w->sparse_b = sparse_b;
  w->b_col = sparse_b && b_col;
  // the same bytes: W (M, K) row-major, or W^T (K, M) column-major
  PK_CSLT_CHECK(cusparseLtStructuredDescriptorInit(handle(), &w->mat_a, w->b_col ? w->k : w->m,
                                                   w->b_col ? w->m : w->k, w->k, 16, cuda_type(w->dtype),
                                                   w->b_col ? CUSPARSE_ORDER_COL : CUSPARSE_ORDER_ROW,
                                                   CUSPARSELT_SPARSITY_50_PERCENT));
  // as A, op(A) = W; as B, op(B) = W^T (K, M)
  const cusparseOperation_t op =
      sparse_b && !w->b_col ? CUSPARSE_OPERATION_TRANSPOSE : CUSPARSE_OPERATION_NON_TRANSPOSE;
  size_t compressed_size = 0, buffer_size = 0;
  PK_CSLT_CHECK(cusparseLtSpMMACompressedSize2(handle(), &w->mat_a, &compressed_size, &buffer_size));
  if (compressed.has_value()) {
    PRUNEKIT_CHECK(compressed->is_cuda() && compressed->is_contiguous() &&
                       static_cast<size_t>(compressed->nbytes()) >= compressed_size,
                   "cslt_prepare: the compressed buffer is smaller than cuSPARSELt's ", compressed_size, " bytes");
    w->compressed = *compressed;
  } else {
    w->compressed = at::empty({static_cast<int64_t>(compressed_size)}, dense.options().dtype(at::kByte));
    at::Tensor buffer =
        at::empty({static_cast<int64_t>(std::max<size_t>(buffer_size, 16))}, dense.options().dtype(at::kByte));
    PK_CSLT_CHECK(cusparseLtSpMMACompress2(handle(), &w->mat_a, sparse_b ? 0 : 1, op, dense.data_ptr(),
                                           w->compressed.data_ptr(), buffer.data_ptr(),
                                           c10::cuda::getCurrentCUDAStream()));
  }
  const std::lock_guard<std::mutex> lock(registry_mutex);
  const int64_t id = next_id++;
  registry[id] = std::move(w);
  return id;
}

int64_t cslt_prepare_with(const at::Tensor& dense, const c10::optional<at::Tensor>& compressed) {
  return prepare_weight(dense, compressed, false, false);
}

// W (M, K) as cuSPARSELt's structured B operand: the product is computed as Y^T (N, M) = X^T (N, K) @ W^T, so the
// transposed view of nn.Linear activations is read as the row-major (N, K) it is and the output is the contiguous
// (N, M) nn.Linear returns. `col`: W described as the (K, M) column-major W^T with opB = N, else as the (M, K)
// row-major W with opB = T (same bytes). cuSPARSELt's bias vector runs along the rows of its output (here the
// tokens), so such a weight takes no bias.
int64_t cslt_prepare_b(const at::Tensor& dense, bool col) { return prepare_weight(dense, c10::nullopt, true, col); }

// y (M, N) = act(W @ x + bias); x: (K, N) column-major (x.stride(0) == 1) or row-major (x.stride(1) == 1, N > 1);
// y: (M, N) column-major (y.stride(0) == 1) or row-major (y.stride(1) == 1; on the H100 with cuSPARSELt 0.8 torch's
// row-major-output configuration ran 2.4x faster than the column-major one, see docs/PERFORMANCE_STRUCTURED.md).
//
// beta (cslt_mm_beta): y = act(W @ x + beta * y + bias), y's old values read in cuSPARSELt's epilogue (C = D); the
// split24 SpMM variant (kernels/split24.py) adds its residual's product this way. A configuration search for a new
// plan then runs on a scratch copy of y, so that y's values survive it.
void cslt_mm_impl(int64_t id, const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& bias,
                  bool relu, float beta) {
  Weight* w = nullptr;
  {
    const std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(id);
    PRUNEKIT_CHECK(it != registry.end(), "cslt_mm: unknown weight id ", id);
    w = it->second.get();
  }
  PRUNEKIT_CHECK(x.is_cuda() && y.is_cuda() && x.scalar_type() == w->dtype && y.scalar_type() == w->dtype,
              "cslt_mm: x and y must be GPU tensors of the weight's dtype");
  PRUNEKIT_CHECK(x.dim() == 2 && x.size(0) == w->k, "cslt_mm: x must be (K, N)");
  PRUNEKIT_CHECK(y.dim() == 2 && y.size(0) == w->m && y.size(1) == x.size(1), "cslt_mm: y must be (M, N)");
  const int64_t n = x.size(1);
  const bool x_row = x.stride(0) != 1 && x.stride(1) == 1 && x.stride(0) >= n;
  PRUNEKIT_CHECK(x_row || x.stride(0) == 1, "cslt_mm: x must be column-major or row-major");
  const bool y_row = y.stride(1) == 1 && y.stride(0) >= n && !(y.stride(0) == 1 && n > 1);
  PRUNEKIT_CHECK(y_row || y.stride(0) == 1, "cslt_mm: y must be column-major or row-major");
  const int64_t ldx = x_row ? x.stride(0) : std::max<int64_t>(x.stride(1), w->k);
  const int64_t ldy = y_row ? std::max<int64_t>(y.stride(0), n) : std::max<int64_t>(y.stride(1), w->m);
  void* bias_ptr = nullptr;
  if (bias.has_value()) {
    PRUNEKIT_CHECK(bias->scalar_type() == w->dtype && bias->is_contiguous() && bias->numel() == w->m,
                "cslt_mm: bias must be a contiguous (M,) tensor of the weight's dtype");
    PRUNEKIT_CHECK(!w->sparse_b, "cslt_mm: a weight prepared as the B operand (prepare_b) takes no bias");
    bias_ptr = bias->data_ptr();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t alg_id = env_int("PRUNEKIT_CSLT_ALG"), split_k = env_int("PRUNEKIT_CSLT_SPLIT_K");
  const int64_t split_k_mode = env_int("PRUNEKIT_CSLT_SPLIT_K_MODE");
  const bool x_t = describe_x_transposed();
  const PlanKey key{n,     ldx,    x_row,  x_t, ldy, y_row, reinterpret_cast<uintptr_t>(bias_ptr),
                    relu,  alg_id, split_k, split_k_mode};
  Plan* p = nullptr;
  {
    const std::lock_guard<std::mutex> lock(registry_mutex);
    auto& slot = w->plans[key];
    if (!slot) {
      auto plan = std::make_unique<Plan>();
      const cudaDataType t = cuda_type(w->dtype);
      // X (K, N) in its order, or the (N, K) it is the transpose of in the other order (then opB = T)
      if (w->sparse_b) {
        // Y^T (N, M) = op(A) op(B): A is X's storage, read as the row-major (N, K) X^T (opA = N) or the row-major
        // (K, N) X (opA = T); D is Y's storage as the (N, M) Y^T, row-major where Y is column-major
        PK_CSLT_CHECK(cusparseLtDenseDescriptorInit(handle(), &plan->mat_b, x_row ? w->k : n, x_row ? n : w->k, ldx,
                                                    16, t, CUSPARSE_ORDER_ROW));
        PK_CSLT_CHECK(cusparseLtDenseDescriptorInit(handle(), &plan->mat_c, n, w->m, ldy, 16, t,
                                                    y_row ? CUSPARSE_ORDER_COL : CUSPARSE_ORDER_ROW));
        PK_CSLT_CHECK(cusparseLtMatmulDescriptorInit(
            handle(), &plan->matmul, x_row ? CUSPARSE_OPERATION_TRANSPOSE : CUSPARSE_OPERATION_NON_TRANSPOSE,
            w->b_col ? CUSPARSE_OPERATION_NON_TRANSPOSE : CUSPARSE_OPERATION_TRANSPOSE, &plan->mat_b, &w->mat_a,
            &plan->mat_c, &plan->mat_c, CUSPARSE_COMPUTE_32F));
      } else {
        const cusparseOrder_t x_order = x_row != x_t ? CUSPARSE_ORDER_ROW : CUSPARSE_ORDER_COL;
        PK_CSLT_CHECK(cusparseLtDenseDescriptorInit(handle(), &plan->mat_b, x_t ? n : w->k, x_t ? w->k : n, ldx, 16,
                                                    t, x_order));
        PK_CSLT_CHECK(cusparseLtDenseDescriptorInit(handle(), &plan->mat_c, w->m, n, ldy, 16, t,
                                                    y_row ? CUSPARSE_ORDER_ROW : CUSPARSE_ORDER_COL));
        PK_CSLT_CHECK(cusparseLtMatmulDescriptorInit(
            handle(), &plan->matmul, CUSPARSE_OPERATION_NON_TRANSPOSE,
            x_t ? CUSPARSE_OPERATION_TRANSPOSE : CUSPARSE_OPERATION_NON_TRANSPOSE, &w->mat_a, &plan->mat_b,
            &plan->mat_c, &plan->mat_c, CUSPARSE_COMPUTE_32F));
      }
      if (relu) {
        const int on = 1;
        PK_CSLT_CHECK(cusparseLtMatmulDescSetAttribute(handle(), &plan->matmul, CUSPARSELT_MATMUL_ACTIVATION_RELU,
                                                       &on, sizeof(on)));
      }
      if (bias_ptr != nullptr) {
        PK_CSLT_CHECK(cusparseLtMatmulDescSetAttribute(handle(), &plan->matmul, CUSPARSELT_MATMUL_BIAS_POINTER,
                                                       &bias_ptr, sizeof(bias_ptr)));
      }
      plan->config_id = static_cast<int>(alg_id);
      // only for the row-major Y (M, N) the runtime's layer writes: in a run with the search on for every layout, a
      // configuration tried for another layout ended the process with an illegal instruction on the H100
      // (benchmarks/results/nm-large-tune-h100-2026-11-26-s23f.log), as cusparseLtMatmulSearch did
      if (alg_id < 0 && split_k < 0 && split_k_mode < 0 && !search_plans() && tune_plans(n) && y_row &&
          !w->sparse_b) {
        const TuneKey tkey{w->m,   w->k, static_cast<int>(w->dtype), x_row, x_t, bias_ptr != nullptr,
                           relu, n_bucket_of(n)};
        const auto found = searched_configs.find(tkey);
        if (found != searched_configs.end()) {
          plan->config_id = found->second.id;
          plan->config_source = found->second.stored ? kConfigStored : kConfigFromBucket;
        } else {
          bool searched = false;
          plan->config_id = tune_config_id(*w, plan->matmul, x, beta != 0.f ? search_scratch(y) : y, &searched);
          if (searched) {
            plan->config_source = kConfigSearched;
            searched_configs[tkey] = Choice{plan->config_id, false};
          }
        }
      }
      const int mode32 = static_cast<int>(split_k_mode), factor32 = static_cast<int>(split_k);
      cusparseStatus_t planned = plan_config(plan->matmul, plan->config_id, mode32, factor32, &plan->alg, &plan->plan);
      if (planned != CUSPARSE_STATUS_SUCCESS &&
          (plan->config_source == kConfigFromBucket || plan->config_source == kConfigStored)) {
        // another N of the bucket (or the stored search) chose an id this N does not plan: the default selection
        plan->config_id = -1;
        plan->config_source = kConfigNone;
        planned = plan_config(plan->matmul, -1, mode32, factor32, &plan->alg, &plan->plan);
      }
      PRUNEKIT_CHECK(planned == CUSPARSE_STATUS_SUCCESS, "cuSPARSELt call planning configuration id ", plan->config_id,
                     " (split-K mode ", mode32, ", factor ", factor32, ") failed: ", cusparseLtGetErrorString(planned));
      plan->ready = true;
      PK_CSLT_CHECK(cusparseLtMatmulGetWorkspace(handle(), &plan->plan, &plan->workspace));
      if (search_plans()) {
        // Times every configuration on these operands (y is overwritten; the real call below writes it again) and
        // updates the plan; the chosen configuration may need another workspace size. The default configuration's
        // workspace may be too small for the split-K ones the search tries: give it kSearchWorkspace at least.
        constexpr size_t kSearchWorkspace = size_t{256} << 20;
        at::Tensor ws = at::empty({static_cast<int64_t>(std::max(plan->workspace, kSearchWorkspace))},
                                  x.options().dtype(at::kByte));
        const float alpha = 1.f, search_beta = 0.f;
        cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
        const void* a_ptr = w->sparse_b ? x.data_ptr() : w->compressed.data_ptr();
        const void* b_ptr = w->sparse_b ? w->compressed.data_ptr() : x.data_ptr();
        const at::Tensor ys = beta != 0.f ? search_scratch(y) : y;
        PK_CSLT_CHECK(cusparseLtMatmulSearch(handle(), &plan->plan, &alpha, a_ptr, b_ptr, &search_beta, ys.data_ptr(),
                                             ys.data_ptr(), ws.data_ptr(), &stream, 1));
        PK_CSLT_CHECK(cusparseLtMatmulGetWorkspace(handle(), &plan->plan, &plan->workspace));
      }
      slot = std::move(plan);
    }
    p = slot.get();
    w->last = p;
  }
  at::Tensor workspace;
  void* ws_ptr = nullptr;
  if (p->workspace > 0) {
    workspace = at::empty({static_cast<int64_t>(p->workspace)}, x.options().dtype(at::kByte));
    ws_ptr = workspace.data_ptr();
  }
  const float alpha = 1.f;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const void* a_ptr = w->sparse_b ? x.data_ptr() : w->compressed.data_ptr();
  const void* b_ptr = w->sparse_b ? w->compressed.data_ptr() : x.data_ptr();
  PK_CSLT_CHECK(
      cusparseLtMatmul(handle(), &p->plan, &alpha, a_ptr, b_ptr, &beta, y.data_ptr(), y.data_ptr(), ws_ptr, &stream,
                       1));
  if (env_int("PRUNEKIT_CSLT_FRESH_PLAN") == 1) {
    // diagnostics (benchmarks/nm_configs.py): drop the plan, so that every call builds its own, as
    // torch._cslt_sparse_mm does (it destroys its plan right after cusparseLtMatmul too)
    const std::lock_guard<std::mutex> lock(registry_mutex);
    w->plans.erase(key);
    w->last = nullptr;
  }
}

void cslt_mm(int64_t id, const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& bias, bool relu) {
  cslt_mm_impl(id, x, y, bias, relu, 0.f);
}

void cslt_mm_beta(int64_t id, const at::Tensor& x, const at::Tensor& y, const c10::optional<at::Tensor>& bias,
                  bool relu, double beta) {
  cslt_mm_impl(id, x, y, bias, relu, static_cast<float>(beta));
}

// The eager entry (one dispatcher call per layer call, no Python tensor work): Y (M, N) = act(W @ x + bias). N is
// padded to a multiple of 16 (a zero-filled copy of x, only for such N). `output` says how Y is laid out:
//  - kOutputCol: layout.py's rule (x (K, N) with unit stride along K and N > 1: Y is the transposed view of a
//    contiguous (N, M); else a contiguous (M, N)); cuSPARSELt writes the column-major Y directly;
//  - kOutputRowCopy: the same rule, but cuSPARSELt writes a row-major (M, N_pad) (its fast configuration on the H100)
//    and a transposing copy follows where the rule wants the other order;
//  - kOutputRow: cuSPARSELt's row-major Y is returned as it is, no copy: for the transposed view of nn.Linear
//    activations the layer's output Y.t() is then a non-contiguous (N, M) view, as torch's own 2:4 F.linear returns.
//    A row-major x (such a view, passed on by the next layer) is read in place, not copied.
constexpr int64_t kOutputCol = 0, kOutputRowCopy = 1, kOutputRow = 2;

at::Tensor cslt_linear(int64_t id, const at::Tensor& x, const c10::optional<at::Tensor>& bias, bool relu,
                       int64_t output) {
  PRUNEKIT_CHECK(x.dim() == 2, "cslt_linear: x must be (K, N)");
  PRUNEKIT_CHECK(output == kOutputCol || output == kOutputRowCopy || output == kOutputRow,
                 "cslt_linear: output must be 0 (column-major), 1 (row-major, then the layout copy) or 2 (row-major)");
  int64_t m = 0;
  bool sparse_b = false;
  {
    const std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(id);
    PRUNEKIT_CHECK(it != registry.end(), "cslt_linear: unknown weight id ", id);
    m = it->second->m;
    sparse_b = it->second->sparse_b;
  }
  const int64_t k = x.size(0), n = x.size(1);
  const bool transposed = n > 1 && x.stride(0) == 1 && x.stride(1) != 1;
  const bool row_major = n > 1 && x.stride(1) == 1 && x.stride(0) != 1;
  const int64_t n_pad = (n + 15) / 16 * 16;
  const bool aligned = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && n_pad == n;
  at::Tensor xb = x;
  if (row_major && aligned && x.stride(0) % 8 == 0) {
    // read in place: the (K, N) row-major view another layer's kOutputRow output gives
  } else if (!(transposed && aligned && x.stride(1) % 8 == 0)) {
    at::Tensor buf = at::zeros({n_pad, k}, x.options());
    buf.narrow(0, 0, n).copy_(x.t());
    xb = buf.t();
  }
  // a B-operand weight (prepare_b) writes Y^T (N, M) row-major: Y column-major, whatever `output` asks
  const bool row_output = output != kOutputCol && !sparse_b;
  at::Tensor y = row_output ? at::empty({m, n_pad}, x.options()) : at::empty({n_pad, m}, x.options()).t();
  cslt_mm(id, xb, y, bias, relu);
  if (n_pad != n) y = y.narrow(1, 0, n);
  if (output == kOutputRow) return y;
  if (transposed) {
    if (!row_output) return y;  // already the transposed view of a contiguous (N, M)
    at::Tensor out = at::empty({n, m}, x.options());
    out.copy_(y.t());
    return out.t();
  }
  if (y.stride(1) == 1 && y.stride(0) == n) return y;  // exactly the strides of a fresh (M, N), as the fake impl's
  return at::empty({m, n}, x.options()).copy_(y);       // (a size-1 N keeps stride 1, so torch's checks agree)
}

int64_t cslt_prepare(const at::Tensor& dense) { return cslt_prepare_with(dense, c10::nullopt); }

// The weight's latest plan as [configuration id, source]: the id is -1 for cuSPARSELt's default selection, else the
// one set on the plan (by $PRUNEKIT_CSLT_ALG or by the search of $PRUNEKIT_CSLT_TUNE=1); source is 1 where that
// search timed the configurations for this plan, 2 where it took the choice of an earlier plan in the same N bucket,
// 3 where it took the id store_config gave, else 0. [-2, 0] when no plan was kept.
std::vector<int64_t> cslt_last_config(int64_t id) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(id);
  PRUNEKIT_CHECK(it != registry.end(), "cslt_last_config: unknown weight id ", id);
  const Plan* plan = it->second->last;
  if (plan == nullptr) return {-2, 0};
  return {plan->config_id, plan->config_source};
}

// The largest algorithm configuration id (CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID) cuSPARSELt offers for the product
// mm(id, x, y, None, False) would run: benchmarks/nm_configs.py sweeps the ids up to it. Runs that product once.
int64_t cslt_max_alg_id(int64_t id, const at::Tensor& x, const at::Tensor& y) {
  cslt_mm(id, x, y, c10::nullopt, false);
  const std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(id);
  PRUNEKIT_CHECK(it != registry.end(), "cslt_max_alg_id: unknown weight id ", id);
  Weight* w = it->second.get();
  PRUNEKIT_CHECK(w->last != nullptr, "cslt_max_alg_id: no plan kept (unset $PRUNEKIT_CSLT_FRESH_PLAN)");
  int max_id = -1;
  PK_CSLT_CHECK(cusparseLtMatmulAlgGetAttribute(handle(), &w->last->alg, CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID, &max_id,
                                                sizeof(max_id)));
  return max_id;
}

// Gives the search's choice for the runtime layer's products with W (M, K) of `dtype` (0: float16, 1: bfloat16), X
// (K, N) row-major (`x_row`: the transposed view of the column-major activations a preceding 2:4 layer returns) or
// column-major (the transposed view of row-major activations), a bias or none, and N in the power-of-two bucket
// `n_bucket`, so that plans of that key take `config_id` (-1: the default selection) without searching (source 3 in
// last_config). The rest of the key is the layer's: X described as $PRUNEKIT_CSLT_B_T says, a row-major Y, no ReLU
// (the layer applies none). The ids come from a search run at export in a child process (kernels/cslt_tune.py), on
// the same GPU model and cuSPARSELt version, so that the process serving the package runs no search, and a
// configuration that failed there (stored as -1) is never tried. An id this N cannot plan falls back to the default
// selection. Returns false, changing nothing, where the process already holds a choice for the key (its own search's,
// or an earlier store's). Plans built before are not changed. Under $PRUNEKIT_CSLT_TUNE=0 stored ids are not used.
bool cslt_store_config(int64_t m, int64_t k, int64_t dtype, bool x_row, bool bias, int64_t n_bucket,
                       int64_t config_id) {
  PRUNEKIT_CHECK(m > 0 && k > 0, "cslt_store_config: M and K must be positive, got ", m, " x ", k);
  PRUNEKIT_CHECK(dtype == 0 || dtype == 1, "cslt_store_config: dtype must be 0 (float16) or 1 (bfloat16), got ",
                 dtype);
  PRUNEKIT_CHECK(n_bucket >= kTuneMinN && n_bucket == n_bucket_of(n_bucket),
                 "cslt_store_config: n_bucket must be a power of two >= ", kTuneMinN, ", got ", n_bucket);
  PRUNEKIT_CHECK(config_id >= -1 && config_id < 1 << 20, "cslt_store_config: bad configuration id ", config_id);
  const int type = static_cast<int>(dtype == 0 ? at::kHalf : at::kBFloat16);
  const TuneKey key{m, k, type, x_row, describe_x_transposed(), bias, false, n_bucket};
  const std::lock_guard<std::mutex> lock(registry_mutex);
  return searched_configs.emplace(key, Choice{static_cast<int>(config_id), true}).second;
}

void cslt_release(int64_t id) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(id);
}

}  // namespace prunekit_cslt

TORCH_LIBRARY(prunekit_cslt, m) {
  m.def("prepare(Tensor dense) -> int");
  m.def("prepare_with(Tensor dense, Tensor? compressed) -> int");
  m.def("prepare_b(Tensor dense, bool col) -> int");
  m.def("max_alg_id(int id, Tensor x, Tensor(a!) y) -> int");
  m.def("last_config(int id) -> int[]", &prunekit_cslt::cslt_last_config);  // no tensor argument: catch-all
  m.def("mm(int id, Tensor x, Tensor(a!) y, Tensor? bias, bool relu) -> ()");
  m.def("mm_beta(int id, Tensor x, Tensor(a!) y, Tensor? bias, bool relu, float beta) -> ()");
  m.def("linear(int id, Tensor x, Tensor? bias, bool relu, int output) -> Tensor");
  m.def("release(int id) -> ()", &prunekit_cslt::cslt_release);  // no tensor argument: a catch-all kernel
  m.def("store_config(int m, int k, int dtype, bool x_row, bool bias, int n_bucket, int config_id) -> bool",
        &prunekit_cslt::cslt_store_config);  // no tensor argument: catch-all
}

TORCH_LIBRARY_IMPL(prunekit_cslt, CUDA, m) {
  m.impl("prepare", &prunekit_cslt::cslt_prepare);
  m.impl("prepare_with", &prunekit_cslt::cslt_prepare_with);
  m.impl("prepare_b", &prunekit_cslt::cslt_prepare_b);
  m.impl("max_alg_id", &prunekit_cslt::cslt_max_alg_id);
  m.impl("mm", &prunekit_cslt::cslt_mm);
  m.impl("mm_beta", &prunekit_cslt::cslt_mm_beta);
  m.impl("linear", &prunekit_cslt::cslt_linear);
}
