// The workspace layouts of the three calls (dispatch.h describes each). A query and its call
// compute the same layout from the same arguments.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "cuda/dispatch.h"
#include "cuda/tiles.h"

namespace flashmsa::cuda {

using tiles::global_blocks_bound;
using tiles::kHeadDim;

size_t guard_bytes(const Geometry& g) {
  return g.batched ? 0 : guard::workspace(g.batch, g.segmented ? g.segments : -1);
}

void check_layout_fits(const char* fn, const Geometry& g, size_t layout_bytes, size_t ws_bytes) {
  const size_t need = guard_bytes(g) + layout_bytes;
  if (need > ws_bytes)
    fail(FLASHMSA_ERROR_WORKSPACE, std::string(fn) + ": workspace: this call's layout needs " + std::to_string(need) +
                                       " bytes, got " + std::to_string(ws_bytes) +
                                       " (did a FLASHMSA_* knob change since the query?)");
}

int kl_ctas(const Geometry& g) {
  int n = 0;
  FLASHMSA_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, g.device_id));
  return n;
}

int kl_segment(const Geometry& g, int ctas) {
  // The default grows with the problem: a quarter of the dq accumulator's bytes (total x Hq x 128 fp32) for the
  // scratch (ctas x seg x 512 bytes), at least kKlSegment and at most kKlSegmentMax entries.
  int64_t seg = int64_t(g.total) * g.Hq / (4 * int64_t(ctas > 0 ? ctas : 1)) / 64 * 64;
  seg = std::clamp<int64_t>(seg, kKlSegment, kKlSegmentMax);
  if (const char* e = std::getenv("FLASHMSA_KL_SEGMENT"); e && *e) {  // tests and tuning (docs/kernels/bwd.md)
    int64_t v = 0;
    bool ok = true;
    for (const char* c = e; *c && ok; ++c) {
      ok = *c >= '0' && *c <= '9';
      v = v * 10 + (*c - '0');
      ok = ok && v <= (int64_t(1) << 20);
    }
    if (!ok || v < 1)
      fail(FLASHMSA_ERROR_INVALID_ARGUMENT,
           std::string("FLASHMSA_KL_SEGMENT: expected decimal digits for 1 .. 1048576 list entries, got '") + e + "'");
    seg = v;
  }
  if (seg > g.max_seqlen) seg = g.max_seqlen;  // a list holds at most a sequence's tokens
  return int((seg + 63) / 64 * 64);
}

namespace {
// An on/off knob: unset or empty -> dflt; "1" / "0"; anything else refused (what: the meaning of "1").
bool onoff_knob(const char* name, const char* what, bool dflt) {
  const char* x = std::getenv(name);
  if (x == nullptr || *x == 0) return dflt;
  const std::string v(x);
  if (v != "0" && v != "1")
    fail(FLASHMSA_ERROR_INVALID_ARGUMENT, std::string(name) + ": expected '1' (" + what + ") or '0', got '" + v + "'");
  return v == "1";
}
}  // namespace

BwdDqPath bwd_dq_path() {
  const char* e = std::getenv("FLASHMSA_BWD_DQ");
  if (e == nullptr || *e == 0) return BwdDqPath::kAuto;
  const std::string v(e);
  if (v == "store") return BwdDqPath::kStoreFirst;
  if (v == "add") return BwdDqPath::kAddOnly;
  if (v == "store-wait") return BwdDqPath::kStoreWait;
  fail(FLASHMSA_ERROR_INVALID_ARGUMENT,
       "FLASHMSA_BWD_DQ: expected 'store' (the first contribution to a dq row stores it), 'add' (dq zeroed, adds only) "
       "or 'store-wait' (tests: 'store', every later contribution through the writer's wait), got '" + v + "'");
}

FwdRings fwd_rings_policy() {
  FwdRings r;
  r.regroup = onoff_knob("FLASHMSA_FWD_REGROUP", "tokens regrouped by selection", true);
  r.persistent = onoff_knob("FLASHMSA_FWD_PERSISTENT", "one CTA per SM over the tiles", true);
  const char* e = std::getenv("FLASHMSA_FWD_RINGS");
  if (e == nullptr || *e == 0) return r;
  const std::string v(e);
  if (v == "auto") return r;
  if (v == "0" || v == "1") {
    r.kind = v == "0" ? kRingsNever : kRingsAlways;
    return r;
  }
  if (v.size() >= 3 && v.size() <= 5 && v.compare(0, 2, "0.") == 0 &&
      v.find_first_not_of("0123456789", 2) == std::string::npos) {  // a ratio 0.x, 0.xy or 0.xyz
    int permille = 0;
    for (size_t c = 2; c < 5; ++c) permille = permille * 10 + (c < v.size() ? v[c] - '0' : 0);
    r.ratio_permille = permille;
    r.ratio_given = true;
    return r;
  }
  fail(FLASHMSA_ERROR_INVALID_ARGUMENT,
       "FLASHMSA_FWD_RINGS: expected 'auto', a ratio '0.x' (1 to 3 digits), '0' (the shared-stream kernel) or '1' "
       "(the rings kernel), got '" + v + "'");
}

