// Small typed wrappers over single PTX instruction families that the kernels use directly.
#pragma once

#include <cstdint>

namespace flashmsa::cuda::ptx {

// PTX ISA 9.7.9.25.3: cp.async (16-byte, cache-global); src_bytes < 16 zero-fills the rest.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes = 16) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes)
               : "memory");
}

// 4-byte cp.async (cache-all; the only size class below 16 bytes is .ca); src_bytes 0 writes zero.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, int src_bytes = 4) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}

// PTX ISA 9.7.9.25.3.2: cp.async.commit_group / cp.async.wait_group N.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// PTX ISA 9.7.13.4.x (membar/fence): fence.proxy.async.shared::cta — makes generic-proxy
// writes to shared memory (cp.async, st.shared) visible to the async proxy (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// PTX ISA 9.7.13.x: bar.sync id, nthreads — a named barrier over a subset of warps.
__device__ __forceinline__ void named_barrier_sync(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

__device__ __forceinline__ float exp2f_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flashmsa::cuda::ptx
