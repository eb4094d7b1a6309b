// The golden cases of ../shared/golden: fp64 results of an implementation of SPEC.md written
// independently of flashmsa. The CPU backend must match every case (inputs are float32 values
// computed in fp64; outputs float64; upstream kl gradient 1; default scales).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "flashmsa/flashmsa.hpp"
#include "npy.hpp"

namespace fs = std::filesystem;
using flashmsa::npy::Array;

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The raw text after "key": in a flat JSON object (enough for case.json).
std::string json_value(const std::string& j, const std::string& key) {
  const size_t k = j.find("\"" + key + "\"");
  if (k == std::string::npos) throw std::runtime_error("case.json: missing " + key);
  size_t c = j.find(':', k) + 1;
  while (c < j.size() && std::isspace(static_cast<unsigned char>(j[c]))) ++c;
  size_t e = c;
  if (j[c] == '[') e = j.find(']', c) + 1;
  else if (j[c] == '"') e = j.find('"', c + 1) + 1;
  else
    while (e < j.size() && j[e] != ',' && j[e] != '}' && j[e] != '\n') ++e;
  return j.substr(c, e - c);
}

int json_int(const std::string& j, const std::string& key) { return std::stoi(json_value(j, key)); }

std::vector<int64_t> json_ints(const std::string& j, const std::string& key) {
  std::string v = json_value(j, key);
  std::vector<int64_t> out;
  std::stringstream ss(v.substr(1, v.size() - 2));
  std::string tok;
  while (std::getline(ss, tok, ','))
    if (tok.find_first_of("0123456789") != std::string::npos) out.push_back(std::stoll(tok));
  return out;
}

flashmsa_tensor_t view_of(std::vector<double>& v, const std::vector<int64_t>& shape) {
  flashmsa_tensor_t t{};
  t.data = v.data();
  t.dtype = FLASHMSA_DTYPE_FP64;
  t.ndim = int32_t(shape.size());
  int64_t s = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[size_t(d)];
    t.strides[d] = s;
    s *= shape[size_t(d)];
  }
  return t;
}

