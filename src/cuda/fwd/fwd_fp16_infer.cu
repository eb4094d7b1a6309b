#include "cuda/fwd/fwd_kernel.cuh"
namespace flashmsa::cuda::attn_fwd {
template void launch<cutlass::half_t, true>(const Params<cutlass::half_t>&, cudaStream_t);
}
