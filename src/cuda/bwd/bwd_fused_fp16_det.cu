#include "cuda/bwd/fused_kernel.cuh"
namespace flashmsa::cuda::attn_bwd {
template void run_fused<Dtype::kFp16, true>(const FusedArgs&, cudaStream_t);
}
