#include "api/validate.hpp"

#include <cmath>
#include <sstream>

namespace flashmsa {

void fail(flashmsa_status_t status, const std::string& msg) { throw ApiError(status, msg); }

std::string shape_string(const flashmsa_tensor_t& t) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < t.ndim && i < FLASHMSA_MAX_DIMS; ++i) os << (i ? ", " : "") << t.shape[i];
  os << "]";
  return os.str();
}

namespace {

std::string strides_string(const flashmsa_tensor_t& t) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < t.ndim && i < FLASHMSA_MAX_DIMS; ++i) os << (i ? ", " : "") << t.strides[i];
  os << "]";
  return os.str();
}

const char* device_name(flashmsa_device_type_t d) {
  return d == FLASHMSA_DEVICE_CPU ? "cpu" : d == FLASHMSA_DEVICE_CUDA ? "cuda" : "unknown";
}

std::string device_string(flashmsa_device_type_t d, int id) {
  return d == FLASHMSA_DEVICE_CPU ? "cpu" : std::string(device_name(d)) + ":" + std::to_string(id);
}

bool is_float(flashmsa_dtype_t t) {
  return t == FLASHMSA_DTYPE_BF16 || t == FLASHMSA_DTYPE_FP16 || t == FLASHMSA_DTYPE_FP32 ||
         t == FLASHMSA_DTYPE_FP64;
}

struct V {
  std::string fn;
  Geometry g;

  [[noreturn]] void bad(const std::string& name, const std::string& msg) const {
    invalid(fn + ": " + name + ": " + msg);
  }

  // Rank, dtype validity, device, contiguous last dim, non-negative strides.
  void basic(const std::string& name, const flashmsa_tensor_t& t) const {
    if (t.ndim < 0 || t.ndim > FLASHMSA_MAX_DIMS)
      bad(name, "expected at most " + std::to_string(FLASHMSA_MAX_DIMS) + " dimensions, got " +
                    std::to_string(t.ndim));
    if (t.dtype < FLASHMSA_DTYPE_BF16 || t.dtype > FLASHMSA_DTYPE_INT32)
      bad(name, "unknown dtype code " + std::to_string(int(t.dtype)));
    if (t.device_type != FLASHMSA_DEVICE_CPU && t.device_type != FLASHMSA_DEVICE_CUDA)
      bad(name, "unknown device type " + std::to_string(int(t.device_type)));
    bool empty = false;
    for (int i = 0; i < t.ndim; ++i) {
      if (t.shape[i] < 0) bad(name, "negative size in shape " + shape_string(t));
      empty = empty || t.shape[i] == 0;
    }
    if (empty) return;  // an empty tensor's strides are never used (torch gives it any)
    int64_t numel = 1;
    for (int i = 0; i < t.ndim; ++i)
      if (__builtin_mul_overflow(numel, t.shape[i], &numel))
        bad(name, "shape " + shape_string(t) + " has more than 2^63 - 1 elements");
    for (int i = 0; i < t.ndim; ++i)
      if (t.strides[i] < 0)
        bad(name, "negative stride " + std::to_string(t.strides[i]) + " in dimension " +
                      std::to_string(i));
    // every element offset (sum of index * stride) must be an int64
    int64_t span = 0;
    for (int i = 0; i < t.ndim; ++i) {
      int64_t term = 0;
      if (__builtin_mul_overflow(t.shape[i] - 1, t.strides[i], &term) ||
          __builtin_add_overflow(span, term, &span))
        bad(name, "shape " + shape_string(t) + " with strides " + strides_string(t) +
                      " addresses elements beyond offset 2^63 - 1");
    }
    if (t.ndim > 0 && t.strides[t.ndim - 1] != 1 && t.shape[t.ndim - 1] > 1)
      bad(name, "the last dimension must be contiguous (stride 1), got stride " +
                    std::to_string(t.strides[t.ndim - 1]));
    if (t.data == nullptr && numel != 0) bad(name, "data is NULL but the tensor has elements");
  }

  void same_device(const std::string& name, const flashmsa_tensor_t& t) const {
    if (t.device_type != g.device || (g.device == FLASHMSA_DEVICE_CUDA && t.device_id != g.device_id))
      bad(name, "expected device " + device_string(g.device, g.device_id) +
                    " (the device of q), got " + device_string(t.device_type, t.device_id));
  }

