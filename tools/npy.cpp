#include "npy.hpp"

#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace flashmsa::npy {

int64_t Array::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

namespace {

std::string header_text(const std::string& descr, const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "{'descr': '" << descr << "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) os << shape[i] << (shape.size() == 1 || i + 1 < shape.size() ? "," : "");
  os << "), }";
  std::string h = os.str();
  const size_t unpadded = 10 + h.size() + 1;  // magic(6)+ver(2)+len(2) + header + '\n'
  h.append((64 - unpadded % 64) % 64, ' ');
  h.push_back('\n');
  return h;
}

void write(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape,
           const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot write " + path);
  const std::string h = header_text(descr, shape);
  const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  f.write(magic, 8);
  const uint16_t len = uint16_t(h.size());
  const char lb[2] = {char(len & 0xff), char(len >> 8)};
  f.write(lb, 2);
  f.write(h.data(), std::streamsize(h.size()));
  f.write(static_cast<const char*>(data), std::streamsize(bytes));
  if (!f) throw std::runtime_error("write failed: " + path);
}

std::string field(const std::string& h, const std::string& key) {
  const size_t k = h.find("'" + key + "'");
  if (k == std::string::npos) return "";
  size_t c = h.find(':', k);
  return c == std::string::npos ? "" : h.substr(c + 1);
}

}  // namespace

Array load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  char magic[6];
  f.read(magic, 6);
  if (!f || std::memcmp(magic, "\x93NUMPY", 6) != 0) throw std::runtime_error("not a .npy file: " + path);
  unsigned char ver[2];
  f.read(reinterpret_cast<char*>(ver), 2);
  uint32_t hlen = 0;
  if (ver[0] == 1) {
    unsigned char b[2];
    f.read(reinterpret_cast<char*>(b), 2);
    hlen = b[0] | (b[1] << 8);
  } else {
    unsigned char b[4];
    f.read(reinterpret_cast<char*>(b), 4);
    hlen = b[0] | (b[1] << 8) | (b[2] << 16) | (uint32_t(b[3]) << 24);
  }
  std::string h(hlen, '\0');
  f.read(&h[0], hlen);
  if (!f) throw std::runtime_error("truncated header: " + path);
  Array a;
  std::string d = field(h, "descr");
  const size_t q1 = d.find('\''), q2 = d.find('\'', q1 + 1);
  a.descr = d.substr(q1 + 1, q2 - q1 - 1);
  if (field(h, "fortran_order").find("True") < 8) throw std::runtime_error("fortran order unsupported: " + path);
  std::string s = field(h, "shape");
  s = s.substr(s.find('(') + 1, s.find(')') - s.find('(') - 1);
  std::istringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ','))
    if (tok.find_first_not_of(' ') != std::string::npos) a.shape.push_back(std::stoll(tok));
  const int64_t n = a.numel();
  a.values.resize(size_t(n));
  if (a.descr == "<f4") {
    std::vector<float> v(static_cast<size_t>(n));
    f.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * 4));
    for (int64_t i = 0; i < n; ++i) a.values[size_t(i)] = v[size_t(i)];
  } else if (a.descr == "<f8") {
    f.read(reinterpret_cast<char*>(a.values.data()), std::streamsize(n * 8));
  } else if (a.descr == "<i4") {
    std::vector<int32_t> v(static_cast<size_t>(n));
    f.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * 4));
    for (int64_t i = 0; i < n; ++i) a.values[size_t(i)] = v[size_t(i)];
  } else {
    throw std::runtime_error("unsupported dtype " + a.descr + " in " + path);
  }
  if (!f) throw std::runtime_error("truncated data: " + path);
  return a;
}

void save_f32(const std::string& path, const std::vector<int64_t>& shape, const std::vector<float>& v) {
  write(path, "<f4", shape, v.data(), v.size() * 4);
}
void save_f64(const std::string& path, const std::vector<int64_t>& shape, const std::vector<double>& v) {
  write(path, "<f8", shape, v.data(), v.size() * 8);
}
void save_i32(const std::string& path, const std::vector<int64_t>& shape, const std::vector<int32_t>& v) {
  write(path, "<i4", shape, v.data(), v.size() * 4);
}

}  // namespace flashmsa::npy
