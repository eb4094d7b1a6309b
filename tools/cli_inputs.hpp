// The seeded inputs of the main job: q, k, v, dout, dlse ~ N(0, 1), the proxy inputs of the
// chosen selection pattern (patterns.hpp), cu_seqlens and dkl.
#pragma once

#include "cli_args.hpp"
#include "cli_buffers.hpp"

namespace flashmsa::cli {

// Seeded inputs, rounded to the dtype; outputs poisoned (NaN / -1 bytes). t is declared.
// On CUDA the inputs are drawn in device memory (cli_device.hpp: the same patterns, the
// device generator's numbers) and copied to the host only when c.host_copies().
void generate(const Config& c, Tensors& t);

}  // namespace flashmsa::cli
