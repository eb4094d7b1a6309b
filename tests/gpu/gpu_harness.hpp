// Harness of the GPU suite: device buffers reused across tests (dirty, never zeroed), seeded
// inputs rounded to the kernel dtype, NaN poisoning, the fp64 CPU reference through the public
// API, and the "straightforward same-dtype reference" of SPEC section 3's accuracy bar.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "flashmsa/flashmsa.hpp"
#include "reference/reference.hpp"

namespace gputest {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << cudaGetErrorString(x)

// Device memory that outlives tests: a buffer handed out again keeps the previous test's data.
class Pool {
 public:
  static Pool& get() {
    static Pool p;
    return p;
  }
  void* take(size_t bytes) {
    bytes = std::max<size_t>(256, (bytes + 255) & ~size_t(255));
    for (auto& b : bufs_)
      if (!b.used && b.bytes >= bytes) {
        b.used = true;
        return b.ptr;
      }
    Buf b{nullptr, bytes, true};
    if (cudaMalloc(&b.ptr, bytes) != cudaSuccess) return nullptr;
    bufs_.push_back(b);
    return b.ptr;
  }
  void release_all() {
    for (auto& b : bufs_) b.used = false;
  }

 private:
  struct Buf {
    void* ptr;
    size_t bytes;
    bool used;
  };
  std::vector<Buf> bufs_;
};

// Releases the pool's buffers (for reuse, not freed) at the end of each test.
struct PoolScope {
  ~PoolScope() { Pool::get().release_all(); }
};

// The shapes of one test problem. Built by named steps, each returning a modified copy:
//   Problem().heads(64, 4).proxy_heads(4, 1).with_topk(16).seqlens({1300})
//   Problem().heads(16, 2).proxy_heads(4, 1).with_topk(8).batched(2, 700).fp16()
struct Problem {
  int Hq = 16, Hkv = 2, Hp = 4, Hpk = 1, D = 128, Dp = 128, topk = 16;
  std::vector<int64_t> lengths{1000};
  int batch = 0;  // > 0: batched [B, S, ...] with S = lengths[0]
  flashmsa_dtype_t dtype = FLASHMSA_DTYPE_BF16;

  // attention heads: Hq query heads sharing Hkv key/value heads
  [[nodiscard]] Problem heads(int q, int kv) const {
    Problem p = *this;
    p.Hq = q;
    p.Hkv = kv;
    return p;
  }
  // proxy heads: Hp proxy query heads (one per MSA group) sharing Hpk proxy key heads
  [[nodiscard]] Problem proxy_heads(int p_q, int p_kv) const {
    Problem p = *this;
    p.Hp = p_q;
    p.Hpk = p_kv;
    return p;
  }
  [[nodiscard]] Problem head_dim(int d) const {
    Problem p = *this;
    p.D = d;
    return p;
  }
  // blocks per (proxy head, token) in SPARSE and GIVEN mode (DENSE ignores it)
  [[nodiscard]] Problem with_topk(int k) const {
    Problem p = *this;
    p.topk = k;
    return p;
  }
  // varlen: one sequence per length (cu_seqlens on the device)
  [[nodiscard]] Problem seqlens(std::vector<int64_t> l) const {
    Problem p = *this;
    p.lengths = std::move(l);
    p.batch = 0;
    return p;
  }
  // batched [B, S, ...] inputs: b sequences of length s (no cu_seqlens)
  [[nodiscard]] Problem batched(int b, int64_t s) const {
    Problem p = *this;
    p.lengths = {s};
    p.batch = b;
    return p;
  }
  [[nodiscard]] Problem fp16() const {
    Problem p = *this;
    p.dtype = FLASHMSA_DTYPE_FP16;
    return p;
  }

