// The element type of a kernel instantiation as the CuTe-free dispatcher names it; the kernels'
// side maps it to the CUTLASS type (ElementOf in utils.cuh).
#pragma once

namespace flashmsa::cuda {

enum class Dtype { kBf16, kFp16 };

}  // namespace flashmsa::cuda
