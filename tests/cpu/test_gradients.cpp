// Finite-difference checks of flashmsa_bwd in fp64 (SPEC "Main backward", "Proxy training").
//
// The scalar checked is L = <dout, out> + <dlse, lse> (main inputs q, k, v; dlse optional)
// and L = g * kl (proxy inputs qp, kp). The main inputs get no gradient from kl (the teacher is
// detached), and qp, kp none from out. Central differences of L are taken per element
// (sum of dout * (out+ - out-), ...) so that the unchanged entries contribute exactly 0.
// The step is 1e-4: the kl is a mean over every (proxy head, token) row, so its rounding
// (~1e-17 absolute) limits a smaller step; at 1e-4 both the truncation and the rounding error
// stay near 1e-8 relative, well inside the 1e-6 tolerance.
// In SPARSE mode the selection is piecewise constant in qp, kp: a coordinate whose +-h
// forwards select different blocks is skipped (and must stay rare).
#include "test_util.hpp"

namespace fmtest {
namespace {

constexpr double kStep = 1e-4;  // roundoff-limited below (kl is a mean over all rows)
constexpr double kRelTol = 1e-6;
constexpr int kCoords = 30;

struct GradCase {
  std::string name;
  Config cfg;
  bool dlse = false;
};

std::ostream& operator<<(std::ostream& os, const GradCase& c) { return os << c.name; }

class Gradients : public SeededParamTest<GradCase> {
 protected:
  // L(a) - L(b) for the main loss, entry by entry.
  double main_delta(const Inputs& in, const FwdResult& a, const FwdResult& b, bool dlse) const {
    double s = 0;
    for (int64_t i = 0; i < a.out.numel(); ++i) s += in.dout.get(i) * (a.out.get(i) - b.out.get(i));
    if (dlse)
      for (int64_t i = 0; i < a.lse.numel(); ++i) {
        const double la = a.lse.get(i), lb = b.lse.get(i);
        if (la != lb) s += in.dlse.get(i) * (la - lb);  // (skips -inf == -inf of empty rows)
      }
    return s;
  }

  // Compares `analytic` with central differences of L along kCoords random coordinates of
  // `x` (a tensor of `in`). proxy: L = g * kl, else the main loss.
  void check(const char* what, const Config& c, Inputs& in, Tensor& x, const Tensor& analytic,
             bool proxy, double g, bool dlse, const Tensor& base_indices) {
    SCOPED_TRACE(what);
    const std::vector<double> an_all = analytic.values();
    ASSERT_GT(max_abs(an_all), 0.0) << what << " is identically zero";
    std::vector<double> fd, an;
    int skipped = 0;
    for (int64_t i : rng.distinct(x.numel(), kCoords)) {
      const double x0 = x.get(i);
      x.set(i, x0 + kStep);
      const double xp = x.get(i);
      const FwdResult fp = run_fwd(c, in);
      x.set(i, x0 - kStep);
      const double xm = x.get(i);
      const FwdResult fm = run_fwd(c, in);
      x.set(i, x0);
      if (c.mode == FLASHMSA_MODE_SPARSE && proxy &&
          !(all_equal(fp.indices, base_indices) && all_equal(fm.indices, base_indices))) {
        ++skipped;  // the selection flipped: L is not differentiable here
        continue;
      }
      const double dl = proxy ? g * (fp.kl_value() - fm.kl_value()) : main_delta(in, fp, fm, dlse);
      fd.push_back(dl / (xp - xm));
      an.push_back(an_all[size_t(i)]);
    }
    EXPECT_LE(skipped, kCoords / 5) << "too many selection flips";
    // per coordinate, relative to the largest analytic entry of the tensor
    const double tol = kRelTol * max_abs(an_all);
    for (size_t j = 0; j < fd.size(); ++j)
      EXPECT_NEAR(an[j], fd[j], tol) << what << " sample " << j;
    EXPECT_LE(rel_l2(an, fd), kRelTol) << what;
  }
};

TEST_P(Gradients, MatchFiniteDifferences) {
  const GradCase& gc = GetParam();
  const Config& c = gc.cfg;
  const double g = 0.7;
  Inputs in = make_inputs(c, rng);
  const FwdResult base = run_fwd(c, in);
  BwdOptions bo;
  bo.dlse = gc.dlse;
  bo.dkl = g;
  const BwdResult grads = run_bwd(c, in, base, bo);
  ASSERT_EQ(grads.status, FLASHMSA_SUCCESS);
  for (const Tensor* t : {&grads.dq, &grads.dk, &grads.dv, &grads.dqp, &grads.dkp})
    if (t->defined()) {
      EXPECT_TRUE(fully_written(*t));
    }

  check("dq", c, in, in.q, grads.dq, false, g, gc.dlse, base.indices);
  check("dk", c, in, in.k, grads.dk, false, g, gc.dlse, base.indices);
  check("dv", c, in, in.v, grads.dv, false, g, gc.dlse, base.indices);
  if (c.proxy) {
    check("dqp", c, in, in.qp, grads.dqp, true, g, gc.dlse, base.indices);
    check("dkp", c, in, in.kp, grads.dkp, true, g, gc.dlse, base.indices);
  }
}

// Head layouts: Hp < Hkv (G = 4), Hp == Hkv (G = 2), Hp > Hkv with G = 1 and Hpk > 1.
Config heads_cfg(int Hq, int Hkv, int Hp, int Hpk, flashmsa_mode_t mode, int topk) {
  Config c;
  c.lens = {0, 1, 130, 257};
  c.Hq = Hq;
  c.Hkv = Hkv;
  c.Hp = Hp;
  c.Hpk = Hpk;
  c.mode = mode;
  c.topk = topk;
  return c;
}

std::vector<GradCase> grad_cases() {
  const auto S = FLASHMSA_MODE_SPARSE, G = FLASHMSA_MODE_GIVEN, De = FLASHMSA_MODE_DENSE;
  std::vector<GradCase> v = {
      {"Sparse_HpLtHkv_G4_dlse", heads_cfg(4, 2, 1, 1, S, 2), true},
      {"Sparse_HpEqHkv_G2", heads_cfg(4, 2, 2, 1, S, 2), false},
      {"Sparse_HpGtHkv_G1_Hpk2_dlse", heads_cfg(4, 1, 4, 2, S, 2), true},
      {"Given_HpLtHkv_G4", heads_cfg(4, 2, 1, 1, G, 3), false},
      {"Given_HpEqHkv_G2_dlse", heads_cfg(4, 2, 2, 1, G, 3), true},
      {"Given_HpGtHkv_G1_Hpk2", heads_cfg(4, 1, 4, 2, G, 2), false},
      {"Dense_HpLtHkv_G4_dlse", heads_cfg(4, 2, 1, 1, De, 0), true},
      {"Dense_HpGtHkv_G1_Hpk2", heads_cfg(4, 1, 4, 2, De, 0), false},
  };
  // explicit (non-default) scales
  GradCase sc{"Sparse_ExplicitScales_dlse", heads_cfg(4, 2, 2, 2, S, 2), true};
  sc.cfg.scale = 0.45;
  sc.cfg.proxy_scale = 0.2;
  sc.cfg.D = 12;
  sc.cfg.Dp = 6;
  v.push_back(sc);
  return v;
}

INSTANTIATE_TEST_SUITE_P(Fp64, Gradients, ::testing::ValuesIn(grad_cases()),
                         [](const ::testing::TestParamInfo<GradCase>& i) { return i.param.name; });

}  // namespace
}  // namespace fmtest