  int64_t total() const {
    if (batch > 0) return int64_t(batch) * lengths.at(0);
    int64_t t = 0;
    for (auto l : lengths) t += l;
    return t;
  }
  std::vector<int64_t> offsets() const {
    std::vector<int64_t> cu{0};
    if (batch > 0)
      for (int b = 0; b < batch; ++b) cu.push_back(cu.back() + lengths[0]);
    else
      for (auto l : lengths) cu.push_back(cu.back() + l);
    return cu;
  }
  int64_t max_len() const {
    int64_t m = 0;
    for (auto l : lengths) m = std::max(m, l);
    return m;
  }
};

// A host tensor in fp64 holding dtype-representable values, plus its device copy.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<double> host;
  void* dev = nullptr;
  flashmsa_dtype_t dtype = FLASHMSA_DTYPE_BF16;
  size_t numel() const { return host.size(); }
  size_t bytes() const { return numel() * flashmsa::dtype_size(dtype); }
};

inline std::vector<int64_t> token_shape(const Problem& pb, int H, int X) {
  if (pb.batch > 0) return {pb.batch, pb.lengths[0], H, X};
  return {pb.total(), H, X};
}

inline flashmsa_tensor_t dev_view(const Tensor& t) {
  flashmsa_tensor_t v{};
  v.data = t.dev;
  v.dtype = t.dtype;
  v.ndim = int(t.shape.size());
  int64_t s = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = t.shape[size_t(d)];
    v.strides[d] = s;
    s *= t.shape[size_t(d)];
  }
  v.device_type = FLASHMSA_DEVICE_CUDA;
  return v;
}

// Host fp64 view (contiguous) of a host vector with a given shape.
inline flashmsa_tensor_t host_view(std::vector<double>& h, const std::vector<int64_t>& shape) {
  flashmsa_tensor_t v{};
  v.data = h.data();
  v.dtype = FLASHMSA_DTYPE_FP64;
  v.ndim = int(shape.size());
  int64_t s = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = shape[size_t(d)];
    v.strides[d] = s;
    s *= shape[size_t(d)];
  }
  return v;
}

// Upload host values in the tensor's dtype.
inline void upload(Tensor& t) {
  t.dev = Pool::get().take(t.bytes());
  std::vector<uint8_t> raw(t.bytes());
  for (size_t i = 0; i < t.numel(); ++i) flashmsa::store_from_double(t.dtype, raw.data(), int64_t(i), t.host[i]);
  cudaMemcpy(t.dev, raw.data(), raw.size(), cudaMemcpyHostToDevice);
}

inline void download(Tensor& t) {
  std::vector<uint8_t> raw(t.bytes());
  cudaMemcpy(raw.data(), t.dev, raw.size(), cudaMemcpyDeviceToHost);
  for (size_t i = 0; i < t.numel(); ++i) t.host[i] = flashmsa::load_as_double(t.dtype, raw.data(), int64_t(i));
}

// A device fp32 scalar holding v (e.g. the kl gradient dkl).
inline Tensor device_scalar(double v) {
  Tensor t;
  t.shape = {};
  t.dtype = FLASHMSA_DTYPE_FP32;
  t.host = {v};
  upload(t);
  return t;
}

// An output: device buffer poisoned with all-ones bytes (NaN for floats, -1 for int32 would be
// a legal value, so int outputs get 0x7f7f7f7f).
inline Tensor output(std::vector<int64_t> shape, flashmsa_dtype_t dtype) {
  Tensor t;
  t.shape = std::move(shape);
  t.dtype = dtype;
  size_t n = 1;
  for (auto s : t.shape) n *= size_t(s);
  t.host.assign(n, 0.0);
  t.dev = Pool::get().take(t.bytes());
  cudaMemset(t.dev, dtype == FLASHMSA_DTYPE_INT32 ? 0x7f : 0xff, t.bytes());
  return t;
}

inline Tensor random_input(std::vector<int64_t> shape, flashmsa_dtype_t dtype, std::mt19937_64& rng,
                           double stddev = 1.0) {
  Tensor t;
  t.shape = std::move(shape);
  t.dtype = dtype;
  size_t n = 1;
  for (auto s : t.shape) n *= size_t(s);
  std::normal_distribution<double> nd(0.0, stddev);
  t.host.resize(n);
  for (auto& x : t.host) x = flashmsa::round_to(dtype, nd(rng));
  upload(t);
  return t;
}

