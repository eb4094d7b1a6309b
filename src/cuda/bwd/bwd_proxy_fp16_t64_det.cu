#include "cuda/bwd/proxy_kernel.cuh"
namespace flashmsa::cuda::attn_bwd {
template void launch_proxy<cutlass::half_t, 64, true>(const ProxyParams<cutlass::half_t>&, cudaStream_t);
}
