// The selection's launch interface as the dispatcher sees it (CuTe-free): plain arguments and
// one run<Dtype>() per instantiation TU (select_bf16.cu, select_fp16.cu), which builds the TMA
// descriptor of kp and launches select_kernel (select_kernel.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/element.h"
#include "cuda/common/seqlen.cuh"

namespace flashmsa::cuda::selection {

// lse_mode: kSelect = selection (indices, and the selected-set proxy lse when asked); the
// lse-only modes write no indices: kDenseLse = over every causal key, kGivenLse = over the blocks
// of `given` [Hp, total, topk] (an empty set: -inf)
constexpr int kSelect = 0, kDenseLse = 1, kGivenLse = 2;

struct Args {
  bool batched = false;
  TokenTensor<const void> qp, kp;
  Seqs seqs;
  int Hp = 0, Hpk = 0, topk = 0;
  float proxy_scale = 0;
  HeadTensor<int32_t> indices;  // [Hp, total, topk]
  HeadTensor<float> proxy_lse;  // [Hp, total]; ptr may be null
  int num_m_blocks = 0;         // grid x: query blocks of the longest sequence
  int lse_mode = kSelect;
  HeadTensor<const int32_t> given;
  int64_t total = 0;  // tokens of the per-token tensors (the TMA descriptor's extent)
};

// The e4m3 selection's scales (fp8_quant.h): qscale [Hp, total_q], kscale [Hpk, total] (a key block's scale at
// its first row). Read only by the kE4m3 instantiation, which selects without the proxy lse (the dispatcher forms
// it afterwards over the selected blocks in the input dtype, kGivenLse).
struct Fp8Scales {
  const float* qscale = nullptr;
  const float* kscale = nullptr;
  int64_t total_q = 0;
};

template <Dtype>
void run(const Args& a, cudaStream_t stream, const Fp8Scales& fp8 = {});

}  // namespace flashmsa::cuda::selection
