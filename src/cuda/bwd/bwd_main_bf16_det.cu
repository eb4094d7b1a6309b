#include "cuda/bwd/bwd_kernel.cuh"
namespace flashmsa::cuda::attn_bwd {
template void launch_main<cutlass::bfloat16_t, true>(const MainParams<cutlass::bfloat16_t>&, int, cudaStream_t);
}
