#include "cuda/bwd/bwd_misc.cuh"

#include <algorithm>
#include <type_traits>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cutlass/numeric_types.h>

#include "cuda/common/utils.cuh"

namespace flashmsa::cuda::attn_bwd {

namespace {

template <class T>
__device__ __forceinline__ float to_f(T x) { return float(x); }

// Per (token, head): dsum = <dout, out> - dlse, lse2 = lse * log2(e), and in deterministic mode
// the dq row's fixed-point unit. A block covers kPreTokens tokens of one head: each half-warp owns
// one token's 128-element rows (16 lanes x 8 elements, 16-byte loads; support.cpp checks the
// alignment), and a warp has all of its kPreSteps x 2 tokens' loads in flight before it reduces:
// one 256-byte row per warp and step (an earlier form of this kernel) reached ~2 TB/s, half the HBM.
constexpr int kPreSteps = 4;                         // tokens per half-warp
constexpr int kPreTokens = 8 * 2 * kPreSteps;        // per block of 8 warps
template <class Element>
__device__ __forceinline__ void load_row8(const Element* row, int part, float (&x)[8]) {
  static_assert(sizeof(Element) == 2, "16-bit elements: 8 per 16-byte load");
  const uint4 v = *reinterpret_cast<const uint4*>(row + part * 8);
  const Element* e = reinterpret_cast<const Element*>(&v);
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] = to_f(e[k]);
}
template <class Element>
__global__ void preprocess_kernel(const PreprocessArgs a) {
  static_assert(kHeadDimInst == 16 * 8, "a half-warp's 16 lanes x 8 elements cover a row");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, half = lane / 16, part = lane % 16;
  const int h = blockIdx.y, b = blockIdx.z;
  int64_t s0, L;
  a.seqs.get(b, s0, L);
  const int64_t i0 = int64_t(blockIdx.x) * kPreTokens + warp * 2 * kPreSteps;  // the warp's first token
  if (i0 >= L) return;
  float acc[kPreSteps], g2[kPreSteps];
#pragma unroll
  for (int s = 0; s < kPreSteps; ++s) acc[s] = 0.f, g2[s] = 0.f;
  if (a.dout.ptr) {  // without dout (the forward's kl), only lse2
    float o[kPreSteps][8], g[kPreSteps][8];
#pragma unroll
    for (int s = 0; s < kPreSteps; ++s) {  // every load first
      const int64_t i = i0 + 2 * s + half;
      const int64_t t = s0 + (i < L ? i : 0);  // a readable row past the end (not stored)
      load_row8(a.out.template row<const Element>(b, t, h), part, o[s]);
      load_row8(a.dout.template row<const Element>(b, t, h), part, g[s]);
      if (a.out_lo.ptr) {
        float lo[8];
        load_row8(a.out_lo.template row<const Element>(b, t, h), part, lo);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[s][k] += lo[k];
      }
    }
#pragma unroll
    for (int s = 0; s < kPreSteps; ++s)
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        acc[s] += o[s][k] * g[s][k];
        g2[s] += g[s][k] * g[s][k];
      }
#pragma unroll
    for (int s = 0; s < kPreSteps; ++s)
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) {  // within the half-warp
        acc[s] += __shfl_xor_sync(0xffffffff, acc[s], off);
        g2[s] += __shfl_xor_sync(0xffffffff, g2[s], off);
      }
  }
  if (part != 0) return;
  const int64_t pad = padded_offset(s0, b, kPadTile);
