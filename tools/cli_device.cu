// The main job's device work besides the library's step: inputs drawn on the GPU, recall and
// unwritten-entry counts on the device tensors (cli_device.hpp says what and why).
#include "cli_device.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "cli_cuda.hpp"
#include "cli_keys.hpp"
#include "patterns.hpp"

namespace flashmsa::cli::dev {

namespace {

// A device allocation released at scope exit.
struct Scratch {
  void* p = nullptr;
  explicit Scratch(size_t bytes) : p(alloc(bytes)) {}
  ~Scratch() { release(p); }
  Scratch(Scratch&& o) noexcept : p(o.p) { o.p = nullptr; }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

template <class T>
Scratch upload_vector(const std::vector<T>& v) {
  Scratch s(v.size() * sizeof(T));
  upload(s.p, v.data(), v.size() * sizeof(T));
  return s;
}

// ---- the generator ---------------------------------------------------------------------
// Value i of a stream is splitmix64's output for the counter key + (i + 1) * golden; its two
// 32-bit halves give two 24-bit uniforms in (0, 1) and one normal by Box-Muller.

__host__ __device__ inline uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t stream_key(uint64_t seed, uint64_t stream) {
  return mix64(mix64(seed + 0x9e3779b97f4a7c15ULL) ^ (stream * 0xd1b54a32d192ed03ULL));
}

__device__ inline float normal_at(uint64_t key, uint64_t i) {
  const uint64_t h = mix64(key + (i + 1) * 0x9e3779b97f4a7c15ULL);
  const float u1 = (float(uint32_t(h >> 40)) + 0.5f) * 0x1.0p-24f;
  const float u2 = (float(uint32_t(h >> 8) & 0xffffffu) + 0.5f) * 0x1.0p-24f;
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

template <class T> __device__ inline T from_float(float x);
template <> __device__ inline float from_float<float>(float x) { return x; }
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ inline __half from_float<__half>(float x) { return __float2half_rn(x); }

// out[i] = noise * N(0,1)_i + sum over j < npick of topics[picks[row * npick + j]][d], with
// row = i / D, d = i % D (the clustered pattern's rows; npick 0: plain normals).
template <class T>
__global__ void draw_kernel(T* out, int64_t n, uint64_t key, float noise, const float* topics,
                            const int32_t* picks, int npick, int D) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float v = noise * normal_at(key, uint64_t(i));
    if (npick) {
      const int64_t row = i / D;
      const int d = int(i - row * D);
      float s = 0.f;
      for (int j = 0; j < npick; ++j) s += topics[int64_t(picks[row * npick + j]) * D + d];
      v += s;
    }
    out[i] = from_float<T>(v);
  }
}

unsigned grid_for(int64_t n) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 132 * 16)));
}

// f(T()) for the element type T of dt (bf16, fp16, fp32); `what` names the use in the error.
template <class F>
void by_dtype(flashmsa_dtype_t dt, const char* what, F&& f) {
  switch (dt) {
    case FLASHMSA_DTYPE_BF16: f(__nv_bfloat16()); break;
    case FLASHMSA_DTYPE_FP16: f(__half()); break;
    case FLASHMSA_DTYPE_FP32: f(float()); break;
    default:
      throw flashmsa::Error(FLASHMSA_ERROR_NOT_SUPPORTED,
                            std::string("flashmsa run: no ") + what + " for " + flashmsa_dtype_name(dt));
  }
}

void draw(void* out, flashmsa_dtype_t dt, int64_t n, uint64_t key, float noise = 1.f,
          const float* topics = nullptr, const int32_t* picks = nullptr, int npick = 0, int D = 1) {
  if (n == 0) return;
  by_dtype(dt, "device generator", [&](auto zero) {
    using T = decltype(zero);
    draw_kernel<<<grid_for(n), 256>>>(static_cast<T*>(out), n, key, noise, topics, picks, npick, D);
  });
  ok(cudaGetLastError(), "drawing the inputs");
}

void alloc_and_draw(Buf& b, uint64_t seed, uint64_t stream) {
  if (!b.used) return;
  b.device = alloc(b.bytes());
  draw(b.device, b.dtype, b.numel(), stream_key(seed, stream));
}

// ---- reading the device tensors --------------------------------------------------------

template <class T> __device__ inline double to_double(T x);
template <> __device__ inline double to_double<float>(float x) { return x; }
template <> __device__ inline double to_double<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ inline double to_double<__half>(__half x) { return __half2float(x); }

