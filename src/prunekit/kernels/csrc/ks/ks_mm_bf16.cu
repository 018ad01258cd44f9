// __nv_bfloat16 instantiation of the Kronecker-sparse tensor-core kernels (ks_mm.cuh), compiled as its own unit.
#include "ks_mm.cuh"

namespace prunekit_ks {
template void launch_tc<__nv_bfloat16>(const KsArgs&, int, int, int, int, cudaStream_t);
}  // namespace prunekit_ks
