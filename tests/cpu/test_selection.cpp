// Selection (flashmsa_select, and the selection of a SPARSE flashmsa_fwd) against a brute-force
// enumeration written from SPEC.md section 1 "Selection":
//   z_p(i,u) = proxy_scale * <qp[i,p], kp[u,pk(p)]> for u <= i; S_p(i,j) = max over block j,
//   S_p(i,l(i)) = +inf; the topk blocks of highest score (ties: lower index), found here by a
//   full sort of every block; slots: non-local by descending score (ties: lower index first),
//   the local block in slot n-1, -1 after; proxy_lse = logsumexp of z over the selected u <= i.
#include "test_util.hpp"

namespace fmtest {
namespace {

struct BruteSelection {
  std::vector<double> indices;    // [Hp][total][topk]
  std::vector<double> proxy_lse;  // [Hp][total]
};

BruteSelection brute_select(const Config& c, const Tensor& qp_t, const Tensor& kp_t) {
  const std::vector<double> qp = qp_t.values(), kp = kp_t.values();
  const double ps = c.proxy_scale != 0 ? c.proxy_scale : 1.0 / std::sqrt(double(c.Dp));
  const int64_t T = c.total();
  BruteSelection r;
  r.indices.assign(size_t(c.Hp * T * c.topk), -1.0);
  r.proxy_lse.assign(size_t(c.Hp * T), 0.0);
  const auto cu = c.offsets();
  for (int p = 0; p < c.Hp; ++p) {
    const int pk = p / (c.Hp / c.Hpk);
    for (int b = 0; b < c.batch(); ++b) {
      const int64_t s0 = cu[size_t(b)];
      for (int64_t i = 0; i < c.lens[size_t(b)]; ++i) {
        std::vector<double> z(size_t(i + 1));
        for (int64_t u = 0; u <= i; ++u) {
          double dot = 0;
          for (int d = 0; d < c.Dp; ++d)
            dot += qp[size_t(tok_index(s0 + i, p, d, c.Hp, c.Dp))] *
                   kp[size_t(tok_index(s0 + u, pk, d, c.Hpk, c.Dp))];
          z[size_t(u)] = ps * dot;
        }
        const int64_t local = i / kBlock;
        std::vector<double> score(size_t(local + 1), -kInf);
        for (int64_t u = 0; u <= i; ++u)
          score[size_t(u / kBlock)] = std::max(score[size_t(u / kBlock)], z[size_t(u)]);
        score[size_t(local)] = kInf;
        std::vector<int64_t> order(size_t(local + 1));
        for (int64_t j = 0; j <= local; ++j) order[size_t(j)] = j;
        std::sort(order.begin(), order.end(), [&](int64_t a, int64_t bb) {
          if (score[size_t(a)] != score[size_t(bb)]) return score[size_t(a)] > score[size_t(bb)];
          return a < bb;
        });
        const int64_t n = std::min<int64_t>(c.topk, local + 1);
        // order[0] is the local block (+inf); the others follow by descending score
        std::vector<int64_t> slots(order.begin() + 1, order.begin() + n);
        slots.push_back(local);
        double* row = r.indices.data() + (p * T + s0 + i) * c.topk;
        for (size_t s = 0; s < slots.size(); ++s) row[s] = double(slots[s]);
        // logsumexp over the selected keys
        double m = -kInf, sum = 0;
        for (int64_t j : slots)
          for (int64_t u = j * kBlock; u <= std::min(i, j * kBlock + kBlock - 1); ++u) m = std::max(m, z[size_t(u)]);
        for (int64_t j : slots)
          for (int64_t u = j * kBlock; u <= std::min(i, j * kBlock + kBlock - 1); ++u) sum += std::exp(z[size_t(u)] - m);
        r.proxy_lse[size_t(p * T + s0 + i)] = m + std::log(sum);
      }
    }
  }
  return r;
}

// Compares indices row by row and names the first differing (head, token, slot).
::testing::AssertionResult same_indices(const Config& c, const Tensor& got,
                                        const std::vector<double>& want) {
  const int64_t T = c.total();
  for (int p = 0; p < c.Hp; ++p)
    for (int64_t t = 0; t < T; ++t)
      for (int s = 0; s < c.topk; ++s) {
        const int64_t i = (p * T + t) * c.topk + s;
        if (got.get(i) != want[size_t(i)])
          return ::testing::AssertionFailure()
                 << "head " << p << ", token " << t << ", slot " << s << ": got " << got.get(i)
                 << ", expected " << want[size_t(i)];
      }
  return ::testing::AssertionSuccess();
}

enum class Keys { Random, AllEqual, DuplicatedBlocks, SmallIntegers };

struct SelCase {
  std::string name;
  int topk;
  Keys keys;
};
std::ostream& operator<<(std::ostream& os, const SelCase& c) { return os << c.name; }

Config selection_config(int topk) {
  Config c;
  c.lens = {1, 127, 128, 0, 129, 300, 2200};  // 2200: 18 blocks, so topk 16 is selective
  c.Hq = 4;
  c.Hkv = 1;
  c.Hp = 4;
  c.Hpk = 2;
  c.Dp = 8;
  c.topk = topk;
  return c;
}

// Proxy keys with exact ties in the block scores.
void make_keys(Config& c, Keys kind, Inputs& in, Rng& rng) {
  const auto cu = c.offsets();
  Tensor& kp = in.kp;
  auto copy_token = [&](int64_t dst, int64_t src) {
    for (int h = 0; h < c.Hpk; ++h)
      for (int d = 0; d < c.Dp; ++d)
        kp.set(tok_index(dst, h, d, c.Hpk, c.Dp), kp.get(tok_index(src, h, d, c.Hpk, c.Dp)));
  };
  switch (kind) {
    case Keys::Random: break;
    case Keys::AllEqual:  // every key of every sequence equals token 0's: all scores tie
      for (int64_t t = 1; t < c.total(); ++t) copy_token(t, 0);
      break;
    case Keys::DuplicatedBlocks:  // block j is a copy of block j % 3 of its sequence
      for (int b = 0; b < c.batch(); ++b)
        for (int64_t u = 3 * kBlock; u < c.lens[size_t(b)]; ++u)
          copy_token(cu[size_t(b)] + u, cu[size_t(b)] + (u / kBlock % 3) * kBlock + u % kBlock);
      break;
    case Keys::SmallIntegers:  // z are small integers, exact in any summation order
      c.proxy_scale = 1.0;
      for (Tensor* t : {&in.qp, &in.kp})
        for (int64_t i = 0; i < t->numel(); ++i) t->set(i, double(rng.integer(-1, 1)));
      break;
  }
}

class Selection : public SeededParamTest<SelCase> {};

TEST_P(Selection, MatchesBruteForce) {
  Config c = selection_config(GetParam().topk);
  Inputs in = make_inputs(c, rng);
  make_keys(c, GetParam().keys, in, rng);
  const SelectResult sel = run_select(c, in);
  ASSERT_EQ(sel.status, FLASHMSA_SUCCESS);
  EXPECT_TRUE(fully_written(sel.indices));
  EXPECT_TRUE(fully_written(sel.proxy_lse));
  const BruteSelection want = brute_select(c, in.qp, in.kp);
  EXPECT_TRUE(same_indices(c, sel.indices, want.indices));
  EXPECT_TRUE(all_close(sel.proxy_lse.values(), want.proxy_lse, 1e-12));
}

std::vector<SelCase> sel_cases() {
  std::vector<SelCase> v;
  const std::pair<const char*, Keys> kinds[] = {{"Random", Keys::Random},
                                                {"AllEqual", Keys::AllEqual},
                                                {"DuplicatedBlocks", Keys::DuplicatedBlocks},
                                                {"SmallIntegers", Keys::SmallIntegers}};
  for (int topk : {1, 2, 16})
    for (const auto& k : kinds) v.push_back({std::string(k.first) + "_topk" + std::to_string(topk), topk, k.second});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Fp64, Selection, ::testing::ValuesIn(sel_cases()),
                         [](const ::testing::TestParamInfo<SelCase>& i) { return i.param.name; });

class SelectionApi : public SeededTest {};

// The selection written by a SPARSE forward is the one flashmsa_select computes, and its
// proxy_lse is the same log-normaliser.
TEST_F(SelectionApi, ForwardSelectionEqualsSelect) {
  for (int topk : {1, 3}) {
    Config c = selection_config(topk);
    c.lens = {300, 1, 129, 600};
    c.Hq = 8;
    c.Hkv = 2;
    Inputs in = make_inputs(c, rng);
    const SelectResult sel = run_select(c, in);
    const FwdResult f = run_fwd(c, in);
    EXPECT_TRUE(all_equal(f.indices, sel.indices)) << "topk " << topk;
    EXPECT_TRUE(all_close(f.proxy_lse, sel.proxy_lse, 1e-12)) << "topk " << topk;
    const BruteSelection want = brute_select(c, in.qp, in.kp);
    EXPECT_TRUE(same_indices(c, f.indices, want.indices)) << "topk " << topk;
  }
}

// Batched [B, S, H, Dp] selection equals the varlen one (indices keep [Hp, B*S, topk]).
TEST_F(SelectionApi, BatchedEqualsVarlen) {
  Config c = selection_config(2);
  c.lens = {257, 257, 257};
  Inputs in = make_inputs(c, rng);
  Config cb = c;
  cb.batched = true;
  const Inputs inb = relayout(in, cb);
  const SelectResult a = run_select(c, in), b = run_select(cb, inb);
  EXPECT_TRUE(all_equal(b.indices, a.indices));
  EXPECT_TRUE(all_close(b.proxy_lse, a.proxy_lse, 1e-12));
  EXPECT_TRUE(same_indices(c, a.indices, brute_select(c, in.qp, in.kp).indices));
}

// The scale is applied: with a large proxy_scale the selection is unchanged (max-pooling is
// monotone) but proxy_lse is the brute-force value at that scale.
TEST_F(SelectionApi, ExplicitProxyScale) {
  Config c = selection_config(2);
  c.lens = {400};
  c.proxy_scale = 3.5;
  Inputs in = make_inputs(c, rng);
  const SelectResult sel = run_select(c, in);
  const BruteSelection want = brute_select(c, in.qp, in.kp);
  EXPECT_TRUE(same_indices(c, sel.indices, want.indices));
  EXPECT_TRUE(all_close(sel.proxy_lse.values(), want.proxy_lse, 1e-12));
}

}  // namespace
}  // namespace fmtest
