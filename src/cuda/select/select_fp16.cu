#include "cuda/select/select_kernel.cuh"
namespace flashmsa::cuda::selection {
template void launch<cutlass::half_t>(const Params<cutlass::half_t>&, cudaStream_t);
}
