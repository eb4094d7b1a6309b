// Shared helpers of the CPU test suite: seeded random numbers, host tensors of any dtype and
// layout (poisoned with NaN on creation), random problems, runners of select / fwd / bwd
// through the public C ABI, and comparisons.
//
// Seeds: every test draws from Rng(test_seed()), a mix of a base seed and the test's name.
// The base seed is fresh per process unless FLASHMSA_TEST_SEED is set; failures print it,
// and FLASHMSA_TEST_SEED=<that value> reproduces the run.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "flashmsa/flashmsa.hpp"

namespace fmtest {

constexpr int kBlock = FLASHMSA_BLOCK_SIZE;
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- seeds and random numbers ------------------------------------------------------------

inline uint64_t base_seed() {
  static const uint64_t seed = [] {
    if (const char* env = std::getenv("FLASHMSA_TEST_SEED")) return uint64_t(std::strtoull(env, nullptr, 0));
    std::random_device rd;
    return (uint64_t(rd()) << 32) ^ uint64_t(rd());
  }();
  return seed;
}

inline std::string seed_note() {
  std::ostringstream os;
  os << "reproduce with FLASHMSA_TEST_SEED=" << base_seed();
  return os.str();
}

// A per-test seed: the base seed mixed with the running test's full name.
inline uint64_t test_seed() {
  std::string name = "?";
  if (const auto* info = ::testing::UnitTest::GetInstance()->current_test_info())
    name = std::string(info->test_suite_name()) + "." + info->name();
  uint64_t h = base_seed() ^ 0x9e3779b97f4a7c15ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen_); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(gen_); }
  int64_t integer(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen_);
  }
  template <class T>
  void shuffle(std::vector<T>& v) { std::shuffle(v.begin(), v.end(), gen_); }
  // `count` distinct values of [0, n) in random order.
  std::vector<int64_t> distinct(int64_t n, int64_t count) {
    std::vector<int64_t> all(size_t(std::max<int64_t>(n, 0)));
    for (int64_t i = 0; i < n; ++i) all[size_t(i)] = i;
    shuffle(all);
    all.resize(size_t(std::min<int64_t>(count, n)));
    return all;
  }

 private:
  std::mt19937_64 gen_;
};

// Fixture base: a seeded Rng and the seed printed with every failure.
class SeededTest : public ::testing::Test {
 protected:
  SeededTest() : rng(test_seed()), trace_(__FILE__, __LINE__, seed_note()) {}
  Rng rng;

 private:
  ::testing::ScopedTrace trace_;
};

template <class P>
class SeededParamTest : public ::testing::TestWithParam<P> {
 protected:
  SeededParamTest() : rng(test_seed()), trace_(__FILE__, __LINE__, seed_note()) {}
  Rng rng;

 private:
  ::testing::ScopedTrace trace_;
};

// ---- host tensors ------------------------------------------------------------------------

// The NaN pattern that fills every new buffer (int32: a value that is no block id).
inline void poison(flashmsa_dtype_t dt, void* p, size_t elems) {
  const uint64_t f64 = 0x7ff4deadbeef0123ull;
  const uint32_t f32 = 0x7fa0dead, i32 = 0x7fadbeef;
  const uint16_t bf16 = 0x7fa1, fp16 = 0x7d01;
  const void* pattern = dt == FLASHMSA_DTYPE_FP64    ? static_cast<const void*>(&f64)
                        : dt == FLASHMSA_DTYPE_FP32  ? static_cast<const void*>(&f32)
                        : dt == FLASHMSA_DTYPE_INT32 ? static_cast<const void*>(&i32)
                        : dt == FLASHMSA_DTYPE_BF16  ? static_cast<const void*>(&bf16)
                                                     : static_cast<const void*>(&fp16);
  const size_t es = flashmsa::dtype_size(dt);
  for (size_t i = 0; i < elems; ++i) std::memcpy(static_cast<char*>(p) + es * i, pattern, es);
}

