// Parameters shared by the backward's kernels (preprocess, index inversion, main backward,
// fused main + kl backward, convert). CuTe-free: the dispatcher fills them.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/common/constants.h"
#include "cuda/common/seqlen.cuh"

namespace flashmsa::cuda::attn_bwd {

// dq_acc's column order (docs/kernels/bwd.md, the dQ tile's swizzle): the main backward's dQ tile has unpadded
// rows (128 floats), so that the dQ writer adds a token slot's R head rows with one bulk operation (they are adjacent in
// the tile and in dq_acc, [token, head, 128]); to keep the tile's float2 stores free of bank conflicts, each row's
// columns are XOR-swizzled, d -> d ^ dq_swizzle(t, r, Rp) for global token t and head r of its unit (Rp = R rounded up
// to a power of two), and dq_acc keeps every row in that order (a property of the (token, head) row, whichever CTA adds
// to it), which the dq convert undoes. The GPU serves a 64-bit store per half-warp: lanes 0-15 store 4 tile rows x 4
// column pairs (32 words), so the 4 rows must fall into 4 different 8-bank groups, which the key 8 ((r + Rp t) mod 4)
// does: 1 wavefront per half-warp, 2 per store (an earlier key, 4 ((r + Rp t) mod 8), put the 4 rows of a half-warp
// into 2 groups: 4 wavefronts per store in ncu). With Rp >= 4 the 4 rows are 4 heads of one token (keys r mod
// 4); with Rp = 2 or 1 they are 2 or 4 token slots, whose keys differ where the tokens are consecutive (clustered
// lists) and may coincide otherwise (bench/tools/dq_token_ops_model.py counts both). Only the low bits of t matter,
// hence the 32-bit product. The key is a multiple of 8, so aligned 8-column blocks move whole (the convert reads them
// with two 16-byte loads).
__host__ __device__ constexpr int dq_swizzle(int64_t t, int r, int rp) {
  return 8 * int((uint32_t(r) + uint32_t(rp) * uint32_t(t)) & 3u);
}

// Tile of the padded per-token buffers (lse2, dpsum): written by the preprocess, read by the
// main backward, both through padded_offset(..., kPadTile).
constexpr int kPadTile = 128;

// The deterministic mode's fixed point. A row's contributions c (each the partial sum over one
// key block or one chunk of rows) satisfy sum |c| <= B for a bound B (bwd_misc.cu: per dq row from
// max |K|, max |V_u|, |dO_t| and the dpsum; per tensor for dk, dv, dqp, dkp). The unit
// u = 2^(47 - floor(log2 B)) keeps B * u < 2^48; each c * u is rounded to an int64 and added, so the
// sum stays below 2^63 even with 2^14 blocks each at the bound, and its resolution is B * 2^-48 (fp32
// adds lose ~2^-24 of the running sum each). A contribution with |c * u| > 2^50 (4x past the
// bound: a non-finite input, or an lse that is not the rows' log-sum-exp) sets a flag that makes
// the converted gradient NaN instead of plausible numbers.
constexpr float kFixLimit = 0x1p50f;
// The 32-bit form, the sparse dq rows' default (SPARSE/GIVEN): a dq row there gets at most
// topk <= 64 = 2^6 contributions (one per selected block; a repeated block counts once), each with
// |c| <= B. The unit keeps B * u < 2^23, so the resolution is B * 2^-23; a contribution past 2^24
// (2-4x its bound) sets the flag, and 2^6 of them stay below 2^30: an int32 sum cannot wrap
// unnoticed. Two adjacent elements share one 64-bit integer add (pack_pair32): the default's fp32
// float2 adds move as many bytes with as many instructions. DENSE rows get up to 1024
// contributions and keep 64 bits per element.
constexpr float kFixLimit32 = 0x1p24f;
static_assert(kMaxTopk * double(kFixLimit32) < 0x1p31, "topk contributions at the flag limit must fit an int32");
// Two int32 contributions (lo: the even element, hi: the odd one) as one 64-bit word, hi * 2^32 + lo.
// The words' sum mod 2^64 is H * 2^32 + L (H, L the two elements' sums, in any order); while
// |L|, |H| < 2^31 (kFixLimit32 above) it is that integer exactly, and unpack_pair32 returns them.
__host__ __device__ inline unsigned long long pack_pair32(int32_t lo, int32_t hi) {
  return static_cast<unsigned long long>(static_cast<long long>(lo)) +
         (static_cast<unsigned long long>(static_cast<uint32_t>(hi)) << 32);
}
__host__ __device__ inline void unpack_pair32(unsigned long long w, int32_t& lo, int32_t& hi) {
  lo = static_cast<int32_t>(static_cast<uint32_t>(w));  // the low word, as a signed value
  hi = static_cast<int32_t>(static_cast<uint32_t>((w - static_cast<unsigned long long>(static_cast<long long>(lo))) >> 32));
}
// The deterministic mode's small block of kFixWords 32-bit words (zeroed before the launch):
// the bounds and the per-tensor units as floats (launch_fix_bounds), then one flag per gradient.
enum FixWord : int {
  kMaxK = 0,      // max |K| element
  kMaxV = 1,      // max |V_u| (row norm)
  kMaxKp = 2,     // max |Kp| element
  kMaxQ = 3,      // max |Q| element
  kMaxQp = 4,     // max |Qp| element
  kMaxDo = 5,     // max |dO_t| (row norm)
  kMaxDoEl = 6,   // max |dO| element
  kMaxDlse = 7,   // max |dlse|
  kUnitDqp = 8,   // the units of the tensors with one unit (dq has one per row)
  kUnitDk = 9,
  kUnitDv = 10,
  kUnitDkp = 11,
  kBad = 12,      // int flags: kBad + 0 dq, 1 dk, 2 dv, 3 dqp, 4 dkp
  kFixWords = 17
};
__host__ __device__ inline float fixed_unit(float bound) {
  if (!(bound < INFINITY)) return NAN;  // a non-finite input: the gradient comes out NaN
  if (bound <= 0.f) return 1.f;         // every contribution is 0
  int e = 47 - ilogbf(bound);
  e = e < -126 ? -126 : (e > 126 ? 126 : e);
  return ldexpf(1.f, e);
}
__host__ __device__ inline float fixed_unit32(float bound) {
  if (!(bound < INFINITY)) return NAN;
  if (bound <= 0.f) return 1.f;
  int e = 22 - ilogbf(bound);
  e = e < -126 ? -126 : (e > 126 ? 126 : e);
  return ldexpf(1.f, e);
}

// The inversion: for each (proxy head p, global key block gb) the tokens (global index,
// ascending) whose key set holds block gb: list = tokens[offsets[p * nblk + gb] ..
// offsets[p * nblk + gb + 1]). Global blocks number the blocks of all sequences in order:
// gb = blk_off[b] + j.
struct Inversion {
  const int32_t* tokens = nullptr;
  const int32_t* offsets = nullptr;   // [Hp * nblk + 1]
  const int32_t* blk_off = nullptr;   // [B + 1]
  int nblk = 0;                       // total global blocks
};

struct Common {
  TokenTensor<const void> q, k, v, dout, qp, kp;
  HeadTensor<const float> lse2, dsum;  // padded: at(h, padded_offset(s0, b, kPadTile) + i)
  HeadTensor<const float> plse;        // [Hp, total] natural log (proxy lse over the set)
  Seqs seqs;
  Inversion inv;
  int Hq = 0, Hkv = 0, Hp = 0, Hpk = 0, R = 0;
  float scale = 0, proxy_scale = 0;
  bool dense = false;
  // fp32 accumulators [total, H, 128] (dense layout)
  float* dq_acc = nullptr;
  float* dk_acc = nullptr;
  float* dv_acc = nullptr;
  float* dqp_acc = nullptr;
  float* dkp_acc = nullptr;
  float* kl_acc = nullptr;   // [Hp, nblk] partial kl sums (one per kl item), or null
  const float* dkl = nullptr;  // device scalar g (null: 0)
  int64_t total = 0;  // query rows (with query segments fewer than the key rows)
  // deterministic mode's exact sums (bwd_common.cuh, "fixed point"): the main kernel's dq and the
  // kl kernel's dqp add 64-bit integers, (contribution * unit) rounded, so the sum does not depend
  // on the order of the adds. unit is a power of two chosen from a bound of the row's sum.
  int64_t* dq_fix = nullptr;          // [total, Hq, 128]
  int64_t* dk_fix = nullptr;          // [total, Hkv, 128]
  int64_t* dv_fix = nullptr;
  int64_t* dqp_fix = nullptr;         // [total, Hp, 128]
  int64_t* dkp_fix = nullptr;         // [total, Hpk, 128]
  HeadTensor<const float> dq_unit;    // padded like dsum: the unit of each (head, token) dq row
  float* fix = nullptr;               // the small block (FixWord): bounds, units, flags
  int32_t* dq_fix32 = nullptr;        // dq_fix's rows in 32 bits (fixed_unit32; null: dq_fix)
  // Query segments (flashmsa.h; null without them): per query row t, its position in its key sequence and its index
  // in the padded buffers (lse2, dsum, dq_unit: padded per segment, as the preprocess writes them); built by
  // launch_query_rows. Without segments a row's position is t - s0 and its padded index pad0 + t.
  const int32_t* qpos = nullptr;
  const int32_t* qpad = nullptr;
  __device__ __forceinline__ int32_t row_pos(int64_t s0, int64_t t) const { return qpos ? qpos[t] : int32_t(t - s0); }
  __device__ __forceinline__ int64_t row_pad(int64_t pad0, int64_t t) const { return qpad ? qpad[t] : pad0 + t; }
  // a readable query row for a slot without one (nothing is read from it): the key sequence's first row without
  // segments (query rows are key rows), row 0 with them (segments are varlen: no batch stride)
  __device__ __forceinline__ int64_t spare_row(int64_t s0) const { return qpos ? 0 : s0; }
};

}  // namespace flashmsa::cuda::attn_bwd
