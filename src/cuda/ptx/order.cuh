// Ordered accumulation across CTAs for the deterministic backward: a CTA that adds into a shared
// fp32 accumulator waits until the accumulator's counter equals its turn, adds, and passes the
// turn on; fp32 addition then happens in the same order on every run. The waits only point to
// CTAs of smaller linear index (launched earlier), so they always make progress.
#pragma once

#include <cstdint>

namespace flashmsa::cuda::ptx {

// PTX ISA 9.7.9.8 ld (.acquire, gpu scope).
__device__ __forceinline__ int32_t ld_acquire_gpu(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// PTX ISA 9.7.9.9 st (.release, gpu scope).
__device__ __forceinline__ void st_release_gpu(int32_t* p, int32_t v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// PTX ISA 9.7.x: %globaltimer, a nanosecond wall clock.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// Ends the kernel with an error. Out of line: an inlined trap in the backward kernels' loops made
// ptxas spill ~1.4 KB per thread (measured with -Xptxas -v); a call costs nothing there.
static __device__ __noinline__ void trap_out_of_line() { __trap(); }

// Spins until *counter == turn. A turn that never comes is a bug (a counter nobody advances):
// after 30 s it traps, so the call fails with a CUDA error instead of hanging.
__device__ __forceinline__ void wait_turn(const int32_t* counter, int32_t turn) {
  if (ld_acquire_gpu(counter) == turn) return;
  const uint64_t start = global_timer_ns();
  while (ld_acquire_gpu(counter) != turn) {
    __nanosleep(64);
    if (global_timer_ns() - start > 30ull * 1000 * 1000 * 1000) trap_out_of_line();
  }
}

}  // namespace flashmsa::cuda::ptx
