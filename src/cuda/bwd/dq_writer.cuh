// The fused kernel's dQ writer with store-first rows (docs/kernels/bwd.md, the dQ path): the first contribution to
// arrive at a (token, proxy head)'s G dq rows stores them (a plain bulk copy) instead of adding them, so dq_acc needs
// no zeroing: the memset's write of dq_acc (1.07 GB at m3 32k) and the first adds' reads of its zeros go away. The
// later contributions add as before (one bulk reduce per token slot), once the first has completed.
//
// Each row group has a 64-bit word [Hp, total] (zeroed with the accumulators): the low half counts the arrivals, the
// high half becomes 1 when the first contribution's store has completed. A contribution arrives with an acquire
// atomic; the first (old low half 0) stores; a later one whose first has not completed yet (old high half 0) waits for
// it. A writer publishes its chunk's first stores (completion, fence.proxy.async.global, red.release) before it waits
// for anyone else's, so the waits form no cycle; they are rare (two CTAs at one token within microseconds). The dq
// convert kernel reads the words: a row group nobody reached (GIVEN rows without blocks) converts to zeros, not to
// the workspace's bytes.
//
// Ordering: a first store completes (cp.async.bulk.wait_group 0), lane 0 orders it before the generic proxy
// (fence.proxy.async.global), the warp synchronises and the slot's lane releases the word (red.release.gpu). A later
// contribution acquires the word (atom.acquire or ld.acquire), then lane 0 orders the async-proxy adds after that
// (fence.proxy.async.global) before issuing them. The kernel's end orders everything before the convert kernel. No
// __threadfence: it turns the kernel's fire-and-forget REDs into waiting ATOMs (tests/sass/check_sass.py checks it).
#pragma once

#include "cuda/bwd/bwd_common.cuh"
#include "cuda/bwd/bwd_params.cuh"

namespace flashmsa::cuda::attn_bwd {

namespace dqw {

__device__ __forceinline__ uint64_t atom_add_acquire(uint64_t* p, uint64_t v) {
  uint64_t old;
  asm volatile("atom.acquire.gpu.global.add.u64 %0, [%1], %2;\n" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}
__device__ __forceinline__ void red_add_release(uint64_t* p, uint64_t v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.b64 %0, [%1];\n" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// PTX ISA: %globaltimer, a nanosecond wall clock
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
// PTX ISA: membar/fence, .proxy.async restricted to the global state space
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
// a plain bulk copy of one slot's rows, shared -> global (PTX ISA: cp.async.bulk, bulk_group)
__device__ __forceinline__ void bulk_store_row(float* gdst, const float* ssrc, uint32_t bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(ssrc));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gdst), "r"(s), "r"(bytes)
               : "memory");
}
constexpr uint64_t kStored = uint64_t(1) << 32;
// A wait that never ends is a bug (a first store nobody publishes): trap after 30 s. Out of line (rarely run).
static __device__ __noinline__ void wait_stored(const uint64_t* w) {
  const uint64_t start = global_timer_ns();
  while ((ld_acquire(w) >> 32) == 0) {
    __nanosleep(64);
    if (global_timer_ns() - start > 30ull * 1000 * 1000 * 1000) __trap();
  }
}
// Lane 0 issues the slots of `mask` (bit s: slot s, 0..63): a store where `first` has the bit, else an add.
template <int kHeadDim>
__device__ __forceinline__ void issue(float* acc, const int64_t* off, const float (*tile)[kHeadDim], int slots,
                                      int slot_rows, uint32_t slot_bytes, uint64_t mask, uint64_t first) {
  for (int s = 0; s < slots; ++s) {
    const int64_t o = off[s * slot_rows];
    if (o < 0 || !((mask >> s) & 1)) continue;
    if ((first >> s) & 1) bulk_store_row(acc + o, tile[s * slot_rows], slot_bytes);
    else bulk_add_row(acc + o, tile[s * slot_rows], slot_bytes);
  }
}

}  // namespace dqw

// The writer's range of chunks (main_produce's writer branch, fused kernel, default mode, P.dq_word set). Slots
// s = lane and lane + 32 of each chunk belong to the lane.
template <class C, class Params, class Smem, class Sync, class State, class Item>
__device__ __forceinline__ void store_first_dq_writer(const Params& P, Smem& S, Sync& sync, State& state,
                                                      const Item& m, int nchunks, int NTc) {
  const Common& p = P.c;
  const int lane = threadIdx.x % 32;
  const int Rp = P.Rp;
  uint64_t* const word = P.dq_word + int64_t(m.grp) * p.total;  // [Hp, query rows]
  const uint32_t slot_bytes = uint32_t(p.R * C::kHeadDim * sizeof(float));
  // lane 0: every bulk group complete and ordered before the generic proxy; then the lanes of first stores publish
  auto publish = [&](bool fa, bool fb, int32_t ta, int32_t tb) {
    if (lane == 0) {
      asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
      dqw::fence_proxy_async_global();
    }
    __syncwarp();
    if (fa) dqw::red_add_release(word + ta, dqw::kStored);
    if (fb) dqw::red_add_release(word + tb, dqw::kStored);
  };
  for (int c = 0; c < nchunks; ++c) {
    sync.dq_full.wait(state.count() & 1);  // (the producer state counts the chunks as the consumers' does)
    const int32_t ta = lane < NTc ? S.dq_tok[lane * Rp] : -1, tb = lane + 32 < NTc ? S.dq_tok[(lane + 32) * Rp] : -1;
    uint64_t oa = 0, ob = 0;
    if (ta >= 0) oa = dqw::atom_add_acquire(word + ta, 1);
    if (tb >= 0) ob = dqw::atom_add_acquire(word + tb, 1);
    const bool fa = ta >= 0 && uint32_t(oa) == 0, fb = tb >= 0 && uint32_t(ob) == 0;  // this is the first
    // its first is not done (P.dq_force_wait, tests: every later contribution takes the rare path below)
    const bool wa = ta >= 0 && !fa && ((oa >> 32) == 0 || P.dq_force_wait),
               wb = tb >= 0 && !fb && ((ob >> 32) == 0 || P.dq_force_wait);
    uint64_t first = uint64_t(__ballot_sync(0xffffffffu, fa)) | uint64_t(__ballot_sync(0xffffffffu, fb)) << 32;
    uint64_t ready = ~uint64_t(0);
    if (__any_sync(0xffffffffu, wa || wb)) {
      // rare: this chunk's first stores go out and are published before the writer waits for anyone's
      if (lane == 0) {
        dqw::issue<C::kHeadDim>(p.dq_acc, S.dq_row, S.dq, NTc, Rp, slot_bytes, first, first);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      }
      publish(fa, fb, ta, tb);
      if (wa) dqw::wait_stored(word + ta);
      if (wb) dqw::wait_stored(word + tb);
      ready = ~first;
      first = 0;
    }
    __syncwarp();  // the lanes' acquires before lane 0's fence and adds
    if (lane == 0) {
      dqw::fence_proxy_async_global();  // the acquired first stores before these adds
      dqw::issue<C::kHeadDim>(p.dq_acc, S.dq_row, S.dq, NTc, Rp, slot_bytes, ready, first);
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // the engine has read the tile
    }
    __syncwarp();
    sync.dq_empty.arrive();
    if (first) publish((first >> lane) & 1, (first >> (lane + 32)) & 1, ta, tb);  // others' adds wait for these
    ++state;
  }
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the adds done before the range ends
}

}  // namespace flashmsa::cuda::attn_bwd
