// The main job's work on the GPU besides the library's step (built with the CUDA runtime only;
// without it every function throws NOT_SUPPORTED):
//  - the inputs drawn in device memory: the same selection patterns as the CPU generator
//    (patterns.hpp) from a counter-based generator, so a 32k-token m3 step draws its 1.1 GB of
//    inputs in milliseconds instead of seconds. The numbers differ from the CPU path's for the
//    same seed (the CPU path keeps its generator); the same seed gives the same numbers on any GPU.
//  - the statistics that read the big tensors: attention-mass recall (fp64) and the count of
//    output entries the step left unwritten (still NaN / below -1 after the poison).
#pragma once

#include <cstdint>
#include <vector>

#include "cli_args.hpp"
#include "cli_buffers.hpp"

namespace flashmsa::cli::dev {

// Allocates the device copies of q, k, v, qp, kp, dout and dlse and draws them (seeded,
// rounded to the dtype). Host copies are left alone.
void draw_inputs(const Config& c, Tensors& t);

// compute_stats' mass recall on the device tensors q, k and indices (same definition; fp64, the
// sum over keys in another order, so it agrees with the host's to ~1e-12).
double mass_recall(const Config& c, const Tensors& t, const std::vector<int64_t>& rows);

// Entries of the device copy of b that the step left unwritten: NaN for float dtypes, values
// below -1 for int32 (the poison is 0xff bytes).
int64_t count_unwritten(const Buf& b);

// Mean and variance of the device copy of b (a float dtype), in fp64: the input check of --check.
void moments(const Buf& b, double* mean, double* var);

}  // namespace flashmsa::cli::dev