double rel_l2(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    const double d = got[i] - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  // An absolute floor for outputs that are zero up to rounding (e.g. dqp in the ties case,
  // where every proxy key is equal and the gradient cancels exactly in exact arithmetic).
  const double floor = 1e-14 * std::sqrt(double(want.size()));
  return std::sqrt(num) / std::max(std::sqrt(den), floor * 1e8);
}

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, CpuBackendMatches) {
  const fs::path dir = fs::path(FLASHMSA_GOLDEN_DIR) / GetParam();
  ASSERT_TRUE(fs::exists(dir / "case.json")) << "missing golden case " << dir;
  const std::string js = read_text(dir / "case.json");
  auto load = [&](const char* name) { return flashmsa::npy::load((dir / (std::string(name) + ".npy")).string()); };
  const int Hq = json_int(js, "Hq"), Hkv = json_int(js, "Hkv"), Hp = json_int(js, "Hp"),
            Hpk = json_int(js, "Hpk"), D = json_int(js, "D"), Dp = json_int(js, "Dp"),
            topk = json_int(js, "topk");
  const bool warmup = json_value(js, "mode").find("warmup") != std::string::npos;
  const bool has_dlse = json_value(js, "dlse").find("true") != std::string::npos;
  const std::vector<int64_t> lengths = json_ints(js, "lengths");
  int64_t total = 0, max_len = 0;
  for (int64_t l : lengths) total += l, max_len = std::max(max_len, l);

  Array q = load("q"), k = load("k"), v = load("v"), qp = load("qp"), kp = load("kp"),
        dout = load("dout"), cu = load("cu_seqlens");
  ASSERT_EQ(q.shape, (std::vector<int64_t>{total, Hq, D}));
  std::vector<int32_t> cu32(cu.values.begin(), cu.values.end());
  flashmsa_tensor_t cu_t = flashmsa::view(cu32.data(), FLASHMSA_DTYPE_INT32, {int64_t(cu32.size())});

  // forward
  std::vector<double> out(size_t(total) * Hq * D, NAN), lse(size_t(Hq) * total, NAN),
      plse(size_t(Hp) * total, NAN), kl(1, NAN);
  std::vector<int32_t> idx(size_t(Hp) * total * topk, -7);
  flashmsa::FwdArgs f;
  f.q = view_of(q.values, q.shape);
  f.k = view_of(k.values, k.shape);
  f.v = view_of(v.values, v.shape);
  f.qp = view_of(qp.values, qp.shape);
  f.kp = view_of(kp.values, kp.shape);
  f.cu_seqlens = cu_t;
  f.max_seqlen = max_len;
  f.mode = warmup ? FLASHMSA_MODE_DENSE : FLASHMSA_MODE_SPARSE;
  f.topk = topk;
  f.compute_kl = 1;
  if (!warmup) f.indices = flashmsa::view(idx.data(), FLASHMSA_DTYPE_INT32, {Hp, total, topk});
  f.out = view_of(out, {total, Hq, D});
  f.lse = view_of(lse, {Hq, total});
  f.proxy_lse = view_of(plse, {Hp, total});
  f.kl = view_of(kl, {});
  ASSERT_NO_THROW(flashmsa::fwd(f)) << flashmsa_last_error();

  const double tol = 1e-10;
  EXPECT_LT(rel_l2(out, load("out").values), tol) << "out";
  EXPECT_LT(rel_l2(lse, load("lse").values), tol) << "lse";
  EXPECT_LT(rel_l2(plse, load("proxy_lse").values), tol) << "proxy_lse";
  EXPECT_NEAR(kl[0], load("kl").values.at(0), tol * std::fabs(load("kl").values.at(0)) + 1e-300) << "kl";
  if (!warmup) {
    const Array want = load("indices");
    ASSERT_EQ(want.values.size(), idx.size());
    size_t diff = 0;
    for (size_t i = 0; i < idx.size(); ++i) diff += (double(idx[i]) != want.values[i]);
    EXPECT_EQ(diff, 0u) << "indices differ in " << diff << " slots";
  }

  // backward with dkl = 1 (and dlse when the case uses it)
  std::vector<double> dq(q.values.size(), NAN), dk(k.values.size(), NAN), dv(v.values.size(), NAN),
      dqp(qp.values.size(), NAN), dkp(kp.values.size(), NAN), dkl(1, 1.0);
  Array dlse;
  flashmsa::BwdArgs b;
  b.q = f.q; b.k = f.k; b.v = f.v; b.qp = f.qp; b.kp = f.kp;
  b.cu_seqlens = cu_t;
  b.max_seqlen = max_len;
  b.mode = f.mode;
  if (!warmup) b.indices = f.indices;
  b.out = f.out;
  b.lse = f.lse;
  b.dout = view_of(dout.values, dout.shape);
  if (has_dlse) {
    dlse = load("dlse");
    b.dlse = view_of(dlse.values, dlse.shape);
  }
  b.dkl = view_of(dkl, {});
  b.dq = view_of(dq, q.shape);
  b.dk = view_of(dk, k.shape);
  b.dv = view_of(dv, v.shape);
  b.dqp = view_of(dqp, qp.shape);
  b.dkp = view_of(dkp, kp.shape);
  ASSERT_NO_THROW(flashmsa::bwd(b)) << flashmsa_last_error();
  EXPECT_LT(rel_l2(dq, load("dq").values), tol) << "dq";
  EXPECT_LT(rel_l2(dk, load("dk").values), tol) << "dk";
  EXPECT_LT(rel_l2(dv, load("dv").values), tol) << "dv";
  EXPECT_LT(rel_l2(dqp, load("dqp").values), tol) << "dqp";
  EXPECT_LT(rel_l2(dkp, load("dkp").values), tol) << "dkp";
  (void)Hkv; (void)Hpk; (void)Dp;
}

std::vector<std::string> golden_cases() {
  std::vector<std::string> names;
  const fs::path root(FLASHMSA_GOLDEN_DIR);
  if (fs::exists(root))
    for (const auto& e : fs::directory_iterator(root))
      if (fs::exists(e.path() / "case.json")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The golden folder must be there: a suite that silently tests nothing proves nothing.
TEST(GoldenFolder, Present) {
  EXPECT_GE(golden_cases().size(), 6u) << "expected the SPEC golden cases in " << FLASHMSA_GOLDEN_DIR
                                       << " (set -DFLASHMSA_GOLDEN_DIR=...)";
}

INSTANTIATE_TEST_SUITE_P(Spec, Golden, ::testing::ValuesIn(golden_cases()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
