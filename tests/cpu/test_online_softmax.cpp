// SPEC section 3 on the CPU: an emulation of the kernels' online softmax (blocks in slot order,
// fp32 running max and sum, P rounded to bf16 before P V, output rounded to bf16) shows why the
// training forward must use the exact running max. With the lazy rescale (threshold 8 in log2
// units) and the dominant key in the last block, the dominant key's P is exp2(delta) instead of
// exactly 1.0, and its bf16 rounding becomes a coherent gain error over the whole row; with the
// exact max both slot orders stay at the bf16 output floor. CI guards the mechanism here; the
// GPU suite measures the kernels themselves.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/dtype.hpp"

namespace {

constexpr int D = 128, kBlock = 128, kBlocks = 8, kKeys = kBlock * kBlocks, kRows = 384;
constexpr float kLog2e = 1.4426950408889634f;

float bf16(float x) { return float(flashmsa::round_to(FLASHMSA_DTYPE_BF16, double(x))); }

struct Row {
  std::vector<float> x;  // logits (already scaled), kKeys
  int dominant = 0;      // key index of the dominant key
};

// One row of the kernel: blocks in the given order, threshold 0 (exact) or 8 (lazy, log2).
std::vector<float> kernel_row(const Row& r, const std::vector<float>& v, const std::vector<int>& order,
                              float threshold) {
  float m = -INFINITY, l = 0.f;
  std::vector<float> o(D, 0.f);
  for (int blk : order) {
    float bm = -INFINITY;
    for (int u = blk * kBlock; u < (blk + 1) * kBlock; ++u) bm = std::max(bm, r.x[size_t(u)]);
    float m_new = std::max(m, bm);
    if (m != -INFINITY && (m_new - m) * kLog2e <= threshold) m_new = m;  // lazy: keep the stale max
    const float alpha = m == -INFINITY ? 0.f : std::exp2((m - m_new) * kLog2e);
    m = m_new;
    l *= alpha;
    for (float& e : o) e *= alpha;
    for (int u = blk * kBlock; u < (blk + 1) * kBlock; ++u) {
      const float p = std::exp2((r.x[size_t(u)] - m) * kLog2e);
      l += p;                      // the row sum takes the fp32 value
      const float pb = bf16(p);    // P V takes the bf16 value
      for (int d = 0; d < D; ++d) o[size_t(d)] += pb * v[size_t(u) * D + d];
    }
  }
  for (float& e : o) e = bf16(e / l);
  return o;
}

std::vector<double> reference_row(const Row& r, const std::vector<float>& v) {
  double m = -INFINITY, s = 0;
  for (float x : r.x) m = std::max(m, double(x));
  std::vector<double> o(D, 0.0);
  for (int u = 0; u < kKeys; ++u) {
    const double p = std::exp(double(r.x[size_t(u)]) - m);
    s += p;
    for (int d = 0; d < D; ++d) o[size_t(d)] += p * v[size_t(u) * D + d];
  }
  for (double& e : o) e /= s;
  return o;
}

// <out - ref, ref> / <ref, ref>
template <class T>
double row_gain(const std::vector<T>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (int d = 0; d < D; ++d) {
    num += (double(out[size_t(d)]) - ref[size_t(d)]) * ref[size_t(d)];
    den += ref[size_t(d)] * ref[size_t(d)];
  }
  return num / den;
}

double rms(const std::vector<double>& x) {
  double s = 0;
  for (double e : x) s += e * e;
  return std::sqrt(s / double(x.size()));
}

struct Result {
  double first, last, diff, floor;  // rms row gains: dominant first, dominant last, their difference; bf16(ref)
  bool bitwise_equal;
};

// Peaked rows: one key per row carries about half of the softmax mass.
Result run(float threshold, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> pick(0, kKeys - 1);
  std::vector<double> g_first, g_last, g_diff, g_floor;
  bool all_equal = true;
  for (int row = 0; row < kRows; ++row) {
    Row r;
    r.x.resize(kKeys);
    double others = 0;
    for (auto& e : r.x) {
      e = nd(rng);
      others += std::exp(double(e));
    }
    r.dominant = pick(rng);
    r.x[size_t(r.dominant)] = float(std::log(others));  // self-weight ~ 50 %
    std::vector<float> v(size_t(kKeys) * D);
    for (auto& e : v) e = bf16(nd(rng));
    const int dom_blk = r.dominant / kBlock;
    std::vector<int> first{dom_blk}, last;
    for (int b = 0; b < kBlocks; ++b)
      if (b != dom_blk) first.push_back(b), last.push_back(b);
    last.push_back(dom_blk);
    const auto ref = reference_row(r, v);
    const auto a = kernel_row(r, v, first, threshold), b = kernel_row(r, v, last, threshold);
    std::vector<double> diff(D), ref_b(D);
    for (int d = 0; d < D; ++d) {
      diff[size_t(d)] = double(b[size_t(d)]) - double(a[size_t(d)]) + ref[size_t(d)];
      ref_b[size_t(d)] = double(bf16(float(ref[size_t(d)])));
    }
    all_equal = all_equal && a == b;
    g_first.push_back(row_gain(a, ref));
    g_last.push_back(row_gain(b, ref));
    g_diff.push_back(row_gain(diff, ref));
    g_floor.push_back(row_gain(ref_b, ref));
  }
  return {rms(g_first), rms(g_last), rms(g_diff), rms(g_floor), all_equal};
}

uint64_t fresh_seed() { return std::random_device{}(); }

TEST(OnlineSoftmax, ExactRunningMaxIsOrderInvariant) {
  const uint64_t seed = fresh_seed();
  const Result r = run(0.f, seed);
  std::printf("    exact: row-gain rms first %.3e, last %.3e, difference %.3e, bf16 floor %.3e (seed %llu)\n",
              r.first, r.last, r.diff, r.floor, (unsigned long long)seed);
  EXPECT_FALSE(r.bitwise_equal) << "the two orders must round differently, or the test proves nothing";
  EXPECT_LT(r.diff, 2 * r.floor);
  EXPECT_LT(r.first, 2 * r.floor);
  EXPECT_LT(r.last, 2 * r.floor);
}

// The same criteria with the lazy threshold fail, by a clear margin, when the dominant key comes
// last: the test above can fail.
TEST(OnlineSoftmax, LazyRescaleFailsTheSameTest) {
  const uint64_t seed = fresh_seed();
  const Result r = run(8.f, seed);
  std::printf("    lazy: row-gain rms first %.3e, last %.3e (%.1fx the floor %.3e), difference %.3e (seed %llu)\n",
              r.first, r.last, r.last / r.floor, r.floor, r.diff, (unsigned long long)seed);
  EXPECT_LT(r.first, 2 * r.floor) << "dominant first: the max is exact from the start";
  EXPECT_GT(r.last, 3 * r.floor) << "dominant last with the stale max must show the coherent gain error";
  EXPECT_GT(r.diff, 3 * r.floor);
}

// ---- precise dpsum (out_lo), emulated -----------------------------------------------------
// dS_j = P_j (dP_j - dpsum) with dpsum = <dout, out>. On a peaked row (the self key carries ~80 %
// of the mass) dP_self - dpsum cancels, and dpsum from the bf16 output carries the output's
// rounding (2^-9 relative) into every dS of the row. The kernels' pipeline: P exact in fp32, dS
// rounded to bf16 for the dQ GEMM, dQ accumulated in fp32. Compared: dpsum from bf16(O), from
// bf16(O) + out_lo (out_lo = bf16(O - bf16(O))), and the ideal pipeline (exact dpsum, dS rounded
// once); dq rel-L2 against fp64 over all rows.
struct DpsumErrors {
  double plain, with_lo, ideal;
};

DpsumErrors run_dpsum(double self_weight, uint64_t seed) {
  constexpr int N = 1024, kDpsumRows = 48;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  double num[3] = {0, 0, 0}, den = 0;
  for (int row = 0; row < kDpsumRows; ++row) {
    std::vector<double> x(N), p(N), v(size_t(N) * D), k(size_t(N) * D), g(D);
    double others = 0;
    for (int j = 1; j < N; ++j) {
      x[size_t(j)] = nd(rng);
      others += std::exp(x[size_t(j)]);
    }
    x[0] = std::log(self_weight / (1 - self_weight) * others);  // key 0 is the query's own
    double m = -INFINITY, sum = 0;
    for (double e : x) m = std::max(m, e);
    for (int j = 0; j < N; ++j) sum += (p[size_t(j)] = std::exp(x[size_t(j)] - m));
    for (double& e : p) e /= sum;
    for (auto& e : v) e = bf16(float(nd(rng)));
    for (auto& e : k) e = bf16(float(nd(rng)));
    for (auto& e : g) e = bf16(float(nd(rng)));
    std::vector<double> o(D, 0.0);
    for (int j = 0; j < N; ++j)
      for (int d = 0; d < D; ++d) o[size_t(d)] += p[size_t(j)] * v[size_t(j) * D + d];
    double dpsum_exact = 0, dpsum_plain = 0, dpsum_lo = 0;
    for (int d = 0; d < D; ++d) {
      const double hi = bf16(float(o[size_t(d)])), lo = bf16(float(o[size_t(d)] - hi));
      dpsum_exact += g[size_t(d)] * o[size_t(d)];
      dpsum_plain += double(float(g[size_t(d)]) * float(hi));
      dpsum_lo += double(float(g[size_t(d)]) * (float(hi) + float(lo)));
    }
    std::vector<double> dq_exact(D, 0.0), dq[3] = {std::vector<double>(D, 0.0), std::vector<double>(D, 0.0),
                                                   std::vector<double>(D, 0.0)};
    for (int j = 0; j < N; ++j) {
      double dp = 0;
      for (int d = 0; d < D; ++d) dp += g[size_t(d)] * v[size_t(j) * D + d];
      const double ds_exact = p[size_t(j)] * (dp - dpsum_exact);
      const double ds[3] = {bf16(float(float(p[size_t(j)]) * (float(dp) - float(dpsum_plain)))),
                            bf16(float(float(p[size_t(j)]) * (float(dp) - float(dpsum_lo)))),
                            bf16(float(ds_exact))};
      for (int d = 0; d < D; ++d) {
        dq_exact[size_t(d)] += ds_exact * k[size_t(j) * D + d];
        for (int c = 0; c < 3; ++c) dq[c][size_t(d)] += ds[c] * k[size_t(j) * D + d];
      }
    }
    for (int d = 0; d < D; ++d) {
      den += dq_exact[size_t(d)] * dq_exact[size_t(d)];
      for (int c = 0; c < 3; ++c) {
        const double e = double(bf16(float(dq[c][size_t(d)]))) - dq_exact[size_t(d)];  // dq stored in bf16
        num[c] += e * e;
      }
    }
  }
  return {std::sqrt(num[0] / den), std::sqrt(num[1] / den), std::sqrt(num[2] / den)};
}

TEST(PreciseDpsum, OutLoRecoversTheIdealDqOnPeakedRows) {
  const uint64_t seed = fresh_seed();
  for (double w : {0.5, 0.8, 0.95}) {
    const DpsumErrors e = run_dpsum(w, seed);
    std::printf("    self-weight %.2f: dq rel-L2 plain %.3e, with out_lo %.3e (%.2fx), ideal %.3e (seed %llu)\n", w,
                e.plain, e.with_lo, e.with_lo / e.plain, e.ideal, (unsigned long long)seed);
    if (w >= 0.8) {
      EXPECT_LT(e.with_lo, 0.6 * e.plain) << "self-weight " << w;
    }
    EXPECT_LT(e.with_lo, 1.5 * e.ideal) << "self-weight " << w;
  }
}

}  // namespace