  void dtype_is(const std::string& name, const flashmsa_tensor_t& t, flashmsa_dtype_t want,
                const std::string& why) const {
    if (t.dtype != want)
      bad(name, std::string("expected dtype ") + flashmsa_dtype_name(want) + " (" + why +
                    "), got " + flashmsa_dtype_name(t.dtype));
  }

  // fp32 statistics (lse, proxy_lse, dlse, kl); fp64 also allowed when the inputs are fp64.
  void stat_dtype(const std::string& name, const flashmsa_tensor_t& t) const {
    if (t.dtype == FLASHMSA_DTYPE_FP32) return;
    if (t.dtype == FLASHMSA_DTYPE_FP64 && g.dtype == FLASHMSA_DTYPE_FP64) return;
    bad(name, std::string("expected dtype fp32") +
                  (g.dtype == FLASHMSA_DTYPE_FP64 ? " or fp64" : "") + ", got " +
                  flashmsa_dtype_name(t.dtype));
  }

  // A size that the backends keep in an int: at most INT32_MAX.
  int narrow(const std::string& name, const std::string& what, int64_t v) const {
    if (v > kMaxInt)
      bad(name, "expected " + what + " <= " + std::to_string(kMaxInt) + ", got " + std::to_string(v));
    return int(v);
  }

  // The first per-token tensor (q or qp for selection) fixes batching, B, S, total.
  void first_tokens(const std::string& name, const flashmsa_tensor_t& t) {
    if (!present(t)) bad(name, "is required");
    basic(name, t);
    if (t.ndim != 3 && t.ndim != 4)
      bad(name, "expected 3 dimensions [total, H, D] or 4 dimensions [B, S, H, D], got " +
                    std::to_string(t.ndim) + " " + shape_string(t));
    if (!is_float(t.dtype) || t.dtype == FLASHMSA_DTYPE_INT32)
      bad(name, std::string("expected a floating dtype (bf16, fp16; fp32, fp64 on the CPU), got ") +
                    flashmsa_dtype_name(t.dtype));
    g.dtype = t.dtype;
    g.device = t.device_type;
    g.device_id = t.device_id;
    g.batched = t.ndim == 4;
    if (g.batched) {
      g.batch = narrow(name, "B", t.shape[0]);
      g.seqlen = t.shape[1];
      if (__builtin_mul_overflow(t.shape[0], t.shape[1], &g.total) || g.total > kMaxInt)
        bad(name, "expected B * S <= " + std::to_string(kMaxInt) +
                      " tokens (what int32 cu_seqlens can describe), got " + shape_string(t));
    } else {
      g.total = t.shape[0];
      if (g.total > kMaxInt)
        bad(name, "expected total <= " + std::to_string(kMaxInt) +
                      " tokens (cu_seqlens is int32), got " + std::to_string(g.total));
    }
    g.total_k = g.total;
  }

  // With query segments, the first key-side tensor (k, or kp for a selection) fixes total_k.
  void first_keys(const std::string& name, const flashmsa_tensor_t& t) {
    if (!g.segmented) return;
    if (g.batched) bad("cu_seqlens_q", "needs varlen [total, H, D] inputs (batched inputs have no query segments)");
    if (!present(t)) bad(name, "is required");
    basic(name, t);
    if (t.ndim != 3)
      bad(name, "expected 3 dimensions [total_k, H, D], got " + std::to_string(t.ndim) + " " + shape_string(t));
    g.total_k = t.shape[0];
    if (g.total_k > kMaxInt)
      bad(name, "expected total_k <= " + std::to_string(kMaxInt) +
                    " tokens (cu_seqlens is int32), got " + std::to_string(g.total_k));
  }