// One CTA per (sampled row r, query head h), one warp per key at a time: the dense causal
// logits of the row in fp64 with a running max, the softmax mass of all keys and of the keys in
// the selected blocks (flags in shared memory) of the head's proxy group. rec = selected / all.
template <class T>
__global__ void recall_kernel(const T* q, const T* k, const int32_t* indices, const int64_t* tok,
                              const int64_t* seq_start, int Hq, int Hkv, int Hp, int topk, int D,
                              int64_t total, double scale, double* rec) {
  extern __shared__ unsigned char smem[];
  double* qrow = reinterpret_cast<double*>(smem);               // [D]
  double* part = qrow + D;                                       // [warps][3]
  unsigned char* chosen = reinterpret_cast<unsigned char*>(part + 3 * (blockDim.x / 32));
  const int r = blockIdx.x / Hq, h = blockIdx.x % Hq;
  const int kv = h / (Hq / Hkv), p = h / (Hq / Hp);
  const int64_t t = tok[r], s0 = seq_start[r];
  const int64_t nb = (t - s0) / 128 + 1;  // blocks up to t's own
  for (int64_t j = threadIdx.x; j < nb; j += blockDim.x) chosen[j] = 0;
  for (int d = threadIdx.x; d < D; d += blockDim.x) qrow[d] = to_double(q[(t * Hq + h) * D + d]);
  __syncthreads();
  for (int s = threadIdx.x; s < topk; s += blockDim.x) {
    const int32_t j = indices[(int64_t(p) * total + t) * topk + s];
    if (j >= 0 && j < nb) chosen[j] = 1;  // blocks after t's own hold no key <= t
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  double m = -INFINITY, all = 0, sel = 0;
  for (int64_t u = s0 + warp; u <= t; u += warps) {
    const T* krow = k + (u * Hkv + kv) * D;
    double dot = 0;
    for (int d = lane; d < D; d += 32) dot += qrow[d] * to_double(krow[d]);
    for (int o = 16; o; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const double x = scale * dot;
    if (x > m) {
      const double f = exp(m - x);
      all *= f;
      sel *= f;
      m = x;
    }
    const double e = exp(x - m);
    all += e;
    if (chosen[(u - s0) / 128]) sel += e;
  }
  if (lane == 0) {
    part[3 * warp] = m;
    part[3 * warp + 1] = all;
    part[3 * warp + 2] = sel;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double M = -INFINITY;
    for (int w = 0; w < warps; ++w) M = fmax(M, part[3 * w]);
    double A = 0, S = 0;
    for (int w = 0; w < warps; ++w) {
      if (part[3 * w] == -INFINITY) continue;
      const double f = exp(part[3 * w] - M);
      A += part[3 * w + 1] * f;
      S += part[3 * w + 2] * f;
    }
    rec[blockIdx.x] = S / A;
  }
}

template <class T>
__global__ void unwritten_kernel(const T* x, int64_t n, unsigned long long* count) {
  unsigned long long c = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, int32_t>) c += x[i] < -1;
    else c += isnan(float(to_double(x[i])));
  }
  for (int o = 16; o; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if (threadIdx.x % 32 == 0 && c) atomicAdd(count, c);
}

template <class T>
__global__ void moments_kernel(const T* x, int64_t n, double* acc) {
  double s = 0, s2 = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double v = to_double(x[i]);
    s += v;
    s2 += v * v;
  }
  for (int o = 16; o; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    s2 += __shfl_xor_sync(0xffffffffu, s2, o);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(acc, s);
    atomicAdd(acc + 1, s2);
  }
}

}  // namespace

void draw_inputs(const Config& c, Tensors& t) {
  const int64_t T = c.total;
  alloc_and_draw(t.q, c.seed, kStreamQ);
  alloc_and_draw(t.k, c.seed, kStreamK);
  alloc_and_draw(t.v, c.seed, kStreamV);
  alloc_and_draw(t.dout, c.seed, kStreamDout);
  alloc_and_draw(t.dlse, c.seed, kStreamDlse);
  t.qp.device = alloc(t.qp.bytes());
  t.kp.device = alloc(t.kp.bytes());
  const uint64_t proxy = stream_key(c.seed, kStreamProxy);
  if (c.pattern == Pattern::Random) {
    draw(t.qp.device, t.qp.dtype, t.qp.numel(), proxy);
    draw(t.kp.device, t.kp.dtype, t.kp.numel(), mix64(proxy + 1));
  } else {
    // The topic choices on the host (small tables, one entry per token and head), the vectors
    // on the device: topics ~ N(0, I); kp = topic of the key's 512-span + 0.5 N(0, I); qp = the
    // sum of the 3 topics of the query's 128-span + 0.5 N(0, I) (patterns.hpp).
    Scratch topics(sizeof(float) * kTopics * c.Dp);
    draw(topics.p, FLASHMSA_DTYPE_FP32, int64_t(kTopics) * c.Dp, mix64(proxy + 2));
    std::vector<int32_t> kpick(size_t(T) * c.Hpk), qpick(size_t(T) * c.Hp * kTopicsPerQuery);
    Rng rng(c.seed, kStreamProxy);
    for (int b = 0; b < c.nseq(); ++b) {
      const int64_t s0 = c.cu[size_t(b)], len = c.cu[size_t(b) + 1] - s0;
      for (int h = 0; h < c.Hpk; ++h)
        for (int64_t span = 0; span * kKeySpan < len; ++span) {
          const int32_t topic = int32_t(rng.below(kTopics));
          for (int64_t u = span * kKeySpan; u < std::min(len, (span + 1) * kKeySpan); ++u)
            kpick[size_t((s0 + u) * c.Hpk + h)] = topic;
        }
      for (int p = 0; p < c.Hp; ++p)
        for (int64_t span = 0; span * kQuerySpan < len; ++span) {
          const std::vector<int64_t> picks = sample_distinct(rng, kTopics, kTopicsPerQuery);
          for (int64_t i = span * kQuerySpan; i < std::min(len, (span + 1) * kQuerySpan); ++i)
            for (int j = 0; j < kTopicsPerQuery; ++j)
              qpick[size_t(((s0 + i) * c.Hp + p) * kTopicsPerQuery + j)] = int32_t(picks[size_t(j)]);
        }
    }
    const Scratch kp_d = upload_vector(kpick), qp_d = upload_vector(qpick);
    draw(t.kp.device, t.kp.dtype, t.kp.numel(), mix64(proxy + 3), float(kTopicNoise), topics.as<float>(),
         kp_d.as<int32_t>(), 1, c.Dp);
    draw(t.qp.device, t.qp.dtype, t.qp.numel(), mix64(proxy + 4), float(kTopicNoise), topics.as<float>(),
         qp_d.as<int32_t>(), kTopicsPerQuery, c.Dp);
    sync();  // before the tables are freed
  }
  sync();
}

