#include "veloxquant/cache/stream_codec.hpp"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include <gtest/gtest.h>

#include "../support/test_util.hpp"
#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/context_coder.hpp"

namespace {

using vq::SymbolTransform;

vq::KVCacheConfig config(int bits, int group, vq::FlushMode flush) {
  vq::KVCacheConfig c;
  c.cachegen_bits = bits;
  c.cachegen_group_size = group;
  c.cachegen_flush = flush;
  return c;
}

// Feed `S` tokens in the given chunk pattern (cycled).
std::unique_ptr<vq::CacheGenKVCache> make_cache(const vq::KVCacheConfig& cfg, const vq::Shape4& shape, std::uint64_t seed,
                                               std::vector<std::int64_t> chunks) {
  auto cache = std::make_unique<vq::CacheGenKVCache>(cfg);
  const auto k = vqtest::random_walk(shape, seed);
  const auto v = vqtest::random_uniform({shape[0], shape[1], shape[2], shape[3] + 1}, seed + 1);
  std::size_t ci = 0;
  for (std::int64_t s = 0; s < shape[2];) {
    const std::int64_t e = std::min(shape[2], s + chunks[ci++ % chunks.size()]);
    cache->update_and_fetch(k.slice(2, s, e), v.slice(2, s, e));
    s = e;
  }
  return cache;
}

bool same_floats(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

void expect_round_trip(const vq::QuantizedStream& s, const vq::StreamCodecOptions& opt) {
  const auto bytes = vq::encode_stream(s, opt);
  const std::uint64_t max_codes = static_cast<std::uint64_t>(s.slices() * s.quantized_tokens() * s.dim());
  const vq::DecodedStream d = vq::decode_stream(bytes, max_codes);
  ASSERT_EQ(d.bits, s.bits());
  ASSERT_EQ(d.slices, s.slices());
  ASSERT_EQ(d.tokens, s.quantized_tokens());
  ASSERT_EQ(d.groups, s.n_groups());
  ASSERT_EQ(d.group_size, s.group_size());
  ASSERT_EQ(d.transform, opt.transform.value_or(vq::default_transform(s.bits())));
  ASSERT_EQ(d.piece_tokens, s.segment_tokens());
  if (max_codes == 0) return;
  ASSERT_EQ(d.dim, s.dim());
  for (std::int64_t sl = 0; sl < s.slices(); ++sl) {
    const auto a = s.codes(sl);
    const auto b = d.slice_codes(sl);
    ASSERT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end())) << "slice " << sl;
    ASSERT_TRUE(same_floats(s.scales(sl), d.slice_scales(sl))) << "slice " << sl;
    ASSERT_TRUE(same_floats(s.minima(sl), d.slice_minima(sl))) << "slice " << sl;
  }
}

TEST(StreamCodec, RoundTripsEveryBitWidthFlushTransformAndGroupSize) {
  for (int bits = 1; bits <= 8; ++bits)
    for (const auto flush : {vq::FlushMode::PerCall, vq::FlushMode::GroupAligned})
      for (const int group : {1, 31, 32, 33})
        for (const auto tr : {SymbolTransform::Codes, SymbolTransform::TokenDelta, SymbolTransform::Context}) {
          if (tr == SymbolTransform::Context && bits > vq::kContextMaxBits) continue;
          SCOPED_TRACE(testing::Message() << "bits " << bits << " group " << group << " flush " << static_cast<int>(flush) << " tr "
                                          << static_cast<int>(tr));
          // Chunks of 37, 1, 1, 5: per_call makes several pieces, group_aligned leaves a residual.
          const auto cp = make_cache(config(bits, group, flush), {2, 2, 83, 5}, static_cast<std::uint64_t>(bits * 100 + group), {37, 1, 1, 5});
  const auto& cache = *cp;
          vq::StreamCodecOptions opt;
          opt.transform = tr;
          expect_round_trip(cache.key_stream(), opt);
          expect_round_trip(cache.value_stream(), opt);
        }
}

