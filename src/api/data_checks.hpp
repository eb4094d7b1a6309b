// Checks that need the data (SPEC section 2): always on the CPU backend, in the opt-in
// validation mode on the GPU (which copies the data to the host first, and so synchronises).
#pragma once

#include <cstdint>
#include <vector>

#include "api/validate.hpp"

namespace flashmsa {

// Sequence offsets (B+1) from a host copy of cu_seqlens (varlen) or from B, S (batched):
// cu[0] = 0, non-decreasing, cu[B] = total, every length <= max_seqlen.
std::vector<int64_t> checked_offsets(const int32_t* host_cu, int64_t stride, const Geometry& g,
                                     const char* fn);

// Query segments from host copies of cu_seqlens_q (S+1) and q_origin ([S, 2], strides in elements)
// against the key sequences cu: cuq[0] = 0, non-decreasing, cuq[S] = total (query rows), every
// length <= max_seqlen_q; 0 <= sequence < B, 0 <= position, position + length <= the sequence's length.
struct Segments {
  std::vector<int64_t> cuq, qpos;
  std::vector<int> qseq;
};
Segments checked_segments(const int32_t* host_cuq, int64_t cuq_stride, const int32_t* host_origin,
                          int64_t origin_stride0, int64_t origin_stride1, const std::vector<int64_t>& cu,
                          const Geometry& g, const char* fn);

// Index rows [Hp][total][topk] (dense host copy): a valid block must not repeat in a row;
// with validate, values outside [0, nblocks) other than -1 are errors too. Rows follow the key
// sequences cu, or the query segments seg when it has any.
void check_index_rows(const std::vector<int32_t>& idx, const std::vector<int64_t>& cu, int Hp,
                      int64_t total, int topk, bool validate, const char* fn,
                      const Segments* seg = nullptr);

}  // namespace flashmsa
