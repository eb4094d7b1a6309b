// flashmsa_fwd on the CUDA backend: the selection (SPARSE) or the proxy lse alone, the main
// forward, and the kl value when asked (the main backward's teacher-only pass and the proxy side,
// proxy_side.cpp).
#include "cuda/dispatch.h"
#include "cuda/tiles.h"

namespace flashmsa::cuda {

namespace {

// The main forward. SPARSE/GIVEN: the shared-stream kernel, the per-warpgroup rings kernel, or (by
// default where R >= 8, FLASHMSA_FWD_RINGS) both over one grid, each running the tiles that the
// router gave it (fwd/fwd_route.cu; `route`: the workspace's byte per tile). DENSE: the shared stream.
void run_fwd(const flashmsa_fwd_args_t& a, const Geometry& g, const Guard& gd, const int32_t* idx, int64_t idx_head,
             int64_t idx_tok, const FwdRings& rings, uint8_t* route, int32_t* perm, unsigned long long* sched,
             cudaStream_t st) {
  attn_fwd::Args p;
  p.q = token_tensor<const void>(a.q, g);
  p.k = token_tensor<const void>(a.k, g);
  p.v = token_tensor<const void>(a.v, g);
  p.batched = g.batched;
  p.out = token_tensor<void>(a.out, g);
  if (present(a.out_lo)) p.out_lo = token_tensor<void>(a.out_lo, g);
  p.lse = head_tensor<float>(a.lse);
  p.indices.ptr = idx;
  p.indices.head = idx_head;
  p.indices.tok = idx_tok;
  // (query segments: the guard's safe copies; every query-side row is then a query row)
  p.seqs = g.segmented ? seqs_of(a.cu_seqlens, g, gd.cuq, gd.origin) : seqs_of(a.cu_seqlens, g);
  p.Hq = g.Hq;
  p.Hkv = g.Hkv;
  p.Hp = g.Hp;
  p.topk = a.mode == FLASHMSA_MODE_DENSE ? 0 : g.topk;
  const tiles::FwdTile tile = tiles::fwd_tile(g, p.topk);
  p.R = tile.R;
  p.NT = tile.NT;
  p.scale = float(g.scale);
  p.num_m_tiles = int(tiles::fwd_m_tiles(g, tile));
  p.total = g.total_k;  // the k and v descriptors' rows
  p.tile_counter = rings.persistent ? sched : nullptr;
  // (the regrouping permutes a sequence's tokens within 128-position spans: not for query segments)
  if (idx != nullptr && rings.regroup && !g.segmented && attn_fwd::regroup_applies(p.NT, p.topk)) {
    attn_fwd::launch_regroup(p, g.max_seqlen, perm, g.total, st);  // before the router, which reads it
    p.perm = perm;
    p.perm_head = g.total;
  }
  FwdRingsKind policy = idx == nullptr ? kRingsNever : rings.kind;
  if (policy == kRingsAuto && !rings.ratio_given && attn_fwd::kRowsPerWarpGroup / p.R > kRingsMaxTokens)
    policy = kRingsNever;
  if (policy == kRingsAuto) {
    attn_fwd::launch_route(p, rings.ratio_permille, route, st);
    p.route = route;
  }
  by_dtype(dtype_of(g), [&](auto D) {
    constexpr Dtype d = decltype(D)::value;
    const bool lazy = a.numerics == FLASHMSA_NUMERICS_INFER;
    if (policy != kRingsAlways) lazy ? attn_fwd::run<d, true, false>(p, st) : attn_fwd::run<d, false, false>(p, st);
    if (policy != kRingsNever) lazy ? attn_fwd::run<d, true, true>(p, st) : attn_fwd::run<d, false, true>(p, st);
  });
}

// kl of the forward: the fused kernel's teacher_only walks (no gradients) over the main probabilities that the
// forward's lse defines, partials added in a fixed order.
void run_fwd_kl(const flashmsa_fwd_args_t& a, const Geometry& g, const int32_t* idx, int64_t idx_head,
                int64_t idx_tok, const flashmsa_tensor_t& plse_t, char* ws, const FwdLayout& l, cudaStream_t st,
                const Guard* segs) {
  attn_bwd::PreprocessArgs pa;
  pa.out = token_tensor<const void>(a.out, g);
  pa.lse = head_tensor<const float>(a.lse);
  // (query segments: over the segments, as the backward's preprocess)
  pa.seqs = segs ? attn_bwd::query_seqs(seqs_of(a.cu_seqlens, g, segs->cuq, segs->origin)) : seqs_of(a.cu_seqlens, g);
  pa.Hq = g.Hq;
  pa.max_seqlen = g.max_seqlen_q;
  pa.lse2 = reinterpret_cast<float*>(ws + l.lse2);
  pa.padded_stride = l.padded;
  by_dtype(dtype_of(g), [&](auto D) { attn_bwd::launch_preprocess<decltype(D)::value>(pa, st); });
  const attn_bwd::Common c = common_base(g, a.q, a.k, a.cu_seqlens, pa.lse2, l.padded,
                                         a.mode == FLASHMSA_MODE_DENSE, idx, idx_head, idx_tok, ws + l.inv, st, segs,
                                         segs ? reinterpret_cast<int32_t*>(ws + l.qrows) : nullptr);
  flashmsa_tensor_t idx_t{};  // the rows the proxy lse recompute reads (GIVEN)
  idx_t.data = const_cast<int32_t*>(idx);
  idx_t.ndim = 3;
  idx_t.strides[0] = idx_head;
  idx_t.strides[1] = idx_tok;
  idx_t.strides[2] = 1;
  ProxyRun r;
  r.qp = &a.qp;
  r.kp = &a.kp;
  r.cu = &a.cu_seqlens;
  r.indices = &idx_t;
  r.proxy_lse = &plse_t;
  r.segments = segs;
  r.plse_ws = reinterpret_cast<float*>(ws + l.plse);
  r.kl_acc = reinterpret_cast<float*>(ws + l.kl);
  r.grads = false;
  // the fused kernel in every mode: the main backward's S and P only (the teacher), the kl walk (R = G: fwd_features);
  // DENSE walks lists of every token from the block on, as the backward's (the kl part 2.0-2.6x faster at fmsa 16k
  // and m3 32k than recomputing the teacher in a kernel of its own: docs/kernels/bwd.md)
  run_fused(g, c, r, true, fused_scratch(l, ws), static_cast<float*>(a.kl.data), st);
}

}  // namespace

void fwd(const flashmsa_fwd_args_t& user, const Geometry& g, void* ws_raw, size_t ws_bytes) {
  const char* fn = "flashmsa_fwd";
  fwd_features(user, g);
  const FwdRings rings = fwd_rings_policy();  // a bad FLASHMSA_FWD_RINGS: refused before any work, whatever the mode
  // the layout this call uses, against the bytes given
  const FwdLayout l = g.total == 0 ? FwdLayout{} : fwd_layout(user, g);
  check_layout_fits(fn, g, l.total, ws_bytes);
  auto st = static_cast<cudaStream_t>(user.stream);
  if (user.validate) {
    const auto cu = validate_offsets(user.cu_seqlens, g, st, fn);
    const Segments sg = validate_segments(user.cu_seqlens_q, user.q_origin, cu, g, st, fn);
    if (user.mode == FLASHMSA_MODE_GIVEN) validate_indices(user.indices, cu, g, st, fn, &sg);
  }
  // From here on the kernels see the guard's safe cu_seqlens (a fault: every sequence empty) and segments.
  Guard gd = start_guard(user.cu_seqlens, user.status, g, guard::kFwd, ws_raw, st, &user.cu_seqlens_q, &user.q_origin);
  const Guard* segs = g.segmented ? &gd : nullptr;
  flashmsa_fwd_args_t a = user;
  a.cu_seqlens = gd.cu;
  for (const flashmsa_tensor_t* t : {&a.out, &a.out_lo, &a.lse, &a.proxy_lse, &a.kl}) poison(gd, *t);
  if (a.mode == FLASHMSA_MODE_SPARSE) poison(gd, a.indices);
  if (present(a.kl)) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(a.kl.data, 0, sizeof(float), st));
  if (g.total == 0) return finish_guard(gd, st);
  char* ws = static_cast<char*>(ws_raw) + guard_bytes(g);