inline bool all_finite(const std::vector<double>& v) {
  for (double x : v)
    if (std::isnan(x)) return false;
  return true;
}

inline double rel_l2(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i]) return INFINITY;
      continue;
    }
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The sequences, the mode and (GIVEN) a copy of the indices in a reference call's arguments.
template <class Args>
void set_key_sets(Args& a, const Problem& pb, std::vector<int32_t>& cu32, flashmsa_mode_t mode,
                  const std::vector<int32_t>* indices, int topk, std::vector<int32_t>& idx_copy) {
  a.cu_seqlens = flashmsa::view(cu32.data(), FLASHMSA_DTYPE_INT32, {int64_t(cu32.size())});
  a.max_seqlen = pb.max_len();
  a.mode = mode;
  if (mode == FLASHMSA_MODE_GIVEN) {
    idx_copy = *indices;
    a.indices = flashmsa::view(idx_copy.data(), FLASHMSA_DTYPE_INT32, {pb.Hp, pb.total(), topk});
  }
}

// The fp64 reference forward over given indices (or dense), through the public API on the CPU.
struct RefFwd {
  std::vector<double> out, lse, proxy_lse;
};
inline RefFwd reference_fwd(const Problem& pb, Tensor& q, Tensor& k, Tensor& v, Tensor* qp, Tensor* kp,
                            const std::vector<int32_t>* indices, int topk, flashmsa_mode_t mode) {
  RefFwd r;
  const int64_t T = pb.total();
  std::vector<int32_t> cu32;
  for (auto c : pb.offsets()) cu32.push_back(int32_t(c));
  r.out.assign(size_t(T) * pb.Hq * pb.D, NAN);
  r.lse.assign(size_t(pb.Hq) * T, NAN);
  flashmsa::FwdArgs a;
  std::vector<int64_t> q3{T, pb.Hq, pb.D}, k3{T, pb.Hkv, pb.D};
  a.q = host_view(q.host, q3);
  a.k = host_view(k.host, k3);
  a.v = host_view(v.host, k3);
  std::vector<int64_t> qp3{T, pb.Hp, pb.Dp}, kp3{T, pb.Hpk, pb.Dp};
  if (qp) {
    a.qp = host_view(qp->host, qp3);
    a.kp = host_view(kp->host, kp3);
    r.proxy_lse.assign(size_t(pb.Hp) * T, NAN);
    a.proxy_lse = host_view(r.proxy_lse, {pb.Hp, T});
  }
  std::vector<int32_t> idx_copy;
  set_key_sets(a, pb, cu32, mode, indices, topk, idx_copy);
  a.out = host_view(r.out, q3);
  a.lse = host_view(r.lse, {pb.Hq, T});
  flashmsa::fwd(a);
  return r;
}

// The reference's description of a problem whose key sets come from given indices (or dense).
inline flashmsa::ref::Problem ref_problem(const Problem& pb, int topk, flashmsa_mode_t mode) {
  flashmsa::ref::Problem rp;
  rp.cu = pb.offsets();
  rp.total = pb.total();
  rp.Hq = pb.Hq; rp.Hkv = pb.Hkv; rp.Hp = pb.Hp; rp.Hpk = pb.Hpk; rp.D = pb.D; rp.Dp = pb.Dp;
  rp.topk = topk;
  rp.mode = mode == FLASHMSA_MODE_DENSE ? FLASHMSA_MODE_DENSE : FLASHMSA_MODE_GIVEN;
  return rp;
}

