// __half instantiations of the sm_90a wgmma BSR kernels (see bsr_mm_wgmma.cuh).
#include "bsr_mm_wgmma.cuh"

namespace prunekit_structured {
namespace wgmma_bsr {
template void dispatch_c<__half, 1>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&, int, cudaStream_t);
template void dispatch_c<__half, 2>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&, int, cudaStream_t);
}  // namespace wgmma_bsr
}  // namespace prunekit_structured
