// Host values of the API's storage dtypes as doubles, for the main job's buffers: element
// sizes, loads, and stores that round to the dtype (round to nearest, ties to even, straight
// from the double).
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashmsa/flashmsa.h"

namespace flashmsa::cli {

size_t dtype_size(flashmsa_dtype_t t);
double load_as_double(flashmsa_dtype_t t, const void* base, int64_t offset);
void store_from_double(flashmsa_dtype_t t, void* base, int64_t offset, double x);

// The 16-bit formats, one value at a time.
double bf16_to_double(uint16_t h);
double fp16_to_double(uint16_t h);
uint16_t double_to_bf16(double x);
uint16_t double_to_fp16(double x);

}  // namespace flashmsa::cli