// Straightforward same-dtype attention (FlashAttention's test rule): q scaled and rounded,
// scores rounded to the dtype, softmax in fp32 rounded to the dtype, P V accumulated in fp32
// and rounded. lse from the rounded scores in fp32.
inline RefFwd straightforward_fwd(const Problem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const std::vector<int32_t>* indices, int topk, flashmsa_mode_t mode) {
  using flashmsa::round_to;
  const auto dt = pb.dtype;
  const flashmsa::ref::Problem rp = ref_problem(pb, topk, mode);
  const double scale = 1.0 / std::sqrt(double(pb.D));
  RefFwd r;
  r.out.assign(size_t(rp.total) * pb.Hq * pb.D, 0.0);
  r.lse.assign(size_t(pb.Hq) * rp.total, 0.0);
  const int64_t n = int64_t(pb.Hq) * rp.total;
  const int T = flashmsa::ref::num_threads();
  flashmsa::ref::parallel_for(n, [&](int64_t first, int64_t, int) {
    std::vector<int64_t> keys;
    std::vector<float> s, qs(size_t(pb.D));
    std::vector<double> o(size_t(pb.D));
    for (int64_t item = first; item < n; item += std::min<int64_t>(T, n)) {
      const int h = int(item / rp.total);
      const int64_t t = item % rp.total;
      flashmsa::ref::key_set(rp, indices ? indices->data() : nullptr, rp.group_of(h), t, keys);
      const int c = rp.kv_of(h);
      for (int d = 0; d < pb.D; ++d) qs[size_t(d)] = float(round_to(dt, q.host[(size_t(t) * pb.Hq + h) * pb.D + d] * scale));
      s.resize(keys.size());
      float m = -INFINITY;
      for (size_t j = 0; j < keys.size(); ++j) {
        float acc = 0.f;
        const double* kr = &k.host[(size_t(keys[j]) * pb.Hkv + c) * pb.D];
        for (int d = 0; d < pb.D; ++d) acc += qs[size_t(d)] * float(kr[d]);
        s[j] = float(round_to(dt, acc));
        m = std::max(m, s[j]);
      }
      float sum = 0.f;
      for (size_t j = 0; j < keys.size(); ++j) sum += std::exp(s[j] - m);
      r.lse[size_t(h) * rp.total + t] = keys.empty() ? -INFINITY : double(m + std::log(sum));
      std::fill(o.begin(), o.end(), 0.0);
      std::vector<float> of(size_t(pb.D), 0.f);
      for (size_t j = 0; j < keys.size(); ++j) {
        const float pj = float(round_to(dt, std::exp(s[j] - m) / sum));
        const double* vr = &v.host[(size_t(keys[j]) * pb.Hkv + c) * pb.D];
        for (int d = 0; d < pb.D; ++d) of[size_t(d)] += pj * float(vr[d]);
      }
      for (int d = 0; d < pb.D; ++d) r.out[(size_t(t) * pb.Hq + h) * pb.D + d] = round_to(dt, of[size_t(d)]);
    }
  });
  return r;
}

// The fp64 reference backward (through the public API on the CPU) over given indices or dense.
struct RefBwd {
  std::vector<double> dq, dk, dv, dqp, dkp;
  std::vector<double> kl{NAN};  // with qp, kp: the fp64 kl value (the backward's kl output)
};
inline RefBwd reference_bwd(const Problem& pb, Tensor& q, Tensor& k, Tensor& v, Tensor* qp, Tensor* kp,
                            const std::vector<int32_t>* indices, int topk, flashmsa_mode_t mode,
                            std::vector<double>& dout, std::vector<double>* dlse, double dkl) {
  const int64_t T = pb.total();
  std::vector<int32_t> cu32;
  for (auto c : pb.offsets()) cu32.push_back(int32_t(c));
  std::vector<int64_t> q3{T, pb.Hq, pb.D}, k3{T, pb.Hkv, pb.D}, qp3{T, pb.Hp, pb.Dp}, kp3{T, pb.Hpk, pb.Dp};
  RefFwd f = reference_fwd(pb, q, k, v, qp, kp, indices, topk, mode);
  RefBwd r;
  r.dq.assign(q.host.size(), NAN);
  r.dk.assign(k.host.size(), NAN);
  r.dv.assign(v.host.size(), NAN);
  flashmsa::BwdArgs a;
  a.q = host_view(q.host, q3);
  a.k = host_view(k.host, k3);
  a.v = host_view(v.host, k3);
  std::vector<double> dklv{dkl};
  if (qp) {
    a.qp = host_view(qp->host, qp3);
    a.kp = host_view(kp->host, kp3);
    r.dqp.assign(qp->host.size(), NAN);
    r.dkp.assign(kp->host.size(), NAN);
    a.dqp = host_view(r.dqp, qp3);
    a.dkp = host_view(r.dkp, kp3);
    a.dkl = host_view(dklv, {});
    a.kl = host_view(r.kl, {});
  }
  std::vector<int32_t> idx_copy;
  set_key_sets(a, pb, cu32, mode, indices, topk, idx_copy);
  a.out = host_view(f.out, q3);
  a.lse = host_view(f.lse, {pb.Hq, T});
  a.dout = host_view(dout, q3);
  if (dlse) a.dlse = host_view(*dlse, {pb.Hq, T});
  a.dq = host_view(r.dq, q3);
  a.dk = host_view(r.dk, k3);
  a.dv = host_view(r.dv, k3);
  flashmsa::bwd(a);
  return r;
}

