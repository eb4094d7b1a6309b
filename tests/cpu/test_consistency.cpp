// Consistency properties of the public API (SPEC.md sections 1 and 3): layouts, modes, the kl
// term, given-index semantics, and the storage dtypes.
#include <climits>

#include "test_util.hpp"

namespace fmtest {
namespace {

constexpr double kTight = 1e-12;  // fp64 against fp64 computed in another order

class Consistency : public SeededTest {
 protected:
  // Heads with Hp < Hkv, Hp == Hkv and Hp > Hkv (G = 1, Hpk > 1) in one config each.
  static std::vector<Config> head_configs(flashmsa_mode_t mode, std::vector<int64_t> lens, int topk) {
    std::vector<Config> v;
    const int layouts[][4] = {{4, 2, 1, 1}, {4, 2, 2, 1}, {4, 1, 4, 2}};
    for (const auto& h : layouts) {
      Config c;
      c.lens = lens;
      c.Hq = h[0];
      c.Hkv = h[1];
      c.Hp = h[2];
      c.Hpk = h[3];
      c.mode = mode;
      c.topk = topk;
      v.push_back(c);
    }
    return v;
  }
  static std::string describe(const Config& c) {
    std::ostringstream os;
    os << "mode " << int(c.mode) << ", Hq " << c.Hq << ", Hkv " << c.Hkv << ", Hp " << c.Hp
       << ", Hpk " << c.Hpk << ", topk " << c.topk << ", dtype " << flashmsa_dtype_name(c.dtype)
       << (c.batched ? ", batched" : "") << (c.strided ? ", strided" : "");
    return os.str();
  }
  static BwdOptions full_bwd(double g = 0.7) {
    BwdOptions o;
    o.dlse = true;
    o.dkl = g;
    return o;
  }
};

// ---- layouts -------------------------------------------------------------------------------

// One varlen call equals one call per sequence (with dkl scaled by N_b / N, since kl is a mean
// over all N = Hp * total rows; kl * N = sum over sequences of kl_b * N_b).
TEST_F(Consistency, VarlenEqualsOneCallPerSequence) {
  for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE}) {
    Config c = head_configs(mode, {0, 1, 130, 257, 129}, 2)[1];
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c, rng);
    const double g = 0.7;
    const Outputs all = run_all(c, in, full_bwd(g));
    const auto cu = c.offsets();
    double kl_sum = 0;
    for (int b = 0; b < c.batch(); ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      const int64_t t0 = cu[size_t(b)], n = c.lens[size_t(b)];
      Config cb = c;
      cb.lens = {n};
      Inputs ib;
      ib.q = slice_tokens(in.q, t0, n);
      ib.k = slice_tokens(in.k, t0, n);
      ib.v = slice_tokens(in.v, t0, n);
      ib.qp = slice_tokens(in.qp, t0, n);
      ib.kp = slice_tokens(in.kp, t0, n);
      ib.dout = slice_tokens(in.dout, t0, n);
      ib.dlse = slice_heads(in.dlse, t0, n);
      ib.indices = slice_heads(in.indices, t0, n);
      ib.cu = Tensor(FLASHMSA_DTYPE_INT32, {2});
      ib.cu.set(0, 0);
      ib.cu.set(1, double(n));
      const Outputs one = run_all(cb, ib, full_bwd(g * double(n) / double(c.total())));
      expect_same_outputs(one, slice_outputs(all, t0, n), kTight, /*compare_kl=*/false);
      kl_sum += one.f.kl_value() * double(n);
    }
    EXPECT_NEAR(all.f.kl_value() * double(c.total()), kl_sum, kTight * kl_sum);
  }
}

