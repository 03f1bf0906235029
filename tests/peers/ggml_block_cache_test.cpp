// GgmlBlockCache as a resident cache: it holds only its blocks (nbytes() is exactly what it has
// allocated, measured by counting this test binary's heap allocations), materialises dense K/V
// only on request, and its attention tiles are read from the blocks. The fp8 cache, resident the
// same way, is measured here too (the heap counter lives in this file).
#include "veloxquant/peers/ggml_block_cache.hpp"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <new>
#include <optional>
#include <vector>

#include <gtest/gtest.h>

#include "veloxquant/cache/attention.hpp"
#include "veloxquant/cache/attention_kernels.hpp"
#include "veloxquant/peers/fp8_cache.hpp"
#include "veloxquant/vq/vq_cache.hpp"
#include "../support/test_util.hpp"

// --- counting the heap --------------------------------------------------------------------------
// Replaces the global operator new/delete of the test binary (plain and nothrow forms; the aligned
// ones keep their defaults). Counting is off except inside a LiveBytes scope on this thread; the cost when off
// is one thread-local check.
namespace {
thread_local bool g_counting = false;
thread_local long long g_live = 0;
}  // namespace

void* operator new(std::size_t n) {
  void* p = std::malloc(n ? n : 1);
  if (!p) throw std::bad_alloc();
  if (g_counting) g_live += static_cast<long long>(malloc_usable_size(p));
  return p;
}
namespace {
void release(void* p) noexcept {
  if (p && g_counting) g_live -= static_cast<long long>(malloc_usable_size(p));
  std::free(p);
}
}  // namespace
void operator delete(void* p) noexcept { release(p); }
void operator delete(void* p, std::size_t) noexcept { release(p); }
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete[](void* p) noexcept { release(p); }
void operator delete[](void* p, std::size_t) noexcept { release(p); }
// The nothrow forms too (std::stable_sort's temporary buffer uses them): every form that a
// replaced delete may free must come from the same malloc, or ASan reports a new/free mismatch.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  void* p = std::malloc(n ? n : 1);
  if (p && g_counting) g_live += static_cast<long long>(malloc_usable_size(p));
  return p;
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void operator delete(void* p, const std::nothrow_t&) noexcept { release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { release(p); }

namespace {

// Net heap bytes (usable sizes) allocated between construction and now on this thread.
struct LiveBytes {
  LiveBytes() { g_live = 0, g_counting = true; }
  ~LiveBytes() { g_counting = false; }
  long long now() const { return g_live; }
};

using vq::Tensor;

// Bytes of a PageVector's mapping that are resident now, by the kernel's count (mincore over the
// whole reserved range: pages never written are not resident, pages written are).
template <class T>
std::size_t resident_bytes(const vq::PageVector<T>& v) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in(v.reserved_bytes() / page);
  EXPECT_EQ(mincore(const_cast<T*>(v.data()), v.reserved_bytes(), in.data()), 0);
  std::size_t n = 0;
  for (unsigned char c : in) n += (c & 1) ? page : 0;
  return n;
}

template <class Cache>
void expect_nbytes_is_what_it_allocated(bool rotate) {
  const Tensor k = vqtest::random_walk({2, 8, 300, 64}, 1), v = vqtest::random_walk({2, 8, 300, 64}, 2);
  long long live = 0;
  std::size_t nbytes = 0, dense = 0, mapped = 0;
  {
    LiveBytes count;
    auto* c = new Cache(rotate);
    for (std::int64_t s = 0; s < 300; s += 50) {
      auto kv = c->update_and_fetch(k.slice(2, s, s + 50), v.slice(2, s, s + 50));  // decode-sized calls
      dense = kv.first.nbytes() + kv.second.nbytes();
    }  // the fetched dense tensors are the caller's: gone here
    (void)c->attend(vqtest::random_uniform({2, 16, 1, 64}, 3), 0.125f);
    live = count.now() - static_cast<long long>(malloc_usable_size(c));
    nbytes = c->nbytes();
    EXPECT_EQ(nbytes, c->key_blocks().nbytes() + c->value_blocks().nbytes() + (rotate ? 2 * 64 * sizeof(float) : 0));  // + the signs
    // 300 tokens of 8 x 64 values are 163-326 kB of blocks per side: each array is in its own
    // mapping, whose resident pages (the kernel's count) are exactly its nbytes().
    EXPECT_TRUE(c->key_blocks().mapped() && c->value_blocks().mapped());
    mapped = c->key_blocks().nbytes() + c->value_blocks().nbytes();
    EXPECT_EQ(resident_bytes(c->key_blocks()), c->key_blocks().nbytes());
    EXPECT_EQ(resident_bytes(c->value_blocks()), c->value_blocks().nbytes());
    delete c;
  }
  // On the heap the cache holds, rotated, the two sign vectors (malloc rounds each up by < 32
  // bytes), and the two layout tensors' control blocks (not counted); nothing else.
  EXPECT_GE(live, static_cast<long long>(nbytes - mapped));
  EXPECT_LE(live, static_cast<long long>(nbytes - mapped) + 256) << "the cache holds memory nbytes() does not count";
  EXPECT_LT(nbytes, dense / 2);  // 3.8x-7x smaller than the dense fp32 K/V it materialises
}

TEST(GgmlBlockCacheResident, NbytesIsExactlyWhatItAllocated) {
  expect_nbytes_is_what_it_allocated<vq::Q8_0KVCache>(false);
  expect_nbytes_is_what_it_allocated<vq::Q4_0KVCache>(false);
  expect_nbytes_is_what_it_allocated<vq::Q4_1KVCache>(false);
  expect_nbytes_is_what_it_allocated<vq::Q4_0KVCache>(true);
}

TEST(Fp8CacheResident, NbytesIsExactlyWhatItAllocated) {
  const Tensor k = vqtest::random_walk({2, 8, 300, 64}, 1), v = vqtest::random_walk({2, 8, 300, 64}, 2);
  long long live = 0;
  std::size_t nbytes = 0;
  {
    LiveBytes count;
    auto* c = new vq::Fp8KVCache;
    for (std::int64_t s = 0; s < 300; s += 50) (void)c->update_and_fetch(k.slice(2, s, s + 50), v.slice(2, s, s + 50));
    (void)c->attend(vqtest::random_uniform({2, 16, 1, 64}, 3), 0.125f);
    live = count.now() - static_cast<long long>(malloc_usable_size(c));
    nbytes = c->nbytes();
    EXPECT_EQ(nbytes, c->key_codes().capacity() + c->value_codes().capacity() +
                          4 * (c->key_scales().capacity() + c->value_scales().capacity()) + 8 * c->call_starts().capacity());
    delete c;
  }
  EXPECT_GE(live, static_cast<long long>(nbytes));
  EXPECT_LE(live, static_cast<long long>(nbytes) + 256) << "the cache holds memory nbytes() does not count";
  EXPECT_LT(nbytes, (k.nbytes() + v.nbytes()) / 2);  // ~1 byte per element (plus spare capacity) against float32's 4
}

TEST(GgmlBlockCacheResident, FetchIsAFreshDenseCopyNotHeldByTheCache) {
  const Tensor k = vqtest::random_walk({1, 4, 40, 8}, 4), v = vqtest::random_walk({1, 4, 40, 8}, 5);
  vq::Q4_0KVCache c;
  auto [fk, fv] = c.update_and_fetch(k, v);
  EXPECT_FALSE(c.key_blocks().mapped());  // 720 bytes: on the heap, exactly the blocks of the one call
  EXPECT_EQ(c.nbytes(), (c.key_blocks().size() + c.value_blocks().size()) * 18);
  const vq::KVState s = c.state();
  EXPECT_TRUE(s.keys.bit_equal(fk));
  EXPECT_TRUE(s.values.bit_equal(fv));
  EXPECT_FALSE(s.keys.shares_storage_with(fk));
  fk.set(0, 0, 0, 0, 1234.0f);  // the caller's own copy
  EXPECT_NE(c.state().keys.at(0, 0, 0, 0), 1234.0f);
}

// The tile reader returns exactly state()'s rows as float32, for every way a head meets the
// blocks: D < 32 (a block spans heads), D = 48 (heads straddle blocks), D = 64 (aligned), and in
// float16 (rounded as state() is).
template <class Cache>
void expect_tiles_equal_state(const vq::Shape4& shape, vq::DType dtype) {
  SCOPED_TRACE(vq::shape_string(shape));
  const Tensor k = vqtest::random_walk(shape, 6, dtype), v = vqtest::random_walk(shape, 7, dtype);
  Cache c;
  c.update_and_fetch(k, v);
  const vq::KVState s = c.state();
  const std::int64_t D = shape[3];
  std::vector<float> scratch(static_cast<std::size_t>(shape[2] * D));
  for (std::int64_t b = 0; b < shape[0]; ++b)
    for (std::int64_t h = 0; h < shape[1]; ++h)
      for (int side = 0; side < 2; ++side) {
        const std::int64_t t0 = 3, n = shape[2] - 5;
        const float* tile = side == 0 ? c.read_key_tile(b, h, t0, n, scratch.data()) : c.read_value_tile(b, h, t0, n, scratch.data());
        const Tensor& want = side == 0 ? s.keys : s.values;
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int64_t d = 0; d < D; ++d) ASSERT_EQ(tile[i * D + d], want.at(b, h, t0 + i, d)) << b << " " << h << " " << i << " " << d;
      }
}

