#include "cli_save.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "cli_util.hpp"
#include "npy.hpp"
#include "patterns.hpp"

namespace flashmsa::cli {

void prepare_save_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UsageError("--save: cannot create the directory '" + dir + "': " + ec.message());
  if (!fs::is_directory(dir, ec)) throw UsageError("--save: '" + dir + "' exists and is not a directory");
  const std::string probe = (fs::path(dir) / ".flashmsa_write_check").string();
  FILE* f = std::fopen(probe.c_str(), "wb");
  if (!f) throw UsageError("--save: cannot write into '" + dir + "': " + std::strerror(errno));
  const bool ok = std::fputs("ok\n", f) >= 0;
  const bool closed = std::fclose(f) == 0;
  fs::remove(probe, ec);
  if (!ok || !closed) throw UsageError("--save: cannot write into '" + dir + "'");
}

namespace {

std::string json_num(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

}  // namespace

void save_all(const Config& c, const Tensors& t) {
  namespace fs = std::filesystem;
  progress("[save] writing %s ...\n", c.save_dir.c_str());
  std::error_code ec;
  fs::create_directories(c.save_dir, ec);
  if (ec) throw std::runtime_error("--save: cannot create " + c.save_dir + ": " + ec.message());
  std::vector<std::string> files;
  for (const Buf* b : t.all()) {
    if (!b->used || b->name == "dkl") continue;  // dkl is kl_grad in config.json
    const std::string path = (fs::path(c.save_dir) / (b->name + ".npy")).string();
    if (b->dtype == FLASHMSA_DTYPE_INT32) {
      npy::save_i32(path, b->shape, std::vector<int32_t>(b->i32(), b->i32() + b->numel()));
    } else if (b->dtype == FLASHMSA_DTYPE_FP64) {
      npy::save_f64(path, b->shape, b->values());
    } else {
      const std::vector<double> v = b->values();
      npy::save_f32(path, b->shape, std::vector<float>(v.begin(), v.end()));  // exact
    }
    files.push_back(b->name);
  }
  std::string j = "{\n";
  auto field = [&](const std::string& k, const std::string& v, bool last = false) {
    j += "  \"" + k + "\": " + v + (last ? "\n" : ",\n");
  };
  auto str = [](const std::string& s) { return "\"" + s + "\""; };
  auto list = [](const std::vector<int64_t>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  };
  std::vector<int64_t> lengths;
  for (int b = 0; b < c.nseq(); ++b) lengths.push_back(c.cu[size_t(b) + 1] - c.cu[size_t(b)]);
  field("lengths", list(lengths));
  field("cu_seqlens", list(c.cu));
  field("total", std::to_string(c.total));
  field("max_seqlen", std::to_string(c.max_seqlen));
  field("batched", c.batched ? "true" : "false");
  field("Hq", std::to_string(c.Hq));
  field("Hkv", std::to_string(c.Hkv));
  field("Hp", std::to_string(c.Hp));
  field("Hpk", std::to_string(c.Hpk));
  field("D", std::to_string(c.D));
  field("Dp", std::to_string(c.Dp));
  field("block_size", std::to_string(kBlock));
  field("topk", c.sparse() ? std::to_string(c.topk) : "null");
  field("mode", str(mode_name(c.mode)));
  field("library_mode", str(c.sparse() ? "given (indices from flashmsa_select)" : "dense"));
  field("numerics", str(c.mode == Mode::Infer ? "infer" : "train"));
  field("softmax_scale", json_num(c.scale()));
  field("proxy_scale", json_num(c.proxy_scale()));
  field("compute_kl", "true");
  field("kl_grad", c.has_bwd() ? json_num(c.kl_grad) : "null");
  field("dlse", c.has_bwd() && c.dlse ? "true" : "false");
  field("deterministic", c.has_bwd() && c.deterministic ? "true" : "false");
  field("precise_dpsum", c.has_bwd() && c.precise_dpsum ? "true" : "false");
  field("seed", std::to_string(c.seed));
  field("pattern", str(pattern_name(c.pattern)));
  field("dtype", str(flashmsa_dtype_name(c.dtype)));
  field("backend", str(c.on_cuda ? "cuda" : "cpu"));
  std::string fl = "[";
  for (size_t i = 0; i < files.size(); ++i) fl += (i ? ", " : "") + str(files[i]);
  field("files", fl + "]", true);
  j += "}\n";
  const std::string path = (fs::path(c.save_dir) / "config.json").string();
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f || std::fwrite(j.data(), 1, j.size(), f) != j.size())
    throw std::runtime_error("--save: cannot write " + path);
  std::fclose(f);
  progress("[save] done (%zu files + config.json)\n", files.size());
}

}  // namespace flashmsa::cli
