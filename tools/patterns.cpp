#include "patterns.hpp"

#include <algorithm>
#include <cmath>
#include <thread>

namespace flashmsa::cli {

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
}  // namespace

Rng::Rng(uint64_t seed, uint64_t stream)
    : gen_(splitmix64(splitmix64(seed) ^ (stream * 0xd1b54a32d192ed03ULL))) {}

double Rng::uniform() {
  // (k + 0.5) / 2^53 with k in [0, 2^53): never 0, never 1.
  const uint64_t k = gen_() >> 11;
  return (double(k) + 0.5) * 0x1.0p-53;
}

double Rng::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  const double u1 = uniform(), u2 = uniform();
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double a = 2.0 * M_PI * u2;
  spare_ = r * std::sin(a);
  has_spare_ = true;
  return r * std::cos(a);
}

uint64_t Rng::below(uint64_t n) {
  if (n <= 1) return 0;
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;  // multiples of n below limit
  uint64_t x;
  do x = gen_();
  while (x >= limit);
  return x % n;
}

const char* pattern_name(Pattern p) {
  return p == Pattern::Random ? "random" : p == Pattern::Clustered ? "clustered" : "trained";
}

bool parse_pattern(const std::string& s, Pattern* out) {
  if (s == "random") *out = Pattern::Random;
  else if (s == "clustered") *out = Pattern::Clustered;
  else if (s == "trained") *out = Pattern::Trained;
  else return false;
  return true;
}

std::vector<double> normal_values(Rng& rng, size_t n) {
  std::vector<double> v(n);
  for (double& x : v) x = rng.normal();
  return v;
}

