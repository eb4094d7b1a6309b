// The FP8 selection's rounding (flashmsa.h, flashmsa_selection_t): ref::round_e4m3 against the nearest of the 256
// E4M3FN codes found by brute force (ties to the even code, saturation at 448), on every code, every midpoint
// between neighbours and random floats over the whole range. The selection built on it is checked against
// torch's float8_e4m3fn in tests/python/test_fp8_selection.py.
#include <cmath>
#include <cstdint>
#include <limits>
#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "reference/reference.hpp"
#include "test_util.hpp"

namespace fmtest {
namespace {

// (value, code) of every finite E4M3FN code: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0:
// subnormals m/8 x 2^-6; S.1111.111 is NaN (no infinities)
std::vector<std::pair<double, int>> e4m3_codes() {
  std::vector<std::pair<double, int>> v;
  for (int code = 0; code < 256; ++code) {
    const int sign = code >> 7, e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) continue;
    const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
    v.emplace_back(sign ? -mag : mag, code);
  }
  return v;
}

double brute_nearest(float x, const std::vector<std::pair<double, int>>& codes) {
  const double a = double(x);
  if (std::fabs(a) >= 448.0) return std::copysign(448.0, a);  // satfinite
  double best = 0, best_d = std::numeric_limits<double>::infinity();
  int best_code = -1;
  for (const auto& [val, code] : codes) {
    if ((val < 0) != std::signbit(a) && val != 0) continue;  // same sign (zero either way)
    const double d = std::fabs(val - a);
    if (d < best_d || (d == best_d && (code & 1) == 0 && (best_code & 1) == 1)) {
      best = val, best_d = d, best_code = code;
    }
  }
  return std::copysign(best, a);
}

TEST(Fp8Selection, RoundE4m3IsTheNearestCode) {
  const auto codes = e4m3_codes();
  std::vector<float> xs;
  std::vector<double> pos;
  for (const auto& [val, code] : codes)
    if (val >= 0) pos.push_back(val);
  std::sort(pos.begin(), pos.end());
  for (size_t i = 0; i < pos.size(); ++i) {
    xs.push_back(float(pos[i]));
    if (i + 1 < pos.size()) {
      const double mid = 0.5 * (pos[i] + pos[i + 1]);  // exact ties: the even code wins
      xs.push_back(float(mid));
      xs.push_back(std::nextafter(float(mid), 0.f));
      xs.push_back(std::nextafter(float(mid), 1e9f));
    }
  }
  for (float x : {448.f, 460.f, 463.99f, 464.f, 500.f, 1e30f, 1e-30f, 0.f}) xs.push_back(x);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> expo(-12.f, 9.5f);
  for (int i = 0; i < 20000; ++i) xs.push_back(std::exp2(expo(rng)));
  int checked = 0;
  for (float x : xs)
    for (float s : {x, -x}) {
      const double want = brute_nearest(s, codes), got = flashmsa::ref::round_e4m3(s);
      ASSERT_EQ(got, want) << "x = " << s;
      ASSERT_EQ(std::signbit(got), std::signbit(double(s))) << "x = " << s;
      ++checked;
    }
  EXPECT_GT(checked, 40000);
  EXPECT_TRUE(std::isnan(flashmsa::ref::round_e4m3(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(flashmsa::ref::round_e4m3(std::numeric_limits<float>::infinity()), 448.0);
}

}  // namespace
}  // namespace fmtest
