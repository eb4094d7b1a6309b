#include "cli_stats.hpp"

#include <algorithm>
#include <limits>

#include "cli_device.hpp"
#include "cli_util.hpp"
#include "patterns.hpp"

namespace flashmsa::cli {

namespace {

// Distinct valid blocks of each 128-query tile (per sequence and proxy head) over topk, mean;
// and the mean number of valid slots per (token, proxy head).
void selection_stats(const Config& c, const int32_t* idx, Stats& s) {
  double tiles = 0, union_sum = 0, slots = 0;
  std::vector<int64_t> stamp;
  int64_t stamp_id = 0;
  for (int b = 0; b < c.nseq(); ++b) {
    const int64_t s0 = c.cu[size_t(b)], len = c.cu[size_t(b) + 1] - s0;
    const int64_t nblocks = (len + kBlock - 1) / kBlock;
    stamp.assign(size_t(nblocks), -1);
    for (int p = 0; p < c.Hp; ++p)
      for (int64_t tile = 0; tile * kBlock < len; ++tile) {
        ++stamp_id;
        int64_t distinct = 0;
        for (int64_t i = tile * kBlock; i < std::min(len, (tile + 1) * kBlock); ++i) {
          const int32_t* row = idx + (int64_t(p) * c.total + s0 + i) * c.topk;
          for (int k = 0; k < c.topk; ++k) {
            const int32_t j = row[k];
            if (j < 0 || j >= nblocks) continue;
            slots += 1;
            if (stamp[size_t(j)] != stamp_id) {
              stamp[size_t(j)] = stamp_id;
              ++distinct;
            }
          }
        }
        tiles += 1;
        union_sum += double(distinct) / c.topk;
      }
  }
  s.union_factor = tiles > 0 ? union_sum / tiles : NAN;
  s.blocks_per_token = c.total > 0 ? slots / (double(c.Hp) * c.total) : NAN;
}

// fp64 dot product in four interleaved partial sums (the CPU backend's order, so the recall is
// the number that backend's fp64 arithmetic gives).
double dot4(const double* a, const double* b, int n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int d = 0;
  for (; d + 4 <= n; d += 4) {
    s0 += a[d] * b[d];
    s1 += a[d + 1] * b[d + 1];
    s2 += a[d + 2] * b[d + 2];
    s3 += a[d + 3] * b[d + 3];
  }
  for (; d < n; ++d) s0 += a[d] * b[d];
  return (s0 + s1) + (s2 + s3);
}

// log-sum-exp of x; -inf for an empty x.
double logsumexp(const std::vector<double>& x) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  if (x.empty()) return kNegInf;
  double m = kNegInf;
  for (double v : x) m = std::max(m, v);
  if (m == kNegInf) return kNegInf;
  double s = 0;
  for (double v : x) s += std::exp(v - m);
  return m + std::log(s);
}

}  // namespace

double host_mass_recall(const Config& c, const Tensors& t, const std::vector<int64_t>& rows) {
  const int64_t n = int64_t(rows.size()) * c.Hq;
  if (n == 0) return 1.0;
  const double scale = c.scale();
  const int32_t* indices = t.indices.i32();
  const std::vector<double> k = t.k.values();
  std::vector<double> rec(size_t(n), 0.0);
  parallel_items(n, [&](int64_t r) {
    const int64_t tok = rows[size_t(r / c.Hq)];
    const int h = int(r % c.Hq), kv = kv_of(c, h);
    const int64_t s0 = c.cu[size_t(seq_of(c, tok))];
    std::vector<double> qrow(size_t(c.D));
    for (int d = 0; d < c.D; ++d) qrow[size_t(d)] = t.q.get((tok * c.Hq + h) * c.D + d);
    std::vector<double> xd(size_t(tok - s0 + 1));
    for (int64_t u = s0; u <= tok; ++u) xd[size_t(u - s0)] = scale * dot4(qrow.data(), k.data() + (u * c.Hkv + kv) * c.D, c.D);
    const double lse_dense = logsumexp(xd);
    std::vector<int64_t> keys;
    key_set(c, indices, group_of(c, h), tok, keys);
    double mass = 0;
    for (int64_t u : keys) mass += std::exp(xd[size_t(u - s0)] - lse_dense);
    rec[size_t(r)] = mass;
  });
  double s = 0;
  for (double x : rec) s += x;
  return s / double(n);
}

std::vector<int64_t> sample_rows(const Config& c) {
  Rng r(c.seed, kStreamSample);
  return sample_distinct(r, c.total, kSampleTokens);
}

Stats compute_stats(const Config& c, const Tensors& t) {
  Stats s;
  progress("[stats] selection statistics and attention-mass recall ...\n");
  const double t0 = now_s();
  const int32_t* idx = c.sparse() ? t.indices.i32() : nullptr;
  s.pairs = count_pairs(c, idx);
  for (int b = 0; b < c.nseq(); ++b) {
    const double len = double(c.cu[size_t(b) + 1] - c.cu[size_t(b)]);
    s.dense_pairs += len * (len + 1) / 2 * c.Hq;
  }
  if (c.total > 0) {
    s.keys_per_token = s.pairs.main_pairs / (double(c.Hq) * c.total);
    s.density = s.dense_pairs > 0 ? s.pairs.main_pairs / s.dense_pairs : NAN;
  }
  s.kl = t.kl.get(0);
  if (c.sparse()) {
    selection_stats(c, idx, s);
    const double dense_work = s.dense_pairs * 2.0 * c.D;
    std::vector<int64_t> rows;
    if (dense_work <= kRecallFullBudget) {
      rows.resize(size_t(c.total));
      for (int64_t i = 0; i < c.total; ++i) rows[size_t(i)] = i;
      s.recall_rows = "all " + std::to_string(c.total) + " tokens x " + std::to_string(c.Hq) + " heads";
    } else {
      rows = sample_rows(c);
      s.recall_rows = "seeded sample of " + std::to_string(rows.size()) + " tokens x " +
                      std::to_string(c.Hq) + " heads";
    }
    s.recall_on_device = c.on_cuda;
    s.recall_row_ids = rows;
    s.recall = c.on_cuda ? dev::mass_recall(c, t, rows) : host_mass_recall(c, t, rows);
  } else {
    s.recall = 1.0;
    s.recall_rows = "dense causal set";
  }
  // every output fully written (outputs were poisoned with NaN before the run)
  for (const Buf* b : {&t.out, &t.lse, &t.indices, &t.proxy_lse, &t.kl, &t.dq, &t.dk, &t.dv,
                       &t.dqp, &t.dkp}) {
    if (!b->used) continue;
    int64_t bad = 0;
    if (b->device) {
      bad = dev::count_unwritten(*b);
    } else if (b->dtype == FLASHMSA_DTYPE_INT32) {
      for (int64_t i = 0; i < b->numel(); ++i) bad += b->i32()[i] < -1 ? 1 : 0;
    } else {
      for (int64_t i = 0; i < b->numel(); ++i) bad += std::isnan(b->get(i)) ? 1 : 0;
    }
    if (bad) {
      s.nonfinite_outputs += bad;
      s.nonfinite_names += (s.nonfinite_names.empty() ? "" : ", ") + b->name + " (" +
                           std::to_string(bad) + ")";
    }
  }
  progress("[stats] done in %.3f s\n", now_s() - t0);
  return s;
}

}  // namespace flashmsa::cli
