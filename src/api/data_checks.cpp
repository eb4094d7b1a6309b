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
  if (cu[size_t(g.batch)] != g.total_k)
    invalid(pre + "expected the last value to equal total = " + std::to_string(g.total_k) +
            (g.segmented ? " (tokens in k)" : " (tokens in q)") + ", got " + std::to_string(cu[size_t(g.batch)]));
  return cu;
}

Segments checked_segments(const int32_t* host_cuq, int64_t cuq_stride, const int32_t* host_origin,
                          int64_t origin_stride0, int64_t origin_stride1, const std::vector<int64_t>& cu,
                          const Geometry& g, const char* fn) {
  Segments sg;
  const int S = g.segments;
  sg.cuq.resize(size_t(S) + 1);
  sg.qseq.resize(size_t(S));
  sg.qpos.resize(size_t(S));
  for (int s = 0; s <= S; ++s) sg.cuq[size_t(s)] = host_cuq[int64_t(s) * cuq_stride];
  const std::string pre = std::string(fn) + ": cu_seqlens_q: ";
  if (sg.cuq[0] != 0) invalid(pre + "expected cu_seqlens_q[0] = 0, got " + std::to_string(sg.cuq[0]));
  const int B = int(cu.size()) - 1;
  for (int s = 0; s < S; ++s) {
    const int64_t lo = sg.cuq[size_t(s)], hi = sg.cuq[size_t(s) + 1];
    if (hi < lo)
      invalid(pre + "expected non-decreasing values, got cu_seqlens_q[" + std::to_string(s + 1) + "] = " +
              std::to_string(hi) + " < cu_seqlens_q[" + std::to_string(s) + "] = " + std::to_string(lo));
    if (hi - lo > g.max_seqlen_q)
      invalid(std::string(fn) + ": max_seqlen_q: expected >= every segment length, got " +
              std::to_string(g.max_seqlen_q) + " < length " + std::to_string(hi - lo) + " of segment " +
              std::to_string(s));
    const int64_t b = host_origin[int64_t(s) * origin_stride0];
    const int64_t p0 = host_origin[int64_t(s) * origin_stride0 + origin_stride1];
    const std::string at = std::string(fn) + ": q_origin: segment " + std::to_string(s) + ": ";
    if (b < 0 || b >= B)
      invalid(at + "key sequence " + std::to_string(b) + " is outside [0, " + std::to_string(B) +
              ") (B from cu_seqlens)");
    const int64_t len_k = cu[size_t(b) + 1] - cu[size_t(b)];
    if (p0 < 0 || p0 + (hi - lo) > len_k)
      invalid(at + "positions [" + std::to_string(p0) + ", " + std::to_string(p0 + (hi - lo)) +
              ") of its " + std::to_string(hi - lo) + " queries are outside [0, " + std::to_string(len_k) +
              "), the positions of key sequence " + std::to_string(b));
    sg.qseq[size_t(s)] = int(b);
    sg.qpos[size_t(s)] = p0;
  }
  if (sg.cuq[size_t(S)] != g.total)
    invalid(pre + "expected the last value to equal total_q = " + std::to_string(g.total) +
            " (tokens in q), got " + std::to_string(sg.cuq[size_t(S)]));
  return sg;
}

void check_index_rows(const std::vector<int32_t>& idx, const std::vector<int64_t>& cu, int Hp,
                      int64_t total, int topk, bool validate, const char* fn, const Segments* seg) {
  std::vector<int64_t> seen;
  const bool segs = seg != nullptr && !seg->cuq.empty();
  const std::vector<int64_t>& rows = segs ? seg->cuq : cu;  // row ranges: segments or sequences
  const int R = int(rows.size()) - 1;
  for (int p = 0; p < Hp; ++p)
    for (int r = 0; r < R; ++r) {
      const int b = segs ? seg->qseq[size_t(r)] : r;
      const int64_t len = cu[size_t(b) + 1] - cu[size_t(b)];
      const int64_t nblocks = (len + FLASHMSA_BLOCK_SIZE - 1) / FLASHMSA_BLOCK_SIZE;
      seen.assign(size_t(nblocks), -1);
      for (int64_t t = rows[size_t(r)]; t < rows[size_t(r) + 1]; ++t) {
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
