// The metadata guard's two kernels (guard.cuh says what they are for).
#include "cuda/common/guard.cuh"

#include <climits>

#include "cuda/common/error.cuh"

namespace flashmsa::cuda::guard {

namespace {

constexpr int kCheckThreads = 1024;
constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

__host__ __device__ int32_t clamp32(int64_t x) { return int32_t(x > INT32_MAX ? INT32_MAX : x); }

// One CTA: every position b of cu_seqlens is checked (values read once, as 64-bit), the faults
// OR-ed and the first faulting position found; then the safe copy is written (the values, or
// zeros on any fault) and, on a fault, the caller's status words.
// Query segments (a.segments >= 0) are checked after cu_seqlens (their key sequences' lengths come
// from it; with a faulty cu_seqlens they are not looked at): any fault zeroes every safe copy, so
// every segment and every sequence is empty. The status words describe the first fault of
// cu_seqlens, else the first faulting segment s (1 + s, cu_seqlens_q[s], cu_seqlens_q[s + 1],
// total_q, max_seqlen_q).
__global__ void __launch_bounds__(kCheckThreads) check_kernel(const CheckArgs a, int32_t* fault, int32_t* safe,
                                                              int32_t* safe_q, int32_t* safe_origin) {
  __shared__ int s_bits, s_first, s_seg_first;
  if (threadIdx.x == 0) {
    s_bits = 0;
    s_first = INT_MAX;
    s_seg_first = INT_MAX;
  }
  __syncthreads();
  int bits = 0, first = INT_MAX;
  for (int b = threadIdx.x; b <= a.batch; b += blockDim.x) {
    const int64_t x = a.cu[int64_t(b) * a.cu_stride];
    int f = 0;
    if (b == 0 && x != 0) f |= kFirstNotZero;
    if (x < 0) f |= kNegative;
    if (x > a.total) f |= kAboveTotal;
    if (b == a.batch && x != a.total) f |= kLastNotTotal;
    if (b < a.batch) {
      const int64_t y = a.cu[int64_t(b + 1) * a.cu_stride];
      if (y < x) f |= kDecreasing;
      else if (y - x > a.max_seqlen) f |= kAboveMaxSeqlen;
    }
    if (f) {
      bits |= f;
      first = min(first, b);
    }
  }
  if (bits) {
    atomicOr(&s_bits, bits);
    atomicMin(&s_first, first);
  }
  __syncthreads();
  if (a.segments >= 0 && s_bits == 0) {
    int seg_first = INT_MAX;
    for (int s = threadIdx.x; s <= a.segments; s += blockDim.x) {
      const int64_t x = a.cuq[int64_t(s) * a.cuq_stride];
      bool bad = (s == 0 && x != 0) || x < 0 || x > a.total_q || (s == a.segments && x != a.total_q);
      if (s < a.segments) {
        const int64_t y = a.cuq[int64_t(s + 1) * a.cuq_stride];
        const int64_t b = a.origin[int64_t(s) * a.origin_stride0], p0 = a.origin[int64_t(s) * a.origin_stride0 + a.origin_stride1];
        bad = bad || y < x || y - x > a.max_seqlen_q || b < 0 || b >= a.batch || p0 < 0;
        if (!bad) {
          const int64_t len_k = int64_t(a.cu[(b + 1) * a.cu_stride]) - a.cu[b * a.cu_stride];
          bad = p0 + (y - x) > len_k;
        }
      }
      if (bad) seg_first = min(seg_first, s);
    }
    if (seg_first != INT_MAX) {
      atomicOr(&s_bits, kSegments);
      atomicMin(&s_seg_first, seg_first);
    }
    __syncthreads();
  }
  const int all = s_bits;
  for (int b = threadIdx.x; b <= a.batch; b += blockDim.x) safe[b] = all ? 0 : a.cu[int64_t(b) * a.cu_stride];
  if (a.segments >= 0) {
    for (int s = threadIdx.x; s <= a.segments; s += blockDim.x) safe_q[s] = all ? 0 : a.cuq[int64_t(s) * a.cuq_stride];
    for (int s = threadIdx.x; s < a.segments; s += blockDim.x) {
      safe_origin[2 * s] = all ? 0 : a.origin[int64_t(s) * a.origin_stride0];
      safe_origin[2 * s + 1] = all ? 0 : a.origin[int64_t(s) * a.origin_stride0 + a.origin_stride1];
    }
  }
  if (threadIdx.x == 0) {
    *fault = all;
    if (all && a.status) {  // one writer per call; calls on one stream are ordered
      volatile int32_t* w = a.status;
      w[kFaults] |= all;
      w[kOps] |= a.op;
      w[kCalls] += 1;
      if (w[kFirstPos] == 0) {
        if (s_first != INT_MAX) {
          const int b = s_first;
          w[kFirstPos] = b + 1;
          w[kValue] = a.cu[int64_t(b) * a.cu_stride];
          w[kNext] = b < a.batch ? a.cu[int64_t(b + 1) * a.cu_stride] : 0;
          w[kTotal] = clamp32(a.total);
          w[kMaxSeqlen] = clamp32(a.max_seqlen);
        } else {
          const int s = s_seg_first;
          w[kFirstPos] = s + 1;
          w[kValue] = a.cuq[int64_t(s) * a.cuq_stride];
          w[kNext] = s < a.segments ? a.cuq[int64_t(s + 1) * a.cuq_stride] : 0;
          w[kTotal] = clamp32(a.total_q);
          w[kMaxSeqlen] = clamp32(a.max_seqlen_q);
        }
      }
      __threadfence_system();
    }
  }
}

__global__ void poison_kernel(const PoisonArgs a) {
  if (*a.fault == 0) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int i = 0; i < a.n; ++i) {
    const Out& o = a.outs[i];
    const int64_t n = o.n0 * o.n1 * o.n2;
    for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
      const int64_t i2 = e % o.n2, r = e / o.n2, i1 = r % o.n1, i0 = r / o.n1;
      const int64_t off = i0 * o.s0 + i1 * o.s1 + i2;
      if (o.bytes == 2) static_cast<uint16_t*>(o.ptr)[off] = uint16_t(o.pattern);
      else static_cast<uint32_t*>(o.ptr)[off] = o.pattern;
    }
  }
}

}  // namespace

