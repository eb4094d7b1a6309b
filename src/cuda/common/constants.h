// The numbers every kernel shares, named (a literal 128 meant three things: keys per block, the
// head dim, threads per warpgroup). Plain: the dispatcher includes it too; support.cpp
// static_asserts them against flashmsa.h.
#pragma once

namespace flashmsa::cuda {

constexpr int kMaxTopk = 64;       // FLASHMSA_MAX_TOPK: the selection's list capacity
constexpr int kBlockKeys = 128;    // FLASHMSA_BLOCK_SIZE: keys per block, rows of every TMA block box
constexpr int kHeadDimInst = 128;  // the one instantiated head dim (D = Dp = 128, SPEC v1)
constexpr int kWgmmaM = 64;        // rows of one warpgroup's wgmma tile

}  // namespace flashmsa::cuda
