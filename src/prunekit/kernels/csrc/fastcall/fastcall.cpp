// Fast Python entries to the runtime's eager C++ operators (docs/KERNELS.md, "Fast calls").
//
// Calling an operator from Python as torch.ops.NS.OP.default(...) converts every argument to an IValue against the
// schema before the dispatcher runs: about 1.3 us for five arguments and 2 us for ten on the build machine, measured
// against the functions below, which take the same arguments through pybind11's casters and call the same operator
// through its typed dispatcher handle. The dispatcher still runs (profiler, dispatch modes); the Python-side argument
// parsing is skipped, and so is torch's autograd fallback where no tensor argument requires a gradient
// (BelowAutograd). Each operator is looked up by name on its first call, so this module loads before or without the
// kernel libraries: a call whose library is not loaded raises RuntimeError ("Could not find schema for ..."), and the
// next call looks again.
//
// This is a Python extension module (tied to one Python version, unlike the kernel libraries, which register their
// operators with TORCH_LIBRARY and load under any Python of the same torch build). It holds no kernels: C++ only,
// built without nvcc. The signatures match the kernels' registrations exactly (the typed handle checks them).
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstdint>
#include <optional>
#include <string>

namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;

// prunekit_structured::bsr_mm (csrc/structured/bsr_mm.cu)
using BsrMm = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, const Tensor&,
                     int64_t, const OptTensor&, bool, int64_t);
// prunekit_nm24::linear (csrc/structured/nm24/nm24_decode.cu)
using Nm24Linear = Tensor(const Tensor&, const Tensor&, const OptTensor&, bool, int64_t);
// prunekit_nm24::bitmap_linear (same file)
using BitmapLinear = Tensor(const Tensor&, const Tensor&, const OptTensor&, bool, int64_t, int64_t);
// prunekit_nm24::spmv24 (csrc/structured/nm24/nm24_spmv.cu)
using Spmv24 = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, bool, bool);
// prunekit_ext::spmm_csr_auto (csrc/spmm_entry.cu)
using SpmmCsrAuto = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                           const OptTensor&, bool, int64_t);

// The typed handle of operator `name` (throws when it is not registered, or when Sig is not its signature). Each
// getter below keeps it in a function-local static: a lookup that throws leaves the static unset, so the next call
// retries.
template <typename Sig>
c10::TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Sig>();
}

const c10::TypedOperatorHandle<BsrMm>& bsr_mm_op() {
  static const auto op = find<BsrMm>("prunekit_structured::bsr_mm");
  return op;
}

const c10::TypedOperatorHandle<Nm24Linear>& nm24_linear_op() {
  static const auto op = find<Nm24Linear>("prunekit_nm24::linear");
  return op;
}

const c10::TypedOperatorHandle<BitmapLinear>& bitmap_linear_op() {
  static const auto op = find<BitmapLinear>("prunekit_nm24::bitmap_linear");
  return op;
}

const c10::TypedOperatorHandle<Spmv24>& spmv24_op() {
  static const auto op = find<Spmv24>("prunekit_nm24::spmv24");
  return op;
}

const c10::TypedOperatorHandle<SpmmCsrAuto>& spmm_csr_auto_op() {
  static const auto op = find<SpmmCsrAuto>("prunekit_ext::spmm_csr_auto");
  return op;
}

// The operators have no autograd kernel, so a call with the autograd dispatch keys in effect runs torch's autograd
// fallback for custom operators: a boxed kernel (every argument packed into IValues, then unpacked again for the
// operator's own kernel) that looks for arguments requiring a gradient and redispatches. Where grad mode is off or no
// tensor argument requires a gradient, that fallback has nothing to do, and the call excludes the autograd keys (and
// ADInplaceOrView) for its duration, as torch.inference_mode() does; the output is an ordinary tensor. Where an
// argument requires a gradient, the call goes through the fallback as before (its warning included).
bool needs_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }
bool needs_grad(const OptTensor& t) { return t.has_value() && needs_grad(*t); }
template <typename... Ts>
bool any_needs_grad(const Ts&... ts) {
  return c10::GradMode::is_enabled() && (needs_grad(ts) || ...);
}
struct BelowAutograd {
  explicit BelowAutograd(bool skip) {
    if (skip) guard.emplace(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  }
  std::optional<c10::impl::ExcludeDispatchKeyGuard> guard;
};

Tensor bsr_mm(const Tensor& blocks, const Tensor& crow, const Tensor& cols, const OptTensor& schedule,
              const OptTensor& split_rows, const Tensor& x, int64_t m, const OptTensor& bias, bool relu,
              int64_t variant) {
  const BelowAutograd below(!any_needs_grad(blocks, crow, cols, schedule, split_rows, x, bias));
  return bsr_mm_op().call(blocks, crow, cols, schedule, split_rows, x, m, bias, relu, variant);
}

Tensor nm24_linear(const Tensor& plan, const Tensor& x, const OptTensor& bias, bool relu, int64_t cfg) {
  const BelowAutograd below(!any_needs_grad(plan, x, bias));
  return nm24_linear_op().call(plan, x, bias, relu, cfg);
}

Tensor bitmap_linear(const Tensor& plan, const Tensor& x, const OptTensor& bias, bool relu, int64_t cfg,
                     int64_t shape) {
  const BelowAutograd below(!any_needs_grad(plan, x, bias));
  return bitmap_linear_op().call(plan, x, bias, relu, cfg, shape);
}

Tensor spmv24(const Tensor& values, const Tensor& metadata, const Tensor& x, const OptTensor& bias, bool relu,
              bool rows) {
  const BelowAutograd below(!any_needs_grad(values, metadata, x, bias));
  return spmv24_op().call(values, metadata, x, bias, relu, rows);
}

Tensor spmm_csr_auto(const Tensor& values, const Tensor& row_offsets, const Tensor& column_indices,
                     const Tensor& row_indices, const Tensor& x, int64_t m, const OptTensor& bias, bool relu,
                     int64_t variant) {
  const BelowAutograd below(!any_needs_grad(values, row_offsets, column_indices, row_indices, x, bias));
  return spmm_csr_auto_op().call(values, row_offsets, column_indices, row_indices, x, m, bias, relu, variant);
}

// Whether the entry `name` (this module's function name) finds its operator with the expected signature: fastcall.py
// hands out a function only after this said yes, so a missing library or a signature this build does not match
// makes the caller use the OpOverload instead of raising on every call.
bool ready(const std::string& name) {
  try {
    if (name == "bsr_mm") {
      bsr_mm_op();
    } else if (name == "linear") {
      nm24_linear_op();
    } else if (name == "bitmap_linear") {
      bitmap_linear_op();
    } else if (name == "spmv24") {
      spmv24_op();
    } else if (name == "spmm_csr_auto") {
      spmm_csr_auto_op();
    } else {
      return false;
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "prunekit's fast Python entries to its eager C++ operators (no kernels)";
  mod.def("bsr_mm", &bsr_mm, "prunekit_structured::bsr_mm");
  mod.def("linear", &nm24_linear, "prunekit_nm24::linear");
  mod.def("bitmap_linear", &bitmap_linear, "prunekit_nm24::bitmap_linear");
  mod.def("spmv24", &spmv24, "prunekit_nm24::spmv24");
  mod.def("spmm_csr_auto", &spmm_csr_auto, "prunekit_ext::spmm_csr_auto");
  mod.def("ready", &ready, "whether the entry of this name finds its operator with the expected signature");
}
