// VqKVCache with resident=coded (vq_cache.hpp, "Sealed tiles"): the Rice tile coder round trips
// every code bit for bit; a coded cache holds the packed cache's values bit for bit (codes, state,
// encode) whatever the chunking, through trim (into a sealed tile and not), from_state and restore;
// attend over it equals dense attention over its reconstruction (Sq = 1 and > 1, GQA, B > 1,
// D = 8, 13, 128, float32 and float16, sinks and exact tails, a layer model with RoPE); it holds
// fewer bytes than the packed form; bad option values get a clear error.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "../../src/vq/seal_coder.hpp"
#include "veloxquant/cache/attention.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/vq/vq_cache.hpp"
#include "../support/test_util.hpp"
#include "../support/vq_random_layer.hpp"

namespace {

using vq::Tensor;

TEST(VqSealCoder, RoundTripsEveryCode) {
  std::mt19937_64 rng(7);
  for (const int n : {1, 8, 13, 32, 128}) {
    for (const double sigma : {0.0, 0.4, 3.0, 40.0, 3000.0}) {
      const std::int64_t rows = 64;
      std::vector<std::int16_t> codes(static_cast<std::size_t>(rows * n));
      std::normal_distribution<double> nd(0.0, sigma);
      for (auto& q : codes) q = static_cast<std::int16_t>(std::clamp(std::nearbyint(nd(rng)), -32640.0, 32640.0));
      codes[0] = 32640, codes[codes.size() - 1] = -32640;  // the codes' reach, both ends
      std::vector<std::uint8_t> bytes = {0xAB};           // a tile may start anywhere in a buffer
      vq::seal::encode_tile(codes.data(), rows, n, bytes);
      EXPECT_EQ(bytes.size() - 1, vq::seal::tile_bytes(codes.data(), rows, n));
      const std::size_t tile = bytes.size() - 1;
      bytes.resize(bytes.size() + 8, 0);
      std::vector<std::int16_t> back(codes.size(), 0);
      EXPECT_EQ(vq::seal::decode_tile(bytes.data() + 1, rows, n, back.data()), tile);
      EXPECT_EQ(back, codes) << "n=" << n << " sigma=" << sigma;
      if (sigma == 0.4 && n >= 32) {
        EXPECT_LT(8.0 * static_cast<double>(tile) / static_cast<double>(codes.size()), 1.8);
      }
    }
  }
}

// Rows that repeat rows of the tile or of the previous tile are copied (not coded): bit for bit, and
// never from a row of the previous tile that itself copies from the tile before it (its decoder
// may not have it); a zero-run coefficient (mostly 0) costs well under a bit per code.
TEST(VqSealCoder, RowCopiesAndZeroRunsRoundTrip) {
  std::mt19937_64 rng(9);
  for (const int n : {1, 8, 13, 32})
    for (const double sigma : {0.0, 0.4, 1.0, 40.0})
      for (const std::int64_t rows : {1, 17, 64}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " sigma=" << sigma << " rows=" << rows);
        std::normal_distribution<double> nd(0.0, sigma);
        std::vector<std::vector<std::int16_t>> vocab(10, std::vector<std::int16_t>(static_cast<std::size_t>(n)));
        for (auto& v : vocab)
          for (auto& q : v) q = static_cast<std::int16_t>(std::nearbyint(nd(rng)));
        std::vector<std::int16_t> prev(static_cast<std::size_t>(64 * n)), cur(static_cast<std::size_t>(rows * n));
        auto pick = [&]() -> const std::vector<std::int16_t>& { return vocab[rng() % 10]; };
        for (std::int64_t r = 0; r < 64; ++r) std::copy_n(pick().begin(), n, prev.begin() + r * n);
        for (std::int64_t r = 0; r < rows; ++r) {
          if (rng() % 3) {
            std::copy_n(pick().begin(), n, cur.begin() + r * n);
          } else {
            for (int c = 0; c < n; ++c) cur[static_cast<std::size_t>(r * n + c)] = static_cast<std::int16_t>(std::nearbyint(nd(rng)));
          }
        }
        const std::uint64_t prev_back = rng() & rng();  // rows of prev that copy from the tile before it
        std::vector<std::uint8_t> bytes;
        const std::uint64_t back = vq::seal::encode_tile(cur.data(), rows, n, bytes, prev.data(), prev_back);
        EXPECT_EQ(bytes.size(), vq::seal::tile_bytes(cur.data(), rows, n, prev.data(), prev_back));
        bytes.resize(bytes.size() + 8, 0);
        EXPECT_EQ(vq::seal::copies_back(bytes.data(), rows), back);
        std::vector<std::int16_t> junk = prev;  // prev's own copies are not named: junk there changes nothing
        for (std::int64_t r = 0; r < 64; ++r)
          if (prev_back >> r & 1) std::fill(junk.begin() + r * n, junk.begin() + (r + 1) * n, std::int16_t{12345});
        std::vector<std::int16_t> out(cur.size(), 7);
        vq::seal::decode_tile(bytes.data(), rows, n, out.data(), junk.data());
        EXPECT_EQ(out, cur);
        if (n == 32 && rows == 64 && sigma > 0) {  // about 2/3 of the rows repeat one of 10: copies pay
          EXPECT_NE(back, 0u);
          EXPECT_LT(bytes.size(), vq::seal::tile_bytes(cur.data(), rows, n));
        }
      }
  // Mostly zeros (sigma 0.2 steps: ~1 % nonzero): zero runs, well under Rice's 1 bit per code.
  std::vector<std::int16_t> sparse(64 * 32);
  std::normal_distribution<double> nd(0.0, 0.2);
  for (auto& q : sparse) q = static_cast<std::int16_t>(std::nearbyint(nd(rng)));
  std::vector<std::uint8_t> bytes;
  vq::seal::encode_tile(sparse.data(), 64, 32, bytes);
  EXPECT_LT(8.0 * static_cast<double>(bytes.size()) / static_cast<double>(sparse.size()), 0.5);
  bytes.resize(bytes.size() + 8, 0);
  std::vector<std::int16_t> out(sparse.size(), 7);
  vq::seal::decode_tile(bytes.data(), 64, 32, out.data());
  EXPECT_EQ(out, sparse);
}