// Batched [B, S, H, D] equals varlen with B sequences of length S; lse, indices, proxy_lse and
// dlse keep the varlen layout [H, B*S] (flashmsa.h).
TEST_F(Consistency, BatchedEqualsVarlen) {
  for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE})
    for (const Config& c : head_configs(mode, {257, 257, 257}, 2)) {
      SCOPED_TRACE(describe(c));
      const Inputs in = make_inputs(c, rng);
      Config cb = c;
      cb.batched = true;
      const Inputs inb = relayout(in, cb);
      const Outputs varlen = run_all(c, in, full_bwd()), batched = run_all(cb, inb, full_bwd());
      EXPECT_EQ(batched.f.out.shape().size(), 4u);
      expect_same_outputs(batched, varlen, kTight);
    }
}

// Non-contiguous token and head strides (inputs and outputs) give the contiguous result and
// leave the gaps between elements untouched.
TEST_F(Consistency, StridedEqualsContiguous) {
  for (bool batched : {false, true})
    for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE}) {
      Config c = head_configs(mode, batched ? std::vector<int64_t>{200, 200} : std::vector<int64_t>{0, 200, 131}, 2)[2];
      c.batched = batched;
      Config cs = c;
      cs.strided = true;
      SCOPED_TRACE(describe(cs));
      const Inputs in = make_inputs(c, rng);
      const Inputs ins = relayout(in, cs);
      const Outputs dense = run_all(c, in, full_bwd()), strided = run_all(cs, ins, full_bwd());
      expect_same_outputs(strided, dense, kTight);
      for (const Tensor* t : {&strided.f.out, &strided.f.lse, &strided.f.proxy_lse, &strided.f.indices,
                              &strided.b.dq, &strided.b.dk, &strided.b.dv, &strided.b.dqp, &strided.b.dkp})
        if (t->defined()) {
          EXPECT_TRUE(fully_written(*t));
        }
    }
}

// ---- modes ---------------------------------------------------------------------------------

// When topk covers every block, SPARSE selects everything: it equals DENSE (kl included).
TEST_F(Consistency, DenseEqualsSparseWhenTopkCoversAllBlocks) {
  for (Config c : head_configs(FLASHMSA_MODE_SPARSE, {300, 1, 129, 0, 384}, 3)) {
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c, rng);
    const Outputs sparse = run_all(c, in, full_bwd());
    Config cd = c;
    cd.mode = FLASHMSA_MODE_DENSE;
    Outputs dense = run_all(cd, in, full_bwd());
    dense.f.indices = sparse.f.indices;  // DENSE writes none
    expect_same_outputs(sparse, dense, kTight);
  }
}

// ---- the kl term ---------------------------------------------------------------------------

TEST_F(Consistency, KlIsNonNegative) {
  for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE})
    for (const Config& c : head_configs(mode, {1, 200, 300}, 2))
      for (double sharp : {1.0, 4.0}) {  // sharper proxy / main distributions
        SCOPED_TRACE(describe(c));
        Inputs in = make_inputs(c, rng);
        for (Tensor* t : {&in.q, &in.qp})
          for (int64_t i = 0; i < t->numel(); ++i) t->set(i, sharp * t->get(i));
        const FwdResult f = run_fwd(c, in);
        EXPECT_GT(f.kl_value(), 0.0) << "sharpness " << sharp;  // random student != teacher
        EXPECT_TRUE(std::isfinite(f.kl_value()));
      }
}

// G = 1 and the proxy equal to the main attention (qp = q, kp = k, Dp = D, same scales,
// Hp = Hkv = Hpk = Hq): student == teacher, so kl = 0 and the proxy gradients vanish.
TEST_F(Consistency, StudentEqualToTeacherGivesZeroKl) {
  for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE})
    for (double proxy_scale : {0.0, 0.3}) {
      Config c;
      c.lens = {130, 1, 300};
      c.Hq = c.Hkv = c.Hp = c.Hpk = 2;
      c.D = c.Dp = 8;
      c.mode = mode;
      c.topk = 2;
      c.scale = c.proxy_scale = proxy_scale;
      SCOPED_TRACE(describe(c));
      Inputs in = make_inputs(c, rng);
      in.qp.set_values(in.q.values());
      in.kp.set_values(in.k.values());
      const Outputs o = run_all(c, in, full_bwd(1.0));
      EXPECT_LT(std::fabs(o.f.kl_value()), 1e-12);
      EXPECT_LT(max_abs(o.b.dqp.values()), 1e-12);
      EXPECT_LT(max_abs(o.b.dkp.values()), 1e-12);
      EXPECT_TRUE(all_close(o.f.proxy_lse, o.f.lse, kTight));  // same normaliser
    }
}