TEST(GgmlBlockCacheResident, TilesAreTheBlocksDequantized) {
  expect_tiles_equal_state<vq::Q4_0KVCache>({2, 4, 20, 8}, vq::DType::F32);
  expect_tiles_equal_state<vq::Q4_1KVCache>({1, 2, 20, 48}, vq::DType::F32);
  expect_tiles_equal_state<vq::Q8_0KVCache>({2, 3, 20, 64}, vq::DType::F32);
  expect_tiles_equal_state<vq::Q4_0KVCache>({1, 4, 20, 8}, vq::DType::F16);
  expect_tiles_equal_state<vq::Q8_0KVCache>({1, 2, 20, 64}, vq::DType::F16);
}

TEST(GgmlBlockCacheResident, TrimAndFromStateStayExact) {
  const Tensor k = vqtest::random_walk({2, 2, 30, 32}, 8), v = vqtest::random_walk({2, 2, 30, 64}, 9);
  for (bool rotate : {false, true}) {
    vq::Q4_0KVCache all(rotate), part(rotate);
    all.update_and_fetch(k, v);
    part.update_and_fetch(k.slice(2, 0, 20), v.slice(2, 0, 20));
    EXPECT_EQ(all.trim(10), 10);
    EXPECT_TRUE(all.state().keys.bit_equal(part.state().keys));
    EXPECT_TRUE(all.state().values.bit_equal(part.state().values));
    const Tensor q = vqtest::random_uniform({2, 4, 2, 32}, 10);
    EXPECT_TRUE(all.attend(q, 0.2f).bit_equal(part.attend(q, 0.2f)));
    vq::Q4_0KVCache copy(rotate);
    copy.from_state(all.state());
    EXPECT_EQ(copy.offset(), 20);
    EXPECT_EQ(copy.stored_bytes().fixed_bytes, all.stored_bytes().fixed_bytes);
    EXPECT_EQ(copy.rotate(), rotate);
  }
}

