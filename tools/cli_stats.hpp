// The statistics of a step of the main job: union factor of the selection over 128-query
// tiles, blocks and keys per token, attention-mass recall of the selected key sets against the
// dense causal softmax (in fp64), the pair counts behind the effective FLOP counts, and outputs
// the step left unwritten.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cli_args.hpp"
#include "cli_buffers.hpp"
#include "cli_keys.hpp"

namespace flashmsa::cli {

constexpr int64_t kSampleTokens = 256;      // sampled tokens of large problems (recall, --check)
constexpr double kRecallFullBudget = 5e10;  // recall on all rows when the dense work is below

struct Stats {
  double union_factor = NAN, blocks_per_token = NAN, keys_per_token = NAN, density = NAN;
  double recall = NAN;
  std::string recall_rows;
  double kl = NAN;
  PairCounts pairs;
  double dense_pairs = 0;  // sum over h, t of (position + 1)
  int64_t nonfinite_outputs = 0;
  std::string nonfinite_names;
};

// The seeded sample of kSampleTokens distinct tokens (ascending).
std::vector<int64_t> sample_rows(const Config& c);

// The statistics of the step that ran on t, with progress lines.
Stats compute_stats(const Config& c, const Tensors& t);

}  // namespace flashmsa::cli