  // A per-token tensor: returns (H, X). want_h / want_x < 0: free.
  std::pair<int, int> tokens(const std::string& name, const flashmsa_tensor_t& t, int want_h,
                             int want_x, const std::string& hname, const std::string& xname,
                             bool key_side = false) const {
    const int64_t rows = key_side ? g.total_k : g.total;
    if (!present(t)) bad(name, "is required");
    basic(name, t);
    same_device(name, t);
    dtype_is(name, t, g.dtype, "the dtype of q");
    const std::string form = g.batched ? "[B, S, " + hname + ", " + xname + "]"
                                       : "[total, " + hname + ", " + xname + "]";
    if (t.ndim != (g.batched ? 4 : 3))
      bad(name, "expected " + std::to_string(g.batched ? 4 : 3) + " dimensions " + form +
                    " like q, got " + shape_string(t));
    if (g.batched) {
      if (t.shape[0] != g.batch || t.shape[1] != g.seqlen)
        bad(name, "expected B = " + std::to_string(g.batch) + ", S = " + std::to_string(g.seqlen) +
                      " (from q), got " + shape_string(t));
    } else if (t.shape[0] != rows) {
      if (g.segmented)
        bad(name, std::string("expected ") + (key_side ? "total_k = " : "total_q = ") + std::to_string(rows) +
                      (key_side ? " key tokens (from k)" : " query tokens (from q)") + ", got " +
                      std::to_string(t.shape[0]) + " in " + shape_string(t));
      bad(name, "expected total = " + std::to_string(g.total) + " tokens (from q), got " +
                    std::to_string(t.shape[0]) + " in " + shape_string(t));
    }
    const int h = narrow(name, hname, t.shape[t.ndim - 2]);
    const int x = narrow(name, xname, t.shape[t.ndim - 1]);
    if (h < 1) bad(name, "expected at least one head (" + hname + " >= 1), got " + std::to_string(h));
    if (x < 1) bad(name, "expected " + xname + " >= 1, got " + std::to_string(x));
    if (want_h >= 0 && h != want_h)
      bad(name, "expected " + hname + " = " + std::to_string(want_h) + ", got " + std::to_string(h) +
                    " in " + shape_string(t));
    if (want_x >= 0 && x != want_x)
      bad(name, "expected " + xname + " = " + std::to_string(want_x) + ", got " +
                    std::to_string(x) + " in " + shape_string(t));
    return {h, x};
  }

  // A per-head tensor [H, total] (K < 0) or [H, total, K].
  void heads(const std::string& name, const flashmsa_tensor_t& t, int H, int K) const {
    if (!present(t)) bad(name, "is required");
    basic(name, t);
    same_device(name, t);
    const int nd = K < 0 ? 2 : 3;
    const std::string form = K < 0 ? "[H, total]" : "[H, total, topk]";
    if (t.ndim != nd)
      bad(name, "expected " + std::to_string(nd) + " dimensions " + form + ", got " +
                    std::to_string(t.ndim) + " " + shape_string(t));
    if (t.shape[0] != H || t.shape[1] != g.total || (K >= 0 && t.shape[2] != K)) {
      std::string want = "[" + std::to_string(H) + ", " + std::to_string(g.total) +
                         (K >= 0 ? ", " + std::to_string(K) : "") + "]";
      bad(name, "expected shape " + want + ", got " + shape_string(t));
    }
  }

  void scalar(const std::string& name, const flashmsa_tensor_t& t) const {
    basic(name, t);
    same_device(name, t);
    const bool ok = t.ndim == 0 || (t.ndim == 1 && t.shape[0] == 1);
    if (!ok) bad(name, "expected a scalar (shape [] or [1]), got " + shape_string(t));
    if (t.data == nullptr) bad(name, "data is NULL");
  }

  void seqlens(const flashmsa_tensor_t& cu, int64_t max_seqlen) {
    if (g.batched) {
      if (present(cu))
        bad("cu_seqlens", "must be absent for batched [B, S, H, D] inputs, got " +
                              shape_string(cu));
      if (max_seqlen != 0 && max_seqlen != g.seqlen)
        bad("max_seqlen", "expected 0 or S = " + std::to_string(g.seqlen) +
                              " (the sequence length of the batched inputs), got " +
                              std::to_string(max_seqlen));
      g.max_seqlen = g.seqlen;
      return;
    }
    if (!present(cu)) bad("cu_seqlens", "is required for varlen [total, H, D] inputs");
    basic("cu_seqlens", cu);
    same_device("cu_seqlens", cu);
    if (cu.dtype != FLASHMSA_DTYPE_INT32)
      bad("cu_seqlens", std::string("expected dtype int32, got ") + flashmsa_dtype_name(cu.dtype));
    if (cu.ndim != 1 || cu.shape[0] < 1)
      bad("cu_seqlens", "expected 1 dimension [B+1] with B >= 0, got " + shape_string(cu));
    if (max_seqlen < 0 || max_seqlen > kMaxInt)
      bad("max_seqlen", "expected 0 <= max_seqlen <= " + std::to_string(kMaxInt) +
                            " (sequence lengths are int32), got " + std::to_string(max_seqlen));
    g.batch = narrow("cu_seqlens", "B (its length - 1)", cu.shape[0] - 1);
    g.max_seqlen = max_seqlen;
  }

