// flashmsa — the main job: one MSA training step (selection, forward, backward) on inputs drawn
// from a BENCHMARKS.md selection pattern, with selection statistics, attention-mass recall,
// timings, effective TFLOP/s, an optional check against the fp64 reference and an optional
// dump of every tensor as .npy files.
//
//   flashmsa run [flags]        (flashmsa run --help lists them)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#ifdef FLASHMSA_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "common/dtype.hpp"
#include "flashmsa/flashmsa.h"
#include "flashmsa/flashmsa.hpp"
#include "npy.hpp"
#include "patterns.hpp"
#include "reference/reference.hpp"

namespace flashmsa::cli {

constexpr int kBlock = FLASHMSA_BLOCK_SIZE;
constexpr int64_t kCheckFullMaxTokens = 4096;  // --check: everything up to this many tokens
constexpr int64_t kSampleTokens = 256;          // else this many sampled tokens
constexpr double kRecallFullBudget = 5e10;      // recall on all rows when the dense work is below
constexpr double kIndexAgreementMin = 0.99;     // --check fails below this index agreement
constexpr double kMaxKlGrad = 1e6;              // --kl-grad: |X| at most this (a loss weight)

// CPU defaults: m3 heads at a length where topk < number of blocks, so the selection is sparse.
constexpr int64_t kCpuDefaultSeqlen = 2048;
constexpr int kCpuDefaultTopk = 4;
constexpr int64_t kCudaDefaultSeqlen = 32768;
constexpr int kCudaDefaultTopk = 16;

// ---- errors ------------------------------------------------------------------------------

// A bad command line: exit code 2 with a usage hint.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- usage -------------------------------------------------------------------------------

const char* kMainUsage =
    "usage: flashmsa run [flags]     one MSA training step with statistics, timings, checks\n"
    "       flashmsa --help          this text\n"
    "       flashmsa run --help      the flags of run\n";

const char* kRunUsage =
    "usage: flashmsa run [flags]\n"
    "\n"
    "Draws seeded inputs, runs selection (flashmsa_select), forward (flashmsa_fwd, kl computed)\n"
    "and backward (flashmsa_bwd) and reports selection statistics, attention-mass recall, kl,\n"
    "time per stage and effective TFLOP/s.\n"
    "\n"
    "problem\n"
    "  --config m3|fmsa       heads preset (default m3): m3 Hq=64 Hkv=4 Hp=4 Hpk=1 D=Dp=128;\n"
    "                         fmsa Hq=16 Hkv=2 Hp=4 Hpk=1 D=Dp=128 (topk 16 on the GPU)\n"
    "  --hq --hkv --hp --hpk --d --dp N   override single head counts / head dims\n"
    "  --seqlen N             one sequence of N tokens (default: 2048 on the CPU, 32768 on CUDA)\n"
    "  --lengths a,b,c        varlen sequences (zero allowed); with --seqlen they must sum to it\n"
    "  --batch B              batched [B, S, H, D] call of B sequences of --seqlen tokens\n"
    "  --topk K               blocks of 128 per token, 1..64 (default: 4 on the CPU, 16 on CUDA)\n"
    "  --dtype bf16|fp16|fp32|fp64   input dtype (default bf16; fp32, fp64: CPU backend only)\n"
    "  --pattern random|clustered    proxy inputs (BENCHMARKS.md; default clustered)\n"
    "  --seed S               random seed (default 0)\n"
    "step\n"
    "  --mode train|infer|warmup     train: select+fwd+bwd; infer: select+fwd (INFER numerics);\n"
    "                         warmup: dense causal fwd+bwd, kl over the full causal set\n"
    "  --kl-grad X            upstream gradient of kl, |X| <= 1e6 (default 1)\n"
    "  --dlse                 also feed a seeded random gradient of lse to the backward\n"
    "  --deterministic        the bitwise reproducible backward (ordered adds on CUDA)\n"
    "  --precise-dpsum        the forward keeps out_lo, the backward's dpsum uses out + out_lo\n"
    "  --backend auto|cpu|cuda       auto (default): CUDA when available and supported, else CPU\n"
    "  --threads N            CPU worker threads, 1..1024 (sets FLASHMSA_NUM_THREADS)\n"
    "output\n"
    "  --check                compare with the fp64 CPU reference (exit 1 when over threshold)\n"
    "  --save DIR             write every tensor as .npy plus config.json into DIR (created and\n"
    "                         checked for writing before the step runs)\n"
    "  --quiet                no progress lines on stderr\n"
    "  -h, --help             this text\n";

// ---- configuration -----------------------------------------------------------------------

enum class Mode { Train, Infer, Warmup };
enum class Backend { Auto, Cpu, Cuda };

const char* mode_name(Mode m) {
  return m == Mode::Train ? "train" : m == Mode::Infer ? "infer" : "warmup";
}
const char* backend_name(Backend b) {
  return b == Backend::Auto ? "auto" : b == Backend::Cpu ? "cpu" : "cuda";
}

struct Config {
  // as given (-1: not given)
  std::string preset = "m3";
  int Hq = -1, Hkv = -1, Hp = -1, Hpk = -1, D = -1, Dp = -1;
  int64_t seqlen = -1;
  int batch = -1;
  bool lengths_given = false;
  std::vector<int64_t> lengths;
  int topk = -1;
  flashmsa_dtype_t dtype = FLASHMSA_DTYPE_BF16;
  Pattern pattern = Pattern::Clustered;
  uint64_t seed = 0;
  Mode mode = Mode::Train;
  Backend backend = Backend::Auto;
  double kl_grad = 1.0;
  bool dlse = false;
  bool deterministic = false, precise_dpsum = false;
  int threads = 0;
  bool check = false;
  bool quiet = false;
  std::string save_dir;

  // resolved
  bool on_cuda = false;
  bool batched = false;  // a [B, S, H, D] call
  std::vector<int64_t> cu;
  int64_t total = 0, max_seqlen = 0;
  std::vector<std::string> defaulted;  // "seqlen=2048", ...
  std::string fallback_notice;

  bool sparse() const { return mode != Mode::Warmup; }
  bool has_bwd() const { return mode != Mode::Infer; }
  int nseq() const { return int(cu.size()) - 1; }
  double scale() const { return 1.0 / std::sqrt(double(D)); }
  double proxy_scale() const { return 1.0 / std::sqrt(double(Dp)); }
};

int64_t parse_int(const std::string& flag, const std::string& s, int64_t lo, int64_t hi) {
  if (s.empty()) throw UsageError(flag + ": expected an integer, got an empty value");
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end == s.c_str() || *end != '\0')
    throw UsageError(flag + ": expected an integer, got '" + s + "'");
  if (v < lo || v > hi)
    throw UsageError(flag + ": expected a value in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "], got " + s);
  return v;
}

uint64_t parse_u64(const std::string& flag, const std::string& s) {
  char* end = nullptr;
  errno = 0;
  if (s.empty() || s[0] == '-') throw UsageError(flag + ": expected a non-negative integer, got '" + s + "'");
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0')
    throw UsageError(flag + ": expected a non-negative integer, got '" + s + "'");
  return v;
}

double parse_double(const std::string& flag, const std::string& s) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || errno != 0 || *end != '\0' || !std::isfinite(v))
    throw UsageError(flag + ": expected a finite number, got '" + s + "'");
  return v;
}