vq::VqConfig config(bool coded, int sinks = 0, int residual = 0) {
  vq::VqConfig c;
  c.bits = 2;
  c.calib = 32;
  c.sinks = sinks;
  c.residual = residual;
  c.coded = coded;
  return c;
}

void feed(vq::VqKVCache& c, const Tensor& k, const Tensor& v, std::int64_t chunk) {
  for (std::int64_t s = 0; s < k.dim(2); s += chunk) {
    const std::int64_t e = std::min(k.dim(2), s + chunk);
    c.update(k.slice(2, s, e), v.slice(2, s, e));
  }
}

void expect_same_values(const vq::VqKVCache& coded, const vq::VqKVCache& packed) {
  ASSERT_EQ(coded.offset(), packed.offset());
  ASSERT_EQ(coded.quantized_tokens(), packed.quantized_tokens());
  EXPECT_EQ(coded.encode(), packed.encode());
  const vq::KVState a = coded.state(), b = packed.state();
  if (packed.offset() == 0) return;
  EXPECT_TRUE(a.keys.contiguous(true).bit_equal(b.keys.contiguous(true)));
  EXPECT_TRUE(a.values.contiguous(true).bit_equal(b.values.contiguous(true)));
}

double max_rel_diff(const Tensor& a, const Tensor& b) {
  const auto x = a.to_f32_vector(), y = b.to_f32_vector();
  double diff = 0, mag = 0;
  for (std::size_t i = 0; i < x.size(); ++i) diff = std::max(diff, std::fabs(double(x[i]) - y[i])), mag = std::max(mag, std::fabs(double(y[i])));
  return diff / (1.0 + mag);
}

struct Case {
  std::int64_t B, H, Hq, D, T, Sq, chunk;
  vq::DType dtype;
  int sinks, residual;
  bool model;  // a layer model with RoPE (else the identity sized from the data)
};

