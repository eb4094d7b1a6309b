// The tensors of one step of the main job: host copies in the library dtype, device copies on
// CUDA (through the CUDA runtime, when the library was built with it), the library's views of
// them, and the host memory the step needs.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cli_args.hpp"
#include "cli_dtype.hpp"
#include "flashmsa/flashmsa.h"

namespace flashmsa::cli {

// ---- device memory (the CUDA runtime only when the library was built with CUDA) -----------
// Every failure throws flashmsa::Error (DEVICE; NOT_SUPPORTED without the runtime).
namespace dev {
#ifdef FLASHMSA_WITH_CUDA
constexpr bool kRuntime = true;
#else
constexpr bool kRuntime = false;
#endif
void* alloc(size_t bytes);  // nullptr for 0 bytes
void release(void* p);
void upload(void* d, const void* h, size_t bytes);
void download(void* h, const void* d, size_t bytes);
void poison(void* d, size_t bytes);  // 0xff bytes (NaN, -1)
void sync();
}  // namespace dev

// ---- tensors -----------------------------------------------------------------------------

// One tensor of the step: its host copy (in the library dtype) and, on CUDA, its device copy.
struct Buf {
  enum Kind { kTokens, kOther };
  std::string name;
  flashmsa_dtype_t dtype = FLASHMSA_DTYPE_FP32;
  std::vector<int64_t> shape;  // the saved (varlen) layout
  Kind kind = kOther;
  bool used = false;
  bool output = false;
  std::vector<unsigned char> host;
  void* device = nullptr;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  size_t bytes() const { return size_t(numel()) * dtype_size(dtype); }
  void declare(const char* n, flashmsa_dtype_t t, std::vector<int64_t> s, Kind k, bool out) {
    name = n;
    dtype = t;
    shape = std::move(s);
    kind = k;
    used = true;
    output = out;
  }
  void allocate_host() { host.assign(bytes(), 0); }
  void poison_host() { std::memset(host.data(), 0xff, host.size()); }
  double get(int64_t i) const { return load_as_double(dtype, host.data(), i); }
  std::vector<double> values() const {
    std::vector<double> v(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) v[size_t(i)] = get(i);
    return v;
  }
  void assign(const std::vector<double>& v) {  // rounds to the dtype (RNE)
    allocate_host();
    for (int64_t i = 0; i < numel(); ++i) store_from_double(dtype, host.data(), i, v[size_t(i)]);
  }
  const int32_t* i32() const { return reinterpret_cast<const int32_t*>(host.data()); }
  int32_t* i32() { return reinterpret_cast<int32_t*>(host.data()); }
};

struct Tensors {
  Buf q, k, v, qp, kp, cu, dout, dlse, dkl;  // inputs
  Buf out, lse, indices, proxy_lse, kl, out_lo;  // forward (and selection) outputs
  Buf dq, dk, dv, dqp, dkp;                  // backward outputs

  std::vector<Buf*> all() {
    return {&q, &k, &v, &qp, &kp, &cu, &dout, &dlse, &dkl, &out, &lse, &indices, &proxy_lse,
            &kl, &out_lo, &dq, &dk, &dv, &dqp, &dkp};
  }
  std::vector<const Buf*> all() const {
    std::vector<const Buf*> r;
    for (Buf* b : const_cast<Tensors*>(this)->all()) r.push_back(b);
    return r;
  }
};

// Shapes and dtypes of every tensor of the step (no memory yet).
void declare(const Config& c, Tensors& t);

// Frees the device copies of t (idempotent).
void release_device(Tensors& t);

// The library's view of a buffer: host or device memory; [B, S, H, X] for per-token tensors of
// a batched call; absent when the tensor is not part of this step.
struct Views {
  const Config& c;
  bool device;
  void* probe = nullptr;  // metadata-only probe: every tensor points here

  flashmsa_tensor_t operator()(const Buf& b) const;
};

// Throws UsageError when the step (its tensors, the CPU backend's fp64 copies, --check's fp64
// run) needs more host memory than this process may use.
void check_host_memory(const Config& c);

}  // namespace flashmsa::cli
