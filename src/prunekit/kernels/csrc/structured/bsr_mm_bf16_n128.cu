// __nv_bfloat16 instantiations of the BSR tensor-core matmul kernels for N tiles of 128 (see bsr_mm.cuh).
#include "bsr_mm.cuh"

namespace prunekit_structured {
template void dispatch_rc<__nv_bfloat16, 128>(int, int, const BsrArgs&, int, cudaStream_t);
}
