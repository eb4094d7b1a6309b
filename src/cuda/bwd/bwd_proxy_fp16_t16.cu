#include "cuda/bwd/proxy_kernel.cuh"
namespace flashmsa::cuda::attn_bwd {
template void run_proxy<Dtype::kFp16, 16, false>(const ProxyArgs&, cudaStream_t);
}