namespace {
// The kl side of a layout (forward's kl value, backward's proxy gradient), which the fused kernel runs
// in every mode: the proxy lse when it is recomputed, the kl partials, the teacher scratch and its
// items' counter.
template <class Layout, class Take>
void take_kl_side(Layout& l, Take& take, const Geometry& g, bool plse) {
  if (plse) l.plse = take(size_t(g.Hp) * g.total * 4);
  l.kl = take(size_t(g.Hp) * global_blocks_bound(g) * 4);
  l.kl_ctas = kl_ctas(g);
  l.kl_seg = kl_segment(g, l.kl_ctas);
  l.teach = take(size_t(l.kl_ctas) * size_t(l.kl_seg) * kBlockKeys * 4);
  l.next_item = take(4);
  l.has_teacher = true;
}
}  // namespace

attn_bwd::InversionArgs inversion_args(const int32_t* idx, int64_t idx_head, int64_t idx_tok,
                                       const flashmsa_tensor_t& cu, const Geometry& g, const int32_t* cuq,
                                       const int32_t* origin) {
  attn_bwd::InversionArgs ia;
  ia.indices.ptr = idx;
  ia.indices.head = idx_head;
  ia.indices.tok = idx_tok;
  ia.seqs = seqs_of(cu, g, cuq, origin);
  ia.Hp = g.Hp;
  ia.topk = g.topk;
  ia.total = g.total;
  ia.nblk = global_blocks_bound(g);
  return ia;
}

BwdLayout bwd_layout(const flashmsa_bwd_args_t& a, const Geometry& g) {
  BwdLayout l;
  // (query segments: the padded buffers are padded per segment, the preprocess's sequences)
  l.padded = padded_total(g.total, g.segmented ? g.segments : g.batch, attn_bwd::kPadTile);
  size_t off = 0;
  auto take = [&](size_t bytes) { const size_t o = off; off += align_up(bytes); return o; };
  l.lse2 = take(size_t(g.Hq) * l.padded * 4);
  l.dsum = take(size_t(g.Hq) * l.padded * 4);
  if (g.segmented) l.qrows = take(size_t(g.total) * 8);
  l.deterministic = a.deterministic;
  // The proxy side runs in the fused kernel, main walk and kl walk (the teacher in the scratch), in every mode, the
  // deterministic one too (dqp, dkp in fixed point): bwd_features refuses a proxy side unless every MSA group lies
  // inside one kv head with G <= 64, so a head unit is one MSA group (R = G). Without a proxy side the main walk runs
  // alone in the fused kernel (main_only) where a head unit is one MSA group, in the default mode; the deterministic
  // mode and groups over several head units run the standalone main kernel.
  const bool proxy_side = bwd_proxy_side(a, g);
  const bool unit_ok = g.Hp > 0 && int64_t(tiles::bwd_unit_heads(g)) * g.Hp == g.Hq;
  const bool fused_ok = unit_ok && !a.deterministic;
  // deterministic mode: the accumulators are 64-bit fixed point (bwd_params.cuh), with a unit per
  // dq row (padded like dsum; written by the preprocess, so outside the zeroed range). SPARSE/GIVEN
  // dq rows get at most topk contributions: 32 bits each, added in pairs.
  const size_t fix = a.deterministic ? 8 : 4;
  l.dq32 = a.deterministic && a.mode != FLASHMSA_MODE_DENSE;
  if (a.deterministic) l.dq_unit = take(size_t(g.Hq) * l.padded * 4);
  l.dq = take(size_t(g.total) * g.Hq * kHeadDim * (l.dq32 ? 4 : fix));
  l.dk = take(size_t(g.total_k) * g.Hkv * kHeadDim * fix);  // (key rows: total_k)
  l.dv = take(size_t(g.total_k) * g.Hkv * kHeadDim * fix);
  if (g.has_proxy) {  // (DENSE with groups over several head units: no proxy side, the fp32 zeros converted)
    const size_t fixp = a.mode == FLASHMSA_MODE_DENSE && !unit_ok ? 4 : fix;
    l.dqp = take(size_t(g.total) * g.Hp * kHeadDim * fixp);
    l.dkp = take(size_t(g.total_k) * g.Hpk * kHeadDim * fixp);
  }
  // the fused kernel (SPARSE/GIVEN with the proxy side, or its main walk alone), default mode: store-first dq rows (dq_writer.cuh), their words
  // zeroed with the accumulators. By default where a chunk holds at most a quarter of a first store on average: its
  // 64 / Rp token slots each get one of up to topk contributions, so Rp x topk >= 256 (H200: m3 at 256
  // -1.1% clustered / -1.6% random backward at 32k; fmsa at 64 +10% at 16k, each first store's publication waits for
  // its chunk's bulk operations).
  const BwdDqPath dq_path = bwd_dq_path();
  l.fused_main = fused_ok && !proxy_side;
  l.dq_store_first = a.mode != FLASHMSA_MODE_DENSE && (proxy_side || l.fused_main) && !a.deterministic &&
                     (dq_path == BwdDqPath::kStoreFirst || dq_path == BwdDqPath::kStoreWait ||
                      (dq_path == BwdDqPath::kAuto && int64_t(tiles::head_slots(g.Hq / g.Hp)) * g.topk >= 256));
  l.dq_force_wait = l.dq_store_first && dq_path == BwdDqPath::kStoreWait;
  if (l.dq_store_first) l.dq_word = take(size_t(g.Hp) * g.total * 8);
  if (a.deterministic) l.fix = take(attn_bwd::kFixWords * 4);  // zeroed with the accumulators (the range [dq, inv))
  l.inv = take(a.mode == FLASHMSA_MODE_DENSE ? attn_bwd::blk_off_workspace(g.batch)
                                             : attn_bwd::inversion_workspace(inversion_args(
                                                   static_cast<const int32_t*>(a.indices.data), a.indices.strides[0],
                                                   a.indices.strides[1], a.cu_seqlens, g)));
  if (proxy_side) take_kl_side(l, take, g, true);
  if (l.fused_main) {  // the items' counter (zeroed by run_fused_main)
    l.kl_ctas = kl_ctas(g);
    l.next_item = take(4);
  }
  l.total = off;
  return l;
}

