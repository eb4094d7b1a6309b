// CPU reference backend: see reference.hpp. Everything is fp64; work items are
// (proxy head p, token t) pairs, which own disjoint rows of out, lse, dq and dqp. Key-side
// gradients (dk, dv, dkp) go to per-thread buffers summed in thread order, so results are
// deterministic for a given thread count.
#include "reference/reference.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace flashmsa::ref {

namespace {
constexpr int kBlock = FLASHMSA_BLOCK_SIZE;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr double kKeyGradBudget = 4.0 * 1024 * 1024 * 1024;  // bytes of per-thread dk, dv, dkp

inline double dot(const double* a, const double* b, int n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int d = 0;
  for (; d + 4 <= n; d += 4) {
    s0 += a[d] * b[d];
    s1 += a[d + 1] * b[d + 1];
    s2 += a[d + 2] * b[d + 2];
    s3 += a[d + 3] * b[d + 3];
  }
  for (; d < n; ++d) s0 += a[d] * b[d];
  return (s0 + s1) + (s2 + s3);
}

inline void axpy(double a, const double* x, double* y, int n) {
  for (int d = 0; d < n; ++d) y[d] += a * x[d];
}

// log-sum-exp of x[0..n); -inf for n == 0. Also returns the max through m.
inline double logsumexp(const std::vector<double>& x, size_t n) {
  if (n == 0) return kNegInf;
  double m = kNegInf;
  for (size_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  if (m == kNegInf) return kNegInf;
  double s = 0;
  for (size_t j = 0; j < n; ++j) s += std::exp(x[j] - m);
  return m + std::log(s);
}

struct Scratch {
  std::vector<int64_t> keys;
  std::vector<double> x, z, p, teacher, orow, tmp;
};
}  // namespace

int Problem::seq_of(int64_t t) const {
  // last b with cu[b] <= t and cu[b+1] > t (skips empty sequences)
  auto it = std::upper_bound(cu.begin(), cu.end(), t);
  return int(it - cu.begin()) - 1;
}

Problem::Query Problem::query(int64_t t) const {
  if (cuq.empty()) {
    const int b = seq_of(t);
    return {b, cu[size_t(b)], t - cu[size_t(b)]};
  }
  // last segment s with cuq[s] <= t < cuq[s+1] (skips empty segments)
  const size_t s = size_t(std::upper_bound(cuq.begin(), cuq.end(), t) - cuq.begin()) - 1;
  const int b = qseq[s];
  return {b, cu[size_t(b)], qpos[s] + (t - cuq[s])};
}

int num_threads() {
  const char* env = std::getenv("FLASHMSA_NUM_THREADS");
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(env, &end, 10);
    const bool digits =
        std::all_of(env, static_cast<const char*>(end), [](char ch) { return ch >= '0' && ch <= '9'; });
    if (errno != 0 || end == env || *end != '\0' || !digits || n < 1 || n > kMaxThreads)
      throw std::invalid_argument("FLASHMSA_NUM_THREADS: expected an integer in [1, " +
                                  std::to_string(kMaxThreads) + "] (or unset: the hardware's), got '" +
                                  std::string(env) + "'");
    return int(n);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? int(std::min<unsigned>(hw, unsigned(kMaxThreads))) : 1;
}

int threads_for(int64_t n) {
  return int(std::min<int64_t>(num_threads(), std::max<int64_t>(n, 1)));
}

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn) {
  parallel_for(n, threads_for(n), fn);
}

