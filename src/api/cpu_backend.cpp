// CPU backend: gathers the strided views into dense fp64 arrays, checks the data that the
// spec asks the CPU to check, runs the reference, and only then scatters the outputs.
#include <cmath>
#include <limits>
#include <new>
#include <stdexcept>
#include <vector>

#include "api/backends.hpp"
#include "api/data_checks.hpp"
#include "common/dtype.hpp"
#include "reference/reference.hpp"

namespace flashmsa::cpu {

namespace {

std::vector<int64_t> read_cu(const flashmsa_tensor_t& cu_t, const Geometry& g, const char* fn) {
  return checked_offsets(g.batched ? nullptr : static_cast<const int32_t*>(cu_t.data),
                         g.batched ? 0 : cu_t.strides[0], g, fn);
}

// The reference's problem: key sequences from cu_seqlens, query segments (when given) checked
// against them.
template <class A>
ref::Problem make_problem(const A& a, const Geometry& g, flashmsa_mode_t mode, const char* fn) {
  ref::Problem pb;
  pb.cu = read_cu(a.cu_seqlens, g, fn);
  if (g.segmented) {
    Segments sg = checked_segments(static_cast<const int32_t*>(a.cu_seqlens_q.data), a.cu_seqlens_q.strides[0],
                                   static_cast<const int32_t*>(a.q_origin.data), a.q_origin.strides[0],
                                   a.q_origin.strides[1], pb.cu, g, fn);
    pb.cuq = std::move(sg.cuq);
    pb.qseq = std::move(sg.qseq);
    pb.qpos = std::move(sg.qpos);
  }
  pb.total = g.total;
  pb.total_k = g.total_k;
  pb.Hq = g.Hq;
  pb.Hkv = g.Hkv;
  pb.Hp = g.Hp;
  pb.Hpk = g.Hpk;
  pb.D = g.D;
  pb.Dp = g.Dp;
  pb.topk = g.topk;
  pb.mode = mode;
  pb.scale = g.scale;
  pb.proxy_scale = g.proxy_scale;
  return pb;
}

// Per-token tensor -> dense [rows][H][X] doubles: the query rows (total) or, for k, v, kp and their
// gradients, the key rows (total_k).
std::vector<double> gather_tokens(const flashmsa_tensor_t& t, const Geometry& g, bool key_side = false) {
  const int H = int(t.shape[t.ndim - 2]), X = int(t.shape[t.ndim - 1]);
  const int64_t rows = key_side ? g.total_k : g.total;
  std::vector<double> out(size_t(rows) * H * X);
  const TokenLayout L = token_layout(t, g);
  for (int64_t tok = 0; tok < rows; ++tok)
    for (int h = 0; h < H; ++h) {
      const int64_t off = L.offset(g.batched ? int(tok / g.seqlen) : 0, tok, h);
      double* dst = out.data() + (tok * H + h) * X;
      for (int x = 0; x < X; ++x) dst[x] = load_as_double(t.dtype, t.data, off + x);
    }
  return out;
}

void scatter_tokens(const flashmsa_tensor_t& t, const Geometry& g, const std::vector<double>& src,
                    bool key_side = false) {
  const int H = int(t.shape[t.ndim - 2]), X = int(t.shape[t.ndim - 1]);
  const int64_t rows = key_side ? g.total_k : g.total;
  const TokenLayout L = token_layout(t, g);
  for (int64_t tok = 0; tok < rows; ++tok)
    for (int h = 0; h < H; ++h) {
      const int64_t off = L.offset(g.batched ? int(tok / g.seqlen) : 0, tok, h);
      const double* s = src.data() + (tok * H + h) * X;
      for (int x = 0; x < X; ++x) store_from_double(t.dtype, t.data, off + x, s[x]);
    }
}

std::vector<double> gather_heads(const flashmsa_tensor_t& t, const Geometry& g) {
  const int H = int(t.shape[0]);
  std::vector<double> out(size_t(H) * g.total);
  const HeadLayout L = head_layout(t);
  for (int h = 0; h < H; ++h)
    for (int64_t tok = 0; tok < g.total; ++tok)
      out[size_t(h) * g.total + tok] = load_as_double(t.dtype, t.data, L.offset(h, tok));
  return out;
}

void scatter_heads(const flashmsa_tensor_t& t, const Geometry& g, const std::vector<double>& src) {
  const int H = int(t.shape[0]);
  const HeadLayout L = head_layout(t);
  for (int h = 0; h < H; ++h)
    for (int64_t tok = 0; tok < g.total; ++tok)
      store_from_double(t.dtype, t.data, L.offset(h, tok), src[size_t(h) * g.total + tok]);
}

std::vector<int32_t> gather_indices(const flashmsa_tensor_t& t, const Geometry& g) {
  std::vector<int32_t> out(size_t(g.Hp) * g.total * g.topk);
  const auto* p = static_cast<const int32_t*>(t.data);
  for (int h = 0; h < g.Hp; ++h)
    for (int64_t tok = 0; tok < g.total; ++tok)
      for (int s = 0; s < g.topk; ++s)
        out[(size_t(h) * g.total + tok) * g.topk + s] =
            p[h * t.strides[0] + tok * t.strides[1] + s];
  return out;
}

void scatter_indices(const flashmsa_tensor_t& t, const Geometry& g, const std::vector<int32_t>& src) {
  auto* p = static_cast<int32_t*>(t.data);
  for (int h = 0; h < g.Hp; ++h)
    for (int64_t tok = 0; tok < g.total; ++tok)
      for (int s = 0; s < g.topk; ++s)
        p[h * t.strides[0] + tok * t.strides[1] + s] =
            src[(size_t(h) * g.total + tok) * g.topk + s];
}

void check_indices(const std::vector<int32_t>& idx, const ref::Problem& pb, bool validate,
                   const char* fn) {
  Segments sg{pb.cuq, pb.qpos, pb.qseq};
  check_index_rows(idx, pb.cu, pb.Hp, pb.total, pb.topk, validate, fn, &sg);
}

void store_scalar(const flashmsa_tensor_t& t, double v) { store_from_double(t.dtype, t.data, 0, v); }

// Runs a call's body: the thread setting (FLASHMSA_NUM_THREADS) is checked before anything else
// and reported as INVALID_ARGUMENT; a dense copy too large for a std::vector is out of memory.
template <class F>
void run(const char* fn, F&& body) {
  try {
    ref::num_threads();
  } catch (const std::invalid_argument& e) {
    invalid(std::string(fn) + ": " + e.what());
  }
  try {
    body();
  } catch (const std::length_error&) {
    throw std::bad_alloc();
  }
}

void select_impl(const flashmsa_select_args_t& a, const Geometry& g);
void fwd_impl(const flashmsa_fwd_args_t& a, const Geometry& g);
void bwd_impl(const flashmsa_bwd_args_t& a, const Geometry& g);

}  // namespace

void select(const flashmsa_select_args_t& a, const Geometry& g) {
  run("flashmsa_select", [&] { select_impl(a, g); });
}
void fwd(const flashmsa_fwd_args_t& a, const Geometry& g) {
  run("flashmsa_fwd", [&] { fwd_impl(a, g); });
}
void bwd(const flashmsa_bwd_args_t& a, const Geometry& g) {
  run("flashmsa_bwd", [&] { bwd_impl(a, g); });
}

namespace {

// The selection of flashmsa_select and SPARSE flashmsa_fwd: indices, and proxy_lse when plse is not null. FP8
// (flashmsa.h, flashmsa_selection_t): ranked on qp, kp's dequantised e4m3 copies, the lse from qp, kp themselves.
void run_selection(const ref::Problem& pb, const Geometry& g, const std::vector<double>& qp,
                   const std::vector<double>& kp, std::vector<int32_t>& idx, double* plse) {
  if (!g.fp8_selection) {
    ref::select(pb, qp.data(), kp.data(), idx.data(), plse);
    return;
  }
  std::vector<double> q8 = qp, k8 = kp;
  ref::quantize_fp8_selection(pb, q8, k8);
  ref::select(pb, q8.data(), k8.data(), idx.data(), nullptr);
  if (plse) ref::proxy_lse_of(pb, qp.data(), kp.data(), idx.data(), plse);
}

void select_impl(const flashmsa_select_args_t& a, const Geometry& g) {
  ref::Problem pb = make_problem(a, g, FLASHMSA_MODE_SPARSE, "flashmsa_select");
  const auto qp = gather_tokens(a.qp, g), kp = gather_tokens(a.kp, g, true);
  std::vector<int32_t> idx(size_t(g.Hp) * g.total * g.topk);
  std::vector<double> plse(size_t(g.Hp) * g.total);
  run_selection(pb, g, qp, kp, idx, plse.data());
  scatter_indices(a.indices, g, idx);
  if (present(a.proxy_lse)) scatter_heads(a.proxy_lse, g, plse);
}

void fwd_impl(const flashmsa_fwd_args_t& a, const Geometry& g) {
  ref::Problem pb = make_problem(a, g, a.mode, "flashmsa_fwd");
  std::vector<int32_t> idx;
  if (a.mode == FLASHMSA_MODE_GIVEN) {
    idx = gather_indices(a.indices, g);
    check_indices(idx, pb, a.validate != 0, "flashmsa_fwd");
  }
  const auto q = gather_tokens(a.q, g), k = gather_tokens(a.k, g, true), v = gather_tokens(a.v, g, true);
  std::vector<double> qp, kp;
  if (g.has_proxy) {
    qp = gather_tokens(a.qp, g);
    kp = gather_tokens(a.kp, g, true);
  }
  if (a.mode == FLASHMSA_MODE_SPARSE) {
    idx.assign(size_t(g.Hp) * g.total * g.topk, -1);
    run_selection(pb, g, qp, kp, idx, nullptr);
  }
  std::vector<double> out(size_t(g.total) * g.Hq * g.D), lse(size_t(g.Hq) * g.total),
      plse(size_t(g.Hp) * g.total, -std::numeric_limits<double>::infinity());
  double kl = 0;
  ref::FwdOut o{out.data(), lse.data(), g.has_proxy ? plse.data() : nullptr,
                a.compute_kl ? &kl : nullptr};
  ref::forward(pb, q.data(), k.data(), v.data(), g.has_proxy ? qp.data() : nullptr,
               g.has_proxy ? kp.data() : nullptr, idx.empty() ? nullptr : idx.data(), o);
  // all computation done: write the outputs
  if (present(a.out_lo)) {  // the low part of the fp64 output in out's dtype
    std::vector<double> lo(out.size());
    for (size_t i = 0; i < out.size(); ++i)
      lo[i] = round_to(a.out.dtype, out[i] - round_to(a.out.dtype, out[i]));
    scatter_tokens(a.out_lo, g, lo);
  }
  scatter_tokens(a.out, g, out);
  scatter_heads(a.lse, g, lse);
  if (present(a.proxy_lse)) scatter_heads(a.proxy_lse, g, plse);
  if (present(a.kl)) store_scalar(a.kl, a.compute_kl ? kl : 0.0);
  if (a.mode == FLASHMSA_MODE_SPARSE && present(a.indices)) scatter_indices(a.indices, g, idx);
}

void bwd_impl(const flashmsa_bwd_args_t& a, const Geometry& g) {
  ref::Problem pb = make_problem(a, g, a.mode, "flashmsa_bwd");
  std::vector<int32_t> idx;
  if (a.mode != FLASHMSA_MODE_DENSE) {
    idx = gather_indices(a.indices, g);
    check_indices(idx, pb, a.validate != 0, "flashmsa_bwd");
  }
  const auto q = gather_tokens(a.q, g), k = gather_tokens(a.k, g, true), v = gather_tokens(a.v, g, true),
             dout = gather_tokens(a.dout, g);
  std::vector<double> qp, kp, dlse;
  if (g.has_proxy) {
    qp = gather_tokens(a.qp, g);
    kp = gather_tokens(a.kp, g, true);
  }
  if (present(a.dlse)) dlse = gather_heads(a.dlse, g);
  const double dkl = present(a.dkl) ? load_as_double(a.dkl.dtype, a.dkl.data, 0) : 0.0;
  if (!std::isfinite(dkl)) invalid("flashmsa_bwd: dkl: expected a finite value, got " + std::to_string(dkl));
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), dqp(qp.size()), dkp(kp.size());
  double kl = 0;
  ref::BwdOut o{dq.data(), dk.data(), dv.data(), g.has_proxy ? dqp.data() : nullptr,
                g.has_proxy ? dkp.data() : nullptr, present(a.kl) ? &kl : nullptr};
  ref::backward(pb, q.data(), k.data(), v.data(), g.has_proxy ? qp.data() : nullptr,
                g.has_proxy ? kp.data() : nullptr, idx.empty() ? nullptr : idx.data(), dout.data(),
                dlse.empty() ? nullptr : dlse.data(), dkl, o);
  scatter_tokens(a.dq, g, dq);
  scatter_tokens(a.dk, g, dk, true);
  scatter_tokens(a.dv, g, dv, true);
  if (g.has_proxy) {
    scatter_tokens(a.dqp, g, dqp);
    scatter_tokens(a.dkp, g, dkp, true);
  }
  if (present(a.kl)) store_scalar(a.kl, kl);
}

}  // namespace

}  // namespace flashmsa::cpu