  // Query segments: cu_seqlens_q [S+1] and q_origin [S, 2], int32, together (their values are data:
  // the backends check them).
  void segments(const flashmsa_tensor_t& cuq, const flashmsa_tensor_t& origin, int64_t max_seqlen_q) {
    if (!g.segmented) {
      g.max_seqlen_q = g.max_seqlen;
      return;
    }
    if (!present(origin)) bad("q_origin", "is required with cu_seqlens_q ([S, 2] int32: key sequence, first position)");
    for (auto [name, t] : {std::pair<const char*, const flashmsa_tensor_t*>{"cu_seqlens_q", &cuq}, {"q_origin", &origin}}) {
      basic(name, *t);
      same_device(name, *t);
      if (t->dtype != FLASHMSA_DTYPE_INT32)
        bad(name, std::string("expected dtype int32, got ") + flashmsa_dtype_name(t->dtype));
    }
    if (cuq.ndim != 1 || cuq.shape[0] < 1)
      bad("cu_seqlens_q", "expected 1 dimension [S+1] with S >= 0, got " + shape_string(cuq));
    g.segments = narrow("cu_seqlens_q", "S (its length - 1)", cuq.shape[0] - 1);
    if (origin.ndim != 2 || origin.shape[0] != g.segments || origin.shape[1] != 2)
      bad("q_origin", "expected shape [" + std::to_string(g.segments) +
                          ", 2] (S from cu_seqlens_q: key sequence, first position), got " + shape_string(origin));
    if (max_seqlen_q < 0 || max_seqlen_q > kMaxInt)
      bad("max_seqlen_q", "expected 0 <= max_seqlen_q <= " + std::to_string(kMaxInt) + ", got " +
                              std::to_string(max_seqlen_q));
    g.max_seqlen_q = max_seqlen_q;
  }

  // Before anything else: whether the call has query segments (they change what the other
  // tensors' row counts must be).
  template <class A>
  void segmentation(const A& a) {
    g.segmented = present(a.cu_seqlens_q);
    if (!g.segmented && present(a.q_origin)) bad("q_origin", "needs cu_seqlens_q (query segments)");
    if (!g.segmented && a.max_seqlen_q != 0)
      bad("max_seqlen_q", "expected 0 without cu_seqlens_q, got " + std::to_string(a.max_seqlen_q));
  }

  void ratios() const {
    if (g.Hq % g.Hkv != 0)
      bad("heads", "Hq (" + std::to_string(g.Hq) + ") must be a multiple of Hkv (" +
                       std::to_string(g.Hkv) + ")");
    if (g.Hq % g.Hp != 0)
      bad("heads", "Hq (" + std::to_string(g.Hq) + ") must be a multiple of Hp (" +
                       std::to_string(g.Hp) + ")");
    if (g.Hp % g.Hpk != 0)
      bad("heads", "Hp (" + std::to_string(g.Hp) + ") must be a multiple of Hpk (" +
                       std::to_string(g.Hpk) + ")");
  }

  // flashmsa_selection_t: true for FP8
  bool selection(flashmsa_selection_t sel) const {
    if (sel != FLASHMSA_SELECTION_INPUT && sel != FLASHMSA_SELECTION_FP8)
      bad("selection", "expected FLASHMSA_SELECTION_INPUT (0) or FP8 (1), got " + std::to_string(int(sel)));
    return sel == FLASHMSA_SELECTION_FP8;
  }
  void topk_range(const std::string& name, int64_t topk) const {
    if (topk < 1 || topk > FLASHMSA_MAX_TOPK)
      bad(name, "expected 1 <= topk <= " + std::to_string(FLASHMSA_MAX_TOPK) + ", got " +
                    std::to_string(topk));
  }

