// Seeded input generation for the main job (flashmsa run): a portable normal generator
// (std::mt19937_64 + Box-Muller, so the numbers do not depend on the standard library's
// distributions) and the selection patterns ("random", "clustered" of BENCHMARKS.md, "trained": a trained
// indexer's statistics, docs/performance.md).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace flashmsa::cli {

// One deterministic random stream. Streams with different ids are independent draws from the
// same user seed, so adding a tensor never changes the values of the others.
class Rng {
 public:
  Rng(uint64_t seed, uint64_t stream);
  double uniform();             // in (0, 1), 53 random bits
  double normal();              // N(0, 1) by Box-Muller
  uint64_t below(uint64_t n);   // uniform integer in [0, n), n >= 1 (rejection, unbiased)

 private:
  std::mt19937_64 gen_;
  bool has_spare_ = false;
  double spare_ = 0;
};

// Stream ids of the generated tensors.
enum Stream : uint64_t {
  kStreamQ = 1,
  kStreamK = 2,
  kStreamV = 3,
  kStreamProxy = 4,
  kStreamDout = 5,
  kStreamDlse = 6,
  kStreamSample = 7,
};

enum class Pattern { Random, Clustered, Trained };
const char* pattern_name(Pattern p);
bool parse_pattern(const std::string& s, Pattern* out);

// n values N(0, 1).
std::vector<double> normal_values(Rng& rng, size_t n);
// n values N(0, 1) of stream `stream`, drawn in fixed chunks of 2^20 values (each chunk its own
// sub-stream) on several threads: the same numbers for any thread count.
std::vector<double> normal_values(uint64_t seed, uint64_t stream, size_t n);

// Proxy inputs for sequences given by cu (B+1 offsets), in the dense layouts
// qp [total][Hp][Dp] and kp [total][Hpk][Dp] (unrounded doubles).
//  random:    qp, kp ~ N(0, 1).
//  clustered: 64 topic vectors t_c ~ N(0, I) (shared by all sequences); for every sequence and
//             proxy key head, every 512-token span of keys (positions inside the sequence) has
//             one topic drawn uniformly, kp[u] = t_topic + 0.5 * N(0, I); for every proxy head,
//             every 128-token span of queries picks 3 distinct topics uniformly,
//             qp[i] = sum of them + 0.5 * N(0, I).
//  trained:   bench/user_path.py's trained_like_proxy with the same parameters (kTrained; its numbers, not
//             its stream): every key block j of a sequence and proxy key head gets a direction c_j ~ N(0, I),
//             kp[u] = c_block(u) + 0.1 * N(0, I); a query row's proxy is the sum of the directions of blocks
//             drawn U^2.4 x (its block) blocks back (at least one; with probability 0.6 also the block before
//             it, else its own direction twice): 1 draw shared by every proxy head of a 64-token span, 1 per
//             head and 64-token span, 2 per head and 8-token span, 12 per token (weight 1.2), + 0.1 * N(0, I).
struct ProxyInputs {
  std::vector<double> qp, kp;
};
ProxyInputs draw_proxy(Pattern pattern, const std::vector<int64_t>& cu, int Hp, int Hpk, int Dp,
                       uint64_t seed);

constexpr int kTopics = 64;
constexpr int kKeySpan = 512;
constexpr int kQuerySpan = 128;
constexpr int kTopicsPerQuery = 3;
constexpr double kTopicNoise = 0.5;
struct TrainedParams {
  int span = 64, n_shared = 1, n_span = 1, sub = 8, n_sub = 2, n_tok = 12;
  double gamma = 2.4, p_pair = 0.6, w_tok = 1.2, key_noise = 0.1, query_noise = 0.1;
};
constexpr TrainedParams kTrained{};

// k distinct values of [0, n) drawn by a partial Fisher-Yates shuffle, sorted ascending.
std::vector<int64_t> sample_distinct(Rng& rng, int64_t n, int64_t k);

}  // namespace flashmsa::cli