// Attention on the blocks runs in 256-token tiles with the AVX-512 kernels (the AVX2 kernels and
// the float-tile path keep the default), and a decode step over several such tiles and a partial
// one (the kernels' look-ahead prefetch running past the last token) equals dense attention over
// the reconstruction, for every block format and both kernel widths.
template <class Cache>
void expect_long_tiles_match_dense(bool rotate) {
  constexpr std::int64_t T = 700, D = 128;
  const Tensor k = vqtest::random_walk({1, 2, T, D}, 31), v = vqtest::random_walk({1, 2, T, D}, 32);
  Cache c(rotate);
  c.update(k, v);
  EXPECT_EQ(c.attention_tile_tokens(), vq::attn::avx512_enabled() ? 256 : static_cast<std::int64_t>(vq::kAttentionTileBytes / 4 / D));
  const Tensor q = vqtest::random_uniform({1, 8, 1, D}, 33);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto x = c.attend(q, scale).to_f32_vector(), y = vq::attend_ref(c, q, scale).to_f32_vector();
  double diff = 0, mag = 0;
  for (std::size_t i = 0; i < x.size(); ++i) diff = std::max(diff, std::fabs(double(x[i]) - y[i])), mag = std::max(mag, std::fabs(double(y[i])));
  EXPECT_GT(mag, 0.1);
  EXPECT_LE(diff, 2e-6 * (1.0 + mag));
}

