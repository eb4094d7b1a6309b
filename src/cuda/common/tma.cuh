// TMA loads of 128-token blocks of a per-token tensor ([total, H, 128] varlen or
// [B, S, H, 128] batched) into one stage of a swizzled shared-memory layout.
//
// The tensor is described to the copy engine as (tokens, d, heads, batch): varlen uses one
// batch of `total` tokens and shifts the origin to the sequence start (domain_offset), batched
// uses (S, d, H, B). Tokens past the tensor's end are zero-filled by the engine; tokens of the
// next sequence are masked by the consumer (u <= i).
#pragma once

#include <cute/tensor.hpp>

#include "cuda/common/constants.h"
#include "cuda/common/seqlen.cuh"

namespace flashmsa::cuda {

using TmaShape = cute::Shape<int32_t, int32_t, int32_t, int32_t>;     // (tokens, d, heads, batch)
using TmaStride = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;

template <class Element, class SmemLayoutStage>
using TmaBlockLoad = decltype(cute::make_tma_copy(
    cute::SM90_TMA_LOAD{},
    cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), TmaShape{}, TmaStride{}),
    SmemLayoutStage{}, cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadDimInst>>{}, cute::_1{}));

// Host: the copy and the shape of its coordinate tensor for a per-token tensor of `heads`
// heads. batched: (S, d, H, B) with the batch stride; varlen: (total, d, H, 1).
template <class Element, class SmemLayoutStage>
struct TmaBlock {
  TmaBlockLoad<Element, SmemLayoutStage> copy;
  TmaShape shape;
};

// The token and batch extents of a per-token tensor for the copy engine, and its batch stride:
// batched (S tokens, B batches), element (b, s) at b * (batch_corr + S * tok) + s * tok; varlen
// (total tokens, one batch, whose stride is never used).
struct TokenExtents {
  int32_t tokens, batches;
  int64_t bstride;
};
inline TokenExtents token_extents(const TokenTensor<const void>& t, bool batched, int64_t seqlen, int batch,
                                  int64_t total) {
  return {int32_t(batched ? seqlen : total), batched ? batch : 1,
          batched ? t.batch_corr + seqlen * t.tok : total * t.tok};
}

template <class Element, class SmemLayoutStage>
TmaBlock<Element, SmemLayoutStage> make_block_load(const TokenTensor<const void>& t, int heads, bool batched,
                                                   int64_t seqlen, int batch, int64_t total) {
  using namespace cute;
  const TokenExtents e = token_extents(t, batched, seqlen, batch, total);
  TmaShape shape = make_shape(e.tokens, int32_t(kHeadDimInst), int32_t(heads), e.batches);
  TmaStride stride = make_stride(t.tok, _1{}, t.head, e.bstride);
  Tensor m = make_tensor(make_gmem_ptr(static_cast<Element const*>(t.ptr)), shape, stride);
  return {make_tma_copy(SM90_TMA_LOAD{}, m, SmemLayoutStage{}, Shape<Int<kBlockKeys>, Int<kHeadDimInst>>{}, _1{}), shape};
}

// Device: the blocks of head `head` of sequence b as the TMA copy's source, (TMA, block): block
// j holds tokens [128 j, 128 j + 128) of the sequence (origin s0 in the varlen tensor; batch
// index b in the batched one). Every kernel's block loads go through this one view: the forward
// (K_j, V_j) and the selection (Kp_j) stream it, the backward loads one block j (tma_load_block).
template <class Tma>
__device__ __forceinline__ auto tma_blocks(const Tma& tma, const TmaShape& shape, int head, int b, int64_t s0,
                                           bool batched) {
  using namespace cute;
  Tensor m = tma.get_tma_tensor(shape)(_, _, head, batched ? b : 0);
  Tensor g = local_tile(domain_offset(make_coord(batched ? int64_t(0) : s0, _0{}), m),
                        Shape<Int<kBlockKeys>, Int<kHeadDimInst>>{}, make_coord(_, _0{}));
  return group_modes<0, 3>(tma.get_slice(_0{}).partition_S(g));
}

// Device: shared-memory destination of those loads, (TMA, stage) (or (TMA) for one resident block).
template <class Tma, class Smem>
__device__ __forceinline__ auto tma_stages(const Tma& tma, Smem&& smem) {
  using namespace cute;
  return group_modes<0, 3>(tma.get_slice(_0{}).partition_D(smem));
}

}  // namespace flashmsa::cuda