#pragma unroll
  for (int s = 0; s < kPreSteps; ++s) {
    const int64_t i = i0 + 2 * s + half;
    if (i >= L) break;
    const int64_t t = s0 + i, pi = pad + i;
    const float dl = a.dlse.ptr ? *a.dlse.at(h, t) : 0.f;
    if (a.dsum) a.dsum[h * a.padded_stride + pi] = acc[s] - dl;
    a.lse2[h * a.padded_stride + pi] = *a.lse.at(h, t) * kLog2e;
    // deterministic mode: a dq row adds sum_u dS_tu K_u with dS_tu = P_tu (dP_tu - D_t),
    // |dP_tu| <= |dO_t| |V_u| and sum_u P_tu <= 1, so |dq_t| <= max|K| (|dO_t| max|V_u| + |D_t|)
    if (a.dq_unit) {
      const float bound = a.fix[kMaxK] * (sqrtf(g2[s]) * a.fix[kMaxV] + fabsf(acc[s] - dl));
      a.dq_unit[h * a.padded_stride + pi] = a.dq_unit32 ? fixed_unit32(bound) : fixed_unit(bound);
    }
  }
}

// Deterministic mode: max over the rows of a per-token tensor [total, heads, 128] of the row's
// largest |element| (norm = false) or its L2 norm (norm = true), into *out (a non-negative float
// compared as an int: NaN, 0x7fc00000 once the sign is cleared, wins over every finite value and inf).
template <class Element>
__global__ void row_bound_kernel(const TokenTensor<const void> x, int heads, const Seqs seqs, int64_t total, bool norm,
                                 float* out) {
  __shared__ float part[8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float m = 0.f;
  for (int64_t r = int64_t(blockIdx.x) * 8 + warp; r < total * heads; r += int64_t(gridDim.x) * 8) {
    const int64_t t = r / heads;
    const int h = int(r % heads);
    const int b = seqs.cu_seqlens ? 0 : int(t / seqs.seqlen);  // varlen tensors have no batch stride
    const Element* row = x.template row<const Element>(b, t, h);
    float v = 0.f;
    for (int e = 0; e < 4; ++e) {
      const float y = to_f(row[lane * 4 + e]);
      v = norm ? v + y * y : fmaxf(v, fabsf(y)) + (y - y);  // (y - y): NaN stays NaN through fmaxf
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float o = __shfl_xor_sync(0xffffffff, v, off);
      v = norm ? v + o : fmaxf(v, o) + (o - o);
    }
    if (norm) v = sqrtf(v);
    m = __int_as_float(max(__float_as_int(m), __float_as_int(fabsf(v))));
  }
  if (lane == 0) part[warp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    int best = 0;
    for (int w = 0; w < 8; ++w) best = max(best, __float_as_int(part[w]));
    atomicMax(reinterpret_cast<int*>(out), best);
  }
}

// max |dlse| over [Hq, total] (deterministic mode), as row_bound_kernel
__global__ void dlse_bound_kernel(const HeadTensor<const float> dlse, int heads, int64_t total, float* out) {
  int m = 0;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < total * heads; r += int64_t(gridDim.x) * blockDim.x)
    m = max(m, __float_as_int(fabsf(*dlse.at(int(r / total), r % total))));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffff, m, off));
  if (threadIdx.x % 32 == 0) atomicMax(reinterpret_cast<int*>(out), m);
}

// The units of the tensors with one unit (bwd_params.cuh), from the bounds of sum |c| over every
// contribution to one element (sums over rows use sum_u P_tu <= 1 per query row, and at most
// gkv * L query rows (t, h) reach a key: gkv = Hq / Hkv heads, L = the longest sequence):
//   dqp: sum_u dz_tu Kp_u, dz = g (s - t), sum_u s, sum_u t <= 1      -> 2 |g| max|Kp|
//   dk:  sum_t dS_tu Q_t, |dS_tu| <= P_tu (|dO_t| |V_u| + |D_t|), |D_t| <= |dO_t| max|V_u| + |dlse|
//                                                                      -> max|Q| gkv L (2 max|dO| max|V| + max|dlse|)
//   dv:  sum_t P_tu dO_t                                               -> max|dO el| gkv L
//   dkp: sum_t dz_tu Qp_t over the gp = Hp / Hpk proxy heads            -> 2 |g| max|Qp| gp L
__global__ void fix_units_kernel(float* fix, const float* dkl, float gkv_l, float gp_l) {
  // without a kl gradient the proxy sums stay zero (no adds): unit 1, so they convert to exact
  // zeros even when qp or kp holds a non-finite value (as in the default mode)
  const bool grads = dkl != nullptr;
  const float g = grads ? fabsf(*dkl) : 0.f;
  fix[kUnitDqp] = grads ? fixed_unit(2.f * g * fix[kMaxKp]) : 1.f;
  fix[kUnitDk] = fixed_unit(fix[kMaxQ] * gkv_l * (2.f * fix[kMaxDo] * fix[kMaxV] + fix[kMaxDlse]));
  fix[kUnitDv] = fixed_unit(fix[kMaxDoEl] * gkv_l);
  fix[kUnitDkp] = grads ? fixed_unit(2.f * g * fix[kMaxQp] * gp_l) : 1.f;
}

