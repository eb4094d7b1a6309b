// 2^x on the FMA pipe (FlashAttention-4 splits the softmax's exps between MUFU and the FMA units),
// for x <= ~0: x rounded to the nearest integer j by the 1.5 * 2^23 shift (the sum's low bits hold
// j + 127), 2^(x - j) by a degree-5 polynomial on [-0.5, 0.5] (max relative error 2.0e-7 in fp32
// Horner, as ex2.approx's), times 2^j made from those bits. x is clamped at -126 with NaN kept, so
// -inf gives 2^-126 (not 0) and NaN stays NaN (through the multiply). On the GPU: one FMNMX.NAN,
// 3 FADD, 5 FFMA, an FMUL and a shift, where MUFU.EX2 runs at 16 per clock and SM (FMA: 128).
// Plain C++ on the host, so that the CPU tests check the same arithmetic (tests/cpu/test_exp2_poly.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FLASHMSA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASHMSA_HOST_DEVICE inline
#endif

namespace flashmsa::cuda {

FLASHMSA_HOST_DEVICE float exp2f_poly(float x) {
  float xc;
#if defined(__CUDA_ARCH__)
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(xc) : "f"(x), "f"(-126.f));
#else
  xc = x != x ? x : (x < -126.f ? -126.f : x);
#endif
  constexpr float kShift = 12582912.f + 127.f;  // 1.5 * 2^23 + the exponent bias
  const float t = xc + kShift;
  const float f = xc - (t - kShift);
  float p = 1.32823037e-3f;
  p = fmaf(p, f, 9.67559032e-3f);
  p = fmaf(p, f, 5.55069521e-2f);
  p = fmaf(p, f, 2.40221187e-1f);
  p = fmaf(p, f, 6.93147004e-1f);
  p = fmaf(p, f, 1.00000012f);
#if defined(__CUDA_ARCH__)
  return p * __int_as_float(__float_as_int(t) << 23);
#else
  uint32_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  bits <<= 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
#endif
}

}  // namespace flashmsa::cuda

#undef FLASHMSA_HOST_DEVICE
