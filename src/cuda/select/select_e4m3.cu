#include "cuda/select/select_kernel.cuh"
namespace flashmsa::cuda::selection {
template void run<Dtype::kE4m3>(const Args&, cudaStream_t, const Fp8Scales&);
}