__global__ void block_counts_kernel(const Seqs seqs, int32_t* counts) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= seqs.batch) return;
  int64_t s0, L;
  seqs.get(b, s0, L);
  counts[b] = int32_t((L + kBlockKeys - 1) / kBlockKeys);
}

__device__ __forceinline__ int seq_of_token(const Seqs& seqs, int64_t t) {
  if (!seqs.cu_seqlens) return int(t / seqs.seqlen);
  int lo = 0, hi = seqs.batch;  // cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (seqs.cu_seqlens[mid] <= t) lo = mid;
    else hi = mid;
  }
  return lo;
}

// keys[(p * total + t) * topk + s] = p * nblk + blk_off[b] + j for a slot that contributes keys
// (0 <= j <= l(t), and the first slot of the row holding j), else the sentinel Hp * nblk;
// values = t. A repeated block (SPEC forbids them; only the opt-in validation reports them on the
// GPU) thus counts once, as in the forward, which walks the row's set of blocks.
__global__ void inversion_keys_kernel(const InversionArgs a, const int32_t* blk_off, uint32_t* keys,
                                      int32_t* vals) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n = int64_t(a.Hp) * a.total * a.topk;
  if (e >= n) return;
  const int s = int(e % a.topk);
  const int64_t t = (e / a.topk) % a.total;
  const int p = int(e / (int64_t(a.topk) * a.total));
  int b;
  int64_t pos, L;
  if (a.seqs.cuq) {  // query segments: the row's segment names its key sequence and first position
    const int sg = seq_of_token(query_seqs(a.seqs), t);
    const QueryUnit u = query_unit(a.seqs, sg);
    b = u.b, L = u.L, pos = t - u.qrow0;
  } else {
    b = seq_of_token(a.seqs, t);
    int64_t s0;
    a.seqs.get(b, s0, L);
    pos = t - s0;
  }
  const int32_t* row = a.indices.at(p, t);
  const int64_t j = row[s];
  // the row inside its sequence: always, unless the guard emptied every sequence (a cu_seqlens or segments fault)
  bool ok = pos >= 0 && pos < L && j >= 0 && j <= pos / kBlockKeys;
  for (int s2 = 0; ok && s2 < s; ++s2) ok = row[s2] != j;
  keys[e] = ok ? uint32_t(int64_t(p) * a.nblk + blk_off[b] + j) : uint32_t(int64_t(a.Hp) * a.nblk);
  vals[e] = int32_t(t);
}

__global__ void query_rows_kernel(const Seqs q, int64_t total_q, int32_t* qpos, int32_t* qpad) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= total_q) return;
  const int sg = seq_of_token(query_seqs(q), t);
  const int64_t first = q.cuq[sg];
  const bool in = t >= first && t < q.cuq[sg + 1];  // (false only where the guard emptied the segments)
  qpos[t] = in ? int32_t(q.qorigin[2 * sg + 1] + (t - first)) : 0;
  qpad[t] = in ? int32_t(padded_offset(first, sg, kPadTile) + (t - first)) : 0;
}

// offsets[k] = first position of key >= k in the sorted keys, k in [0, Hp * nblk]
__global__ void inversion_offsets_kernel(const uint32_t* keys, int64_t n, int64_t nkeys, int32_t* offsets) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k > nkeys) return;
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (int64_t(keys[mid]) < k) lo = mid + 1;
    else hi = mid;
  }
  offsets[k] = int32_t(lo);
}

