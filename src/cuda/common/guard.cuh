// The metadata guard of every CUDA call (issue 13): cu_seqlens is data on the device, so the
// host cannot check it without a synchronisation. Instead, each varlen call starts with one
// small kernel that checks cu_seqlens against total and max_seqlen and writes a SAFE copy into
// the call's workspace; every other kernel of the call reads only that copy. A valid
// cu_seqlens is copied unchanged; an invalid one becomes all zeros (every sequence empty), so
// no kernel can index outside the caller's buffers whatever the values were. The faults are
// recorded in a workspace word and in the caller's status words (flashmsa.h,
// FLASHMSA_STATUS_WORDS), and the call ends with a poison kernel that fills every output with
// NaN (indices with INT32_MIN) when that word is set; on valid metadata it returns at once.
// Cost: two launches of a few microseconds per call (docs/design.md has the measurement).
//
// CuTe-free on purpose: backend.cu's dispatch code and the guard's own TU include it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace flashmsa::cuda::guard {

// What a faulting call records in the caller's status words (flashmsa.h repeats these values;
// backend.cu static_asserts that they agree).
enum Fault : int32_t {
  kFirstNotZero = 1,    // cu_seqlens[0] != 0
  kNegative = 2,        // a value < 0
  kDecreasing = 4,      // cu_seqlens[b + 1] < cu_seqlens[b]
  kAboveTotal = 8,      // a value > total
  kLastNotTotal = 16,   // cu_seqlens[B] != total
  kAboveMaxSeqlen = 32,  // a length > max_seqlen
  kSegments = 64         // query segments (cu_seqlens_q, q_origin) that do not fit the key sequences
};
enum Word : int {
  kFaults = 0,   // OR of Fault bits over every faulting call
  kOps = 1,      // OR of Op bits of the faulting calls
  kCalls = 2,    // number of faulting calls
  kFirstPos = 3, // 1 + the first faulting position b of the first faulting call (0: none)
  kValue = 4,    // cu_seqlens[b] there
  kNext = 5,     // cu_seqlens[b + 1] there (0 when b = B)
  kTotal = 6,    // total of that call (clamped to INT32_MAX)
  kMaxSeqlen = 7,  // max_seqlen of that call (clamped to INT32_MAX)
  kWords = 8
};
enum Op : int32_t { kSelect = 1, kFwd = 2, kBwd = 4 };

// Workspace of the guard: the fault word, the safe copy of cu_seqlens [B + 1], and with query segments
// the safe copies of cu_seqlens_q [S + 1] and q_origin [S, 2] (contiguous).
size_t workspace(int batch, int segments = -1);

struct CheckArgs {
  const int32_t* cu = nullptr;  // the caller's cu_seqlens (device)
  int64_t cu_stride = 1;
  int batch = 0;
  int64_t total = 0, max_seqlen = 0;
  int32_t* status = nullptr;  // the caller's status words (device or mapped host memory), or null
  int32_t op = 0;
  // query segments (segments < 0: none): checked against the key sequences of cu_seqlens
  const int32_t* cuq = nullptr;
  const int32_t* origin = nullptr;
  int64_t cuq_stride = 1, origin_stride0 = 2, origin_stride1 = 1;
  int segments = -1;
  int64_t total_q = 0, max_seqlen_q = 0;
};
struct Safe {
  const int32_t* cu = nullptr;
  const int32_t* cuq = nullptr;     // [S + 1], with segments
  const int32_t* origin = nullptr;  // [S, 2] contiguous, with segments
};
// Launches the check into ws (workspace(batch, segments) bytes); returns the safe copies.
Safe launch_check(const CheckArgs& a, void* ws, cudaStream_t st);
// The fault word in ws (the poison kernel's switch).
const int32_t* fault_word(const void* ws);

// One output to poison: element (i0, i1, i2) at ptr + (i0 * s0 + i1 * s1 + i2) * bytes.
struct Out {
  void* ptr = nullptr;
  int64_t n0 = 1, n1 = 1, n2 = 1, s0 = 0, s1 = 0;  // a scalar (rank 0) is one element
  int bytes = 4;
  uint32_t pattern = 0;
};
constexpr int kMaxOuts = 8;
struct PoisonArgs {
  const int32_t* fault = nullptr;
  int n = 0;
  Out outs[kMaxOuts];
  void add(const Out& o) {
    if (o.ptr != nullptr && o.n0 * o.n1 * o.n2 > 0) outs[n++] = o;
  }
};
// Fills every listed output with its pattern when *fault != 0; returns at once otherwise.
void launch_poison(const PoisonArgs& a, cudaStream_t st);

// NaN bit patterns by element size (bf16 / fp16 differ) and the indices' poison.
constexpr uint32_t kNanBf16 = 0x7FC0u, kNanFp16 = 0x7E00u, kNanFp32 = 0x7FC00000u, kPoisonIndex = 0x80000000u;

}  // namespace flashmsa::cuda::guard