TEST(StreamCodec, RoundTripsAwkwardShapesAndKernels) {
  for (const vq::Shape4 shape : {vq::Shape4{1, 1, 1, 1}, vq::Shape4{1, 1, 32, 1}, vq::Shape4{3, 1, 33, 2}, vq::Shape4{1, 4, 64, 16}})
    for (const auto kernel : {vq::RansKernel::Scalar, vq::RansKernel::Auto}) {
      const auto cp = make_cache(config(4, 32, vq::FlushMode::PerCall), shape, 7, {shape[2]});
  const auto& cache = *cp;
      vq::StreamCodecOptions opt;
      opt.kernel = kernel;
      expect_round_trip(cache.key_stream(), opt);
      opt.transform = SymbolTransform::TokenDelta;
      expect_round_trip(cache.value_stream(), opt);
      opt.transform = SymbolTransform::Context;
      expect_round_trip(cache.key_stream(), opt);
      expect_round_trip(cache.value_stream(), opt);
    }
}

// Context codes at most 4-bit codes (the class map is built for 2^4 + 1 raw contexts): a 5-bit
// stream is refused at encode, and a buffer that claims it is a FormatError.
TEST(StreamCodec, ContextTransformIsForCodesUpToFourBits) {
  const auto cp = make_cache(config(5, 8, vq::FlushMode::GroupAligned), {1, 2, 40, 3}, 5, {40});
  vq::StreamCodecOptions opt;
  opt.transform = SymbolTransform::Context;
  EXPECT_THROW((void)vq::encode_stream(cp->key_stream(), opt), vq::InvalidArgument);
  const auto c4 = make_cache(config(4, 8, vq::FlushMode::GroupAligned), {1, 2, 40, 3}, 5, {40});
  auto bytes = vq::encode_stream(c4->key_stream(), opt);
  bytes[1] = 5;
  EXPECT_THROW((void)vq::decode_stream(bytes, 240), vq::FormatError);
}

TEST(StreamCodec, ConstantInputCodesInZeroPayload) {
  vq::CacheGenKVCache cache(config(4, 32, vq::FlushMode::GroupAligned));
  const auto k = vq::Tensor::from_f32({1, 2, 64, 4}, std::vector<float>(512, 0.5f));
  cache.update_and_fetch(k, k);
  expect_round_trip(cache.key_stream(), {});
}

TEST(StreamCodec, EmptyStreams) {
  const vq::CacheGenKVCache empty(config(4, 32, vq::FlushMode::GroupAligned));
  expect_round_trip(empty.key_stream(), {});
  EXPECT_EQ(empty.encoded_key_bytes(), 0u);
  EXPECT_EQ(empty.encoded_value_bytes(), 0u);
  // Group-aligned, fewer tokens than a group: slices but no closed tokens; all residual.
  const auto cp = make_cache(config(4, 32, vq::FlushMode::GroupAligned), {1, 3, 10, 8}, 1, {10});
  const auto& cache = *cp;
  expect_round_trip(cache.key_stream(), {});
  EXPECT_EQ(cache.encoded_key_bytes(), cache.encode_keys().size() + 3u * 10 * 8 * 4);
  const auto d = vq::CacheGenKVCache::decode(cache.encode_keys(), 0);
  EXPECT_TRUE(d.codes.empty());
}