// Straightforward same-dtype backward: the forward of straightforward_fwd, then dP = dO V in fp32
// rounded, D = <dO, O> with the rounded O, dS = P (dP - D + dlse) rounded, dq, dk, dv accumulated
// in fp32 and rounded once.
inline RefBwd straightforward_bwd(const Problem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const std::vector<double>& dout, const std::vector<double>* dlse,
                                  const std::vector<int32_t>* indices, int topk, flashmsa_mode_t mode) {
  using flashmsa::round_to;
  const auto dt = pb.dtype;
  const flashmsa::ref::Problem rp = ref_problem(pb, topk, mode);
  const double scale = 1.0 / std::sqrt(double(pb.D));
  const RefFwd f = straightforward_fwd(pb, q, k, v, indices, topk, mode);
  const int64_t n = int64_t(pb.Hq) * rp.total;
  const int T = int(std::min<int64_t>(flashmsa::ref::num_threads(), std::max<int64_t>(n, 1)));
  const size_t kv_elems = k.host.size();
  std::vector<std::vector<float>> dkb(static_cast<size_t>(T)), dvb(static_cast<size_t>(T));
  RefBwd r;
  r.dq.assign(q.host.size(), 0.0);
  flashmsa::ref::parallel_for(n, [&](int64_t first, int64_t, int tid) {
    auto& dk = dkb[size_t(tid)];
    auto& dv = dvb[size_t(tid)];
    dk.assign(kv_elems, 0.f);
    dv.assign(kv_elems, 0.f);
    std::vector<int64_t> keys;
    std::vector<float> s, pr;
    for (int64_t item = first; item < n; item += T) {
      const int h = int(item / rp.total);
      const int64_t t = item % rp.total;
      flashmsa::ref::key_set(rp, indices ? indices->data() : nullptr, rp.group_of(h), t, keys);
      if (keys.empty()) continue;
      const int c = rp.kv_of(h);
      const size_t qo = (size_t(t) * pb.Hq + h) * pb.D;
      const double lse = f.lse[size_t(h) * rp.total + t];
      float Dh = 0.f;
      for (int d = 0; d < pb.D; ++d) Dh += float(dout[qo + d]) * float(f.out[qo + d]);
      if (dlse) Dh -= float((*dlse)[size_t(h) * rp.total + t]);
      std::vector<float> dq(size_t(pb.D), 0.f);
      for (size_t j = 0; j < keys.size(); ++j) {
        const size_t ko = (size_t(keys[j]) * pb.Hkv + c) * pb.D;
        float sc = 0.f, dp = 0.f;
        for (int d = 0; d < pb.D; ++d) {
          sc += float(round_to(dt, q.host[qo + d] * scale)) * float(k.host[ko + d]);
          dp += float(dout[qo + d]) * float(v.host[ko + d]);
        }
        const float p = float(round_to(dt, std::exp(double(float(round_to(dt, sc))) - lse)));
        const float ds = float(round_to(dt, p * (float(round_to(dt, dp)) - Dh)));
        for (int d = 0; d < pb.D; ++d) {
          dq[size_t(d)] += ds * float(k.host[ko + d]);
          dk[ko + d] += ds * float(q.host[qo + d]);
          dv[ko + d] += p * float(dout[qo + d]);
        }
      }
      for (int d = 0; d < pb.D; ++d) r.dq[qo + d] = round_to(dt, dq[size_t(d)] * scale);
    }
  });
  r.dk.assign(kv_elems, 0.0);
  r.dv.assign(kv_elems, 0.0);
  for (size_t e = 0; e < kv_elems; ++e) {
    float a = 0.f, b2 = 0.f;
    for (int tt = 0; tt < T; ++tt) {
      if (dkb[size_t(tt)].empty()) continue;
      a += dkb[size_t(tt)][e];
      b2 += dvb[size_t(tt)][e];
    }
    r.dk[e] = round_to(dt, a * scale);
    r.dv[e] = round_to(dt, b2);
  }
  return r;
}

