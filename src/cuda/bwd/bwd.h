// The backward's launch interface as the dispatcher sees it (CuTe-free): plain arguments of the
// two wgmma kernels (main, fused main + kl) and one run_*<Dtype, ...>() per instantiation TU
// (bwd_{main,fused}_*.cu), which builds the TMA descriptors of the resident key blocks and
// launches the kernel. The small kernels (preprocess, inversion, convert, kl reduce) are in
// bwd_misc.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/bwd_params.cuh"
#include "cuda/common/element.h"

namespace flashmsa::cuda::attn_bwd {

// The main backward alone in the standalone kernel (bwd_kernel.cuh): dq, dk, dv, where the fused kernel does not run it
// (the deterministic mode without a proxy side, groups over several head units).
struct MainArgs {
  bool batched = false;
  Common c;
  int Rp = 0;                  // head slots per token: R rounded up to a power of two
  int log_rp = 0;              // log2(Rp)
  int64_t total = 0;           // key rows (the K/V TMA descriptors' extent; c.total counts query rows)
};

// The main backward and the proxy side in one persistent kernel (fused_kernel.cuh; every mode with
// a kl gradient or value, R = G): dq, dk, dv, dqp, dkp and the
// kl partials, the teacher in a per-CTA scratch; main_only: the main walk alone (no proxy side).
struct FusedArgs {
  bool batched = false;
  Common c;                    // the main backward's fields and the proxy side's (qp, kp, plse, ...)
  int Rp = 0, log_rp = 0;
  bool teacher_only = false;   // the forward's kl: S, P, the teacher and the kl terms only
  bool grads = true;           // false: no proxy gradients (the kl value only)
  bool main_only = false;      // no proxy side (any mode): the main walk alone; no scratch, no kp, no kl item
  int64_t total = 0;           // key rows (the K/V/Kp TMA descriptors' extent; c.total counts query rows)
  float* scratch = nullptr;    // [ctas, seg, 128] teacher rows
  int seg = 0;                 // list entries per segment (a multiple of 64)
  int ctas = 0;                // persistent CTAs (at most this many; the scratch has a slot for each)
  int32_t* next_item = nullptr;  // the items' counter, zero at the launch
  // The dQ rows' words (default mode; dq_writer.cuh): the first contribution to a (token, proxy head)'s rows stores
  // them, so dq_acc is not zeroed. [Hp, total]: arrivals (low 32 bits), the first stored (high 32); zero at the launch.
  // Null: dq_acc zeroed, adds only.
  uint64_t* dq_word = nullptr;
  bool dq_force_wait = false;  // tests (FLASHMSA_BWD_DQ=store-wait): every later contribution waits as if its first
                               // had not completed, so the rare path runs
};

// kDet: the deterministic instantiation (the fixed-point fields of Common set), else the default
// one.
template <Dtype, bool kDet>
void run_main(const MainArgs& a, int units, cudaStream_t stream);
template <Dtype, bool kDet>
void run_fused(const FusedArgs& a, cudaStream_t stream);

}  // namespace flashmsa::cuda::attn_bwd
