// Varlen / batched sequence addressing shared by the kernels and the dispatcher (CuTe-free; the
// host compiler sees __host__ / __device__ through cuda_runtime.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashmsa::cuda {

// A per-token tensor: element (b, t, h, x) at ptr + b * batch_corr + t * tok + h * head + x,
// t the global token index (see TokenLayout in api/validate.hpp).
template <class T>
struct TokenTensor {
  T* ptr = nullptr;
  int64_t tok = 0, head = 0, batch_corr = 0;
  // E: the element type when T is (const) void.
  template <class E = T>
  __host__ __device__ E* row(int b, int64_t t, int h) const {
    return static_cast<E*>(ptr) + (b * batch_corr + t * tok + h * head);
  }
};

// A per-head tensor [H, total(, K)].
template <class T>
struct HeadTensor {
  T* ptr = nullptr;
  int64_t head = 0, tok = 0;
  __host__ __device__ T* at(int h, int64_t t) const { return ptr + h * head + t * tok; }
};

struct Seqs {
  const int* cu_seqlens = nullptr;  // device, [B+1]; null for batched
  int64_t seqlen = 0;               // batched S
  int batch = 0;
  // Query segments (flashmsa.h, "Query segments"; the guard's safe copies), or null: one per sequence.
  const int* cuq = nullptr;      // [S+1]
  const int* qorigin = nullptr;  // [S, 2] contiguous: key sequence, first position
  int segments = 0;              // S, or batch without segments: the query units of the query-tile grids
  __device__ void get(int b, int64_t& start, int64_t& len) const {
    if (cu_seqlens) {
      start = cu_seqlens[b];
      len = cu_seqlens[b + 1] - start;
    } else {
      start = b * seqlen;
      len = seqlen;
    }
  }
};

// Query unit s (a segment, or sequence s without segments): its key sequence b (key rows s0 ..
// s0 + L), the query positions [lo, hi) it holds and the query row of position pos, qrow0 + pos
// (without segments qrow0 = s0: query rows are key rows).
struct QueryUnit {
  int b;
  int64_t s0, L, lo, hi, qrow0;
};
__device__ __forceinline__ QueryUnit query_unit(const Seqs& q, int s) {
  QueryUnit u;
  if (q.cuq) {
    u.b = q.qorigin[2 * s];
    q.get(u.b, u.s0, u.L);
    u.lo = q.qorigin[2 * s + 1];
    u.hi = u.lo + (q.cuq[s + 1] - q.cuq[s]);
    u.qrow0 = q.cuq[s] - u.lo;
  } else {
    u.b = s;
    q.get(s, u.s0, u.L);
    u.lo = 0;
    u.hi = u.L;
    u.qrow0 = u.s0;
  }
  return u;
}

// THE padded offset of varlen-padded per-token buffers (lse in log2, dpsum): sequence b starts
// at a multiple of `tile`, so a kernel may read a whole tile past a sequence's end. The tile has
// no default on purpose: the kernel that writes and the kernel that reads pass the same
// constant (kPadTile of the backward), and buffers are sized by padded_total() with it.
__host__ __device__ inline int64_t padded_offset(int64_t seq_start, int b, int tile) {
  return (seq_start + int64_t(b) * tile) / tile * tile;
}
__host__ __device__ inline int64_t padded_total(int64_t total, int batch, int tile) {
  return total + int64_t(batch) * tile;  // >= padded_offset(cu[B-1], B-1) + len(B-1) rounded up
}

}  // namespace flashmsa::cuda
