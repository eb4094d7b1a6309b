#include "cuda/bwd/kl_kernel.cuh"
namespace flashmsa::cuda::attn_bwd {
template void launch_kl<cutlass::half_t, false>(const KlParams<cutlass::half_t>&, cudaStream_t);
}