size_t workspace(int batch, int segments) {
  size_t n = align_up(sizeof(int32_t)) + align_up(size_t(batch + 1) * sizeof(int32_t));
  if (segments >= 0) n += align_up(size_t(segments + 1) * sizeof(int32_t)) + align_up(size_t(segments) * 2 * sizeof(int32_t));
  return n;
}

const int32_t* fault_word(const void* ws) { return static_cast<const int32_t*>(ws); }

Safe launch_check(const CheckArgs& a, void* ws, cudaStream_t st) {
  char* base = static_cast<char*>(ws);
  auto* fault = reinterpret_cast<int32_t*>(base);
  size_t off = align_up(sizeof(int32_t));
  auto* safe = reinterpret_cast<int32_t*>(base + off);
  off += align_up(size_t(a.batch + 1) * sizeof(int32_t));
  int32_t *safe_q = nullptr, *safe_origin = nullptr;
  if (a.segments >= 0) {
    safe_q = reinterpret_cast<int32_t*>(base + off);
    off += align_up(size_t(a.segments + 1) * sizeof(int32_t));
    safe_origin = reinterpret_cast<int32_t*>(base + off);
  }
  check_kernel<<<1, kCheckThreads, 0, st>>>(a, fault, safe, safe_q, safe_origin);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
  return Safe{safe, safe_q, safe_origin};
}

void launch_poison(const PoisonArgs& a, cudaStream_t st) {
  if (a.n == 0) return;
  constexpr int kThreads = 256, kBlocks = 264;  // 2 per SM of an H100/H200: a fill at full bandwidth
  poison_kernel<<<kBlocks, kThreads, 0, st>>>(a);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashmsa::cuda::guard
