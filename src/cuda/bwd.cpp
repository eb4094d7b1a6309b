// flashmsa_bwd on the CUDA backend: preprocess (dpsum, lse in log2), the index inversion, the
// main backward (dq, dk, dv; the KL teacher when the proxy gradient is asked), the proxy side
// (proxy_side.cpp), and the conversion of the fp32 accumulators to the outputs.
#include <algorithm>
#include <cstdlib>

#include "cuda/dispatch.h"
#include "cuda/tiles.h"

namespace flashmsa::cuda {

namespace {

void convert(Dtype d, const float* acc, TokenTensor<void> out, const Seqs& seqs, int64_t max_seqlen, int heads,
             float scale, cudaStream_t st, attn_bwd::DqLayout dq_layout = {}) {
  by_dtype(d, [&](auto D) {
    attn_bwd::launch_convert<decltype(D)::value>(acc, out, seqs, max_seqlen, heads, scale, st, dq_layout);
  });
}

// the deterministic mode's fixed-point accumulators (int64, or int32 with acc32): unit per row
// (padded_stride > 0) or one
void convert_fixed(Dtype d, const char* acc, TokenTensor<void> out, const Seqs& seqs, int64_t max_seqlen, int heads,
                   float scale, const float* unit, int64_t padded_stride, const int32_t* bad, cudaStream_t st,
                   bool acc32 = false) {
  by_dtype(d, [&](auto D) {
    if (acc32)
      attn_bwd::launch_convert_fixed32<decltype(D)::value>(reinterpret_cast<const int32_t*>(acc), out, seqs,
                                                           max_seqlen, heads, scale, unit, padded_stride, bad, st);
    else
      attn_bwd::launch_convert_fixed<decltype(D)::value>(reinterpret_cast<const int64_t*>(acc), out, seqs, max_seqlen,
                                                         heads, scale, unit, padded_stride, bad, st);
  });
}

// segs: the call's query segments (the guard's safe copies), or null
void run_bwd(const flashmsa_bwd_args_t& a, const Geometry& g, char* ws, const BwdLayout& l, cudaStream_t st,
             const Guard* segs) {
  const Dtype d = dtype_of(g);
  const Seqs seqs = seqs_of(a.cu_seqlens, g);  // the key sequences
  // the query rows' sequences: the segments with them (the preprocess and the query-side converts run over them)
  const Seqs qseqs = segs ? attn_bwd::query_seqs(seqs_of(a.cu_seqlens, g, segs->cuq, segs->origin)) : seqs;
  float* dq_acc = reinterpret_cast<float*>(ws + l.dq);
  float* dk_acc = reinterpret_cast<float*>(ws + l.dk);
  float* dv_acc = reinterpret_cast<float*>(ws + l.dv);
  // the accumulators start at zero (this launch initialises them; nothing else does), dq's unless its first
  // contributions store (l.dq_store_first: the fused kernel's dq writer, dq_writer.cuh; its words are zeroed here)
  const size_t zero_from = l.dq_store_first ? l.dk : l.dq;
  FLASHMSA_CUDA_CHECK(cudaMemsetAsync(ws + zero_from, 0, l.inv - zero_from, st));
  // deterministic mode: the bounds and units of the fixed-point sums (before the preprocess, which
  // reads them for the dq rows' units)
  float* const fix = l.deterministic ? reinterpret_cast<float*>(ws + l.fix) : nullptr;
  const int32_t* const bad =  // dq, dk, dv, dqp, dkp
      l.deterministic ? reinterpret_cast<const int32_t*>(fix) + attn_bwd::kBad : nullptr;
  if (l.deterministic) {
    attn_bwd::FixInputs fi;
    fi.q = token_tensor<const void>(a.q, g);
    fi.k = token_tensor<const void>(a.k, g);
    fi.v = token_tensor<const void>(a.v, g);
    fi.dout = token_tensor<const void>(a.dout, g);
    if (g.has_proxy) {
      fi.qp = token_tensor<const void>(a.qp, g);
      fi.kp = token_tensor<const void>(a.kp, g);
    }
    fi.dlse = head_tensor<const float>(a.dlse);
    fi.dkl = present(a.dkl) ? static_cast<const float*>(a.dkl.data) : nullptr;
    fi.Hq = g.Hq;
    fi.Hkv = g.Hkv;
    fi.Hp = g.has_proxy ? g.Hp : 0;
    fi.Hpk = g.has_proxy ? g.Hpk : 0;
    fi.seqs = seqs;
    fi.total = g.total;
    fi.total_k = g.total_k;
    // the most query rows of a head reaching one key: a sequence's length, or with segments every query row
    fi.max_seqlen = segs ? std::max<int64_t>(g.total, 1) : g.max_seqlen;
    fi.dtype = d;
    attn_bwd::launch_fix_bounds(fi, fix, st);
  }

  attn_bwd::PreprocessArgs pa;
  pa.out = token_tensor<const void>(a.out, g);
  if (present(a.out_lo)) pa.out_lo = token_tensor<const void>(a.out_lo, g);
  pa.dout = token_tensor<const void>(a.dout, g);
  pa.lse = head_tensor<const float>(a.lse);
  pa.dlse = head_tensor<const float>(a.dlse);
  pa.seqs = qseqs;
  pa.Hq = g.Hq;
  pa.max_seqlen = g.max_seqlen_q;
  pa.lse2 = reinterpret_cast<float*>(ws + l.lse2);
  pa.dsum = reinterpret_cast<float*>(ws + l.dsum);
  pa.padded_stride = l.padded;
  if (l.deterministic) {
    pa.dq_unit = reinterpret_cast<float*>(ws + l.dq_unit);
    pa.fix = fix;
    pa.dq_unit32 = l.dq32;  // 32-bit dq rows in pairs (SPARSE/GIVEN: <= topk contributions; bwd_layout)
  }
  by_dtype(d, [&](auto D) { attn_bwd::launch_preprocess<decltype(D)::value>(pa, st); });

  attn_bwd::Common c = common_base(g, a.q, a.k, a.cu_seqlens, pa.lse2, l.padded, a.mode == FLASHMSA_MODE_DENSE,
                  static_cast<const int32_t*>(a.indices.data), a.indices.strides[0], a.indices.strides[1],
                  ws + l.inv, st, segs, segs ? reinterpret_cast<int32_t*>(ws + l.qrows) : nullptr);
  c.v = token_tensor<const void>(a.v, g);
  c.dout = token_tensor<const void>(a.dout, g);
  c.dsum.ptr = pa.dsum;
  c.dsum.head = l.padded;
  c.dsum.tok = 1;
  c.R = tiles::bwd_unit_heads(g);
  c.dq_acc = dq_acc;
  c.dk_acc = dk_acc;
  c.dv_acc = dv_acc;
  if (l.deterministic) {  // fixed point: dq with a unit per row, dk and dv with one unit each
    c.dq_fix = reinterpret_cast<int64_t*>(ws + l.dq);  // read by the kernel only when dq_fix32 is null
    if (l.dq32) c.dq_fix32 = reinterpret_cast<int32_t*>(ws + l.dq);  // 4 bytes per element (bwd_layout)
    c.dk_fix = reinterpret_cast<int64_t*>(ws + l.dk);
    c.dv_fix = reinterpret_cast<int64_t*>(ws + l.dv);
    c.dq_unit.ptr = reinterpret_cast<const float*>(ws + l.dq_unit);
    c.dq_unit.head = l.padded;
    c.dq_unit.tok = 1;
    c.fix = fix;
  }
  // the proxy side (the proxy gradient dkl and/or the kl value): the fused kernel runs it with the main backward (the
  // teacher in a per-CTA scratch), in every mode, the deterministic one too (a proxy side implies R = G: bwd_features)
  const bool proxy_side = bwd_proxy_side(a, g);
  ProxyRun r;
  attn_bwd::Common cp = c;
  if (proxy_side) {
    r.qp = &a.qp;
    r.kp = &a.kp;
    r.cu = &a.cu_seqlens;
    r.indices = &a.indices;
    r.proxy_lse = &a.proxy_lse;
    r.segments = segs;
    r.plse_ws = reinterpret_cast<float*>(ws + l.plse);
    r.dqp_acc = reinterpret_cast<float*>(ws + l.dqp);
    r.dkp_acc = reinterpret_cast<float*>(ws + l.dkp);
    // the kl terms only when the caller asks for the kl value (the kl walk skips them otherwise)
    r.kl_acc = present(a.kl) ? reinterpret_cast<float*>(ws + l.kl) : nullptr;
    r.dkl = static_cast<const float*>(a.dkl.data);
    r.grads = present(a.dkl);  // without dkl the accumulators stay zero
    if (l.deterministic) {  // the fused kernel's kl walk: dqp, dkp in fixed point
      cp.dqp_fix = reinterpret_cast<int64_t*>(ws + l.dqp);
      cp.dkp_fix = reinterpret_cast<int64_t*>(ws + l.dkp);
    }
  }
  float* const kl_out = present(a.kl) ? static_cast<float*>(a.kl.data) : nullptr;
  uint64_t* const dq_word = l.dq_store_first ? reinterpret_cast<uint64_t*>(ws + l.dq_word) : nullptr;
  if (l.has_teacher) {  // (has_teacher: the proxy side, every mode; R = G here)
    run_fused(g, cp, r, false, fused_scratch(l, ws), kl_out, st, dq_word, l.dq_force_wait);
  } else if (l.fused_main) {  // the fused kernel's main walk alone (persistent; store-first dq in SPARSE/GIVEN)
    run_fused_main(g, c, fused_scratch(l, ws), st, dq_word, l.dq_force_wait);  // (no teacher: it nulls the scratch)
  } else {
    attn_bwd::MainArgs mp;
    mp.c = c;
    mp.batched = g.batched;
    mp.total = g.total_k;  // the K/V descriptors' rows: key rows
    mp.Rp = tiles::head_slots(c.R);
    mp.log_rp = __builtin_ctz(unsigned(mp.Rp));
    launch_main(d, mp, g.Hq / c.R, st);
  }

  if (l.deterministic) {
    convert_fixed(d, ws + l.dq, token_tensor<void>(a.dq, g), qseqs, g.max_seqlen_q, g.Hq, float(g.scale),
                  reinterpret_cast<const float*>(ws + l.dq_unit), l.padded, bad + 0, st, l.dq32);
    convert_fixed(d, ws + l.dk, token_tensor<void>(a.dk, g), seqs, g.max_seqlen, g.Hkv, float(g.scale),
                  fix + attn_bwd::kUnitDk, 0, bad + 1, st);
    convert_fixed(d, ws + l.dv, token_tensor<void>(a.dv, g), seqs, g.max_seqlen, g.Hkv, 1.f,
                  fix + attn_bwd::kUnitDv, 0, bad + 2, st);
  } else {
    attn_bwd::DqLayout dl{c.R, tiles::head_slots(c.R)};
    if (l.dq_store_first) {  // rows nobody stored (no list entry) convert to zeros
      dl.words = reinterpret_cast<const uint64_t*>(ws + l.dq_word);
      dl.total = g.total;
    }
    convert(d, dq_acc, token_tensor<void>(a.dq, g), qseqs, g.max_seqlen_q, g.Hq, float(g.scale), st, dl);
    convert(d, dk_acc, token_tensor<void>(a.dk, g), seqs, g.max_seqlen, g.Hkv, float(g.scale), st);
    convert(d, dv_acc, token_tensor<void>(a.dv, g), seqs, g.max_seqlen, g.Hkv, 1.f, st);
  }
  if (g.has_proxy) {
    // dz was kept N / proxy_scale times larger
    const float pscale = proxy_side ? kl_scales(g).grad : 1.f;
    if (l.deterministic && l.has_teacher) {
      convert_fixed(d, ws + l.dqp, token_tensor<void>(a.dqp, g), qseqs, g.max_seqlen_q, g.Hp, pscale,
                    fix + attn_bwd::kUnitDqp, 0, bad + 3, st);
      convert_fixed(d, ws + l.dkp, token_tensor<void>(a.dkp, g), seqs, g.max_seqlen, g.Hpk, pscale,
                    fix + attn_bwd::kUnitDkp, 0, bad + 4, st);
    } else {  // (zeros when the proxy side did not run: the zeroed accumulators read as fp32)
      convert(d, reinterpret_cast<float*>(ws + l.dqp), token_tensor<void>(a.dqp, g), qseqs, g.max_seqlen_q, g.Hp,
              pscale, st);
      convert(d, reinterpret_cast<float*>(ws + l.dkp), token_tensor<void>(a.dkp, g), seqs, g.max_seqlen, g.Hpk,
              pscale, st);
    }
  }
}

}  // namespace

void bwd(const flashmsa_bwd_args_t& user, const Geometry& g, void* ws_raw, size_t ws_bytes) {
  const char* fn = "flashmsa_bwd";
  bwd_features(user, g);
  // the layout this call uses, against the bytes given
  const BwdLayout l = g.total == 0 ? BwdLayout{} : bwd_layout(user, g);
  check_layout_fits(fn, g, l.total, ws_bytes);
  auto st = static_cast<cudaStream_t>(user.stream);
  if (user.validate) {
    const auto cu = validate_offsets(user.cu_seqlens, g, st, fn);
    const Segments sg = validate_segments(user.cu_seqlens_q, user.q_origin, cu, g, st, fn);
    if (user.mode != FLASHMSA_MODE_DENSE) validate_indices(user.indices, cu, g, st, fn, &sg);
  }
  // From here on the kernels see the guard's safe cu_seqlens (a fault: every sequence empty) and segments.
  Guard gd = start_guard(user.cu_seqlens, user.status, g, guard::kBwd, ws_raw, st, &user.cu_seqlens_q, &user.q_origin);
  flashmsa_bwd_args_t a = user;
  a.cu_seqlens = gd.cu;
  for (const flashmsa_tensor_t* t : {&a.dq, &a.dk, &a.dv, &a.dqp, &a.dkp, &a.kl}) poison(gd, *t);
  if (present(a.kl)) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(a.kl.data, 0, sizeof(float), st));  // no tokens: 0
  if (g.total == 0) return finish_guard(gd, st);
  char* ws = static_cast<char*>(ws_raw) + guard_bytes(g);
  run_bwd(a, g, ws, l, st, g.segmented ? &gd : nullptr);
  finish_guard(gd, st);
}

}  // namespace flashmsa::cuda
