// nbytes() of the resident CacheGen and KIVI caches is exactly what they have allocated: this
// binary counts its own heap (a replaced global operator new/delete, which is why it is a test
// executable of its own, vq_alloc_tests: the replacement does not touch vq_tests).
#include <malloc.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>

#include <gtest/gtest.h>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/peers/kivi_cache.hpp"
#include "../support/test_util.hpp"

// --- counting the heap ---------------------------------------------------------------------------
// Net usable bytes allocated on this thread while g_counting is set; every form of new and delete
// goes through malloc/free so that the counts pair up.
namespace {
thread_local bool g_counting = false;
thread_local long long g_live = 0;
void* counted_alloc(std::size_t n) noexcept {
  void* p = std::malloc(n ? n : 1);
  if (p && g_counting) g_live += static_cast<long long>(malloc_usable_size(p));
  return p;
}
void counted_free(void* p) noexcept {
  if (p && g_counting) g_live -= static_cast<long long>(malloc_usable_size(p));
  std::free(p);
}
}  // namespace

void* operator new(std::size_t n) {
  void* p = counted_alloc(n);
  if (!p) throw std::bad_alloc();
  return p;
}
void* operator new[](std::size_t n) { return operator new(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc(n); }
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t) noexcept { counted_free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { counted_free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { counted_free(p); }

namespace {

using vq::Tensor;

struct Counting {
  Counting() { g_live = 0, g_counting = true; }
  ~Counting() { g_counting = false; }
};

// Build `spec`'s cache inside a counting scope, feed it a prefill and decode steps (so that exact
// windows hold tokens), attend and materialise once (both must leave nothing behind), then compare
// the heap it holds with nbytes(). `read_counters` also reads the byte counters first (CacheGen's
// histograms then exist and must be counted too).
void expect_nbytes_is_the_heap(const std::string& spec, vq::DType dtype, bool read_counters) {
  SCOPED_TRACE(spec + (dtype == vq::DType::F16 ? " f16" : " f32") + (read_counters ? " counters read" : ""));
  const Tensor k = vqtest::random_walk({2, 4, 300, 64}, 1, dtype), v = vqtest::random_walk({2, 4, 300, 64}, 2, dtype);
  const Tensor q = vqtest::random_uniform({2, 8, 1, 64}, 3);
  long long live = 0;
  std::size_t nbytes = 0;
  std::size_t dense = 0;
  {
    Counting count;
    auto cache = vq::make_caches(vq::MethodSpec::parse(spec), vq::ModelDescription::uniform(1, 64))[0];
    const long long made = g_live;  // the cache object and its shared_ptr control block
    cache->update(k.slice(2, 0, 200), v.slice(2, 0, 200));
    for (std::int64_t t = 200; t < 270; ++t) cache->update(k.slice(2, t, t + 1), v.slice(2, t, t + 1));
    (void)cache->attend(q, 0.125f);
    {
      const vq::KVState s = cache->state();  // the caller's tensors: freed at the end of this scope
      dense = s.keys.nbytes() + s.values.nbytes();
    }
    if (read_counters) (void)cache->stored_bytes();
    live = g_live - made;
    nbytes = cache->nbytes();
  }
  EXPECT_GE(live, static_cast<long long>(nbytes)) << "nbytes() counts memory the cache did not allocate";
  // malloc rounds each block up by < 32 bytes; the two layout tensors' control blocks are not counted.
  EXPECT_LE(live, static_cast<long long>(nbytes) + 2048) << "the cache holds memory nbytes() does not count";
  // Under the dense bytes it materialises, even at this short context (KIVI keeps 128 of 270 value
  // tokens exact). Not per_call: there each one-token decode step is a segment with a group of
  // float32 metadata of its own (the reference's flaw), which outweighs a dense token.
  if (spec.find("per_call") == std::string::npos) EXPECT_LT(nbytes, dense);
}

TEST(ResidentNbytes, CacheGenBothFlushModesAndKiviHoldExactlyWhatTheyReport) {
  for (const char* spec : {"cachegen:bits=4,schedule=off", "cachegen:bits=4,flush=per_call,schedule=off", "cachegen:bits=3,group=16,schedule=off",
                           "kivi:bits=2", "kivi:bits=4,group=16,residual=32"})
    for (const vq::DType dt : {vq::DType::F32, vq::DType::F16})
      for (const bool counters : {false, true}) expect_nbytes_is_the_heap(spec, dt, counters);
}

// vq with resident=coded: every quantized token sealed (the open tile too), the packed layout's
// arrays dropped at rest, the sealed bytes grown to their exact size on the heap. The readers'
// per-thread tile scratch (not billed: like attention's float tiles) is made by a first cache of
// the same shape before counting.
TEST(ResidentNbytes, VqCodedHoldsExactlyWhatItReports) {
  for (const char* spec : {"vq:bits=2,resident=coded", "vq:bits=3,resident=coded,residual=4,sinks=1"})
    for (const vq::DType dt : {vq::DType::F32, vq::DType::F16}) {
      {
        auto warm = vq::make_caches(vq::MethodSpec::parse(spec), vq::ModelDescription::uniform(1, 64))[0];
        const Tensor k = vqtest::random_walk({2, 4, 100, 64}, 7, dt);
        warm->update(k, k);
        (void)warm->attend(vqtest::random_uniform({2, 8, 1, 64}, 3), 0.125f);
        (void)warm->state();
      }
      expect_nbytes_is_the_heap(spec, dt, false);
    }
}

// After trim (a group reopened into the residual) and a full_state round trip, the heap still
// matches nbytes().
TEST(ResidentNbytes, CacheGenAfterTrimAndFullStateRoundTrip) {
  const Tensor k = vqtest::random_walk({1, 4, 150, 64}, 4, vq::DType::F16), v = vqtest::random_walk({1, 4, 150, 64}, 5, vq::DType::F16);
  long long live = 0;
  std::size_t nbytes = 0;
  {
    Counting count;
    auto* a = new vq::CacheGenKVCache;
    a->update(k, v);
    a->trim(23);  // 127 tokens: group [96, 128) reopens, 31 rows rejoin the residual
    auto* b = new vq::CacheGenKVCache;
    b->from_full_state(a->full_state());
    delete a;
    live = g_live - static_cast<long long>(malloc_usable_size(b));
    nbytes = b->nbytes();
    EXPECT_EQ(b->key_stream().residual_tokens(), 31);
    delete b;
  }
  EXPECT_GE(live, static_cast<long long>(nbytes));
  EXPECT_LE(live, static_cast<long long>(nbytes) + 1024);
}

}  // namespace
