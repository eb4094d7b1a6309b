// The fp8 selection's quantised copies (docs/semantics.md, "fp8 selection"): qp per (row, proxy
// head) and kp per (128-token key block of its sequence, proxy key head), each group scaled by
// amax / 448 and stored as e4m3(x * (448 / amax)), round to nearest even, saturating. CuTe-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/element.h"
#include "cuda/common/seqlen.cuh"

namespace flashmsa::cuda::selection {

// The copies the e4m3 selection reads: q8 [total, Hp, 128] and k8 [total_k, Hpk, 128] bytes, token-major and
// contiguous; qscale [Hp, total]; kscale [Hpk, total_k], the scale of a key block at its first row (the other
// rows are not written). A group with a non-finite value gets a NaN scale (its logits rank below every number,
// as the reference's NaN logits do); an all-zero group the scale 0.
struct Fp8Copies {
  uint8_t* q8 = nullptr;
  uint8_t* k8 = nullptr;
  float* qscale = nullptr;
  float* kscale = nullptr;
  int64_t total = 0, total_k = 0;
};

struct QuantArgs {
  bool batched = false;
  TokenTensor<const void> qp, kp;
  Seqs keys;             // the key sequences (cu_seqlens, or batched), no segments
  int64_t seqlen = 0;    // batched S (query and key rows t = b * S + position)
  int Hp = 0, Hpk = 0;
  int max_blocks = 0;    // key blocks of the longest sequence
};

// src: the input dtype (kBf16 or kFp16)
void quantize_fp8(Dtype src, const QuantArgs& a, const Fp8Copies& c, cudaStream_t st);

// bytes of the copies for `total` query rows and `total_k` key rows (each part 256-byte aligned)
size_t fp8_copies_bytes(int64_t total, int64_t total_k, int Hp, int Hpk);
Fp8Copies fp8_copies_at(void* ws, int64_t total, int64_t total_k, int Hp, int Hpk);

}  // namespace flashmsa::cuda::selection
