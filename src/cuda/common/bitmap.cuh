// A block bitmap's compaction, shared by the forward's prologue (the tile's union) and the regrouping (a span's
// distinct blocks): one warp writes each word's exclusive prefix of set bits and returns the total (every lane);
// a set bit's rank in the compacted list then reads one prefix word and one bitmap word.
// CuTe-free.
#pragma once

#include <cstdint>

namespace flashmsa::cuda {

__device__ __forceinline__ int warp_word_prefix(const uint32_t* bits, int nwords, int* prefix, int lane) {
  int carry = 0;
  for (int w0 = 0; w0 < nwords; w0 += 32) {
    const int w = w0 + lane;
    const int c = w < nwords ? __popc(bits[w]) : 0;
    int x = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (w < nwords) prefix[w] = carry + x - c;
    carry += __shfl_sync(0xffffffffu, x, 31);
  }
  return carry;
}

// The rank of set bit j among the bitmap's set bits (the index of block j in the compacted list), from the word
// prefix that warp_word_prefix wrote.
__device__ __forceinline__ int bit_rank(const uint32_t* bits, const int* prefix, int j) {
  return prefix[j / 32] + __popc(bits[j / 32] & ((1u << (j % 32)) - 1u));
}

}  // namespace flashmsa::cuda
