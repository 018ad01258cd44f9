// __half instantiations of the BSR tensor-core matmul kernels for N tiles of 32 (see bsr_mm.cuh).
#include "bsr_mm.cuh"

namespace prunekit_structured {
template void dispatch_rc<__half, 32>(int, int, const BsrArgs&, int, cudaStream_t);
}
