#include "cli_keys.hpp"

#include <algorithm>

namespace flashmsa::cli {

int seq_of(const Config& c, int64_t t) {
  // last b with cu[b] <= t and cu[b+1] > t (skips empty sequences)
  auto it = std::upper_bound(c.cu.begin(), c.cu.end(), t);
  return int(it - c.cu.begin()) - 1;
}

namespace {
// The keys [lo, hi) of slot value j of token t (sequence start s0, nblocks blocks): the block's
// keys up to t; false for an empty slot.
bool slot_keys(int64_t j, int64_t s0, int64_t nblocks, int64_t t, int64_t& lo, int64_t& hi) {
  if (j < 0 || j >= nblocks) return false;
  lo = s0 + j * kBlock;
  hi = std::min(lo + kBlock, t + 1);
  return true;
}
}  // namespace

void key_set(const Config& c, const int32_t* indices, int p, int64_t t, std::vector<int64_t>& keys) {
  keys.clear();
  const int b = seq_of(c, t);
  const int64_t s0 = c.cu[size_t(b)], len = c.cu[size_t(b) + 1] - s0;
  if (!c.sparse()) {
    for (int64_t u = s0; u <= t; ++u) keys.push_back(u);
    return;
  }
  const int64_t nblocks = (len + kBlock - 1) / kBlock;
  const int32_t* row = indices + (int64_t(p) * c.total + t) * c.topk;
  for (int s = 0; s < c.topk; ++s) {
    int64_t lo, hi;
    if (slot_keys(row[s], s0, nblocks, t, lo, hi))
      for (int64_t u = lo; u < hi; ++u) keys.push_back(u);
  }
}

PairCounts count_pairs(const Config& c, const int32_t* indices) {
  PairCounts pc;
  const int G = c.Hq / c.Hp;
  for (int p = 0; p < c.Hp; ++p)
    for (int64_t t = 0; t < c.total; ++t) {
      const int b = seq_of(c, t);
      pc.proxy_pairs += double(t - c.cu[size_t(b)] + 1);
      if (!c.sparse()) {
        pc.main_pairs += double(t - c.cu[size_t(b)] + 1) * G;
      } else {  // |U_p(t)| without listing it: the causal part of each valid slot's block
        const int64_t s0 = c.cu[size_t(b)], len = c.cu[size_t(b) + 1] - s0;
        const int64_t nblocks = (len + kBlock - 1) / kBlock;
        const int32_t* row = indices + (int64_t(p) * c.total + t) * c.topk;
        int64_t n = 0, lo, hi;
        for (int s = 0; s < c.topk; ++s)
          if (slot_keys(row[s], s0, nblocks, t, lo, hi)) n += std::max<int64_t>(0, hi - lo);
        pc.main_pairs += double(n) * G;
      }
    }
  return pc;
}

}  // namespace flashmsa::cli