// A host tensor of any dtype with explicit strides (in elements; empty: contiguous).
// Element access is by the logical row-major index; values go through double.
class Tensor {
 public:
  Tensor() = default;
  Tensor(flashmsa_dtype_t dtype, std::vector<int64_t> shape, std::vector<int64_t> strides = {})
      : dtype_(dtype), shape_(std::move(shape)), strides_(std::move(strides)) {
    if (strides_.empty()) {
      strides_.assign(shape_.size(), 1);
      for (int d = int(shape_.size()) - 2; d >= 0; --d)
        strides_[size_t(d)] = strides_[size_t(d) + 1] * shape_[size_t(d) + 1];
    }
    int64_t span = numel() > 0 ? 1 : 0;
    for (size_t d = 0; d < shape_.size() && numel() > 0; ++d) span += (shape_[d] - 1) * strides_[d];
    storage_elems_ = size_t(span);
    bytes_.assign(std::max<size_t>(storage_elems_, 1) * flashmsa::dtype_size(dtype_), 0);
    poison(dtype_, bytes_.data(), std::max<size_t>(storage_elems_, 1));
  }

  bool defined() const { return !shape_.empty(); }
  flashmsa_dtype_t dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    return shape_.empty() ? 0 : n;
  }
  void* data() const { return const_cast<unsigned char*>(bytes_.data()); }
  const std::vector<unsigned char>& bytes() const { return bytes_; }

  // The C view (absent when undefined).
  flashmsa_tensor_t view() const {
    if (!defined()) return flashmsa::none();
    flashmsa_tensor_t t = flashmsa::none();
    t.data = data();
    t.dtype = dtype_;
    t.ndim = int32_t(shape_.size());
    for (size_t d = 0; d < shape_.size(); ++d) {
      t.shape[d] = shape_[d];
      t.strides[d] = strides_[d];
    }
    t.device_type = FLASHMSA_DEVICE_CPU;
    return t;
  }

  int64_t offset_of(int64_t linear) const {
    int64_t off = 0;
    for (int d = int(shape_.size()) - 1; d >= 0; --d) {
      off += (linear % shape_[size_t(d)]) * strides_[size_t(d)];
      linear /= shape_[size_t(d)];
    }
    return off;
  }
  double get(int64_t i) const { return flashmsa::load_as_double(dtype_, data(), offset_of(i)); }
  void set(int64_t i, double x) { flashmsa::store_from_double(dtype_, data(), offset_of(i), x); }

  std::vector<double> values() const {
    std::vector<double> v(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) v[size_t(i)] = get(i);
    return v;
  }
  void set_values(const std::vector<double>& v) {
    for (int64_t i = 0; i < numel(); ++i) set(i, v[size_t(i)]);
  }
  // The same values in another dtype (rounded) and layout.
  Tensor converted(flashmsa_dtype_t dt, std::vector<int64_t> strides = {}) const {
    Tensor t(dt, shape_, std::move(strides));
    t.set_values(values());
    return t;
  }

  // True when every storage element that is not part of the tensor still holds the poison.
  bool gaps_untouched() const {
    Tensor ref(dtype_, {int64_t(std::max<size_t>(storage_elems_, 1))});
    std::vector<char> used(std::max<size_t>(storage_elems_, 1), 0);
    for (int64_t i = 0; i < numel(); ++i) used[size_t(offset_of(i))] = 1;
    const size_t es = flashmsa::dtype_size(dtype_);
    for (size_t e = 0; e < used.size(); ++e)
      if (!used[e] && std::memcmp(bytes_.data() + e * es, ref.bytes_.data() + e * es, es) != 0) return false;
    return true;
  }

 private:
  flashmsa_dtype_t dtype_ = FLASHMSA_DTYPE_FP64;
  std::vector<int64_t> shape_, strides_;
  size_t storage_elems_ = 0;
  std::vector<unsigned char> bytes_;
};

// ---- problems ----------------------------------------------------------------------------

inline int64_t num_blocks(int64_t len) { return (len + kBlock - 1) / kBlock; }

struct Config {
  std::vector<int64_t> lens{130};
  int Hq = 4, Hkv = 2, Hp = 2, Hpk = 1, D = 8, Dp = 8;
  flashmsa_mode_t mode = FLASHMSA_MODE_SPARSE;
  int topk = 2;       // SPARSE: topk; GIVEN: the width of the given rows
  bool proxy = true;  // pass qp, kp (required in SPARSE mode)
  double scale = 0, proxy_scale = 0;
  flashmsa_dtype_t dtype = FLASHMSA_DTYPE_FP64;
  bool batched = false;  // [B, S, H, X] tensors, no cu_seqlens (all lens equal)
  bool strided = false;  // non-contiguous token and head strides everywhere

