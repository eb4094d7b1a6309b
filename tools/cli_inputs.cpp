#include "cli_inputs.hpp"

#include "cli_device.hpp"
#include "patterns.hpp"

namespace flashmsa::cli {

void generate(const Config& c, Tensors& t) {
  const size_t T = size_t(c.total);
  t.cu.allocate_host();
  for (size_t i = 0; i < c.cu.size(); ++i) t.cu.i32()[i] = int32_t(c.cu[i]);
  if (c.has_bwd()) t.dkl.assign({c.kl_grad});
  if (c.on_cuda) {
    dev::draw_inputs(c, t);
    if (c.host_copies())
      for (Buf* b : t.all())
        if (b->used && b->device) {
          b->allocate_host();
          dev::download(b->host.data(), b->device, b->bytes());
        }
    return;
  }
  t.q.assign(normal_values(c.seed, kStreamQ, T * c.Hq * c.D));
  t.k.assign(normal_values(c.seed, kStreamK, T * c.Hkv * c.D));
  t.v.assign(normal_values(c.seed, kStreamV, T * c.Hkv * c.D));
  const ProxyInputs px = draw_proxy(c.pattern, c.cu, c.Hp, c.Hpk, c.Dp, c.seed);
  t.qp.assign(px.qp);
  t.kp.assign(px.kp);
  if (c.has_bwd()) {
    t.dout.assign(normal_values(c.seed, kStreamDout, T * c.Hq * c.D));
    if (c.dlse) {
      Rng r2(c.seed, kStreamDlse);
      t.dlse.assign(normal_values(r2, size_t(c.Hq) * T));
    }
  }
  for (Buf* b : t.all())
    if (b->used && b->output) {
      b->allocate_host();
      b->poison_host();
    }
}

}  // namespace flashmsa::cli