std::vector<int64_t> parse_lengths(const std::string& flag, const std::string& s) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (true) {
    const size_t comma = s.find(',', pos);
    out.push_back(parse_int(flag, s.substr(pos, comma == std::string::npos ? std::string::npos
                                                                            : comma - pos),
                            0, int64_t(1) << 31));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

flashmsa_dtype_t parse_dtype(const std::string& s) {
  if (s == "bf16") return FLASHMSA_DTYPE_BF16;
  if (s == "fp16") return FLASHMSA_DTYPE_FP16;
  if (s == "fp32") return FLASHMSA_DTYPE_FP32;
  if (s == "fp64") return FLASHMSA_DTYPE_FP64;
  throw UsageError("--dtype: expected bf16, fp16, fp32 or fp64, got '" + s + "'");
}

// Returns false when help was asked for.
bool parse_run_args(const std::vector<std::string>& args, Config& c) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i], value;
    bool has_inline = false;
    if (flag.rfind("--", 0) == 0) {
      const size_t eq = flag.find('=');
      if (eq != std::string::npos) {
        value = flag.substr(eq + 1);
        flag = flag.substr(0, eq);
        has_inline = true;
      }
    }
    auto val = [&]() -> std::string {
      if (has_inline) return value;
      if (i + 1 >= args.size()) throw UsageError(flag + ": missing value");
      return args[++i];
    };
    auto no_value = [&]() {
      if (has_inline) throw UsageError(flag + ": takes no value");
    };
    const int64_t kMaxHeads = 1 << 16;
    if (flag == "-h" || flag == "--help") return false;
    else if (flag == "--config") {
      c.preset = val();
      if (c.preset != "m3" && c.preset != "fmsa")
        throw UsageError("--config: expected m3 or fmsa, got '" + c.preset + "'");
    } else if (flag == "--hq") c.Hq = int(parse_int(flag, val(), 1, kMaxHeads));
    else if (flag == "--hkv") c.Hkv = int(parse_int(flag, val(), 1, kMaxHeads));
    else if (flag == "--hp") c.Hp = int(parse_int(flag, val(), 1, kMaxHeads));
    else if (flag == "--hpk") c.Hpk = int(parse_int(flag, val(), 1, kMaxHeads));
    else if (flag == "--d") c.D = int(parse_int(flag, val(), 1, 4096));
    else if (flag == "--dp") c.Dp = int(parse_int(flag, val(), 1, 4096));
    else if (flag == "--seqlen") c.seqlen = parse_int(flag, val(), 0, int64_t(1) << 31);
    else if (flag == "--lengths") {
      c.lengths = parse_lengths(flag, val());
      c.lengths_given = true;
    } else if (flag == "--batch") c.batch = int(parse_int(flag, val(), 1, 1 << 20));
    else if (flag == "--topk") c.topk = int(parse_int(flag, val(), 1, FLASHMSA_MAX_TOPK));
    else if (flag == "--dtype") c.dtype = parse_dtype(val());
    else if (flag == "--pattern") {
      const std::string s = val();
      if (!parse_pattern(s, &c.pattern))
        throw UsageError("--pattern: expected random or clustered, got '" + s + "'");
    } else if (flag == "--seed") c.seed = parse_u64(flag, val());
    else if (flag == "--mode") {
      const std::string s = val();
      if (s == "train") c.mode = Mode::Train;
      else if (s == "infer") c.mode = Mode::Infer;
      else if (s == "warmup") c.mode = Mode::Warmup;
      else throw UsageError("--mode: expected train, infer or warmup, got '" + s + "'");
    } else if (flag == "--backend") {
      const std::string s = val();
      if (s == "auto") c.backend = Backend::Auto;
      else if (s == "cpu") c.backend = Backend::Cpu;
      else if (s == "cuda") c.backend = Backend::Cuda;
      else throw UsageError("--backend: expected auto, cpu or cuda, got '" + s + "'");
    } else if (flag == "--kl-grad") {
      const std::string s = val();
      c.kl_grad = parse_double(flag, s);
      if (std::fabs(c.kl_grad) > kMaxKlGrad)
        throw UsageError(flag + ": expected a finite number with |X| <= 1e6 (the upstream gradient "
                         "of kl, a loss weight), got " + s);
    }
    else if (flag == "--dlse") { no_value(); c.dlse = true; }
    else if (flag == "--deterministic") { no_value(); c.deterministic = true; }
    else if (flag == "--precise-dpsum") { no_value(); c.precise_dpsum = true; }
    else if (flag == "--threads") c.threads = int(parse_int(flag, val(), 1, ref::kMaxThreads));
    else if (flag == "--check") { no_value(); c.check = true; }
    else if (flag == "--quiet") { no_value(); c.quiet = true; }
    else if (flag == "--save") {
      c.save_dir = val();
      if (c.save_dir.empty()) throw UsageError("--save: expected a directory");
    } else throw UsageError("unknown flag '" + args[i] + "'");
  }
  return true;
}

// Heads, dims and combinations that do not depend on the backend.
void resolve_heads(Config& c) {
  const bool m3 = c.preset == "m3";
  auto pick = [](int given, int preset) { return given > 0 ? given : preset; };
  c.Hq = pick(c.Hq, m3 ? 64 : 16);
  c.Hkv = pick(c.Hkv, m3 ? 4 : 2);
  c.Hp = pick(c.Hp, 4);
  c.Hpk = pick(c.Hpk, 1);
  c.D = pick(c.D, 128);
  c.Dp = pick(c.Dp, 128);
  if (c.Hq % c.Hkv != 0)
    throw UsageError("heads: Hq (" + std::to_string(c.Hq) + ") must be a multiple of Hkv (" +
                     std::to_string(c.Hkv) + ")");
  if (c.Hq % c.Hp != 0)
    throw UsageError("heads: Hq (" + std::to_string(c.Hq) + ") must be a multiple of Hp (" +
                     std::to_string(c.Hp) + ")");
  if (c.Hp % c.Hpk != 0)
    throw UsageError("heads: Hp (" + std::to_string(c.Hp) + ") must be a multiple of Hpk (" +
                     std::to_string(c.Hpk) + ")");
  if (c.batch > 0 && c.lengths_given)
    throw UsageError("--batch: cannot be combined with --lengths (a batched call has equal lengths)");
  if (c.lengths_given && c.seqlen >= 0) {
    int64_t sum = 0;
    for (int64_t l : c.lengths) sum += l;
    if (sum != c.seqlen)
      throw UsageError("--lengths: the lengths sum to " + std::to_string(sum) +
                       " tokens but --seqlen says " + std::to_string(c.seqlen));
  }
}

// Lengths and topk, with the defaults of the chosen backend.
void resolve_sizes(Config& c) {
  const int64_t def_len = c.on_cuda ? kCudaDefaultSeqlen : kCpuDefaultSeqlen;
  const int def_topk = c.on_cuda ? kCudaDefaultTopk : kCpuDefaultTopk;
  c.defaulted.clear();
  if (c.topk < 0 && c.sparse()) {
    c.topk = def_topk;
    c.defaulted.push_back("topk=" + std::to_string(def_topk));
  }
  if (c.topk < 0) c.topk = def_topk;  // warmup: unused, kept for the proxy scale of the report
  std::vector<int64_t> lens;
  if (c.lengths_given) {
    lens = c.lengths;
  } else {
    int64_t s = c.seqlen;
    if (s < 0) {
      s = def_len;
      c.defaulted.push_back("seqlen=" + std::to_string(def_len));
    }
    const int b = c.batch > 0 ? c.batch : 1;
    lens.assign(size_t(b), s);
    c.batched = c.batch > 0;
  }
  c.cu.assign(1, 0);
  c.max_seqlen = 0;
  for (int64_t l : lens) {
    c.cu.push_back(c.cu.back() + l);
    c.max_seqlen = std::max(c.max_seqlen, l);
  }
  c.total = c.cu.back();
  if (c.total > std::numeric_limits<int32_t>::max())
    throw UsageError("lengths: " + std::to_string(c.total) + " tokens in all; cu_seqlens is int32");
}

std::string fmt(const char* f, ...);  // printf into a string (below)

// ---- progress ----------------------------------------------------------------------------

bool g_quiet = false;

