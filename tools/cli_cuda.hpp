// The main job's check of CUDA runtime calls (only where the runtime is built in): a failure
// throws flashmsa::Error (DEVICE) naming the call.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "flashmsa/flashmsa.hpp"

namespace flashmsa::cli::dev {

inline void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw flashmsa::Error(FLASHMSA_ERROR_DEVICE, std::string("flashmsa run: ") + what + ": " +
                                                     cudaGetErrorString(e));
}

}  // namespace flashmsa::cli::dev
