// Bad input (SPEC.md section 2): every case starts from a valid call of flashmsa_select,
// flashmsa_fwd or flashmsa_bwd, breaks one thing, and checks the status, that the message
// names the entry point and the argument (and, where given, the expected and actual values),
// and that no buffer of the call changed: outputs keep their NaN poison, inputs their data.
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "reference/reference.hpp"
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

// Rewrites a view's shape and strides; the data pointer stays (validation must stop first).
void reshape_view(flashmsa_tensor_t& t, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  t.ndim = int32_t(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides[i];
  }
}

// The forward's per-token tensors as one batched sequence [1, 300, H, X]; no cu_seqlens.
void make_batched(ValidCall& s) {
  for (flashmsa_tensor_t* t : {&s.fa.q, &s.fa.k, &s.fa.v, &s.fa.qp, &s.fa.kp, &s.fa.out})
    reshape_view(*t, {1, 300, t->shape[1], t->shape[2]}, {300 * t->strides[0], t->strides[0], t->strides[1], 1});
  s.fa.cu_seqlens = flashmsa::none();
}

constexpr int64_t kTwo31 = int64_t(1) << 31, kTwo32 = int64_t(1) << 32;

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
      {"FwdSelectionUnknown", E::Fwd, [](ValidCall& s) { s.fa.selection = flashmsa_selection_t(2); },
       {"selection", "got 2"}},
      {"SelectSelectionUnknown", E::Select, [](ValidCall& s) { s.sa.selection = flashmsa_selection_t(-1); },
       {"selection", "got -1"}},
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
      {"BwdKlWithoutProxy", E::Bwd,
       [](ValidCall& s) {
         s.ba.qp = s.ba.kp = s.ba.proxy_lse = s.ba.dqp = s.ba.dkp = flashmsa::none();
         s.ba.kl = s.make(F64, {1});
       },
       {"kl", "needs qp and kp"}},
      {"BwdKlNotScalar", E::Bwd, [](ValidCall& s) { s.ba.kl = s.make(F64, {2}); }, {"kl", "expected a scalar"}},
      {"BwdKlWrongDtype", E::Bwd, [](ValidCall& s) { s.ba.kl = s.make(I32, {1}); }, {"kl", "expected dtype fp32"}},
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
      // ---- issue 13: sizes are checked before they are narrowed to int (no wrap)
      {"FwdHqAboveInt32", E::Fwd, [](ValidCall& s) { reshape_view(s.fa.q, {300, kTwo32 + 4, 8}, {0, 0, 1}); },
       {"q", "Hq <= 2147483647", "got 4294967300"}},
      {"FwdDAboveInt32", E::Fwd, [](ValidCall& s) { reshape_view(s.fa.q, {300, 4, kTwo31}, {0, 0, 1}); },
       {"q", "D <= 2147483647", "got 2147483648"}},
      {"FwdHkvAboveInt32", E::Fwd, [](ValidCall& s) { reshape_view(s.fa.k, {300, kTwo31, 8}, {0, 0, 1}); },
       {"k", "Hkv <= 2147483647"}},
      {"FwdHpkAboveInt32", E::Fwd, [](ValidCall& s) { reshape_view(s.fa.kp, {300, kTwo32 + 1, 8}, {0, 0, 1}); },
       {"kp", "Hpk <= 2147483647"}},
      {"SelectHpAboveInt32", E::Select, [](ValidCall& s) { reshape_view(s.sa.qp, {300, kTwo32 + 2, 8}, {0, 0, 1}); },
       {"qp", "Hp <= 2147483647"}},
      {"BwdHqAboveInt32", E::Bwd, [](ValidCall& s) { reshape_view(s.ba.q, {300, kTwo32 + 4, 8}, {0, 0, 1}); },
       {"q", "Hq <= 2147483647"}},
      {"FwdTotalAboveInt32", E::Fwd, [](ValidCall& s) { reshape_view(s.fa.q, {kTwo31, 4, 8}, {0, 8, 1}); },
       {"q", "total <= 2147483647", "int32"}},
      {"FwdCuLengthAboveInt32", E::Fwd, [](ValidCall& s) { reshape_view(s.fa.cu_seqlens, {kTwo31 + 2}, {1}); },
       {"cu_seqlens", "B (its length - 1) <= 2147483647"}},
      {"FwdNumelOverflow", E::Fwd,
       [](ValidCall& s) { reshape_view(s.fa.k, {300, int64_t(1) << 40, int64_t(1) << 30}, {0, 0, 1}); },
       {"k", "more than 2^63 - 1 elements"}},
      {"FwdOffsetOverflow", E::Fwd, [](ValidCall& s) { reshape_view(s.fa.v, {300, 2, 8}, {int64_t(1) << 62, 8, 1}); },
       {"v", "beyond offset 2^63 - 1"}},
      {"FwdBatchedBAboveInt32", E::Fwd,
       [](ValidCall& s) {
         make_batched(s);
         reshape_view(s.fa.q, {kTwo31 + 1, 1, 4, 8}, {0, 0, 8, 1});
       },
       {"q", "B <= 2147483647"}},
      {"FwdBatchedTokensAboveInt32", E::Fwd,
       [](ValidCall& s) {
         make_batched(s);
         reshape_view(s.fa.q, {65536, 65536, 4, 8}, {0, 0, 8, 1});
       },
       {"q", "B * S <= 2147483647"}},
      // ---- issue 13: max_seqlen (varlen 0..2^31-1; batched 0 or S), scales (0 or (0, 1e4])
      {"FwdMaxSeqlenAboveInt32", E::Fwd, [](ValidCall& s) { s.fa.max_seqlen = kTwo31; },
       {"max_seqlen", "0 <= max_seqlen <= 2147483647", "got 2147483648"}},
      {"SelectMaxSeqlenInt64Max", E::Select, [](ValidCall& s) { s.sa.max_seqlen = std::numeric_limits<int64_t>::max(); },
       {"max_seqlen", "2147483647"}},
      {"FwdBatchedMaxSeqlenNotS", E::Fwd,
       [](ValidCall& s) {
         make_batched(s);
         s.fa.max_seqlen = 301;
       },
       {"max_seqlen", "0 or S = 300", "got 301"}},
      {"FwdBatchedMaxSeqlenSmaller", E::Fwd,
       [](ValidCall& s) {
         make_batched(s);
         s.fa.max_seqlen = 200;
       },
       {"max_seqlen", "S = 300", "got 200"}},
      {"FwdScale1e300", E::Fwd, [](ValidCall& s) { s.fa.softmax_scale = 1e300; },
       {"softmax_scale", "finite value > 0 and <= 10000", "1e+300"}},
      {"FwdScaleJustAboveMax", E::Fwd, [](ValidCall& s) { s.fa.softmax_scale = 10000.5; },
       {"softmax_scale", "<= 10000", "10000.5"}},
      {"FwdProxyScale1e5", E::Fwd, [](ValidCall& s) { s.fa.proxy_scale = 1e5; }, {"proxy_scale", "<= 10000"}},
      {"SelectProxyScale1e300", E::Select, [](ValidCall& s) { s.sa.proxy_scale = 1e300; }, {"proxy_scale", "<= 10000"}},
      {"BwdScale1e300", E::Bwd, [](ValidCall& s) { s.ba.softmax_scale = 1e300; }, {"softmax_scale", "<= 10000"}},
      {"BwdDklInf", E::Bwd, [inf](ValidCall& s) { s.ba.dkl = s.make_values(F64, {1}, {inf}); }, {"dkl", "finite"}},
      {"FwdValidateNotFlag", E::Fwd, [](ValidCall& s) { s.fa.validate = 256; }, {"validate", "got 256"}},
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

