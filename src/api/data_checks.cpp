#include "api/data_checks.hpp"

#include <string>

namespace flashmsa {

std::vector<int64_t> checked_offsets(const int32_t* host_cu, int64_t stride, const Geometry& g,
                                     const char* fn) {
  std::vector<int64_t> cu(size_t(g.batch) + 1);
  if (g.batched) {
    for (int b = 0; b <= g.batch; ++b) cu[size_t(b)] = int64_t(b) * g.seqlen;
    return cu;
  }
  for (int b = 0; b <= g.batch; ++b) cu[size_t(b)] = host_cu[int64_t(b) * stride];
  const std::string pre = std::string(fn) + ": cu_seqlens: ";
  if (cu[0] != 0) invalid(pre + "expected cu_seqlens[0] = 0, got " + std::to_string(cu[0]));
  for (int b = 0; b < g.batch; ++b) {
    if (cu[size_t(b) + 1] < cu[size_t(b)])
      invalid(pre + "expected non-decreasing values, got cu_seqlens[" + std::to_string(b + 1) +
              "] = " + std::to_string(cu[size_t(b) + 1]) + " < cu_seqlens[" + std::to_string(b) +
              "] = " + std::to_string(cu[size_t(b)]));
    const int64_t len = cu[size_t(b) + 1] - cu[size_t(b)];
    if (len > g.max_seqlen)
      invalid(std::string(fn) + ": max_seqlen: expected >= every sequence length, got " +
              std::to_string(g.max_seqlen) + " < length " + std::to_string(len) + " of sequence " +
              std::to_string(b));
  }
  if (cu[size_t(g.batch)] != g.total)
    invalid(pre + "expected the last value to equal total = " + std::to_string(g.total) +
            " (tokens in q), got " + std::to_string(cu[size_t(g.batch)]));
  return cu;
}

void check_index_rows(const std::vector<int32_t>& idx, const std::vector<int64_t>& cu, int Hp,
                      int64_t total, int topk, bool validate, const char* fn) {
  std::vector<int64_t> seen;
  const int B = int(cu.size()) - 1;
  for (int p = 0; p < Hp; ++p)
    for (int b = 0; b < B; ++b) {
      const int64_t len = cu[size_t(b) + 1] - cu[size_t(b)];
      const int64_t nblocks = (len + FLASHMSA_BLOCK_SIZE - 1) / FLASHMSA_BLOCK_SIZE;
      seen.assign(size_t(nblocks), -1);
      for (int64_t t = cu[size_t(b)]; t < cu[size_t(b) + 1]; ++t) {
        const int32_t* row = idx.data() + (size_t(p) * total + t) * topk;
        for (int s = 0; s < topk; ++s) {
          const int64_t j = row[s];
          if (j < 0 || j >= nblocks) {
            if (validate && j != -1)
              invalid(std::string(fn) + ": indices: value " + std::to_string(j) + " at (head " +
                      std::to_string(p) + ", token " + std::to_string(t) + ", slot " +
                      std::to_string(s) + ") is outside [0, " + std::to_string(nblocks) +
                      "), the blocks of sequence " + std::to_string(b) +
                      " (use -1 for an empty slot)");
            continue;
          }
          if (seen[size_t(j)] == t)
            invalid(std::string(fn) + ": indices: block " + std::to_string(j) + " repeats at (head " +
                    std::to_string(p) + ", token " + std::to_string(t) + ", slot " +
                    std::to_string(s) + "); blocks must not repeat in a row");
          seen[size_t(j)] = t;
        }
      }
    }
}

}  // namespace flashmsa
