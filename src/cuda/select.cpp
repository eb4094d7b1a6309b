// flashmsa_select on the CUDA backend, and the selection kernel's other uses (the proxy lse
// alone, for the forward's outputs and the kl).
#include "cuda/dispatch.h"
#include "cuda/select/fp8_quant.h"
#include "cuda/tiles.h"

namespace flashmsa::cuda {

void launch_select(Dtype d, const selection::Args& a, cudaStream_t st) {
  by_dtype(d, [&](auto D) { selection::run<decltype(D)::value>(a, st); });
}

void run_select(const flashmsa_tensor_t& qp, const flashmsa_tensor_t& kp, const flashmsa_tensor_t& cu,
                const Geometry& g, int32_t* indices, int64_t idx_head, int64_t idx_tok, HeadTensor<float> proxy_lse,
                cudaStream_t st, int lse_mode, HeadTensor<const int32_t> given, const Guard* segments, void* fp8_ws) {
  selection::Args p;
  p.qp = token_tensor<const void>(qp, g);
  p.kp = token_tensor<const void>(kp, g);
  p.batched = g.batched;
  // query segments: the guard's safe copies (every query-side row then a query row)
  p.seqs = segments != nullptr ? seqs_of(cu, g, segments->cuq, segments->origin) : seqs_of(cu, g);
  p.Hp = g.Hp;
  p.Hpk = g.Hpk;
  p.topk = g.topk;
  p.proxy_scale = float(g.proxy_scale);
  p.indices.ptr = indices;
  p.indices.head = idx_head;
  p.indices.tok = idx_tok;
  p.proxy_lse = proxy_lse;
  p.num_m_blocks = int((g.max_seqlen + tiles::kTileRows - 1) / tiles::kTileRows);  // one CTA per query block
  p.lse_mode = lse_mode;
  p.given = given;
  p.total = g.total_k;  // the kp descriptor's rows
  if (!(g.fp8_selection && lse_mode == selection::kSelect)) return launch_select(dtype_of(g), p, st);
  // fp8: e4m3 copies of qp (per row) and kp (per key block), the ranking on them, then the proxy lse over the
  // selected blocks in the input dtype (the union walk, selection::kGivenLse)
  using selection::Fp8Copies;
  const Fp8Copies c = selection::fp8_copies_at(fp8_ws, g.total, g.total_k, g.Hp, g.Hpk);
  selection::QuantArgs qa;
  qa.batched = g.batched;
  qa.qp = p.qp;
  qa.kp = p.kp;
  qa.keys = seqs_of(cu, g);
  qa.seqlen = g.seqlen;
  qa.Hp = g.Hp;
  qa.Hpk = g.Hpk;
  qa.max_blocks = int((g.max_seqlen + kBlockKeys - 1) / kBlockKeys);
  selection::quantize_fp8(dtype_of(g), qa, c, st);
  selection::Args p8 = p;
  p8.qp = TokenTensor<const void>{c.q8, int64_t(g.Hp) * kHeadDimInst, kHeadDimInst, 0};
  p8.kp = TokenTensor<const void>{c.k8, int64_t(g.Hpk) * kHeadDimInst, kHeadDimInst, 0};
  p8.proxy_lse = {};
  selection::Fp8Scales sc;
  sc.qscale = c.qscale;
  sc.kscale = c.kscale;
  sc.total_q = g.total;
  selection::run<Dtype::kE4m3>(p8, st, sc);
  if (proxy_lse.ptr == nullptr) return;
  p.lse_mode = selection::kGivenLse;
  p.given.ptr = indices;
  p.given.head = idx_head;
  p.given.tok = idx_tok;
  p.indices = {};
  launch_select(dtype_of(g), p, st);
}

size_t fp8_selection_bytes(const Geometry& g) {
  return g.fp8_selection ? selection::fp8_copies_bytes(g.total, g.total_k, g.Hp, g.Hpk) : 0;
}

void select(const flashmsa_select_args_t& a, const Geometry& g, void* ws, size_t) {
  const char* fn = "flashmsa_select";
  check_aligned(fn, "qp", a.qp);
  check_aligned(fn, "kp", a.kp);
  if (present(a.proxy_lse) && a.proxy_lse.dtype != FLASHMSA_DTYPE_FP32) unsupported(fn, "proxy_lse must be fp32");
  auto st = static_cast<cudaStream_t>(a.stream);
  Guard gd = start_guard(a.cu_seqlens, a.status, g, guard::kSelect, ws, st, &a.cu_seqlens_q, &a.q_origin);
  if (g.total == 0) return;
  run_select(a.qp, a.kp, gd.cu, g, static_cast<int32_t*>(a.indices.data), a.indices.strides[0], a.indices.strides[1],
             head_tensor<float>(a.proxy_lse), st, selection::kSelect, {}, g.segmented ? &gd : nullptr,
             static_cast<char*>(ws) + select_fp8_offset(g));
  poison(gd, a.indices);
  poison(gd, a.proxy_lse);
  finish_guard(gd, st);
}

}  // namespace flashmsa::cuda
