#include "cuda/fwd/fwd_kernel.cuh"
namespace flashmsa::cuda::attn_fwd {
template void launch<cutlass::bfloat16_t, false>(const Params<cutlass::bfloat16_t>&, cudaStream_t);
}