// The ideal low-precision backward of SPEC section 3's precise-dpsum bar: fp64 math (the fp64
// forward's lse and exact output for dpsum) with P and dS rounded to the dtype once, and the
// gradients rounded at the end. dv is not part of that bar and is left empty.
inline RefBwd ideal_bwd(const Problem& pb, const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<double>& dout, const RefFwd& f64, const std::vector<int32_t>* indices,
                        int topk, flashmsa_mode_t mode) {
  using flashmsa::round_to;
  const auto dt = pb.dtype;
  const flashmsa::ref::Problem rp = ref_problem(pb, topk, mode);
  const double scale = 1.0 / std::sqrt(double(pb.D));
  const int64_t n = int64_t(pb.Hq) * rp.total;
  const int T = int(std::min<int64_t>(flashmsa::ref::num_threads(), std::max<int64_t>(n, 1)));
  const size_t kv_elems = k.host.size();
  std::vector<std::vector<double>> dkb(static_cast<size_t>(T));
  RefBwd r;
  r.dq.assign(q.host.size(), 0.0);
  flashmsa::ref::parallel_for(n, [&](int64_t first, int64_t, int tid) {
    auto& dk = dkb[size_t(tid)];
    dk.assign(kv_elems, 0.0);
    std::vector<int64_t> keys;
    for (int64_t item = first; item < n; item += T) {
      const int h = int(item / rp.total);
      const int64_t t = item % rp.total;
      flashmsa::ref::key_set(rp, indices ? indices->data() : nullptr, rp.group_of(h), t, keys);
      if (keys.empty()) continue;
      const int c = rp.kv_of(h);
      const size_t qo = (size_t(t) * pb.Hq + h) * pb.D;
      const double lse = f64.lse[size_t(h) * rp.total + t];
      double Dh = 0;
      for (int d = 0; d < pb.D; ++d) Dh += dout[qo + d] * f64.out[qo + d];
      std::vector<double> dq(size_t(pb.D), 0.0);
      for (size_t j = 0; j < keys.size(); ++j) {
        const size_t ko = (size_t(keys[j]) * pb.Hkv + c) * pb.D;
        double sc = 0, dp = 0;
        for (int d = 0; d < pb.D; ++d) {
          sc += q.host[qo + d] * k.host[ko + d];
          dp += dout[qo + d] * v.host[ko + d];
        }
        const double p = std::exp(sc * scale - lse);
        const double ds = round_to(dt, p * (dp - Dh));
        for (int d = 0; d < pb.D; ++d) {
          dq[size_t(d)] += ds * k.host[ko + d];
          dk[ko + d] += ds * q.host[qo + d];
        }
      }
      for (int d = 0; d < pb.D; ++d) r.dq[qo + d] = round_to(dt, dq[size_t(d)] * scale);
    }
  });
  r.dk.assign(kv_elems, 0.0);
  for (size_t e = 0; e < kv_elems; ++e) {
    double a = 0;
    for (int tt = 0; tt < T; ++tt)
      if (!dkb[size_t(tt)].empty()) a += dkb[size_t(tt)][e];
    r.dk[e] = round_to(dt, a * scale);
  }
  return r;
}

