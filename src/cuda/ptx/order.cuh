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

// Spins until *counter == turn.
__device__ __forceinline__ void wait_turn(const int32_t* counter, int32_t turn) {
  while (ld_acquire_gpu(counter) != turn) __nanosleep(64);
}

}  // namespace flashmsa::cuda::ptx
