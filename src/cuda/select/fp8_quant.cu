// The fp8 selection's quantisation (fp8_quant.h). qp: a group is one row of one proxy head (128 values), one warp
// (4 values a lane); kp: a group is a key block of one proxy key head (up to 128 rows x 128 values), one CTA of 8
// warps, 16 rows each, whose amaxes the CTA combines.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "cuda/common/error.cuh"
#include "cuda/select/fp8_quant.h"

namespace flashmsa::cuda::selection {

namespace {

constexpr int kDim = 128, kBlock = 128;

__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }

// four consecutive 16-bit values (8-byte aligned) as floats
template <class T>
__device__ __forceinline__ float4 load4(const T* p) {
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = to_float2(*reinterpret_cast<const T2*>(&u.x)), b = to_float2(*reinterpret_cast<const T2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

__device__ __forceinline__ bool finite4(float4 v) {
  return isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w);
}
__device__ __forceinline__ float amax4(float4 v) { return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))); }

// four values x inv, e4m3 round to nearest even saturating at 448 (the reference's round_e4m3)
__device__ __forceinline__ uint32_t e4m3x4(float4 v, float inv) {
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v.x * inv, v.y * inv), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v.z * inv, v.w * inv), __NV_SATFINITE, __NV_E4M3);
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

// The group's (amax, finite) -> the multiplier of the stored values and the scale: an all-zero
// group stores zeros with the scale 0, a non-finite one the scale NaN.
__device__ __forceinline__ void group_scale(float amax, bool finite, float& inv, float& scale) {
  if (!finite) {
    inv = 0.f;
    scale = __int_as_float(0x7fc00000);
  } else if (amax == 0.f) {
    inv = 0.f;
    scale = 0.f;
  } else {
    inv = __fdiv_rn(448.f, amax);
    scale = __fdiv_rn(amax, 448.f);
  }
}

// qp: warp w of the CTA quantises row (blockIdx.x * 8 + w) of head blockIdx.y
template <class T>
__global__ void __launch_bounds__(256) quantize_rows(const QuantArgs a, Fp8Copies c) {
  const int lane = threadIdx.x % 32, h = blockIdx.y;
  const int64_t t = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (t >= c.total) return;
  const int b = a.batched ? int(t / a.seqlen) : 0;
  const T* src = a.qp.template row<const T>(b, t, h) + lane * 4;
  const float4 v = load4(src);
  float amax = amax4(v);
  bool finite = finite4(v);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    finite = __all_sync(0xffffffffu, finite);
  }
  float inv, scale;
  group_scale(amax, finite, inv, scale);
  reinterpret_cast<uint32_t*>(c.q8 + (t * a.Hp + h) * kDim)[lane] = e4m3x4(v, inv);
  if (lane == 0) c.qscale[int64_t(h) * c.total + t] = scale;
}

// kp: CTA (block j, head c, key sequence b); 8 warps, each 16 rows of the block
template <class T>
__global__ void __launch_bounds__(256) quantize_blocks(const QuantArgs a, Fp8Copies c) {
  __shared__ float s_amax[8];
  __shared__ int s_finite[8];
  const int j = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  int64_t s0, len;
  a.keys.get(b, s0, len);
  if (int64_t(j) * kBlock >= len) return;
  const int rows = int(len - int64_t(j) * kBlock < kBlock ? len - int64_t(j) * kBlock : kBlock);
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
  const int64_t r0 = s0 + int64_t(j) * kBlock;
  float4 v[16];
  float amax = 0.f;
  bool finite = true;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int r = w * 16 + k;
    v[k] = r < rows ? load4(a.kp.template row<const T>(a.batched ? b : 0, r0 + r, h) + lane * 4)
                    : make_float4(0.f, 0.f, 0.f, 0.f);
    amax = fmaxf(amax, amax4(v[k]));
    finite = finite && finite4(v[k]);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  finite = __all_sync(0xffffffffu, finite);
  if (lane == 0) {
    s_amax[w] = amax;
    s_finite[w] = finite;
  }
  __syncthreads();
  amax = s_amax[0];
  finite = s_finite[0];
#pragma unroll
  for (int k = 1; k < 8; ++k) {
    amax = fmaxf(amax, s_amax[k]);
    finite = finite && s_finite[k];
  }
  float inv, scale;
  group_scale(amax, finite, inv, scale);
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int r = w * 16 + k;
    if (r < rows) reinterpret_cast<uint32_t*>(c.k8 + ((r0 + r) * a.Hpk + h) * kDim)[lane] = e4m3x4(v[k], inv);
  }
  if (threadIdx.x == 0) c.kscale[int64_t(h) * c.total_k + r0] = scale;
}

template <class T>
void launch(const QuantArgs& a, const Fp8Copies& c, cudaStream_t st) {
  if (c.total > 0) {
    quantize_rows<T><<<dim3(unsigned((c.total + 7) / 8), unsigned(a.Hp)), 256, 0, st>>>(a, c);
    FLASHMSA_CUDA_CHECK(cudaGetLastError());
  }
  if (c.total_k > 0 && a.max_blocks > 0) {
    quantize_blocks<T><<<dim3(unsigned(a.max_blocks), unsigned(a.Hpk), unsigned(a.keys.batch)), 256, 0, st>>>(a, c);
    FLASHMSA_CUDA_CHECK(cudaGetLastError());
  }
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

void quantize_fp8(Dtype src, const QuantArgs& a, const Fp8Copies& c, cudaStream_t st) {
  if (src == Dtype::kBf16) launch<__nv_bfloat16>(a, c, st);
  else launch<__half>(a, c, st);
}

size_t fp8_copies_bytes(int64_t total, int64_t total_k, int Hp, int Hpk) {
  return align256(size_t(total) * Hp * kDim) + align256(size_t(total_k) * Hpk * kDim) +
         align256(size_t(total) * Hp * 4) + align256(size_t(total_k) * Hpk * 4);
}

Fp8Copies fp8_copies_at(void* ws, int64_t total, int64_t total_k, int Hp, int Hpk) {
  char* p = static_cast<char*>(ws);
  Fp8Copies c;
  c.total = total;
  c.total_k = total_k;
  c.q8 = reinterpret_cast<uint8_t*>(p);
  p += align256(size_t(total) * Hp * kDim);
  c.k8 = reinterpret_cast<uint8_t*>(p);
  p += align256(size_t(total_k) * Hpk * kDim);
  c.qscale = reinterpret_cast<float*>(p);
  p += align256(size_t(total) * Hp * 4);
  c.kscale = reinterpret_cast<float*>(p);
  return c;
}

}  // namespace flashmsa::cuda::selection
