// The KL rule of docs/semantics.md ("The KL term") on the device, in one place: the kl walk
// (kl_kernel.cuh, teacher stored by the main walk; fused_kernel.cuh) applies it. The teacher's mean
// over the group (1/G) is taken where the teacher is formed (bwd_kernel.cuh's store_teacher);
// the 1/N of the kl value and the gradient's 1/N and proxy scale are the host's (kl_scales in
// src/cuda/dispatch.h), applied once by the kl reduce and the conversion kernels.
#pragma once

#include <cstdint>

#include "cuda/bwd/bwd_common.cuh"

namespace flashmsa::cuda::attn_bwd {

// dz's gain. The kernels keep dz N / proxy_scale times larger than SPEC's (the 1/N inside, fp16's dz fell into
// subnormals) and round it to the input dtype for the proxy GEMMs. Formed with g itself, g (s - t) overflowed fp16
// (65504) under a loss scaler's g (torch.amp.GradScaler: 2^16 at first, doubled every 2000 steps without an inf; at
// 2^24 wherever |s - t| > 0.004), while the outputs, N times smaller, were in range: an inf in every proxy gradient
// and a skipped step. So dz is formed with g' = g 2^k, |g'| in [2^13, 2^14): |dz| <= |g'| < 2^14 for every g, and
// (s - t) keeps fp16's 11 bits down to 2^-27. The fp32 products (a dQp tile, dKp) are scaled back by 2^-k before
// they are added anywhere: exact (powers of two), so the accumulators, the deterministic mode's fixed-point units
// (from |g|) and bf16's results (the same rounding at any scale) are unchanged. g = 0, inf or NaN: gain g, unscale 1
// (exact zeros stay exact; non-finite values propagate).
struct KlGain {
  float gain, unscale;
};
__device__ __forceinline__ KlGain kl_gain(float g) {
  if (!(fabsf(g) > 0.f) || !isfinite(g)) return {g, 1.f};
  int e;
  frexpf(g, &e);  // |g| = m 2^e, m in [0.5, 1)
  const int k = max(-126, min(126, 14 - e));  // (for finite g only k > 126 is cut: |g| < 2^-112, gain < 2^14)
  return {ldexpf(g, k), ldexpf(1.f, -k)};
}

// One (token, key) of a proxy head: the student s = 2^zl2 (zl2 = log2 s, from the proxy logit and
// the proxy lse), the teacher t. Returns dz = g (s - t) for the g given (the kernels pass
// kl_gain(g).gain), kept N / proxy_scale times larger than SPEC's dz; kl_element also adds the kl
// term t (ln t - ln s) to kl_sum (a zero teacher adds nothing: 0 ln 0 = 0; a NaN or inf teacher or
// student adds NaN or inf, as its dz has: `teacher != 0`, never `teacher > 0`, which is false for
// NaN and would drop the row from the value only), kl_gradient does not (the kl value not asked
// for: no log per element).
__device__ __forceinline__ float kl_gradient(float teacher, float zl2, float g) {
  return g * (ptx::exp2f_approx(zl2) - teacher);
}
// `valid` false: nothing added (a masked element; its dz is the caller's to drop). The term is formed either way
// and selected, not branched to (the kl walk's element loop stays branch-free; + 0.f leaves kl_sum's bits).
__device__ __forceinline__ float kl_element(float teacher, float zl2, float g, float& kl_sum, bool valid = true) {
  const float dz = kl_gradient(teacher, zl2, g);
  const float term = teacher * (__logf(teacher) - zl2 * kLn2);
  kl_sum += (valid && teacher != 0.f) ? term : 0.f;
  return dz;
}

// dKp_j of a (key block, proxy head) walk: fp32 atomics (several proxy heads may share a proxy
// key head). dQp is added per chunk by the kl walk ((token, dim) accumulators, float2 adds of
// adjacent dims, through its dQ writer).
// kFixed (the kl walk's deterministic instantiation): dKp in fixed point (bwd_params.cuh), no
// fence in the kernel (a fence would make every add of the kernel a waiting ATOMG).
// unscale: kl_gain's 2^-k, applied to accdKp (in place) before it is added.
template <int kHeadDim, bool kFixed = false, class Acc, class ThrMma>
__device__ __forceinline__ void add_dkp(const Common& p, bool grads, Acc& accdKp, float unscale, const ThrMma& thr_dkp,
                                        int pk, int64_t key_base, int64_t L, int64_t s0) {
  using namespace cute;
  if (!grads) return;
#pragma unroll
  for (int x = 0; x < size(accdKp); ++x) accdKp(x) *= unscale;
  const auto c = thr_dkp.partition_C(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
  if constexpr (kFixed) {
    bool bad = false;
    add_key_rows_fixed(accdKp, c, key_base, L, s0, p.Hpk, pk, p.dkp_fix, p.fix[kUnitDkp], bad);
    if (bad) atomicOr(reinterpret_cast<int32_t*>(p.fix) + kBad + 4, 1);
  } else {
    add_key_rows(accdKp, c, key_base, L, s0, p.Hpk, pk, p.dkp_acc);
  }
}

}  // namespace flashmsa::cuda::attn_bwd
