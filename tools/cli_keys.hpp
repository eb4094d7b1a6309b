// The key sets of the spec as the main job needs them for its statistics and its sampled check:
// which query heads share a key head or a proxy head, the key set U_p(t) of a token, and the
// number of (head, key) pairs of a step (the basis of the effective FLOP counts).
#pragma once

#include <cstdint>
#include <vector>

#include "cli_args.hpp"

namespace flashmsa::cli {

// The sequence holding global token t (empty sequences skipped).
int seq_of(const Config& c, int64_t t);
inline int kv_of(const Config& c, int h) { return h / (c.Hq / c.Hkv); }     // key head of query head h
inline int group_of(const Config& c, int h) { return h / (c.Hq / c.Hp); }  // proxy head of query head h
inline int pk_of(const Config& c, int p) { return p / (c.Hp / c.Hpk); }    // proxy key head of proxy head p

// The key set U_p(t) of global token t for proxy head p, as global key positions: in slot order
// of indices [Hp][total][topk] (sparse steps), or every causal key ascending (warmup: dense,
// indices unused). Empty slots and keys after t are left out.
void key_set(const Config& c, const int32_t* indices, int p, int64_t t, std::vector<int64_t>& keys);

// Number of (query head, key) pairs in the key sets and of causal proxy pairs (selection).
struct PairCounts {
  double main_pairs = 0;   // sum over h, t of |U_grp(h)(t)|
  double proxy_pairs = 0;  // sum over p, t of (position in sequence + 1)
};
PairCounts count_pairs(const Config& c, const int32_t* indices);

}  // namespace flashmsa::cli
