// The command line of the main job (flashmsa run): the configuration, its parsing, the --help
// texts, and the checks of flags and of their combinations made before anything is computed.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashmsa/flashmsa.h"
#include "patterns.hpp"

namespace flashmsa::cli {

constexpr int kBlock = FLASHMSA_BLOCK_SIZE;
constexpr double kMaxKlGrad = 1e6;  // --kl-grad: |X| at most this (a loss weight)

// CPU defaults: m3 heads at a length where topk < number of blocks, so the selection is sparse.
constexpr int64_t kCpuDefaultSeqlen = 2048;
constexpr int kCpuDefaultTopk = 4;
constexpr int64_t kCudaDefaultSeqlen = 32768;
constexpr int kCudaDefaultTopk = 16;

// A bad command line: exit code 2 with a usage hint.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

extern const char* const kMainUsage;  // flashmsa --help
extern const char* const kRunUsage;   // flashmsa run --help

enum class Mode { Train, Infer, Warmup };
enum class Backend { Auto, Cpu, Cuda };

const char* mode_name(Mode m);
const char* backend_name(Backend b);

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
  // Whether the step keeps host copies of every tensor: always on the CPU; on CUDA only for
  // --check and --save (otherwise the inputs are drawn on the device, the statistics read the
  // device tensors, and only the indices and kl come back).
  bool host_copies() const { return !on_cuda || check || !save_dir.empty(); }
};

// Parses the flags of `run` into c (throws UsageError). Returns false when help was asked for.
bool parse_run_args(const std::vector<std::string>& args, Config& c);

// --threads into FLASHMSA_NUM_THREADS, and the variable checked (a bad value is a UsageError
// here, before anything runs).
void apply_threads(const Config& c);

// Heads, dims and combinations that do not depend on the backend.
void resolve_heads(Config& c);

// Lengths and topk, with the defaults of the chosen backend (c.on_cuda).
void resolve_sizes(Config& c);

}  // namespace flashmsa::cli
