// flashmsa_select on the CUDA backend, and the selection kernel's other uses (the proxy lse
// alone, for the forward's outputs and the kl).
#include "cuda/dispatch.h"
#include "cuda/tiles.h"

namespace flashmsa::cuda {

void launch_select(Dtype d, const selection::Args& a, cudaStream_t st) {
  by_dtype(d, [&](auto D) { selection::run<decltype(D)::value>(a, st); });
}

void run_select(const flashmsa_tensor_t& qp, const flashmsa_tensor_t& kp, const flashmsa_tensor_t& cu,
                const Geometry& g, int32_t* indices, int64_t idx_head, int64_t idx_tok, HeadTensor<float> proxy_lse,
                cudaStream_t st, int lse_mode, HeadTensor<const int32_t> given, const Guard* segments) {
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
  launch_select(dtype_of(g), p, st);
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
             head_tensor<float>(a.proxy_lse), st, selection::kSelect, {}, g.segmented ? &gd : nullptr);
  poison(gd, a.indices);
  poison(gd, a.proxy_lse);
  finish_guard(gd, st);
}

}  // namespace flashmsa::cuda