// A convert thread's 8 elements: 16 threads per (token, head) row of a [total, heads, 128]
// accumulator, grid (tokens / 16, heads, sequences) (launch_convert*). False past the sequence.
struct ConvertSite {
  int64_t i, s0, t;  // token in its sequence, the sequence's start, global token
  int h, b, d;       // head, sequence, first column
};
__device__ __forceinline__ bool convert_site(const Seqs& seqs, ConvertSite& c) {
  c.i = int64_t(blockIdx.x) * (blockDim.x / 16) + threadIdx.x / 16;
  c.h = blockIdx.y, c.b = blockIdx.z;
  int64_t L;
  seqs.get(c.b, c.s0, L);
  if (c.i >= L) return false;
  c.t = c.s0 + c.i;
  c.d = (threadIdx.x % 16) * 8;
  return true;
}
inline dim3 convert_grid(int64_t max_seqlen, int heads, int batch) {
  return dim3(unsigned((max_seqlen + 15) / 16), heads, batch);
}

// out = scale * acc in the output dtype, 8 columns per thread. unit_heads > 0: dq_acc after the main backward
// (bwd_params.cuh, dq_swizzle), whose (token t, head h) row has its columns XOR-swizzled by
// s = dq_swizzle(t, h mod unit_heads, unit_rp), a multiple of 8, so logical columns d .. d + 7 (d a multiple of 8) sit
// in the aligned block d ^ s; 0 for every other accumulator (no swizzle).
template <class Element>
__global__ void convert_kernel(const float* acc, TokenTensor<void> out, Seqs seqs, int heads, float scale,
                               DqLayout dq) {
  ConvertSite c;
  if (!convert_site(seqs, c)) return;
  const int s = dq.unit_heads > 0 ? dq_swizzle(c.t, c.h % dq.unit_heads, dq.unit_rp) : 0;
  const float* src = acc + (c.t * heads + c.h) * kHeadDimInst + (c.d ^ s);
  Element* dst = out.template row<Element>(c.b, c.t, c.h) + c.d;
  float4 x0 = make_float4(0.f, 0.f, 0.f, 0.f), x1 = x0;
  // (a store-first row group that no contribution reached holds the workspace's bytes: zeros instead)
  if (!dq.words || uint32_t(dq.words[(c.h / dq.unit_heads) * dq.total + c.t]) != 0)
    x0 = *reinterpret_cast<const float4*>(src), x1 = *reinterpret_cast<const float4*>(src + 4);
  alignas(16) Element v[8] = {Element(x0.x * scale), Element(x0.y * scale), Element(x0.z * scale), Element(x0.w * scale),
                              Element(x1.x * scale), Element(x1.y * scale), Element(x1.z * scale), Element(x1.w * scale)};
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v);
}

// the fixed-point accumulators (deterministic mode): value = acc / unit, exact in double up to 2^53
// (32-bit accumulators hold pairs of elements in 64-bit words: pack_pair32)
template <class Element, class Acc>
__global__ void convert_fixed_kernel(const Acc* acc, TokenTensor<void> out, Seqs seqs, int heads, float scale,
                                     const float* unit, int64_t padded_stride, const int32_t* bad) {
  ConvertSite c;
  if (!convert_site(seqs, c)) return;
  const float u = padded_stride ? unit[c.h * padded_stride + padded_offset(c.s0, c.b, kPadTile) + c.i] : *unit;
  const double f = *bad ? double(NAN) : double(scale) / double(u);
  const Acc* src = acc + (c.t * heads + c.h) * kHeadDimInst + c.d;
  Element* dst = out.template row<Element>(c.b, c.t, c.h) + c.d;
  alignas(16) Element v[8];
  if constexpr (sizeof(Acc) == 4) {  // 32-bit elements added in pairs (pack_pair32)
    const unsigned long long* w = reinterpret_cast<const unsigned long long*>(src);
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      int32_t lo, hi;
      unpack_pair32(w[e / 2], lo, hi);
      v[e] = Element(float(double(lo) * f));
      v[e + 1] = Element(float(double(hi) * f));
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = Element(float(double(src[e]) * f));
  }
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v);
}