  int batch() const { return int(lens.size()); }
  int64_t total() const {
    int64_t t = 0;
    for (int64_t l : lens) t += l;
    return t;
  }
  int64_t max_len() const { return lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end()); }
  std::vector<int64_t> offsets() const {
    std::vector<int64_t> cu{0};
    for (int64_t l : lens) cu.push_back(cu.back() + l);
    return cu;
  }
  // lse, proxy_lse, dlse, kl, dkl: fp64 for fp64 inputs (full precision), else fp32.
  flashmsa_dtype_t stat_dtype() const {
    return dtype == FLASHMSA_DTYPE_FP64 ? FLASHMSA_DTYPE_FP64 : FLASHMSA_DTYPE_FP32;
  }

  // A per-token tensor [total, H, X] (or [B, S, H, X]) in this config's layout.
  Tensor tokens(int H, int X, flashmsa_dtype_t dt) const {
    const int64_t T = total();
    if (batched) {
      const int64_t B = batch(), S = lens.empty() ? 0 : lens[0];
      if (!strided) return Tensor(dt, {B, S, H, X});
      const int64_t hs = X + 2, ts = H * hs + 1;
      return Tensor(dt, {B, S, H, X}, {S * ts + 7, ts, hs, 1});
    }
    if (!strided) return Tensor(dt, {T, H, X});
    // head-major with padding: neither stride is the contiguous one
    return Tensor(dt, {T, H, X}, {X + 1, T * (X + 1) + 3, 1});
  }
  Tensor tokens(int H, int X) const { return tokens(H, X, dtype); }
  // A per-head tensor [H, total] (K < 0) or [H, total, K].
  Tensor heads(int H, int K, flashmsa_dtype_t dt) const {
    const int64_t T = total();
    if (K < 0) return strided ? Tensor(dt, {H, T}, {T + 5, 1}) : Tensor(dt, {H, T});
    return strided ? Tensor(dt, {H, T, K}, {T * (K + 1) + 2, K + 1, 1}) : Tensor(dt, {H, T, K});
  }
};

struct Inputs {
  Tensor q, k, v, qp, kp, cu;
  Tensor indices;    // GIVEN mode: [Hp, total, topk]
  Tensor dout, dlse;  // upstream gradients of out and lse
};

inline void fill_normal(Tensor& t, Rng& rng, double sd = 1.0) {
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, sd * rng.normal());
}

// Random given indices: every row holds at least one block <= the query's own (so the row
// is not empty), then up to topk - 1 more distinct blocks of the sequence, slots shuffled,
// the rest -1.
inline Tensor random_given_indices(const Config& c, Rng& rng) {
  Tensor idx = c.heads(c.Hp, c.topk, FLASHMSA_DTYPE_INT32);
  const auto cu = c.offsets();
  for (int p = 0; p < c.Hp; ++p)
    for (int b = 0; b < c.batch(); ++b) {
      const int64_t nb = num_blocks(c.lens[size_t(b)]);
      for (int64_t t = cu[size_t(b)]; t < cu[size_t(b) + 1]; ++t) {
        const int64_t own = (t - cu[size_t(b)]) / kBlock;
        std::vector<int64_t> row{rng.integer(0, own)};
        for (int64_t j : rng.distinct(nb, rng.integer(0, c.topk - 1)))
          if (int64_t(row.size()) < c.topk && std::find(row.begin(), row.end(), j) == row.end())
            row.push_back(j);
        row.resize(size_t(c.topk), -1);
        rng.shuffle(row);
        for (int s = 0; s < c.topk; ++s) idx.set((int64_t(p) * c.total() + t) * c.topk + s, double(row[size_t(s)]));
      }
    }
  return idx;
}