TEST(StreamCodec, EncodedBytesCountResidualAndFollowUpdatesAndTrims) {
  vq::CacheGenKVCache cache(config(4, 32, vq::FlushMode::GroupAligned));
  const auto k = vqtest::random_walk({1, 2, 100, 8}, 3);
  cache.update_and_fetch(k.slice(2, 0, 70), k.slice(2, 0, 70));
  const std::uint64_t a = cache.encoded_key_bytes();
  EXPECT_EQ(a, cache.encode_keys().size() + 2u * (70 - 64) * 8 * 4);
  EXPECT_EQ(cache.encoded_key_bytes(), a);  // cached
  EXPECT_EQ(cache.encoded_value_bytes(), cache.encode_values().size() + 2u * 6 * 8 * 4);
  cache.update_and_fetch(k.slice(2, 70, 100), k.slice(2, 70, 100));
  EXPECT_EQ(cache.encoded_key_bytes(), cache.encode_keys().size() + 2u * (100 - 96) * 8 * 4);
  cache.trim(40);
  EXPECT_EQ(cache.encoded_key_bytes(), cache.encode_keys().size() + 2u * (60 - 32) * 8 * 4);
  // The residual is billed at the dtype's size (float32 above: 4 bytes), as a .vqkv file stores it.
  vq::CacheGenKVCache half(config(4, 32, vq::FlushMode::GroupAligned));
  const auto k16 = k.to(vq::DType::F16);
  half.update_and_fetch(k16.slice(2, 0, 70), k16.slice(2, 0, 70));
  EXPECT_EQ(half.encoded_key_bytes(), half.encode_keys().size() + 2u * (70 - 64) * 8 * 2);
}

TEST(StreamCodec, SizeIsCloseToEstimatePlusTablesPlusFloatMetadata) {
  for (const auto tr : {SymbolTransform::Codes, SymbolTransform::TokenDelta}) {
    const auto cp = make_cache(config(4, 32, vq::FlushMode::GroupAligned), {1, 4, 2048, 32}, 11, {2048});
  const auto& cache = *cp;
    const auto& s = cache.key_stream();
    vq::StreamCodecOptions opt;
    opt.transform = tr;
    vq::EncodedStreamSize size;
    const auto bytes = vq::encode_stream(s, opt, size);
    EXPECT_EQ(size.total, bytes.size());
    EXPECT_EQ(size.metadata, static_cast<std::uint64_t>(s.n_groups() * s.dim() * s.slices()) * 8);
    // Shannon bound of the same symbols, per channel.
    double bits = 0;
    const auto pieces = s.segment_tokens();
    for (std::int64_t sl = 0; sl < s.slices(); ++sl)
      for (int c = 0; c < s.dim(); ++c) {
        std::vector<std::uint16_t> sym;
        vq::channel_symbols(s.codes(sl).data() + c, static_cast<std::size_t>(s.dim()), pieces, 4, tr, sym);
        std::vector<double> h(static_cast<std::size_t>(vq::symbol_alphabet(4, tr)), 0.0);
        for (const auto x : sym) h[x] += 1;
        for (const double n : h)
          if (n > 0) bits -= n * std::log2(n / static_cast<double>(sym.size()));
      }
    const double ideal = bits / 8 + static_cast<double>(size.tables + size.metadata + size.header);
    EXPECT_LT(static_cast<double>(bytes.size()), ideal * 1.02) << "transform " << static_cast<int>(tr);
    EXPECT_GT(static_cast<double>(bytes.size()), ideal * 0.999);
  }
}

// The default (docs/benchmarks.md, "Choosing the symbol model"): the context coder up to 4 bits,
// where it stores fewer bytes than per-channel tables; plain codes above. encoded_key_bytes
// measures the default's buffer (everything closed here: no residual).
TEST(StreamCodec, DefaultIsTheContextCoderUpToFourBits) {
  for (const int bits : {1, 2, 3, 4, 5, 8}) {
    const auto cp = make_cache(config(bits, 32, vq::FlushMode::GroupAligned), {1, 4, 1024, 32}, 12, {1024});
    const auto& s = cp->key_stream();
    const auto def = vq::encode_stream(s);
    ASSERT_GE(def.size(), 3u);
    const auto want = bits <= 4 ? SymbolTransform::Context : SymbolTransform::Codes;
    EXPECT_EQ(vq::default_transform(bits), want);
    EXPECT_EQ(def[2], static_cast<std::uint8_t>(want)) << "bits " << bits;  // the transform byte
    EXPECT_EQ(cp->encoded_key_bytes(), def.size());
    vq::StreamCodecOptions codes;
    codes.transform = SymbolTransform::Codes;
    if (bits <= 4) {
      EXPECT_LT(def.size(), vq::encode_stream(s, codes).size()) << "bits " << bits;
    }
    EXPECT_EQ(vq::decode_stream(def, s.slices() * 1024 * 32).codes.size(), static_cast<std::size_t>(s.slices() * 1024 * 32));
  }
}

