#include "cli_util.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace flashmsa::cli {

namespace {
bool g_quiet = false;
}  // namespace

std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

void set_quiet(bool quiet) { g_quiet = quiet; }

void progress(const char* f, ...) {
  if (g_quiet) return;
  va_list ap;
  va_start(ap, f);
  std::vfprintf(stderr, f, ap);
  va_end(ap);
  std::fflush(stderr);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int num_threads() {
  const char* env = std::getenv("FLASHMSA_NUM_THREADS");
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(env, &end, 10);
    bool digits = true;
    for (const char* p = env; p != end; ++p) digits = digits && *p >= '0' && *p <= '9';
    if (errno != 0 || end == env || *end != '\0' || !digits || n < 1 || n > kMaxThreads)
      throw std::invalid_argument("FLASHMSA_NUM_THREADS: expected an integer in [1, " +
                                  std::to_string(kMaxThreads) + "] (or unset: the hardware's), got '" +
                                  std::string(env) + "'");
    return int(n);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? int(std::min<unsigned>(hw, unsigned(kMaxThreads))) : 1;
}

void parallel_items(int64_t n, const std::function<void(int64_t)>& fn) {
  const int T = int(std::max<int64_t>(1, std::min<int64_t>(num_threads(), n)));
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    try {
      for (int64_t i; !failed.load() && (i = next.fetch_add(1)) < n;) fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      failed = true;
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(size_t(T));
  for (int i = 1; i < T; ++i) {
    try {
      pool.emplace_back(work);
    } catch (...) {  // std::system_error: no more threads; the started ones share the work
      break;
    }
  }
  work();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace flashmsa::cli