void progress(const char* fmt, ...) {
  if (g_quiet) return;
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fflush(stderr);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- device memory (the CUDA runtime only when the library was built with CUDA) -----------

namespace dev {
#ifdef FLASHMSA_WITH_CUDA
void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw flashmsa::Error(FLASHMSA_ERROR_DEVICE, std::string("flashmsa run: ") + what + ": " +
                                                     cudaGetErrorString(e));
}
void* alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  ok(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
}
void release(void* p) {
  if (p) cudaFree(p);
}
void upload(void* d, const void* h, size_t bytes) {
  if (bytes) ok(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}
void download(void* h, const void* d, size_t bytes) {
  if (bytes) ok(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}
void poison(void* d, size_t bytes) {
  if (bytes) ok(cudaMemset(d, 0xff, bytes), "cudaMemset");
}
void sync() { ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
constexpr bool kRuntime = true;
#else
[[noreturn]] void none() {
  throw flashmsa::Error(FLASHMSA_ERROR_NOT_SUPPORTED,
                        "flashmsa run: this executable was built without the CUDA runtime");
}
void* alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  none();
}
void release(void*) {}
void upload(void*, const void*, size_t bytes) {
  if (bytes) none();
}
void download(void*, const void*, size_t bytes) {
  if (bytes) none();
}
void poison(void*, size_t bytes) {
  if (bytes) none();
}
void sync() {}
constexpr bool kRuntime = false;
#endif
}  // namespace dev

// ---- tensors -----------------------------------------------------------------------------

// One tensor of the step: its host copy (in the library dtype) and, on CUDA, its device copy.
struct Buf {
  enum Kind { kTokens, kOther };
  std::string name;
  flashmsa_dtype_t dtype = FLASHMSA_DTYPE_FP32;
  std::vector<int64_t> shape;  // the saved (varlen) layout
  Kind kind = kOther;
  bool used = false;
  bool output = false;
  std::vector<unsigned char> host;
  void* device = nullptr;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  size_t bytes() const { return size_t(numel()) * dtype_size(dtype); }
  void declare(const char* n, flashmsa_dtype_t t, std::vector<int64_t> s, Kind k, bool out) {
    name = n;
    dtype = t;
    shape = std::move(s);
    kind = k;
    used = true;
    output = out;
  }
  void allocate_host() { host.assign(bytes(), 0); }
  void poison_host() { std::memset(host.data(), 0xff, host.size()); }
  double get(int64_t i) const { return load_as_double(dtype, host.data(), i); }
  std::vector<double> values() const {
    std::vector<double> v(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) v[size_t(i)] = get(i);
    return v;
  }
  void assign(const std::vector<double>& v) {  // rounds to the dtype (RNE)
    allocate_host();
    for (int64_t i = 0; i < numel(); ++i) store_from_double(dtype, host.data(), i, v[size_t(i)]);
  }
  const int32_t* i32() const { return reinterpret_cast<const int32_t*>(host.data()); }
  int32_t* i32() { return reinterpret_cast<int32_t*>(host.data()); }
};

struct Tensors {
  Buf q, k, v, qp, kp, cu, dout, dlse, dkl;  // inputs
  Buf out, lse, indices, proxy_lse, kl, out_lo;  // forward (and selection) outputs
  Buf dq, dk, dv, dqp, dkp;                  // backward outputs

  std::vector<Buf*> all() {
    return {&q, &k, &v, &qp, &kp, &cu, &dout, &dlse, &dkl, &out, &lse, &indices, &proxy_lse,
            &kl, &out_lo, &dq, &dk, &dv, &dqp, &dkp};
  }
  std::vector<const Buf*> all() const {
    std::vector<const Buf*> r;
    for (Buf* b : const_cast<Tensors*>(this)->all()) r.push_back(b);
    return r;
  }
};

// Shapes and dtypes of every tensor of the step (no memory yet).
void declare(const Config& c, Tensors& t) {
  const flashmsa_dtype_t dt = c.dtype;
  const flashmsa_dtype_t st = dt == FLASHMSA_DTYPE_FP64 ? FLASHMSA_DTYPE_FP64 : FLASHMSA_DTYPE_FP32;
  const int64_t T = c.total;
  t.q.declare("q", dt, {T, c.Hq, c.D}, Buf::kTokens, false);
  t.k.declare("k", dt, {T, c.Hkv, c.D}, Buf::kTokens, false);
  t.v.declare("v", dt, {T, c.Hkv, c.D}, Buf::kTokens, false);
  t.qp.declare("qp", dt, {T, c.Hp, c.Dp}, Buf::kTokens, false);
  t.kp.declare("kp", dt, {T, c.Hpk, c.Dp}, Buf::kTokens, false);
  t.cu.declare("cu_seqlens", FLASHMSA_DTYPE_INT32, {int64_t(c.cu.size())}, Buf::kOther, false);
  t.out.declare("out", dt, {T, c.Hq, c.D}, Buf::kTokens, true);
  t.lse.declare("lse", st, {c.Hq, T}, Buf::kOther, true);
  if (c.sparse()) t.indices.declare("indices", FLASHMSA_DTYPE_INT32, {c.Hp, T, c.topk}, Buf::kOther, true);
  t.proxy_lse.declare("proxy_lse", st, {c.Hp, T}, Buf::kOther, true);
  t.kl.declare("kl", st, {}, Buf::kOther, true);
  if (c.has_bwd() && c.precise_dpsum) t.out_lo.declare("out_lo", dt, {T, c.Hq, c.D}, Buf::kTokens, true);
  if (c.has_bwd()) {
    t.dout.declare("dout", dt, {T, c.Hq, c.D}, Buf::kTokens, false);
    if (c.dlse) t.dlse.declare("dlse", st, {c.Hq, T}, Buf::kOther, false);
    t.dkl.declare("dkl", st, {}, Buf::kOther, false);
    t.dq.declare("dq", dt, {T, c.Hq, c.D}, Buf::kTokens, true);
    t.dk.declare("dk", dt, {T, c.Hkv, c.D}, Buf::kTokens, true);
    t.dv.declare("dv", dt, {T, c.Hkv, c.D}, Buf::kTokens, true);
    t.dqp.declare("dqp", dt, {T, c.Hp, c.Dp}, Buf::kTokens, true);
    t.dkp.declare("dkp", dt, {T, c.Hpk, c.Dp}, Buf::kTokens, true);
  }
}

// Seeded inputs, rounded to the dtype; outputs poisoned (NaN / -1 bytes).
void generate(const Config& c, Tensors& t) {
  const size_t T = size_t(c.total);
  t.q.assign(normal_values(c.seed, kStreamQ, T * c.Hq * c.D));
  t.k.assign(normal_values(c.seed, kStreamK, T * c.Hkv * c.D));
  t.v.assign(normal_values(c.seed, kStreamV, T * c.Hkv * c.D));
  const ProxyInputs px = draw_proxy(c.pattern, c.cu, c.Hp, c.Hpk, c.Dp, c.seed);
  t.qp.assign(px.qp);
  t.kp.assign(px.kp);
  t.cu.allocate_host();
  for (size_t i = 0; i < c.cu.size(); ++i) t.cu.i32()[i] = int32_t(c.cu[i]);
  if (c.has_bwd()) {
    t.dout.assign(normal_values(c.seed, kStreamDout, T * c.Hq * c.D));
    if (c.dlse) {
      Rng r2(c.seed, kStreamDlse);
      t.dlse.assign(normal_values(r2, size_t(c.Hq) * T));
    }
    t.dkl.assign({c.kl_grad});
  }
  for (Buf* b : t.all())
    if (b->used && b->output) {
      b->allocate_host();
      b->poison_host();
    }
}

// The library's view of a buffer: host or device memory; [B, S, H, X] for per-token tensors of
// a batched call; absent when the tensor is not part of this step.
struct Views {
  const Config& c;
  bool device;
  void* probe = nullptr;  // metadata-only probe: every tensor points here

  flashmsa_tensor_t operator()(const Buf& b) const {
    if (!b.used) return flashmsa::none();
    flashmsa_tensor_t t{};
    t.data = probe ? probe : device ? b.device : const_cast<unsigned char*>(b.host.data());
    if (b.numel() == 0 && !probe) t.data = nullptr;
    t.dtype = b.dtype;
    t.device_type = device ? FLASHMSA_DEVICE_CUDA : FLASHMSA_DEVICE_CPU;
    t.device_id = 0;
    std::vector<int64_t> shape = b.shape;
    if (b.kind == Buf::kTokens && c.batched)
      shape = {int64_t(c.nseq()), c.max_seqlen, b.shape[1], b.shape[2]};
    t.ndim = int32_t(shape.size());
    int64_t stride = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      t.shape[d] = shape[size_t(d)];
      t.strides[d] = stride;
      stride *= shape[size_t(d)];
    }
    return t;
  }
};

// ---- the step ----------------------------------------------------------------------------

struct StageArgs {
  flashmsa_select_args_t sel;
  flashmsa_fwd_args_t fwd;
  flashmsa_bwd_args_t bwd;
};

StageArgs make_args(const Config& c, Tensors& t, const Views& V) {
  StageArgs a;
  flashmsa_select_args_init(&a.sel);
  flashmsa_fwd_args_init(&a.fwd);
  flashmsa_bwd_args_init(&a.bwd);
  const flashmsa_tensor_t cu = c.batched ? flashmsa::none() : V(t.cu);
  const int64_t max_seqlen = c.max_seqlen;

  a.sel.qp = V(t.qp);
  a.sel.kp = V(t.kp);
  a.sel.cu_seqlens = cu;
  a.sel.max_seqlen = max_seqlen;
  a.sel.topk = c.topk;
  a.sel.indices = V(t.indices);

  // The forward consumes the selection stage's indices (GIVEN); warmup is DENSE.
  const flashmsa_mode_t lib_mode = c.sparse() ? FLASHMSA_MODE_GIVEN : FLASHMSA_MODE_DENSE;
  a.fwd.q = V(t.q);
  a.fwd.k = V(t.k);
  a.fwd.v = V(t.v);
  a.fwd.qp = V(t.qp);
  a.fwd.kp = V(t.kp);
  a.fwd.cu_seqlens = cu;
  a.fwd.max_seqlen = max_seqlen;
  a.fwd.mode = lib_mode;
  a.fwd.numerics = c.mode == Mode::Infer ? FLASHMSA_NUMERICS_INFER : FLASHMSA_NUMERICS_TRAIN;
  a.fwd.topk = c.sparse() ? c.topk : 0;
  a.fwd.compute_kl = 1;
  a.fwd.indices = V(t.indices);
  a.fwd.out = V(t.out);
  a.fwd.lse = V(t.lse);
  a.fwd.proxy_lse = V(t.proxy_lse);
  a.fwd.kl = V(t.kl);
  a.fwd.out_lo = V(t.out_lo);

  a.bwd.q = V(t.q);
  a.bwd.k = V(t.k);
  a.bwd.v = V(t.v);
  a.bwd.qp = V(t.qp);
  a.bwd.kp = V(t.kp);
  a.bwd.cu_seqlens = cu;
  a.bwd.max_seqlen = max_seqlen;
  a.bwd.mode = lib_mode;
  a.bwd.indices = V(t.indices);
  a.bwd.out = V(t.out);
  a.bwd.out_lo = V(t.out_lo);
  a.bwd.deterministic = c.deterministic ? 1 : 0;
  a.bwd.lse = V(t.lse);
  a.bwd.proxy_lse = V(t.proxy_lse);
  a.bwd.dout = V(t.dout);
  a.bwd.dlse = V(t.dlse);
  a.bwd.dkl = V(t.dkl);
  a.bwd.dq = V(t.dq);
  a.bwd.dk = V(t.dk);
  a.bwd.dv = V(t.dv);
  a.bwd.dqp = V(t.dqp);
  a.bwd.dkp = V(t.dkp);
  return a;
}

// Asks the CUDA backend (metadata only: workspace queries) whether it can run this step.
// Returns "" when it can, else the library's message.
std::string probe_cuda(const Config& c) {
  Tensors t;
  declare(c, t);
  void* mem = nullptr;
#ifdef FLASHMSA_WITH_CUDA
  if (flashmsa_cuda_available() && cudaMalloc(&mem, 256) != cudaSuccess) {
    cudaGetLastError();
    mem = nullptr;
  }
#endif
  static unsigned char dummy[256];  // never dereferenced: the queries read metadata only
  Views V{c, true, mem ? mem : dummy};
  StageArgs a = make_args(c, t, V);
  size_t n = 0;
  flashmsa_status_t s = FLASHMSA_SUCCESS;
  if (c.sparse()) s = flashmsa_select_workspace_size(&a.sel, &n);
  if (s == FLASHMSA_SUCCESS) s = flashmsa_fwd_workspace_size(&a.fwd, &n);
  if (s == FLASHMSA_SUCCESS && c.has_bwd()) s = flashmsa_bwd_workspace_size(&a.bwd, &n);
  std::string msg = s == FLASHMSA_SUCCESS ? "" : flashmsa_last_error();
  if (s != FLASHMSA_SUCCESS && msg.empty()) msg = flashmsa_status_string(s);
  dev::release(mem);
  return msg;
}

// Picks the backend (auto: CUDA when available and able to run the step) and the sizes.
void resolve_backend(Config& c) {
  const bool fp_host_only = c.dtype == FLASHMSA_DTYPE_FP32 || c.dtype == FLASHMSA_DTYPE_FP64;
  if (c.backend == Backend::Cpu) {
    c.on_cuda = false;
    resolve_sizes(c);
    return;
  }
  if (c.backend == Backend::Cuda) {
    c.on_cuda = true;
    resolve_sizes(c);
    const std::string msg = probe_cuda(c);
    if (!msg.empty()) throw flashmsa::Error(FLASHMSA_ERROR_NOT_SUPPORTED, msg);
    if (!dev::kRuntime)
      throw flashmsa::Error(FLASHMSA_ERROR_NOT_SUPPORTED,
                            "flashmsa run: this executable was built without the CUDA runtime");
    return;
  }
  // auto
  if (flashmsa_cuda_available() && dev::kRuntime && !fp_host_only) {
    c.on_cuda = true;
    resolve_sizes(c);
    const std::string msg = probe_cuda(c);
    if (msg.empty()) return;
    c.fallback_notice = "note: CUDA device found but the CUDA backend cannot run this step (" +
                        msg + "); falling back to the CPU backend";
  }
  c.on_cuda = false;
  resolve_sizes(c);
}

struct Timings {
  double select_ms = NAN, fwd_ms = NAN, bwd_ms = NAN;
};

// Runs one library call: workspace query and allocation, synchronised wall-clock timing.
template <class Args, class Query, class Call>
double run_stage(const char* tag, const std::string& what, bool on_cuda, const Args& a, Query query,
                 Call call) {
  progress("[%s] %s ...\n", tag, what.c_str());
  size_t ws_bytes = 0;
  flashmsa::check(query(&a, &ws_bytes));
  std::vector<unsigned char> host_ws;
  void* ws = nullptr;
  if (ws_bytes > 0) {
    if (on_cuda) {
      ws = dev::alloc(ws_bytes);
    } else {
      host_ws.resize(ws_bytes);
      ws = host_ws.data();
    }
  }
  if (on_cuda) dev::sync();
  const double t0 = now_s();
  flashmsa_status_t s = call(&a, ws, ws_bytes);
  if (on_cuda && s == FLASHMSA_SUCCESS) dev::sync();
  const double dt = now_s() - t0;
  if (on_cuda) dev::release(ws);
  flashmsa::check(s);
  progress("[%s] done in %.3f s\n", tag, dt);
  return dt * 1e3;
}

Timings run_step(const Config& c, Tensors& t) {
  if (c.on_cuda) {
    progress("[cuda] copying inputs to the device ...\n");
    for (Buf* b : t.all())
      if (b->used) {
        b->device = dev::alloc(b->bytes());
        if (b->output) dev::poison(b->device, b->bytes());
        else dev::upload(b->device, b->host.data(), b->bytes());
      }
  }
  Views V{c, c.on_cuda, nullptr};
  const StageArgs a = make_args(c, t, V);
  Timings tm;
  const std::string where = std::string(c.on_cuda ? "cuda" : "cpu") + ", " +
                            std::to_string(c.total) + " tokens";
  try {
    if (c.sparse())
      tm.select_ms = run_stage("select", "selection, topk " + std::to_string(c.topk) + " (" + where + ")",
                               c.on_cuda, a.sel, flashmsa_select_workspace_size, flashmsa_select);
    tm.fwd_ms = run_stage("forward", std::string(c.sparse() ? "sparse" : "dense causal") +
                                         " forward + kl (" + where + ")",
                          c.on_cuda, a.fwd, flashmsa_fwd_workspace_size, flashmsa_fwd);
    if (c.has_bwd())
      tm.bwd_ms = run_stage("backward", "backward, dkl " + fmt("%g", c.kl_grad) + " (" + where + ")",
                            c.on_cuda, a.bwd, flashmsa_bwd_workspace_size, flashmsa_bwd);
  } catch (...) {
    if (c.on_cuda)
      for (Buf* b : t.all()) dev::release(b->device), b->device = nullptr;
    throw;
  }
  if (c.on_cuda) {
    for (Buf* b : t.all())
      if (b->used && b->output) dev::download(b->host.data(), b->device, b->bytes());
    for (Buf* b : t.all()) dev::release(b->device), b->device = nullptr;
  }
  return tm;
}

// ---- statistics --------------------------------------------------------------------------

ref::Problem make_problem(const Config& c, flashmsa_mode_t mode) {
  ref::Problem pb;
  pb.cu = c.cu;
  pb.total = c.total;
  pb.Hq = c.Hq;
  pb.Hkv = c.Hkv;
  pb.Hp = c.Hp;
  pb.Hpk = c.Hpk;
  pb.D = c.D;
  pb.Dp = c.Dp;
  pb.topk = c.topk;
  pb.mode = mode;
  pb.scale = c.scale();
  pb.proxy_scale = c.proxy_scale();
  return pb;
}

struct Stats {
  double union_factor = NAN, blocks_per_token = NAN, keys_per_token = NAN, density = NAN;
  double recall = NAN;
  std::string recall_rows;
  double kl = NAN;
  ref::PairCounts pairs;
  double dense_pairs = 0;  // sum over h, t of (position + 1)
  int64_t nonfinite_outputs = 0;
  std::string nonfinite_names;
};

// Distinct valid blocks of each 128-query tile (per sequence and proxy head) over topk, mean;
// and the mean number of valid slots per (token, proxy head).
void selection_stats(const Config& c, const int32_t* idx, Stats& s) {
  double tiles = 0, union_sum = 0, slots = 0;
  std::vector<int64_t> stamp;
  int64_t stamp_id = 0;
  for (int b = 0; b < c.nseq(); ++b) {
    const int64_t s0 = c.cu[size_t(b)], len = c.cu[size_t(b) + 1] - s0;
    const int64_t nblocks = (len + kBlock - 1) / kBlock;
    stamp.assign(size_t(nblocks), -1);
    for (int p = 0; p < c.Hp; ++p)
      for (int64_t tile = 0; tile * kBlock < len; ++tile) {
        ++stamp_id;
        int64_t distinct = 0;
        for (int64_t i = tile * kBlock; i < std::min(len, (tile + 1) * kBlock); ++i) {
          const int32_t* row = idx + (int64_t(p) * c.total + s0 + i) * c.topk;
          for (int k = 0; k < c.topk; ++k) {
            const int32_t j = row[k];
            if (j < 0 || j >= nblocks) continue;
            slots += 1;
            if (stamp[size_t(j)] != stamp_id) {
              stamp[size_t(j)] = stamp_id;
              ++distinct;
            }
          }
        }
        tiles += 1;
        union_sum += double(distinct) / c.topk;
      }
  }
  s.union_factor = tiles > 0 ? union_sum / tiles : NAN;
  s.blocks_per_token = c.total > 0 ? slots / (double(c.Hp) * c.total) : NAN;
}

std::vector<int64_t> sample_rows(const Config& c) {
  Rng r(c.seed, kStreamSample);
  return sample_distinct(r, c.total, kSampleTokens);
}

Stats compute_stats(const Config& c, const Tensors& t) {
  Stats s;
  progress("[stats] selection statistics and attention-mass recall ...\n");
  const double t0 = now_s();
  const ref::Problem pb = make_problem(c, c.sparse() ? FLASHMSA_MODE_SPARSE : FLASHMSA_MODE_DENSE);
  const int32_t* idx = c.sparse() ? t.indices.i32() : nullptr;
  s.pairs = ref::count_pairs(pb, idx);
  for (int b = 0; b < c.nseq(); ++b) {
    const double len = double(c.cu[size_t(b) + 1] - c.cu[size_t(b)]);
    s.dense_pairs += len * (len + 1) / 2 * c.Hq;
  }
  if (c.total > 0) {
    s.keys_per_token = s.pairs.main_pairs / (double(c.Hq) * c.total);
    s.density = s.dense_pairs > 0 ? s.pairs.main_pairs / s.dense_pairs : NAN;
  }
  s.kl = t.kl.get(0);
  if (c.sparse()) {
    selection_stats(c, idx, s);
    const double dense_work = s.dense_pairs * 2.0 * c.D;
    std::vector<int64_t> rows;
    if (dense_work <= kRecallFullBudget) {
      rows.resize(size_t(c.total));
      for (int64_t i = 0; i < c.total; ++i) rows[size_t(i)] = i;
      s.recall_rows = "all " + std::to_string(c.total) + " tokens x " + std::to_string(c.Hq) + " heads";
    } else {
      rows = sample_rows(c);
      s.recall_rows = "seeded sample of " + std::to_string(rows.size()) + " tokens x " +
                      std::to_string(c.Hq) + " heads";
    }
    const std::vector<double> q = t.q.values(), k = t.k.values();
    s.recall = ref::mass_recall(pb, q.data(), k.data(), idx, rows);
  } else {
    s.recall = 1.0;
    s.recall_rows = "dense causal set";
  }
  // every output fully written (outputs were poisoned with NaN before the run)
  for (const Buf* b : {&t.out, &t.lse, &t.indices, &t.proxy_lse, &t.kl, &t.dq, &t.dk, &t.dv,
                       &t.dqp, &t.dkp}) {
    if (!b->used) continue;
    int64_t bad = 0;
    if (b->dtype == FLASHMSA_DTYPE_INT32) {
      for (int64_t i = 0; i < b->numel(); ++i) bad += b->i32()[i] < -1 ? 1 : 0;
    } else {
      for (int64_t i = 0; i < b->numel(); ++i) bad += std::isnan(b->get(i)) ? 1 : 0;
    }
    if (bad) {
      s.nonfinite_outputs += bad;
      s.nonfinite_names += (s.nonfinite_names.empty() ? "" : ", ") + b->name + " (" +
                           std::to_string(bad) + ")";
    }
  }
  progress("[stats] done in %.3f s\n", now_s() - t0);
  return s;
}

// ---- check against the fp64 reference ---------------------------------------------------

struct Err {
  std::string name;
  double diff2 = 0, ref2 = 0, max_abs = 0;
  int64_t count = 0, mismatched_inf = 0;
  std::string note;
  void add(double got, double want) {
    ++count;
    if (std::isinf(want) || std::isinf(got) || std::isnan(got) || std::isnan(want)) {
      if (!(got == want)) ++mismatched_inf;
      return;
    }
    const double d = got - want;
    diff2 += d * d;
    ref2 += want * want;
    max_abs = std::max(max_abs, std::fabs(d));
  }
  double rel() const {
    if (mismatched_inf) return INFINITY;
    if (ref2 == 0) return diff2 == 0 ? 0.0 : INFINITY;
    return std::sqrt(diff2 / ref2);
  }
};

struct CheckResult {
  bool ran = false;
  std::string scope;
  std::vector<Err> errs;
  double index_agreement = NAN;
  int64_t index_slots = 0;
  double threshold = 0;
  bool pass = true;
};

double threshold_for(flashmsa_dtype_t t) {
  switch (t) {
    case FLASHMSA_DTYPE_FP32: return 1e-5;
    case FLASHMSA_DTYPE_FP64: return 1e-12;
    default: return 2e-2;
  }
}

Err compare_all(const char* name, const Buf& got, const std::vector<double>& want) {
  Err e;
  e.name = name;
  for (int64_t i = 0; i < got.numel(); ++i) e.add(got.get(i), want[size_t(i)]);
  return e;
}

// Small problems: the whole step again through the CPU backend with fp64 tensors (the
// reference), the forward and backward fed the kernel's own indices (SPEC section 4).
void check_full(const Config& c, const Tensors& t, CheckResult& r) {
  const flashmsa_dtype_t F = FLASHMSA_DTYPE_FP64;
  const int64_t T = c.total;
  r.scope = "all " + std::to_string(T) + " tokens, every output";
  std::vector<double> q = t.q.values(), k = t.k.values(), v = t.v.values(), qp = t.qp.values(),
                      kp = t.kp.values();
  std::vector<int32_t> cu(c.cu.begin(), c.cu.end());
  const flashmsa_tensor_t cu_v = flashmsa::view(cu.data(), FLASHMSA_DTYPE_INT32, {int64_t(cu.size())});
  auto tok = [&](std::vector<double>& x, int H, int X) {
    return flashmsa::view(x.empty() ? nullptr : x.data(), F, {T, H, X});
  };
  std::vector<int32_t> kidx;  // the kernel's indices, dense
  if (c.sparse()) {
    kidx.assign(t.indices.i32(), t.indices.i32() + t.indices.numel());
    std::vector<int32_t> ridx(kidx.size(), -1);
    flashmsa::SelectArgs s;
    s.qp = tok(qp, c.Hp, c.Dp);
    s.kp = tok(kp, c.Hpk, c.Dp);
    s.cu_seqlens = cu_v;
    s.max_seqlen = c.max_seqlen;
    s.topk = c.topk;
    s.indices = flashmsa::view(ridx.empty() ? nullptr : ridx.data(), FLASHMSA_DTYPE_INT32,
                               {c.Hp, T, c.topk});
    flashmsa::select(s);
    int64_t same = 0;
    for (size_t i = 0; i < ridx.size(); ++i) same += ridx[i] == kidx[i];
    r.index_slots = int64_t(ridx.size());
    r.index_agreement = ridx.empty() ? 1.0 : double(same) / double(ridx.size());
  }
  const flashmsa_mode_t mode = c.sparse() ? FLASHMSA_MODE_GIVEN : FLASHMSA_MODE_DENSE;
  const flashmsa_tensor_t idx_v =
      c.sparse() ? flashmsa::view(kidx.empty() ? nullptr : kidx.data(), FLASHMSA_DTYPE_INT32,
                                  {c.Hp, T, c.topk})
                 : flashmsa::none();
  std::vector<double> out(size_t(T) * c.Hq * c.D), lse(size_t(c.Hq) * T), plse(size_t(c.Hp) * T);
  double kl = 0;
  auto heads = [&](std::vector<double>& x, int H) {
    return flashmsa::view(x.empty() ? nullptr : x.data(), F, {H, T});
  };
  flashmsa::FwdArgs f;
  f.q = tok(q, c.Hq, c.D);
  f.k = tok(k, c.Hkv, c.D);
  f.v = tok(v, c.Hkv, c.D);
  f.qp = tok(qp, c.Hp, c.Dp);
  f.kp = tok(kp, c.Hpk, c.Dp);
  f.cu_seqlens = cu_v;
  f.max_seqlen = c.max_seqlen;
  f.mode = mode;
  f.compute_kl = 1;
  f.indices = idx_v;
  f.out = tok(out, c.Hq, c.D);
  f.lse = heads(lse, c.Hq);
  f.proxy_lse = heads(plse, c.Hp);
  f.kl = flashmsa::view(&kl, F, {});
  flashmsa::fwd(f);
  r.errs.push_back(compare_all("out", t.out, out));
  r.errs.push_back(compare_all("lse", t.lse, lse));
  r.errs.push_back(compare_all("proxy_lse", t.proxy_lse, plse));
  r.errs.push_back(compare_all("kl", t.kl, {kl}));
  if (!c.has_bwd()) return;
  std::vector<double> dout = t.dout.values(), dlse = c.dlse ? t.dlse.values() : std::vector<double>();
  double dkl = c.kl_grad;
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), dqp(qp.size()), dkp(kp.size());
  flashmsa::BwdArgs b;
  b.q = f.q;
  b.k = f.k;
  b.v = f.v;
  b.qp = f.qp;
  b.kp = f.kp;
  b.cu_seqlens = cu_v;
  b.max_seqlen = c.max_seqlen;
  b.mode = mode;
  b.indices = idx_v;
  b.out = f.out;
  b.lse = f.lse;
  b.proxy_lse = f.proxy_lse;
  b.dout = tok(dout, c.Hq, c.D);
  if (c.dlse) b.dlse = heads(dlse, c.Hq);
  b.dkl = flashmsa::view(&dkl, F, {});
  b.dq = tok(dq, c.Hq, c.D);
  b.dk = tok(dk, c.Hkv, c.D);
  b.dv = tok(dv, c.Hkv, c.D);
  b.dqp = tok(dqp, c.Hp, c.Dp);
  b.dkp = tok(dkp, c.Hpk, c.Dp);
  flashmsa::bwd(b);
  r.errs.push_back(compare_all("dq", t.dq, dq));
  r.errs.push_back(compare_all("dk", t.dk, dk));
  r.errs.push_back(compare_all("dv", t.dv, dv));
  r.errs.push_back(compare_all("dqp", t.dqp, dqp));
  r.errs.push_back(compare_all("dkp", t.dkp, dkp));
}

