// The backward's small kernels: preprocess (dpsum, lse in log2 into padded buffers), index
// inversion (deterministic: a stable radix sort keyed by (proxy head, global block)), and the
// fp32-accumulator to output conversion.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/bwd/bwd_params.cuh"
#include "cuda/common/element.h"

namespace flashmsa::cuda::attn_bwd {

struct PreprocessArgs {
  TokenTensor<const void> out, dout;
  TokenTensor<const void> out_lo;  // optional: dpsum from out + out_lo (precise dpsum)
  HeadTensor<const float> lse;   // [Hq, total] natural log
  HeadTensor<const float> dlse;  // optional
  Seqs seqs;
  int Hq = 0;
  int64_t max_seqlen = 0;
  float* lse2 = nullptr;  // padded [Hq, padded_total]
  float* dsum = nullptr;
  int64_t padded_stride = 0;  // = padded_total(total, B, kPadTile)
  // deterministic mode: each dq row's fixed-point unit (padded like dsum), from the bounds
  // (launch_fix_bounds: fix[kMaxK], fix[kMaxV]) and the row's |dO| and dpsum
  float* dq_unit = nullptr;
  const float* fix = nullptr;
  bool dq_unit32 = false;  // the units of the 32-bit dq rows (fixed_unit32)
};
template <Dtype>
void launch_preprocess(const PreprocessArgs& a, cudaStream_t st);

// Query segments: per query row t of segment s (cu_seqlens_q[s] <= t < cu_seqlens_q[s + 1]), qpos[t] = its position in
// its key sequence, q_origin[s][1] + t - cu_seqlens_q[s], and qpad[t] = padded_offset(cu_seqlens_q[s], s, kPadTile) +
// t - cu_seqlens_q[s], its index in the padded buffers (the preprocess runs over the segments as its sequences).
// q: the guard's segments (q.cuq, q.qorigin, q.segments).
void launch_query_rows(const Seqs& q, int64_t total_q, int32_t* qpos, int32_t* qpad, cudaStream_t st);
// The segments as the sequences of the query rows: what the preprocess and the query-side converts iterate over.
__host__ __device__ inline Seqs query_seqs(const Seqs& q) {
  if (!q.cuq) return q;
  Seqs r;
  r.cu_seqlens = q.cuq;
  r.batch = r.segments = q.segments;
  return r;
}

// Inversion workspace sizes; build writes inv.{tokens, offsets, blk_off}.
struct InversionArgs {
  HeadTensor<const int32_t> indices;  // [Hp, total, topk] (total: query rows)
  Seqs seqs;                          // the key sequences, with the query segments when the call has them
  int Hp = 0, topk = 0;
  int64_t total = 0;
  int nblk = 0;  // upper bound of global blocks: total / 128 + B + 1
};
size_t inversion_workspace(const InversionArgs& a);
// Builds into ws (inversion_workspace bytes); returns the views.
Inversion build_inversion(const InversionArgs& a, void* ws, cudaStream_t st);
// blk_off only (dense mode), into ws of (B + 1) ints plus scan scratch.
size_t blk_off_workspace(int batch);
const int32_t* build_blk_off(const Seqs& seqs, void* ws, cudaStream_t st);

// out[t, h, :] = scale * acc[t, h, :] in the output dtype. dq_layout: for the main backward's dq_acc, its heads per
// unit (R) and their head slots (Rp: R rounded up to a power of two), whose column order (bwd_params.cuh, dq_swizzle)
// the convert undoes; the default (unit_heads 0) for every other accumulator.
// words: the store-first rows' words (dq_writer.cuh; [Hp, total], one per unit of unit_heads heads), whose zero
// arrival count marks a row group that no contribution stored (converted to zeros); null: dq_acc was zeroed.
struct DqLayout {
  int unit_heads = 0, unit_rp = 0;
  const uint64_t* words = nullptr;
  int64_t total = 0;
};
template <Dtype>
void launch_convert(const float* acc, TokenTensor<void> out, const Seqs& seqs, int64_t max_seqlen, int heads,
                    float scale, cudaStream_t st, DqLayout dq_layout = {});

// Deterministic mode's fixed point (bwd_params.cuh): the bounds of FixWord into fix (zeroed by
// the caller), then the units of dk, dv, dqp, dkp. Non-finite inputs give non-finite bounds and
// NaN units (so NaN gradients).
struct FixInputs {
  TokenTensor<const void> q, k, v, dout, qp, kp;  // qp, kp: absent without a proxy
  HeadTensor<const float> dlse;                   // optional
  const float* dkl = nullptr;                     // optional (no proxy gradient)
  int Hq = 0, Hkv = 0, Hp = 0, Hpk = 0;
  Seqs seqs;
  int64_t total = 0, max_seqlen = 0;  // query rows; max_seqlen: the most query rows of a head that reach one key
  int64_t total_k = 0;                // key rows (k, v, kp)
  Dtype dtype = Dtype::kBf16;
};
void launch_fix_bounds(const FixInputs& in, float* fix, cudaStream_t st);
// out[t, h, :] = scale * acc[t, h, :] / unit in the output dtype, unit = row_unit.at(h, padded
// row) (per row: padded_stride > 0) or *unit (one for all); NaN everywhere when *bad is set.
template <Dtype>
void launch_convert_fixed(const int64_t* acc, TokenTensor<void> out, const Seqs& seqs, int64_t max_seqlen, int heads,
                          float scale, const float* unit, int64_t padded_stride, const int32_t* bad, cudaStream_t st);
// The same from 32-bit accumulators (dq rows with fixed_unit32).
template <Dtype>
void launch_convert_fixed32(const int32_t* acc, TokenTensor<void> out, const Seqs& seqs, int64_t max_seqlen, int heads,
                            float scale, const float* unit, int64_t padded_stride, const int32_t* bad, cudaStream_t st);

// kl = scale * (sum of n per-CTA partials, added in a fixed order): deterministic.
void launch_kl_reduce(const float* partials, int64_t n, double scale, float* out, cudaStream_t st);

}  // namespace flashmsa::cuda::attn_bwd