  // 0 selects 1/sqrt(dim); else 0 < s <= kMaxScale (larger scales overflow the fp32 logits).
  double resolve_scale(const std::string& name, double s, int dim) const {
    if (s == 0.0) return 1.0 / std::sqrt(double(dim));
    if (!std::isfinite(s) || s < 0.0 || s > kMaxScale) {
      std::ostringstream os;
      os << "expected a finite value > 0 and <= " << kMaxScale << " (or 0 for the default 1/sqrt("
         << dim << ")), got " << s;
      bad(name, os.str());
    }
    return s;
  }

  void flag(const std::string& name, int32_t v) const {
    if (v != 0 && v != 1) bad(name, "expected 0 or 1, got " + std::to_string(v));
  }

  void mode(flashmsa_mode_t m) const {
    if (m != FLASHMSA_MODE_SPARSE && m != FLASHMSA_MODE_DENSE && m != FLASHMSA_MODE_GIVEN)
      bad("mode", "expected FLASHMSA_MODE_SPARSE (0), DENSE (1) or GIVEN (2), got " +
                      std::to_string(int(m)));
  }

  // Caller indices [Hp, total, topk] (GIVEN; SPARSE in the backward): rank, topk, and the
  // groups when no proxy tensors give Hp.
  void index_rows(const flashmsa_tensor_t& idx, const char* missing) {
    if (!present(idx)) bad("indices", missing);
    basic("indices", idx);
    if (idx.ndim != 3)
      bad("indices", "expected 3 dimensions [Hp, total, topk], got " + std::to_string(idx.ndim) + " " +
                         shape_string(idx));
    topk_range("indices", idx.shape[2]);
    g.topk = int(idx.shape[2]);
    if (!g.has_proxy) {
      g.Hp = narrow("indices", "Hp (its first dimension)", idx.shape[0]);
      g.Hpk = 1;
      if (g.Hp < 1) bad("indices", "expected Hp >= 1 rows, got " + shape_string(idx));
    }
  }

  // DENSE mode: no indices; without proxy tensors there are no groups to train, so every head
  // is its own group.
  void dense_groups(const flashmsa_tensor_t& idx) {
    if (present(idx)) bad("indices", "must be absent in DENSE (warmup) mode");
    if (!g.has_proxy) {
      g.Hp = g.Hq;
      g.Hpk = 1;
    }
  }

  // Main q, k, v and the optional proxy pair; fills heads and dims.
  void main_inputs(const flashmsa_tensor_t& q, const flashmsa_tensor_t& k,
                   const flashmsa_tensor_t& v, const flashmsa_tensor_t& qp,
                   const flashmsa_tensor_t& kp) {
    first_tokens("q", q);
    g.Hq = narrow("q", "Hq", q.shape[q.ndim - 2]);
    g.D = narrow("q", "D", q.shape[q.ndim - 1]);
    if (g.Hq < 1) bad("q", "expected Hq >= 1, got " + std::to_string(g.Hq));
    if (g.D < 1) bad("q", "expected D >= 1, got " + std::to_string(g.D));
    first_keys("k", k);
    g.Hkv = tokens("k", k, -1, g.D, "Hkv", "D", true).first;
    tokens("v", v, g.Hkv, g.D, "Hkv", "D", true);
    if (present(qp) != present(kp))
      bad(present(qp) ? "kp" : "qp", "qp and kp must be given together");
    g.has_proxy = present(qp);
    if (g.has_proxy) {
      auto hd = tokens("qp", qp, -1, -1, "Hp", "Dp");
      g.Hp = hd.first;
      g.Dp = hd.second;
      g.Hpk = tokens("kp", kp, -1, g.Dp, "Hpk", "Dp", true).first;
    }
  }
};

}  // namespace

TokenLayout token_layout(const flashmsa_tensor_t& t, const Geometry& g) {
  TokenLayout l;
  if (t.ndim == 4) {
    l.tok = t.strides[1];
    l.head = t.strides[2];
    l.batch_corr = t.strides[0] - g.seqlen * t.strides[1];
  } else {
    l.tok = t.strides[0];
    l.head = t.strides[1];
  }
  return l;
}

HeadLayout head_layout(const flashmsa_tensor_t& t) { return {t.strides[0], t.strides[1]}; }

