// --save of the main job: every tensor of the step as a .npy file (float32 for bf16, fp16 and
// fp32 tensors, exact; float64; int32) and config.json with the problem, into one directory.
#pragma once

#include <string>

#include "cli_args.hpp"
#include "cli_buffers.hpp"

namespace flashmsa::cli {

// --save: the directory is created and a file written and removed in it before the step runs,
// so an unwritable path fails at once (UsageError) instead of after the computation.
void prepare_save_dir(const std::string& dir);

// Writes the tensors of t (dkl is kl_grad in config.json) and config.json into c.save_dir.
void save_all(const Config& c, const Tensors& t);

}  // namespace flashmsa::cli
