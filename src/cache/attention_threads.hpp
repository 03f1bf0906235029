// Private to the cache stage: the process-wide thread pool that attend_tiled spreads a long
// context's token splits over (cache/attention.hpp, "Threads"). The pool is Debian's pthreadpool
// (libpthreadpool-dev, the pool XNNPACK and PyTorch use): the calling thread works as one of the
// threads, and workers spin briefly for the next call before they sleep, so a decode loop that
// attends layer after layer does not wake them from the kernel every time.
#pragma once
#include <cstddef>
#include <functional>

namespace vq::detail {

// Runs fn(i) for every i in [0, n) and returns when all have run; rethrows the first exception
// fn threw (the others' items still run). On attention_threads() threads when that is > 1 and the
// pool is free; on the calling thread alone when it is 1, or while another thread's call holds
// the pool (rather than wait for it). Which thread runs an item is not fixed: fn must give the
// same result on any.
void attention_parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn);

}  // namespace vq::detail
