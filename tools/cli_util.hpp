// Small helpers of the main job (flashmsa run): printf into a string, progress lines on stderr,
// a wall clock, the worker thread count and a pool of threads over independent items.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace flashmsa::cli {

// printf into a string (at most 511 characters).
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));

// Progress lines on stderr, unless quiet.
void set_quiet(bool quiet);
void progress(const char* f, ...) __attribute__((format(printf, 1, 2)));

// Seconds of a monotonic clock.
double now_s();

// Most worker threads (--threads and FLASHMSA_NUM_THREADS), as the CPU backend allows.
constexpr int kMaxThreads = 1024;

// The worker thread count of the CPU backend: FLASHMSA_NUM_THREADS, an integer in
// [1, kMaxThreads]; unset or empty: the hardware's, at most kMaxThreads. Any other value throws
// std::invalid_argument with a message naming the variable.
int num_threads();

// Runs fn(i) for i in [0, n) on num_threads() threads (items are independent, so the result
// does not depend on which thread ran which item). Threads that cannot be started leave their
// share to the others; the first exception of any thread is rethrown after all joined.
void parallel_items(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace flashmsa::cli
