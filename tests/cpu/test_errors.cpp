// Bad input (SPEC.md section 2): every case starts from a valid call of flashmsa_select,
// flashmsa_fwd or flashmsa_bwd, breaks one thing, and checks the status, that the message
// names the entry point and the argument (and, where given, the expected and actual values),
// and that no buffer of the call changed: outputs keep their NaN poison, inputs their data.
#include <deque>
#include <functional>

#include "test_util.hpp"

namespace fmtest {
namespace {

enum class Entry { Select, Fwd, Bwd, FwdWorkspace };

const char* entry_name(Entry e) {
  switch (e) {
    case Entry::Select: return "flashmsa_select";
    case Entry::Fwd: return "flashmsa_fwd";
    case Entry::Bwd: return "flashmsa_bwd";
    case Entry::FwdWorkspace: return "flashmsa_fwd";  // validation messages name the call
  }
  return "?";
}

// A valid problem and valid arguments of every entry point, over buffers owned here.
// total = 300 tokens in 3 sequences (100, 0, 200); Hq 4, Hkv 2, Hp 2, Hpk 1; D = Dp = 8.
struct ValidCall {
  Config c;
  Inputs in;
  Tensor given;       // valid given indices [Hp, total, 2]
  FwdResult fwd_in;   // a real forward: the out / lse inputs of the backward
  SelectResult sel;   // outputs of the select call (poisoned)
  FwdResult fwd;      // outputs of the fwd call (poisoned)
  BwdResult bwd;      // outputs of the bwd call (poisoned)
  Tensor dkl;
  std::deque<Tensor> extra;  // buffers made by a case
  flashmsa_select_args_t sa;
  flashmsa_fwd_args_t fa;
  flashmsa_bwd_args_t ba;
  bool null_args = false, null_bytes = false;

  explicit ValidCall(Rng& rng) {
    c.lens = {100, 0, 200};
    c.Hq = 4;
    c.Hkv = 2;
    c.Hp = 2;
    c.Hpk = 1;
    c.topk = 2;
    in = make_inputs(c, rng);
    Config cg = c;
    cg.mode = FLASHMSA_MODE_GIVEN;
    given = random_given_indices(cg, rng);
    fwd_in = run_fwd(c, in);
    sa = select_args(c, in, sel);
    fa = fwd_args(c, in, fwd);
    BwdOptions bo;
    bo.dlse = true;
    ba = bwd_args(c, in, fwd_in, bwd, dkl, bo);
  }
  ValidCall(const ValidCall&) = delete;
  ValidCall& operator=(const ValidCall&) = delete;

  // A new zero-filled buffer kept alive by the setup.
  flashmsa_tensor_t make(flashmsa_dtype_t dt, std::vector<int64_t> shape) {
    extra.emplace_back(dt, std::move(shape));
    for (int64_t i = 0; i < extra.back().numel(); ++i) extra.back().set(i, 0.0);
    return extra.back().view();
  }
  flashmsa_tensor_t make_values(flashmsa_dtype_t dt, std::vector<int64_t> shape,
                                const std::vector<double>& values) {
    flashmsa_tensor_t t = make(dt, std::move(shape));
    extra.back().set_values(values);
    return t;
  }
  // GIVEN-mode forward / backward with these indices (copies of the valid ones with edits).
  flashmsa_tensor_t given_with(const std::vector<std::pair<int64_t, double>>& edits) {
    extra.push_back(given);
    for (const auto& e : edits) extra.back().set(e.first, e.second);
    return extra.back().view();
  }
  void use_given_fwd(flashmsa_tensor_t idx) {
    fa.mode = FLASHMSA_MODE_GIVEN;
    fa.indices = idx;
  }

  std::vector<const Tensor*> buffers() const {
    std::vector<const Tensor*> v = {&in.q, &in.k, &in.v, &in.qp, &in.kp, &in.cu, &in.dout, &in.dlse,
                                    &given, &fwd_in.out, &fwd_in.lse, &fwd_in.indices,
                                    &fwd_in.proxy_lse, &fwd_in.kl, &sel.indices, &sel.proxy_lse,
                                    &fwd.out, &fwd.lse, &fwd.indices, &fwd.proxy_lse, &fwd.kl,
                                    &bwd.dq, &bwd.dk, &bwd.dv, &bwd.dqp, &bwd.dkp, &dkl};
    for (const Tensor& t : extra) v.push_back(&t);
    return v;
  }