double mass_recall(const Config& c, const Tensors& t, const std::vector<int64_t>& rows) {
  const int64_t n = int64_t(rows.size()) * c.Hq;
  if (n == 0) return 1.0;
  std::vector<int64_t> starts(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) starts[r] = c.cu[size_t(seq_of(c, rows[r]))];
  const Scratch tok = upload_vector(rows), st = upload_vector(starts);
  Scratch rec(sizeof(double) * size_t(n));
  const int threads = 256;
  const size_t smem = sizeof(double) * (size_t(c.D) + 3 * (threads / 32)) + size_t(c.max_seqlen / 128 + 1);
  by_dtype(t.q.dtype, "device statistics", [&](auto zero) {
    using T = decltype(zero);
    auto kern = recall_kernel<T>;
    ok(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)), "recall (shared memory)");
    kern<<<unsigned(n), threads, smem>>>(static_cast<const T*>(t.q.device), static_cast<const T*>(t.k.device),
                                         static_cast<const int32_t*>(t.indices.device), tok.as<int64_t>(),
                                         st.as<int64_t>(), c.Hq, c.Hkv, c.Hp, c.topk, c.D, c.total,
                                         c.scale(), rec.as<double>());
  });
  ok(cudaGetLastError(), "recall");
  std::vector<double> h(static_cast<size_t>(n));
  download(h.data(), rec.p, h.size() * sizeof(double));
  double s = 0;
  for (double x : h) s += x;  // row order, as the host's
  return s / double(n);
}

int64_t count_unwritten(const Buf& b) {
  if (!b.used || b.numel() == 0) return 0;
  Scratch cnt(sizeof(unsigned long long));
  ok(cudaMemset(cnt.p, 0, sizeof(unsigned long long)), "cudaMemset");
  const int64_t n = b.numel();
  if (b.dtype == FLASHMSA_DTYPE_INT32) {
    unwritten_kernel<<<grid_for(n), 256>>>(static_cast<const int32_t*>(b.device), n, cnt.as<unsigned long long>());
  } else {
    by_dtype(b.dtype, "device statistics", [&](auto zero) {
      using T = decltype(zero);
      unwritten_kernel<<<grid_for(n), 256>>>(static_cast<const T*>(b.device), n, cnt.as<unsigned long long>());
    });
  }
  ok(cudaGetLastError(), "counting unwritten entries");
  unsigned long long h = 0;
  download(&h, cnt.p, sizeof h);
  return int64_t(h);
}

void moments(const Buf& b, double* mean, double* var) {
  const int64_t n = b.numel();
  Scratch acc(2 * sizeof(double));
  ok(cudaMemset(acc.p, 0, 2 * sizeof(double)), "cudaMemset");
  by_dtype(b.dtype, "device statistics", [&](auto zero) {
    using T = decltype(zero);
    moments_kernel<<<grid_for(n), 256>>>(static_cast<const T*>(b.device), n, acc.as<double>());
  });
  ok(cudaGetLastError(), "input moments");
  double h[2] = {0, 0};
  download(h, acc.p, sizeof h);
  *mean = n ? h[0] / double(n) : NAN;
  *var = n ? h[1] / double(n) - *mean * *mean : NAN;
}

}  // namespace flashmsa::cli::dev
