// flashmsa — a thin C++ API over the C ABI (flashmsa.h): tensor views built from shapes,
// argument structs initialised to their defaults, and errors as exceptions.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashmsa/flashmsa.h"

namespace flashmsa {

// A failed call: its status and the library's message.
class Error : public std::runtime_error {
 public:
  Error(flashmsa_status_t status, const std::string& msg) : std::runtime_error(msg), status_(status) {}
  flashmsa_status_t status() const { return status_; }

 private:
  flashmsa_status_t status_;
};

inline void check(flashmsa_status_t s) {
  if (s != FLASHMSA_SUCCESS) throw Error(s, flashmsa_last_error());
}

// A contiguous (row-major) view of caller memory.
inline flashmsa_tensor_t view(void* data, flashmsa_dtype_t dtype, std::initializer_list<int64_t> shape,
                              flashmsa_device_type_t device = FLASHMSA_DEVICE_CPU, int device_id = 0) {
  flashmsa_tensor_t t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = int32_t(shape.size());
  t.device_type = device;
  t.device_id = device_id;
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

// The same view with explicit strides (in elements).
inline flashmsa_tensor_t view(void* data, flashmsa_dtype_t dtype, std::initializer_list<int64_t> shape,
                              std::initializer_list<int64_t> strides,
                              flashmsa_device_type_t device = FLASHMSA_DEVICE_CPU, int device_id = 0) {
  flashmsa_tensor_t t = view(data, dtype, shape, device, device_id);
  int i = 0;
  for (int64_t s : strides) t.strides[i++] = s;
  return t;
}

inline flashmsa_tensor_t none() {
  flashmsa_tensor_t t{};
  return t;
}

struct SelectArgs : flashmsa_select_args_t {
  SelectArgs() { flashmsa_select_args_init(this); }
};
struct FwdArgs : flashmsa_fwd_args_t {
  FwdArgs() { flashmsa_fwd_args_init(this); }
};
struct BwdArgs : flashmsa_bwd_args_t {
  BwdArgs() { flashmsa_bwd_args_init(this); }
};

inline size_t workspace_size(const flashmsa_select_args_t& a) {
  size_t n = 0;
  check(flashmsa_select_workspace_size(&a, &n));
  return n;
}
inline size_t workspace_size(const flashmsa_fwd_args_t& a) {
  size_t n = 0;
  check(flashmsa_fwd_workspace_size(&a, &n));
  return n;
}
inline size_t workspace_size(const flashmsa_bwd_args_t& a) {
  size_t n = 0;
  check(flashmsa_bwd_workspace_size(&a, &n));
  return n;
}

// The operations; throw flashmsa::Error on failure. The workspace is caller memory on the
// tensors' device (none is needed on the CPU).
inline void select(const flashmsa_select_args_t& a, void* ws = nullptr, size_t bytes = 0) {
  check(flashmsa_select(&a, ws, bytes));
}
inline void fwd(const flashmsa_fwd_args_t& a, void* ws = nullptr, size_t bytes = 0) {
  check(flashmsa_fwd(&a, ws, bytes));
}
inline void bwd(const flashmsa_bwd_args_t& a, void* ws = nullptr, size_t bytes = 0) {
  check(flashmsa_bwd(&a, ws, bytes));
}

// Throws flashmsa::Error (INVALID_ARGUMENT, naming the faults) when the status words of earlier
// CUDA calls hold a metadata fault, and clears them. Synchronises `stream` (flashmsa.h).
inline void check_status(const flashmsa_tensor_t& status, void* stream = nullptr) {
  check(flashmsa_check_status(&status, stream, FLASHMSA_CHECK_SYNC | FLASHMSA_CHECK_RESET, nullptr));
}

inline bool cuda_available() { return flashmsa_cuda_available() != 0; }

}  // namespace flashmsa