inline Inputs make_inputs(const Config& c, Rng& rng) {
  Inputs in;
  in.q = c.tokens(c.Hq, c.D);
  in.k = c.tokens(c.Hkv, c.D);
  in.v = c.tokens(c.Hkv, c.D);
  for (Tensor* t : {&in.q, &in.k, &in.v}) fill_normal(*t, rng);
  if (c.proxy) {
    in.qp = c.tokens(c.Hp, c.Dp);
    in.kp = c.tokens(c.Hpk, c.Dp);
    fill_normal(in.qp, rng);
    fill_normal(in.kp, rng);
  }
  if (!c.batched) {
    in.cu = Tensor(FLASHMSA_DTYPE_INT32, {int64_t(c.lens.size()) + 1});
    const auto cu = c.offsets();
    for (size_t i = 0; i < cu.size(); ++i) in.cu.set(int64_t(i), double(cu[i]));
  }
  if (c.mode == FLASHMSA_MODE_GIVEN) in.indices = random_given_indices(c, rng);
  in.dout = c.tokens(c.Hq, c.D);
  fill_normal(in.dout, rng);
  in.dlse = c.heads(c.Hq, -1, c.stat_dtype());
  fill_normal(in.dlse, rng);
  return in;
}

// The same values in the layout and dtype of another config (same lens and heads).
inline Inputs relayout(const Inputs& src, const Config& c) {
  auto copy = [](const Tensor& from, Tensor to) {
    if (!from.defined()) return Tensor();
    to.set_values(from.values());
    return to;
  };
  Inputs in;
  in.q = copy(src.q, c.tokens(c.Hq, c.D));
  in.k = copy(src.k, c.tokens(c.Hkv, c.D));
  in.v = copy(src.v, c.tokens(c.Hkv, c.D));
  in.qp = c.proxy ? copy(src.qp, c.tokens(c.Hp, c.Dp)) : Tensor();
  in.kp = c.proxy ? copy(src.kp, c.tokens(c.Hpk, c.Dp)) : Tensor();
  if (!c.batched) {
    in.cu = Tensor(FLASHMSA_DTYPE_INT32, {int64_t(c.lens.size()) + 1});
    const auto cu = c.offsets();
    for (size_t i = 0; i < cu.size(); ++i) in.cu.set(int64_t(i), double(cu[i]));
  }
  if (src.indices.defined()) in.indices = copy(src.indices, c.heads(c.Hp, c.topk, FLASHMSA_DTYPE_INT32));
  in.dout = copy(src.dout, c.tokens(c.Hq, c.D));
  in.dlse = copy(src.dlse, c.heads(c.Hq, -1, c.stat_dtype()));
  return in;
}

// Rounds every floating input to what `dt` can hold (so that an fp64 run and a `dt` run see the
// same numbers).
inline void round_inputs_to(Inputs& in, flashmsa_dtype_t dt) {
  for (Tensor* t : {&in.q, &in.k, &in.v, &in.qp, &in.kp, &in.dout})
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, flashmsa::round_to(dt, t->get(i)));
  for (int64_t i = 0; i < in.dlse.numel(); ++i)
    in.dlse.set(i, flashmsa::round_to(FLASHMSA_DTYPE_FP32, in.dlse.get(i)));
}

// ---- runners (public C ABI) --------------------------------------------------------------

struct SelectResult {
  Tensor indices, proxy_lse;
  flashmsa_status_t status = FLASHMSA_ERROR_INTERNAL;
};

inline flashmsa_select_args_t select_args(const Config& c, const Inputs& in, SelectResult& r) {
  flashmsa::SelectArgs a;
  a.qp = in.qp.view();
  a.kp = in.kp.view();
  a.cu_seqlens = in.cu.view();
  a.max_seqlen = c.batched ? 0 : c.max_len();
  a.topk = c.topk;
  a.proxy_scale = c.proxy_scale;
  if (!r.indices.defined()) r.indices = c.heads(c.Hp, c.topk, FLASHMSA_DTYPE_INT32);
  if (!r.proxy_lse.defined()) r.proxy_lse = c.heads(c.Hp, -1, c.stat_dtype());
  a.indices = r.indices.view();
  a.proxy_lse = r.proxy_lse.view();
  return a;
}

inline SelectResult run_select(const Config& c, const Inputs& in) {
  SelectResult r;
  const flashmsa_select_args_t a = select_args(c, in, r);
  r.status = flashmsa_select(&a, nullptr, 0);
  EXPECT_EQ(r.status, FLASHMSA_SUCCESS) << flashmsa_last_error();
  return r;
}

