#include "cuda/fwd/fwd_kernel.cuh"
namespace flashmsa::cuda::attn_fwd {
template void run<Dtype::kBf16, false, false>(const Args&, cudaStream_t);
}
