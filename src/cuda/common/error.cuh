// CUDA runtime error checks for the kernels' launch code. Deliberately free of the public
// header (flashmsa.h) and the API's validation header: a kernel's translation unit then does
// not recompile when the ABI or the argument checks change.
#pragma once

#include <cuda_runtime.h>

namespace flashmsa::cuda {

// Throws the library's DEVICE error ("CUDA error: <text> at <expr>"); defined in backend.cu.
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr);

}  // namespace flashmsa::cuda

#define FLASHMSA_CUDA_CHECK(expr)                                          \
  do {                                                                     \
    cudaError_t err_ = (expr);                                             \
    if (err_ != cudaSuccess) ::flashmsa::cuda::throw_cuda_error(err_, #expr); \
  } while (0)