struct FwdOptions {
  bool compute_kl = true;      // needs proxy
  bool want_indices = true;    // SPARSE: write the selection
  bool want_proxy_lse = true;  // needs proxy
  int validate = 0;
  flashmsa_numerics_t numerics = FLASHMSA_NUMERICS_TRAIN;
};

struct FwdResult {
  Tensor out, lse, indices, proxy_lse, kl;
  flashmsa_status_t status = FLASHMSA_ERROR_INTERNAL;
  double kl_value() const { return kl.defined() ? kl.get(0) : 0.0; }
};

// The inputs, sequences, mode, scales and validation flag that a forward's and a backward's
// arguments share.
template <class Args>
void set_inputs(Args& a, const Config& c, const Inputs& in, int validate) {
  a.q = in.q.view();
  a.k = in.k.view();
  a.v = in.v.view();
  a.qp = in.qp.view();
  a.kp = in.kp.view();
  a.cu_seqlens = in.cu.view();
  a.max_seqlen = c.batched ? 0 : c.max_len();
  a.mode = c.mode;
  a.softmax_scale = c.scale;
  a.proxy_scale = c.proxy_scale;
  a.validate = validate;
}

// Arguments of a forward of config c on in, writing into r's tensors (allocated if undefined).
inline flashmsa_fwd_args_t fwd_args(const Config& c, const Inputs& in, FwdResult& r,
                                    const FwdOptions& o = {}) {
  flashmsa::FwdArgs a;
  set_inputs(a, c, in, o.validate);
  a.numerics = o.numerics;
  a.topk = c.mode == FLASHMSA_MODE_SPARSE ? c.topk : 0;
  if (!r.out.defined()) r.out = c.tokens(c.Hq, c.D);
  if (!r.lse.defined()) r.lse = c.heads(c.Hq, -1, c.stat_dtype());
  a.out = r.out.view();
  a.lse = r.lse.view();
  if (c.mode == FLASHMSA_MODE_GIVEN) {
    a.indices = in.indices.view();
  } else if (c.mode == FLASHMSA_MODE_SPARSE && o.want_indices) {
    if (!r.indices.defined()) r.indices = c.heads(c.Hp, c.topk, FLASHMSA_DTYPE_INT32);
    a.indices = r.indices.view();
  }
  if (c.proxy && o.want_proxy_lse) {
    if (!r.proxy_lse.defined()) r.proxy_lse = c.heads(c.Hp, -1, c.stat_dtype());
    a.proxy_lse = r.proxy_lse.view();
  }
  if (c.proxy && o.compute_kl) {
    a.compute_kl = 1;
    if (!r.kl.defined()) r.kl = Tensor(c.stat_dtype(), {1});
    a.kl = r.kl.view();
  }
  return a;
}

inline FwdResult run_fwd(const Config& c, const Inputs& in, const FwdOptions& o = {}) {
  FwdResult r;
  const flashmsa_fwd_args_t a = fwd_args(c, in, r, o);
  r.status = flashmsa_fwd(&a, nullptr, 0);
  EXPECT_EQ(r.status, FLASHMSA_SUCCESS) << flashmsa_last_error();
  return r;
}

struct BwdOptions {
  bool dlse = false;      // pass in.dlse
  bool has_dkl = true;    // pass a dkl tensor ...
  double dkl = 0.7;       // ... holding this g
  bool proxy_lse = true;  // pass the forward's proxy_lse (else the backward recomputes it)
  int validate = 0;
};

struct BwdResult {
  Tensor dq, dk, dv, dqp, dkp;
  flashmsa_status_t status = FLASHMSA_ERROR_INTERNAL;
};