// One (proxy head p, token t) row of the straightforward proxy side over its key set `keys`: the
// teacher as the fp32 mean of the group's heads' P, each rounded to the dtype (scores from q scaled
// and rounded, rounded again), and the student's logits z rounded to the dtype with their max m and
// sum of exp(z - m) in fp32.
struct StraightforwardRow {
  std::vector<float> teacher, z, s;
  float m = 0.f, sum = 0.f;
  void form(const Problem& pb, const flashmsa::ref::Problem& rp, const Tensor& q, const Tensor& k, const Tensor& qp,
            const Tensor& kp, int p, int64_t t, const std::vector<int64_t>& keys) {
    using flashmsa::round_to;
    const auto dt = pb.dtype;
    const double scale = 1.0 / std::sqrt(double(pb.D)), pscale = 1.0 / std::sqrt(double(pb.Dp));
    const int G = pb.Hq / pb.Hp;
    const size_t nk = keys.size();
    teacher.assign(nk, 0.f);
    s.resize(nk);
    for (int h = p * G; h < (p + 1) * G; ++h) {
      const int c = rp.kv_of(h);
      const size_t qo = (size_t(t) * pb.Hq + h) * pb.D;
      float mh = -INFINITY;
      for (size_t j = 0; j < nk; ++j) {
        float acc = 0.f;
        const size_t ko = (size_t(keys[j]) * pb.Hkv + c) * pb.D;
        for (int d = 0; d < pb.D; ++d) acc += float(round_to(dt, q.host[qo + d] * scale)) * float(k.host[ko + d]);
        s[j] = float(round_to(dt, acc));
        mh = std::max(mh, s[j]);
      }
      float sh = 0.f;
      for (size_t j = 0; j < nk; ++j) sh += std::exp(s[j] - mh);
      for (size_t j = 0; j < nk; ++j) teacher[j] += float(round_to(dt, std::exp(s[j] - mh) / sh)) / float(G);
    }
    const int c = rp.pk_of(p);
    const size_t qo = (size_t(t) * pb.Hp + p) * pb.Dp;
    z.resize(nk);
    m = -INFINITY;
    for (size_t j = 0; j < nk; ++j) {
      float acc = 0.f;
      const size_t ko = (size_t(keys[j]) * pb.Hpk + c) * pb.Dp;
      for (int d = 0; d < pb.Dp; ++d) acc += float(qp.host[qo + d]) * float(kp.host[ko + d]);
      z[j] = float(round_to(dt, acc * pscale));
      m = std::max(m, z[j]);
    }
    sum = 0.f;
    for (size_t j = 0; j < nk; ++j) sum += std::exp(z[j] - m);
  }
};

// Runs f(tid, p, t, row) for every (proxy head p, token t) row with a non-empty key set, the row formed
// (StraightforwardRow), on T threads (row items tid, tid + T, ...).
template <class F>
void for_each_straightforward_row(const Problem& pb, const flashmsa::ref::Problem& rp, const Tensor& q,
                                  const Tensor& k, const Tensor& qp, const Tensor& kp,
                                  const std::vector<int32_t>* indices, int T, F f) {
  const int64_t n = int64_t(pb.Hp) * rp.total;
  flashmsa::ref::parallel_for(n, T, [&](int64_t first, int64_t, int tid) {
    std::vector<int64_t> keys;
    StraightforwardRow row;
    for (int64_t item = first; item < n; item += T) {
      const int p = int(item / rp.total);
      const int64_t t = item % rp.total;
      flashmsa::ref::key_set(rp, indices ? indices->data() : nullptr, p, t, keys);
      if (keys.empty()) continue;
      row.form(pb, rp, q, k, qp, kp, p, t, keys);
      f(tid, p, t, keys, row);
    }
  });
}