TEST(GgmlBlockCacheResident, LongTilesOnTheBlocksMatchDenseAttention) {
  for (bool wide : {true, false}) {  // the AVX-512 kernels (where the CPU has them), then the AVX2 ones
    const bool was = vq::attn::set_avx512_enabled(wide);
    for (bool rotate : {false, true}) {
      SCOPED_TRACE(::testing::Message() << (rotate ? "rotated" : "plain") << (wide ? " avx512" : " avx2"));
      expect_long_tiles_match_dense<vq::Q4_0KVCache>(rotate);
      expect_long_tiles_match_dense<vq::Q4_1KVCache>(rotate);
      expect_long_tiles_match_dense<vq::Q8_0KVCache>(rotate);
    }
    vq::attn::set_avx512_enabled(was);
  }
  // Float16 input takes the float-tile path (tiles rounded through float16): default tiles.
  vq::Q4_0KVCache half;
  half.update(vqtest::random_walk({1, 2, 40, 128}, 34, vq::DType::F16), vqtest::random_walk({1, 2, 40, 128}, 35, vq::DType::F16));
  EXPECT_EQ(half.attention_tile_tokens(), static_cast<std::int64_t>(vq::kAttentionTileBytes / 4 / 128));
}

// Rotation: the blocks hold R x per head; dequantization un-rotates; a row with one outlier
// channel (what rotation is for) loses far less.
TEST(GgmlBlockCacheResident, RotationSpreadsAnOutlierAndIsUndone) {
  const std::int64_t D = 128;
  std::vector<float> x(static_cast<std::size_t>(D * 16));
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = n(rng) + (i % D == 5 ? 40.0f : 0.0f);  // channel 5 is an outlier
  const Tensor k = Tensor::from_f32({1, 1, 16, D}, x);
  auto error = [&](bool rotate) {
    vq::Q4_0KVCache c(rotate);
    const auto [fk, fv] = c.update_and_fetch(k, k);
    double e = 0;
    for (std::int64_t t = 0; t < 16; ++t)
      for (std::int64_t d = 0; d < D; ++d) e += std::pow(fk.at(0, 0, t, d) - k.at(0, 0, t, d), 2);
    return e;
  };
  const double plain = error(false), rotated = error(true);
  EXPECT_LT(rotated, plain / 4) << plain << " " << rotated;
  vq::Q8_0KVCache r(true);
  r.update_and_fetch(k, k);
  EXPECT_EQ(r.kind(), "GgmlBlockCache<q8_0:rotate=1>");
  for (std::int64_t d = 0; d < D; ++d) EXPECT_NEAR(r.state().keys.at(0, 0, 3, d), k.at(0, 0, 3, d), 0.05);
  // The blocks are of the rotated row: block 0 of token 0 is q8_0 of the first 32 values of R k.
  std::vector<float> row(x.begin(), x.begin() + D);
  vq::HeadRotation(D).rotate(row.data());
  vq::ggml::block_q8_0 b{};
  vq::ggml::quantize_block_q8_0_ref(row.data(), b);
  EXPECT_EQ(std::memcmp(&b, &r.key_blocks()[0], sizeof b), 0);
}

// Our vq cache (vq/vq_cache.hpp) is resident too; its tests sit here, beside the heap counter.
// Its heap is nbytes() - nbytes_mapped(), and nbytes_mapped() is the pages the kernel has backed
// for its packed rows (in mappings of their own once past kPageVectorHeapBytes each).
std::size_t vq_backed_bytes(const vq::VqKVCache& c, std::int64_t batch) {
  std::size_t n = 0;
  for (int side = 0; side < 2; ++side)
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto& rows = c.packed_rows(side, b).bytes();
      if (rows.mapped()) n += resident_bytes(rows);
    }
  return n;
}

void expect_vq_heap_and_pages(const vq::VqKVCache& c, long long live, std::int64_t batch) {
  const std::size_t nbytes = c.nbytes(), mapped = c.nbytes_mapped();
  EXPECT_EQ(vq_backed_bytes(c, batch), mapped) << "nbytes_mapped() is not the pages the packed rows hold";
  // malloc rounds each of the cache's ~20 vectors up by < 32 bytes; the layout tensors' control blocks are not counted.
  EXPECT_GE(live, static_cast<long long>(nbytes - mapped)) << "nbytes() counts memory the cache did not allocate";
  EXPECT_LE(live, static_cast<long long>(nbytes - mapped) + 1024) << "the cache holds memory nbytes() does not count";
}