// Arguments of the backward of f (the forward of c on in). Indices: the given ones (GIVEN) or
// the forward's selection (SPARSE).
inline flashmsa_bwd_args_t bwd_args(const Config& c, const Inputs& in, const FwdResult& f,
                                    BwdResult& r, Tensor& dkl, const BwdOptions& o = {}) {
  flashmsa::BwdArgs a;
  set_inputs(a, c, in, o.validate);
  if (c.mode == FLASHMSA_MODE_GIVEN) a.indices = in.indices.view();
  if (c.mode == FLASHMSA_MODE_SPARSE) a.indices = f.indices.view();
  a.out = f.out.view();
  a.lse = f.lse.view();
  if (o.proxy_lse && c.proxy) a.proxy_lse = f.proxy_lse.view();
  a.dout = in.dout.view();
  if (o.dlse) a.dlse = in.dlse.view();
  if (o.has_dkl) {
    dkl = Tensor(c.stat_dtype(), {1});
    dkl.set(0, o.dkl);
    a.dkl = dkl.view();
  }
  if (!r.dq.defined()) r.dq = c.tokens(c.Hq, c.D);
  if (!r.dk.defined()) r.dk = c.tokens(c.Hkv, c.D);
  if (!r.dv.defined()) r.dv = c.tokens(c.Hkv, c.D);
  a.dq = r.dq.view();
  a.dk = r.dk.view();
  a.dv = r.dv.view();
  if (c.proxy) {
    if (!r.dqp.defined()) r.dqp = c.tokens(c.Hp, c.Dp);
    if (!r.dkp.defined()) r.dkp = c.tokens(c.Hpk, c.Dp);
    a.dqp = r.dqp.view();
    a.dkp = r.dkp.view();
  }
  return a;
}

inline BwdResult run_bwd(const Config& c, const Inputs& in, const FwdResult& f,
                         const BwdOptions& o = {}) {
  BwdResult r;
  Tensor dkl;
  const flashmsa_bwd_args_t a = bwd_args(c, in, f, r, dkl, o);
  r.status = flashmsa_bwd(&a, nullptr, 0);
  EXPECT_EQ(r.status, FLASHMSA_SUCCESS) << flashmsa_last_error();
  return r;
}

// ---- comparisons -------------------------------------------------------------------------

// ||a - b|| / ||b|| over the entries where b is finite (0 when both are zero).
inline double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!std::isfinite(b[i])) continue;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  if (den == 0) return num == 0 ? 0.0 : kInf;
  return std::sqrt(num / den);
}
inline double rel_l2(const Tensor& a, const Tensor& b) { return rel_l2(a.values(), b.values()); }

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v)
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  return m;
}

// Elementwise |a - b| <= rtol * max|b| (+ atol); non-finite entries must match exactly.
inline ::testing::AssertionResult all_close(const std::vector<double>& a,
                                            const std::vector<double>& b, double rtol,
                                            double atol = 0) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  const double tol = rtol * max_abs(b) + atol;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool fa = std::isfinite(a[i]), fb = std::isfinite(b[i]);
    const bool ok = (fa && fb) ? std::fabs(a[i] - b[i]) <= tol
                               : (!std::isnan(a[i]) && !std::isnan(b[i]) && a[i] == b[i]);
    if (!ok)
      return ::testing::AssertionFailure()
             << "entry " << i << ": " << a[i] << " vs " << b[i] << " (tolerance " << tol
             << ", rel-L2 " << rel_l2(a, b) << ")";
  }
  return ::testing::AssertionSuccess();
}
inline ::testing::AssertionResult all_close(const Tensor& a, const Tensor& b, double rtol,
                                            double atol = 0) {
  return all_close(a.values(), b.values(), rtol, atol);
}

// Exact equality of the values (as doubles; -inf == -inf, NaN never equal).
inline ::testing::AssertionResult all_equal(const std::vector<double>& a,
                                            const std::vector<double>& b) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i]))
      return ::testing::AssertionFailure() << "entry " << i << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}
inline ::testing::AssertionResult all_equal(const Tensor& a, const Tensor& b) {
  return all_equal(a.values(), b.values());
}

// Every element was written (no poison left) and the gaps of a strided buffer were not.
inline ::testing::AssertionResult fully_written(const Tensor& t) {
  const int32_t poison_int = 0x7fadbeef;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double x = t.get(i);
    if (std::isnan(x) || (t.dtype() == FLASHMSA_DTYPE_INT32 && x == poison_int))
      return ::testing::AssertionFailure() << "element " << i << " was not written";
  }
  if (!t.gaps_untouched()) return ::testing::AssertionFailure() << "a write landed outside the tensor";
  return ::testing::AssertionSuccess();
}

