// --check of the main job: the step's outputs against the fp64 reference. Small problems run
// the whole step again through the public C ABI on CPU tensors of dtype fp64 (the CPU backend
// computes in fp64), fed the step's own indices; large ones recompute a seeded sample of rows
// here in fp64 over the step's own key sets.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cli_args.hpp"
#include "cli_buffers.hpp"

namespace flashmsa::cli {

constexpr int64_t kCheckFullMaxTokens = 4096;  // --check: everything up to this many tokens
constexpr double kIndexAgreementMin = 0.99;    // --check fails below this index agreement

// The error of one tensor against its reference.
struct Err {
  std::string name;
  double diff2 = 0, ref2 = 0, max_abs = 0;
  int64_t count = 0, mismatched_inf = 0;
  std::string note;
  void add(double got, double want) {
    ++count;
    if (std::isinf(want) || std::isinf(got) || std::isnan(got) || std::isnan(want)) {
      if (!(got == want)) ++mismatched_inf;
      return;
    }
    const double d = got - want;
    diff2 += d * d;
    ref2 += want * want;
    max_abs = std::max(max_abs, std::fabs(d));
  }
  double rel() const {
    if (mismatched_inf) return INFINITY;
    if (ref2 == 0) return diff2 == 0 ? 0.0 : INFINITY;
    return std::sqrt(diff2 / ref2);
  }
};

// A check of the parts of a CUDA run that only the device computes (the drawn inputs, the
// device statistics): a name, what was measured against which bar, and the verdict.
struct DeviceCheck {
  std::string name, detail;
  bool ok = false;
};

struct CheckResult {
  bool ran = false;
  std::vector<DeviceCheck> device;
  std::string scope;
  std::vector<Err> errs;
  double index_agreement = NAN;
  int64_t index_slots = 0;
  double threshold = 0;
  bool pass = true;
};

// The check of the step that ran on t, with progress lines.
CheckResult run_check(const Config& c, const Tensors& t);

struct Stats;
// On CUDA: the moments of the inputs drawn on the device (N(0, 1) within 6 standard errors) and
// the device's recall against the host's fp64 recall over the same rows (within 1e-9); added
// to r (r.pass false on a failure).
void check_device_parts(const Config& c, const Tensors& t, const Stats& s, CheckResult& r);

constexpr double kRecallAgreement = 1e-9;  // |device recall - host recall| at most this

}  // namespace flashmsa::cli
