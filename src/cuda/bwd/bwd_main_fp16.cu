#include "cuda/bwd/bwd_kernel.cuh"
namespace flashmsa::cuda::attn_bwd {
template void launch_main<cutlass::half_t, false>(const MainParams<cutlass::half_t>&, int, cudaStream_t);
}
