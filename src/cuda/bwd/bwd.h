// The backward's launch interface as the dispatcher sees it (CuTe-free): plain arguments of the
// three wgmma kernels and one run_*<Dtype, ...>() per instantiation TU (bwd_{main,kl,proxy}_*.cu),
// which builds the TMA descriptors of the resident key blocks and launches the kernel. The small
// kernels (preprocess, inversion, convert, kl reduce) are in bwd_misc.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd/bwd_params.cuh"
#include "cuda/common/element.h"

namespace flashmsa::cuda::attn_bwd {

// The main backward (bwd_kernel.cuh): dq, dk, dv; with `teacher`, also the KL teacher.
struct MainArgs {
  bool batched = false;
  Common c;
  int Rp = 0;                  // head slots per token: R rounded up to a power of two
  int log_rp = 0;              // log2(Rp)
  float* teacher = nullptr;    // [inversion entries, 128] mean_h P of the group, or null
  bool teacher_only = false;   // the forward's kl: S, P and the teacher only (V is not read)
  int64_t total = 0;           // tokens of the per-token tensors (the TMA descriptors' extent)
};

// The proxy side from the stored teacher (kl_kernel.cuh): dqp, dkp, the kl partials.
struct KlArgs {
  bool batched = false;
  Common c;
  const float* teacher = nullptr;  // [inversion entries, 128], from the main backward
  bool grads = true;               // false: the kl value only (forward's compute_kl)
  int64_t total = 0;
};

// The recomputing proxy kernel (proxy_kernel.cuh, DENSE mode): the teacher from the group's S.
struct ProxyArgs {
  bool batched = false;
  Common c;
  int G = 0;           // query heads per proxy head
  bool grads = true;   // false: kl value only (forward's compute_kl), no gradients
  int64_t total = 0;
};

// kDet: the deterministic instantiation (c.turn_keys and the fixed-point fields of Common set),
// else the default one.
template <Dtype, bool kDet>
void run_main(const MainArgs& a, int units, cudaStream_t stream);
template <Dtype, bool kDet>
void run_kl(const KlArgs& a, cudaStream_t stream);
// kTok: tokens per chunk (64 / G rounded: 16 or 64, tiles.h)
template <Dtype, int kTok, bool kDet>
void run_proxy(const ProxyArgs& a, cudaStream_t stream);

}  // namespace flashmsa::cuda::attn_bwd