// dkl absent or 0: the proxy gradients are exactly zero (and written); the main gradients do
// not depend on dkl; the proxy gradients are linear in it.
TEST_F(Consistency, ProxyGradientsFollowDkl) {
  for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE}) {
    Config c = head_configs(mode, {257, 1, 64}, 2)[0];
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c, rng);
    const FwdResult f = run_fwd(c, in);
    BwdOptions absent = full_bwd(), zero = full_bwd(0.0), g1 = full_bwd(0.75), g2 = full_bwd(1.5);
    absent.has_dkl = false;
    const BwdResult b_absent = run_bwd(c, in, f, absent), b_zero = run_bwd(c, in, f, zero),
                    b1 = run_bwd(c, in, f, g1), b2 = run_bwd(c, in, f, g2);
    for (const BwdResult* b : {&b_absent, &b_zero}) {
      EXPECT_TRUE(fully_written(b->dqp));
      EXPECT_TRUE(fully_written(b->dkp));
      EXPECT_TRUE(all_zero(b->dqp));
      EXPECT_TRUE(all_zero(b->dkp));
    }
    EXPECT_GT(max_abs(b1.dqp.values()), 0.0);
    EXPECT_GT(max_abs(b1.dkp.values()), 0.0);
    for (auto m : {&BwdResult::dq, &BwdResult::dk, &BwdResult::dv})
      EXPECT_TRUE(all_close(b1.*m, b_absent.*m, kTight));
    std::vector<double> twice_dqp = b1.dqp.values(), twice_dkp = b1.dkp.values();
    for (double& x : twice_dqp) x *= 2;
    for (double& x : twice_dkp) x *= 2;
    EXPECT_TRUE(all_close(b2.dqp.values(), twice_dqp, kTight));
    EXPECT_TRUE(all_close(b2.dkp.values(), twice_dkp, kTight));
  }
}

// ---- call options --------------------------------------------------------------------------

// Options that must not change the result on the CPU: INFER numerics (the fp64 reference is
// exact in both), the optional outputs (indices, proxy_lse, kl) of the forward, the backward's
// proxy_lse input (recomputed when absent), deterministic, and validate on valid indices.
TEST_F(Consistency, OptionalArgumentsDoNotChangeResults) {
  for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE}) {
    const Config c = head_configs(mode, {200, 1, 129}, 2)[1];
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c, rng);
    const Outputs base = run_all(c, in, full_bwd());

    FwdOptions infer;
    infer.numerics = FLASHMSA_NUMERICS_INFER;
    infer.validate = 1;
    const FwdResult fi = run_fwd(c, in, infer);
    EXPECT_TRUE(all_close(fi.out, base.f.out, kTight));
    EXPECT_TRUE(all_close(fi.lse, base.f.lse, kTight));

    FwdOptions bare;
    bare.compute_kl = bare.want_indices = bare.want_proxy_lse = false;
    const FwdResult fb = run_fwd(c, in, bare);
    EXPECT_TRUE(all_close(fb.out, base.f.out, kTight));
    EXPECT_TRUE(all_close(fb.lse, base.f.lse, kTight));

    BwdOptions bo = full_bwd();
    bo.proxy_lse = false;
    bo.validate = 1;
    Outputs recomputed{base.f, run_bwd(c, in, base.f, bo)};
    expect_same_outputs(recomputed, base, kTight);

    // deterministic = 1
    BwdResult bd;
    Tensor dkl;
    flashmsa_bwd_args_t a = bwd_args(c, in, base.f, bd, dkl, full_bwd());
    a.deterministic = 1;
    ASSERT_EQ(flashmsa_bwd(&a, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
    Outputs det{base.f, bd};
    expect_same_outputs(det, base, kTight);
  }
}

