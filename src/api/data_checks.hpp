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

// Index rows [Hp][total][topk] (dense host copy): a valid block must not repeat in a row;
// with validate, values outside [0, nblocks) other than -1 are errors too.
void check_index_rows(const std::vector<int32_t>& idx, const std::vector<int64_t>& cu, int Hp,
                      int64_t total, int topk, bool validate, const char* fn);

}  // namespace flashmsa
