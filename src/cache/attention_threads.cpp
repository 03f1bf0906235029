// The attention thread pool (attention_threads.hpp) and the process-wide thread count
// (cache/attention.hpp: attention_threads / set_attention_threads).
#include "attention_threads.hpp"

#include <pthreadpool.h>

#include <exception>
#include <mutex>
#include <thread>

#include "veloxquant/cache/attention.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

namespace {

// The pool and its size. `g_pool_mutex` is held for a whole parallel call, so that
// set_attention_threads never destroys a pool in use; a second caller does not wait for it (it
// runs its items itself: the results are the same).
std::mutex g_pool_mutex;
pthreadpool_t g_pool = nullptr;  // null while the count is 1
int g_threads = 1;

struct PoolDestroyer {
  ~PoolDestroyer() {
    if (g_pool) pthreadpool_destroy(g_pool);
  }
} g_pool_destroyer;

struct Job {
  const std::function<void(std::size_t)>* fn;
  std::mutex error_mutex;
  std::exception_ptr error;
};

void run_item(void* context, std::size_t i) {
  auto* job = static_cast<Job*>(context);
  try {
    (*job->fn)(i);
  } catch (...) {
    const std::lock_guard<std::mutex> lock(job->error_mutex);
    if (!job->error) job->error = std::current_exception();
  }
}

}  // namespace

int attention_threads() {
  const std::lock_guard<std::mutex> lock(g_pool_mutex);
  return g_threads;
}

int set_attention_threads(int n) {
  require(n >= 0 && n <= kMaxAttentionThreads, "attention threads must be 0 (every hardware thread) .. {}, got {}", kMaxAttentionThreads,
          n);
  if (n == 0) n = static_cast<int>(std::max(1u, std::min<unsigned>(std::thread::hardware_concurrency(), kMaxAttentionThreads)));
  const std::lock_guard<std::mutex> lock(g_pool_mutex);
  const int previous = g_threads;
  if (n == g_threads) return previous;
  pthreadpool_t pool = nullptr;
  if (n > 1) {
    pool = pthreadpool_create(static_cast<std::size_t>(n));
    if (!pool) throw Error(fmt::format("could not start {} attention threads", n));
  }
  if (g_pool) pthreadpool_destroy(g_pool);
  g_pool = pool;
  g_threads = n;
  return previous;
}

namespace detail {

void attention_parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn) {
  Job job{&fn, {}, {}};
  std::unique_lock<std::mutex> lock(g_pool_mutex, std::try_to_lock);
  // With the pool: pthreadpool hands out the items (statically first, then by stealing) and
  // returns when all are done. Without it (one thread, a single item, or the pool busy with
  // another thread's call): in order on this thread.
  pthreadpool_t pool = lock.owns_lock() && n > 1 ? g_pool : nullptr;
  if (!pool && lock.owns_lock()) lock.unlock();
  pthreadpool_parallelize_1d(pool, run_item, &job, n, 0);
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace detail

}  // namespace vq