// Static interleaved assignment (item r goes to thread r % T): balanced for causal work and
// deterministic for a given T. fn(tid, n, tid) runs once per tid; threads that cannot be
// started leave their tids to the calling thread (same work split, same result).
void parallel_for(int64_t n, int T, const std::function<void(int64_t, int64_t, int)>& fn) {
  T = std::max(T, 1);
  if (T == 1) {
    fn(0, n, 0);
    return;
  }
  // The first exception is kept and rethrown; after it, the tids not yet begun are skipped (a
  // failure is usually out of memory: holding one exception object per tid could exhaust even the
  // runtime's emergency pool for exceptions, and std::terminate would follow).
  std::exception_ptr error;
  std::mutex error_mutex;
  std::atomic<bool> failed{false};
  auto body = [&](int tid) {
    if (failed.load()) return;
    try {
      fn(tid, n, tid);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      failed = true;
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(size_t(T) - 1);
  int started = 1;  // tids [1, started) run on their own threads
  for (; started < T; ++started) {
    try {
      pool.emplace_back(body, started);
    } catch (...) {  // std::system_error (EAGAIN: no threads left), std::bad_alloc
      break;
    }
  }
  body(0);
  for (int tid = started; tid < T; ++tid) body(tid);
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

// Helper: iterate the items of thread tid under parallel_for's interleaving.
template <class F>
static void for_items(int64_t first, int64_t n, int stride_threads, F&& f) {
  for (int64_t r = first; r < n; r += stride_threads) f(r);
}

void key_set(const Problem& pb, const int32_t* indices, int p, int64_t t,
             std::vector<int64_t>& keys) {
  keys.clear();
  const Problem::Query qy = pb.query(t);
  const int64_t s0 = qy.s0, len = pb.cu[size_t(qy.b) + 1] - s0, last = s0 + qy.pos;  // last key row
  if (pb.mode == FLASHMSA_MODE_DENSE) {
    for (int64_t u = s0; u <= last; ++u) keys.push_back(u);
    return;
  }
  const int64_t nblocks = (len + kBlock - 1) / kBlock;
  const int32_t* row = indices + (int64_t(p) * pb.total + t) * pb.topk;
  for (int s = 0; s < pb.topk; ++s) {
    const int64_t j = row[s];
    if (j < 0 || j >= nblocks) continue;  // empty slot
    const int64_t lo = s0 + j * kBlock, hi = std::min(lo + kBlock, last + 1);
    for (int64_t u = lo; u < hi; ++u) keys.push_back(u);
  }
}

double round_e4m3(float x) {
  if (std::isnan(x)) return std::numeric_limits<double>::quiet_NaN();
  const double a = std::fabs(double(x));
  // 448 is the largest value; from the tie with the next binade step (464) up, RNE would leave the format
  if (a >= 464.0) return std::copysign(448.0, double(x));
  if (a == 0.0) return std::copysign(0.0, double(x));
  int e = 0;
  std::frexp(a, &e);                 // a in [2^(e-1), 2^e)
  const int E = std::max(e - 1, -6);  // subnormals keep the smallest normal binade's quantum, 2^-9
  const double quantum = std::ldexp(1.0, E - 3);
  return std::copysign(std::nearbyint(a / quantum) * quantum, double(x));  // round to nearest, ties to even
}

namespace {
// One fp8 group: rows x Dp values, row r at v + r * row_stride, quantised and dequantised in place.
void fp8_group(double* v, int64_t rows, int64_t row_stride, int Dp) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < Dp; ++d) {
      const float f = float(v[r * row_stride + d]);
      finite = finite && std::isfinite(f);
      amax = std::max(amax, std::fabs(f));
    }
  if (amax == 0.f && finite) return;
  const float inv = 448.f / amax, scale = amax / 448.f;
  for (int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < Dp; ++d) {
      double& x = v[r * row_stride + d];
      x = finite ? round_e4m3(float(x) * inv) * double(scale) : std::numeric_limits<double>::quiet_NaN();
    }
}
}  // namespace

void quantize_fp8_selection(const Problem& pb, std::vector<double>& qp, std::vector<double>& kp) {
  const int Dp = pb.Dp;
  for (int64_t t = 0; t < pb.total; ++t)  // qp: one group per (row, head)
    for (int p = 0; p < pb.Hp; ++p) fp8_group(qp.data() + (t * pb.Hp + p) * Dp, 1, 0, Dp);
  // kp: one group per (key block of its sequence, head): the block's rows x Dp
  for (size_t b = 0; b + 1 < pb.cu.size(); ++b)
    for (int64_t lo = pb.cu[b]; lo < pb.cu[b + 1]; lo += kBlock)
      for (int c = 0; c < pb.Hpk; ++c)
        fp8_group(kp.data() + (lo * pb.Hpk + c) * Dp, std::min<int64_t>(kBlock, pb.cu[b + 1] - lo),
                  int64_t(pb.Hpk) * Dp, Dp);
}

void proxy_lse_of(const Problem& pb, const double* qp, const double* kp, const int32_t* indices, double* out) {
  const int64_t n = int64_t(pb.Hp) * pb.total;
  const int T = threads_for(n);
  parallel_for(n, T, [&](int64_t first, int64_t, int) {
    std::vector<int64_t> keys;
    std::vector<double> z;
    for_items(first, n, T, [&](int64_t r) {
      const int p = int(r / pb.total);
      const int64_t t = r % pb.total;
      key_set(pb, indices, p, t, keys);
      const double* qrow = qp + (t * pb.Hp + p) * pb.Dp;
      const int c = pb.pk_of(p);
      z.resize(keys.size());
      for (size_t j = 0; j < keys.size(); ++j) z[j] = pb.proxy_scale * dot(qrow, kp + (keys[j] * pb.Hpk + c) * pb.Dp, pb.Dp);
      out[r] = logsumexp(z, z.size());
    });
  });
}

void select(const Problem& pb, const double* qp, const double* kp, int32_t* indices,
            double* proxy_lse) {
  const int64_t n = int64_t(pb.Hp) * pb.total;
  const int T = threads_for(n);
  parallel_for(n, T, [&](int64_t first, int64_t, int) {
    std::vector<double> z, score;
    std::vector<int> order;
    for_items(first, n, T, [&](int64_t r) {
      const int p = int(r / pb.total);
      const int64_t t = r % pb.total;
      const Problem::Query qy = pb.query(t);
      const int64_t s0 = qy.s0, pos = qy.pos, l = pos / kBlock;
      const double* qrow = qp + (t * pb.Hp + p) * pb.Dp;
      const int c = pb.pk_of(p);
      z.assign(size_t(pos + 1), 0.0);
      for (int64_t u = 0; u <= pos; ++u)
        z[size_t(u)] = pb.proxy_scale * dot(qrow, kp + ((s0 + u) * pb.Hpk + c) * pb.Dp, pb.Dp);
      score.assign(size_t(l), kNegInf);
      for (int64_t u = 0; u < l * kBlock; ++u)
        score[size_t(u / kBlock)] = std::max(score[size_t(u / kBlock)], z[size_t(u)]);
      order.resize(size_t(l));
      for (int j = 0; j < int(l); ++j) order[size_t(j)] = j;
      const int64_t nsel = std::min<int64_t>(pb.topk - 1, l);  // non-local slots
      std::partial_sort(order.begin(), order.begin() + nsel, order.end(), [&](int a, int c2) {
        if (score[size_t(a)] != score[size_t(c2)]) return score[size_t(a)] > score[size_t(c2)];
        return a < c2;
      });
      int32_t* row = indices + r * pb.topk;
      for (int s = 0; s < pb.topk; ++s) row[s] = -1;
      for (int64_t s = 0; s < nsel; ++s) row[s] = order[size_t(s)];
      row[nsel] = int32_t(l);
      if (proxy_lse) {
        // log-normaliser over the selected keys (u <= pos)
        double m = kNegInf;
        for (int64_t s = 0; s <= nsel; ++s) {
          const int64_t lo = int64_t(row[s]) * kBlock, hi = std::min(lo + kBlock, pos + 1);
          for (int64_t u = lo; u < hi; ++u) m = std::max(m, z[size_t(u)]);
        }
        double sum = 0;
        for (int64_t s = 0; s <= nsel; ++s) {
          const int64_t lo = int64_t(row[s]) * kBlock, hi = std::min(lo + kBlock, pos + 1);
          for (int64_t u = lo; u < hi; ++u) sum += std::exp(z[size_t(u)] - m);
        }
        proxy_lse[r] = m + std::log(sum);
      }
    });
  });
}

// Main-attention probabilities of head h at token t over keys: fills sc.p, returns the lse.
static double main_probs(const Problem& pb, const double* q, const double* k, int h, int64_t t,
                         Scratch& sc) {
  const size_t n = sc.keys.size();
  const int c = pb.kv_of(h);
  const double* qrow = q + (t * pb.Hq + h) * pb.D;
  sc.x.resize(n);
  for (size_t j = 0; j < n; ++j)
    sc.x[j] = pb.scale * dot(qrow, k + (sc.keys[j] * pb.Hkv + c) * pb.D, pb.D);
  const double lse = logsumexp(sc.x, n);
  sc.p.resize(n);
  for (size_t j = 0; j < n; ++j) sc.p[j] = std::exp(sc.x[j] - lse);
  return lse;
}

// Proxy (student) softmax of proxy head p at token t over keys: fills sc.z with the
// probabilities and sc.tmp with their logs (z - lse, exact where a probability underflows to
// 0), returns the proxy lse.
static double proxy_probs(const Problem& pb, const double* qp, const double* kp, int p,
                          int64_t t, Scratch& sc) {
  const size_t n = sc.keys.size();
  const int c = pb.pk_of(p);
  const double* qrow = qp + (t * pb.Hp + p) * pb.Dp;
  sc.z.resize(n);
  for (size_t j = 0; j < n; ++j)
    sc.z[j] = pb.proxy_scale * dot(qrow, kp + (sc.keys[j] * pb.Hpk + c) * pb.Dp, pb.Dp);
  const double lse = logsumexp(sc.z, n);
  sc.tmp.resize(n);
  for (size_t j = 0; j < n; ++j) {
    sc.tmp[j] = sc.z[j] - lse;
    sc.z[j] = std::exp(sc.tmp[j]);
  }
  return lse;
}

// sum_j t_j log(t_j / s_j), with 0 log 0 = 0; log_s holds log s_j (finite even where s_j
// underflows to 0, e.g. at a large proxy scale). Only an exact zero is skipped: a NaN teacher
// (`t > 0` is false for it) or student makes the row NaN, as it makes the row's gradient.
static double kl_row(const std::vector<double>& t, const std::vector<double>& log_s, size_t n) {
  double acc = 0;
  for (size_t j = 0; j < n; ++j)
    if (t[j] != 0) acc += t[j] * (std::log(t[j]) - log_s[j]);
  return acc;
}

void forward(const Problem& pb, const double* q, const double* k, const double* v,
             const double* qp, const double* kp, const int32_t* indices, const FwdOut& o) {
  const int64_t n = int64_t(pb.Hp) * pb.total;
  const int G = pb.group_size();
  const bool proxy = qp && kp;
  std::vector<double> kl_rows(size_t(n), 0.0);
  const int T = threads_for(n);
  parallel_for(n, T, [&](int64_t first, int64_t, int) {
    Scratch sc;
    for_items(first, n, T, [&](int64_t r) {
      const int p = int(r / pb.total);
      const int64_t t = r % pb.total;
      key_set(pb, indices, p, t, sc.keys);
      const size_t nk = sc.keys.size();
      sc.teacher.assign(nk, 0.0);
      for (int h = p * G; h < (p + 1) * G; ++h) {
        const int c = pb.kv_of(h);
        const double lse = main_probs(pb, q, k, h, t, sc);
        o.lse[int64_t(h) * pb.total + t] = lse;
        double* orow = o.out + (t * pb.Hq + h) * pb.D;
        std::fill(orow, orow + pb.D, 0.0);
        for (size_t j = 0; j < nk; ++j) {
          axpy(sc.p[j], v + (sc.keys[j] * pb.Hkv + c) * pb.D, orow, pb.D);
          sc.teacher[j] += sc.p[j] / G;
        }
      }
      if (proxy) {
        const double plse = proxy_probs(pb, qp, kp, p, t, sc);
        if (o.proxy_lse) o.proxy_lse[r] = plse;
        kl_rows[size_t(r)] = kl_row(sc.teacher, sc.tmp, nk);
      }
    });
  });
  if (o.kl) {
    double s = 0;
    for (double x : kl_rows) s += x;
    *o.kl = (proxy && n > 0) ? s / double(n) : 0.0;
  }
}

void backward(const Problem& pb, const double* q, const double* k, const double* v,
              const double* qp, const double* kp, const int32_t* indices, const double* dout,
              const double* dlse, double dkl, const BwdOut& o) {
  const int64_t n = int64_t(pb.Hp) * pb.total;
  const int G = pb.group_size();
  const bool proxy = qp && kp && o.dqp && o.dkp && dkl != 0.0;
  const bool want_kl = qp && kp && o.kl;
  std::vector<double> kl_rows(want_kl ? size_t(n) : 0, 0.0);
  const double kl_coef = n > 0 ? dkl / double(n) : 0.0;  // g / N
  const size_t kv_elems = size_t(pb.total_k) * pb.Hkv * pb.D;
  const size_t kp_elems = size_t(pb.total_k) * pb.Hpk * pb.Dp;
  // Every thread keeps its own dk, dv (and dkp) buffers: at most kKeyGradBudget bytes of them
  // in all (one thread's worth at least), so many threads on a long sequence cannot exhaust the
  // host's memory. T depends on the thread setting and the problem only: still deterministic.
  const double per_thread = 8.0 * (2.0 * double(kv_elems) + (proxy ? double(kp_elems) : 0.0));
  const int T = int(std::max<double>(
      1.0, std::min<double>(threads_for(n), std::floor(kKeyGradBudget / std::max(per_thread, 1.0)))));
  std::vector<std::vector<double>> dk_buf(static_cast<size_t>(T)), dv_buf(static_cast<size_t>(T)),
      dkp_buf(static_cast<size_t>(T));
  std::fill(o.dq, o.dq + size_t(pb.total) * pb.Hq * pb.D, 0.0);
  if (o.dqp) std::fill(o.dqp, o.dqp + size_t(pb.total) * pb.Hp * pb.Dp, 0.0);
  parallel_for(n, T, [&](int64_t first, int64_t, int tid) {
    Scratch sc;
    auto& dk = dk_buf[size_t(tid)];
    auto& dv = dv_buf[size_t(tid)];
    auto& dkp = dkp_buf[size_t(tid)];
    dk.assign(kv_elems, 0.0);
    dv.assign(kv_elems, 0.0);
    if (proxy) dkp.assign(kp_elems, 0.0);
    for_items(first, n, T, [&](int64_t r) {
      const int p = int(r / pb.total);
      const int64_t t = r % pb.total;
      key_set(pb, indices, p, t, sc.keys);
      const size_t nk = sc.keys.size();
      if (nk == 0) return;  // empty set: zero gradients, adds nothing
      sc.teacher.assign(nk, 0.0);
      for (int h = p * G; h < (p + 1) * G; ++h) {
        const int c = pb.kv_of(h);
        main_probs(pb, q, k, h, t, sc);
        const double* qrow = q + (t * pb.Hq + h) * pb.D;
        const double* dorow = dout + (t * pb.Hq + h) * pb.D;
        // D_h(t) = <dout, out> with the exact fp64 out
        sc.orow.assign(size_t(pb.D), 0.0);
        for (size_t j = 0; j < nk; ++j)
          axpy(sc.p[j], v + (sc.keys[j] * pb.Hkv + c) * pb.D, sc.orow.data(), pb.D);
        const double Dh = dot(dorow, sc.orow.data(), pb.D);
        const double shift = Dh - (dlse ? dlse[int64_t(h) * pb.total + t] : 0.0);
        double* dqrow = o.dq + (t * pb.Hq + h) * pb.D;
        for (size_t j = 0; j < nk; ++j) {
          const int64_t krow = (sc.keys[j] * pb.Hkv + c) * pb.D;
          const double dP = dot(dorow, v + krow, pb.D);
          const double dS = sc.p[j] * (dP - shift);
          axpy(pb.scale * dS, k + krow, dqrow, pb.D);
          axpy(pb.scale * dS, qrow, dk.data() + krow, pb.D);
          axpy(sc.p[j], dorow, dv.data() + krow, pb.D);
          sc.teacher[j] += sc.p[j] / G;
        }
      }
      if (proxy || want_kl) proxy_probs(pb, qp, kp, p, t, sc);
      if (want_kl) kl_rows[size_t(r)] = kl_row(sc.teacher, sc.tmp, nk);
      if (proxy) {
        const int c = pb.pk_of(p);
        const double* qprow = qp + (t * pb.Hp + p) * pb.Dp;
        double* dqprow = o.dqp + (t * pb.Hp + p) * pb.Dp;
        for (size_t j = 0; j < nk; ++j) {
          const double dz = kl_coef * (sc.z[j] - sc.teacher[j]);
          const int64_t krow = (sc.keys[j] * pb.Hpk + c) * pb.Dp;
          axpy(pb.proxy_scale * dz, kp + krow, dqprow, pb.Dp);
          axpy(pb.proxy_scale * dz, qprow, dkp.data() + krow, pb.Dp);
        }
      }
    });
  });
  // Reduce the per-thread key-side buffers in thread order (deterministic).
  auto reduce = [&](std::vector<std::vector<double>>& bufs, double* dst, size_t elems) {
    std::fill(dst, dst + elems, 0.0);
    const int TT = threads_for(int64_t(elems));
    parallel_for(int64_t(elems), TT, [&](int64_t first, int64_t total_n, int) {
      const int64_t chunk = (total_n + TT - 1) / TT;
      const int64_t lo = first * chunk, hi = std::min<int64_t>(total_n, lo + chunk);
      for (const auto& b : bufs)
        if (!b.empty())
          for (int64_t e = lo; e < hi; ++e) dst[e] += b[size_t(e)];
    });
  };
  if (o.kl) {  // summed in row order, as forward() does
    double s = 0;
    for (double x : kl_rows) s += x;
    *o.kl = (want_kl && n > 0) ? s / double(n) : 0.0;
  }
  reduce(dk_buf, o.dk, kv_elems);
  reduce(dv_buf, o.dv, kv_elems);
  if (o.dkp) {
    if (proxy) reduce(dkp_buf, o.dkp, kp_elems);
    else std::fill(o.dkp, o.dkp + kp_elems, 0.0);
  }
}

double mass_recall(const Problem& pb, const double* q, const double* k, const int32_t* indices,
                   const std::vector<int64_t>& rows) {
  const int64_t n = int64_t(rows.size()) * pb.Hq;
  if (n == 0) return 1.0;
  std::vector<double> rec(size_t(n), 0.0);
  const int T = threads_for(n);
  parallel_for(n, T, [&](int64_t first, int64_t, int) {
    Scratch sc;
    std::vector<double> xd;
    for_items(first, n, T, [&](int64_t r) {
      const int64_t t = rows[size_t(r / pb.Hq)];
      const int h = int(r % pb.Hq), c = pb.kv_of(h);
      const Problem::Query qy = pb.query(t);
      const double* qrow = q + (t * pb.Hq + h) * pb.D;
      xd.resize(size_t(qy.pos + 1));
      for (int64_t u = qy.s0; u <= qy.s0 + qy.pos; ++u)
        xd[size_t(u - qy.s0)] = pb.scale * dot(qrow, k + (u * pb.Hkv + c) * pb.D, pb.D);
      const double lse_dense = logsumexp(xd, xd.size());
      key_set(pb, indices, pb.group_of(h), t, sc.keys);
      double mass = 0;
      for (int64_t u : sc.keys) mass += std::exp(xd[size_t(u - qy.s0)] - lse_dense);
      rec[size_t(r)] = mass;
    });
  });
  double s = 0;
  for (double x : rec) s += x;
  return s / double(n);
}

PairCounts count_pairs(const Problem& pb, const int32_t* indices) {
  PairCounts pc;
  std::vector<int64_t> keys;
  for (int p = 0; p < pb.Hp; ++p)
    for (int64_t t = 0; t < pb.total; ++t) {
      const int64_t pos = pb.query(t).pos;
      pc.proxy_pairs += double(pos + 1);
      if (pb.mode == FLASHMSA_MODE_DENSE) {
        pc.main_pairs += double(pos + 1) * pb.group_size();
      } else {
        key_set(pb, indices, p, t, keys);
        pc.main_pairs += double(keys.size()) * pb.group_size();
      }
    }
  return pc;
}

}  // namespace flashmsa::ref