  const int32_t* idx = nullptr;
  int64_t idx_head = 0, idx_tok = 0;
  // the proxy lse: an output, or (for the kl) workspace
  flashmsa_tensor_t plse_t = a.proxy_lse;
  if (!present(plse_t) && a.compute_kl) {
    plse_t = flashmsa_tensor_t{};
    plse_t.data = ws + l.plse;
    plse_t.dtype = FLASHMSA_DTYPE_FP32;
    plse_t.ndim = 2;
    plse_t.shape[0] = g.Hp;
    plse_t.shape[1] = g.total;
    plse_t.strides[0] = g.total;
    plse_t.strides[1] = 1;
    plse_t.device_type = FLASHMSA_DEVICE_CUDA;
  }
  if (a.mode == FLASHMSA_MODE_SPARSE) {
    int32_t* dst = present(a.indices) ? static_cast<int32_t*>(a.indices.data) : reinterpret_cast<int32_t*>(ws + l.idx);
    idx_head = present(a.indices) ? a.indices.strides[0] : g.total * g.topk;
    idx_tok = present(a.indices) ? a.indices.strides[1] : g.topk;
    run_select(a.qp, a.kp, a.cu_seqlens, g, dst, idx_head, idx_tok, head_tensor<float>(plse_t), st,
               selection::kSelect, {}, segs, ws + l.fp8);
    idx = dst;
  } else {
    if (a.mode == FLASHMSA_MODE_GIVEN) {
      idx = static_cast<const int32_t*>(a.indices.data);
      idx_head = a.indices.strides[0];
      idx_tok = a.indices.strides[1];
    }
    if (present(plse_t)) {  // the proxy lse over the given sets / the causal set (an output, or the kl's)
      HeadTensor<const int32_t> given;
      given.ptr = idx;
      given.head = idx_head;
      given.tok = idx_tok;
      const int mode = a.mode == FLASHMSA_MODE_DENSE ? selection::kDenseLse : selection::kGivenLse;
      run_select(a.qp, a.kp, a.cu_seqlens, g, nullptr, 0, 0, head_tensor<float>(plse_t), st, mode, given, segs);
    }
  }

  run_fwd(a, g, gd, idx, idx_head, idx_tok, rings, reinterpret_cast<uint8_t*>(ws + l.route),
          reinterpret_cast<int32_t*>(ws + l.perm), reinterpret_cast<unsigned long long*>(ws + l.sched), st);
  if (a.compute_kl) run_fwd_kl(a, g, idx, idx_head, idx_tok, plse_t, ws, l, st, segs);
  finish_guard(gd, st);
}

}  // namespace flashmsa::cuda
