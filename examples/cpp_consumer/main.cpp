// One MSA forward through the installed library, on the CPU backend: 300 tokens (3 key blocks),
// 4 query heads over 2 kv heads, 2 proxy heads, head dim 16, fp32. With topk 3 every block is
// selected, so the sparse forward must equal the dense (warmup) one: the program checks that and
// prints what it computed. Exit status 0 on agreement.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <flashmsa/flashmsa.hpp>

int main() {
  constexpr int64_t T = 300, Hq = 4, Hkv = 2, Hp = 2, Hpk = 1, D = 16;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  auto randn = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = normal(rng);
    return v;
  };
  std::vector<float> q = randn(T * Hq * D), k = randn(T * Hkv * D), v = randn(T * Hkv * D),
                     qp = randn(T * Hp * D), kp = randn(T * Hpk * D);
  std::vector<int32_t> cu = {0, int32_t(T)};
  const auto F = FLASHMSA_DTYPE_FP32;

  auto forward = [&](flashmsa_mode_t mode, std::vector<float>& out, std::vector<float>& lse, float& kl) {
    flashmsa::FwdArgs a;
    a.q = flashmsa::view(q.data(), F, {T, Hq, D});
    a.k = flashmsa::view(k.data(), F, {T, Hkv, D});
    a.v = flashmsa::view(v.data(), F, {T, Hkv, D});
    a.qp = flashmsa::view(qp.data(), F, {T, Hp, D});
    a.kp = flashmsa::view(kp.data(), F, {T, Hpk, D});
    a.cu_seqlens = flashmsa::view(cu.data(), FLASHMSA_DTYPE_INT32, {2});
    a.max_seqlen = T;
    a.mode = mode;
    a.topk = mode == FLASHMSA_MODE_SPARSE ? 3 : 0;
    a.compute_kl = 1;
    out.assign(static_cast<size_t>(T * Hq * D), NAN);
    lse.assign(static_cast<size_t>(Hq * T), NAN);
    a.out = flashmsa::view(out.data(), F, {T, Hq, D});
    a.lse = flashmsa::view(lse.data(), F, {Hq, T});
    a.kl = flashmsa::view(&kl, F, {});
    flashmsa::fwd(a);  // the CPU backend: no workspace, no stream
  };

  try {
    std::vector<float> out_s, lse_s, out_d, lse_d;
    float kl_s = NAN, kl_d = NAN;
    forward(FLASHMSA_MODE_SPARSE, out_s, lse_s, kl_s);
    forward(FLASHMSA_MODE_DENSE, out_d, lse_d, kl_d);
    double diff = 0, norm = 0;
    for (size_t i = 0; i < out_s.size(); ++i) {
      diff = std::fmax(diff, std::fabs(double(out_s[i]) - out_d[i]));
      norm = std::fmax(norm, std::fabs(double(out_d[i])));
    }
    std::printf("flashmsa %s (CUDA backend available: %s)\n", flashmsa_version(),
                flashmsa_cuda_available() ? "yes" : "no");
    std::printf("sparse forward, topk 3 of 3 blocks: max |out| %.4f, kl %.6f\n", norm, kl_s);
    std::printf("dense forward: kl %.6f; max |sparse - dense| %.3g\n", kl_d, diff);
    const bool ok = std::isfinite(norm) && norm > 0 && diff <= 1e-5 * norm && std::fabs(kl_s - kl_d) <= 1e-5;
    std::printf("%s\n", ok ? "OK: sparse with every block selected equals dense" : "MISMATCH");
    return ok ? 0 : 1;
  } catch (const flashmsa::Error& e) {
    std::fprintf(stderr, "flashmsa error (status %d): %s\n", int(e.status()), e.what());
    return 2;
  }
}
