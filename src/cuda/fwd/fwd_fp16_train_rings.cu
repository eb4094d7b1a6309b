#include "cuda/fwd/fwd_kernel.cuh"
namespace flashmsa::cuda::attn_fwd {
template void run<Dtype::kFp16, false, true>(const Args&, cudaStream_t);
}
