// The main forward's launch interface as the dispatcher sees it (CuTe-free): plain arguments and
// one run<Dtype, kLazyRescale>() per instantiation TU (fwd_{bf16,fp16}_{train,infer}.cu), which
// builds the TMA descriptors of K and V and launches fwd_kernel (fwd_kernel.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/element.h"
#include "cuda/common/seqlen.cuh"

namespace flashmsa::cuda::attn_fwd {

// Capacity of the per-tile union (entries of (token, slot) pairs) and of the block bitmap in
// shared memory (fwd_kernel.cuh's Config): they bound topk * tokens per tile and max_seqlen.
constexpr int kMaxUnion = 2048;
constexpr int kMaxBlocks = 8192;  // max_seqlen <= 1M tokens

struct Args {
  bool batched = false;
  TokenTensor<const void> q, k, v;
  TokenTensor<void> out;
  TokenTensor<void> out_lo;  // optional: Element(O - Element(O)) of the fp32 output O
  HeadTensor<float> lse;              // [Hq, total]
  HeadTensor<const int32_t> indices;  // [Hp, total, topk]; ptr null in dense mode
  Seqs seqs;
  int Hq = 0, Hkv = 0, Hp = 0, topk = 0;
  int R = 0, NT = 0;                  // heads and tokens per tile (tiles.h)
  float scale = 0;
  int num_m_tiles = 0;
  int64_t total = 0;  // tokens of the per-token tensors (the TMA descriptors' extent)
};

template <Dtype, bool kLazyRescale>
void run(const Args& a, cudaStream_t stream);

}  // namespace flashmsa::cuda::attn_fwd
