#include "cuda/bwd/bwd_kernel.cuh"
namespace flashmsa::cuda::attn_bwd {
template void run_main<Dtype::kFp16, false>(const MainArgs&, int, cudaStream_t);
}
