// The backends behind the C ABI. Each entry point receives arguments that passed
// validate_*() and the Geometry it produced; it may still fail (data checks, device errors)
// but only before writing any output.
#pragma once

#include <cstddef>

#include "api/validate.hpp"

namespace flashmsa {

namespace cpu {
void select(const flashmsa_select_args_t& a, const Geometry& g);
void fwd(const flashmsa_fwd_args_t& a, const Geometry& g);
void bwd(const flashmsa_bwd_args_t& a, const Geometry& g);
}  // namespace cpu

namespace cuda {
// True when this build has the CUDA backend and a device is visible.
bool available();
// Throws NOT_SUPPORTED (naming the missing feature) when the CUDA backend cannot run g.
void check_supported(const Geometry& g, const char* fn);
size_t select_workspace(const flashmsa_select_args_t& a, const Geometry& g);
size_t fwd_workspace(const flashmsa_fwd_args_t& a, const Geometry& g);
size_t bwd_workspace(const flashmsa_bwd_args_t& a, const Geometry& g);
void select(const flashmsa_select_args_t& a, const Geometry& g, void* ws, size_t bytes);
void fwd(const flashmsa_fwd_args_t& a, const Geometry& g, void* ws, size_t bytes);
void bwd(const flashmsa_bwd_args_t& a, const Geometry& g, void* ws, size_t bytes);
// The status words of a CUDA call: device memory of the call's device, or page-locked host
// memory the device can write (INVALID_ARGUMENT otherwise).
void check_status_memory(const flashmsa_tensor_t& status, const Geometry& g, const char* fn);
// Copies FLASHMSA_STATUS_WORDS device words into `words` on `stream` (zeroing them after with
// FLASHMSA_CHECK_RESET) and synchronises; host words are read by the caller.
void read_status(const flashmsa_tensor_t& status, void* stream, int32_t flags, int32_t* words);
void synchronize(void* stream);
}  // namespace cuda

}  // namespace flashmsa