TEST(VqCacheResident, NbytesIsExactlyWhatItAllocated) {
  const Tensor k = vqtest::random_walk({2, 8, 300, 64}, 1), v = vqtest::random_walk({2, 8, 300, 64}, 2);
  std::size_t nbytes = 0;
  // The same run twice, counted the second time: the coder memoises the tables it builds (per
  // process, not per cache), and the first run fills that memo.
  for (int pass = 0; pass < 2; ++pass) {
    std::optional<LiveBytes> count;
    if (pass == 1) count.emplace();
    vq::VqConfig cfg;
    cfg.residual = 16;
    cfg.sinks = 2;
    auto* c = new vq::VqKVCache(cfg);
    c->update(k.slice(2, 0, 100), v.slice(2, 0, 100));  // a prefill, then decode steps
    for (std::int64_t s = 100; s < 300; ++s) c->update(k.slice(2, s, s + 1), v.slice(2, s, s + 1));
    (void)c->update_and_fetch(k.slice(2, 0, 0), v.slice(2, 0, 0));  // the fetched dense copy is the caller's
    (void)c->attend(vqtest::random_uniform({2, 16, 1, 64}, 3), 0.125f);
    (void)c->stored_bytes();
    if (pass == 1) expect_vq_heap_and_pages(*c, count->now() - static_cast<long long>(malloc_usable_size(c)), 2);
    nbytes = c->nbytes();
    delete c;
    if (pass == 1) EXPECT_EQ(count->now(), 0) << "the cache left memory behind";
  }
  // A few bits per element against float32's 32 (a random walk drifts from its calibration, so
  // fields widen), plus 18 exact tokens.
  EXPECT_LT(nbytes, (k.nbytes() + v.nbytes()) / 3);
}

// The same after trim (pages past the kept rows handed back) and growth after it, with packed
// rows on the heap (300 tokens) and in mappings (3000), float32 and float16.
TEST(VqCacheResident, NbytesFollowsTrimAndGrowth) {
  for (const vq::DType dtype : {vq::DType::F32, vq::DType::F16})
    for (const std::int64_t tokens : {std::int64_t{300}, std::int64_t{3000}}) {
      SCOPED_TRACE(::testing::Message() << vq::dtype_name(dtype) << " " << tokens << " tokens");
      const Tensor k = vqtest::random_walk({2, 4, tokens, 64}, 6, dtype), v = vqtest::random_walk({2, 4, tokens, 64}, 7, dtype);
      const Tensor q = vqtest::random_uniform({2, 8, 1, 64}, 8);
      vq::VqConfig cfg;
      cfg.calib = 32;
      cfg.sinks = 2;
      cfg.residual = 16;
      // Run twice, counted the second time (attend keeps per-thread scratch between calls).
      for (int pass = 0; pass < 2; ++pass) {
        std::optional<LiveBytes> count;
        if (pass == 1) count.emplace();
        auto* c = new vq::VqKVCache(cfg);
        const auto live = [&] { return pass == 1 ? count->now() - static_cast<long long>(malloc_usable_size(c)) : 0; };
        c->update(k.slice(2, 0, tokens / 2), v.slice(2, 0, tokens / 2));
        for (std::int64_t t = tokens / 2; t < tokens; t += 97) c->update(k.slice(2, t, std::min(tokens, t + 97)), v.slice(2, t, std::min(tokens, t + 97)));
        (void)c->attend(q, 0.125f);
        ASSERT_GT(c->quantized_tokens(), 0);
        if (pass == 1) {
          expect_vq_heap_and_pages(*c, live(), 2);
          EXPECT_EQ(c->nbytes_mapped() > 0, tokens > 1000);  // ~100 bytes a row: past 64 KiB at 3000 rows
        }
        c->trim(tokens / 3);
        if (pass == 1) expect_vq_heap_and_pages(*c, live(), 2);
        c->update(k.slice(2, 0, 200), v.slice(2, 0, 200));
        if (pass == 1) expect_vq_heap_and_pages(*c, live(), 2);
        delete c;
        if (pass == 1) EXPECT_EQ(count->now(), 0) << "the cache left memory behind";
      }
    }
}

}  // namespace

