#include "cuda/bwd/kl_kernel.cuh"
namespace flashmsa::cuda::attn_bwd {
template void run_kl<Dtype::kBf16, false>(const KlArgs&, cudaStream_t);
}
