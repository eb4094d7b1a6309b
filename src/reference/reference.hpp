// The CPU reference backend: SPEC.md section 1 written as plain threaded C++ on dense fp64
// arrays. This is the oracle of every test and the backend of the main job without a GPU.
//
// Layouts (dense, row-major): per-token tensors [total][H][D]; lse, proxy_lse [H][total];
// indices [Hp][total][topk]. Sequences are given by cu (B+1 offsets); query rows are key rows
// too unless query segments are given (cuq, qseq, qpos: the C header's "Query segments").
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "flashmsa/flashmsa.h"

namespace flashmsa::ref {

struct Problem {
  std::vector<int64_t> cu;  // B+1 key sequence offsets, cu[0] = 0, cu[B] = total_k
  int64_t total = 0;        // query rows (q, qp, out, lse, indices, dq, dqp)
  int64_t total_k = 0;      // key rows (k, v, kp, dk, dv, dkp)
  // Query segments (all empty: query row t is key row t): rows [cuq[s], cuq[s+1]) are the queries
  // at positions qpos[s], qpos[s] + 1, ... of key sequence qseq[s].
  std::vector<int64_t> cuq, qpos;
  std::vector<int> qseq;
  int Hq = 0, Hkv = 0, Hp = 0, Hpk = 0, D = 0, Dp = 0;
  int topk = 0;  // width of the indices rows (SPARSE / GIVEN)
  flashmsa_mode_t mode = FLASHMSA_MODE_SPARSE;
  double scale = 0, proxy_scale = 0;  // resolved (never 0)

  int batch() const { return int(cu.size()) - 1; }
  int group_size() const { return Hq / Hp; }          // G: query heads per proxy head
  int kv_of(int h) const { return h / (Hq / Hkv); }
  int group_of(int h) const { return h / (Hq / Hp); }
  int pk_of(int p) const { return p / (Hp / Hpk); }
  int seq_of(int64_t t) const;                        // key sequence holding key row t
  struct Query {
    int b;        // key sequence
    int64_t s0;   // its first key row
    int64_t pos;  // the query's position in it
  };
  Query query(int64_t t) const;                       // where query row t sits
};

// Most worker threads the reference uses (FLASHMSA_NUM_THREADS and the CLI's --threads).
constexpr int kMaxThreads = 1024;

// Number of worker threads: FLASHMSA_NUM_THREADS, an integer in [1, kMaxThreads]; unset or
// empty: the hardware's, at most kMaxThreads. Any other value throws std::invalid_argument
// with a message naming the variable (the CPU backend reports it as INVALID_ARGUMENT).
int num_threads();
// min(num_threads(), max(n, 1)): the threads parallel_for(n, fn) uses.
int threads_for(int64_t n);
// Runs fn(tid, n, tid) once for every tid in [0, T), T = threads_for(n) (or the given T >= 1),
// one thread each. Work must be split by tid alone (for example items tid, tid + T, ...), so the
// result depends on T only, never on which OS thread ran a tid: when a thread cannot be started
// (std::system_error, out of memory) its tids run on the calling thread, after tid 0. An exception
// thrown by fn on any thread is rethrown here, after every started thread has joined (the tids not
// yet begun by then are skipped: the call has failed anyway).
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn);
void parallel_for(int64_t n, int T, const std::function<void(int64_t, int64_t, int)>& fn);

// Selection: indices [Hp][total][topk] (-1 padded), proxy_lse [Hp][total] (may be null).
void select(const Problem& pb, const double* qp, const double* kp, int32_t* indices,
            double* proxy_lse);

// The OCP E4M3FN value nearest to x (ties to the even code), saturating at +-448; NaN stays NaN.
double round_e4m3(float x);

// flashmsa_selection_t FP8 (flashmsa.h): qp [total][Hp][Dp] and kp [total_k][Hpk][Dp] replaced in place by their
// dequantised e4m3 values, qp with one scale per (row, head), kp with one per (128-token key block of its sequence,
// head): scale = amax / 448 in fp32 of the group's values read as fp32, the stored value e4m3(x * (448 / amax));
// a group whose amax is 0 stays 0, one with a non-finite value becomes NaN.
void quantize_fp8_selection(const Problem& pb, std::vector<double>& qp, std::vector<double>& kp);

// proxy_lse [Hp][total]: the proxy's log-normaliser over the key sets of `indices` (-inf for an empty set).
void proxy_lse_of(const Problem& pb, const double* qp, const double* kp, const int32_t* indices, double* out);

// The key set U_p(t) of query row t for proxy head p, as key rows in slot order
// (SPARSE / GIVEN) or ascending (DENSE). Empty slots and keys after t are left out.
void key_set(const Problem& pb, const int32_t* indices, int p, int64_t t,
             std::vector<int64_t>& keys);

struct FwdOut {
  double* out = nullptr;        // [total][Hq][D]
  double* lse = nullptr;        // [Hq][total]
  double* proxy_lse = nullptr;  // [Hp][total], optional (needs qp, kp)
  double* kl = nullptr;         // scalar, optional (needs qp, kp)
};
// Forward over the key sets (indices ignored in DENSE mode). qp, kp may be null.
void forward(const Problem& pb, const double* q, const double* k, const double* v,
             const double* qp, const double* kp, const int32_t* indices, const FwdOut& o);

struct BwdOut {
  double* dq = nullptr;   // [total][Hq][D]
  double* dk = nullptr;   // [total][Hkv][D]
  double* dv = nullptr;
  double* dqp = nullptr;  // [total][Hp][Dp], optional
  double* dkp = nullptr;  // [total][Hpk][Dp], optional
  double* kl = nullptr;   // scalar, optional (needs qp, kp): the forward's kl value, from the same pass
};
// Backward: recomputes the forward in fp64 (exact P, out, lse). dlse may be null; dkl is the
// upstream gradient g of kl (the proxy gradients are exactly zero when it is 0). o.kl gets the
// value forward() gives for the same inputs (the teacher and the student are formed anyway).
void backward(const Problem& pb, const double* q, const double* k, const double* v,
              const double* qp, const double* kp, const int32_t* indices, const double* dout,
              const double* dlse, double dkl, const BwdOut& o);

// Attention-mass recall of a selection: for each sampled (query head, token), the share of
// the DENSE causal softmax mass of the main attention that lies in the key set; returns the
// mean over the sampled rows. rows: global tokens to evaluate (all heads each).
double mass_recall(const Problem& pb, const double* q, const double* k, const int32_t* indices,
                   const std::vector<int64_t>& rows);

// Number of (query head, key) pairs in the key sets (for effective FLOP counts) and of causal
// proxy pairs (selection), over the given tokens.
struct PairCounts {
  double main_pairs = 0;   // sum over h, t of |U_grp(h)(t)|
  double proxy_pairs = 0;  // sum over p, t of (position in sequence + 1)
};
PairCounts count_pairs(const Problem& pb, const int32_t* indices);

}  // namespace flashmsa::ref