// compute_kl = 0 with a kl tensor: kl is the zero placeholder (and still written).
TEST_F(Consistency, KlPlaceholderIsZeroWhenNotComputed) {
  const Config c = head_configs(FLASHMSA_MODE_SPARSE, {300}, 2)[0];
  const Inputs in = make_inputs(c, rng);
  FwdResult r;
  flashmsa_fwd_args_t a = fwd_args(c, in, r);
  a.compute_kl = 0;
  ASSERT_EQ(flashmsa_fwd(&a, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
  EXPECT_EQ(r.kl.get(0), 0.0);
}

// The backward's kl output (what a training loop logs at no extra pass) is the forward's kl value
// for the same inputs, in every mode, with the kl gradient absent, 0 or 0.75, and with the
// backward's proxy lse given or recomputed; asking for it changes no gradient. It is written
// over a poisoned value.
TEST_F(Consistency, BackwardKlEqualsForwardKl) {
  for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE}) {
    for (const Config& c : head_configs(mode, {257, 1, 64, 0}, 2)) {
      SCOPED_TRACE(describe(c));
      if (!c.proxy) continue;
      const Inputs in = make_inputs(c, rng);
      const FwdResult f = run_fwd(c, in);
      ASSERT_GT(f.kl_value(), 0.0);
      for (double g : {double(NAN), 0.0, 0.75})
        for (bool plse : {true, false}) {
          BwdOptions o = full_bwd(std::isnan(g) ? 0.0 : g);
          o.has_dkl = !std::isnan(g);
          o.proxy_lse = plse;
          const BwdResult plain = run_bwd(c, in, f, o);
          BwdResult r;
          Tensor dkl, kl(c.stat_dtype(), {1});
          kl.set(0, NAN);
          flashmsa_bwd_args_t a = bwd_args(c, in, f, r, dkl, o);
          a.kl = kl.view();
          ASSERT_EQ(flashmsa_bwd(&a, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
          EXPECT_EQ(kl.get(0), f.kl_value()) << "g " << g << ", proxy_lse " << plse;
          for (auto m : {&BwdResult::dq, &BwdResult::dk, &BwdResult::dv, &BwdResult::dqp, &BwdResult::dkp})
            EXPECT_TRUE(all_equal(r.*m, plain.*m));
        }
    }
  }
}

// No tokens at all (B = 0, or only empty sequences): every call succeeds, kl = 0.
TEST_F(Consistency, EmptyBatches) {
  for (const std::vector<int64_t>& lens : {std::vector<int64_t>{}, std::vector<int64_t>{0, 0}})
    for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE}) {
      const Config c = head_configs(mode, lens, 2)[0];
      SCOPED_TRACE(describe(c) + ", B = " + std::to_string(lens.size()));
      const Inputs in = make_inputs(c, rng);
      const Outputs o = run_all(c, in, full_bwd());
      EXPECT_EQ(o.f.kl_value(), 0.0);
      if (mode == FLASHMSA_MODE_SPARSE) run_select(c, in);
    }
}

// ---- non-finite inputs ---------------------------------------------------------------------

// Whether any of tokens [t0, t1) of a per-token tensor [total, H, X] holds a NaN (any: t1 < 0 means to the end).
bool nan_in_tokens(const Tensor& t, int64_t t0 = 0, int64_t t1 = -1) {
  const int64_t per = t.shape()[1] * t.shape()[2];
  const int64_t end = t1 < 0 ? t.shape()[0] : t1;
  for (int64_t i = t0 * per; i < end * per; ++i)
    if (std::isnan(t.get(i))) return true;
  return false;
}