std::vector<double> normal_values(uint64_t seed, uint64_t stream, size_t n) {
  constexpr size_t kChunk = size_t(1) << 20;
  std::vector<double> v(n);
  const size_t chunks = (n + kChunk - 1) / kChunk;
  const size_t threads = std::max<size_t>(1, std::min<size_t>(chunks, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (size_t w = 0; w < threads; ++w)
    pool.emplace_back([&, w] {
      for (size_t c = w; c < chunks; c += threads) {
        Rng r(seed, stream * 0x100000001b3ULL + c);
        for (size_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) v[i] = r.normal();
      }
    });
  for (auto& t : pool) t.join();
  return v;
}

std::vector<int64_t> sample_distinct(Rng& rng, int64_t n, int64_t k) {
  k = std::min(k, n);
  std::vector<int64_t> pool(size_t(std::max<int64_t>(n, 0)));
  for (int64_t i = 0; i < n; ++i) pool[size_t(i)] = i;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t j = i + int64_t(rng.below(uint64_t(n - i)));
    std::swap(pool[size_t(i)], pool[size_t(j)]);
  }
  pool.resize(size_t(k));
  std::sort(pool.begin(), pool.end());
  return pool;
}

namespace {
// n target blocks before query block qb and each one's partner (the block before it with probability p_pair, else
// itself), appended to out: 2n ids.
void draw_targets(Rng& rng, int64_t qb, int n, std::vector<int64_t>& out) {
  const TrainedParams& p = kTrained;
  for (int i = 0; i < n; ++i) {
    const double u = std::pow(rng.uniform(), p.gamma);
    const int64_t b = std::max<int64_t>(0, qb - std::max<int64_t>(1, std::llround(u * double(qb))));
    out.push_back(b);
    out.push_back(rng.uniform() < p.p_pair ? std::max<int64_t>(0, b - 1) : b);
  }
}

// The trained pattern of one sequence (tokens s0 .. s0 + len) into r.
void draw_trained(ProxyInputs& r, int64_t s0, int64_t len, int Hp, int Hpk, int Dp, uint64_t seed, uint64_t seq) {
  const TrainedParams& p = kTrained;
  const int64_t nb = (len + 127) / 128;
  Rng rng(seed, kStreamProxy * 0x10000ULL + 2 * seq);
  const std::vector<double> c = normal_values(rng, size_t(Hpk) * nb * Dp);  // [Hpk][nb][Dp]
  auto dir = [&](int hk, int64_t b) { return c.data() + (size_t(hk) * nb + b) * Dp; };
  for (int64_t u = 0; u < len; ++u)
    for (int hk = 0; hk < Hpk; ++hk) {
      double* row = r.kp.data() + (size_t(s0 + u) * Hpk + hk) * Dp;
      const double* cv = dir(hk, u / 128);
      for (int d = 0; d < Dp; ++d) row[d] = cv[d] + p.key_noise * rng.normal();
    }
  // the span and sub-span draws (serial: a span's tokens share them), then each token's own (threads over chunks
  // of tokens, each chunk its own stream: the same numbers for any thread count)
  const int64_t nspan = (len + p.span - 1) / p.span, nsub = (len + p.sub - 1) / p.sub;
  std::vector<int64_t> shared, spans, subs;
  for (int64_t s = 0; s < nspan; ++s) draw_targets(rng, s * p.span / 128, p.n_shared, shared);
  for (int h = 0; h < Hp; ++h) {
    for (int64_t s = 0; s < nspan; ++s) draw_targets(rng, s * p.span / 128, p.n_span, spans);
    for (int64_t s = 0; s < nsub; ++s) draw_targets(rng, s * p.sub / 128, p.n_sub, subs);
  }
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (len + kChunk - 1) / kChunk;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(chunks, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < threads; ++w)
    pool.emplace_back([&, w] {
      std::vector<int64_t> tok;
      std::vector<double> acc(static_cast<size_t>(Dp));
      for (int64_t ch = w; ch < chunks; ch += threads) {
        Rng tr(seed, kStreamProxy * 0x10000ULL + 2 * seq + 1 + 0x100000000ULL * uint64_t(ch + 1));
        for (int64_t i = ch * kChunk; i < std::min(len, (ch + 1) * kChunk); ++i)
          for (int h = 0; h < Hp; ++h) {
            const int hk = h * Hpk / Hp;
            std::fill(acc.begin(), acc.end(), 0.0);
            auto add = [&](const int64_t* ids, int64_t n, double wgt) {
              for (int64_t x = 0; x < n; ++x) {
                const double* cv = dir(hk, ids[x]);
                for (int d = 0; d < Dp; ++d) acc[size_t(d)] += wgt * cv[d];
              }
            };
            const int64_t span = i / p.span, sb = i / p.sub;
            add(shared.data() + span * 2 * p.n_shared, 2 * p.n_shared, 1.0);
            add(spans.data() + (size_t(h) * nspan + span) * 2 * p.n_span, 2 * p.n_span, 1.0);
            add(subs.data() + (size_t(h) * nsub + sb) * 2 * p.n_sub, 2 * p.n_sub, 1.0);
            tok.clear();
            draw_targets(tr, i / 128, p.n_tok, tok);
            add(tok.data(), int64_t(tok.size()), p.w_tok);
            double* row = r.qp.data() + (size_t(s0 + i) * Hp + h) * Dp;
            for (int d = 0; d < Dp; ++d) row[d] = acc[size_t(d)] + p.query_noise * tr.normal();
          }
      }
    });
  for (auto& t : pool) t.join();
}
}  // namespace

ProxyInputs draw_proxy(Pattern pattern, const std::vector<int64_t>& cu, int Hp, int Hpk, int Dp,
                       uint64_t seed) {
  const int64_t total = cu.empty() ? 0 : cu.back();
  ProxyInputs r;
  if (pattern == Pattern::Trained) {
    r.qp.assign(size_t(total) * Hp * Dp, 0.0);
    r.kp.assign(size_t(total) * Hpk * Dp, 0.0);
    for (size_t b = 0; b + 1 < cu.size(); ++b) draw_trained(r, cu[b], cu[b + 1] - cu[b], Hp, Hpk, Dp, seed, b);
    return r;
  }
  Rng rng(seed, kStreamProxy);
  if (pattern == Pattern::Random) {
    r.qp = normal_values(rng, size_t(total) * Hp * Dp);
    r.kp = normal_values(rng, size_t(total) * Hpk * Dp);
    return r;
  }
  r.qp.assign(size_t(total) * Hp * Dp, 0.0);
  r.kp.assign(size_t(total) * Hpk * Dp, 0.0);
  const std::vector<double> topics = normal_values(rng, size_t(kTopics) * Dp);
  auto topic = [&](int64_t c) { return topics.data() + c * Dp; };
  std::vector<int64_t> picks;
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    const int64_t s0 = cu[b], len = cu[b + 1] - cu[b];
    // keys: one topic per 512-token span, drawn independently for each proxy key head
    for (int c = 0; c < Hpk; ++c)
      for (int64_t span = 0; span * kKeySpan < len; ++span) {
        const double* tv = topic(int64_t(rng.below(kTopics)));
        const int64_t hi = std::min(len, (span + 1) * kKeySpan);
        for (int64_t u = span * kKeySpan; u < hi; ++u) {
          double* row = r.kp.data() + ((s0 + u) * Hpk + c) * Dp;
          for (int d = 0; d < Dp; ++d) row[d] = tv[d] + kTopicNoise * rng.normal();
        }
      }
    // queries: 3 distinct topics per 128-token span, for each proxy head
    for (int p = 0; p < Hp; ++p)
      for (int64_t span = 0; span * kQuerySpan < len; ++span) {
        picks = sample_distinct(rng, kTopics, kTopicsPerQuery);
        const int64_t hi = std::min(len, (span + 1) * kQuerySpan);
        for (int64_t i = span * kQuerySpan; i < hi; ++i) {
          double* row = r.qp.data() + ((s0 + i) * Hp + p) * Dp;
          for (int d = 0; d < Dp; ++d) {
            double s = 0;
            for (int64_t c : picks) s += topic(c)[d];
            row[d] = s + kTopicNoise * rng.normal();
          }
        }
      }
  }
  return r;
}

}  // namespace flashmsa::cli
