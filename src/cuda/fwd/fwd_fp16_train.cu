#include "cuda/fwd/fwd_kernel.cuh"
namespace flashmsa::cuda::attn_fwd {
template void launch<cutlass::half_t, false>(const Params&, cudaStream_t);
}