void expect_coded_case(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "B=" << c.B << " H=" << c.H << " Hq=" << c.Hq << " D=" << c.D << " T=" << c.T << " Sq=" << c.Sq
                                    << " chunk=" << c.chunk << (c.dtype == vq::DType::F16 ? " f16" : " f32") << " sinks=" << c.sinks
                                    << " residual=" << c.residual << (c.model ? " model" : ""));
  std::shared_ptr<const vq::VqLayerModel> lm;
  if (c.model) lm = std::make_shared<const vq::VqLayerModel>(vqtest::random_weights_layer_model(static_cast<int>(c.H), static_cast<int>(c.D), 32, 5));
  vq::VqKVCache coded(config(true, c.sinks, c.residual), lm), packed(config(false, c.sinks, c.residual), lm);
  const Tensor k = vqtest::random_walk({c.B, c.H, c.T, c.D}, 11, c.dtype), v = vqtest::random_walk({c.B, c.H, c.T, c.D}, 12, c.dtype);
  feed(coded, k.slice(2, 0, c.T - c.Sq), v.slice(2, 0, c.T - c.Sq), c.chunk);
  feed(packed, k.slice(2, 0, c.T - c.Sq), v.slice(2, 0, c.T - c.Sq), c.T);
  coded.update(k.slice(2, c.T - c.Sq, c.T), v.slice(2, c.T - c.Sq, c.T));
  packed.update(k.slice(2, c.T - c.Sq, c.T), v.slice(2, c.T - c.Sq, c.T));
  EXPECT_EQ(coded.sealed_tokens(), coded.quantized_tokens());  // the open tile too
  ASSERT_GT(coded.sealed_tokens(), 0);
  expect_same_values(coded, packed);
  const Tensor q = vqtest::random_uniform({c.B, c.Hq, c.Sq, c.D}, 13);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  const Tensor ref = vq::attend_ref(coded, q, scale);
  EXPECT_LE(max_rel_diff(coded.attend(q, scale), ref), 4e-6);
  EXPECT_LE(max_rel_diff(packed.attend(q, scale), ref), 4e-6);
  EXPECT_LT(coded.nbytes(), packed.nbytes());
}

TEST(VqSealed, AttendEqualsDenseAttentionOverTheReconstruction) {
  using vq::DType;
  const Case cases[] = {
      {1, 2, 2, 8, 300, 1, 300, DType::F32, 0, 0, false},   // one prefill, one decode step
      {1, 2, 4, 8, 200, 1, 1, DType::F32, 0, 0, true},      // token by token, RoPE model, GQA
      {2, 2, 6, 13, 333, 5, 50, DType::F16, 1, 4, false},   // B > 1, odd D, Sq > 1, sinks, exact tail
      {1, 4, 8, 128, 260, 3, 100, DType::F16, 0, 2, false}, // D = 128
      {2, 2, 2, 16, 400, 7, 77, DType::F32, 2, 0, true},
  };
  for (const Case& c : cases) expect_coded_case(c);
}

// A layer that sees tokens alone (stories260K's first): rows repeat, within a tile and from the
// tile before. Fed token by token (the open tile coded again at every step) and in chunks, the
// coded cache holds the packed one's values, attends alike, trims alike, and its copies make it smaller.
TEST(VqSealed, RepeatedRowsAreCopiedAndStayExact) {
  const Tensor vk = vqtest::random_walk({1, 2, 12, 8}, 51), vv = vqtest::random_walk({1, 2, 12, 8}, 52);
  const std::int64_t T = 300;
  Tensor k = Tensor::zeros({1, 2, T, 8}, vq::DType::F32), v = Tensor::zeros({1, 2, T, 8}, vq::DType::F32);
  std::mt19937_64 rng(5);
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t w = static_cast<std::int64_t>(rng() % 12);
    for (std::int64_t h = 0; h < 2; ++h)
      for (const auto& [dst, src] : {std::pair{&k, &vk}, std::pair{&v, &vv}})
        std::memcpy(dst->row(0, h, t), src->row(0, h, w), 8 * sizeof(float));
  }
  const Tensor walk_k = vqtest::random_walk({1, 2, T, 8}, 53), walk_v = vqtest::random_walk({1, 2, T, 8}, 54);
  for (const std::int64_t chunk : {1, 37}) {
    SCOPED_TRACE(chunk);
    vq::VqKVCache coded(config(true), nullptr), packed(config(false), nullptr), walk(config(true), nullptr);
    feed(coded, k, v, chunk);
    feed(packed, k, v, T);
    feed(walk, walk_k, walk_v, chunk);
    EXPECT_EQ(coded.sealed_tokens(), coded.quantized_tokens());
    expect_same_values(coded, packed);
    const Tensor q = vqtest::random_uniform({1, 4, 1, 8}, 13);
    EXPECT_LE(max_rel_diff(coded.attend(q, 0.35f), vq::attend_ref(coded, q, 0.35f)), 4e-6);
    EXPECT_LT(2 * coded.nbytes(), walk.nbytes());  // 12 distinct rows: nearly every row a copy
    EXPECT_EQ(coded.trim(100), 100);
    EXPECT_EQ(packed.trim(100), 100);
    expect_same_values(coded, packed);
  }
}