Geometry validate_select(const flashmsa_select_args_t& a) {
  V v{"flashmsa_select", {}};
  v.segmentation(a);
  v.first_tokens("qp", a.qp);
  v.g.Hp = v.narrow("qp", "Hp", a.qp.shape[a.qp.ndim - 2]);
  v.g.Dp = v.narrow("qp", "Dp", a.qp.shape[a.qp.ndim - 1]);
  if (v.g.Hp < 1) v.bad("qp", "expected Hp >= 1, got " + std::to_string(v.g.Hp));
  if (v.g.Dp < 1) v.bad("qp", "expected Dp >= 1, got " + std::to_string(v.g.Dp));
  v.first_keys("kp", a.kp);
  v.g.Hpk = v.tokens("kp", a.kp, -1, v.g.Dp, "Hpk", "Dp", true).first;
  v.g.has_proxy = true;
  v.g.Hq = v.g.Hp;  // no main heads in a selection call
  v.g.Hkv = 1;
  v.seqlens(a.cu_seqlens, a.max_seqlen);
  v.segments(a.cu_seqlens_q, a.q_origin, a.max_seqlen_q);
  if (v.g.Hp % v.g.Hpk != 0)
    v.bad("heads", "Hp (" + std::to_string(v.g.Hp) + ") must be a multiple of Hpk (" +
                       std::to_string(v.g.Hpk) + ")");
  v.topk_range("topk", a.topk);
  v.g.topk = a.topk;
  v.g.proxy_scale = v.resolve_scale("proxy_scale", a.proxy_scale, v.g.Dp);
  v.g.fp8_selection = v.selection(a.selection);
  v.heads("indices", a.indices, v.g.Hp, v.g.topk);
  v.dtype_is("indices", a.indices, FLASHMSA_DTYPE_INT32, "block ids");
  if (present(a.proxy_lse)) {
    v.heads("proxy_lse", a.proxy_lse, v.g.Hp, -1);
    v.stat_dtype("proxy_lse", a.proxy_lse);
  }
  return v.g;
}

Geometry validate_fwd(const flashmsa_fwd_args_t& a) {
  V v{"flashmsa_fwd", {}};
  v.segmentation(a);
  v.mode(a.mode);
  if (a.numerics != FLASHMSA_NUMERICS_TRAIN && a.numerics != FLASHMSA_NUMERICS_INFER)
    v.bad("numerics", "expected FLASHMSA_NUMERICS_TRAIN (0) or INFER (1), got " +
                          std::to_string(int(a.numerics)));
  v.g.fp8_selection = v.selection(a.selection) && a.mode == FLASHMSA_MODE_SPARSE;  // only SPARSE selects
  v.main_inputs(a.q, a.k, a.v, a.qp, a.kp);
  v.seqlens(a.cu_seqlens, a.max_seqlen);
  v.segments(a.cu_seqlens_q, a.q_origin, a.max_seqlen_q);
  v.flag("compute_kl", a.compute_kl);
  v.flag("validate", a.validate);
  if (a.mode == FLASHMSA_MODE_SPARSE) {
    if (!v.g.has_proxy) v.bad("qp", "is required in SPARSE mode (the proxy selects the blocks)");
    v.topk_range("topk", a.topk);
    v.g.topk = a.topk;
  } else if (a.mode == FLASHMSA_MODE_GIVEN) {
    v.index_rows(a.indices, "is required in GIVEN mode");
  } else {
    v.dense_groups(a.indices);
  }
  v.ratios();
  v.g.scale = v.resolve_scale("softmax_scale", a.softmax_scale, v.g.D);
  v.g.proxy_scale = v.g.has_proxy ? v.resolve_scale("proxy_scale", a.proxy_scale, v.g.Dp) : 1.0;
  if (present(a.indices)) {
    v.heads("indices", a.indices, v.g.Hp, v.g.topk);
    v.dtype_is("indices", a.indices, FLASHMSA_DTYPE_INT32, "block ids");
  }
  // outputs
  v.tokens("out", a.out, v.g.Hq, v.g.D, "Hq", "D");
  if (present(a.out_lo)) v.tokens("out_lo", a.out_lo, v.g.Hq, v.g.D, "Hq", "D");
  v.heads("lse", a.lse, v.g.Hq, -1);
  v.stat_dtype("lse", a.lse);
  if (present(a.proxy_lse)) {
    if (!v.g.has_proxy) v.bad("proxy_lse", "needs qp and kp");
    v.heads("proxy_lse", a.proxy_lse, v.g.Hp, -1);
    v.stat_dtype("proxy_lse", a.proxy_lse);
  }
  if (a.compute_kl && !v.g.has_proxy) v.bad("compute_kl", "needs qp and kp");
  if (a.compute_kl && !present(a.kl)) v.bad("kl", "is required when compute_kl is set");
  if (present(a.kl)) {
    v.scalar("kl", a.kl);
    v.stat_dtype("kl", a.kl);
  }
  return v.g;
}