// kl = (sum of the partials, in a fixed order) * scale, written as fp32
__global__ void kl_reduce_kernel(const float* partials, int64_t n, double scale, float* out) {
  __shared__ double part[256];
  double acc = 0;
  for (int64_t x = threadIdx.x; x < n; x += 256) acc += partials[x];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int half = 128; half > 0; half >>= 1) {
    if (int(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = float(part[0] * scale);
}

size_t align_up(size_t n) { return (n + 255) & ~size_t(255); }

struct InvLayout {
  size_t keys_in, keys_out, vals_in, vals_out, offsets, blk_off, counts, scan_tmp, sort_tmp, total;
};

InvLayout inv_layout(const InversionArgs& a) {
  const int64_t n = int64_t(a.Hp) * a.total * a.topk;
  InvLayout l{};
  size_t scan_bytes = 0, sort_bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                a.seqs.batch + 1);
  const int end_bit = 1 + int(std::log2(double(int64_t(a.Hp) * a.nblk + 1)) + 1);
  cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n, 0, end_bit);
  size_t off = 0;
  auto take = [&](size_t bytes) { const size_t o = off; off += align_up(bytes); return o; };
  l.keys_in = take(size_t(n) * 4);
  l.keys_out = take(size_t(n) * 4);
  l.vals_in = take(size_t(n) * 4);
  l.vals_out = take(size_t(n) * 4);
  l.offsets = take((size_t(a.Hp) * a.nblk + 1) * 4);
  l.blk_off = take(size_t(a.seqs.batch + 1) * 4);
  l.counts = take(size_t(a.seqs.batch + 1) * 4);
  l.scan_tmp = take(scan_bytes);
  l.sort_tmp = take(sort_bytes);
  l.total = off;
  return l;
}

}  // namespace

template <Dtype D>
void launch_preprocess(const PreprocessArgs& a, cudaStream_t st) {
  if (a.seqs.batch == 0 || a.max_seqlen == 0) return;
  dim3 grid(unsigned((a.max_seqlen + kPreTokens - 1) / kPreTokens), a.Hq, a.seqs.batch);
  preprocess_kernel<typename ElementOf<D>::type><<<grid, 256, 0, st>>>(a);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

size_t blk_off_workspace(int batch) {
  size_t scan_bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                batch + 1);
  return align_up(size_t(batch + 1) * 4) * 2 + align_up(scan_bytes);
}

const int32_t* build_blk_off(const Seqs& seqs, void* ws, cudaStream_t st) {
  char* base = static_cast<char*>(ws);
  int32_t* counts = reinterpret_cast<int32_t*>(base);
  int32_t* blk_off = reinterpret_cast<int32_t*>(base + align_up(size_t(seqs.batch + 1) * 4));
  void* tmp = base + 2 * align_up(size_t(seqs.batch + 1) * 4);
  size_t scan_bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, counts, blk_off, seqs.batch + 1);
  FLASHMSA_CUDA_CHECK(cudaMemsetAsync(counts, 0, size_t(seqs.batch + 1) * 4, st));
  if (seqs.batch > 0) block_counts_kernel<<<(seqs.batch + 255) / 256, 256, 0, st>>>(seqs, counts);
  FLASHMSA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(tmp, scan_bytes, counts, blk_off, seqs.batch + 1, st));
  return blk_off;
}

size_t inversion_workspace(const InversionArgs& a) { return inv_layout(a).total; }

