#include "cli_report.hpp"

#include <cmath>
#include <cstdio>

#include "cli_util.hpp"
#include "patterns.hpp"

namespace flashmsa::cli {

namespace {

void row(const char* key, const std::string& value) { std::printf("  %-34s %s\n", key, value.c_str()); }

std::string lengths_text(const Config& c) {
  const int B = c.nseq();
  if (c.batched) return fmt("batched [B=%d, S=%lld] (total %lld tokens)", B, (long long)c.max_seqlen, (long long)c.total);
  if (B == 1) return fmt("1 sequence of %lld tokens", (long long)c.total);
  std::string s;
  for (int b = 0; b < B && b < 12; ++b)
    s += (b ? "," : "") + std::to_string(c.cu[size_t(b) + 1] - c.cu[size_t(b)]);
  if (B > 12) s += ",...";
  return fmt("%d sequences [%s] (total %lld, max %lld)", B, s.c_str(), (long long)c.total,
             (long long)c.max_seqlen);
}

}  // namespace

void print_config(const Config& c) {
  std::printf("flashmsa %s — MiniMax Sparse Attention, one %s step\n\n", flashmsa_version(),
              mode_name(c.mode));
  std::printf("configuration\n");
  const bool preset_exact = c.Hq == (c.preset == "m3" ? 64 : 16) && c.Hkv == (c.preset == "m3" ? 4 : 2) &&
                            c.Hp == 4 && c.Hpk == 1 && c.D == 128 && c.Dp == 128;
  row("heads", fmt("Hq=%d Hkv=%d Hp=%d Hpk=%d  (%s)", c.Hq, c.Hkv, c.Hp, c.Hpk,
                   preset_exact ? c.preset.c_str() : ("custom, from " + c.preset).c_str()));
  row("head dims", fmt("D=%d Dp=%d  (scale %.6g, proxy scale %.6g)", c.D, c.Dp, c.scale(), c.proxy_scale()));
  row("lengths", lengths_text(c));
  row("topk", c.sparse() ? fmt("%d blocks of %d tokens (local block included)", c.topk, kBlock)
                         : std::string("- (warmup: dense causal)"));
  row("dtype", flashmsa_dtype_name(c.dtype));
  row("mode", fmt("%s  (library: %s, %s numerics)", mode_name(c.mode),
                  c.sparse() ? "select, then fwd/bwd in GIVEN mode" : "DENSE",
                  c.mode == Mode::Infer ? "INFER" : "TRAIN"));
  row("pattern", pattern_name(c.pattern));
  row("backend", c.on_cuda ? "cuda" : fmt("cpu (fp64 reference backend), %d threads", num_threads()));
  row("seed", std::to_string(c.seed));
  if (c.has_bwd())
    row("backward inputs", fmt("dout ~ N(0,1), dkl = %g%s%s%s", c.kl_grad, c.dlse ? ", dlse ~ N(0,1)" : "",
                               c.deterministic ? ", deterministic" : "", c.precise_dpsum ? ", precise dpsum (out_lo)" : ""));
  if (!c.defaulted.empty()) {
    std::string d;
    for (const auto& s : c.defaulted) d += (d.empty() ? "" : ", ") + s;
    row("defaults picked", d + (c.on_cuda ? " (CUDA)" : " (CPU backend: small enough for seconds)"));
  }
  std::printf("\n");
  std::fflush(stdout);
}

void print_report(const Config& c, const Stats& s, const Timings& tm, const CheckResult& chk) {
  std::printf("selection\n");
  if (c.sparse()) {
    row("union factor (128-query tiles)", fmt("%.3f   (distinct blocks per tile / topk, mean over tiles, proxy heads)", s.union_factor));
    row("blocks per token", fmt("%.3f   (of topk %d)", s.blocks_per_token, c.topk));
  } else {
    row("union factor (128-query tiles)", "-   (warmup: no selection)");
  }
  row("keys per (token, proxy head)", fmt("%.1f   (%.1f%% of the dense causal pairs)", s.keys_per_token, 100.0 * s.density));
  row("attention-mass recall", fmt("%.4f   (%s%s)", s.recall, s.recall_rows.c_str(),
                                   s.recall_on_device ? "; fp64 on the GPU" : ""));
  row("kl", fmt("%.9g", s.kl));
  if (s.nonfinite_outputs)
    row("UNWRITTEN OUTPUTS (NaN)", s.nonfinite_names);
  std::printf("\n");

  std::printf("time\n");
  std::printf("  %-10s %12s %14s %16s\n", "stage", "ms", "eff. TFLOP/s", "counted GFLOP");
  const double fwd_flops = 4.0 * c.D * s.pairs.main_pairs;
  const double bwd_flops = 2.5 * fwd_flops;
  const double sel_flops = 2.0 * c.Dp * s.pairs.proxy_pairs;
  auto line = [&](const char* name, double ms, double flops) {
    if (std::isnan(ms)) {
      std::printf("  %-10s %12s %14s %16s\n", name, "-", "-", "-");
      return;
    }
    std::printf("  %-10s %12.3f %14.4f %16.3f\n", name, ms, ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0,
                flops / 1e9);
  };
  line("selection", tm.select_ms, sel_flops);
  line("forward", tm.fwd_ms, fwd_flops);
  line("backward", tm.bwd_ms, bwd_flops);
  double total_ms = 0, total_flops = 0;
  if (!std::isnan(tm.select_ms)) total_ms += tm.select_ms, total_flops += sel_flops;
  if (!std::isnan(tm.fwd_ms)) total_ms += tm.fwd_ms, total_flops += fwd_flops;
  if (!std::isnan(tm.bwd_ms)) total_ms += tm.bwd_ms, total_flops += bwd_flops;
  line("total", total_ms, total_flops);
  std::printf("  (effective TFLOP/s: fwd 4*D*pairs, bwd 2.5x fwd, selection 2*Dp*causal proxy pairs;%s)\n",
              c.on_cuda ? " wall clock after cudaDeviceSynchronize" : " CPU fp64 reference");
  std::printf("\n");

  if (chk.ran) {
    std::printf("check against the fp64 reference (%s)\n", chk.scope.c_str());
    std::printf("  %-10s %14s %14s   %s\n", "tensor", "rel-L2", "max abs", "");
    for (const Err& e : chk.errs) {
      const bool ok = e.rel() <= chk.threshold;
      std::printf("  %-10s %14.3e %14.3e   %s%s\n", e.name.c_str(), e.rel(), e.max_abs, ok ? "ok" : "FAIL",
                  e.mismatched_inf ? fmt(" (%lld inf/nan mismatches)", (long long)e.mismatched_inf).c_str() : "");
    }
    if (c.sparse())
      std::printf("  %-10s %14.6f %14s   %s  (fraction of equal slots over %lld; threshold %.2f)\n",
                  "indices", chk.index_agreement, "", chk.index_agreement >= kIndexAgreementMin ? "ok" : "FAIL",
                  (long long)chk.index_slots, kIndexAgreementMin);
    for (const DeviceCheck& d : chk.device)
      std::printf("  %-10s %s   %s\n", d.name.c_str(), d.detail.c_str(), d.ok ? "ok" : "FAIL");
    std::printf("  threshold rel-L2 <= %.0e (%s)  =>  %s\n", chk.threshold, flashmsa_dtype_name(c.dtype),
                chk.pass ? "PASS" : "FAIL");
    std::printf("\n");
  }
  if (!c.save_dir.empty()) std::printf("saved tensors and config.json to %s\n", c.save_dir.c_str());
  std::fflush(stdout);
}

}  // namespace flashmsa::cli
