// The step of the main job through the public C ABI: the argument structs of the three stages
// (flashmsa_select, flashmsa_fwd, flashmsa_bwd), the choice of the backend, and the timed run
// with its workspaces.
#pragma once

#include <cmath>

#include "cli_args.hpp"
#include "cli_buffers.hpp"
#include "flashmsa/flashmsa.h"

namespace flashmsa::cli {

struct StageArgs {
  flashmsa_select_args_t sel;
  flashmsa_fwd_args_t fwd;
  flashmsa_bwd_args_t bwd;
};

// The arguments of the three stages over the views V of t: the forward and backward consume
// the selection's indices (GIVEN mode); warmup is DENSE.
StageArgs make_args(const Config& c, Tensors& t, const Views& V);

// Picks the backend (auto: CUDA when available and able to run the step, else the CPU with a
// fallback notice) and then the sizes (resolve_sizes).
void resolve_backend(Config& c);

struct Timings {
  double select_ms = NAN, fwd_ms = NAN, bwd_ms = NAN;
};

// Runs the stages of the step on t (generated), with progress lines. On CUDA the tensors stay on
// the device (release_device frees them); the outputs come back into host copies when
// c.host_copies(), else only the indices and kl.
Timings run_step(const Config& c, Tensors& t);

}  // namespace flashmsa::cli
