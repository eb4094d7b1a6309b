#include "cuda/bwd/bwd_misc.cuh"

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cutlass/numeric_types.h>

#include "cuda/common/utils.cuh"

namespace flashmsa::cuda::attn_bwd {

namespace {

template <class T>
__device__ __forceinline__ float to_f(T x) { return float(x); }

// one warp per (token, head): dsum = <dout, out> - dlse, lse2 = lse * log2(e)
template <class Element>
__global__ void preprocess_kernel(const PreprocessArgs a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t i = int64_t(blockIdx.x) * (blockDim.x / 32) + warp;
  const int h = blockIdx.y, b = blockIdx.z;
  int64_t s0, L;
  a.seqs.get(b, s0, L);
  if (i >= L) return;
  const int64_t t = s0 + i;
  float acc = 0.f;
  if (a.dout.ptr) {  // without dout (the forward's kl), only lse2
    const Element* o = a.out.template row<const Element>(b, t, h);
    const Element* g = a.dout.template row<const Element>(b, t, h);
    if (a.out_lo.ptr) {
      const Element* lo = a.out_lo.template row<const Element>(b, t, h);
      for (int e = 0; e < 4; ++e) acc += (to_f(o[lane * 4 + e]) + to_f(lo[lane * 4 + e])) * to_f(g[lane * 4 + e]);
    } else {
      for (int e = 0; e < 4; ++e) acc += to_f(o[lane * 4 + e]) * to_f(g[lane * 4 + e]);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, off);
  if (lane == 0) {
    const int64_t pi = padded_offset(s0, b, kPadTile) + i;
    const float dl = a.dlse.ptr ? *a.dlse.at(h, t) : 0.f;
    if (a.dsum) a.dsum[h * a.padded_stride + pi] = acc - dl;
    a.lse2[h * a.padded_stride + pi] = *a.lse.at(h, t) * kLog2e;
  }
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
  const int b = seq_of_token(a.seqs, t);
  int64_t s0, L;
  a.seqs.get(b, s0, L);
  const int32_t* row = a.indices.at(p, t);
  const int64_t j = row[s];
  // t inside its sequence: always, unless the guard emptied every sequence (cu_seqlens fault)
  bool ok = t - s0 < L && j >= 0 && j <= (t - s0) / kBlockKeys;
  for (int s2 = 0; ok && s2 < s; ++s2) ok = row[s2] != j;
  keys[e] = ok ? uint32_t(int64_t(p) * a.nblk + blk_off[b] + j) : uint32_t(int64_t(a.Hp) * a.nblk);
  vals[e] = int32_t(t);
}

// Deterministic mode: the rank of each sorted entry's block among the valid blocks of its
// (proxy head, token) row, i.e. the entry's turn in that token's dq / dqp sum.
__global__ void inversion_ranks_kernel(const InversionArgs a, const uint32_t* keys, const int32_t* vals,
                                       const int32_t* blk_off, int64_t n, int32_t* ranks) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  const uint32_t key = keys[e];
  if (int64_t(key) >= int64_t(a.Hp) * a.nblk) {  // sentinel (empty slot)
    ranks[e] = 0;
    return;
  }
  const int p = int(key / uint32_t(a.nblk)), gb = int(key % uint32_t(a.nblk));
  const int64_t t = vals[e];
  const int b = seq_of_token(a.seqs, t);
  int64_t s0, L;
  a.seqs.get(b, s0, L);
  const int64_t j = gb - blk_off[b], own = (t - s0) / kBlockKeys;
  const int32_t* row = a.indices.at(p, t);
  int r = 0;  // distinct valid blocks below j (a repeated block is one entry, see the keys kernel)
  for (int s = 0; s < a.topk; ++s) {
    const int64_t v = row[s];
    bool first = v >= 0 && v <= own && v < j;
    for (int s2 = 0; first && s2 < s; ++s2) first = row[s2] != v;
    r += first ? 1 : 0;
  }
  ranks[e] = r;
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

template <class Element>
__global__ void convert_kernel(const float* acc, TokenTensor<void> out, Seqs seqs, int heads, float scale, bool tiled) {
  const int64_t i = int64_t(blockIdx.x) * (blockDim.x / 16) + threadIdx.x / 16;
  const int h = blockIdx.y, b = blockIdx.z;
  int64_t s0, L;
  seqs.get(b, s0, L);
  if (i >= L) return;
  const int64_t t = s0 + i;
  const int d = (threadIdx.x % 16) * 8;
  const float* src = tiled ? acc + dq_tiled_row(t, d / 64, h, heads) + ((d % 64) ^ dq_tiled_swizzle(t, h))
                          : acc + (t * heads + h) * kHeadDimInst + d;
  Element* dst = out.template row<Element>(b, t, h) + d;
  const float4 x0 = *reinterpret_cast<const float4*>(src), x1 = *reinterpret_cast<const float4*>(src + 4);
  alignas(16) Element v[8] = {Element(x0.x * scale), Element(x0.y * scale), Element(x0.z * scale), Element(x0.w * scale),
                              Element(x1.x * scale), Element(x1.y * scale), Element(x1.z * scale), Element(x1.w * scale)};
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
  dim3 grid(unsigned((a.max_seqlen + 7) / 8), a.Hq, a.seqs.batch);
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
  if (a.ranks) {  // into keys_in, free once sorted
    auto* ranks = reinterpret_cast<int32_t*>(keys_in);
    if (n > 0) {
      inversion_ranks_kernel<<<unsigned((n + 255) / 256), 256, 0, st>>>(a, keys_out, vals_out, blk_off, n, ranks);
      FLASHMSA_CUDA_CHECK(cudaGetLastError());
    }
    inv.rank = ranks;
  }
  return inv;
}

template <Dtype D>
void launch_convert(const float* acc, TokenTensor<void> out, const Seqs& seqs, int64_t max_seqlen, int heads,
                    float scale, cudaStream_t st, bool tiled) {
  if (seqs.batch == 0 || max_seqlen == 0) return;
  dim3 grid(unsigned((max_seqlen + 15) / 16), heads, seqs.batch);
  convert_kernel<typename ElementOf<D>::type><<<grid, 256, 0, st>>>(acc, out, seqs, heads, scale, tiled);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

void launch_kl_reduce(const float* partials, int64_t n, double scale, float* out, cudaStream_t st) {
  kl_reduce_kernel<<<1, 256, 0, st>>>(partials, n, scale, out);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

template void launch_preprocess<Dtype::kBf16>(const PreprocessArgs&, cudaStream_t);
template void launch_preprocess<Dtype::kFp16>(const PreprocessArgs&, cudaStream_t);
template void launch_convert<Dtype::kBf16>(const float*, TokenTensor<void>, const Seqs&, int64_t, int, float, cudaStream_t,
                                          bool);
template void launch_convert<Dtype::kFp16>(const float*, TokenTensor<void>, const Seqs&, int64_t, int, float, cudaStream_t,
                                          bool);

}  // namespace flashmsa::cuda::attn_bwd