inline bool all_zero(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (t.get(i) != 0.0) return false;
  return true;
}

// ---- whole runs --------------------------------------------------------------------------

// A forward and the backward of it.
struct Outputs {
  FwdResult f;
  BwdResult b;
};

inline Outputs run_all(const Config& c, const Inputs& in, const BwdOptions& bo = {},
                       const FwdOptions& fo = {}) {
  Outputs o;
  o.f = run_fwd(c, in, fo);
  o.b = run_bwd(c, in, o.f, bo);
  return o;
}

// Every output and gradient of two runs agree: indices exactly, the rest within rtol of the
// largest entry (non-finite entries exactly). kl only when compare_kl.
inline void expect_same_outputs(const Outputs& got, const Outputs& want, double rtol,
                                bool compare_kl = true) {
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> pairs[] = {
      {"out", {&got.f.out, &want.f.out}},       {"lse", {&got.f.lse, &want.f.lse}},
      {"proxy_lse", {&got.f.proxy_lse, &want.f.proxy_lse}},
      {"kl", {&got.f.kl, &want.f.kl}},          {"dq", {&got.b.dq, &want.b.dq}},
      {"dk", {&got.b.dk, &want.b.dk}},          {"dv", {&got.b.dv, &want.b.dv}},
      {"dqp", {&got.b.dqp, &want.b.dqp}},       {"dkp", {&got.b.dkp, &want.b.dkp}}};
  for (const auto& pr : pairs) {
    const Tensor &a = *pr.second.first, &b = *pr.second.second;
    if (!compare_kl && std::string(pr.first) == "kl") continue;
    ASSERT_EQ(a.defined(), b.defined()) << pr.first;
    if (a.defined()) {
      EXPECT_TRUE(all_close(a, b, rtol)) << pr.first;
    }
  }
  if (got.f.indices.defined() || want.f.indices.defined()) {
    EXPECT_TRUE(all_equal(got.f.indices, want.f.indices)) << "indices";
  }
}

// Tokens [t0, t0 + n) of a varlen per-token tensor [total, H, X], contiguous.
inline Tensor slice_tokens(const Tensor& t, int64_t t0, int64_t n) {
  if (!t.defined()) return Tensor();
  const int64_t row = t.shape()[1] * t.shape()[2];
  Tensor s(t.dtype(), {n, t.shape()[1], t.shape()[2]});
  for (int64_t i = 0; i < n * row; ++i) s.set(i, t.get(t0 * row + i));
  return s;
}

// Tokens [t0, t0 + n) of a per-head tensor [H, total] or [H, total, K], contiguous.
inline Tensor slice_heads(const Tensor& t, int64_t t0, int64_t n) {
  if (!t.defined()) return Tensor();
  const int64_t H = t.shape()[0], T = t.shape()[1], K = t.shape().size() == 3 ? t.shape()[2] : 1;
  Tensor s = t.shape().size() == 3 ? Tensor(t.dtype(), {H, n, K}) : Tensor(t.dtype(), {H, n});
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < n * K; ++i) s.set(h * n * K + i, t.get(h * T * K + t0 * K + i));
  return s;
}

// The outputs of tokens [t0, t0 + n) (kl left out).
inline Outputs slice_outputs(const Outputs& o, int64_t t0, int64_t n) {
  Outputs s;
  s.f.out = slice_tokens(o.f.out, t0, n);
  s.f.lse = slice_heads(o.f.lse, t0, n);
  s.f.indices = slice_heads(o.f.indices, t0, n);
  s.f.proxy_lse = slice_heads(o.f.proxy_lse, t0, n);
  for (auto m : {&BwdResult::dq, &BwdResult::dk, &BwdResult::dv, &BwdResult::dqp, &BwdResult::dkp})
    s.b.*m = slice_tokens(o.b.*m, t0, n);
  return s;
}

// Element index of (token, head, x) in a [total, H, X] tensor, of (h, t) in [H, total].
inline int64_t tok_index(int64_t t, int h, int x, int H, int X) { return (t * H + h) * int64_t(X) + x; }

}  // namespace fmtest
