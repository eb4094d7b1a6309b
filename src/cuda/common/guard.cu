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
__global__ void __launch_bounds__(kCheckThreads) check_kernel(const CheckArgs a, int32_t* fault, int32_t* safe) {
  __shared__ int s_bits, s_first;
  if (threadIdx.x == 0) {
    s_bits = 0;
    s_first = INT_MAX;
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
  const int all = s_bits;
  for (int b = threadIdx.x; b <= a.batch; b += blockDim.x) safe[b] = all ? 0 : a.cu[int64_t(b) * a.cu_stride];
  if (threadIdx.x == 0) {
    *fault = all;
    if (all && a.status) {  // one writer per call; calls on one stream are ordered
      volatile int32_t* w = a.status;
      w[kFaults] |= all;
      w[kOps] |= a.op;
      w[kCalls] += 1;
      if (w[kFirstPos] == 0) {
        const int b = s_first;
        w[kFirstPos] = b + 1;
        w[kValue] = a.cu[int64_t(b) * a.cu_stride];
        w[kNext] = b < a.batch ? a.cu[int64_t(b + 1) * a.cu_stride] : 0;
        w[kTotal] = clamp32(a.total);
        w[kMaxSeqlen] = clamp32(a.max_seqlen);
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

size_t workspace(int batch) { return align_up(sizeof(int32_t)) + align_up(size_t(batch + 1) * sizeof(int32_t)); }

const int32_t* fault_word(const void* ws) { return static_cast<const int32_t*>(ws); }

const int32_t* launch_check(const CheckArgs& a, void* ws, cudaStream_t st) {
  auto* fault = static_cast<int32_t*>(ws);
  auto* safe = reinterpret_cast<int32_t*>(static_cast<char*>(ws) + align_up(sizeof(int32_t)));
  check_kernel<<<1, kCheckThreads, 0, st>>>(a, fault, safe);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
  return safe;
}

void launch_poison(const PoisonArgs& a, cudaStream_t st) {
  if (a.n == 0) return;
  constexpr int kThreads = 256, kBlocks = 264;  // 2 per SM of an H100/H200: a fill at full bandwidth
  poison_kernel<<<kBlocks, kThreads, 0, st>>>(a);
  FLASHMSA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashmsa::cuda::guard