bool finite_tokens(const Tensor& t, int64_t t0, int64_t t1) {
  const int64_t per = t.shape()[1] * t.shape()[2];
  for (int64_t i = t0 * per; i < t1 * per; ++i)
    if (!std::isfinite(t.get(i))) return false;
  return true;
}

// A NaN in one element of q, k, qp or kp makes the kl value NaN, the forward's and the backward's, as it makes
// the proxy gradient of the rows it reaches (dz = g/N (s - t) with a NaN teacher or student): value and gradient
// agree. Before, a NaN teacher was dropped from the value (`t > 0` is false for NaN) while its gradient was NaN.
// The other sequence's rows stay finite. A query row (token 150 of sequence 0) for q and qp; a key (token 20) that
// every row of block 0 sees for k and kp.
TEST_F(Consistency, NanInputMakesKlNan) {
  for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE})
    for (const std::string name : {"q", "k", "qp", "kp"}) {
      const Config c = head_configs(mode, {300, 200}, 2)[0];
      SCOPED_TRACE(describe(c) + ", NaN in " + name);
      Inputs in = make_inputs(c, rng);
      Tensor& x = name == "q" ? in.q : name == "k" ? in.k : name == "qp" ? in.qp : in.kp;
      const int64_t tok = name[0] == 'k' ? 20 : 150;
      x.set(tok_index(tok, 0, 1, int(x.shape()[1]), int(x.shape()[2])), NAN);
      const FwdResult f = run_fwd(c, in);
      EXPECT_TRUE(std::isnan(f.kl_value())) << "forward kl " << f.kl_value();
      BwdResult r;
      Tensor dkl, kl(c.stat_dtype(), {1});
      kl.set(0, 0.0);
      flashmsa_bwd_args_t a = bwd_args(c, in, f, r, dkl, full_bwd(1.0));
      a.kl = kl.view();
      ASSERT_EQ(flashmsa_bwd(&a, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
      EXPECT_TRUE(std::isnan(kl.get(0))) << "backward kl " << kl.get(0);
      EXPECT_TRUE(nan_in_tokens(r.dqp, 0, 300)) << "the rows the NaN reaches have a NaN proxy gradient";
      EXPECT_TRUE(finite_tokens(r.dqp, 300, 500) && finite_tokens(r.dkp, 300, 500)) << "sequence 1";
      // the same inputs without the NaN: a finite value (the test's NaN is what makes it NaN)
      x.set(tok_index(tok, 0, 1, int(x.shape()[1]), int(x.shape()[2])), 0.5);
      EXPECT_TRUE(std::isfinite(run_fwd(c, in).kl_value()));
    }
}

// A teacher entry that is exactly 0 (a probability that underflows in fp64) still adds 0 to the kl value
// (0 log 0 = 0), forward and backward, and its gradient stays finite.
TEST_F(Consistency, ZeroTeacherEntriesAddNothing) {
  for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE}) {
    Config c = head_configs(mode, {300}, 2)[0];
    c.scale = 1e4;  // main logits spread by thousands: most P underflow to exactly 0
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c, rng);
    const FwdResult f = run_fwd(c, in);
    EXPECT_TRUE(std::isfinite(f.kl_value()) && f.kl_value() > 0.0) << f.kl_value();
    BwdResult r;
    Tensor dkl, kl(c.stat_dtype(), {1});
    flashmsa_bwd_args_t a = bwd_args(c, in, f, r, dkl, full_bwd(1.0));
    a.kl = kl.view();
    ASSERT_EQ(flashmsa_bwd(&a, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
    EXPECT_EQ(kl.get(0), f.kl_value());
    EXPECT_TRUE(finite_tokens(r.dqp, 0, 300) && finite_tokens(r.dkp, 0, 300));
  }
}

// ---- given indices -------------------------------------------------------------------------

