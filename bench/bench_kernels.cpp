// Times flashmsa's CUDA kernels on BENCHMARKS.md's configurations and patterns (CUDA events,
// median of >= 10 timed runs after warm-up) and prints one JSON object per measurement.
//   flashmsa_bench --config m3 --seqlens 8192,32768 --patterns clustered,random [--iters 10]
//                  [--save-indices DIR]   (the selections, for bench/run_bench.py's peers)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/dtype.hpp"
#include "flashmsa/flashmsa.hpp"
#include "patterns.hpp"
#include "reference/reference.hpp"

using namespace flashmsa;

namespace {

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "CUDA error %s at %s\n", cudaGetErrorString(e_), #x);      \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

struct Config {
  std::string name;
  int Hq, Hkv, Hp, Hpk, topk;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t a = 0;
  while (a <= s.size()) {
    size_t b = s.find(',', a);
    if (b == std::string::npos) b = s.size();
    if (b > a) out.push_back(s.substr(a, b - a));
    a = b + 1;
  }
  return out;
}

// values rounded to bf16 on every hardware thread (the same bits as one loop)
std::vector<uint16_t> to_bf16(const std::vector<double>& h) {
  std::vector<uint16_t> raw(h.size());
  const size_t threads = std::max(1u, std::thread::hardware_concurrency()), step = (h.size() + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (size_t w = 0; w < threads; ++w)
    pool.emplace_back([&, w] {
      for (size_t i = w * step; i < std::min(h.size(), (w + 1) * step); ++i) raw[i] = double_to_bf16(h[i]);
    });
  for (auto& t : pool) t.join();
  return raw;
}

void* upload_raw(const std::vector<uint16_t>& raw) {
  void* d;
  CK(cudaMalloc(&d, raw.size() * 2));
  CK(cudaMemcpy(d, raw.data(), raw.size() * 2, cudaMemcpyHostToDevice));
  return d;
}

void* upload_bf16(const std::vector<double>& h) { return upload_raw(to_bf16(h)); }

// The main inputs (q, k, v, dout: N(0, 1) of a fixed stream) depend only on their stream and size, so the patterns
// of one length share them: drawn and rounded once per length (the host draw was most of a run's wall time).
const std::vector<uint16_t>& main_values(uint64_t stream, size_t n) {
  static std::map<std::pair<uint64_t, size_t>, std::vector<uint16_t>> cache;
  const auto key = std::make_pair(stream, n);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  for (auto e = cache.begin(); e != cache.end();)  // another length's values: not needed again
    e = e->first.first == stream ? cache.erase(e) : std::next(e);
  return cache.emplace(key, to_bf16(cli::normal_values(1, stream, n))).first->second;
}

flashmsa_tensor_t dv(void* p, flashmsa_dtype_t dt, std::initializer_list<int64_t> shape) {
  return view(p, dt, shape, FLASHMSA_DEVICE_CUDA, 0);
}

template <class F>
double median_ms(F&& f, int iters) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  CK(cudaDeviceSynchronize());
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "m3", seqlens = "32768", patterns = "clustered,random", save_dir;
  int iters = 10;
  bool select_only = false;  // --only select: time the selection alone (A/B of selection builds; no main inputs drawn)
  bool options = true;  // --options 0: skip the deterministic / out_lo timings (variant builds that refuse them)
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--config") config = v;
    else if (k == "--seqlens") seqlens = v;
    else if (k == "--patterns") patterns = v;
    else if (k == "--iters") iters = std::atoi(v.c_str());
    else if (k == "--save-indices") save_dir = v;
    else if (k == "--options") options = v != "0";
    else if (k == "--only") {
      if (v != "select") {
        std::fprintf(stderr, "--only takes 'select' (the selection alone), got '%s'\n", v.c_str());
        return 2;
      }
      select_only = true;
    }
    else { std::fprintf(stderr, "unknown flag %s\n", k.c_str()); return 2; }
  }
  Config c = config == "fmsa" ? Config{"fmsa", 16, 2, 4, 1, 16} : Config{"m3", 64, 4, 4, 1, 16};
  const int D = 128;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  for (const auto& sl : split(seqlens))
    for (const auto& pat_s : split(patterns)) {
      const int64_t T = std::atoll(sl.c_str());
      cli::Pattern pat;
      if (!cli::parse_pattern(pat_s, &pat)) {
        std::fprintf(stderr, "flashmsa_bench: --patterns: unknown pattern '%s' (random, clustered, trained)\n",
                     pat_s.c_str());
        return 2;
      }
      std::vector<int64_t> cu{0, T};
      auto proxy = cli::draw_proxy(pat, cu, c.Hp, c.Hpk, D, 1234);
      void* q = select_only ? nullptr : upload_raw(main_values(cli::kStreamQ, size_t(T) * c.Hq * D));
      void* k = select_only ? nullptr : upload_raw(main_values(cli::kStreamK, size_t(T) * c.Hkv * D));
      void* v = select_only ? nullptr : upload_raw(main_values(cli::kStreamV, size_t(T) * c.Hkv * D));
      void* qp = upload_bf16(proxy.qp);
      void* kp = upload_bf16(proxy.kp);
      int32_t cu32[2] = {0, int32_t(T)};
      void *dcu, *idx, *plse, *out, *lse;
      CK(cudaMalloc(&dcu, 8));
      CK(cudaMemcpy(dcu, cu32, 8, cudaMemcpyHostToDevice));
      CK(cudaMalloc(&idx, size_t(c.Hp) * T * c.topk * 4));
      CK(cudaMalloc(&plse, size_t(c.Hp) * T * 4));
      CK(cudaMalloc(&out, size_t(T) * c.Hq * D * 2));
      CK(cudaMalloc(&lse, size_t(c.Hq) * T * 4));

      SelectArgs s;
      s.qp = dv(qp, FLASHMSA_DTYPE_BF16, {T, c.Hp, D});
      s.kp = dv(kp, FLASHMSA_DTYPE_BF16, {T, c.Hpk, D});
      s.cu_seqlens = dv(dcu, FLASHMSA_DTYPE_INT32, {2});
      s.max_seqlen = T;
      s.topk = c.topk;
      s.indices = dv(idx, FLASHMSA_DTYPE_INT32, {c.Hp, T, c.topk});
      s.proxy_lse = dv(plse, FLASHMSA_DTYPE_FP32, {c.Hp, T});
      // every varlen call needs a little workspace (the metadata guard's safe cu_seqlens)
      void* wss;
      const size_t sws = workspace_size(s);
      CK(cudaMalloc(&wss, std::max<size_t>(sws, 256)));
      const double t_sel = median_ms([&] { flashmsa::select(s, wss, sws); }, iters);
      // the selection made (host copy) and the effective work it defines
      std::vector<int32_t> hidx(size_t(c.Hp) * T * c.topk);
      auto selected_pairs = [&] {
        CK(cudaMemcpy(hidx.data(), idx, hidx.size() * 4, cudaMemcpyDeviceToHost));
        ref::Problem pb;
        pb.cu = cu;
        pb.total = T;
        pb.Hq = c.Hq; pb.Hkv = c.Hkv; pb.Hp = c.Hp; pb.Hpk = c.Hpk; pb.D = D; pb.Dp = D;
        pb.topk = c.topk;
        pb.mode = FLASHMSA_MODE_GIVEN;
        return ref::count_pairs(pb, hidx.data());
      };
      if (select_only) {
        const auto pc = selected_pairs();
        std::printf("{\"gpu\": \"%s\", \"config\": \"%s\", \"seqlen\": %lld, \"pattern\": \"%s\", \"topk\": %d, "
                    "\"select_ms\": %.4f, \"select_tflops\": %.1f}\n",
                    prop.name, c.name.c_str(), (long long)T, pat_s.c_str(), c.topk, t_sel,
                    2.0 * D * pc.proxy_pairs / (t_sel * 1e-3) / 1e12);
        std::fflush(stdout);
        for (void* ptr : {q, k, v, qp, kp, dcu, idx, plse, out, lse, wss}) cudaFree(ptr);
        continue;
      }

      FwdArgs f;
      f.q = dv(q, FLASHMSA_DTYPE_BF16, {T, c.Hq, D});
      f.k = dv(k, FLASHMSA_DTYPE_BF16, {T, c.Hkv, D});
      f.v = dv(v, FLASHMSA_DTYPE_BF16, {T, c.Hkv, D});
      f.cu_seqlens = s.cu_seqlens;
      f.max_seqlen = T;
      f.mode = FLASHMSA_MODE_GIVEN;
      f.indices = s.indices;
      f.out = dv(out, FLASHMSA_DTYPE_BF16, {T, c.Hq, D});
      f.lse = dv(lse, FLASHMSA_DTYPE_FP32, {c.Hq, T});
      void* wsg;
      const size_t gws = workspace_size(f);
      CK(cudaMalloc(&wsg, std::max<size_t>(gws, 256)));
      const double t_fwd = median_ms([&] { flashmsa::fwd(f, wsg, gws); }, iters);
      f.numerics = FLASHMSA_NUMERICS_INFER;
      const double t_fwd_inf = median_ms([&] { flashmsa::fwd(f, wsg, gws); }, iters);
      f.numerics = FLASHMSA_NUMERICS_TRAIN;
      FwdArgs fd = f;
      fd.mode = FLASHMSA_MODE_DENSE;
      fd.indices = flashmsa::none();
      fd.qp = s.qp;
      fd.kp = s.kp;
      const size_t dws = workspace_size(fd);
      void* wsdn;
      CK(cudaMalloc(&wsdn, std::max<size_t>(dws, 256)));
      const double t_dense = median_ms([&] { flashmsa::fwd(fd, wsdn, dws); }, std::max(3, iters / 3));
      cudaFree(wsdn);

      // backward (GIVEN indices of the selection, proxy lse, kl gradient 1, the kl value as a
      // training step gets it) and a whole step
      void *dout, *dq, *dk, *dvv, *dqp, *dkp, *dkl, *klv;
      CK(cudaMalloc(&dout, size_t(T) * c.Hq * D * 2));
      CK(cudaMalloc(&dq, size_t(T) * c.Hq * D * 2));
      CK(cudaMalloc(&dk, size_t(T) * c.Hkv * D * 2));
      CK(cudaMalloc(&dvv, size_t(T) * c.Hkv * D * 2));
      CK(cudaMalloc(&dqp, size_t(T) * c.Hp * D * 2));
      CK(cudaMalloc(&dkp, size_t(T) * c.Hpk * D * 2));
      CK(cudaMalloc(&dkl, 4));
      CK(cudaMalloc(&klv, 4));
      {
        const std::vector<uint16_t>& raw = main_values(cli::kStreamDout, size_t(T) * c.Hq * D);
        CK(cudaMemcpy(dout, raw.data(), raw.size() * 2, cudaMemcpyHostToDevice));
        const float one = 1.f;
        CK(cudaMemcpy(dkl, &one, 4, cudaMemcpyHostToDevice));
      }
      BwdArgs bw;
      bw.q = f.q; bw.k = f.k; bw.v = f.v; bw.qp = s.qp; bw.kp = s.kp;
      bw.cu_seqlens = s.cu_seqlens;
      bw.max_seqlen = T;
      bw.mode = FLASHMSA_MODE_GIVEN;
      bw.indices = s.indices;
      bw.out = f.out; bw.lse = f.lse; bw.proxy_lse = s.proxy_lse;
      bw.dout = dv(dout, FLASHMSA_DTYPE_BF16, {T, c.Hq, D});
      bw.dkl = dv(dkl, FLASHMSA_DTYPE_FP32, {});
      bw.dq = dv(dq, FLASHMSA_DTYPE_BF16, {T, c.Hq, D});
      bw.dk = dv(dk, FLASHMSA_DTYPE_BF16, {T, c.Hkv, D});
      bw.dv = dv(dvv, FLASHMSA_DTYPE_BF16, {T, c.Hkv, D});
      bw.dqp = dv(dqp, FLASHMSA_DTYPE_BF16, {T, c.Hp, D});
      bw.dkp = dv(dkp, FLASHMSA_DTYPE_BF16, {T, c.Hpk, D});
      bw.kl = dv(klv, FLASHMSA_DTYPE_FP32, {});
      const size_t bws = workspace_size(bw);
      void* wsb;
      CK(cudaMalloc(&wsb, std::max<size_t>(bws, 256)));
      const double t_bwd = median_ms([&] { flashmsa::bwd(bw, wsb, bws); }, iters);
      // a variant of the backward call, timed on its own workspace
      auto time_bwd = [&](const BwdArgs& x, int n) {
        const size_t wx = workspace_size(x);
        void* wsx;
        CK(cudaMalloc(&wsx, std::max<size_t>(wx, 256)));
        const double t = median_ms([&] { flashmsa::bwd(x, wsx, wx); }, n);
        cudaFree(wsx);
        return t;
      };
      // the main attention's backward alone (no proxy side: what a frozen indexer's step runs; the
      // Python op passes no kl gradient when qp, kp take none)
      BwdArgs bm = bw;
      bm.qp = bm.kp = bm.proxy_lse = bm.dkl = bm.kl = bm.dqp = bm.dkp = flashmsa::none();
      const double t_bwd_main = time_bwd(bm, iters);
      // the dense (warmup) mode's backward as a warmup training step runs it: the main walk over every causal key with
      // the proxy side (kl gradient and value; the proxy lse recomputed); out and lse are the dense forward's, which ran
      // last
      BwdArgs bdense = bw;
      bdense.mode = FLASHMSA_MODE_DENSE;
      bdense.indices = bdense.proxy_lse = flashmsa::none();
      const double t_dense_bwd = time_bwd(bdense, std::max(3, iters / 3));
      // the deterministic backward, and the precise dpsum (forward writing out_lo, backward reading it)
      double t_bwd_det = NAN, t_dense_bwd_det = NAN, t_fwd_lo = NAN, t_bwd_lo = NAN;
      if (options) {
        BwdArgs bd = bw;
        bd.deterministic = 1;
        t_bwd_det = time_bwd(bd, std::max(3, iters / 2));
        BwdArgs bdd = bdense;  // the warmup step's backward under torch.use_deterministic_algorithms
        bdd.deterministic = 1;
        t_dense_bwd_det = time_bwd(bdd, 3);
        void* lo;
        CK(cudaMalloc(&lo, size_t(T) * c.Hq * D * 2));
        FwdArgs fl = f;
        fl.out_lo = dv(lo, FLASHMSA_DTYPE_BF16, {T, c.Hq, D});
        const size_t wl = workspace_size(fl);
        void* wsl;
        CK(cudaMalloc(&wsl, std::max<size_t>(wl, 256)));
        t_fwd_lo = median_ms([&] { flashmsa::fwd(fl, wsl, wl); }, iters);
        BwdArgs bl = bw;
        bl.out_lo = fl.out_lo;
        t_bwd_lo = median_ms([&] { flashmsa::bwd(bl, wsb, bws); }, iters);
        cudaFree(wsl);
        cudaFree(lo);
      }
      // step: forward with selection (SPARSE) + backward
      FwdArgs fs = f;
      fs.mode = FLASHMSA_MODE_SPARSE;
      fs.qp = s.qp; fs.kp = s.kp; fs.topk = c.topk; fs.indices = s.indices; fs.proxy_lse = s.proxy_lse;
      const size_t fws = workspace_size(fs);
      void* wsf;
      CK(cudaMalloc(&wsf, std::max<size_t>(fws, 256)));
      const double t_step = median_ms([&] { flashmsa::fwd(fs, wsf, fws); flashmsa::bwd(bw, wsb, bws); }, iters);
      // bytes a step holds on the device: inputs, outputs, gradients, workspaces
      const double step_gb = (double(T) * (2 * c.Hq + 2 * c.Hkv + c.Hp + c.Hpk) * D * 2 * 2 /* inputs+grads */ +
                              double(T) * c.Hq * D * 2 * 2 /* out, dout */ + double(c.Hq + c.Hp) * T * 4 +
                              double(c.Hp) * T * c.topk * 4 + double(bws) + double(fws)) / 1e9;
      for (void* ptr : {dout, dq, dk, dvv, dqp, dkp, dkl, klv, wsb, wsf}) cudaFree(ptr);

      // effective work from the selection actually made
      const auto pc = selected_pairs();
      const double dense_pairs = double(c.Hq) * double(T) * double(T + 1) / 2;
      // union factor: distinct blocks per 128-query tile / topk, mean over tiles and heads
      double uf = 0;
      int ntiles = 0;
      for (int p = 0; p < c.Hp; ++p)
        for (int64_t t0 = 0; t0 < T; t0 += 128) {
          std::vector<char> seen(size_t((T + 127) / 128), 0);
          int distinct = 0;
          for (int64_t t = t0; t < std::min(T, t0 + 128); ++t)
            for (int s2 = 0; s2 < c.topk; ++s2) {
              const int j = hidx[(size_t(p) * T + t) * c.topk + s2];
              if (j >= 0 && !seen[size_t(j)]) seen[size_t(j)] = 1, ++distinct;
            }
          uf += double(distinct) / c.topk;
          ++ntiles;
        }
      uf /= ntiles;
      if (!save_dir.empty()) {  // raw int32 [Hp, T, topk] for the peers (FlexAttention masks)
        const std::string path = save_dir + "/indices-" + c.name + "-" + sl + "-" + pat_s + ".bin";
        if (FILE* fp = std::fopen(path.c_str(), "wb")) {
          std::fwrite(hidx.data(), 4, hidx.size(), fp);
          std::fclose(fp);
        }
      }
      auto tf = [](double flop, double ms) { return flop / (ms * 1e-3) / 1e12; };
      auto js = [](double ms) {  // JSON number, null when not measured
        char b[32];
        std::snprintf(b, sizeof b, "%.4f", ms);
        return std::isnan(ms) ? std::string("null") : std::string(b);
      };
      std::printf(
          "{\"gpu\": \"%s\", \"config\": \"%s\", \"seqlen\": %lld, \"pattern\": \"%s\", \"topk\": %d, "
          "\"union_factor_128\": %.3f, \"select_ms\": %.4f, \"select_tflops\": %.1f, "
          "\"fwd_train_ms\": %.4f, \"fwd_train_tflops\": %.1f, \"fwd_infer_ms\": %.4f, \"fwd_infer_tflops\": %.1f, "
          "\"dense_fwd_ms\": %.4f, \"dense_fwd_tflops\": %.1f, \"bwd_ms\": %.4f, \"bwd_tflops\": %.1f, "
          "\"bwd_main_ms\": %.4f, \"bwd_main_tflops\": %.1f, \"dense_bwd_ms\": %.4f, \"dense_bwd_tflops\": %.1f, "
          "\"step_ms\": %.4f, \"step_tflops\": %.1f, \"step_gb\": %.2f, \"bwd_deterministic_ms\": %s, "
          "\"dense_bwd_deterministic_ms\": %s, \"fwd_train_out_lo_ms\": %s, \"bwd_out_lo_ms\": %s}\n",
          prop.name, c.name.c_str(), (long long)T, pat_s.c_str(), c.topk, uf, t_sel,
          tf(2.0 * D * pc.proxy_pairs, t_sel), t_fwd, tf(4.0 * D * pc.main_pairs, t_fwd), t_fwd_inf,
          tf(4.0 * D * pc.main_pairs, t_fwd_inf), t_dense, tf(4.0 * D * dense_pairs, t_dense), t_bwd,
          tf(2.5 * 4.0 * D * pc.main_pairs, t_bwd), t_bwd_main, tf(2.5 * 4.0 * D * pc.main_pairs, t_bwd_main), t_dense_bwd,
          tf(2.5 * 4.0 * D * dense_pairs, t_dense_bwd), t_step,
          tf(3.5 * 4.0 * D * pc.main_pairs + 2.0 * D * pc.proxy_pairs, t_step), step_gb, js(t_bwd_det).c_str(),
          js(t_dense_bwd_det).c_str(), js(t_fwd_lo).c_str(), js(t_bwd_lo).c_str());
      std::fflush(stdout);
      for (void* p : {q, k, v, qp, kp, dcu, idx, plse, out, lse, wss, wsg}) cudaFree(p);
    }
  return 0;
}