TEST(VqSealed, TrimFromStateAndRestoreStayExact) {
  auto lm = std::make_shared<const vq::VqLayerModel>(vqtest::random_weights_layer_model(2, 8, 32, 9));
  const Tensor k = vqtest::random_walk({1, 2, 300, 8}, 21), v = vqtest::random_walk({1, 2, 300, 8}, 22);
  for (const std::int64_t cut : {10, 40, 70, 200, 299}) {  // inside the open tile, into sealed tiles, to 1 token
    SCOPED_TRACE(cut);
    vq::VqKVCache coded(config(true), lm), packed(config(false), lm);
    feed(coded, k, v, 300);
    feed(packed, k, v, 300);
    EXPECT_EQ(coded.trim(cut), cut);
    EXPECT_EQ(packed.trim(cut), cut);
    EXPECT_EQ(coded.sealed_tokens(), coded.quantized_tokens());
    expect_same_values(coded, packed);
    // And both continue alike.
    coded.update(k.slice(2, 0, 90), v.slice(2, 0, 90));
    packed.update(k.slice(2, 0, 90), v.slice(2, 0, 90));
    expect_same_values(coded, packed);
  }
  vq::VqKVCache coded(config(true, 0, 3), lm), packed(config(false, 0, 3), lm);
  feed(coded, k, v, 37);
  feed(packed, k, v, 300);
  expect_same_values(coded, packed);
  vq::VqKVCache again(config(true, 0, 3), lm), again_packed(config(false, 0, 3), lm);
  again.from_state(coded.state());  // the rows re-fed (and re-quantized) as one chunk
  again_packed.from_state(packed.state());
  EXPECT_GT(again.sealed_tokens(), 0);
  expect_same_values(again, again_packed);
  // restore from the codes and the exact tail seals what is due.
  const vq::KVState st = coded.state();
  const std::int64_t Q = coded.quantized_tokens();
  auto back = vq::VqKVCache::restore(config(true, 0, 3), lm, coded.codes(),
                                     {st.keys.slice(2, Q, st.keys.dim(2)).contiguous(true), st.values.slice(2, Q, st.values.dim(2)).contiguous(true)});
  EXPECT_EQ(back->sealed_tokens(), Q);
  expect_same_values(*back, packed);
  EXPECT_EQ(coded.trim(1000), 300);
  EXPECT_EQ(coded.sealed_tokens(), 0);
  EXPECT_EQ(coded.nbytes(), packed.trim(1000) == 300 ? packed.nbytes() : 1);
}

TEST(VqSealed, HoldsFewerBytesThanThePackedRows) {
  // 1024 tokens x 8 heads x 128, float16, bits=2.
  const Tensor k = vqtest::random_walk({1, 8, 1024, 128}, 31, vq::DType::F16), v = vqtest::random_walk({1, 8, 1024, 128}, 32, vq::DType::F16);
  vq::VqConfig cfg;
  cfg.bits = 2;
  vq::VqKVCache packed(cfg);
  cfg.coded = true;
  vq::VqKVCache coded(cfg);
  packed.update(k, v);
  coded.update(k, v);
  const double elements = 2.0 * 1024 * 8 * 128;
  const double coded_bits = 8.0 * static_cast<double>(coded.nbytes()) / elements, packed_bits = 8.0 * static_cast<double>(packed.nbytes()) / elements;
  EXPECT_LT(coded_bits, packed_bits - 0.3) << coded_bits << " vs " << packed_bits;
}

TEST(VqSealed, SpecOptionAndErrors) {
  const vq::MethodSpec m = vq::MethodSpec::parse("vq:bits=2,resident=coded");
  EXPECT_TRUE(m.vq.coded);
  EXPECT_NE(m.to_string().find("resident=coded"), std::string::npos);
  EXPECT_FALSE(vq::MethodSpec::parse("vq:bits=2,resident=packed").vq.coded);
  EXPECT_EQ(vq::MethodSpec::parse("vq:bits=2").to_string().find("resident"), std::string::npos);
  try {
    (void)vq::MethodSpec::parse("vq:resident=dense");
    FAIL() << "resident=dense accepted";
  } catch (const vq::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("resident=dense must be packed or coded"), std::string::npos) << e.what();
  }
  // Bad queries leave a coded cache unchanged.
  vq::VqKVCache c(config(true));
  const Tensor k = vqtest::random_walk({1, 2, 100, 8}, 41), v = vqtest::random_walk({1, 2, 100, 8}, 42);
  c.update(k, v);
  const auto before = c.encode();
  EXPECT_THROW((void)c.attend(vqtest::random_uniform({1, 3, 1, 8}, 1), 0.3f), vq::InvalidArgument);
  EXPECT_THROW((void)c.attend(vqtest::random_uniform({1, 2, 1, 9}, 1), 0.3f), vq::InvalidArgument);
  EXPECT_EQ(c.encode(), before);
}

}  // namespace
