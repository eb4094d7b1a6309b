// The element type of a kernel instantiation as the CuTe-free dispatcher names it; the kernels'
// side maps it to the CUTLASS type (ElementOf in utils.cuh).
#pragma once

namespace flashmsa::cuda {

// kE4m3: the fp8 selection's quantised copies of qp and kp (select_e4m3.cu), no other kernel
enum class Dtype { kBf16, kFp16, kE4m3 };

}  // namespace flashmsa::cuda
