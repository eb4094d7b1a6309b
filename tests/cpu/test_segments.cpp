// Query segments (cu_seqlens_q, q_origin: the C header's "Query segments"): the rows of a whole
// varlen problem split into chunks over several "ranks", each rank's call given its chunks as
// segments against all keys, must give the whole call's rows (selection, out, lse, proxy_lse,
// dq, dqp), its kl as the row-weighted mean, and its key gradients as the sum over ranks.
// Plus every bad-input class of the new arguments.
#include <functional>

#include "test_util.hpp"

namespace fmtest {
namespace {

// One rank's share: its segments (key sequence, first position, length) in the order of its rows.
struct Seg {
  int b;
  int64_t pos, len;
};

// A per-token tensor holding rows `rows` of src ([total, H, X] contiguous fp64).
Tensor take_rows(const Tensor& src, const std::vector<int64_t>& rows) {
  const int64_t H = src.shape()[1], X = src.shape()[2];
  Tensor t(src.dtype(), {int64_t(rows.size()), H, X});
  for (size_t r = 0; r < rows.size(); ++r)
    for (int64_t e = 0; e < H * X; ++e) t.set(int64_t(r) * H * X + e, src.get(rows[r] * H * X + e));
  return t;
}

// Columns `rows` of a per-head tensor [H, total(, K)].
Tensor take_cols(const Tensor& src, const std::vector<int64_t>& rows) {
  const int64_t H = src.shape()[0], T = src.shape()[1], K = src.shape().size() == 3 ? src.shape()[2] : 1;
  std::vector<int64_t> shape{H, int64_t(rows.size())};
  if (src.shape().size() == 3) shape.push_back(K);
  Tensor t(src.dtype(), shape);
  for (int64_t h = 0; h < H; ++h)
    for (size_t r = 0; r < rows.size(); ++r)
      for (int64_t k = 0; k < K; ++k) t.set((h * int64_t(rows.size()) + int64_t(r)) * K + k, src.get((h * T + rows[r]) * K + k));
  return t;
}

struct Rank {
  std::vector<Seg> segs;
  std::vector<int64_t> rows;  // the whole problem's rows, in this rank's order
  Tensor cuq, origin;
  int64_t max_len = 0;
};

Rank make_rank(const std::vector<Seg>& segs, const std::vector<int64_t>& cu) {
  Rank r;
  r.segs = segs;
  r.cuq = Tensor(FLASHMSA_DTYPE_INT32, {int64_t(segs.size()) + 1});
  r.origin = Tensor(FLASHMSA_DTYPE_INT32, {int64_t(segs.size()), 2});
  r.cuq.set(0, 0);
  for (size_t s = 0; s < segs.size(); ++s) {
    for (int64_t i = 0; i < segs[s].len; ++i) r.rows.push_back(cu[size_t(segs[s].b)] + segs[s].pos + i);
    r.cuq.set(int64_t(s) + 1, double(r.rows.size()));
    r.origin.set(int64_t(s) * 2, segs[s].b);
    r.origin.set(int64_t(s) * 2 + 1, double(segs[s].pos));
    r.max_len = std::max(r.max_len, segs[s].len);
  }
  return r;
}

template <class Args>
void set_segments(Args& a, const Rank& r) {
  a.cu_seqlens_q = r.cuq.view();
  a.q_origin = r.origin.view();
  a.max_seqlen_q = r.max_len;
}

void expect_same(const Tensor& got, const Tensor& want, const char* what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  for (int64_t i = 0; i < got.numel(); ++i)
    if (!(got.get(i) == want.get(i))) {
      ADD_FAILURE() << what << ": element " << i << " is " << got.get(i) << ", the whole call's " << want.get(i);
      return;
    }
}

// Splits every sequence at random cut points into chunks and deals them to P ranks in a
// scrambled order (zigzag-like: a rank holds chunks of several sequences, not in order), with an
// empty segment on rank 0.
std::vector<std::vector<Seg>> deal(const Config& c, int P, Rng& rng) {
  std::vector<std::vector<Seg>> ranks(static_cast<size_t>(P));
  int next = 0;
  for (int b = 0; b < c.batch(); ++b) {
    const int64_t len = c.lens[size_t(b)];
    std::vector<int64_t> cuts{0, len};
    for (int i = 0; i < 3 && len > 1; ++i) cuts.push_back(rng.integer(1, len - 1));
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      ranks[size_t(next % P)].push_back({b, cuts[i], cuts[i + 1] - cuts[i]});
      next += 1 + int(rng.integer(0, 1));
    }
  }
  for (auto& r : ranks) rng.shuffle(r);
  ranks[0].push_back({c.batch() - 1, 0, 0});
  return ranks;
}

class Segments : public SeededParamTest<flashmsa_mode_t> {};

TEST_P(Segments, RanksEqualTheWholeCall) {
  Config c;
  c.lens = {300, 0, 129, 513, 1};
  c.Hq = 4, c.Hkv = 2, c.Hp = 2, c.Hpk = 1, c.D = 8, c.Dp = 8, c.topk = 3;
  c.mode = GetParam();
  const Inputs in = make_inputs(c, rng);
  const FwdResult whole = run_fwd(c, in);
  BwdOptions bo;
  bo.dlse = true;
  const BwdResult wg = run_bwd(c, in, whole, bo);
  const auto cu = c.offsets();
  const int P = 3;
  const auto dealt = deal(c, P, rng);
  const double N = double(c.Hp) * double(c.total());
  double kl_sum = 0;
  std::vector<double> dk(size_t(wg.dk.numel()), 0.0), dv(dk.size(), 0.0), dkp(size_t(wg.dkp.numel()), 0.0);
  for (int p = 0; p < P; ++p) {
    SCOPED_TRACE("rank " + std::to_string(p));
    const Rank r = make_rank(dealt[size_t(p)], cu);
    const int64_t Tq = int64_t(r.rows.size());
    Tensor q = take_rows(in.q, r.rows), qp = take_rows(in.qp, r.rows), dout = take_rows(in.dout, r.rows);
    Tensor dlse = take_cols(in.dlse, r.rows);
    Tensor given = c.mode == FLASHMSA_MODE_GIVEN ? take_cols(in.indices, r.rows) : Tensor();
    // the forward
    flashmsa::FwdArgs fa;
    fa.q = q.view(), fa.k = in.k.view(), fa.v = in.v.view(), fa.qp = qp.view(), fa.kp = in.kp.view();
    fa.cu_seqlens = in.cu.view();
    fa.max_seqlen = c.max_len();
    set_segments(fa, r);
    fa.mode = c.mode;
    fa.topk = c.mode == FLASHMSA_MODE_SPARSE ? c.topk : 0;
    Tensor out(FLASHMSA_DTYPE_FP64, {Tq, c.Hq, c.D}), lse(FLASHMSA_DTYPE_FP64, {c.Hq, Tq}),
        plse(FLASHMSA_DTYPE_FP64, {c.Hp, Tq}), idx(FLASHMSA_DTYPE_INT32, {c.Hp, Tq, c.topk}),
        kl(FLASHMSA_DTYPE_FP64, {1});
    fa.out = out.view(), fa.lse = lse.view(), fa.proxy_lse = plse.view(), fa.kl = kl.view();
    fa.compute_kl = 1;
    if (c.mode == FLASHMSA_MODE_GIVEN) fa.indices = given.view();
    if (c.mode == FLASHMSA_MODE_SPARSE) fa.indices = idx.view();
    ASSERT_EQ(flashmsa_fwd(&fa, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
    expect_same(out, take_rows(whole.out, r.rows), "out");
    expect_same(lse, take_cols(whole.lse, r.rows), "lse");
    expect_same(plse, take_cols(whole.proxy_lse, r.rows), "proxy_lse");
    if (c.mode == FLASHMSA_MODE_SPARSE) expect_same(idx, take_cols(whole.indices, r.rows), "indices");
    const double Nr = double(c.Hp) * double(Tq);
    kl_sum += kl.get(0) * Nr;
    // the backward: dkl scaled so that dz = (g / N) (s - t), as in the whole call
    flashmsa::BwdArgs ba;
    ba.q = q.view(), ba.k = in.k.view(), ba.v = in.v.view(), ba.qp = qp.view(), ba.kp = in.kp.view();
    ba.cu_seqlens = in.cu.view();
    ba.max_seqlen = c.max_len();
    set_segments(ba, r);
    ba.mode = c.mode;
    ba.indices = c.mode == FLASHMSA_MODE_GIVEN ? given.view() : c.mode == FLASHMSA_MODE_SPARSE ? idx.view() : flashmsa::none();
    ba.out = out.view(), ba.lse = lse.view(), ba.proxy_lse = plse.view();
    ba.dout = dout.view(), ba.dlse = dlse.view();
    Tensor dkl(FLASHMSA_DTYPE_FP64, {1});
    dkl.set(0, bo.dkl * Nr / N);
    ba.dkl = dkl.view();
    Tensor dq(FLASHMSA_DTYPE_FP64, {Tq, c.Hq, c.D}), dqp(FLASHMSA_DTYPE_FP64, {Tq, c.Hp, c.Dp}),
        dkr = c.tokens(c.Hkv, c.D), dvr = c.tokens(c.Hkv, c.D), dkpr = c.tokens(c.Hpk, c.Dp);
    ba.dq = dq.view(), ba.dk = dkr.view(), ba.dv = dvr.view(), ba.dqp = dqp.view(), ba.dkp = dkpr.view();
    ASSERT_EQ(flashmsa_bwd(&ba, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
    EXPECT_LE(rel_l2(dq.values(), take_rows(wg.dq, r.rows).values()), 1e-13);
    EXPECT_LE(rel_l2(dqp.values(), take_rows(wg.dqp, r.rows).values()), 1e-12);
    const auto a = dkr.values(), b2 = dvr.values(), c2 = dkpr.values();
    for (size_t i = 0; i < dk.size(); ++i) dk[i] += a[i], dv[i] += b2[i];
    for (size_t i = 0; i < dkp.size(); ++i) dkp[i] += c2[i];
  }
  EXPECT_NEAR(kl_sum / N, whole.kl_value(), 1e-12 * std::abs(whole.kl_value()) + 1e-300);
  EXPECT_GT(whole.kl_value(), 0.0);
  EXPECT_LE(rel_l2(dk, wg.dk.values()), 1e-12);
  EXPECT_LE(rel_l2(dv, wg.dv.values()), 1e-12);
  EXPECT_LE(rel_l2(dkp, wg.dkp.values()), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(Modes, Segments,
                         ::testing::Values(FLASHMSA_MODE_SPARSE, FLASHMSA_MODE_DENSE, FLASHMSA_MODE_GIVEN),
                         [](const auto& p) {
                           return std::string(p.param == FLASHMSA_MODE_SPARSE  ? "Sparse"
                                              : p.param == FLASHMSA_MODE_DENSE ? "Dense"
                                                                                  : "Given");
                         });

// The selection call alone, with one segment per sequence against all keys.
TEST(SegmentsSelect, ChunkEqualsWholeRows) {
  Rng rng(test_seed());
  Config c;
  c.lens = {700, 260};
  c.Hp = 2, c.Hpk = 1, c.Dp = 8, c.topk = 4;
  const Inputs in = make_inputs(c, rng);
  const SelectResult whole = run_select(c, in);
  const Rank r = make_rank({{0, 385, 315}, {1, 3, 250}}, c.offsets());
  Tensor qp = take_rows(in.qp, r.rows);
  flashmsa::SelectArgs a;
  a.qp = qp.view(), a.kp = in.kp.view(), a.cu_seqlens = in.cu.view();
  a.max_seqlen = c.max_len();
  set_segments(a, r);
  a.topk = c.topk;
  Tensor idx(FLASHMSA_DTYPE_INT32, {c.Hp, int64_t(r.rows.size()), c.topk}),
      plse(FLASHMSA_DTYPE_FP64, {c.Hp, int64_t(r.rows.size())});
  a.indices = idx.view(), a.proxy_lse = plse.view();
  ASSERT_EQ(flashmsa_select(&a, nullptr, 0), FLASHMSA_SUCCESS) << flashmsa_last_error();
  expect_same(idx, take_cols(whole.indices, r.rows), "indices");
  expect_same(plse, take_cols(whole.proxy_lse, r.rows), "proxy_lse");
}

// Every bad value of the new arguments: INVALID_ARGUMENT naming it, outputs untouched.
TEST(SegmentsErrors, BadSegmentsFailAndWriteNothing) {
  Rng rng(test_seed());
  Config c;
  c.lens = {300, 129};
  c.Hq = 4, c.Hkv = 2, c.Hp = 2, c.Hpk = 1, c.D = 8, c.Dp = 8, c.topk = 3;
  const Inputs in = make_inputs(c, rng);
  const Rank good = make_rank({{0, 100, 150}, {1, 0, 129}}, c.offsets());
  Tensor q = take_rows(in.q, good.rows), qp = take_rows(in.qp, good.rows);
  const int64_t Tq = int64_t(good.rows.size());
  struct Case {
    const char* what;
    std::string expect;  // a piece of the message
    std::function<void(flashmsa::FwdArgs&, Tensor&, Tensor&)> edit;
  };
  auto set_cuq = [](Tensor& cuq, int i, double v) { cuq.set(i, v); };
  std::vector<Case> cases = {
      {"origin without cu_seqlens_q", "q_origin: needs cu_seqlens_q",
       [](flashmsa::FwdArgs& a, Tensor&, Tensor&) { a.cu_seqlens_q = flashmsa::none(); }},
      {"cu_seqlens_q without origin", "q_origin: is required",
       [](flashmsa::FwdArgs& a, Tensor&, Tensor&) { a.q_origin = flashmsa::none(); }},
      {"max_seqlen_q without segments", "max_seqlen_q: expected 0",
       [](flashmsa::FwdArgs& a, Tensor&, Tensor&) { a.cu_seqlens_q = a.q_origin = flashmsa::none(); }},
      {"origin of the wrong shape", "q_origin: expected shape [2, 2]",
       [](flashmsa::FwdArgs& a, Tensor&, Tensor&) { a.q_origin.shape[1] = 1; }},
      {"cu_seqlens_q not int32", "cu_seqlens_q: expected dtype int32",
       [](flashmsa::FwdArgs& a, Tensor&, Tensor&) { a.cu_seqlens_q.dtype = FLASHMSA_DTYPE_FP32; }},
      {"first value not 0", "expected cu_seqlens_q[0] = 0",
       [&](flashmsa::FwdArgs&, Tensor& cuq, Tensor&) { set_cuq(cuq, 0, 1); }},
      {"decreasing", "expected non-decreasing values",
       [&](flashmsa::FwdArgs&, Tensor& cuq, Tensor&) { set_cuq(cuq, 2, 100); }},
      {"last value not total_q", "expected the last value to equal total_q",
       [&](flashmsa::FwdArgs&, Tensor& cuq, Tensor&) { set_cuq(cuq, 2, 200); }},
      {"segment longer than max_seqlen_q", "max_seqlen_q: expected >= every segment length",
       [](flashmsa::FwdArgs& a, Tensor&, Tensor&) { a.max_seqlen_q = 100; }},
      {"key sequence out of range", "key sequence 2 is outside [0, 2)",
       [](flashmsa::FwdArgs&, Tensor&, Tensor& o) { o.set(2, 2); }},
      {"negative key sequence", "key sequence -1 is outside",
       [](flashmsa::FwdArgs&, Tensor&, Tensor& o) { o.set(0, -1); }},
      {"negative position", "positions [-1, 149)",
       [](flashmsa::FwdArgs&, Tensor&, Tensor& o) { o.set(1, -1); }},
      {"queries past the sequence's end", "positions [151, 301) of its 150 queries are outside [0, 300)",
       [](flashmsa::FwdArgs&, Tensor&, Tensor& o) { o.set(1, 151); }},
      {"queries past a shorter sequence", "of key sequence 0",
       [](flashmsa::FwdArgs&, Tensor&, Tensor& o) { o.set(2, 0), o.set(3, 200); }},
      {"k rows disagree with cu_seqlens", "expected the last value to equal total = 400 (tokens in k)",
       [](flashmsa::FwdArgs& a, Tensor&, Tensor&) { a.k.shape[0] = a.v.shape[0] = a.kp.shape[0] = 400; }},
      {"v rows disagree with k", "v: expected total_k = 429 key tokens (from k)",
       [](flashmsa::FwdArgs& a, Tensor&, Tensor&) { a.v.shape[0] = 428; }},
      {"qp rows disagree with q", "qp: expected total_q = 279 query tokens (from q)",
       [](flashmsa::FwdArgs& a, Tensor&, Tensor&) { a.qp.shape[0] = 278; }},
  };
  for (const auto& cs : cases) {
    SCOPED_TRACE(cs.what);
    Rank r = make_rank({{0, 100, 150}, {1, 0, 129}}, c.offsets());
    flashmsa::FwdArgs a;
    a.q = q.view(), a.k = in.k.view(), a.v = in.v.view(), a.qp = qp.view(), a.kp = in.kp.view();
    a.cu_seqlens = in.cu.view();
    a.max_seqlen = c.max_len();
    set_segments(a, r);
    a.topk = c.topk;
    Tensor out(FLASHMSA_DTYPE_FP64, {Tq, c.Hq, c.D}), lse(FLASHMSA_DTYPE_FP64, {c.Hq, Tq});
    a.out = out.view(), a.lse = lse.view();
    cs.edit(a, r.cuq, r.origin);
    a.cu_seqlens_q.data = a.cu_seqlens_q.ndim ? r.cuq.data() : nullptr;
    a.q_origin.data = a.q_origin.ndim ? r.origin.data() : nullptr;
    EXPECT_EQ(flashmsa_fwd(&a, nullptr, 0), FLASHMSA_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(flashmsa_last_error()).find(cs.expect), std::string::npos) << flashmsa_last_error();
    for (double x : out.values()) ASSERT_TRUE(std::isnan(x)) << "out was written";
    for (double x : lse.values()) ASSERT_TRUE(std::isnan(x)) << "lse was written";
  }
  // batched inputs have no query segments
  Config cb = c;
  cb.lens = {256, 256};
  cb.batched = true;
  const Inputs ib = make_inputs(cb, rng);
  FwdResult rb;
  flashmsa_fwd_args_t a = fwd_args(cb, ib, rb);
  const Rank r = make_rank({{0, 0, 10}}, cb.offsets());
  set_segments(a, r);
  EXPECT_EQ(flashmsa_fwd(&a, nullptr, 0), FLASHMSA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashmsa_last_error()).find("cu_seqlens_q: needs varlen"), std::string::npos)
      << flashmsa_last_error();
}

}  // namespace
}  // namespace fmtest
