// The forward's router (sparse mode): per tile, the shared-stream kernel or the per-warpgroup
// rings kernel (fwd_kernel.cuh). One warp per tile counts the blocks that each consumer
// warpgroup's tokens selected (n_0, n_1) and their union u, exactly as the forward's prologue
// builds them (a slot counts when 0 <= j <= the token's own block), and writes 1 (rings) when
// 1000 max(n_0, n_1) <= ratio_permille u (fwd.h). Both kernels then run the same grid and return at once
// on the tiles routed to the other. Reads (Hq / R) x total x topk index slots (each head unit of
// a group reads the group's; m3 32k: 8 MB, a few microseconds); no CuTe.
#include "cuda/common/constants.h"
#include "cuda/common/error.cuh"
#include "cuda/fwd/fwd.h"

namespace flashmsa::cuda::attn_fwd {

namespace {

constexpr int kWarps = 8;                    // tiles per CTA
constexpr int kWords = kMaxBlocks / 32;      // a bitmap of a sequence's blocks

__global__ void __launch_bounds__(kWarps * 32) route_kernel(const Args a, int ratio_permille, uint8_t* __restrict__ route) {
  __shared__ uint32_t bits[kWarps][2][kWords];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int units = a.Hq / a.R;
  const int64_t ntiles = num_tiles(a);
  const int64_t id = int64_t(blockIdx.x) * kWarps + warp;
  if (id >= ntiles) return;
  const int m_tile = int(id % a.num_m_tiles);
  const int unit = int((id / a.num_m_tiles) % units), b = int(id / (int64_t(a.num_m_tiles) * units));
  const QueryUnit qu = query_unit(a.seqs, b);  // (fwd_kernel.cuh's tile_from: the same tile)
  const int64_t L = qu.hi, qrow0 = qu.qrow0;
  const int64_t i0 = qu.lo + int64_t(m_tile) * a.NT;
  if (i0 >= L) {  // no rows: either kernel returns at once
    if (lane == 0) route[id] = 0;
    return;
  }
  const int ntok = L - i0 < a.NT ? int(L - i0) : a.NT;
  const int grp = unit * a.R / (a.Hq / a.Hp);
  const int64_t i_last = tile_last_pos(i0, ntok, L, a.perm != nullptr);  // (fwd.h: regrouped tiles too)
  const int nwords = int((i_last / kBlockKeys) / 32 + 1);
  uint32_t(&w0)[kWords] = bits[warp][0];
  uint32_t(&w1)[kWords] = bits[warp][1];
  for (int w = lane; w < nwords; w += 32) w0[w] = w1[w] = 0u;
  __syncwarp();
  const int last0 = wg_last_token(a.R, 0), first1 = wg_first_token(a.R, 1);  // (fwd.h)
  const int nent = ntok * a.topk;
  for (int e = lane; e < nent; e += 32) {
    const int tok = e / a.topk, s = e % a.topk;
    const int64_t i = tile_token_pos(a, grp, qrow0, i0, tok);
    const int j = a.indices.at(grp, qrow0 + i)[s];
    if (j < 0 || int64_t(j) > i / kBlockKeys) continue;
    const uint32_t bit = 1u << (j % 32);
    if (tok <= last0) atomicOr(&w0[j / 32], bit);
    if (tok >= first1) atomicOr(&w1[j / 32], bit);
  }
  __syncwarp();
  int n0 = 0, n1 = 0, u = 0;
  for (int w = lane; w < nwords; w += 32) {
    n0 += __popc(w0[w]);
    n1 += __popc(w1[w]);
    u += __popc(w0[w] | w1[w]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    n0 += __shfl_xor_sync(0xffffffffu, n0, o);
    n1 += __shfl_xor_sync(0xffffffffu, n1, o);
    u += __shfl_xor_sync(0xffffffffu, u, o);
  }
  if (lane == 0) route[id] = uint8_t(u > 0 && 1000 * max(n0, n1) <= ratio_permille * u);
}

}  // namespace

void launch_route(const Args& a, int ratio_permille, uint8_t* route, cudaStream_t stream) {
  const int64_t ntiles = num_tiles(a);
  if (ntiles == 0) return;
  route_kernel<<<unsigned((ntiles + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(a, ratio_permille, route);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashmsa::cuda::attn_fwd
