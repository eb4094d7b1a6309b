#include "cli_buffers.hpp"

#include <cmath>
#include <fstream>

#include <unistd.h>

#ifdef FLASHMSA_WITH_CUDA
#include "cli_cuda.hpp"
#endif

#include "cli_check.hpp"
#include "cli_device.hpp"
#include "cli_util.hpp"
#include "flashmsa/flashmsa.hpp"

namespace flashmsa::cli {

// ---- device memory -----------------------------------------------------------------------

namespace dev {
#ifdef FLASHMSA_WITH_CUDA
void* alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  ok(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
}
void release(void* p) {
  if (p) cudaFree(p);
}
void upload(void* d, const void* h, size_t bytes) {
  if (bytes) ok(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}
void download(void* h, const void* d, size_t bytes) {
  if (bytes) ok(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}
void poison(void* d, size_t bytes) {
  if (bytes) ok(cudaMemset(d, 0xff, bytes), "cudaMemset");
}
void sync() { ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
#else
namespace {
[[noreturn]] void none() {
  throw flashmsa::Error(FLASHMSA_ERROR_NOT_SUPPORTED,
                        "flashmsa run: this executable was built without the CUDA runtime");
}
}  // namespace
void* alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  none();
}
void release(void*) {}
void upload(void*, const void*, size_t bytes) {
  if (bytes) none();
}
void download(void*, const void*, size_t bytes) {
  if (bytes) none();
}
void poison(void*, size_t bytes) {
  if (bytes) none();
}
void sync() {}
void draw_inputs(const Config&, Tensors&) { none(); }
double mass_recall(const Config&, const Tensors&, const std::vector<int64_t>&) { none(); }
int64_t count_unwritten(const Buf&) { none(); }
void moments(const Buf&, double*, double*) { none(); }
#endif
}  // namespace dev

// ---- tensors -----------------------------------------------------------------------------

void declare(const Config& c, Tensors& t) {
  const flashmsa_dtype_t dt = c.dtype;
  const flashmsa_dtype_t st = dt == FLASHMSA_DTYPE_FP64 ? FLASHMSA_DTYPE_FP64 : FLASHMSA_DTYPE_FP32;
  const int64_t T = c.total;
  t.q.declare("q", dt, {T, c.Hq, c.D}, Buf::kTokens, false);
  t.k.declare("k", dt, {T, c.Hkv, c.D}, Buf::kTokens, false);
  t.v.declare("v", dt, {T, c.Hkv, c.D}, Buf::kTokens, false);
  t.qp.declare("qp", dt, {T, c.Hp, c.Dp}, Buf::kTokens, false);
  t.kp.declare("kp", dt, {T, c.Hpk, c.Dp}, Buf::kTokens, false);
  t.cu.declare("cu_seqlens", FLASHMSA_DTYPE_INT32, {int64_t(c.cu.size())}, Buf::kOther, false);
  t.out.declare("out", dt, {T, c.Hq, c.D}, Buf::kTokens, true);
  t.lse.declare("lse", st, {c.Hq, T}, Buf::kOther, true);
  if (c.sparse()) t.indices.declare("indices", FLASHMSA_DTYPE_INT32, {c.Hp, T, c.topk}, Buf::kOther, true);
  t.proxy_lse.declare("proxy_lse", st, {c.Hp, T}, Buf::kOther, true);
  t.kl.declare("kl", st, {}, Buf::kOther, true);
  if (c.has_bwd() && c.precise_dpsum) t.out_lo.declare("out_lo", dt, {T, c.Hq, c.D}, Buf::kTokens, true);
  if (c.has_bwd()) {
    t.dout.declare("dout", dt, {T, c.Hq, c.D}, Buf::kTokens, false);
    if (c.dlse) t.dlse.declare("dlse", st, {c.Hq, T}, Buf::kOther, false);
    t.dkl.declare("dkl", st, {}, Buf::kOther, false);
    t.dq.declare("dq", dt, {T, c.Hq, c.D}, Buf::kTokens, true);
    t.dk.declare("dk", dt, {T, c.Hkv, c.D}, Buf::kTokens, true);
    t.dv.declare("dv", dt, {T, c.Hkv, c.D}, Buf::kTokens, true);
    t.dqp.declare("dqp", dt, {T, c.Hp, c.Dp}, Buf::kTokens, true);
    t.dkp.declare("dkp", dt, {T, c.Hpk, c.Dp}, Buf::kTokens, true);
  }
}

void release_device(Tensors& t) {
  for (Buf* b : t.all()) {
    dev::release(b->device);
    b->device = nullptr;
  }
}

flashmsa_tensor_t Views::operator()(const Buf& b) const {
  if (!b.used) return flashmsa::none();
  flashmsa_tensor_t t{};
  t.data = probe ? probe : device ? b.device : const_cast<unsigned char*>(b.host.data());
  if (b.numel() == 0 && !probe) t.data = nullptr;
  t.dtype = b.dtype;
  t.device_type = device ? FLASHMSA_DEVICE_CUDA : FLASHMSA_DEVICE_CPU;
  t.device_id = 0;
  std::vector<int64_t> shape = b.shape;
  if (b.kind == Buf::kTokens && c.batched)
    shape = {int64_t(c.nseq()), c.max_seqlen, b.shape[1], b.shape[2]};
  t.ndim = int32_t(shape.size());
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[size_t(d)];
    t.strides[d] = stride;
    stride *= shape[size_t(d)];
  }
  return t;
}

// ---- host memory -------------------------------------------------------------------------

namespace {

// Host bytes the step needs, roughly: every buffer, the CPU backend's fp64 copies of the
// per-token tensors (gathered inputs and results), and --check's fp64 run on small problems.
double estimate_host_bytes(const Config& c) {
  Tensors t;
  declare(c, t);
  double bufs = 0, tok_elems = 0;
  for (const Buf* b : t.all())
    if (b->used) {
      bufs += double(b->numel()) * double(dtype_size(b->dtype));
      if (b->kind == Buf::kTokens) tok_elems += double(b->numel());
    }
  double need = c.host_copies() ? bufs : double(t.indices.bytes());
  if (!c.on_cuda) need += 16.0 * tok_elems;
  if (c.check && c.total <= kCheckFullMaxTokens) need += 16.0 * tok_elems;
  return need;
}

// The host memory this process may use: physical memory, a cgroup limit, RLIMIT_AS.
double host_memory_limit(std::string* what) {
  double lim = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  *what = "physical memory";
  if (!(lim > 0)) lim = INFINITY;
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    double v = 0;
    if (f >> v && v > 0 && v < lim) {
      lim = v;
      *what = std::string("the memory limit in ") + path;
    }
  }
  return lim;
}

}  // namespace

void check_host_memory(const Config& c) {
  std::string what;
  const double need = estimate_host_bytes(c), have = host_memory_limit(&what);
  if (need > have)
    throw UsageError(fmt("the step needs about %.1f GiB of host memory (its tensors%s), more than "
                         "the %.1f GiB available (%s): use a smaller --seqlen, --batch or --lengths, "
                         "or fewer heads",
                         need / (1 << 30), c.on_cuda ? "" : " and the CPU backend's fp64 copies",
                         have / (1 << 30), what.c_str()));
}

}  // namespace flashmsa::cli