class GivenIndices : public Consistency {
 protected:
  Config given_config() const {
    Config c = head_configs(FLASHMSA_MODE_GIVEN, {300, 129, 5, 0, 400}, 2)[1];
    return c;
  }
  // Rows of indices as vectors (per head, per token) and back.
  static std::vector<std::vector<int64_t>> rows(const Config& c, const Tensor& idx) {
    std::vector<std::vector<int64_t>> r(size_t(c.Hp * c.total()));
    const int64_t K = idx.shape()[2];
    for (size_t i = 0; i < r.size(); ++i)
      for (int64_t s = 0; s < K; ++s) r[i].push_back(int64_t(idx.get(int64_t(i) * K + s)));
    return r;
  }
  static Tensor from_rows(const Config& c, const std::vector<std::vector<int64_t>>& r) {
    Tensor t = c.heads(c.Hp, c.topk, FLASHMSA_DTYPE_INT32);
    for (size_t i = 0; i < r.size(); ++i)
      for (int s = 0; s < c.topk; ++s) t.set(int64_t(i) * c.topk + s, double(r[i][size_t(s)]));
    return t;
  }
  // Sequence of global token t.
  static int seq_of(const Config& c, int64_t t) {
    const auto cu = c.offsets();
    return int(std::upper_bound(cu.begin(), cu.end(), t) - cu.begin()) - 1;
  }
  // Number of blocks of t's sequence, and t's own (local) block.
  static int64_t blocks_of(const Config& c, int64_t t) { return num_blocks(c.lens[size_t(seq_of(c, t))]); }
  static int64_t own_block(const Config& c, int64_t t) {
    return (t - c.offsets()[size_t(seq_of(c, t))]) / kBlock;
  }
};

// Slots outside [0, nblocks) are empty, and blocks after the query's own add no keys: a row
// padded with such slots gives what the row without them gives.
TEST_F(GivenIndices, InvalidAndFutureSlotsAreIgnored) {
  Config c = given_config();
  Inputs in = make_inputs(c, rng);
  const auto clean_rows = rows(c, in.indices);  // each row has a block <= its own
  Config cw = c;
  cw.topk = c.topk + 6;
  auto wide_rows = clean_rows;
  for (size_t r = 0; r < wide_rows.size(); ++r) {
    const int64_t t = int64_t(r) % c.total(), nb = blocks_of(c, t), own = own_block(c, t);
    std::vector<int64_t> junk = {INT_MIN, -123456, -1, nb, INT_MAX};
    // a future block not already in the row (if there is one)
    for (int64_t j = own + 1; j < nb; ++j)
      if (std::find(wide_rows[r].begin(), wide_rows[r].end(), j) == wide_rows[r].end()) {
        junk.push_back(j);
        break;
      }
    junk.resize(6, -1);
    for (int64_t j : junk)  // insert at random places, keeping the order of the others
      wide_rows[r].insert(wide_rows[r].begin() + rng.integer(0, int64_t(wide_rows[r].size())), j);
  }
  // the clean rows without their own future blocks too
  auto trimmed_rows = clean_rows;
  for (size_t r = 0; r < trimmed_rows.size(); ++r) {
    const int64_t own = own_block(c, int64_t(r) % c.total());
    for (int64_t& j : trimmed_rows[r])
      if (j > own) j = -1;
  }
  Inputs in_wide = in, in_trim = in;
  in_wide.indices = from_rows(cw, wide_rows);
  in_trim.indices = from_rows(c, trimmed_rows);
  const Outputs base = run_all(c, in, full_bwd()), wide = run_all(cw, in_wide, full_bwd()),
                trim = run_all(c, in_trim, full_bwd());
  expect_same_outputs(wide, base, kTight);
  expect_same_outputs(trim, base, kTight);
}

// Permuting the slots of every row changes nothing beyond rounding.
TEST_F(GivenIndices, SlotPermutationChangesNothing) {
  const Config c = given_config();
  const Inputs in = make_inputs(c, rng);
  auto r = rows(c, in.indices);
  for (auto& row : r) rng.shuffle(row);
  Inputs perm = in;
  perm.indices = from_rows(c, r);
  expect_same_outputs(run_all(c, perm, full_bwd()), run_all(c, in, full_bwd()), kTight);
}