// Runs fn(i) for i in [0, n) on the reference's thread count (items are independent, so the
// result does not depend on which thread ran which item). Threads that cannot be started leave
// their share to the others; the first exception of any thread is rethrown after all joined.
void parallel_items(int64_t n, const std::function<void(int64_t)>& fn) {
  const int T = int(std::max<int64_t>(1, std::min<int64_t>(ref::num_threads(), n)));
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    try {
      for (int64_t i; !failed.load() && (i = next.fetch_add(1)) < n;) fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      failed = true;
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(size_t(T));
  for (int i = 1; i < T; ++i) {
    try {
      pool.emplace_back(work);
    } catch (...) {  // std::system_error: no more threads; the started ones share the work
      break;
    }
  }
  work();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

double dotd(const double* a, const double* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The selection row of the spec for token t (global) and proxy head p, in fp64.
void select_row(const Config& c, const ref::Problem& pb, const std::vector<double>& qp,
                const std::vector<double>& kp, int p, int64_t t, int32_t* row) {
  const int b = pb.seq_of(t);
  const int64_t s0 = c.cu[size_t(b)], pos = t - s0, l = pos / kBlock;
  const double* qrow = qp.data() + (t * c.Hp + p) * c.Dp;
  const int pk = pb.pk_of(p);
  std::vector<double> score(size_t(l), -INFINITY);
  for (int64_t u = 0; u < l * kBlock; ++u) {
    const double z = pb.proxy_scale * dotd(qrow, kp.data() + ((s0 + u) * c.Hpk + pk) * c.Dp, c.Dp);
    score[size_t(u / kBlock)] = std::max(score[size_t(u / kBlock)], z);
  }
  std::vector<int> order(static_cast<size_t>(l));
  for (int j = 0; j < int(l); ++j) order[size_t(j)] = j;
  const int64_t nsel = std::min<int64_t>(c.topk - 1, l);
  std::partial_sort(order.begin(), order.begin() + nsel, order.end(), [&](int x, int y) {
    return score[size_t(x)] != score[size_t(y)] ? score[size_t(x)] > score[size_t(y)] : x < y;
  });
  for (int s = 0; s < c.topk; ++s) row[s] = -1;
  for (int64_t s = 0; s < nsel; ++s) row[s] = order[size_t(s)];
  row[nsel] = int32_t(l);
}

// Large problems: a seeded sample of tokens; per (token, proxy head) the fp64 rows of out,
// lse, dq, proxy_lse, dqp over the kernel's own key sets, and the selection row.
// dk, dv, dkp (sums over all queries) and kl (a sum over all tokens) are not checked here.
void check_sampled(const Config& c, const Tensors& t, CheckResult& r) {
  const std::vector<int64_t> rows = sample_rows(c);
  r.scope = "seeded sample of " + std::to_string(rows.size()) + " of " + std::to_string(c.total) +
            " tokens: out, lse, proxy_lse, dq, dqp, indices (dk, dv, dkp, kl not checked)";
  const ref::Problem pb = make_problem(c, c.sparse() ? FLASHMSA_MODE_GIVEN : FLASHMSA_MODE_DENSE);
  const std::vector<double> q = t.q.values(), k = t.k.values(), v = t.v.values(),
                            qp = t.qp.values(), kp = t.kp.values();
  const std::vector<double> dout = c.has_bwd() ? t.dout.values() : std::vector<double>();
  const std::vector<double> dlse = c.dlse ? t.dlse.values() : std::vector<double>();
  const int G = c.Hq / c.Hp, D = c.D, Dp = c.Dp;
  const double N = double(c.Hp) * double(c.total);
  const int64_t n = int64_t(rows.size()) * c.Hp;
  // per item: reference values laid out as the kernel's, compared afterwards in item order
  struct Item {
    std::vector<double> out, lse, dq, dqp;
    double plse = 0;
    std::vector<int32_t> sel;
  };
  std::vector<Item> items(static_cast<size_t>(n));
  const int32_t* kidx = c.sparse() ? t.indices.i32() : nullptr;
  parallel_items(n, [&](int64_t it) {
    const int64_t tok = rows[size_t(it / c.Hp)];
    const int p = int(it % c.Hp);
    Item& I = items[size_t(it)];
    std::vector<int64_t> keys;
    ref::key_set(pb, kidx, p, tok, keys);
    const size_t nk = keys.size();
    std::vector<double> x(nk), P(nk), teacher(nk, 0.0), orow(static_cast<size_t>(D));
    I.out.assign(size_t(G) * D, 0.0);
    I.lse.assign(size_t(G), -INFINITY);
    I.dq.assign(size_t(G) * D, 0.0);
    for (int g = 0; g < G; ++g) {
      const int h = p * G + g, kv = pb.kv_of(h);
      const double* qrow = q.data() + (tok * c.Hq + h) * D;
      double m = -INFINITY;
      for (size_t j = 0; j < nk; ++j) {
        x[j] = pb.scale * dotd(qrow, k.data() + (keys[j] * c.Hkv + kv) * D, D);
        m = std::max(m, x[j]);
      }
      if (nk == 0) continue;
      double sum = 0;
      for (size_t j = 0; j < nk; ++j) sum += std::exp(x[j] - m);
      const double lse = m + std::log(sum);
      I.lse[size_t(g)] = lse;
      std::fill(orow.begin(), orow.end(), 0.0);
      for (size_t j = 0; j < nk; ++j) {
        P[j] = std::exp(x[j] - lse);
        teacher[j] += P[j] / G;
        const double* vrow = v.data() + (keys[j] * c.Hkv + kv) * D;
        for (int d = 0; d < D; ++d) orow[size_t(d)] += P[j] * vrow[d];
      }
      std::copy(orow.begin(), orow.end(), I.out.begin() + int64_t(g) * D);
      if (!c.has_bwd()) continue;
      const double* dorow = dout.data() + (tok * c.Hq + h) * D;
      const double shift = dotd(dorow, orow.data(), D) - (c.dlse ? dlse[size_t(h) * c.total + tok] : 0.0);
      double* dqrow = I.dq.data() + int64_t(g) * D;
      for (size_t j = 0; j < nk; ++j) {
        const double dP = dotd(dorow, v.data() + (keys[j] * c.Hkv + kv) * D, D);
        const double dS = P[j] * (dP - shift);
        const double* krow = k.data() + (keys[j] * c.Hkv + kv) * D;
        for (int d = 0; d < D; ++d) dqrow[d] += pb.scale * dS * krow[d];
      }
    }
    // proxy row: student softmax, proxy_lse, dqp
    const int pk = pb.pk_of(p);
    const double* qprow = qp.data() + (tok * c.Hp + p) * Dp;
    std::vector<double> z(nk);
    double m = -INFINITY;
    for (size_t j = 0; j < nk; ++j) {
      z[j] = pb.proxy_scale * dotd(qprow, kp.data() + (keys[j] * c.Hpk + pk) * Dp, Dp);
      m = std::max(m, z[j]);
    }
    double sum = 0;
    for (size_t j = 0; j < nk; ++j) sum += std::exp(z[j] - m);
    I.plse = nk ? m + std::log(sum) : -INFINITY;
    I.dqp.assign(size_t(Dp), 0.0);
    if (c.has_bwd() && c.kl_grad != 0)
      for (size_t j = 0; j < nk; ++j) {
        const double dz = (c.kl_grad / N) * (std::exp(z[j] - I.plse) - teacher[j]);
        const double* kprow = kp.data() + (keys[j] * c.Hpk + pk) * Dp;
        for (int d = 0; d < Dp; ++d) I.dqp[size_t(d)] += pb.proxy_scale * dz * kprow[d];
      }
    if (c.sparse()) {
      I.sel.resize(size_t(c.topk));
      select_row(c, pb, qp, kp, p, tok, I.sel.data());
    }
  });
  Err e_out, e_lse, e_plse, e_dq, e_dqp;
  e_out.name = "out";
  e_lse.name = "lse";
  e_plse.name = "proxy_lse";
  e_dq.name = "dq";
  e_dqp.name = "dqp";
  int64_t same = 0, slots = 0;
  for (int64_t it = 0; it < n; ++it) {
    const int64_t tok = rows[size_t(it / c.Hp)];
    const int p = int(it % c.Hp);
    const Item& I = items[size_t(it)];
    for (int g = 0; g < G; ++g) {
      const int h = p * G + g;
      for (int d = 0; d < D; ++d) {
        const int64_t o = (tok * c.Hq + h) * D + d;
        e_out.add(t.out.get(o), I.out[size_t(g) * D + d]);
        if (c.has_bwd()) e_dq.add(t.dq.get(o), I.dq[size_t(g) * D + d]);
      }
      e_lse.add(t.lse.get(int64_t(h) * c.total + tok), I.lse[size_t(g)]);
    }
    e_plse.add(t.proxy_lse.get(int64_t(p) * c.total + tok), I.plse);
    if (c.has_bwd())
      for (int d = 0; d < Dp; ++d) e_dqp.add(t.dqp.get((tok * c.Hp + p) * Dp + d), I.dqp[size_t(d)]);
    if (c.sparse())
      for (int s = 0; s < c.topk; ++s) {
        ++slots;
        same += kidx[(int64_t(p) * c.total + tok) * c.topk + s] == I.sel[size_t(s)];
      }
  }
  r.errs = {e_out, e_lse, e_plse};
  if (c.has_bwd()) {
    r.errs.push_back(e_dq);
    r.errs.push_back(e_dqp);
  }
  if (c.sparse()) {
    r.index_slots = slots;
    r.index_agreement = slots ? double(same) / double(slots) : 1.0;
  }
}

CheckResult run_check(const Config& c, const Tensors& t) {
  CheckResult r;
  r.ran = true;
  r.threshold = threshold_for(c.dtype);
  const double t0 = now_s();
  progress("[check] fp64 reference (%s) ...\n",
           c.total <= kCheckFullMaxTokens ? "every token" : "sampled tokens");
  if (c.total <= kCheckFullMaxTokens) check_full(c, t, r);
  else check_sampled(c, t, r);
  for (const Err& e : r.errs)
    if (!(e.rel() <= r.threshold)) r.pass = false;
  if (c.sparse() && !(r.index_agreement >= kIndexAgreementMin)) r.pass = false;
  progress("[check] done in %.3f s\n", now_s() - t0);
  return r;
}

// ---- save --------------------------------------------------------------------------------

std::string json_num(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

void save_all(const Config& c, const Tensors& t) {
  namespace fs = std::filesystem;
  progress("[save] writing %s ...\n", c.save_dir.c_str());
  std::error_code ec;
  fs::create_directories(c.save_dir, ec);
  if (ec) throw std::runtime_error("--save: cannot create " + c.save_dir + ": " + ec.message());
  std::vector<std::string> files;
  for (const Buf* b : t.all()) {
    if (!b->used || b->name == "dkl") continue;  // dkl is kl_grad in config.json
    const std::string path = (fs::path(c.save_dir) / (b->name + ".npy")).string();
    if (b->dtype == FLASHMSA_DTYPE_INT32) {
      npy::save_i32(path, b->shape, std::vector<int32_t>(b->i32(), b->i32() + b->numel()));
    } else if (b->dtype == FLASHMSA_DTYPE_FP64) {
      npy::save_f64(path, b->shape, b->values());
    } else {
      const std::vector<double> v = b->values();
      npy::save_f32(path, b->shape, std::vector<float>(v.begin(), v.end()));  // exact
    }
    files.push_back(b->name);
  }
  std::string j = "{\n";
  auto field = [&](const std::string& k, const std::string& v, bool last = false) {
    j += "  \"" + k + "\": " + v + (last ? "\n" : ",\n");
  };
  auto str = [](const std::string& s) { return "\"" + s + "\""; };
  auto list = [](const std::vector<int64_t>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  };
  std::vector<int64_t> lengths;
  for (int b = 0; b < c.nseq(); ++b) lengths.push_back(c.cu[size_t(b) + 1] - c.cu[size_t(b)]);
  field("lengths", list(lengths));
  field("cu_seqlens", list(c.cu));
  field("total", std::to_string(c.total));
  field("max_seqlen", std::to_string(c.max_seqlen));
  field("batched", c.batched ? "true" : "false");
  field("Hq", std::to_string(c.Hq));
  field("Hkv", std::to_string(c.Hkv));
  field("Hp", std::to_string(c.Hp));
  field("Hpk", std::to_string(c.Hpk));
  field("D", std::to_string(c.D));
  field("Dp", std::to_string(c.Dp));
  field("block_size", std::to_string(kBlock));
  field("topk", c.sparse() ? std::to_string(c.topk) : "null");
  field("mode", str(mode_name(c.mode)));
  field("library_mode", str(c.sparse() ? "given (indices from flashmsa_select)" : "dense"));
  field("numerics", str(c.mode == Mode::Infer ? "infer" : "train"));
  field("softmax_scale", json_num(c.scale()));
  field("proxy_scale", json_num(c.proxy_scale()));
  field("compute_kl", "true");
  field("kl_grad", c.has_bwd() ? json_num(c.kl_grad) : "null");
  field("dlse", c.has_bwd() && c.dlse ? "true" : "false");
  field("deterministic", c.has_bwd() && c.deterministic ? "true" : "false");
  field("precise_dpsum", c.has_bwd() && c.precise_dpsum ? "true" : "false");
  field("seed", std::to_string(c.seed));
  field("pattern", str(pattern_name(c.pattern)));
  field("dtype", str(flashmsa_dtype_name(c.dtype)));
  field("backend", str(c.on_cuda ? "cuda" : "cpu"));
  std::string fl = "[";
  for (size_t i = 0; i < files.size(); ++i) fl += (i ? ", " : "") + str(files[i]);
  field("files", fl + "]", true);
  j += "}\n";
  const std::string path = (fs::path(c.save_dir) / "config.json").string();
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f || std::fwrite(j.data(), 1, j.size(), f) != j.size())
    throw std::runtime_error("--save: cannot write " + path);
  std::fclose(f);
  progress("[save] done (%zu files + config.json)\n", files.size());
}

// ---- report ------------------------------------------------------------------------------

void row(const char* key, const std::string& value) { std::printf("  %-34s %s\n", key, value.c_str()); }

std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::string lengths_text(const Config& c) {
  const int B = c.nseq();
  if (c.batched) return fmt("batched [B=%d, S=%lld] (total %lld tokens)", B, (long long)c.max_seqlen, (long long)c.total);
  if (B == 1) return fmt("1 sequence of %lld tokens", (long long)c.total);
  std::string s;
  for (int b = 0; b < B && b < 12; ++b)
    s += (b ? "," : "") + std::to_string(c.cu[size_t(b) + 1] - c.cu[size_t(b)]);
  if (B > 12) s += ",...";
  return fmt("%d sequences [%s] (total %lld, max %lld)", B, s.c_str(), (long long)c.total,
             (long long)c.max_seqlen);
}

void print_config(const Config& c) {
  std::printf("flashmsa %s — MiniMax Sparse Attention, one %s step\n\n", flashmsa_version(),
              mode_name(c.mode));
  std::printf("configuration\n");
  const bool preset_exact = c.Hq == (c.preset == "m3" ? 64 : 16) && c.Hkv == (c.preset == "m3" ? 4 : 2) &&
                            c.Hp == 4 && c.Hpk == 1 && c.D == 128 && c.Dp == 128;
  row("heads", fmt("Hq=%d Hkv=%d Hp=%d Hpk=%d  (%s)", c.Hq, c.Hkv, c.Hp, c.Hpk,
                   preset_exact ? c.preset.c_str() : ("custom, from " + c.preset).c_str()));
  row("head dims", fmt("D=%d Dp=%d  (scale %.6g, proxy scale %.6g)", c.D, c.Dp, c.scale(), c.proxy_scale()));
  row("lengths", lengths_text(c));
  row("topk", c.sparse() ? fmt("%d blocks of %d tokens (local block included)", c.topk, kBlock)
                         : std::string("- (warmup: dense causal)"));
  row("dtype", flashmsa_dtype_name(c.dtype));
  row("mode", fmt("%s  (library: %s, %s numerics)", mode_name(c.mode),
                  c.sparse() ? "select, then fwd/bwd in GIVEN mode" : "DENSE",
                  c.mode == Mode::Infer ? "INFER" : "TRAIN"));
  row("pattern", pattern_name(c.pattern));
  row("backend", c.on_cuda ? "cuda" : fmt("cpu (fp64 reference backend), %d threads", ref::num_threads()));
  row("seed", std::to_string(c.seed));
  if (c.has_bwd())
    row("backward inputs", fmt("dout ~ N(0,1), dkl = %g%s%s%s", c.kl_grad, c.dlse ? ", dlse ~ N(0,1)" : "",
                               c.deterministic ? ", deterministic" : "", c.precise_dpsum ? ", precise dpsum (out_lo)" : ""));
  if (!c.defaulted.empty()) {
    std::string d;
    for (const auto& s : c.defaulted) d += (d.empty() ? "" : ", ") + s;
    row("defaults picked", d + (c.on_cuda ? " (CUDA)" : " (CPU backend: small enough for seconds)"));
  }
  std::printf("\n");
  std::fflush(stdout);
}

void print_report(const Config& c, const Stats& s, const Timings& tm, const CheckResult& chk) {
  std::printf("selection\n");
  if (c.sparse()) {
    row("union factor (128-query tiles)", fmt("%.3f   (distinct blocks per tile / topk, mean over tiles, proxy heads)", s.union_factor));
    row("blocks per token", fmt("%.3f   (of topk %d)", s.blocks_per_token, c.topk));
  } else {
    row("union factor (128-query tiles)", "-   (warmup: no selection)");
  }
  row("keys per (token, proxy head)", fmt("%.1f   (%.1f%% of the dense causal pairs)", s.keys_per_token, 100.0 * s.density));
  row("attention-mass recall", fmt("%.4f   (%s)", s.recall, s.recall_rows.c_str()));
  row("kl", fmt("%.9g", s.kl));
  if (s.nonfinite_outputs)
    row("UNWRITTEN OUTPUTS (NaN)", s.nonfinite_names);
  std::printf("\n");

  std::printf("time\n");
  std::printf("  %-10s %12s %14s %16s\n", "stage", "ms", "eff. TFLOP/s", "counted GFLOP");
  const double fwd_flops = 4.0 * c.D * s.pairs.main_pairs;
  const double bwd_flops = 2.5 * fwd_flops;
  const double sel_flops = 2.0 * c.Dp * s.pairs.proxy_pairs;
  auto line = [&](const char* name, double ms, double flops) {
    if (std::isnan(ms)) {
      std::printf("  %-10s %12s %14s %16s\n", name, "-", "-", "-");
      return;
    }
    std::printf("  %-10s %12.3f %14.4f %16.3f\n", name, ms, ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0,
                flops / 1e9);
  };
  line("selection", tm.select_ms, sel_flops);
  line("forward", tm.fwd_ms, fwd_flops);
  line("backward", tm.bwd_ms, bwd_flops);
  double total_ms = 0, total_flops = 0;
  if (!std::isnan(tm.select_ms)) total_ms += tm.select_ms, total_flops += sel_flops;
  if (!std::isnan(tm.fwd_ms)) total_ms += tm.fwd_ms, total_flops += fwd_flops;
  if (!std::isnan(tm.bwd_ms)) total_ms += tm.bwd_ms, total_flops += bwd_flops;
  line("total", total_ms, total_flops);
  std::printf("  (effective TFLOP/s: fwd 4*D*pairs, bwd 2.5x fwd, selection 2*Dp*causal proxy pairs;%s)\n",
              c.on_cuda ? " wall clock after cudaDeviceSynchronize" : " CPU fp64 reference");
  std::printf("\n");

  if (chk.ran) {
    std::printf("check against the fp64 reference (%s)\n", chk.scope.c_str());
    std::printf("  %-10s %14s %14s   %s\n", "tensor", "rel-L2", "max abs", "");
    for (const Err& e : chk.errs) {
      const bool ok = e.rel() <= chk.threshold;
      std::printf("  %-10s %14.3e %14.3e   %s%s\n", e.name.c_str(), e.rel(), e.max_abs, ok ? "ok" : "FAIL",
                  e.mismatched_inf ? fmt(" (%lld inf/nan mismatches)", (long long)e.mismatched_inf).c_str() : "");
    }
    if (c.sparse())
      std::printf("  %-10s %14.6f %14s   %s  (fraction of equal slots over %lld; threshold %.2f)\n",
                  "indices", chk.index_agreement, "", chk.index_agreement >= kIndexAgreementMin ? "ok" : "FAIL",
                  (long long)chk.index_slots, kIndexAgreementMin);
    std::printf("  threshold rel-L2 <= %.0e (%s)  =>  %s\n", chk.threshold, flashmsa_dtype_name(c.dtype),
                chk.pass ? "PASS" : "FAIL");
    std::printf("\n");
  }
  if (!c.save_dir.empty()) std::printf("saved tensors and config.json to %s\n", c.save_dir.c_str());
  std::fflush(stdout);
}

// ---- checks before the step ----------------------------------------------------------------

// Host bytes the step needs, roughly: every buffer, the CPU backend's fp64 copies of the
// per-token tensors (gathered inputs and results), and --check's fp64 run on small problems.
double estimate_host_bytes(const Config& c) {
  Tensors t;
  declare(c, t);
  double bufs = 0, tok_elems = 0;
  for (const Buf* b : t.all())
    if (b->used) {
      bufs += double(b->numel()) * double(dtype_size(b->dtype));
      if (b->kind == Buf::kTokens) tok_elems += double(b->numel());
    }
  double need = bufs;
  if (!c.on_cuda) need += 16.0 * tok_elems;
  if (c.check && c.total <= kCheckFullMaxTokens) need += 16.0 * tok_elems;
  return need;
}

// The host memory this process may use: physical memory, a cgroup limit, RLIMIT_AS.
double host_memory_limit(std::string* what) {
  double lim = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  *what = "physical memory";
  if (!(lim > 0)) lim = INFINITY;
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    double v = 0;
    if (f >> v && v > 0 && v < lim) {
      lim = v;
      *what = std::string("the memory limit in ") + path;
    }
  }
  return lim;
}

void check_host_memory(const Config& c) {
  std::string what;
  const double need = estimate_host_bytes(c), have = host_memory_limit(&what);
  if (need > have)
    throw UsageError(fmt("the step needs about %.1f GiB of host memory (its tensors%s), more than "
                         "the %.1f GiB available (%s): use a smaller --seqlen, --batch or --lengths, "
                         "or fewer heads",
                         need / (1 << 30), c.on_cuda ? "" : " and the CPU backend's fp64 copies",
                         have / (1 << 30), what.c_str()));
}

// --save: the directory is created and a file written and removed in it before the step runs,
// so an unwritable path fails at once instead of after the computation.
void prepare_save_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UsageError("--save: cannot create the directory '" + dir + "': " + ec.message());
  if (!fs::is_directory(dir, ec)) throw UsageError("--save: '" + dir + "' exists and is not a directory");
  const std::string probe = (fs::path(dir) / ".flashmsa_write_check").string();
  FILE* f = std::fopen(probe.c_str(), "wb");
  if (!f) throw UsageError("--save: cannot write into '" + dir + "': " + std::strerror(errno));
  const bool ok = std::fputs("ok\n", f) >= 0;
  const bool closed = std::fclose(f) == 0;
  fs::remove(probe, ec);
  if (!ok || !closed) throw UsageError("--save: cannot write into '" + dir + "'");
}

// ---- main --------------------------------------------------------------------------------

int run(const std::vector<std::string>& args) {
  Config c;
  if (!parse_run_args(args, c)) {
    std::fputs(kRunUsage, stdout);
    return 0;
  }
  g_quiet = c.quiet;
  if (c.threads > 0) setenv("FLASHMSA_NUM_THREADS", std::to_string(c.threads).c_str(), 1);
  try {
    ref::num_threads();  // a bad FLASHMSA_NUM_THREADS fails here, before anything runs
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  resolve_heads(c);
  resolve_backend(c);
  if (!c.fallback_notice.empty()) std::fprintf(stderr, "%s\n", c.fallback_notice.c_str());
  if (c.on_cuda && (c.dtype == FLASHMSA_DTYPE_FP32 || c.dtype == FLASHMSA_DTYPE_FP64))
    throw UsageError("--dtype " + std::string(flashmsa_dtype_name(c.dtype)) + ": CPU backend only");
  check_host_memory(c);
  if (!c.save_dir.empty()) prepare_save_dir(c.save_dir);
  print_config(c);

  Tensors t;
  declare(c, t);
  progress("[inputs] drawing %s inputs (%lld tokens, seed %llu) ...\n", pattern_name(c.pattern),
           (long long)c.total, (unsigned long long)c.seed);
  double t0 = now_s();
  generate(c, t);
  progress("[inputs] done in %.3f s\n", now_s() - t0);

  const Timings tm = run_step(c, t);
  const Stats s = compute_stats(c, t);
  CheckResult chk;
  if (c.check) chk = run_check(c, t);
  if (!c.save_dir.empty()) save_all(c, t);
  print_report(c, s, tm, chk);
  if (s.nonfinite_outputs) {
    std::fprintf(stderr, "flashmsa: error: outputs not fully written: %s\n", s.nonfinite_names.c_str());
    return 1;
  }
  return chk.ran && !chk.pass ? 1 : 0;
}

}  // namespace flashmsa::cli

int main(int argc, char** argv) {
  using namespace flashmsa::cli;
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || args[0] == "-h" || args[0] == "--help") {
      std::fputs(kMainUsage, args.empty() ? stderr : stdout);
      return args.empty() ? 2 : 0;
    }
    if (args[0] != "run") throw UsageError("unknown command '" + args[0] + "'");
    return run(std::vector<std::string>(args.begin() + 1, args.end()));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "flashmsa: %s\n%s(see flashmsa %s--help)\n", e.what(),
                 args.empty() || args[0] != "run" ? kMainUsage : "", !args.empty() && args[0] == "run" ? "run " : "");
    return 2;
  } catch (const flashmsa::Error& e) {
    std::fprintf(stderr, "flashmsa: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flashmsa: error: %s\n", e.what());
    return 1;
  }
}