Inversion build_inversion(const InversionArgs& a, void* ws, cudaStream_t st) {
  const InvLayout l = inv_layout(a);
  char* base = static_cast<char*>(ws);
  auto* keys_in = reinterpret_cast<uint32_t*>(base + l.keys_in);
  auto* keys_out = reinterpret_cast<uint32_t*>(base + l.keys_out);
  auto* vals_in = reinterpret_cast<int32_t*>(base + l.vals_in);
  auto* vals_out = reinterpret_cast<int32_t*>(base + l.vals_out);
  auto* offsets = reinterpret_cast<int32_t*>(base + l.offsets);
  auto* blk_off = reinterpret_cast<int32_t*>(base + l.blk_off);
  auto* counts = reinterpret_cast<int32_t*>(base + l.counts);
  // blk_off: exclusive scan of the per-sequence block counts
  size_t scan_bytes = l.sort_tmp - l.scan_tmp;
  FLASHMSA_CUDA_CHECK(cudaMemsetAsync(counts, 0, size_t(a.seqs.batch + 1) * 4, st));
  if (a.seqs.batch > 0) block_counts_kernel<<<(a.seqs.batch + 255) / 256, 256, 0, st>>>(a.seqs, counts);
  FLASHMSA_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(base + l.scan_tmp, scan_bytes, counts, blk_off, a.seqs.batch + 1, st));
  const int64_t n = int64_t(a.Hp) * a.total * a.topk;
  if (n > 0) {
    inversion_keys_kernel<<<unsigned((n + 255) / 256), 256, 0, st>>>(a, blk_off, keys_in, vals_in);
    FLASHMSA_CUDA_CHECK(cudaGetLastError());
    size_t sort_bytes = l.total - l.sort_tmp;
    const int end_bit = 1 + int(std::log2(double(int64_t(a.Hp) * a.nblk + 1)) + 1);
    FLASHMSA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + l.sort_tmp, sort_bytes, keys_in, keys_out, vals_in,
                                                        vals_out, n, 0, end_bit, st));
  }
  const int64_t nkeys = int64_t(a.Hp) * a.nblk;
  inversion_offsets_kernel<<<unsigned((nkeys + 1 + 255) / 256), 256, 0, st>>>(keys_out, n, nkeys, offsets);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
  Inversion inv;
  inv.tokens = vals_out;
  inv.offsets = offsets;
  inv.blk_off = blk_off;
  inv.nblk = a.nblk;
  return inv;
}

