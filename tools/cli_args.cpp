#include "cli_args.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "cli_util.hpp"

namespace flashmsa::cli {

const char* const kMainUsage =
    "usage: flashmsa run [flags]     one MSA training step with statistics, timings, checks\n"
    "       flashmsa --help          this text\n"
    "       flashmsa run --help      the flags of run\n";

const char* const kRunUsage =
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
    "  --pattern random|clustered|trained   proxy inputs (BENCHMARKS.md; trained: a trained indexer's\n"
    "                         statistics, docs/performance.md; default clustered)\n"
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
    "  --cp N                 the step over N processes with flashmsa.distributed (gloo on the CPU,\n"
    "                         NCCL on GPUs), checked against one process: the pip-installed\n"
    "                         command runs it (python3 -m flashmsa.cp_run --help)\n"
    "output\n"
    "  --check                compare with the fp64 CPU reference (exit 1 when over threshold)\n"
    "  --save DIR             write every tensor as .npy plus config.json into DIR (created and\n"
    "                         checked for writing before the step runs)\n"
    "  --quiet                no progress lines on stderr\n"
    "  -h, --help             this text\n";

const char* mode_name(Mode m) {
  return m == Mode::Train ? "train" : m == Mode::Infer ? "infer" : "warmup";
}
const char* backend_name(Backend b) {
  return b == Backend::Auto ? "auto" : b == Backend::Cpu ? "cpu" : "cuda";
}

namespace {

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

}  // namespace

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
    else if (flag == "--cp")
      throw UsageError("--cp: the step over several processes needs torch.distributed: run it with the "
                       "pip-installed `flashmsa run --cp N` (python3 -m flashmsa.cp_run --cp N); this program "
                       "runs one process");
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
        throw UsageError("--pattern: expected random, clustered or trained, got '" + s + "'");
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
    else if (flag == "--threads") c.threads = int(parse_int(flag, val(), 1, kMaxThreads));
    else if (flag == "--check") { no_value(); c.check = true; }
    else if (flag == "--quiet") { no_value(); c.quiet = true; }
    else if (flag == "--save") {
      c.save_dir = val();
      if (c.save_dir.empty()) throw UsageError("--save: expected a directory");
    } else throw UsageError("unknown flag '" + args[i] + "'");
  }
  return true;
}

void apply_threads(const Config& c) {
  if (c.threads > 0) setenv("FLASHMSA_NUM_THREADS", std::to_string(c.threads).c_str(), 1);
  try {
    num_threads();  // a bad FLASHMSA_NUM_THREADS fails here, before anything runs
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

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

}  // namespace flashmsa::cli
