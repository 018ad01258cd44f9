// __nv_bfloat16 instantiations of the sm_90a wgmma BSR kernels for 16- and 32-row blocks, the roles swapped (see
// bsr_mm_wgmma.cuh, bsr_wgmma_t_kernel), the X-slab (XR) kernels.
#include "bsr_mm_wgmma.cuh"

namespace prunekit_structured {
namespace wgmma_bsr {
template void dispatch_rc_t<__nv_bfloat16, 1, true>(int, int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&, int, int, int,
                                     cudaStream_t);
template void dispatch_rc_t<__nv_bfloat16, 2, true>(int, int, const CUtensorMap&, const CUtensorMap&, const BsrArgs&, int, int, int,
                                     cudaStream_t);
}  // namespace wgmma_bsr
}  // namespace prunekit_structured