template <Dtype D>
void launch_convert(const float* acc, TokenTensor<void> out, const Seqs& seqs, int64_t max_seqlen, int heads,
                    float scale, cudaStream_t st, DqLayout dq_layout) {
  if (seqs.batch == 0 || max_seqlen == 0) return;
  convert_kernel<typename ElementOf<D>::type><<<convert_grid(max_seqlen, heads, seqs.batch), 256, 0, st>>>(
      acc, out, seqs, heads, scale, dq_layout);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

namespace {
template <Dtype D, class Acc>
void convert_fixed_any(const Acc* acc, TokenTensor<void> out, const Seqs& seqs, int64_t max_seqlen, int heads,
                       float scale, const float* unit, int64_t padded_stride, const int32_t* bad, cudaStream_t st) {
  if (seqs.batch == 0 || max_seqlen == 0) return;
  convert_fixed_kernel<typename ElementOf<D>::type, Acc>
      <<<convert_grid(max_seqlen, heads, seqs.batch), 256, 0, st>>>(acc, out, seqs, heads, scale, unit,
                                                                     padded_stride, bad);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}
}  // namespace

template <Dtype D>
void launch_convert_fixed(const int64_t* acc, TokenTensor<void> out, const Seqs& seqs, int64_t max_seqlen, int heads,
                          float scale, const float* unit, int64_t padded_stride, const int32_t* bad, cudaStream_t st) {
  convert_fixed_any<D>(acc, out, seqs, max_seqlen, heads, scale, unit, padded_stride, bad, st);
}
template <Dtype D>
void launch_convert_fixed32(const int32_t* acc, TokenTensor<void> out, const Seqs& seqs, int64_t max_seqlen, int heads,
                            float scale, const float* unit, int64_t padded_stride, const int32_t* bad, cudaStream_t st) {
  convert_fixed_any<D>(acc, out, seqs, max_seqlen, heads, scale, unit, padded_stride, bad, st);
}

void launch_fix_bounds(const FixInputs& in, float* fix, cudaStream_t st) {
  const int64_t rows = std::max(in.total, in.total_k);
  const unsigned blocks = unsigned(std::min<int64_t>(1024, (rows * std::max(in.Hq, 1) + 7) / 8 + 1));
  auto run = [&](auto* tag, TokenTensor<const void> x, int heads, int64_t total, bool norm, int word) {
    using Element = std::remove_pointer_t<decltype(tag)>;
    if (!x.ptr || total == 0) return;
    row_bound_kernel<Element><<<blocks, 256, 0, st>>>(x, heads, in.seqs, total, norm, fix + word);
    FLASHMSA_CUDA_CHECK(cudaGetLastError());
  };
  auto all = [&](auto* tag) {
    run(tag, in.k, in.Hkv, in.total_k, false, kMaxK);
    run(tag, in.v, in.Hkv, in.total_k, true, kMaxV);
    run(tag, in.kp, in.Hpk, in.total_k, false, kMaxKp);
    run(tag, in.q, in.Hq, in.total, false, kMaxQ);
    run(tag, in.qp, in.Hp, in.total, false, kMaxQp);
    run(tag, in.dout, in.Hq, in.total, true, kMaxDo);
    run(tag, in.dout, in.Hq, in.total, false, kMaxDoEl);
  };
  if (in.dtype == Dtype::kBf16) all(static_cast<cutlass::bfloat16_t*>(nullptr));
  else all(static_cast<cutlass::half_t*>(nullptr));
  if (in.dlse.ptr && in.total > 0) {
    dlse_bound_kernel<<<blocks, 256, 0, st>>>(in.dlse, in.Hq, in.total, fix + kMaxDlse);
    FLASHMSA_CUDA_CHECK(cudaGetLastError());
  }
  const float L = float(in.max_seqlen);
  fix_units_kernel<<<1, 1, 0, st>>>(fix, in.dkl, float(in.Hq / std::max(in.Hkv, 1)) * L,
                                    in.Hpk ? float(in.Hp / in.Hpk) * L : 0.f);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

void launch_query_rows(const Seqs& q, int64_t total_q, int32_t* qpos, int32_t* qpad, cudaStream_t st) {
  if (total_q == 0 || !q.cuq) return;
  query_rows_kernel<<<unsigned((total_q + 255) / 256), 256, 0, st>>>(q, total_q, qpos, qpad);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

void launch_kl_reduce(const float* partials, int64_t n, double scale, float* out, cudaStream_t st) {
  kl_reduce_kernel<<<1, 256, 0, st>>>(partials, n, scale, out);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

template void launch_preprocess<Dtype::kBf16>(const PreprocessArgs&, cudaStream_t);
template void launch_preprocess<Dtype::kFp16>(const PreprocessArgs&, cudaStream_t);
template void launch_convert<Dtype::kBf16>(const float*, TokenTensor<void>, const Seqs&, int64_t, int, float, cudaStream_t,
                                           DqLayout);
template void launch_convert<Dtype::kFp16>(const float*, TokenTensor<void>, const Seqs&, int64_t, int, float, cudaStream_t,
                                           DqLayout);
template void launch_convert_fixed<Dtype::kBf16>(const int64_t*, TokenTensor<void>, const Seqs&, int64_t, int, float,
                                                const float*, int64_t, const int32_t*, cudaStream_t);
template void launch_convert_fixed<Dtype::kFp16>(const int64_t*, TokenTensor<void>, const Seqs&, int64_t, int, float,
                                                const float*, int64_t, const int32_t*, cudaStream_t);
template void launch_convert_fixed32<Dtype::kBf16>(const int32_t*, TokenTensor<void>, const Seqs&, int64_t, int, float,
                                                  const float*, int64_t, const int32_t*, cudaStream_t);
template void launch_convert_fixed32<Dtype::kFp16>(const int32_t*, TokenTensor<void>, const Seqs&, int64_t, int, float,
                                                  const float*, int64_t, const int32_t*, cudaStream_t);

}  // namespace flashmsa::cuda::attn_bwd
