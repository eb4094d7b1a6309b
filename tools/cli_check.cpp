#include "cli_check.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "cli_device.hpp"
#include "cli_keys.hpp"
#include "cli_stats.hpp"
#include "cli_util.hpp"
#include "flashmsa/flashmsa.hpp"

namespace flashmsa::cli {

namespace {

double threshold_for(flashmsa_dtype_t t) {
  switch (t) {
    case FLASHMSA_DTYPE_FP32: return 1e-5;
    case FLASHMSA_DTYPE_FP64: return 1e-12;
    default: return 2e-2;
  }
}

Err compare_all(const char* name, const Buf& got, const std::vector<double>& want) {
  Err e;
  e.name = name;
  for (int64_t i = 0; i < got.numel(); ++i) e.add(got.get(i), want[size_t(i)]);
  return e;
}

// Small problems: the whole step again through the CPU backend with fp64 tensors (the
// reference), the forward and backward fed the kernel's own indices (SPEC section 4).
void check_full(const Config& c, const Tensors& t, CheckResult& r) {
  const flashmsa_dtype_t F = FLASHMSA_DTYPE_FP64;
  const int64_t T = c.total;
  r.scope = "all " + std::to_string(T) + " tokens, every output";
  std::vector<double> q = t.q.values(), k = t.k.values(), v = t.v.values(), qp = t.qp.values(),
                      kp = t.kp.values();
  std::vector<int32_t> cu(c.cu.begin(), c.cu.end());
  const flashmsa_tensor_t cu_v = flashmsa::view(cu.data(), FLASHMSA_DTYPE_INT32, {int64_t(cu.size())});
  auto tok = [&](std::vector<double>& x, int H, int X) {
    return flashmsa::view(x.empty() ? nullptr : x.data(), F, {T, H, X});
  };
  std::vector<int32_t> kidx;  // the kernel's indices, dense
  if (c.sparse()) {
    kidx.assign(t.indices.i32(), t.indices.i32() + t.indices.numel());
    std::vector<int32_t> ridx(kidx.size(), -1);
    flashmsa::SelectArgs s;
    s.qp = tok(qp, c.Hp, c.Dp);
    s.kp = tok(kp, c.Hpk, c.Dp);
    s.cu_seqlens = cu_v;
    s.max_seqlen = c.max_seqlen;
    s.topk = c.topk;
    s.indices = flashmsa::view(ridx.empty() ? nullptr : ridx.data(), FLASHMSA_DTYPE_INT32,
                               {c.Hp, T, c.topk});
    flashmsa::select(s);
    int64_t same = 0;
    for (size_t i = 0; i < ridx.size(); ++i) same += ridx[i] == kidx[i];
    r.index_slots = int64_t(ridx.size());
    r.index_agreement = ridx.empty() ? 1.0 : double(same) / double(ridx.size());
  }
  const flashmsa_mode_t mode = c.sparse() ? FLASHMSA_MODE_GIVEN : FLASHMSA_MODE_DENSE;
  const flashmsa_tensor_t idx_v =
      c.sparse() ? flashmsa::view(kidx.empty() ? nullptr : kidx.data(), FLASHMSA_DTYPE_INT32,
                                  {c.Hp, T, c.topk})
                 : flashmsa::none();
  std::vector<double> out(size_t(T) * c.Hq * c.D), lse(size_t(c.Hq) * T), plse(size_t(c.Hp) * T);
  double kl = 0;
  auto heads = [&](std::vector<double>& x, int H) {
    return flashmsa::view(x.empty() ? nullptr : x.data(), F, {H, T});
  };
  flashmsa::FwdArgs f;
  f.q = tok(q, c.Hq, c.D);
  f.k = tok(k, c.Hkv, c.D);
  f.v = tok(v, c.Hkv, c.D);
  f.qp = tok(qp, c.Hp, c.Dp);
  f.kp = tok(kp, c.Hpk, c.Dp);
  f.cu_seqlens = cu_v;
  f.max_seqlen = c.max_seqlen;
  f.mode = mode;
  f.compute_kl = 1;
  f.indices = idx_v;
  f.out = tok(out, c.Hq, c.D);
  f.lse = heads(lse, c.Hq);
  f.proxy_lse = heads(plse, c.Hp);
  f.kl = flashmsa::view(&kl, F, {});
  flashmsa::fwd(f);
  r.errs.push_back(compare_all("out", t.out, out));
  r.errs.push_back(compare_all("lse", t.lse, lse));
  r.errs.push_back(compare_all("proxy_lse", t.proxy_lse, plse));
  r.errs.push_back(compare_all("kl", t.kl, {kl}));
  if (!c.has_bwd()) return;
  std::vector<double> dout = t.dout.values(), dlse = c.dlse ? t.dlse.values() : std::vector<double>();
  double dkl = c.kl_grad;
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), dqp(qp.size()), dkp(kp.size());
  flashmsa::BwdArgs b;
  b.q = f.q;
  b.k = f.k;
  b.v = f.v;
  b.qp = f.qp;
  b.kp = f.kp;
  b.cu_seqlens = cu_v;
  b.max_seqlen = c.max_seqlen;
  b.mode = mode;
  b.indices = idx_v;
  b.out = f.out;
  b.lse = f.lse;
  b.proxy_lse = f.proxy_lse;
  b.dout = tok(dout, c.Hq, c.D);
  if (c.dlse) b.dlse = heads(dlse, c.Hq);
  b.dkl = flashmsa::view(&dkl, F, {});
  b.dq = tok(dq, c.Hq, c.D);
  b.dk = tok(dk, c.Hkv, c.D);
  b.dv = tok(dv, c.Hkv, c.D);
  b.dqp = tok(dqp, c.Hp, c.Dp);
  b.dkp = tok(dkp, c.Hpk, c.Dp);
  flashmsa::bwd(b);
  r.errs.push_back(compare_all("dq", t.dq, dq));
  r.errs.push_back(compare_all("dk", t.dk, dk));
  r.errs.push_back(compare_all("dv", t.dv, dv));
  r.errs.push_back(compare_all("dqp", t.dqp, dqp));
  r.errs.push_back(compare_all("dkp", t.dkp, dkp));
}

double dotd(const double* a, const double* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The selection row of the spec for token t (global) and proxy head p, in fp64.
void select_row(const Config& c, const std::vector<double>& qp, const std::vector<double>& kp,
                int p, int64_t t, int32_t* row) {
  const double proxy_scale = c.proxy_scale();
  const int b = seq_of(c, t);
  const int64_t s0 = c.cu[size_t(b)], pos = t - s0, l = pos / kBlock;
  const double* qrow = qp.data() + (t * c.Hp + p) * c.Dp;
  const int pk = pk_of(c, p);
  std::vector<double> score(size_t(l), -INFINITY);
  for (int64_t u = 0; u < l * kBlock; ++u) {
    const double z = proxy_scale * dotd(qrow, kp.data() + ((s0 + u) * c.Hpk + pk) * c.Dp, c.Dp);
    score[size_t(u / kBlock)] = std::max(score[size_t(u / kBlock)], z);
  }
  std::vector<int> order(static_cast<size_t>(l));
  for (int j = 0; j < int(l); ++j) order[size_t(j)] = j;
  const int64_t nsel = std::min<int64_t>(c.topk - 1, l);
  std::partial_sort(order.begin(), order.begin() + nsel, order.end(), [&](int x, int y) {
    return score[size_t(x)] != score[size_t(y)] ? score[size_t(x)] > score[size_t(y)] : x < y;
  });
  for (int s = 0; s < c.topk; ++s) row[s] = -1;
  for (int64_t s = 0; s < nsel; ++s) row[s] = order[size_t(s)];
  row[nsel] = int32_t(l);
}

// Large problems: a seeded sample of tokens; per (token, proxy head) the fp64 rows of out,
// lse, dq, proxy_lse, dqp over the kernel's own key sets, and the selection row.
// dk, dv, dkp (sums over all queries) and kl (a sum over all tokens) are not checked here.
void check_sampled(const Config& c, const Tensors& t, CheckResult& r) {
  const std::vector<int64_t> rows = sample_rows(c);
  r.scope = "seeded sample of " + std::to_string(rows.size()) + " of " + std::to_string(c.total) +
            " tokens: out, lse, proxy_lse, dq, dqp, indices (dk, dv, dkp, kl not checked)";
  const double scale = c.scale(), proxy_scale = c.proxy_scale();
  const std::vector<double> q = t.q.values(), k = t.k.values(), v = t.v.values(),
                            qp = t.qp.values(), kp = t.kp.values();
  const std::vector<double> dout = c.has_bwd() ? t.dout.values() : std::vector<double>();
  const std::vector<double> dlse = c.dlse ? t.dlse.values() : std::vector<double>();
  const int G = c.Hq / c.Hp, D = c.D, Dp = c.Dp;
  const double N = double(c.Hp) * double(c.total);
  const int64_t n = int64_t(rows.size()) * c.Hp;
  // per item: reference values laid out as the kernel's, compared afterwards in item order
  struct Item {
    std::vector<double> out, lse, dq, dqp;
    double plse = 0;
    std::vector<int32_t> sel;
  };
  std::vector<Item> items(static_cast<size_t>(n));
  const int32_t* kidx = c.sparse() ? t.indices.i32() : nullptr;
  parallel_items(n, [&](int64_t it) {
    const int64_t tok = rows[size_t(it / c.Hp)];
    const int p = int(it % c.Hp);
    Item& I = items[size_t(it)];
    std::vector<int64_t> keys;
    key_set(c, kidx, p, tok, keys);
    const size_t nk = keys.size();
    std::vector<double> x(nk), P(nk), teacher(nk, 0.0), orow(static_cast<size_t>(D));
    I.out.assign(size_t(G) * D, 0.0);
    I.lse.assign(size_t(G), -INFINITY);
    I.dq.assign(size_t(G) * D, 0.0);
    for (int g = 0; g < G; ++g) {
      const int h = p * G + g, kv = kv_of(c, h);
      const double* qrow = q.data() + (tok * c.Hq + h) * D;
      double m = -INFINITY;
      for (size_t j = 0; j < nk; ++j) {
        x[j] = scale * dotd(qrow, k.data() + (keys[j] * c.Hkv + kv) * D, D);
        m = std::max(m, x[j]);
      }
      if (nk == 0) continue;
      double sum = 0;
      for (size_t j = 0; j < nk; ++j) sum += std::exp(x[j] - m);
      const double lse = m + std::log(sum);
      I.lse[size_t(g)] = lse;
      std::fill(orow.begin(), orow.end(), 0.0);
      for (size_t j = 0; j < nk; ++j) {
        P[j] = std::exp(x[j] - lse);
        teacher[j] += P[j] / G;
        const double* vrow = v.data() + (keys[j] * c.Hkv + kv) * D;
        for (int d = 0; d < D; ++d) orow[size_t(d)] += P[j] * vrow[d];
      }
      std::copy(orow.begin(), orow.end(), I.out.begin() + int64_t(g) * D);
      if (!c.has_bwd()) continue;
      const double* dorow = dout.data() + (tok * c.Hq + h) * D;
      const double shift = dotd(dorow, orow.data(), D) - (c.dlse ? dlse[size_t(h) * c.total + tok] : 0.0);
      double* dqrow = I.dq.data() + int64_t(g) * D;
      for (size_t j = 0; j < nk; ++j) {
        const double dP = dotd(dorow, v.data() + (keys[j] * c.Hkv + kv) * D, D);
        const double dS = P[j] * (dP - shift);
        const double* krow = k.data() + (keys[j] * c.Hkv + kv) * D;
        for (int d = 0; d < D; ++d) dqrow[d] += scale * dS * krow[d];
      }
    }
    // proxy row: student softmax, proxy_lse, dqp
    const int pk = pk_of(c, p);
    const double* qprow = qp.data() + (tok * c.Hp + p) * Dp;
    std::vector<double> z(nk);
    double m = -INFINITY;
    for (size_t j = 0; j < nk; ++j) {
      z[j] = proxy_scale * dotd(qprow, kp.data() + (keys[j] * c.Hpk + pk) * Dp, Dp);
      m = std::max(m, z[j]);
    }
    double sum = 0;
    for (size_t j = 0; j < nk; ++j) sum += std::exp(z[j] - m);
    I.plse = nk ? m + std::log(sum) : -INFINITY;
    I.dqp.assign(size_t(Dp), 0.0);
    if (c.has_bwd() && c.kl_grad != 0)
      for (size_t j = 0; j < nk; ++j) {
        const double dz = (c.kl_grad / N) * (std::exp(z[j] - I.plse) - teacher[j]);
        const double* kprow = kp.data() + (keys[j] * c.Hpk + pk) * Dp;
        for (int d = 0; d < Dp; ++d) I.dqp[size_t(d)] += proxy_scale * dz * kprow[d];
      }
    if (c.sparse()) {
      I.sel.resize(size_t(c.topk));
      select_row(c, qp, kp, p, tok, I.sel.data());
    }
  });
  Err e_out, e_lse, e_plse, e_dq, e_dqp;
  e_out.name = "out";
  e_lse.name = "lse";
  e_plse.name = "proxy_lse";
  e_dq.name = "dq";
  e_dqp.name = "dqp";
  int64_t same = 0, slots = 0;
  for (int64_t it = 0; it < n; ++it) {
    const int64_t tok = rows[size_t(it / c.Hp)];
    const int p = int(it % c.Hp);
    const Item& I = items[size_t(it)];
    for (int g = 0; g < G; ++g) {
      const int h = p * G + g;
      for (int d = 0; d < D; ++d) {
        const int64_t o = (tok * c.Hq + h) * D + d;
        e_out.add(t.out.get(o), I.out[size_t(g) * D + d]);
        if (c.has_bwd()) e_dq.add(t.dq.get(o), I.dq[size_t(g) * D + d]);
      }
      e_lse.add(t.lse.get(int64_t(h) * c.total + tok), I.lse[size_t(g)]);
    }
    e_plse.add(t.proxy_lse.get(int64_t(p) * c.total + tok), I.plse);
    if (c.has_bwd())
      for (int d = 0; d < Dp; ++d) e_dqp.add(t.dqp.get((tok * c.Hp + p) * Dp + d), I.dqp[size_t(d)]);
    if (c.sparse())
      for (int s = 0; s < c.topk; ++s) {
        ++slots;
        same += kidx[(int64_t(p) * c.total + tok) * c.topk + s] == I.sel[size_t(s)];
      }
  }
  r.errs = {e_out, e_lse, e_plse};
  if (c.has_bwd()) {
    r.errs.push_back(e_dq);
    r.errs.push_back(e_dqp);
  }
  if (c.sparse()) {
    r.index_slots = slots;
    r.index_agreement = slots ? double(same) / double(slots) : 1.0;
  }
}

}  // namespace

CheckResult run_check(const Config& c, const Tensors& t) {
  CheckResult r;
  r.ran = true;
  r.threshold = threshold_for(c.dtype);
  const double t0 = now_s();
  progress("[check] fp64 reference (%s) ...\n",
           c.total <= kCheckFullMaxTokens ? "every token" : "sampled tokens");
  if (c.total <= kCheckFullMaxTokens) check_full(c, t, r);
  else check_sampled(c, t, r);
  for (const Err& e : r.errs)
    if (!(e.rel() <= r.threshold)) r.pass = false;
  if (c.sparse() && !(r.index_agreement >= kIndexAgreementMin)) r.pass = false;
  progress("[check] done in %.3f s\n", now_s() - t0);
  return r;
}

void check_device_parts(const Config& c, const Tensors& t, const Stats& s, CheckResult& r) {
  if (!c.on_cuda) return;
  progress("[check] device-drawn inputs and device statistics ...\n");
  std::vector<const Buf*> normals = {&t.q, &t.k, &t.v, &t.dout, &t.dlse};
  if (c.pattern == Pattern::Random) normals.insert(normals.end(), {&t.qp, &t.kp});
  for (const Buf* b : normals) {
    if (!b->used || b->numel() < 1000) continue;
    double mean = 0, var = 0;
    dev::moments(*b, &mean, &var);
    const double n = double(b->numel());
    const double mean_bar = 6.0 / std::sqrt(n), var_bar = 6.0 * std::sqrt(2.0 / n) + 1e-3;
    DeviceCheck d;
    d.name = "input " + b->name;
    d.ok = std::fabs(mean) <= mean_bar && std::fabs(var - 1.0) <= var_bar;
    d.detail = fmt("N(0,1): mean %.2e (|.| <= %.1e), var %.6f (|var-1| <= %.1e)", mean, mean_bar, var, var_bar);
    r.device.push_back(d);
  }
  if (c.sparse()) {
    const double host = host_mass_recall(c, t, s.recall_row_ids);
    DeviceCheck d;
    d.name = "recall";
    d.ok = std::fabs(s.recall - host) <= kRecallAgreement;
    d.detail = fmt("device %.12f vs host fp64 %.12f (|diff| %.1e <= %.0e)", s.recall, host,
                   std::fabs(s.recall - host), kRecallAgreement);
    r.device.push_back(d);
  }
  for (const DeviceCheck& d : r.device) r.pass = r.pass && d.ok;
}

}  // namespace flashmsa::cli
