#include "cuda/bwd/kl_kernel.cuh"
namespace flashmsa::cuda::attn_bwd {
template void launch_kl<cutlass::bfloat16_t, true>(const KlParams<cutlass::bfloat16_t>&, cudaStream_t);
}