FwdLayout fwd_layout(const flashmsa_fwd_args_t& a, const Geometry& g) {
  FwdLayout l;
  size_t off = 0;
  auto take = [&](size_t bytes) { const size_t o = off; off += align_up(bytes); return o; };
  l.sched = take(sizeof(unsigned long long));
  if (a.mode != FLASHMSA_MODE_DENSE) {  // the router's byte per forward tile (fwd.cpp's grid)
    const tiles::FwdTile t = tiles::fwd_tile(g, g.topk);
    l.route = take(size_t(tiles::fwd_tiles(g, t)));
    l.perm = take(size_t(g.Hp) * g.total * 4);
  }
  if (a.mode == FLASHMSA_MODE_SPARSE && !present(a.indices)) l.idx = take(size_t(g.Hp) * g.total * g.topk * 4);
  if (a.mode == FLASHMSA_MODE_SPARSE && g.fp8_selection) l.fp8 = take(fp8_selection_bytes(g));
  if (a.compute_kl) {
    l.padded = padded_total(g.total, g.segmented ? g.segments : g.batch, attn_bwd::kPadTile);
    l.lse2 = take(size_t(g.Hq) * l.padded * 4);
    if (g.segmented) l.qrows = take(size_t(g.total) * 8);
    l.inv = take(a.mode == FLASHMSA_MODE_DENSE
                     ? attn_bwd::blk_off_workspace(g.batch)
                     : attn_bwd::inversion_workspace(inversion_args(nullptr, 0, 0, a.cu_seqlens, g)));
    // the fused kernel's teacher_only walks in every mode (DENSE: over lists of every token from the block on, as the
    // backward's)
    take_kl_side(l, take, g, !present(a.proxy_lse));
  }
  l.total = off;
  return l;
}

size_t select_fp8_offset(const Geometry& g) { return align_up(guard_bytes(g)); }

size_t select_workspace(const flashmsa_select_args_t&, const Geometry& g) {
  return g.fp8_selection && g.total > 0 ? select_fp8_offset(g) + fp8_selection_bytes(g) : guard_bytes(g);
}

size_t fwd_workspace(const flashmsa_fwd_args_t& a, const Geometry& g) {
  fwd_features(a, g);
  fwd_rings_policy();  // a bad FLASHMSA_FWD_RINGS fails every forward query, whatever the mode
  return guard_bytes(g) + (g.total == 0 ? 0 : fwd_layout(a, g).total);
}

size_t bwd_workspace(const flashmsa_bwd_args_t& a, const Geometry& g) {
  bwd_features(a, g);
  bwd_dq_path();  // a bad FLASHMSA_BWD_DQ fails every backward query (and call: api.cpp), whatever the mode
  return guard_bytes(g) + (g.total == 0 ? 0 : bwd_layout(a, g).total);
}

}  // namespace flashmsa::cuda