  flashmsa_status_t call(Entry e) {
    size_t bytes = 0;
    switch (e) {
      case Entry::Select: return flashmsa_select(null_args ? nullptr : &sa, nullptr, 0);
      case Entry::Fwd: return flashmsa_fwd(null_args ? nullptr : &fa, nullptr, 0);
      case Entry::Bwd: return flashmsa_bwd(null_args ? nullptr : &ba, nullptr, 0);
      case Entry::FwdWorkspace:
        return flashmsa_fwd_workspace_size(null_args ? nullptr : &fa, null_bytes ? nullptr : &bytes);
    }
    return FLASHMSA_ERROR_INTERNAL;
  }
};

struct ErrorCase {
  std::string name;
  Entry entry;
  std::function<void(ValidCall&)> mutate;
  std::vector<std::string> message;  // substrings of flashmsa_last_error()
  flashmsa_status_t status = FLASHMSA_ERROR_INVALID_ARGUMENT;
};
std::ostream& operator<<(std::ostream& os, const ErrorCase& c) { return os << c.name; }

class BadInput : public SeededParamTest<ErrorCase> {};

TEST_P(BadInput, IsRejectedAndWritesNothing) {
  const ErrorCase& ec = GetParam();
  ValidCall s(rng);
  ec.mutate(s);
  std::vector<std::vector<unsigned char>> before;
  for (const Tensor* t : s.buffers()) before.push_back(t->bytes());
  const flashmsa_status_t st = s.call(ec.entry);
  const std::string msg = flashmsa_last_error();
  EXPECT_EQ(st, ec.status) << msg;
  EXPECT_EQ(msg.rfind(entry_name(ec.entry), 0), 0u) << "the message names the entry point: " << msg;
  for (const std::string& part : ec.message)
    EXPECT_NE(msg.find(part), std::string::npos) << "expected \"" << part << "\" in: " << msg;
  const auto after = s.buffers();
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_TRUE(after[i]->bytes() == before[i]) << "buffer " << i << " changed; " << msg;
}

using E = Entry;
constexpr auto I32 = FLASHMSA_DTYPE_INT32;
constexpr auto F32 = FLASHMSA_DTYPE_FP32;
constexpr auto F64 = FLASHMSA_DTYPE_FP64;

// Valid cu_seqlens are {0, 100, 100, 300}; max_seqlen 200.
std::vector<ErrorCase> error_cases() {
  const double nan = std::nan(""), inf = kInf;
  return {
      // ---- flashmsa_select
      {"SelectNullArgs", E::Select, [](ValidCall& s) { s.null_args = true; }, {"args is NULL"}},
      {"SelectQpRank2", E::Select, [](ValidCall& s) { s.sa.qp = s.make(F64, {300, 16}); },
       {"qp", "expected 3 dimensions", "got 2"}},
      {"SelectQpInt32", E::Select, [](ValidCall& s) { s.sa.qp.dtype = I32; }, {"qp", "floating dtype", "int32"}},
      {"SelectKpDtypeMismatch", E::Select, [](ValidCall& s) { s.sa.kp = s.make(F32, {300, 1, 8}); },
       {"kp", "expected dtype fp64", "got fp32"}},
      {"SelectKpDpMismatch", E::Select, [](ValidCall& s) { s.sa.kp = s.make(F64, {300, 1, 4}); },
       {"kp", "Dp = 8", "got 4"}},
      {"SelectTopk0", E::Select, [](ValidCall& s) { s.sa.topk = 0; }, {"topk", "1 <= topk <= 64", "got 0"}},
      {"SelectTopk65", E::Select, [](ValidCall& s) { s.sa.topk = 65; }, {"topk", "got 65"}},
      {"SelectHpNotMultipleOfHpk", E::Select, [](ValidCall& s) { s.sa.kp = s.make(F64, {300, 3, 8}); },
       {"Hpk", "Hp (2)", "(3)"}},
      {"SelectIndicesWrongShape", E::Select, [](ValidCall& s) { s.sa.indices = s.make(I32, {2, 300, 3}); },
       {"indices", "expected shape [2, 300, 2]", "got [2, 300, 3]"}},
      {"SelectIndicesFp32", E::Select, [](ValidCall& s) { s.sa.indices = s.make(F32, {2, 300, 2}); },
       {"indices", "int32", "got fp32"}},
      {"SelectIndicesMissing", E::Select, [](ValidCall& s) { s.sa.indices = flashmsa::none(); },
       {"indices", "required"}},
      {"SelectProxyLseInt32", E::Select, [](ValidCall& s) { s.sa.proxy_lse = s.make(I32, {2, 300}); },
       {"proxy_lse", "got int32"}},
      {"SelectProxyScaleNegative", E::Select, [](ValidCall& s) { s.sa.proxy_scale = -0.5; },
       {"proxy_scale", "finite value > 0", "-0.5"}},
      {"SelectCuDecreasing", E::Select,
       [](ValidCall& s) { s.sa.cu_seqlens = s.make_values(I32, {4}, {0, 150, 100, 300}); },
       {"cu_seqlens", "non-decreasing"}},
      {"SelectKpOnCuda", E::Select, [](ValidCall& s) { s.sa.kp.device_type = FLASHMSA_DEVICE_CUDA; },
       {"kp", "expected device cpu", "cuda"}},
      // ---- flashmsa_fwd: tensors
      {"FwdNullArgs", E::Fwd, [](ValidCall& s) { s.null_args = true; }, {"args is NULL"}},
      {"FwdQRank5", E::Fwd, [](ValidCall& s) { s.fa.q.ndim = 5; }, {"q", "at most 4", "got 5"}},
      {"FwdQInt32", E::Fwd, [](ValidCall& s) { s.fa.q.dtype = I32; }, {"q", "floating dtype", "int32"}},
      {"FwdKWrongTotal", E::Fwd, [](ValidCall& s) { s.fa.k = s.make(F64, {299, 2, 8}); },
       {"k", "total = 300", "got 299"}},
      {"FwdVDtypeMismatch", E::Fwd, [](ValidCall& s) { s.fa.v = s.make(F32, {300, 2, 8}); },
       {"v", "expected dtype fp64", "got fp32"}},
      {"FwdKOnCuda", E::Fwd, [](ValidCall& s) { s.fa.k.device_type = FLASHMSA_DEVICE_CUDA; },
       {"k", "expected device cpu", "cuda:0"}},
      {"FwdVLastDimStrided", E::Fwd,
       [](ValidCall& s) {
         s.fa.v = s.make(F64, {300, 2, 16});
         s.fa.v.shape[2] = 8;
         s.fa.v.strides[2] = 2;
       },
       {"v", "contiguous", "stride 2"}},
      {"FwdNegativeStride", E::Fwd, [](ValidCall& s) { s.fa.q.strides[0] = -32; }, {"q", "negative stride"}},
      {"FwdNullDataWithElements", E::Fwd, [](ValidCall& s) { s.fa.k.data = nullptr; }, {"k", "NULL"}},
      {"FwdHqNotMultipleOfHkv", E::Fwd,
       [](ValidCall& s) {
         s.fa.k = s.make(F64, {300, 3, 8});
         s.fa.v = s.make(F64, {300, 3, 8});
       },
       {"Hq (4)", "Hkv (3)"}},
      {"FwdHqNotMultipleOfHp", E::Fwd, [](ValidCall& s) { s.fa.qp = s.make(F64, {300, 3, 8}); },
       {"Hq (4)", "Hp (3)"}},
      {"FwdHpNotMultipleOfHpk", E::Fwd, [](ValidCall& s) { s.fa.kp = s.make(F64, {300, 3, 8}); },
       {"Hp (2)", "Hpk (3)"}},
      {"FwdQpWithoutKp", E::Fwd, [](ValidCall& s) { s.fa.kp = flashmsa::none(); }, {"kp", "together"}},
      {"FwdSparseWithoutProxy", E::Fwd,
       [](ValidCall& s) {
         s.fa.qp = s.fa.kp = s.fa.proxy_lse = s.fa.kl = flashmsa::none();
         s.fa.compute_kl = 0;
       },
       {"qp", "required in SPARSE mode"}},
      {"FwdTopk0", E::Fwd, [](ValidCall& s) { s.fa.topk = 0; }, {"topk", "got 0"}},
      {"FwdTopk65", E::Fwd, [](ValidCall& s) { s.fa.topk = 65; }, {"topk", "got 65"}},
      {"FwdModeUnknown", E::Fwd, [](ValidCall& s) { s.fa.mode = flashmsa_mode_t(7); }, {"mode", "got 7"}},
      {"FwdNumericsUnknown", E::Fwd, [](ValidCall& s) { s.fa.numerics = flashmsa_numerics_t(3); }, {"numerics", "got 3"}},
      // ---- flashmsa_fwd: sequences
      {"FwdCuNotInt32", E::Fwd, [](ValidCall& s) { s.fa.cu_seqlens = s.make_values(F32, {4}, {0, 100, 100, 300}); },
       {"cu_seqlens", "int32", "got fp32"}},
      {"FwdCuEmpty", E::Fwd, [](ValidCall& s) { s.fa.cu_seqlens = s.make(I32, {0}); },
       {"cu_seqlens", "[B+1]", "got [0]"}},
      {"FwdCuMissing", E::Fwd, [](ValidCall& s) { s.fa.cu_seqlens = flashmsa::none(); }, {"cu_seqlens", "required"}},
      {"FwdCuDecreasing", E::Fwd, [](ValidCall& s) { s.fa.cu_seqlens = s.make_values(I32, {4}, {0, 150, 100, 300}); },
       {"cu_seqlens", "non-decreasing", "100 < "}},
      {"FwdCuNotEndingAtTotal", E::Fwd,
       [](ValidCall& s) { s.fa.cu_seqlens = s.make_values(I32, {4}, {0, 100, 100, 299}); },
       {"cu_seqlens", "total = 300", "got 299"}},
      {"FwdCuTooShort", E::Fwd, [](ValidCall& s) { s.fa.cu_seqlens = s.make_values(I32, {3}, {0, 100, 100}); },
       {"cu_seqlens", "total = 300", "got 100"}},
      {"FwdCuFirstNotZero", E::Fwd, [](ValidCall& s) { s.fa.cu_seqlens = s.make_values(I32, {4}, {5, 100, 100, 300}); },
       {"cu_seqlens[0] = 0", "got 5"}},
      {"FwdMaxSeqlenTooSmall", E::Fwd, [](ValidCall& s) { s.fa.max_seqlen = 199; }, {"max_seqlen", "199", "200"}},
      {"FwdMaxSeqlenNegative", E::Fwd, [](ValidCall& s) { s.fa.max_seqlen = -1; }, {"max_seqlen", "got -1"}},
      {"FwdBatchedWithCu", E::Fwd,
       [](ValidCall& s) {
         for (flashmsa_tensor_t* t : {&s.fa.q, &s.fa.k, &s.fa.v, &s.fa.qp, &s.fa.kp, &s.fa.out}) {
           t->ndim = 4;
           t->shape[3] = t->shape[2];
           t->shape[2] = t->shape[1];
           t->shape[1] = 100;
           t->shape[0] = 3;
           t->strides[3] = 1;
           t->strides[2] = t->shape[3];
           t->strides[1] = t->shape[2] * t->shape[3];
           t->strides[0] = 100 * t->strides[1];
         }
       },
       {"cu_seqlens", "must be absent"}},
      // ---- flashmsa_fwd: scales, outputs, modes
      {"FwdScaleNegative", E::Fwd, [](ValidCall& s) { s.fa.softmax_scale = -1.0; }, {"softmax_scale", "got -1"}},
      {"FwdScaleNaN", E::Fwd, [nan](ValidCall& s) { s.fa.softmax_scale = nan; }, {"softmax_scale", "nan"}},
      {"FwdScaleInf", E::Fwd, [inf](ValidCall& s) { s.fa.softmax_scale = inf; }, {"softmax_scale", "inf"}},
      {"FwdProxyScaleNaN", E::Fwd, [nan](ValidCall& s) { s.fa.proxy_scale = nan; }, {"proxy_scale", "nan"}},
      {"FwdOutMissing", E::Fwd, [](ValidCall& s) { s.fa.out = flashmsa::none(); }, {"out", "required"}},
      {"FwdLseMissing", E::Fwd, [](ValidCall& s) { s.fa.lse = flashmsa::none(); }, {"lse", "required"}},
      {"FwdOutLoWrongShape", E::Fwd, [](ValidCall& s) { s.fa.out_lo = s.make(F64, {300, 2, 8}); },
       {"out_lo", "expected Hq = 4, got 2"}},
      {"FwdOutLoDtype", E::Fwd, [](ValidCall& s) { s.fa.out_lo = s.make(F32, {300, 4, 8}); }, {"out_lo", "fp32"}},
      {"FwdLseWrongShape", E::Fwd, [](ValidCall& s) { s.fa.lse = s.make(F64, {2, 300}); },
       {"lse", "expected shape [4, 300]", "got [2, 300]"}},
      {"FwdLseInt32", E::Fwd, [](ValidCall& s) { s.fa.lse = s.make(I32, {4, 300}); }, {"lse", "got int32"}},
      {"FwdKlNotScalar", E::Fwd, [](ValidCall& s) { s.fa.kl = s.make(F64, {2}); }, {"kl", "scalar", "got [2]"}},
      {"FwdKlMissingWhenComputed", E::Fwd, [](ValidCall& s) { s.fa.kl = flashmsa::none(); }, {"kl", "compute_kl"}},
      {"FwdComputeKlNotFlag", E::Fwd, [](ValidCall& s) { s.fa.compute_kl = 2; }, {"compute_kl", "got 2"}},
      {"FwdKlWithoutProxy", E::Fwd,
       [](ValidCall& s) {
         s.use_given_fwd(s.given.view());
         s.fa.qp = s.fa.kp = s.fa.proxy_lse = flashmsa::none();
       },
       {"compute_kl", "qp"}},
      {"FwdDenseWithIndices", E::Fwd, [](ValidCall& s) { s.fa.mode = FLASHMSA_MODE_DENSE; }, {"indices", "DENSE"}},
      {"FwdGivenWithoutIndices", E::Fwd,
       [](ValidCall& s) {
         s.fa.mode = FLASHMSA_MODE_GIVEN;
         s.fa.indices = flashmsa::none();
       },
       {"indices", "required in GIVEN mode"}},
      {"FwdGivenRepeatedBlock", E::Fwd,
       [](ValidCall& s) { s.use_given_fwd(s.given_with({{2 * 250, 1}, {2 * 250 + 1, 1}})); },
       {"indices", "block 1 repeats", "token 250"}},
      {"FwdGivenOutOfRangeValidated", E::Fwd,
       [](ValidCall& s) {
         s.use_given_fwd(s.given_with({{2 * 40 + 1, 5}}));
         s.fa.validate = 1;
       },
       {"indices", "value 5", "outside [0, 1)"}},
      {"FwdGivenIndicesFp32", E::Fwd,
       [](ValidCall& s) { s.use_given_fwd(s.make(F32, {2, 300, 2})); }, {"indices", "int32", "got fp32"}},
      // ---- workspace query
      {"FwdWorkspaceNullBytes", E::FwdWorkspace, [](ValidCall& s) { s.null_bytes = true; }, {"bytes", "NULL"}},
      {"FwdWorkspaceBadTopk", E::FwdWorkspace, [](ValidCall& s) { s.fa.topk = 65; }, {"topk", "got 65"}},
      // ---- flashmsa_bwd
      {"BwdNullArgs", E::Bwd, [](ValidCall& s) { s.null_args = true; }, {"args is NULL"}},
      {"BwdQRank2", E::Bwd, [](ValidCall& s) { s.ba.q = s.make(F64, {300, 32}); }, {"q", "got 2"}},
      {"BwdDoutWrongShape", E::Bwd, [](ValidCall& s) { s.ba.dout = s.make(F64, {300, 4, 4}); },
       {"dout", "D = 8", "got 4"}},
      {"BwdDqDtypeMismatch", E::Bwd, [](ValidCall& s) { s.ba.dq = s.make(F32, {300, 4, 8}); },
       {"dq", "expected dtype fp64", "got fp32"}},
      {"BwdDqMissing", E::Bwd, [](ValidCall& s) { s.ba.dq = flashmsa::none(); }, {"dq", "required"}},
      {"BwdDqpMissing", E::Bwd, [](ValidCall& s) { s.ba.dqp = flashmsa::none(); }, {"dqp", "required"}},
      {"BwdDkpWithoutProxy", E::Bwd,
       [](ValidCall& s) { s.ba.qp = s.ba.kp = s.ba.proxy_lse = s.ba.dqp = flashmsa::none(); },
       {"dkp", "must be absent"}},
      {"BwdLseWrongShape", E::Bwd, [](ValidCall& s) { s.ba.lse = s.make(F64, {4, 299}); },
       {"lse", "expected shape [4, 300]", "got [4, 299]"}},
      {"BwdDlseWrongShape", E::Bwd, [](ValidCall& s) { s.ba.dlse = s.make(F64, {4, 300, 1}); }, {"dlse", "got 3"}},
      {"BwdIndicesMissing", E::Bwd, [](ValidCall& s) { s.ba.indices = flashmsa::none(); }, {"indices", "required"}},
      {"BwdIndicesRepeatedBlock", E::Bwd,
       [](ValidCall& s) {
         s.ba.mode = FLASHMSA_MODE_GIVEN;
         s.ba.indices = s.given_with({{300 * 2 + 2 * 299, 0}, {300 * 2 + 2 * 299 + 1, 0}});
       },
       {"indices", "block 0 repeats", "head 1, token 299"}},
      {"BwdIndicesOutOfRangeValidated", E::Bwd,
       [](ValidCall& s) {
         s.ba.mode = FLASHMSA_MODE_GIVEN;
         s.ba.indices = s.given_with({{2 * 150, -7}});
         s.ba.validate = 1;
       },
       {"indices", "value -7", "outside [0, 2)"}},
      {"BwdDklNotScalar", E::Bwd, [](ValidCall& s) { s.ba.dkl = s.make(F64, {2}); }, {"dkl", "scalar", "got [2]"}},
      {"BwdDklNaN", E::Bwd, [nan](ValidCall& s) { s.ba.dkl = s.make_values(F64, {1}, {nan}); }, {"dkl", "finite"}},
      {"BwdOutLoWrongShape", E::Bwd, [](ValidCall& s) { s.ba.out_lo = s.make(F64, {300, 4, 4}); },
       {"out_lo", "expected D = 8, got 4"}},
      {"BwdDeterministicNotFlag", E::Bwd, [](ValidCall& s) { s.ba.deterministic = -1; }, {"deterministic", "got -1"}},
      {"BwdKOnCuda", E::Bwd,
       [](ValidCall& s) {
         s.ba.dk.device_type = FLASHMSA_DEVICE_CUDA;
         s.ba.dk.device_id = 1;
       },
       {"dk", "expected device cpu", "cuda:1"}},
      {"BwdScaleInf", E::Bwd, [inf](ValidCall& s) { s.ba.proxy_scale = -inf; }, {"proxy_scale", "-inf"}},
      {"BwdCuDecreasing", E::Bwd, [](ValidCall& s) { s.ba.cu_seqlens = s.make_values(I32, {4}, {0, 100, 50, 300}); },
       {"cu_seqlens", "non-decreasing"}},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, BadInput, ::testing::ValuesIn(error_cases()),
                         [](const ::testing::TestParamInfo<ErrorCase>& i) { return i.param.name; });

// The unmodified setup succeeds and writes every output (so the cases above fail for their
// one defect, and "unchanged" is a real check).
class BadInputBaseline : public SeededTest {};

TEST_F(BadInputBaseline, ValidCallsSucceedAndWrite) {
  for (Entry e : {Entry::Select, Entry::Fwd, Entry::Bwd, Entry::FwdWorkspace}) {
    ValidCall s(rng);
    EXPECT_EQ(s.call(e), FLASHMSA_SUCCESS) << entry_name(e) << ": " << flashmsa_last_error();
    EXPECT_STREQ(flashmsa_last_error(), "");
  }
  ValidCall s(rng);
  ASSERT_EQ(s.call(Entry::Select), FLASHMSA_SUCCESS);
  ASSERT_EQ(s.call(Entry::Fwd), FLASHMSA_SUCCESS);
  ASSERT_EQ(s.call(Entry::Bwd), FLASHMSA_SUCCESS);
  for (const Tensor* t : {&s.sel.indices, &s.sel.proxy_lse, &s.fwd.out, &s.fwd.lse, &s.fwd.indices,
                          &s.fwd.proxy_lse, &s.fwd.kl, &s.bwd.dq, &s.bwd.dk, &s.bwd.dv, &s.bwd.dqp,
                          &s.bwd.dkp})
    EXPECT_TRUE(fully_written(*t));
}

}  // namespace
}  // namespace fmtest