// ---- issue 13: the thread setting of the CPU backend -------------------------------------

// Sets FLASHMSA_NUM_THREADS for a scope and restores it.
class ThreadsEnv {
 public:
  explicit ThreadsEnv(const char* value) {
    if (const char* old = std::getenv("FLASHMSA_NUM_THREADS")) old_ = old, had_ = true;
    setenv("FLASHMSA_NUM_THREADS", value, 1);
  }
  ~ThreadsEnv() {
    if (had_) setenv("FLASHMSA_NUM_THREADS", old_.c_str(), 1);
    else unsetenv("FLASHMSA_NUM_THREADS");
  }

 private:
  std::string old_;
  bool had_ = false;
};

class ThreadSetting : public SeededTest {};

TEST_F(ThreadSetting, BadValuesAreInvalidArgumentsAndWriteNothing) {
  for (const char* value : {"0", "-1", "1025", "40000", "abc", "4x", " 2", "+2", "2.0",
                            "99999999999999999999"}) {
    for (Entry e : {Entry::Select, Entry::Fwd, Entry::Bwd}) {
      ValidCall s(rng);
      std::vector<std::vector<unsigned char>> before;
      for (const Tensor* t : s.buffers()) before.push_back(t->bytes());
      ThreadsEnv env(value);
      const flashmsa_status_t st = s.call(e);
      const std::string msg = flashmsa_last_error();
      EXPECT_EQ(st, FLASHMSA_ERROR_INVALID_ARGUMENT) << value << ": " << msg;
      EXPECT_EQ(msg.rfind(entry_name(e), 0), 0u) << msg;
      EXPECT_NE(msg.find("FLASHMSA_NUM_THREADS: expected an integer in [1, 1024]"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::string("'") + value + "'"), std::string::npos) << msg;
      const auto after = s.buffers();
      for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i]->bytes() == before[i]) << value;
    }
  }
}

