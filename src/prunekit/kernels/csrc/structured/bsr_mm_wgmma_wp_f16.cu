// __half instantiations of the sm_90a wgmma BSR kernels for 64-row blocks, producer warp (WARP_PRODUCER; see
// bsr_mm_wgmma.cuh): a file of their own so that they compile in parallel with the others.
#include "bsr_mm_wgmma.cuh"

namespace prunekit_structured {
namespace wgmma_bsr {
template void dispatch_c<__half, 1, true>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&, int, int,
                                      cudaStream_t);
template void dispatch_c<__half, 2, true>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&, int, int,
                                      cudaStream_t);
template void dispatch_c<__half, 1, true, 64>(int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&, int,
                                          int, cudaStream_t);
}  // namespace wgmma_bsr
}  // namespace prunekit_structured
