// Argument validation (SPEC section 2) and the normalised description of a call that the
// backends consume. Everything here looks at metadata only; checks that need the data
// (cu_seqlens values, index values) live in the backends (always on the CPU, opt-in on the GPU).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "flashmsa/flashmsa.h"

namespace flashmsa {

// Thrown by validation and the backends; turned into a status + message at the C boundary.
struct ApiError : std::runtime_error {
  flashmsa_status_t status;
  ApiError(flashmsa_status_t s, const std::string& m) : std::runtime_error(m), status(s) {}
};

// Limits of the metadata (docs/errors.md). Every head count, head dim and the batch size are
// narrowed to int, so they must fit one; max_seqlen bounds sequence lengths that cu_seqlens
// (int32) can express; a scale above kMaxScale makes logits that overflow fp32 (and lse, stored
// in fp32, infinite) for ordinary inputs.
constexpr int64_t kMaxInt = 2147483647;  // INT32_MAX
constexpr double kMaxScale = FLASHMSA_MAX_SCALE;

[[noreturn]] void fail(flashmsa_status_t status, const std::string& msg);
[[noreturn]] inline void invalid(const std::string& msg) {
  fail(FLASHMSA_ERROR_INVALID_ARGUMENT, msg);
}

inline bool present(const flashmsa_tensor_t& t) { return !(t.data == nullptr && t.ndim == 0); }

// Addressing of a per-token tensor ([total, H, X] or [B, S, H, X]) in elements:
// offset(b, t, h, x) = b * batch_corr + t * tok + h * head + x, t the global token index.
struct TokenLayout {
  int64_t batch_corr = 0, tok = 0, head = 0;
  int64_t offset(int b, int64_t t, int h) const { return b * batch_corr + t * tok + h * head; }
};

// Addressing of a per-head tensor ([H, total] or [H, total, K]).
struct HeadLayout {
  int64_t head = 0, tok = 0;
  int64_t offset(int h, int64_t t) const { return h * head + t * tok; }
};

struct Geometry {
  bool batched = false;
  int batch = 0;             // B
  int64_t seqlen = 0;        // S (batched only)
  int64_t total = 0;         // query rows (q, qp, out, lse, indices, ...)
  int64_t total_k = 0;       // key rows (k, v, kp): total, unless query segments are given
  int64_t max_seqlen = 0;    // batched: S
  bool segmented = false;    // query segments (cu_seqlens_q, q_origin) are given
  int segments = 0;          // S, with segmented
  int64_t max_seqlen_q = 0;  // with segmented: >= every segment's length; else max_seqlen
  int Hq = 0, Hkv = 0, Hp = 0, Hpk = 0, D = 0, Dp = 0;
  int topk = 0;
  double scale = 0, proxy_scale = 0;  // resolved
  bool has_proxy = false;
  bool fp8_selection = false;  // the selection ranks in e4m3 (flashmsa_selection_t FP8; SPARSE / select only)
  flashmsa_dtype_t dtype = FLASHMSA_DTYPE_BF16;
  flashmsa_device_type_t device = FLASHMSA_DEVICE_CPU;
  int device_id = 0;
};

// Validate and describe. fn names the entry point for messages.
Geometry validate_select(const flashmsa_select_args_t& a);
Geometry validate_fwd(const flashmsa_fwd_args_t& a);
Geometry validate_bwd(const flashmsa_bwd_args_t& a);

TokenLayout token_layout(const flashmsa_tensor_t& t, const Geometry& g);
HeadLayout head_layout(const flashmsa_tensor_t& t);

std::string shape_string(const flashmsa_tensor_t& t);

}  // namespace flashmsa