// Straightforward same-dtype proxy gradient: P of the group's heads from the straightforward
// forward (rounded), the teacher as their fp32 mean, proxy logits rounded, the student softmax in
// fp32, dz rounded once, dqp and dkp accumulated in fp32 and rounded.
inline RefBwd straightforward_proxy_bwd(const Problem& pb, const Tensor& q, const Tensor& k, const Tensor& qp,
                                        const Tensor& kp, const std::vector<int32_t>* indices, int topk,
                                        flashmsa_mode_t mode, double g) {
  using flashmsa::round_to;
  const auto dt = pb.dtype;
  const flashmsa::ref::Problem rp = ref_problem(pb, topk, mode);
  const double pscale = 1.0 / std::sqrt(double(pb.Dp));
  const int64_t n = int64_t(pb.Hp) * rp.total;
  const float coef = float(g / double(n));
  const int T = int(std::min<int64_t>(flashmsa::ref::num_threads(), std::max<int64_t>(n, 1)));
  std::vector<std::vector<float>> dkpb(static_cast<size_t>(T));
  RefBwd r;
  r.dqp.assign(qp.host.size(), 0.0);
  for (auto& b : dkpb) b.assign(kp.host.size(), 0.f);
  for_each_straightforward_row(pb, rp, q, k, qp, kp, indices, T, [&](int tid, int p, int64_t t,
                                                                     const std::vector<int64_t>& keys,
                                                                     const StraightforwardRow& row) {
    auto& dkp = dkpb[size_t(tid)];
    const int c = rp.pk_of(p);
    const size_t qo = (size_t(t) * pb.Hp + p) * pb.Dp;
    std::vector<float> dq(size_t(pb.Dp), 0.f);
    for (size_t j = 0; j < keys.size(); ++j) {
      const float dz = float(round_to(dt, coef * (std::exp(row.z[j] - row.m) / row.sum - row.teacher[j])));
      const size_t ko = (size_t(keys[j]) * pb.Hpk + c) * pb.Dp;
      for (int d = 0; d < pb.Dp; ++d) {
        dq[size_t(d)] += dz * float(kp.host[ko + d]);
        dkp[ko + d] += dz * float(qp.host[qo + d]);
      }
    }
    for (int d = 0; d < pb.Dp; ++d) r.dqp[qo + d] = round_to(dt, dq[size_t(d)] * pscale);
  });
  r.dkp.assign(kp.host.size(), 0.0);
  for (size_t e = 0; e < kp.host.size(); ++e) {
    float a = 0.f;
    for (int tt = 0; tt < T; ++tt)
      if (!dkpb[size_t(tt)].empty()) a += dkpb[size_t(tt)][e];
    r.dkp[e] = round_to(dt, a * pscale);
  }
  return r;
}

// Straightforward same-dtype kl value (SPEC section 3's yardstick for the kl output): the teacher
// and the student as straightforward_proxy_bwd forms them (each head's P rounded to the dtype, the
// teacher their fp32 mean, the proxy logits rounded, the student softmax in fp32), each row's
// sum of t (ln t - ln s) over t > 0 in fp32, the rows' mean over the Hp x total rows in double.
inline double straightforward_kl(const Problem& pb, const Tensor& q, const Tensor& k, const Tensor& qp,
                                 const Tensor& kp, const std::vector<int32_t>* indices, int topk,
                                 flashmsa_mode_t mode) {
  const flashmsa::ref::Problem rp = ref_problem(pb, topk, mode);
  const int64_t n = int64_t(pb.Hp) * rp.total;
  const int T = int(std::min<int64_t>(flashmsa::ref::num_threads(), std::max<int64_t>(n, 1)));
  std::vector<double> part(static_cast<size_t>(T), 0.0);
  for_each_straightforward_row(pb, rp, q, k, qp, kp, indices, T, [&](int tid, int, int64_t,
                                                                     const std::vector<int64_t>& keys,
                                                                     const StraightforwardRow& row) {
    const float lsum = std::log(row.sum);
    float kl_row = 0.f;
    for (size_t j = 0; j < keys.size(); ++j)
      if (row.teacher[j] > 0.f) kl_row += row.teacher[j] * (std::log(row.teacher[j]) - (row.z[j] - row.m - lsum));
    part[size_t(tid)] += double(kl_row);
  });
  double total = 0.0;
  for (double x : part) total += x;
  return total / double(n);
}

}  // namespace gputest
