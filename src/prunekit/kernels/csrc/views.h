// raw_view / raw_t: strided aliases of a tensor's storage made without the dispatcher, for the eager C++ entries'
// internal views (the activations seen as X (K, N), a fresh output seen as Y (M, N) or Y^T (N, M)).
//
// Why: x.t() in C++ is three dispatcher calls (t, transpose, as_strided), each through the autograd and view-tracking
// kernels: 0.42 us per view on the build machine's CPU against 0.09 us for raw_view (docs/KERNELS.md, "Fast
// calls"), and the entries made two or three per call. The alias shares the storage, gets its own version counter and no autograd
// view metadata, which is all these views need: they only carry sizes, strides and the data pointer to a launcher,
// or wrap an output allocated in the same call (which then has no other handle). Never use it on a tensor that may
// require grad where the alias is returned.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <utility>

namespace prunekit {

inline at::Tensor raw_view(const at::Tensor& t, c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
  impl->set_sizes_and_strides(sizes, strides, t.storage_offset());
  return at::Tensor(std::move(impl));
}

// The transpose of a 2-D tensor (what t.t() gives).
inline at::Tensor raw_t(const at::Tensor& t) {
  const int64_t sizes[2] = {t.size(1), t.size(0)};
  const int64_t strides[2] = {t.stride(1), t.stride(0)};
  return raw_view(t, sizes, strides);
}

}  // namespace prunekit