// A row whose set is empty (every slot invalid, or only blocks after its own) gets out = 0,
// lse = -inf and zero gradients, and its inputs influence nothing (it adds 0 to the kl sum).
TEST_F(GivenIndices, EmptyRowGivesZeroOutputAndNoInfluence) {
  Config c = given_config();
  c.lens = {300, 129};
  Inputs in = make_inputs(c, rng);
  auto r = rows(c, in.indices);
  const int G = c.Hq / c.Hp;
  // (proxy head, token) rows made empty: all slots invalid / only a future block
  const std::vector<std::pair<int, int64_t>> empty = {{0, 5}, {1, 200}, {1, 0}, {0, 300}};
  for (size_t e = 0; e < empty.size(); ++e) {
    auto& row = r[size_t(empty[e].first * c.total() + empty[e].second)];
    std::fill(row.begin(), row.end(), -1);
    if (e == 0) row[1] = 1;  // token 5 of a 300-token sequence: block 1 is in its future
    if (e == 1) row[0] = 7;  // out of range, validate off
  }
  in.indices = from_rows(c, r);
  const Outputs o = run_all(c, in, full_bwd());
  for (const auto& [p, t] : empty)
    for (int h = p * G; h < (p + 1) * G; ++h) {
      SCOPED_TRACE("head " + std::to_string(h) + ", token " + std::to_string(t));
      EXPECT_EQ(o.f.lse.get(int64_t(h) * c.total() + t), -kInf);
      for (int d = 0; d < c.D; ++d) {
        EXPECT_EQ(o.f.out.get(tok_index(t, h, d, c.Hq, c.D)), 0.0);
        EXPECT_EQ(o.b.dq.get(tok_index(t, h, d, c.Hq, c.D)), 0.0);
      }
      for (int d = 0; d < c.Dp; ++d) EXPECT_EQ(o.b.dqp.get(tok_index(t, p, d, c.Hp, c.Dp)), 0.0);
    }
  // new values in the empty rows' q, qp, dout and dlse change nothing
  Inputs in2 = in;
  for (const auto& [p, t] : empty) {
    for (int h = p * G; h < (p + 1) * G; ++h) {
      for (int d = 0; d < c.D; ++d) {
        in2.q.set(tok_index(t, h, d, c.Hq, c.D), rng.normal());
        in2.dout.set(tok_index(t, h, d, c.Hq, c.D), rng.normal());
      }
      in2.dlse.set(int64_t(h) * c.total() + t, rng.normal());
    }
    for (int d = 0; d < c.Dp; ++d) in2.qp.set(tok_index(t, p, d, c.Hp, c.Dp), rng.normal());
  }
  Outputs o2 = run_all(c, in2, full_bwd());
  expect_same_outputs(o2, o, kTight);
}

// ---- storage dtypes ------------------------------------------------------------------------

