// The selection's exp2 on the FMA pipe (src/cuda/common/exp2_poly.h), the same arithmetic on the
// host: its relative error against 2^x over the range the block lse feeds it (x in [-126, 0], the
// logit minus the block max in log2 units, and the small positive rounding excess), and its edge
// values (-inf, NaN, the clamp). The kernel's proxy lse is checked on the GPU (Sparse.*: rel-L2
// against fp64); this guards the polynomial and the exponent trick themselves.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "cuda/common/exp2_poly.h"

using flashmsa::cuda::exp2f_poly;

TEST(Exp2Poly, RelativeErrorAsMufu) {
  // every fp32 step of 2^-12 in [-126, 0.5): 516,000 points, all fractional positions
  double worst = 0.0;
  float worst_x = 0.f;
  for (int i = -126 * 4096; i < 2048; ++i) {
    const float x = float(i) / 4096.f;
    const double want = std::exp2(double(x));
    const double rel = std::fabs(double(exp2f_poly(x)) / want - 1.0);
    if (rel > worst) worst = rel, worst_x = x;
  }
  std::printf("    max relative error %.3e at x = %.6f\n", worst, double(worst_x));
  EXPECT_LT(worst, 2.5e-7);  // ex2.approx.f32: ~2 ulp (2.4e-7)
}

TEST(Exp2Poly, OddArgumentsAndEdges) {
  for (float x : {-0.5f, -0.49999997f, -1.5f, -3.3f, -17.25f, -100.75f, -125.9f, 0.f, 0.3f, -1e-7f}) {
    const double want = std::exp2(double(x));
    EXPECT_LT(std::fabs(double(exp2f_poly(x)) / want - 1.0), 2.5e-7) << "x = " << x;
  }
  // the clamp: -inf and anything below -126 give 2^-126 (a tiny positive term of the block sum)
  const float tiny = exp2f_poly(-std::numeric_limits<float>::infinity());
  EXPECT_GT(tiny, 0.f);
  EXPECT_LT(tiny, 1.5e-38f);
  EXPECT_EQ(exp2f_poly(-1000.f), tiny);
  // NaN stays NaN (a NaN logit must give a NaN lse, as with MUFU)
  EXPECT_TRUE(std::isnan(exp2f_poly(std::numeric_limits<float>::quiet_NaN())));
}
