// The printed report of the main job on stdout: the configuration before the step, then the
// selection statistics, the time per stage with effective TFLOP/s, and the --check table.
#pragma once

#include "cli_args.hpp"
#include "cli_check.hpp"
#include "cli_stats.hpp"
#include "cli_step.hpp"

namespace flashmsa::cli {

void print_config(const Config& c);
void print_report(const Config& c, const Stats& s, const Timings& tm, const CheckResult& chk);

}  // namespace flashmsa::cli
