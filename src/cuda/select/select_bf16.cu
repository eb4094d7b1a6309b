#include "cuda/select/select_kernel.cuh"
namespace flashmsa::cuda::selection {
template void launch<cutlass::bfloat16_t>(const Params<cutlass::bfloat16_t>&, cudaStream_t);
}
