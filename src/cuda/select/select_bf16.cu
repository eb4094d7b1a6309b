#include "cuda/select/select_kernel.cuh"
namespace flashmsa::cuda::selection {
template void run<Dtype::kBf16>(const Args&, cudaStream_t, const Fp8Scales&);
}