Geometry validate_bwd(const flashmsa_bwd_args_t& a) {
  V v{"flashmsa_bwd", {}};
  v.segmentation(a);
  v.mode(a.mode);
  v.main_inputs(a.q, a.k, a.v, a.qp, a.kp);
  v.seqlens(a.cu_seqlens, a.max_seqlen);
  v.segments(a.cu_seqlens_q, a.q_origin, a.max_seqlen_q);
  v.flag("deterministic", a.deterministic);
  v.flag("validate", a.validate);
  if (a.mode == FLASHMSA_MODE_DENSE) {
    v.dense_groups(a.indices);
  } else {
    v.index_rows(a.indices, "is required in SPARSE and GIVEN modes");
  }
  v.ratios();
  v.g.scale = v.resolve_scale("softmax_scale", a.softmax_scale, v.g.D);
  v.g.proxy_scale = v.g.has_proxy ? v.resolve_scale("proxy_scale", a.proxy_scale, v.g.Dp) : 1.0;
  if (present(a.indices)) {
    v.heads("indices", a.indices, v.g.Hp, v.g.topk);
    v.dtype_is("indices", a.indices, FLASHMSA_DTYPE_INT32, "block ids");
  }
  v.tokens("out", a.out, v.g.Hq, v.g.D, "Hq", "D");
  if (present(a.out_lo)) v.tokens("out_lo", a.out_lo, v.g.Hq, v.g.D, "Hq", "D");
  v.heads("lse", a.lse, v.g.Hq, -1);
  v.stat_dtype("lse", a.lse);
  v.tokens("dout", a.dout, v.g.Hq, v.g.D, "Hq", "D");
  if (present(a.dlse)) {
    v.heads("dlse", a.dlse, v.g.Hq, -1);
    v.stat_dtype("dlse", a.dlse);
  }
  if (present(a.proxy_lse)) {
    if (!v.g.has_proxy) v.bad("proxy_lse", "needs qp and kp");
    v.heads("proxy_lse", a.proxy_lse, v.g.Hp, -1);
    v.stat_dtype("proxy_lse", a.proxy_lse);
  }
  if (present(a.dkl)) {
    v.scalar("dkl", a.dkl);
    if (a.dkl.dtype != FLASHMSA_DTYPE_FP32 && a.dkl.dtype != FLASHMSA_DTYPE_FP64)
      v.bad("dkl", std::string("expected dtype fp32 or fp64, got ") + flashmsa_dtype_name(a.dkl.dtype));
  }
  v.tokens("dq", a.dq, v.g.Hq, v.g.D, "Hq", "D");
  v.tokens("dk", a.dk, v.g.Hkv, v.g.D, "Hkv", "D", true);
  v.tokens("dv", a.dv, v.g.Hkv, v.g.D, "Hkv", "D", true);
  if (v.g.has_proxy) {
    v.tokens("dqp", a.dqp, v.g.Hp, v.g.Dp, "Hp", "Dp");
    v.tokens("dkp", a.dkp, v.g.Hpk, v.g.Dp, "Hpk", "Dp", true);
  } else {
    if (present(a.dqp)) v.bad("dqp", "must be absent when qp and kp are absent");
    if (present(a.dkp)) v.bad("dkp", "must be absent when qp and kp are absent");
  }
  if (present(a.kl)) {
    if (!v.g.has_proxy) v.bad("kl", "needs qp and kp");
    v.scalar("kl", a.kl);
    v.stat_dtype("kl", a.kl);
  }
  return v.g;
}

}  // namespace flashmsa