// bf16 / fp16 / fp32 inputs: every output equals the fp64 result on the same (representable)
// inputs, rounded to the output's dtype (lse, proxy_lse, kl: fp32).
TEST_F(Consistency, LowPrecisionEqualsRoundedFp64) {
  for (flashmsa_dtype_t dt : {FLASHMSA_DTYPE_BF16, FLASHMSA_DTYPE_FP16, FLASHMSA_DTYPE_FP32})
    for (flashmsa_mode_t mode : {FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_GIVEN, FLASHMSA_MODE_DENSE}) {
      Config c64 = head_configs(mode, {1, 257, 130}, 2)[2];
      Inputs in64 = make_inputs(c64, rng);
      round_inputs_to(in64, dt);
      Config c = c64;
      c.dtype = dt;
      SCOPED_TRACE(describe(c));
      const Inputs in = relayout(in64, c);
      const double g = 0.75;  // exact in fp32
      const Outputs ref = run_all(c64, in64, full_bwd(g)), got = run_all(c, in, full_bwd(g));
      auto rounded = [](const Tensor& t, flashmsa_dtype_t to) {
        std::vector<double> v = t.values();
        for (double& x : v) x = flashmsa::round_to(to, x);
        return v;
      };
      const auto f32 = FLASHMSA_DTYPE_FP32;
      EXPECT_EQ(got.f.out.dtype(), dt);
      EXPECT_EQ(got.f.lse.dtype(), f32);
      EXPECT_TRUE(all_equal(got.f.out.values(), rounded(ref.f.out, dt))) << "out";
      EXPECT_TRUE(all_equal(got.f.lse.values(), rounded(ref.f.lse, f32))) << "lse";
      EXPECT_TRUE(all_equal(got.f.proxy_lse.values(), rounded(ref.f.proxy_lse, f32))) << "proxy_lse";
      EXPECT_TRUE(all_equal(got.f.kl.values(), rounded(ref.f.kl, f32))) << "kl";
      if (mode == FLASHMSA_MODE_SPARSE) {
        EXPECT_TRUE(all_equal(got.f.indices, ref.f.indices)) << "indices";
      }
      for (auto m : {&BwdResult::dq, &BwdResult::dk, &BwdResult::dv, &BwdResult::dqp, &BwdResult::dkp})
        EXPECT_TRUE(all_equal((got.b.*m).values(), rounded(ref.b.*m, dt)));
    }
}

// out_lo (the precise-dpsum input): the low part of the fp64 output in the output dtype, so
// out + out_lo carries ~16 more bits than out; the backward accepts it (the CPU backend's dpsum
// uses the exact fp64 output either way, so the gradients are unchanged).
TEST_F(Consistency, OutLoIsTheLowPartOfTheOutput) {
  Config c64;
  c64.lens = {300, 129};
  Inputs in64 = make_inputs(c64, rng);
  round_inputs_to(in64, FLASHMSA_DTYPE_BF16);
  Config c = c64;
  c.dtype = FLASHMSA_DTYPE_BF16;
  const Inputs in = relayout(in64, c);
  const FwdResult ref = run_fwd(c64, in64);
  FwdResult f;
  flashmsa_fwd_args_t a = fwd_args(c, in, f);
  Tensor lo = c.tokens(c.Hq, c.D);
  a.out_lo = lo.view();
  ASSERT_EQ(flashmsa_fwd(&a, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
  const auto o64 = ref.out.values(), hi = f.out.values(), low = lo.values();
  double e_hi = 0, e_two = 0, n = 0;
  for (size_t i = 0; i < o64.size(); ++i) {
    const double want_lo = flashmsa::round_to(FLASHMSA_DTYPE_BF16, o64[i] - hi[i]);
    ASSERT_EQ(low[i], want_lo) << "element " << i;
    e_hi += (hi[i] - o64[i]) * (hi[i] - o64[i]);
    e_two += (hi[i] + low[i] - o64[i]) * (hi[i] + low[i] - o64[i]);
    n += o64[i] * o64[i];
  }
  std::printf("    rel-L2 vs fp64: out %.3e, out + out_lo %.3e\n", std::sqrt(e_hi / n), std::sqrt(e_two / n));
  EXPECT_LT(std::sqrt(e_two / n), std::sqrt(e_hi / n) / 64);
  // the backward takes it
  BwdResult b0, b1;
  Tensor dkl0, dkl1;
  flashmsa_bwd_args_t ba0 = bwd_args(c, in, f, b0, dkl0), ba1 = bwd_args(c, in, f, b1, dkl1);
  ba1.out_lo = lo.view();
  ASSERT_EQ(flashmsa_bwd(&ba0, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
  ASSERT_EQ(flashmsa_bwd(&ba1, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
  EXPECT_TRUE(all_equal(b0.dq.values(), b1.dq.values()));
}

}  // namespace
}  // namespace fmtest
