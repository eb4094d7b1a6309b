// The host side of the metadata guard (common/guard.cuh says what it is for): the check launched
// first in every varlen call, the poison list, the poison launched last; reading the status
// words; and the opt-in `validate`'s host copies of cu_seqlens and index rows.
#include "cuda/dispatch.h"

namespace flashmsa::cuda {

Guard start_guard(const flashmsa_tensor_t& cu, const flashmsa_tensor_t& status, const Geometry& g, int32_t op,
                  void* ws, cudaStream_t st, const flashmsa_tensor_t* cuq, const flashmsa_tensor_t* origin) {
  Guard r;
  r.cu = cu;
  if (g.batched) return r;
  guard::CheckArgs c;
  c.cu = static_cast<const int32_t*>(cu.data);
  c.cu_stride = cu.strides[0];
  c.batch = g.batch;
  c.total = g.total_k;
  c.max_seqlen = g.max_seqlen;
  c.status = present(status) ? static_cast<int32_t*>(status.data) : nullptr;
  c.op = op;
  if (g.segmented) {
    c.cuq = static_cast<const int32_t*>(cuq->data);
    c.cuq_stride = cuq->strides[0];
    c.origin = static_cast<const int32_t*>(origin->data);
    c.origin_stride0 = origin->strides[0];
    c.origin_stride1 = origin->strides[1];
    c.segments = g.segments;
    c.total_q = g.total;
    c.max_seqlen_q = g.max_seqlen_q;
  }
  const guard::Safe safe = guard::launch_check(c, ws, st);
  r.cu.data = const_cast<int32_t*>(safe.cu);
  r.cu.strides[0] = 1;
  r.cuq = safe.cuq;
  r.origin = safe.origin;
  r.outs.fault = guard::fault_word(ws);
  r.on = true;
  return r;
}

void poison(Guard& r, const flashmsa_tensor_t& t) {
  if (!r.on || !present(t) || t.data == nullptr || t.ndim > 3) return;
  guard::Out o;
  o.ptr = t.data;
  if (t.ndim >= 1) o.n0 = t.shape[0], o.s0 = t.strides[0];
  if (t.ndim >= 2) o.n1 = t.shape[1], o.s1 = t.strides[1];
  if (t.ndim == 3) o.n2 = t.shape[2];
  switch (t.dtype) {
    case FLASHMSA_DTYPE_BF16: o.bytes = 2; o.pattern = guard::kNanBf16; break;
    case FLASHMSA_DTYPE_FP16: o.bytes = 2; o.pattern = guard::kNanFp16; break;
    case FLASHMSA_DTYPE_INT32: o.bytes = 4; o.pattern = guard::kPoisonIndex; break;
    default: o.bytes = 4; o.pattern = guard::kNanFp32; break;
  }
  r.outs.add(o);
}

void finish_guard(const Guard& r, cudaStream_t st) {
  if (r.on) guard::launch_poison(r.outs, st);
}

void read_status(const flashmsa_tensor_t& s, void* stream, int32_t flags, int32_t* w) {
  auto st = static_cast<cudaStream_t>(stream);
  const size_t bytes = sizeof(int32_t) * FLASHMSA_STATUS_WORDS;
  FLASHMSA_CUDA_CHECK(cudaMemcpyAsync(w, s.data, bytes, cudaMemcpyDeviceToHost, st));
  if (flags & FLASHMSA_CHECK_RESET) FLASHMSA_CUDA_CHECK(cudaMemsetAsync(s.data, 0, bytes, st));
  synchronize(stream);
}

void synchronize(void* stream) { FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream))); }

// Opt-in data validation: copy cu_seqlens (and indices) to the host and check them.
std::vector<int64_t> validate_offsets(const flashmsa_tensor_t& cu, const Geometry& g, cudaStream_t st,
                                      const char* fn) {
  std::vector<int32_t> host;
  if (!g.batched) {
    host.resize(size_t(g.batch) + 1);
    for (int b = 0; b <= g.batch; ++b)
      FLASHMSA_CUDA_CHECK(cudaMemcpyAsync(&host[size_t(b)], static_cast<const int32_t*>(cu.data) + b * cu.strides[0],
                                          4, cudaMemcpyDeviceToHost, st));
    FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(st));
  }
  return checked_offsets(host.data(), 1, g, fn);
}

Segments validate_segments(const flashmsa_tensor_t& cuq, const flashmsa_tensor_t& origin, const std::vector<int64_t>& cu,
                           const Geometry& g, cudaStream_t st, const char* fn) {
  if (!g.segmented) return {};
  std::vector<int32_t> q(size_t(g.segments) + 1), o(size_t(g.segments) * 2);
  for (int s = 0; s <= g.segments; ++s)
    FLASHMSA_CUDA_CHECK(cudaMemcpyAsync(&q[size_t(s)], static_cast<const int32_t*>(cuq.data) + s * cuq.strides[0], 4,
                                        cudaMemcpyDeviceToHost, st));
  for (int s = 0; s < g.segments; ++s)
    for (int c = 0; c < 2; ++c)
      FLASHMSA_CUDA_CHECK(cudaMemcpyAsync(&o[size_t(2 * s + c)],
                                          static_cast<const int32_t*>(origin.data) + s * origin.strides[0] +
                                              c * origin.strides[1],
                                          4, cudaMemcpyDeviceToHost, st));
  FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(st));
  return checked_segments(q.data(), 1, o.data(), 2, 1, cu, g, fn);
}

void validate_indices(const flashmsa_tensor_t& t, const std::vector<int64_t>& cu, const Geometry& g,
                      cudaStream_t st, const char* fn, const Segments* segments) {
  std::vector<int32_t> host(size_t(g.Hp) * g.total * g.topk);
  for (int h = 0; h < g.Hp; ++h)
    FLASHMSA_CUDA_CHECK(cudaMemcpy2DAsync(host.data() + size_t(h) * g.total * g.topk, size_t(g.topk) * 4,
                                          static_cast<const int32_t*>(t.data) + h * t.strides[0],
                                          size_t(t.strides[1]) * 4, size_t(g.topk) * 4, size_t(g.total),
                                          cudaMemcpyDeviceToHost, st));
  FLASHMSA_CUDA_CHECK(cudaStreamSynchronize(st));
  check_index_rows(host, cu, g.Hp, g.total, g.topk, true, fn, segments);
}

}  // namespace flashmsa::cuda
