// flashmsa — the main job: one MSA training step (selection, forward, backward) on inputs drawn
// from a BENCHMARKS.md selection pattern, with selection statistics, attention-mass recall,
// timings, effective TFLOP/s, an optional check against the fp64 reference and an optional
// dump of every tensor as .npy files.
//
//   flashmsa run [flags]        (flashmsa run --help lists them)
//
// A client of the public API (flashmsa.h, flashmsa.hpp) only. The parts, one job each:
//   cli_args     configuration, flags, --help, checks of the command line
//   cli_buffers  host / device tensors, library views, host memory check
//   cli_inputs   seeded inputs (patterns.hpp: the selection patterns)
//   cli_step     argument structs, backend choice, the timed stages with their workspaces
//   cli_keys     key sets and pair counts;  cli_stats  selection statistics, recall
//   cli_check    --check against the fp64 reference;  cli_save  --save (.npy, config.json)
//   cli_report   the printed report;  cli_util, cli_dtype  small helpers
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cli_args.hpp"
#include "cli_buffers.hpp"
#include "cli_check.hpp"
#include "cli_inputs.hpp"
#include "cli_report.hpp"
#include "cli_save.hpp"
#include "cli_stats.hpp"
#include "cli_step.hpp"
#include "cli_util.hpp"
#include "flashmsa/flashmsa.h"
#include "flashmsa/flashmsa.hpp"
#include "patterns.hpp"

namespace flashmsa::cli {

int run(const std::vector<std::string>& args) {
  Config c;
  if (!parse_run_args(args, c)) {
    std::fputs(kRunUsage, stdout);
    return 0;
  }
  set_quiet(c.quiet);
  apply_threads(c);
  resolve_heads(c);
  resolve_backend(c);
  if (!c.fallback_notice.empty()) std::fprintf(stderr, "%s\n", c.fallback_notice.c_str());
  if (c.on_cuda && (c.dtype == FLASHMSA_DTYPE_FP32 || c.dtype == FLASHMSA_DTYPE_FP64))
    throw UsageError("--dtype " + std::string(flashmsa_dtype_name(c.dtype)) + ": CPU backend only");
  check_host_memory(c);
  if (!c.save_dir.empty()) prepare_save_dir(c.save_dir);
  print_config(c);

  Tensors t;
  declare(c, t);
  progress("[inputs] drawing %s inputs (%lld tokens, seed %llu) ...\n", pattern_name(c.pattern),
           (long long)c.total, (unsigned long long)c.seed);
  double t0 = now_s();
  generate(c, t);
  progress("[inputs] done in %.3f s\n", now_s() - t0);

  const Timings tm = run_step(c, t);
  const Stats s = compute_stats(c, t);
  CheckResult chk;
  if (c.check) {
    chk = run_check(c, t);
    check_device_parts(c, t, s, chk);
  }
  release_device(t);
  if (!c.save_dir.empty()) save_all(c, t);
  print_report(c, s, tm, chk);
  if (s.nonfinite_outputs) {
    std::fprintf(stderr, "flashmsa: error: outputs not fully written: %s\n", s.nonfinite_names.c_str());
    return 1;
  }
  return chk.ran && !chk.pass ? 1 : 0;
}

}  // namespace flashmsa::cli

int main(int argc, char** argv) {
  using namespace flashmsa::cli;
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || args[0] == "-h" || args[0] == "--help") {
      std::fputs(kMainUsage, args.empty() ? stderr : stdout);
      return args.empty() ? 2 : 0;
    }
    if (args[0] != "run") throw UsageError("unknown command '" + args[0] + "'");
    return run(std::vector<std::string>(args.begin() + 1, args.end()));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "flashmsa: %s\n%s(see flashmsa %s--help)\n", e.what(),
                 args.empty() || args[0] != "run" ? kMainUsage : "", !args.empty() && args[0] == "run" ? "run " : "");
    return 2;
  } catch (const flashmsa::Error& e) {
    std::fprintf(stderr, "flashmsa: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flashmsa: error: %s\n", e.what());
    return 1;
  }
}
