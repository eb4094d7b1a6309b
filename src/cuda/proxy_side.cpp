// What the forward's kl value and the backward's proxy gradient share: the Common parameters of
// the backward's kernels (with the index inversion), the proxy lse the kl needs, the proxy side's
// launch (the fused main + kl kernel, every mode), and the fused kernel's main walk alone (no proxy
// side).
#include <algorithm>
#include <cstdint>

#include "cuda/dispatch.h"
#include "cuda/tiles.h"

namespace flashmsa::cuda {

namespace {

// The default or the deterministic instantiation of a kernel: `det` says which the parameters ask
// for, `ready` whether they carry what it needs (their fixed-point accumulators, bwd_params.cuh).
bool deterministic(bool det, bool ready) {
  if (det && !ready) fail(FLASHMSA_ERROR_INTERNAL, "flashmsa_bwd: CUDA backend: deterministic mode without its sums");
  return det;
}

// The proxy lse the kl needs: the given tensor, or recomputed over the same sets into workspace.
HeadTensor<float> proxy_lse_for_kl(const Geometry& g, const attn_bwd::Common& c, const ProxyRun& r, cudaStream_t st) {
  HeadTensor<float> plse;
  if (present(*r.proxy_lse)) {
    plse = head_tensor<float>(*r.proxy_lse);
  } else {  // the proxy lse over the same sets
    plse.ptr = r.plse_ws;
    plse.head = g.total;
    plse.tok = 1;
    HeadTensor<const int32_t> given;
    if (!c.dense) {
      given.ptr = static_cast<const int32_t*>(r.indices->data);
      given.head = r.indices->strides[0];
      given.tok = r.indices->strides[1];
    }
    run_select(*r.qp, *r.kp, *r.cu, g, nullptr, 0, 0, plse, st, c.dense ? selection::kDenseLse : selection::kGivenLse,
               given, r.segments);
  }
  return plse;
}

// The shared parameters plus the proxy side's: qp, kp, the proxy lse (given or recomputed), the
// dqp/dkp/kl accumulators and the kl gradient.
attn_bwd::Common proxy_common(const Geometry& g, const attn_bwd::Common& c, const ProxyRun& r, cudaStream_t st) {
  const HeadTensor<float> plse = proxy_lse_for_kl(g, c, r, st);
  attn_bwd::Common pc = c;
  pc.qp = token_tensor<const void>(*r.qp, g);
  pc.kp = token_tensor<const void>(*r.kp, g);
  pc.plse.ptr = plse.ptr;
  pc.plse.head = plse.head;
  pc.plse.tok = plse.tok;
  pc.dqp_acc = r.dqp_acc;
  pc.dkp_acc = r.dkp_acc;
  pc.kl_acc = r.kl_acc;
  pc.dkl = r.dkl;
  return pc;
}

}  // namespace

attn_bwd::Common common_base(const Geometry& g, const flashmsa_tensor_t& q, const flashmsa_tensor_t& k,
                             const flashmsa_tensor_t& cu, float* lse2, int64_t padded, bool dense,
                             const int32_t* idx, int64_t idx_head, int64_t idx_tok, char* inv_ws,
                             cudaStream_t st, const Guard* segments, int32_t* qrows) {
  attn_bwd::Common c;
  c.q = token_tensor<const void>(q, g);
  c.k = token_tensor<const void>(k, g);
  c.lse2.ptr = lse2;
  c.lse2.head = padded;
  c.lse2.tok = 1;
  const int32_t* cuq = segments ? segments->cuq : nullptr;
  const int32_t* origin = segments ? segments->origin : nullptr;
  c.seqs = seqs_of(cu, g, cuq, origin);
  if (cuq) {  // each query row's position and padded index (the kernels' row_pos, row_pad)
    if (!qrows) fail(FLASHMSA_ERROR_INTERNAL, "flashmsa: CUDA backend: query segments without their rows' workspace");
    attn_bwd::launch_query_rows(c.seqs, g.total, qrows, qrows + g.total, st);
    c.qpos = qrows;
    c.qpad = qrows + g.total;
  }
  c.dense = dense;
  if (dense) {
    if (cuq) fail(FLASHMSA_ERROR_INTERNAL, "flashmsa: CUDA backend: DENSE lists with query segments");
    c.inv.blk_off = attn_bwd::build_blk_off(c.seqs, inv_ws, st);
    c.inv.nblk = tiles::global_blocks_bound(g);
  } else {
    attn_bwd::InversionArgs ia = inversion_args(idx, idx_head, idx_tok, cu, g, cuq, origin);
    c.inv = attn_bwd::build_inversion(ia, inv_ws, st);
  }
  c.Hq = g.Hq;
  c.Hkv = g.Hkv;
  c.Hp = g.Hp;
  c.Hpk = g.Hpk;
  c.scale = float(g.scale);
  c.proxy_scale = float(g.proxy_scale);
  c.total = g.total;
  return c;
}

void launch_main(Dtype d, const attn_bwd::MainArgs& a, int units, cudaStream_t st) {
  by_dtype(d, [&](auto D) {
    by_det(deterministic(a.c.fix != nullptr, a.c.dq_fix && a.c.dk_fix && a.c.dv_fix && a.c.dq_unit.ptr),
           [&](auto Det) { attn_bwd::run_main<decltype(D)::value, decltype(Det)::value>(a, units, st); });
  });
}

namespace {
void kl_reduce(const Geometry& g, const ProxyRun& r, float* kl_out, cudaStream_t st) {
  if (kl_out)
    attn_bwd::launch_kl_reduce(r.kl_acc, int64_t(g.Hp) * tiles::global_blocks_bound(g), kl_scales(g).value, kl_out,
                               st);
}
}  // namespace

namespace {
// The fused kernel's arguments both launches share: c with one MSA group per head unit, the geometry, the persistent
// CTAs' scratch and item counter (zeroed here, on the stream), the dq path.
attn_bwd::FusedArgs fused_args(const Geometry& g, const attn_bwd::Common& c, const FusedScratch& s, cudaStream_t st,
                               uint64_t* dq_word, bool dq_force_wait) {
  attn_bwd::FusedArgs fa;
  fa.c = c;
  fa.c.R = tiles::bwd_unit_heads(g);
  if (int64_t(fa.c.R) * g.Hp != g.Hq)
    fail(FLASHMSA_ERROR_INTERNAL, "flashmsa: CUDA backend: the fused kernel needs one group per unit");
  fa.batched = g.batched;
  fa.total = g.total_k;  // the K/V (Kp) descriptors' rows: key rows
  fa.Rp = tiles::head_slots(fa.c.R);
  fa.log_rp = __builtin_ctz(unsigned(fa.Rp));
  fa.scratch = s.teacher;
  fa.seg = s.seg;
  fa.ctas = s.ctas;
  fa.next_item = s.next_item;
  fa.dq_word = dq_word;
  fa.dq_force_wait = dq_force_wait;
  FLASHMSA_CUDA_CHECK(cudaMemsetAsync(s.next_item, 0, sizeof(int32_t), st));
  return fa;
}
}  // namespace

void run_fused(const Geometry& g, const attn_bwd::Common& c, const ProxyRun& r, bool teacher_only,
               const FusedScratch& s, float* kl_out, cudaStream_t st, uint64_t* dq_word, bool dq_force_wait) {
  attn_bwd::FusedArgs fa =
      fused_args(g, proxy_common(g, c, r, st), s, st, teacher_only ? nullptr : dq_word, dq_force_wait);
  fa.teacher_only = teacher_only;
  fa.grads = r.grads && !teacher_only;
  const bool det = fa.c.fix != nullptr;
  const bool ready = fa.c.dq_fix && fa.c.dk_fix && fa.c.dv_fix && fa.c.dq_unit.ptr && fa.c.dqp_fix && fa.c.dkp_fix;
  by_dtype(dtype_of(g), [&](auto D) {
    by_det(deterministic(det, ready),
           [&](auto Det) { attn_bwd::run_fused<decltype(D)::value, decltype(Det)::value>(fa, st); });
  });
  kl_reduce(g, r, kl_out, st);
}

void run_fused_main(const Geometry& g, const attn_bwd::Common& c, const FusedScratch& s, cudaStream_t st,
                    uint64_t* dq_word, bool dq_force_wait) {
  if (c.fix) fail(FLASHMSA_ERROR_INTERNAL, "flashmsa: CUDA backend: the fused main walk needs the default mode");
  attn_bwd::FusedArgs fa = fused_args(g, c, s, st, dq_word, dq_force_wait);
  fa.main_only = true;
  fa.grads = false;
  fa.scratch = nullptr;
  // one segment per item: a list (DENSE: the block's tokens to the sequence's end) holds at most a sequence's tokens
  // (segments are a multiple of 64 entries)
  fa.seg = int(std::min<int64_t>((g.max_seqlen + 63) / 64 * 64, int64_t(INT32_MAX) / 64 * 64));
  by_dtype(dtype_of(g), [&](auto D) { attn_bwd::run_fused<decltype(D)::value, false>(fa, st); });
}

}  // namespace flashmsa::cuda
