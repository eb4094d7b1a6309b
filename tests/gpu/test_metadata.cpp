// Metadata faults (issue 13): whatever cu_seqlens and max_seqlen say, no kernel touches memory
// outside its buffers (run under compute-sanitizer memcheck by scripts/gpu_all.sh), the CUDA
// context survives, every fault is reported in the status words and named by
// flashmsa_check_status, the outputs of the faulting call are poisoned (NaN, indices INT32_MIN),
// and a correct call right after returns correct results.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu_harness.hpp"

namespace {

using namespace gputest;

uint64_t seed_now() {
  static std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

// Status words in device memory or in page-locked host memory (both are allowed).
enum class StatusMemory { kDevice, kHost };
struct Status {
  int32_t* ptr = nullptr;
  bool host = false;
  explicit Status(StatusMemory memory) : host(memory == StatusMemory::kHost) {
    if (host) cudaHostAlloc(reinterpret_cast<void**>(&ptr), FLASHMSA_STATUS_WORDS * 4, cudaHostAllocMapped);
    else ptr = static_cast<int32_t*>(Pool::get().take(FLASHMSA_STATUS_WORDS * 4));
    if (host) std::fill(ptr, ptr + FLASHMSA_STATUS_WORDS, 0);
    else cudaMemset(ptr, 0, FLASHMSA_STATUS_WORDS * 4);
  }
  ~Status() {
    if (host) cudaFreeHost(ptr);
  }
  Status(const Status&) = delete;
  Status& operator=(const Status&) = delete;
  flashmsa_tensor_t view() const {
    return flashmsa::view(ptr, FLASHMSA_DTYPE_INT32, {FLASHMSA_STATUS_WORDS},
                          host ? FLASHMSA_DEVICE_CPU : FLASHMSA_DEVICE_CUDA);
  }
  // flashmsa_check_status (synchronising, resetting): the status code, word 0, the message.
  struct Read {
    flashmsa_status_t rc;
    int32_t faults;
    std::string msg;
  };
  Read check() const {
    const flashmsa_tensor_t v = view();
    int32_t faults = -1;
    const flashmsa_status_t rc =
        flashmsa_check_status(&v, nullptr, FLASHMSA_CHECK_SYNC | FLASHMSA_CHECK_RESET, &faults);
    return {rc, faults, flashmsa_last_error()};
  }
};

// The fault bits SPEC's cu_seqlens rules give (the device check must find exactly these).
int32_t expected_faults(const std::vector<int64_t>& cu, int64_t total, int64_t max_seqlen) {
  int32_t f = 0;
  const size_t B = cu.size() - 1;
  if (cu[0] != 0) f |= FLASHMSA_FAULT_FIRST_NOT_ZERO;
  if (cu[B] != total) f |= FLASHMSA_FAULT_LAST_NOT_TOTAL;
  for (size_t b = 0; b <= B; ++b) {
    if (cu[b] < 0) f |= FLASHMSA_FAULT_NEGATIVE;
    if (cu[b] > total) f |= FLASHMSA_FAULT_ABOVE_TOTAL;
    if (b < B && cu[b + 1] < cu[b]) f |= FLASHMSA_FAULT_DECREASING;
    else if (b < B && cu[b + 1] - cu[b] > max_seqlen) f |= FLASHMSA_FAULT_ABOVE_MAX_SEQLEN;
  }
  return f;
}

// The device inputs of one problem, and the outputs of every call of one "step": selection,
// sparse forward (indices, proxy lse, kl), dense forward (kl), given forward (over the sparse
// forward's indices), sparse backward
// with the kl gradient (deterministic: comparable bitwise), dense backward with the kl gradient.
struct Step {
  Problem pb;
  Tensor q, k, v, qp, kp, dout, dkl;
  Tensor sel_idx, sel_plse;
  Tensor out, lse, idx, plse, kl;
  Tensor d_out, d_lse, d_kl;                 // dense forward
  Tensor g_out, g_lse;                       // given forward
  Tensor dq, dk, dv, dqp, dkp;               // sparse backward
  Tensor ddq, ddk, ddv, ddqp, ddkp;          // dense backward
  bool full = true;                          // false: selection, sparse forward, sparse backward only
};

// The calls of a step: all of them, or the selection, sparse forward and sparse backward only.
enum class StepCalls { kAll, kSparseOnly };

Step make_step(const Problem& pb, std::mt19937_64& rng, StepCalls calls) {
  Step s;
  s.pb = pb;
  s.full = calls == StepCalls::kAll;
  s.q = random_input(token_shape(pb, pb.Hq, pb.D), pb.dtype, rng);
  s.k = random_input(token_shape(pb, pb.Hkv, pb.D), pb.dtype, rng);
  s.v = random_input(token_shape(pb, pb.Hkv, pb.D), pb.dtype, rng);
  s.qp = random_input(token_shape(pb, pb.Hp, pb.Dp), pb.dtype, rng);
  s.kp = random_input(token_shape(pb, pb.Hpk, pb.Dp), pb.dtype, rng);
  s.dout = random_input(token_shape(pb, pb.Hq, pb.D), pb.dtype, rng);
  s.dkl.shape = {};
  s.dkl.dtype = FLASHMSA_DTYPE_FP32;
  s.dkl.host = {0.9};
  upload(s.dkl);
  return s;
}

// Fresh poisoned-by-the-harness outputs (NaN bytes / 0x7f7f7f7f), then every call of the step
// with the given cu_seqlens values and max_seqlen (varlen), or batched when cu is empty.
void run_step(Step& s, const std::vector<int64_t>& cu, int64_t max_seqlen, const Status* st) {
  const Problem& pb = s.pb;
  const int64_t T = pb.total();
  const auto dt = pb.dtype;
  Tensor cu_t;
  if (!cu.empty()) {
    cu_t.shape = {int64_t(cu.size())};
    cu_t.dtype = FLASHMSA_DTYPE_INT32;
    cu_t.host.assign(cu.begin(), cu.end());
    upload(cu_t);
  }
  auto seqs = [&](auto& a) {
    if (!cu.empty()) a.cu_seqlens = dev_view(cu_t);
    a.max_seqlen = max_seqlen;
    if (st) a.status = st->view();
  };
  auto inputs = [&](auto& a) {  // q, k, v, qp, kp and the sequences of a forward or backward call
    a.q = dev_view(s.q);
    a.k = dev_view(s.k);
    a.v = dev_view(s.v);
    a.qp = dev_view(s.qp);
    a.kp = dev_view(s.kp);
    seqs(a);
  };
  auto run = [&](auto& a, auto fn) {
    const size_t ws_bytes = flashmsa::workspace_size(a);
    void* ws = ws_bytes ? Pool::get().take(ws_bytes) : nullptr;
    if (ws) cudaMemset(ws, 0xff, ws_bytes);
    fn(a, ws, ws_bytes);
  };
  {  // selection
    s.sel_idx = output({pb.Hp, T, pb.topk}, FLASHMSA_DTYPE_INT32);
    s.sel_plse = output({pb.Hp, T}, FLASHMSA_DTYPE_FP32);
    flashmsa::SelectArgs a;
    a.qp = dev_view(s.qp);
    a.kp = dev_view(s.kp);
    seqs(a);
    a.topk = pb.topk;
    a.indices = dev_view(s.sel_idx);
    a.proxy_lse = dev_view(s.sel_plse);
    run(a, [](auto& x, void* w, size_t n) { flashmsa::select(x, w, n); });
  }
  auto fwd = [&](flashmsa_mode_t mode, Tensor& out, Tensor& lse, Tensor* idx, Tensor* plse, Tensor* kl) {
    out = output(token_shape(pb, pb.Hq, pb.D), dt);
    lse = output({pb.Hq, T}, FLASHMSA_DTYPE_FP32);
    flashmsa::FwdArgs a;
    inputs(a);
    a.mode = mode;
    a.topk = mode == FLASHMSA_MODE_SPARSE ? pb.topk : 0;
    if (mode == FLASHMSA_MODE_GIVEN) a.indices = dev_view(s.idx);  // this step's selection
    if (idx) {
      *idx = output({pb.Hp, T, pb.topk}, FLASHMSA_DTYPE_INT32);
      a.indices = dev_view(*idx);
    }
    if (plse) {
      *plse = output({pb.Hp, T}, FLASHMSA_DTYPE_FP32);
      a.proxy_lse = dev_view(*plse);
    }
    if (kl) {
      *kl = output({}, FLASHMSA_DTYPE_FP32);
      a.kl = dev_view(*kl);
      a.compute_kl = 1;
    }
    a.out = dev_view(out);
    a.lse = dev_view(lse);
    run(a, [](auto& x, void* w, size_t n) { flashmsa::fwd(x, w, n); });
  };
  fwd(FLASHMSA_MODE_SPARSE, s.out, s.lse, &s.idx, &s.plse, &s.kl);
  if (s.full) {
    fwd(FLASHMSA_MODE_DENSE, s.d_out, s.d_lse, nullptr, nullptr, &s.d_kl);
    fwd(FLASHMSA_MODE_GIVEN, s.g_out, s.g_lse, nullptr, nullptr, nullptr);
  }
  auto bwd = [&](flashmsa_mode_t mode, Tensor& out, Tensor& lse, Tensor* idx, Tensor* grads[5], bool det) {
    const std::vector<int64_t> shapes[5] = {token_shape(pb, pb.Hq, pb.D), token_shape(pb, pb.Hkv, pb.D),
                                            token_shape(pb, pb.Hkv, pb.D), token_shape(pb, pb.Hp, pb.Dp),
                                            token_shape(pb, pb.Hpk, pb.Dp)};
    for (int i = 0; i < 5; ++i) *grads[i] = output(shapes[i], dt);
    flashmsa::BwdArgs a;
    inputs(a);
    a.mode = mode;
    if (idx) a.indices = dev_view(*idx);
    a.out = dev_view(out);
    a.lse = dev_view(lse);
    a.dout = dev_view(s.dout);
    a.dkl = dev_view(s.dkl);
    a.dq = dev_view(*grads[0]);
    a.dk = dev_view(*grads[1]);
    a.dv = dev_view(*grads[2]);
    a.dqp = dev_view(*grads[3]);
    a.dkp = dev_view(*grads[4]);
    a.deterministic = det ? 1 : 0;
    run(a, [](auto& x, void* w, size_t n) { flashmsa::bwd(x, w, n); });
  };
  Tensor* sparse_grads[5] = {&s.dq, &s.dk, &s.dv, &s.dqp, &s.dkp};
  bwd(FLASHMSA_MODE_SPARSE, s.out, s.lse, &s.idx, sparse_grads, /*det=*/true);
  if (s.full) {
    Tensor* dense_grads[5] = {&s.ddq, &s.ddk, &s.ddv, &s.ddqp, &s.ddkp};
    bwd(FLASHMSA_MODE_DENSE, s.d_out, s.d_lse, nullptr, dense_grads, /*det=*/false);
  }
}

std::vector<Tensor*> outputs_of(Step& s) {
  std::vector<Tensor*> r = {&s.sel_idx, &s.sel_plse, &s.out, &s.lse, &s.idx, &s.plse, &s.kl,
                            &s.dq, &s.dk, &s.dv, &s.dqp, &s.dkp};
  if (s.full)
    for (Tensor* t : {&s.d_out, &s.d_lse, &s.d_kl, &s.g_out, &s.g_lse, &s.ddq, &s.ddk, &s.ddv, &s.ddqp, &s.ddkp})
      r.push_back(t);
  return r;
}
const char* kNames[] = {"select indices", "select proxy_lse", "out", "lse", "indices", "proxy_lse", "kl",
                        "dq", "dk", "dv", "dqp", "dkp", "dense out", "dense lse", "dense kl", "given out",
                        "given lse", "dense dq", "dense dk", "dense dv", "dense dqp", "dense dkp"};

// Every element poisoned: NaN for floating point, INT32_MIN for indices.
void expect_poisoned(Step& s, const std::string& what) {
  int i = 0;
  for (Tensor* t : outputs_of(s)) {
    download(*t);
    size_t bad = 0;
    for (double x : t->host)
      bad += t->dtype == FLASHMSA_DTYPE_INT32 ? (x != double(INT32_MIN)) : !std::isnan(x);
    EXPECT_EQ(bad, 0u) << what << ": " << kNames[i] << ": " << bad << " of " << t->host.size()
                       << " elements not poisoned";
    ++i;
  }
}

// The valid step: every output written and finite where it must be (lse may be -inf nowhere
// here: no empty key sets without GIVEN rows of -1, which GIVEN reads only as empty sets).
std::vector<std::vector<double>> snapshot(Step& s) {
  std::vector<std::vector<double>> r;
  for (Tensor* t : outputs_of(s)) {
    download(*t);
    r.push_back(t->host);
  }
  return r;
}

const Problem kTable =
    Problem().heads(16, 2).proxy_heads(4, 1).with_topk(4).seqlens({1000, 2000});  // total 3000, the table

// One row of the table (and more): the faults that must be found.
struct Row {
  const char* name;
  std::vector<int64_t> cu;
  int64_t max_seqlen;
  int32_t faults;
};

void run_table(StatusMemory status_memory) {
  PoolScope scope;
  std::mt19937_64 rng(seed_now());
  Step s = make_step(kTable, rng, StepCalls::kAll);
  const int64_t T = kTable.total();
  const std::vector<int64_t> good = kTable.offsets();
  Status st(status_memory);

  // The valid step, checked against the fp64 reference (forward) before anything goes wrong.
  run_step(s, good, 2000, &st);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  {
    const Status::Read r = st.check();
    ASSERT_EQ(r.rc, FLASHMSA_SUCCESS) << r.msg;
    ASSERT_EQ(r.faults, 0);
  }
  const auto before = snapshot(s);
  {
    std::vector<int32_t> idx(s.idx.host.begin(), s.idx.host.end());
    RefFwd ref = reference_fwd(kTable, s.q, s.k, s.v, nullptr, nullptr, &idx, kTable.topk, FLASHMSA_MODE_GIVEN);
    RefFwd plain = straightforward_fwd(kTable, s.q, s.k, s.v, &idx, kTable.topk, FLASHMSA_MODE_GIVEN);
    const double e = rel_l2(s.out.host, ref.out), base = rel_l2(plain.out, ref.out);
    EXPECT_LE(e, 2 * base + 1e-5) << "valid forward before the faults";
  }

  const int32_t kMax = INT32_MAX, kMin = INT32_MIN;
  const std::vector<Row> rows = {
      {"last value > total", {0, 1000, 4000}, 3000, FLASHMSA_FAULT_ABOVE_TOTAL | FLASHMSA_FAULT_LAST_NOT_TOTAL},
      {"first value != 0", {100, 1000, 3000}, 3000, FLASHMSA_FAULT_FIRST_NOT_ZERO},
      {"non-monotonic", {0, 2000, 1000, 3000}, 3000, FLASHMSA_FAULT_DECREASING},
      {"last value < total", {0, 1000, 1500}, 3000, FLASHMSA_FAULT_LAST_NOT_TOTAL},
      {"max_seqlen below a length", good, 1500, FLASHMSA_FAULT_ABOVE_MAX_SEQLEN},
      {"negative value", {0, -5, 3000}, 3000,
       FLASHMSA_FAULT_NEGATIVE | FLASHMSA_FAULT_DECREASING | FLASHMSA_FAULT_ABOVE_MAX_SEQLEN},
      {"negative first", {-100, 1000, 3000}, 3000, FLASHMSA_FAULT_FIRST_NOT_ZERO | FLASHMSA_FAULT_NEGATIVE},
      {"INT32_MAX inside", {0, kMax, 3000}, 3000,
       FLASHMSA_FAULT_ABOVE_TOTAL | FLASHMSA_FAULT_ABOVE_MAX_SEQLEN | FLASHMSA_FAULT_DECREASING},
      {"INT32_MIN inside", {0, kMin, 3000}, 3000,
       FLASHMSA_FAULT_NEGATIVE | FLASHMSA_FAULT_DECREASING | FLASHMSA_FAULT_ABOVE_MAX_SEQLEN},
      {"INT32_MAX last", {0, 1000, kMax}, 3000,
       FLASHMSA_FAULT_ABOVE_TOTAL | FLASHMSA_FAULT_LAST_NOT_TOTAL | FLASHMSA_FAULT_ABOVE_MAX_SEQLEN},
      {"all zero", {0, 0, 0}, 3000, FLASHMSA_FAULT_LAST_NOT_TOTAL},
      {"one sequence too long", {0, 3000}, 2999, FLASHMSA_FAULT_ABOVE_MAX_SEQLEN},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(row.name);
    ASSERT_EQ(expected_faults(row.cu, T, row.max_seqlen), row.faults) << "the table's own expectation";
    run_step(s, row.cu, row.max_seqlen, &st);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "the CUDA context must survive";
    const Status::Read r = st.check();
    EXPECT_EQ(r.rc, FLASHMSA_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(r.faults, row.faults);
    for (const char* word : {"cu_seqlens", "flashmsa_select", "flashmsa_fwd", "flashmsa_bwd", "NaN"})
      EXPECT_NE(r.msg.find(word), std::string::npos) << "message lacks '" << word << "': " << r.msg;
    std::printf("    %-26s -> %s\n", row.name, r.msg.c_str());
    expect_poisoned(s, row.name);
    // a correct call right after: the same results as before the faults (deterministic kernels)
    run_step(s, good, 2000, &st);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Status::Read ok = st.check();
    EXPECT_EQ(ok.rc, FLASHMSA_SUCCESS) << ok.msg;
    const auto after = snapshot(s);
    for (size_t i = 0; i < after.size(); ++i) {
      size_t differ = 0;
      for (size_t e = 0; e < after[i].size(); ++e)
        differ += std::memcmp(&after[i][e], &before[i][e], sizeof(double)) != 0;
      // dense backward: atomics in any order (default mode), so compare within rounding
      if (differ && std::string(kNames[i]).rfind("dense d", 0) == 0) {
        EXPECT_LT(rel_l2(after[i], before[i]), 1e-2) << kNames[i] << " after the fault";
        continue;
      }
      EXPECT_EQ(differ, 0u) << kNames[i] << ": the valid call after the fault differs from before";
    }
  }
}

TEST(Metadata, SmallTableStatusInDeviceMemory) { run_table(StatusMemory::kDevice); }
TEST(Metadata, SmallTableStatusInHostMemory) { run_table(StatusMemory::kHost); }

// Without status words the faults still poison the outputs and touch nothing else.
TEST(Metadata, SmallNoStatusStillPoisons) {
  PoolScope scope;
  std::mt19937_64 rng(seed_now());
  Step s = make_step(kTable, rng, StepCalls::kSparseOnly);
  run_step(s, {0, 2000, 1000, 3000}, 3000, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_poisoned(s, "no status words");
}

// Batched inputs have no device metadata; a max_seqlen other than 0 or S is refused at once,
// writing nothing, and a correct call after works.
TEST(Metadata, SmallBatchedMaxSeqlen) {
  PoolScope scope;
  std::mt19937_64 rng(seed_now());
  const Problem pb = kTable.batched(2, 700);
  Step s = make_step(pb, rng, StepCalls::kSparseOnly);
  Status st(StatusMemory::kHost);
  for (int64_t bad : {int64_t(699), int64_t(701), int64_t(-1), int64_t(1) << 40}) {
    Tensor out = output(token_shape(pb, pb.Hq, pb.D), pb.dtype), lse = output({pb.Hq, pb.total()}, FLASHMSA_DTYPE_FP32);
    flashmsa::FwdArgs a;
    a.q = dev_view(s.q);
    a.k = dev_view(s.k);
    a.v = dev_view(s.v);
    a.qp = dev_view(s.qp);
    a.kp = dev_view(s.kp);
    a.max_seqlen = bad;
    a.topk = pb.topk;
    a.out = dev_view(out);
    a.lse = dev_view(lse);
    a.status = st.view();
    size_t n = 0;
    EXPECT_EQ(flashmsa_fwd_workspace_size(&a, &n), FLASHMSA_ERROR_INVALID_ARGUMENT) << "max_seqlen " << bad;
    EXPECT_NE(std::string(flashmsa_last_error()).find("max_seqlen"), std::string::npos) << flashmsa_last_error();
    EXPECT_EQ(flashmsa_fwd(&a, nullptr, 0), FLASHMSA_ERROR_INVALID_ARGUMENT);
    download(out);
    for (double x : out.host) ASSERT_TRUE(std::isnan(x)) << "a refused call wrote its output";
  }
  run_step(s, {}, 0, &st);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(st.check().rc, FLASHMSA_SUCCESS);
  for (Tensor* t : {&s.out, &s.lse, &s.dq, &s.dk, &s.dv, &s.dqp, &s.dkp}) {
    download(*t);
    EXPECT_TRUE(all_finite(t->host));
  }
}

// Status words the device cannot write are refused before anything runs.
TEST(Metadata, PageableStatusRefused) {
  PoolScope scope;
  std::mt19937_64 rng(seed_now());
  Step s = make_step(kTable, rng, StepCalls::kSparseOnly);
  std::vector<int32_t> pageable(FLASHMSA_STATUS_WORDS, 0);
  flashmsa::SelectArgs a;
  a.qp = dev_view(s.qp);
  a.kp = dev_view(s.kp);
  Tensor cu;
  cu.shape = {3};
  cu.dtype = FLASHMSA_DTYPE_INT32;
  cu.host = {0, 1000, 3000};
  upload(cu);
  a.cu_seqlens = dev_view(cu);
  a.max_seqlen = 2000;
  a.topk = 4;
  Tensor idx = output({4, 3000, 4}, FLASHMSA_DTYPE_INT32);
  a.indices = dev_view(idx);
  a.status = flashmsa::view(pageable.data(), FLASHMSA_DTYPE_INT32, {FLASHMSA_STATUS_WORDS});
  size_t n = 0;
  EXPECT_EQ(flashmsa_select_workspace_size(&a, &n), FLASHMSA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashmsa_last_error()).find("page-locked"), std::string::npos) << flashmsa_last_error();
}

// Seeded random corruptions of cu_seqlens / max_seqlen through selection, forward and backward
// (FLASHMSA_FUZZ_N, default 200): each must be reported with exactly SPEC's faults and poison
// every output; a valid step at the end still matches the one before.
TEST(Metadata, SmallFuzz) {
  PoolScope scope;
  const char* env = std::getenv("FLASHMSA_FUZZ_N");
  const int n = env ? std::atoi(env) : 200;
  const uint64_t seed = seed_now();
  std::printf("    fuzz seed %llu, %d corruptions\n", (unsigned long long)seed, n);
  std::mt19937_64 rng(seed);
  const Problem pb = Problem().heads(8, 2).proxy_heads(2, 1).with_topk(2).seqlens({300, 129, 0, 271, 5});
  const int64_t T = pb.total();
  Step s = make_step(pb, rng, StepCalls::kSparseOnly);
  Status st(rng() % 2 == 0 ? StatusMemory::kHost : StatusMemory::kDevice);
  const std::vector<int64_t> good = pb.offsets();
  const int64_t good_max = pb.max_len();
  run_step(s, good, good_max, &st);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(st.check().rc, FLASHMSA_SUCCESS);
  const auto before = snapshot(s);
  int reported = 0;
  int32_t seen = 0;
  for (int it = 0; it < n; ++it) {
    std::vector<int64_t> cu = good;
    int64_t max_seqlen = good_max;
    const auto pick = [&](size_t m) { return size_t(rng() % m); };
    // corrupt until invalid (a middle value moved within its neighbours is a valid packing)
    while (expected_faults(cu, T, max_seqlen) == 0) {
      const int64_t specials[] = {INT32_MIN, INT32_MAX, -1, T + 1, T - 1, 0, T};
      switch (rng() % 7) {
        case 0: cu[pick(cu.size())] += int64_t(rng() % 400) - 200; break;
        case 1: cu[pick(cu.size())] = specials[pick(7)]; break;
        case 2: std::swap(cu[pick(cu.size())], cu[pick(cu.size())]); break;
        case 3: max_seqlen = int64_t(rng() % std::max<int64_t>(good_max, 1)); break;
        case 4: cu[0] = int64_t(rng() % 50) + 1; break;
        case 5: cu.back() = T + int64_t(rng() % 300) - 150; break;
        default: cu.insert(cu.begin() + 1 + pick(cu.size() - 1), int64_t(rng() % (T + 200)) - 100); break;
      }
      for (auto& x : cu) x = std::clamp<int64_t>(x, INT32_MIN, INT32_MAX);
    }
    const int32_t want = expected_faults(cu, T, max_seqlen);
    run_step(s, cu, max_seqlen, &st);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "corruption " << it;
    const Status::Read r = st.check();
    ASSERT_EQ(r.rc, FLASHMSA_ERROR_INVALID_ARGUMENT) << "corruption " << it << " not reported";
    ASSERT_EQ(r.faults, want) << "corruption " << it << ": " << r.msg;
    reported += 1;
    seen |= r.faults;
    if (it % 25 == 0) expect_poisoned(s, "corruption " + std::to_string(it));
  }
  EXPECT_EQ(reported, n);
  std::printf("    %d of %d corruptions reported; fault kinds seen: 0x%x\n", reported, n, unsigned(seen));
  run_step(s, good, good_max, &st);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(st.check().rc, FLASHMSA_SUCCESS);
  const auto after = snapshot(s);
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_EQ(std::memcmp(after[i].data(), before[i].data(), after[i].size() * sizeof(double)), 0)
        << kNames[i] << ": the valid step after the fuzz differs from before";
}

}  // namespace
