// The wgmma throughput probe of docs/kernels/fwd.md ("Models for issue 59"): chains of bf16 64xNx128 warpgroup
// GEMMs (eight m64nNk16 wgmma each) on operands that stay in shared memory (SS) or with A in registers (RS), for
// N = 16 .. 256 and 1 or 2 warpgroups per SM, one CTA per SM. It prints the MACs per clock per SM (clock64 on each
// SM) and the TF/s of the whole GPU (CUDA events): the shared-memory operand-read cap that the swap-AB model
// assumes (~820 MACs a clock at N = 16 if operands are read at 128 B a clock) is the SS N = 16 row.
// Built with the benchmarks (CMake target flashmsa_wgmma_probe); on the GPU machine: STEPS=wgmma bash scripts/gpu_all.sh.
// (RS stops at N = 128: at N = 256 the register A operand and the accumulators leave ptxas too few registers and it
// serialises the wgmma.)
#include <cuda_runtime.h>

#include <cstdio>
#include <type_traits>

#include "cuda/common/utils.cuh"
#include "cuda/ptx/cp_async.cuh"

namespace {

using namespace flashmsa::cuda;
using E = cutlass::bfloat16_t;
constexpr int kIters = 2048;

template <int N, bool kRs, int kWgs>
__global__ void __launch_bounds__(kWgs * 128, 1) probe(float* sink, long long* clocks) {
  using namespace cute;
  using LA = SwizzledTile<E, 64, 128>;
  using LB = SwizzledTile<E, N, 128>;
  extern __shared__ char raw[];
  E* base = reinterpret_cast<E*>((reinterpret_cast<uintptr_t>(raw) + 1023) / 1024 * 1024);
  const int tid = threadIdx.x, wg = tid / 128;
  constexpr int kA = cosize_v<LA>, kB = cosize_v<LB>;
  for (int i = tid; i < kWgs * kA + kB; i += blockDim.x) base[i] = E(0.001f * float(i % 7));
  flashmsa::cuda::ptx::fence_proxy_async_smem();
  __syncthreads();
  using Mma = std::conditional_t<kRs, RsMma<E, 64, N, 128, GMMA::Major::K, GMMA::Major::K>, SsMma<E, 64, N, 128>>;
  Mma mma;
  auto thr = mma.get_thread_slice(tid % 128);
  Tensor sA = make_tensor(make_smem_ptr(base + wg * kA), LA{});
  Tensor sB = make_tensor(make_smem_ptr(base + kWgs * kA), LB{});
  Tensor tA = thr.partition_fragment_A(sA);
  if constexpr (kRs)
    for (int i = 0; i < size(tA); ++i) tA(i) = E(0.001f * float(i % 5));
  Tensor tB = thr.partition_fragment_B(sB);
  Tensor acc = partition_fragment_C(mma, Shape<_64, Int<N>>{});
  clear(acc);
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < kIters; ++it) {
    wg_gemm_issue<false>(mma, tA, tB, acc);
    warpgroup_wait<1>();
  }
  warpgroup_wait<0>();
  wg_gemm_done(mma, tA, acc);
  const long long t1 = clock64();
  float s = 0.f;
  for (int i = 0; i < size(acc); ++i) s += acc(i);
  sink[blockIdx.x * blockDim.x + tid] = s;
  if (tid == 0) clocks[blockIdx.x] = t1 - t0;
}

template <int N, bool kRs, int kWgs>
void run(int sms, float* sink, long long* clocks, long long* host) {
  auto k = probe<N, kRs, kWgs>;
  const int smem = (kWgs * 64 * 128 + N * 128) * 2 + 1024;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  k<<<sms, kWgs * 128, smem>>>(sink, clocks);  // warm-up
  cudaEventRecord(a);
  k<<<sms, kWgs * 128, smem>>>(sink, clocks);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaMemcpy(host, clocks, sizeof(long long) * sms, cudaMemcpyDeviceToHost);
  long long worst = 0;
  for (int i = 0; i < sms; ++i) worst = host[i] > worst ? host[i] : worst;
  const double macs_sm = double(kWgs) * kIters * 64.0 * N * 128;
  std::printf("%s N=%3d warpgroups=%d  MACs/clock/SM %7.1f  (%5.1f%% of 2048)  %6.1f TF/s  err=%s\n",
              kRs ? "RS" : "SS", N, kWgs, macs_sm / double(worst), 100.0 * macs_sm / double(worst) / 2048.0,
              2.0 * macs_sm * sms / (ms * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
}

template <bool kRs, int kWgs>
void sweep(int sms, float* sink, long long* clocks, long long* host) {
  run<16, kRs, kWgs>(sms, sink, clocks, host);
  run<32, kRs, kWgs>(sms, sink, clocks, host);
  run<64, kRs, kWgs>(sms, sink, clocks, host);
  run<128, kRs, kWgs>(sms, sink, clocks, host);
  if constexpr (!kRs) run<256, kRs, kWgs>(sms, sink, clocks, host);
}

}  // namespace

int main() {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
    std::printf("no CUDA device\n");
    return 2;
  }
  float* sink = nullptr;
  long long* clocks = nullptr;
  cudaMalloc(&sink, sizeof(float) * sms * 256);
  cudaMalloc(&clocks, sizeof(long long) * sms);
  static long long host[1024];
  sweep<false, 1>(sms, sink, clocks, host);
  sweep<false, 2>(sms, sink, clocks, host);
  sweep<true, 1>(sms, sink, clocks, host);
  sweep<true, 2>(sms, sink, clocks, host);
  return 0;
}