TEST(StreamCodec, CorruptAndTruncatedInputIsAFormatError) {
  for (const auto flush : {vq::FlushMode::PerCall, vq::FlushMode::GroupAligned})
    for (const auto tr : {SymbolTransform::Codes, SymbolTransform::TokenDelta, SymbolTransform::Context}) {
      const auto cp = make_cache(config(3, 8, flush), {1, 2, 40, 3}, 5, {17, 1, 22});
  const auto& cache = *cp;
      vq::StreamCodecOptions opt;
      opt.transform = tr;
      const auto bytes = vq::encode_stream(cache.key_stream(), opt);
      const std::uint64_t max_codes = 2 * 40 * 3;
      (void)vq::decode_stream(bytes, max_codes);
      for (std::size_t n = 0; n < bytes.size(); ++n)
        EXPECT_THROW((void)vq::decode_stream(std::span(bytes).first(n), max_codes), vq::FormatError) << "prefix " << n;
      auto longer = bytes;
      longer.push_back(0);
      EXPECT_THROW((void)vq::decode_stream(longer, max_codes), vq::FormatError);
      EXPECT_THROW((void)vq::decode_stream(bytes, max_codes - 1), vq::FormatError);  // more codes than the caller expects
      auto bad = bytes;
      bad[0] = 2;  // version
      EXPECT_THROW((void)vq::decode_stream(bad, max_codes), vq::FormatError);
      bad = bytes;
      bad[1] = 0;  // bits
      EXPECT_THROW((void)vq::decode_stream(bad, max_codes), vq::FormatError);
      bad = bytes;
      bad[2] = 7;  // transform
      EXPECT_THROW((void)vq::decode_stream(bad, max_codes), vq::FormatError);
      // Random byte flips: either a clean FormatError or a decode of the right shape, never a crash.
      std::mt19937 rng(42);
      for (int i = 0; i < 400; ++i) {
        bad = bytes;
        const std::size_t at = rng() % bad.size();
        bad[at] = static_cast<std::uint8_t>(bad[at] ^ (1u << (rng() % 8)));
        try {
          const auto d = vq::decode_stream(bad, max_codes);
          EXPECT_LE(d.codes.size(), max_codes);
        } catch (const vq::FormatError&) {
        }
      }
    }
}

TEST(StreamCodec, HugeClaimedShapesAreRefusedBeforeAllocating) {
  // version 1, bits 4, Codes, dim 65536, slices 2^24, group 1, tokens 2^40, groups 2^40, 1 piece of 2^40.
  std::vector<std::uint8_t> b{1, 4, 0};
  auto varint = [&](std::uint64_t v) {
    while (v >= 0x80) b.push_back(static_cast<std::uint8_t>(v | 0x80)), v >>= 7;
    b.push_back(static_cast<std::uint8_t>(v));
  };
  varint(1u << 16);
  varint(1u << 24);
  varint(1);
  varint(std::uint64_t{1} << 40);
  varint(std::uint64_t{1} << 40);
  varint(1);
  varint(std::uint64_t{1} << 40);
  EXPECT_THROW((void)vq::decode_stream(b, std::uint64_t{1} << 30), vq::FormatError);
  EXPECT_THROW((void)vq::decode_stream(b, ~std::uint64_t{0}), vq::FormatError);  // then truncated (tables)
}

}  // namespace
