#include "cli_step.hpp"

#include <string>
#include <vector>

#ifdef FLASHMSA_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "cli_util.hpp"
#include "flashmsa/flashmsa.hpp"

namespace flashmsa::cli {

StageArgs make_args(const Config& c, Tensors& t, const Views& V) {
  StageArgs a;
  flashmsa_select_args_init(&a.sel);
  flashmsa_fwd_args_init(&a.fwd);
  flashmsa_bwd_args_init(&a.bwd);
  const flashmsa_tensor_t cu = c.batched ? flashmsa::none() : V(t.cu);
  const int64_t max_seqlen = c.max_seqlen;

  a.sel.qp = V(t.qp);
  a.sel.kp = V(t.kp);
  a.sel.cu_seqlens = cu;
  a.sel.max_seqlen = max_seqlen;
  a.sel.topk = c.topk;
  a.sel.indices = V(t.indices);

  // The forward consumes the selection stage's indices (GIVEN); warmup is DENSE.
  const flashmsa_mode_t lib_mode = c.sparse() ? FLASHMSA_MODE_GIVEN : FLASHMSA_MODE_DENSE;
  auto inputs = [&](auto& x) {  // what the forward and the backward read alike
    x.q = V(t.q);
    x.k = V(t.k);
    x.v = V(t.v);
    x.qp = V(t.qp);
    x.kp = V(t.kp);
    x.cu_seqlens = cu;
    x.max_seqlen = max_seqlen;
    x.mode = lib_mode;
  };
  inputs(a.fwd);
  a.fwd.numerics = c.mode == Mode::Infer ? FLASHMSA_NUMERICS_INFER : FLASHMSA_NUMERICS_TRAIN;
  a.fwd.topk = c.sparse() ? c.topk : 0;
  // kl as a training loop gets it: from the backward's proxy side (no extra pass); the forward
  // computes it only when no backward follows (inference)
  a.fwd.compute_kl = c.has_bwd() ? 0 : 1;
  a.fwd.indices = V(t.indices);
  a.fwd.out = V(t.out);
  a.fwd.lse = V(t.lse);
  a.fwd.proxy_lse = V(t.proxy_lse);
  if (!c.has_bwd()) a.fwd.kl = V(t.kl);
  a.fwd.out_lo = V(t.out_lo);

  inputs(a.bwd);
  a.bwd.indices = V(t.indices);
  a.bwd.out = V(t.out);
  a.bwd.out_lo = V(t.out_lo);
  a.bwd.deterministic = c.deterministic ? 1 : 0;
  a.bwd.lse = V(t.lse);
  a.bwd.proxy_lse = V(t.proxy_lse);
  a.bwd.dout = V(t.dout);
  a.bwd.dlse = V(t.dlse);
  a.bwd.dkl = V(t.dkl);
  a.bwd.dq = V(t.dq);
  a.bwd.dk = V(t.dk);
  a.bwd.dv = V(t.dv);
  a.bwd.dqp = V(t.dqp);
  a.bwd.dkp = V(t.dkp);
  if (c.has_bwd()) a.bwd.kl = V(t.kl);
  return a;
}

namespace {

// Asks the CUDA backend (metadata only: workspace queries) whether it can run this step.
// Returns "" when it can, else the library's message.
std::string probe_cuda(const Config& c) {
  Tensors t;
  declare(c, t);
  void* mem = nullptr;
#ifdef FLASHMSA_WITH_CUDA
  if (flashmsa_cuda_available() && cudaMalloc(&mem, 256) != cudaSuccess) {
    cudaGetLastError();
    mem = nullptr;
  }
#endif
  static unsigned char dummy[256];  // never dereferenced: the queries read metadata only
  Views V{c, true, mem ? mem : dummy};
  StageArgs a = make_args(c, t, V);
  size_t n = 0;
  flashmsa_status_t s = FLASHMSA_SUCCESS;
  if (c.sparse()) s = flashmsa_select_workspace_size(&a.sel, &n);
  if (s == FLASHMSA_SUCCESS) s = flashmsa_fwd_workspace_size(&a.fwd, &n);
  if (s == FLASHMSA_SUCCESS && c.has_bwd()) s = flashmsa_bwd_workspace_size(&a.bwd, &n);
  std::string msg = s == FLASHMSA_SUCCESS ? "" : flashmsa_last_error();
  if (s != FLASHMSA_SUCCESS && msg.empty()) msg = flashmsa_status_string(s);
  dev::release(mem);
  return msg;
}

// Runs one library call: workspace query and allocation, synchronised wall-clock timing.
template <class Args, class Query, class Call>
double run_stage(const char* tag, const std::string& what, bool on_cuda, const Args& a, Query query,
                 Call call) {
  progress("[%s] %s ...\n", tag, what.c_str());
  size_t ws_bytes = 0;
  flashmsa::check(query(&a, &ws_bytes));
  std::vector<unsigned char> host_ws;
  void* ws = nullptr;
  if (ws_bytes > 0) {
    if (on_cuda) {
      ws = dev::alloc(ws_bytes);
    } else {
      host_ws.resize(ws_bytes);
      ws = host_ws.data();
    }
  }
  if (on_cuda) dev::sync();
  const double t0 = now_s();
  flashmsa_status_t s = call(&a, ws, ws_bytes);
  if (on_cuda && s == FLASHMSA_SUCCESS) dev::sync();
  const double dt = now_s() - t0;
  if (on_cuda) dev::release(ws);
  flashmsa::check(s);
  progress("[%s] done in %.3f s\n", tag, dt);
  return dt * 1e3;
}

}  // namespace

void resolve_backend(Config& c) {
  const bool fp_host_only = c.dtype == FLASHMSA_DTYPE_FP32 || c.dtype == FLASHMSA_DTYPE_FP64;
  if (c.backend == Backend::Cpu) {
    c.on_cuda = false;
    resolve_sizes(c);
    return;
  }
  if (c.backend == Backend::Cuda) {
    c.on_cuda = true;
    resolve_sizes(c);
    const std::string msg = probe_cuda(c);
    if (!msg.empty()) throw flashmsa::Error(FLASHMSA_ERROR_NOT_SUPPORTED, msg);
    if (!dev::kRuntime)
      throw flashmsa::Error(FLASHMSA_ERROR_NOT_SUPPORTED,
                            "flashmsa run: this executable was built without the CUDA runtime");
    return;
  }
  // auto
  if (flashmsa_cuda_available() && dev::kRuntime && !fp_host_only) {
    c.on_cuda = true;
    resolve_sizes(c);
    const std::string msg = probe_cuda(c);
    if (msg.empty()) return;
    c.fallback_notice = "note: CUDA device found but the CUDA backend cannot run this step (" +
                        msg + "); falling back to the CPU backend";
  }
  c.on_cuda = false;
  resolve_sizes(c);
}

Timings run_step(const Config& c, Tensors& t) {
  if (c.on_cuda) {
    progress("[cuda] copying inputs to the device ...\n");
    for (Buf* b : t.all())
      if (b->used && !b->device) {  // the inputs drawn on the device are there already
        b->device = dev::alloc(b->bytes());
        if (b->output) dev::poison(b->device, b->bytes());
        else dev::upload(b->device, b->host.data(), b->bytes());
      }
  }
  Views V{c, c.on_cuda, nullptr};
  const StageArgs a = make_args(c, t, V);
  Timings tm;
  const std::string where = std::string(c.on_cuda ? "cuda" : "cpu") + ", " +
                            std::to_string(c.total) + " tokens";
  try {
    if (c.sparse())
      tm.select_ms = run_stage("select", "selection, topk " + std::to_string(c.topk) + " (" + where + ")",
                               c.on_cuda, a.sel, flashmsa_select_workspace_size, flashmsa_select);
    tm.fwd_ms = run_stage("forward", std::string(c.sparse() ? "sparse" : "dense causal") +
                                         (c.has_bwd() ? " forward (" : " forward + kl (") + where + ")",
                          c.on_cuda, a.fwd, flashmsa_fwd_workspace_size, flashmsa_fwd);
    if (c.has_bwd())
      tm.bwd_ms = run_stage("backward", "backward + kl, dkl " + fmt("%g", c.kl_grad) + " (" + where + ")",
                            c.on_cuda, a.bwd, flashmsa_bwd_workspace_size, flashmsa_bwd);
  } catch (...) {
    release_device(t);
    throw;
  }
  if (c.on_cuda)
    for (Buf* b : t.all())
      if (b->used && b->output && (c.host_copies() || b == &t.indices || b == &t.kl)) {
        b->allocate_host();
        dev::download(b->host.data(), b->device, b->bytes());
      }
  return tm;
}

}  // namespace flashmsa::cli
