#include "cli_dtype.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace flashmsa::cli {

namespace {

// |x| (finite, >= 0) rounded to a binary format with `mant` stored mantissa bits and smallest
// normal exponent `emin` (below it: subnormal steps of 2^(emin - mant)), to nearest, ties to
// even. The result may be the next power of two; overflow is the caller's to detect.
double round_to_format(double ax, int mant, int emin) {
  if (ax == 0) return ax;
  int e = 0;
  std::frexp(ax, &e);  // ax = m * 2^e, m in [0.5, 1): leading bit 2^(e - 1)
  const int step = std::max(e - 1, emin) - mant;
  // ax / 2^step is exact (a power-of-two scaling into range); std::nearbyint rounds half to
  // even in the default rounding mode.
  return std::ldexp(std::nearbyint(std::ldexp(ax, -step)), step);
}

uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

float bits_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

constexpr double kBf16Max = 3.3895313892515355e38;  // (2 - 2^-7) * 2^127
constexpr double kFp16Max = 65504.0;                // (2 - 2^-10) * 2^15

}  // namespace

double bf16_to_double(uint16_t h) { return bits_float(uint32_t(h) << 16); }

double fp16_to_double(uint16_t h) {
  const int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v;
  if (exp == 0) v = std::ldexp(double(man), -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = std::ldexp(double(man | 0x400), exp - 25);
  return (h & 0x8000) ? -v : v;
}

uint16_t double_to_bf16(double x) {
  if (std::isnan(x)) return 0x7fc0;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double r = std::isinf(x) ? INFINITY : round_to_format(std::fabs(x), 7, -126);
  if (r > kBf16Max) return uint16_t(sign | 0x7f80);
  // r is a bf16 value, so the float holds it exactly and its upper half is the bf16
  return uint16_t(sign | (float_bits(float(r)) >> 16));
}

uint16_t double_to_fp16(double x) {
  if (std::isnan(x)) return 0x7e00;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double r = std::isinf(x) ? INFINITY : round_to_format(std::fabs(x), 10, -14);
  if (r > kFp16Max) return uint16_t(sign | 0x7c00);
  if (r < std::ldexp(1.0, -14)) return uint16_t(sign | uint16_t(std::ldexp(r, 24)));  // subnormal
  int e = 0;
  const double m = std::frexp(r, &e);  // r = m * 2^e, m in [0.5, 1)
  const int exp = e - 1 + 15;          // biased exponent
  const int man = int(std::ldexp(m, 11)) - 1024;
  return uint16_t(sign | (exp << 10) | man);
}

size_t dtype_size(flashmsa_dtype_t t) {
  switch (t) {
    case FLASHMSA_DTYPE_BF16:
    case FLASHMSA_DTYPE_FP16: return 2;
    case FLASHMSA_DTYPE_FP32:
    case FLASHMSA_DTYPE_INT32: return 4;
    case FLASHMSA_DTYPE_FP64: return 8;
  }
  return 0;
}

double load_as_double(flashmsa_dtype_t t, const void* base, int64_t offset) {
  switch (t) {
    case FLASHMSA_DTYPE_BF16: return bf16_to_double(static_cast<const uint16_t*>(base)[offset]);
    case FLASHMSA_DTYPE_FP16: return fp16_to_double(static_cast<const uint16_t*>(base)[offset]);
    case FLASHMSA_DTYPE_FP32: return static_cast<const float*>(base)[offset];
    case FLASHMSA_DTYPE_FP64: return static_cast<const double*>(base)[offset];
    case FLASHMSA_DTYPE_INT32: return static_cast<const int32_t*>(base)[offset];
  }
  return NAN;
}

void store_from_double(flashmsa_dtype_t t, void* base, int64_t offset, double x) {
  switch (t) {
    case FLASHMSA_DTYPE_BF16: static_cast<uint16_t*>(base)[offset] = double_to_bf16(x); break;
    case FLASHMSA_DTYPE_FP16: static_cast<uint16_t*>(base)[offset] = double_to_fp16(x); break;
    case FLASHMSA_DTYPE_FP32: static_cast<float*>(base)[offset] = float(x); break;
    case FLASHMSA_DTYPE_FP64: static_cast<double*>(base)[offset] = x; break;
    case FLASHMSA_DTYPE_INT32: static_cast<int32_t*>(base)[offset] = int32_t(x); break;
  }
}

}  // namespace flashmsa::cli
