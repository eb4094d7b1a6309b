#include "cuda/bwd/proxy_kernel.cuh"
namespace flashmsa::cuda::attn_bwd {
template void launch_proxy<cutlass::bfloat16_t, 16, true>(const ProxyParams<cutlass::bfloat16_t>&, cudaStream_t);
}
