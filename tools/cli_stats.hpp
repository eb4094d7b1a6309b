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
  bool recall_on_device = false;
  std::vector<int64_t> recall_row_ids;  // the tokens the recall ran over
  std::string recall_rows;
  double kl = NAN;
  PairCounts pairs;
  double dense_pairs = 0;  // sum over h, t of (position + 1)
  int64_t nonfinite_outputs = 0;
  std::string nonfinite_names;
};

// The seeded sample of kSampleTokens distinct tokens (ascending).
std::vector<int64_t> sample_rows(const Config& c);

// The statistics of the step that ran on t, with progress lines. On CUDA the recall and the
// unwritten-entry counts read the device tensors (cli_device.hpp).
Stats compute_stats(const Config& c, const Tensors& t);

// The attention-mass recall over the given rows from the host copies of q, k and indices, in
// fp64 (the CPU's statistic; on CUDA --check compares the device's against it).
double host_mass_recall(const Config& c, const Tensors& t, const std::vector<int64_t>& rows);

}  // namespace flashmsa::cli