TEST_F(ThreadSetting, EmptyIsUnsetAndTheBoundsRun) {
  for (const char* value : {"", "1", "1024"}) {
    ThreadsEnv env(value);
    EXPECT_GE(flashmsa::ref::num_threads(), 1);
    EXPECT_LE(flashmsa::ref::num_threads(), flashmsa::ref::kMaxThreads);
    ValidCall s(rng);
    EXPECT_EQ(s.call(Entry::Fwd), FLASHMSA_SUCCESS) << value << ": " << flashmsa_last_error();
    EXPECT_TRUE(fully_written(s.fwd.out));
  }
}

// ---- issue 13: parallel_for never terminates the process ---------------------------------

TEST(ParallelFor, EveryTidRunsOnceWithItsOwnIndex) {
  for (int T : {1, 2, 7, 64}) {
    std::vector<std::atomic<int>> runs(static_cast<size_t>(T));
    flashmsa::ref::parallel_for(1000, T, [&](int64_t first, int64_t n, int tid) {
      EXPECT_EQ(first, tid);
      EXPECT_EQ(n, 1000);
      runs[size_t(tid)]++;
    });
    for (auto& r : runs) EXPECT_EQ(r.load(), 1);
  }
}

TEST(ParallelFor, AnExceptionOnAnyThreadIsRethrownToTheCaller) {
  for (int bad : {0, 3, 63}) {
    std::atomic<int> ran{0};
    EXPECT_THROW(flashmsa::ref::parallel_for(1000, 64,
                                             [&](int64_t, int64_t, int tid) {
                                               ++ran;
                                               if (tid == bad) throw std::bad_alloc();
                                             }),
                 std::bad_alloc)
        << "tid " << bad;
    EXPECT_GE(ran.load(), 1);
  }
  EXPECT_THROW(flashmsa::ref::parallel_for(10, 1, [](int64_t, int64_t, int) { throw std::runtime_error("x"); }),
               std::runtime_error);
}

// Virtual memory of this process, bytes.
size_t vm_size() {
  std::ifstream f("/proc/self/status");
  std::string key;
  size_t kb = 0;
  while (f >> key) {
    if (key == "VmSize:") {
      f >> kb;
      return kb * 1024;
    }
    std::getline(f, key);
  }
  return 0;
}

// Limits this process's address space to its current size plus `extra` bytes.
bool limit_address_space(size_t extra) {
  const size_t vm = vm_size();
  if (vm == 0) return false;
  rlimit lim;
  lim.rlim_cur = lim.rlim_max = vm + extra;
  return setrlimit(RLIMIT_AS, &lim) == 0;
}

// The child of ThreadCreationFailureFallsBackToTheCallingThread: its exit code.
int fallback_child() {
  if (!limit_address_space(size_t(64) << 20)) return 3;  // ~8 stacks of 8 MiB
  const int T = 512;
  std::vector<int> runs(size_t(T), 0);
  std::vector<std::thread::id> where(static_cast<size_t>(T));
  std::mutex m;
  flashmsa::ref::parallel_for(100000, T, [&](int64_t, int64_t, int tid) {
    std::lock_guard<std::mutex> lock(m);
    runs[size_t(tid)]++;
    where[size_t(tid)] = std::this_thread::get_id();
  });
  int on_caller = 0;
  for (int tid = 0; tid < T; ++tid) {
    if (runs[size_t(tid)] != 1) return 5;
    on_caller += where[size_t(tid)] == std::this_thread::get_id();
  }
  return on_caller > 1 ? 0 : 6;  // > 1: threads failed to start and the caller took over
}

// In a child process whose address space holds a few thread stacks but not 512: thread creation
// fails part way, the calling thread runs the rest, every tid runs exactly once, no abort.
TEST(ParallelForDeathTest, ThreadCreationFailureFallsBackToTheCallingThread) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(fallback_child()), ::testing::ExitedWithCode(0), "");
}

// The child of ForwardUnderAnAddressSpaceLimitIsExact.
int limited_forward_child(const Config& c, const Inputs& in, const FwdResult& free_run) {
  if (!limit_address_space(size_t(128) << 20)) return 3;
  const FwdResult limited = run_fwd(c, in);
  if (limited.status != FLASHMSA_SUCCESS) return 4;
  if (free_run.out.bytes() != limited.out.bytes() || free_run.lse.bytes() != limited.lse.bytes() ||
      free_run.kl.bytes() != limited.kl.bytes())
    return 5;
  return 0;
}

// The forward (1024 threads asked for) under the same kind of limit: bitwise the result of the
// same thread count without the limit.
TEST(ParallelForDeathTest, ForwardUnderAnAddressSpaceLimitIsExact) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Rng rng(test_seed());
  Config c;
  c.lens = {700, 300};
  c.topk = 2;
  const Inputs in = make_inputs(c, rng);
  ThreadsEnv env("1024");
  const FwdResult free_run = run_fwd(c, in);
  EXPECT_EXIT(std::exit(limited_forward_child(c, in, free_run)), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace fmtest
