// Built instead of src/cuda/ when nvcc is not found: the CUDA backend is absent.
#include "api/backends.hpp"

namespace flashmsa::cuda {

bool available() { return false; }
void check_supported(const Geometry&, const char* fn) {
  fail(FLASHMSA_ERROR_NOT_SUPPORTED, std::string(fn) + ": built without the CUDA backend");
}
size_t select_workspace(const flashmsa_select_args_t&, const Geometry&) { return 0; }
size_t fwd_workspace(const flashmsa_fwd_args_t&, const Geometry&) { return 0; }
size_t bwd_workspace(const flashmsa_bwd_args_t&, const Geometry&) { return 0; }
void select(const flashmsa_select_args_t&, const Geometry& g, void*, size_t) {
  check_supported(g, "flashmsa_select");
}
void fwd(const flashmsa_fwd_args_t&, const Geometry& g, void*, size_t) {
  check_supported(g, "flashmsa_fwd");
}
void bwd(const flashmsa_bwd_args_t&, const Geometry& g, void*, size_t) {
  check_supported(g, "flashmsa_bwd");
}
void check_status_memory(const flashmsa_tensor_t&, const Geometry& g, const char* fn) { check_supported(g, fn); }
void read_status(const flashmsa_tensor_t&, void*, int32_t, int32_t*) {
  fail(FLASHMSA_ERROR_NOT_SUPPORTED, "flashmsa_check_status: status words in device memory, but this flashmsa "
                                     "was built without its CUDA backend");
}
void synchronize(void*) {}

}  // namespace flashmsa::cuda
