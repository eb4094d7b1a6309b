// Host-side conversions between the storage dtypes of the API and double.
// Rounding is round-to-nearest-even, decided directly from the double (no double rounding).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flashmsa/flashmsa.h"

namespace flashmsa {

inline size_t dtype_size(flashmsa_dtype_t t) {
  switch (t) {
    case FLASHMSA_DTYPE_BF16:
    case FLASHMSA_DTYPE_FP16: return 2;
    case FLASHMSA_DTYPE_FP32:
    case FLASHMSA_DTYPE_INT32: return 4;
    case FLASHMSA_DTYPE_FP64: return 8;
  }
  return 0;
}

inline float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

inline double bf16_to_double(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline double fp16_to_double(uint16_t h) {
  const int sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v;
  if (exp == 0) v = std::ldexp(double(man), -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = std::ldexp(double(man | 0x400), exp - 25);
  return sign ? -v : v;
}

// Generic round-to-nearest-even of a double to a 16-bit format, given its decoder and the
// bit pattern of the truncation (toward zero) of |x|. Candidates: trunc and trunc + 1 ulp.
template <class Decode>
inline uint16_t round_pick(double x, uint16_t sign_bit, uint16_t trunc_bits, Decode decode) {
  const double ax = std::fabs(x);
  const uint16_t lo = trunc_bits, hi = uint16_t(trunc_bits + 1);
  const double dlo = ax - decode(lo), dhi = decode(hi) - ax;
  uint16_t r;
  if (dlo < dhi) r = lo;
  else if (dhi < dlo) r = hi;
  else r = (lo & 1) ? hi : lo;
  return uint16_t(r | sign_bit);
}

inline uint16_t double_to_bf16(double x) {
  if (std::isnan(x)) return 0x7fc0;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double ax = std::fabs(x);
  if (ax >= 3.3961775292304e38 /* > max bf16 + half ulp */) return uint16_t(sign | 0x7f80);
  // truncation of |x| to bf16: truncate to float toward zero first (exact for bf16 purposes)
  float f = float(ax);
  if (double(f) > ax) f = std::nextafter(f, 0.0f);
  const uint16_t tb = uint16_t(float_to_bits(f) >> 16);
  if (tb >= 0x7f7f) {  // at or above the largest finite bf16
    const double maxv = bf16_to_double(0x7f7f);
    return uint16_t(sign | (ax - maxv >= bf16_to_double(0x7f80) - maxv ? 0x7f80 : 0x7f7f));
  }
  return round_pick(x, sign, tb, [](uint16_t b) { return bf16_to_double(b); });
}

inline uint16_t double_to_fp16(double x) {
  if (std::isnan(x)) return 0x7e00;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double ax = std::fabs(x);
  if (ax >= 65520.0) return uint16_t(sign | 0x7c00);  // rounds to inf
  uint16_t tb;
  if (ax < std::ldexp(1.0, -14)) {
    tb = uint16_t(std::floor(std::ldexp(ax, 24)));  // subnormal: units of 2^-24
  } else {
    int e;
    const double m = std::frexp(ax, &e);  // ax = m * 2^e, m in [0.5, 1)
    const int exp = e - 1 + 15;           // biased exponent
    const uint16_t man = uint16_t(std::floor(std::ldexp(m, 11)) - 1024);
    tb = uint16_t((exp << 10) | man);
  }
  if (tb >= 0x7bff) return uint16_t(sign | 0x7bff);
  return round_pick(x, sign, tb, [](uint16_t b) { return fp16_to_double(b); });
}

// Round a double to what the dtype can hold (the value a kernel would store), as a double.
inline double round_to(flashmsa_dtype_t t, double x) {
  switch (t) {
    case FLASHMSA_DTYPE_BF16: return bf16_to_double(double_to_bf16(x));
    case FLASHMSA_DTYPE_FP16: return fp16_to_double(double_to_fp16(x));
    case FLASHMSA_DTYPE_FP32: return double(float(x));
    default: return x;
  }
}

inline double load_as_double(flashmsa_dtype_t t, const void* base, int64_t offset) {
  switch (t) {
    case FLASHMSA_DTYPE_BF16: return bf16_to_double(static_cast<const uint16_t*>(base)[offset]);
    case FLASHMSA_DTYPE_FP16: return fp16_to_double(static_cast<const uint16_t*>(base)[offset]);
    case FLASHMSA_DTYPE_FP32: return static_cast<const float*>(base)[offset];
    case FLASHMSA_DTYPE_FP64: return static_cast<const double*>(base)[offset];
    case FLASHMSA_DTYPE_INT32: return static_cast<const int32_t*>(base)[offset];
  }
  return NAN;
}

inline void store_from_double(flashmsa_dtype_t t, void* base, int64_t offset, double x) {
  switch (t) {
    case FLASHMSA_DTYPE_BF16: static_cast<uint16_t*>(base)[offset] = double_to_bf16(x); break;
    case FLASHMSA_DTYPE_FP16: static_cast<uint16_t*>(base)[offset] = double_to_fp16(x); break;
    case FLASHMSA_DTYPE_FP32: static_cast<float*>(base)[offset] = float(x); break;
    case FLASHMSA_DTYPE_FP64: static_cast<double*>(base)[offset] = x; break;
    case FLASHMSA_DTYPE_INT32: static_cast<int32_t*>(base)[offset] = int32_t(x); break;
  }
}

}  // namespace flashmsa
