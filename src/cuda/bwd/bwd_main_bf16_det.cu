#include "cuda/bwd/bwd_kernel.cuh"
namespace flashmsa::cuda::attn_bwd {
template void run_main<Dtype::kBf16, true>(const MainArgs&, int, cudaStream_t);
}
