// Minimal reader/writer of numpy .npy files (format version 1.0/2.0, little-endian,
// C order): float32, float64, int32. Used by the main job (--save) and the golden tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace flashmsa::npy {

struct Array {
  std::string descr;             // "<f4", "<f8", "<i4"
  std::vector<int64_t> shape;
  std::vector<double> values;    // every element as a double (exact for f4, f8, i4)
  int64_t numel() const;
};

// Throws std::runtime_error with the path on any failure.
Array load(const std::string& path);
void save_f32(const std::string& path, const std::vector<int64_t>& shape, const std::vector<float>& v);
void save_f64(const std::string& path, const std::vector<int64_t>& shape, const std::vector<double>& v);
void save_i32(const std::string& path, const std::vector<int64_t>& shape, const std::vector<int32_t>& v);

}  // namespace flashmsa::npy
