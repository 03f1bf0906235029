#include "veloxquant/entropy/context_coder.hpp"

#include <algorithm>
#include <cmath>
#include <span>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"

namespace {

vq::ContextLayout layout(std::size_t slices, std::size_t tokens, std::size_t dim, int bits, std::vector<std::int64_t> pieces, int group) {
  vq::ContextLayout l{slices, tokens, dim, bits, vq::group_starts(pieces, group)};
  return l;
}

// Codes of the kind a cache makes: per channel a clamped random walk (step 0 or +-1 with
// probability `move`), restarted at a random level at every group start; or iid uniform.
std::vector<std::uint8_t> walk_codes(const vq::ContextLayout& l, double move, unsigned seed, bool iid = false) {
  std::mt19937 rng(seed);
  const int top = (1 << l.bits) - 1;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<std::uint8_t> q(l.size());
  for (std::size_t s = 0; s < l.slices; ++s)
    for (std::size_t c = 0; c < l.dim; ++c) {
      int v = 0;
      for (std::size_t t = 0; t < l.tokens; ++t) {
        if (iid || l.group_start[t]) {
          v = static_cast<int>(rng() % static_cast<unsigned>(top + 1));
        } else if (u(rng) < move) {
          v = std::clamp(v + (rng() % 2 ? 1 : -1), 0, top);
        }
        q[(s * l.tokens + t) * l.dim + c] = static_cast<std::uint8_t>(v);
      }
    }
  return q;
}

std::vector<std::uint8_t> decode(std::span<const std::uint8_t> b, const vq::ContextLayout& l, vq::RansKernel k = vq::RansKernel::Auto) {
  std::vector<std::uint8_t> out(l.size(), 0xee);
  vq::context_decode(b, l, out, k);
  return out;
}

TEST(ContextCoder, GroupStartsFollowThePieces) {
  EXPECT_EQ(vq::group_starts(std::vector<std::int64_t>{5, 3}, 2), (std::vector<std::uint8_t>{1, 0, 1, 0, 1, 1, 0, 1}));
  EXPECT_EQ(vq::group_starts(std::vector<std::int64_t>{4}, 32), (std::vector<std::uint8_t>{1, 0, 0, 0}));
  EXPECT_TRUE(vq::group_starts(std::vector<std::int64_t>{}, 8).empty());
}

// Every shape: pair rows, single rows (odd groups, pieces, a last odd token, group size 1), bits
// 1..4, channel counts below, at and above one AVX2 group; the scalar reference and the AVX2
// kernels write the same bytes and decode the same codes.
TEST(ContextCoder, RoundTripIsExactForEveryShape) {
  unsigned seed = 1;
  for (int bits = 1; bits <= 4; ++bits)
    for (std::size_t slices : {1u, 3u})
      for (std::size_t dim : {1u, 7u, 32u, 40u})
        for (const auto& [pieces, group] : std::vector<std::pair<std::vector<std::int64_t>, int>>{
                 {{1}, 32}, {{5}, 1}, {{100}, 32}, {{5, 3, 40}, 8}, {{33}, 32}, {{45}, 9}})
          for (const double move : {0.0, 0.2, 1.0}) {
            std::size_t tokens = 0;
            for (const auto p : pieces) tokens += static_cast<std::size_t>(p);
            const auto l = layout(slices, tokens, dim, bits, pieces, group);
            const auto q = walk_codes(l, move, seed++, move == 1.0);
            vq::ContextCodedSize size;
            const auto b = vq::context_encode(q, l, &size, vq::RansKernel::Scalar);
            ASSERT_EQ(size.model + size.tables + size.payload, b.size());
            ASSERT_GE(size.classes, 1u);
            ASSERT_LE(size.classes, static_cast<std::size_t>((1 << bits) + 1));
            ASSERT_EQ(decode(b, l, vq::RansKernel::Scalar), q) << "bits " << bits << " dim " << dim << " tokens " << tokens;
            if (vq::rans_avx2_available()) {
              ASSERT_EQ(vq::context_encode(q, l, nullptr, vq::RansKernel::Avx2), b) << "bits " << bits << " dim " << dim << " tokens " << tokens;
              ASSERT_EQ(decode(b, l, vq::RansKernel::Avx2), q);
            }
          }
}

// Streams long enough for the AVX2 kernels' main loops and the bits-back tail, with single rows
// in the middle (group 9) and at the end (an odd last token).
TEST(ContextCoder, LongStreamsAreExactOnBothKernels) {
  unsigned seed = 100;
  for (int bits = 1; bits <= 4; ++bits)
    for (const auto& [pieces, group] : std::vector<std::pair<std::vector<std::int64_t>, int>>{{{1024}, 32}, {{333}, 9}, {{201}, 32}}) {
      const auto l = layout(2, static_cast<std::size_t>(pieces[0]), 64, bits, pieces, group);
      const auto q = walk_codes(l, 0.15, seed++);
      const auto b = vq::context_encode(q, l, nullptr, vq::RansKernel::Scalar);
      EXPECT_EQ(decode(b, l, vq::RansKernel::Scalar), q);
      if (!vq::rans_avx2_available()) continue;
      EXPECT_EQ(vq::context_encode(q, l, nullptr, vq::RansKernel::Avx2), b) << "bits " << bits << " group " << group;
      EXPECT_EQ(decode(b, l, vq::RansKernel::Avx2), q);
    }
}

TEST(ContextCoder, EmptyStreamsRoundTrip) {
  for (const auto& l : {layout(2, 0, 8, 4, {}, 32), layout(0, 5, 8, 4, {5}, 32), layout(1, 4, 0, 2, {4}, 2)}) {
    vq::ContextCodedSize size;
    const auto b = vq::context_encode(std::vector<std::uint8_t>{}, l, &size);
    EXPECT_EQ(size.classes, 1u);
    EXPECT_EQ(size.payload, 1u);  // the unit count 0
    EXPECT_TRUE(decode(b, l).empty());
    auto longer = b;
    longer.push_back(0);
    EXPECT_THROW(decode(longer, l), vq::FormatError);
    EXPECT_THROW(decode(std::vector<std::uint8_t>{}, l), vq::FormatError);
    EXPECT_THROW(decode(std::span(b).first(b.size() - 1), l), vq::FormatError);
  }
}

// The .vqkv container's use: one model for a whole side, one payload per chunk of whole groups,
// each coded and decoded by one encoder / decoder; the model survives serialisation.
TEST(ContextCoder, OneModelCodesManyPayloads) {
  const auto whole = layout(2, 96, 32, 4, {96}, 32);
  const auto q = walk_codes(whole, 0.2, 21);
  const vq::ContextModel model = vq::ContextModel::build(q, whole);
  std::vector<std::uint8_t> mb;
  model.serialize_to(mb);
  EXPECT_EQ(mb.size(), model.serialized_size());
  std::size_t used = 0;
  EXPECT_EQ(vq::ContextModel::deserialize(mb, 4, &used), model);
  EXPECT_EQ(used, mb.size());
  EXPECT_THROW(vq::ContextModel::deserialize(mb, 3), vq::FormatError);  // a 4-bit model read as 3-bit
  const vq::ContextEncoder enc(model);
  const vq::ContextDecoder dec(vq::ContextModel::deserialize(mb, 4));
  // Chunks of 64 and 32 tokens: per slice, a token range of the whole side's codes.
  for (const auto& [t0, n] : std::vector<std::pair<std::size_t, std::size_t>>{{0, 64}, {64, 32}}) {
    const auto l = layout(2, n, 32, 4, {static_cast<std::int64_t>(n)}, 32);
    std::vector<std::span<const std::uint8_t>> in;
    for (std::size_t s = 0; s < 2; ++s) in.push_back(std::span(q).subspan((s * 96 + t0) * 32, n * 32));
    std::vector<std::uint8_t> payload;
    enc.encode(vq::ContextSlices(in), l, payload);
    EXPECT_EQ(vq::context_payload_units(payload), vq::context_coded_units(l));
    std::vector<std::vector<std::uint8_t>> out(2, std::vector<std::uint8_t>(n * 32));
    std::vector<std::span<std::uint8_t>> outs{out[0], out[1]};
    dec.decode(payload, l, vq::ContextSlicesOut(outs));
    for (std::size_t s = 0; s < 2; ++s) EXPECT_TRUE(std::equal(out[s].begin(), out[s].end(), in[s].begin(), in[s].end()));
  }
}

// The derived pair tables: a valid 12-bit table per class, every pair the model can code present,
// each first code keeping 4x its frequency (when it has >= 4), and within 0.5 % of the model's
// own cost on the pairs it codes.
TEST(ContextCoder, PairTablesFollowTheModel) {
  const auto l = layout(4, 2048, 32, 4, {2048}, 32);
  const auto q = walk_codes(l, 0.1, 8);
  const vq::ContextModel m = vq::ContextModel::build(q, l);
  ASSERT_GE(m.classes(), 4);
  for (int k = 0; k < m.classes(); ++k) {
    const vq::FrequencyTable p = vq::pair_frequency_table(m, k);
    ASSERT_EQ(p.alphabet_size(), 256);
    ASSERT_EQ(p.scale_bits(), vq::kPairScaleBits);
    double model_bits = 0, pair_bits = 0;
    for (int a = 0; a < 16; ++a) {
      const auto& g = m.table(m.class_of(a));
      std::uint32_t row = 0;
      for (int b = 0; b < 16; ++b) {
        const std::uint32_t f = p.freq(a | b << 4);
        row += f;
        EXPECT_EQ(f > 0, m.table(k).freq(a) > 0 && g.freq(b) > 0) << "class " << k << " pair " << a << "," << b;
        const double pm = m.table(k).freq(a) / 1024.0 * g.freq(b) / 1024.0;
        if (pm > 0) model_bits -= pm * std::log2(pm), pair_bits -= pm * std::log2(f / 4096.0);
      }
      if (m.table(k).freq(a) >= 4) EXPECT_EQ(row, 4 * m.table(k).freq(a));
    }
    EXPECT_LT(pair_bits, model_bits * 1.005) << "class " << k;
  }
  EXPECT_THROW(vq::pair_frequency_table(m, m.classes()), vq::InvalidArgument);
}

// A model built from other codes may give a code frequency 0: the encoder refuses it (both
// kernels) instead of writing a stream that cannot decode.
TEST(ContextCoder, EncoderRefusesCodesItsModelCannotCode) {
  const auto l = layout(1, 64, 32, 4, {64}, 32);
  std::vector<std::uint8_t> q(l.size(), 3);
  const vq::ContextModel m = vq::ContextModel::build(q, l);  // only code 3 ever occurs
  q[40 * 32 + 5] = 9;
  std::vector<std::uint8_t> out;
  for (const auto k : {vq::RansKernel::Scalar, vq::RansKernel::Auto})
    EXPECT_THROW(vq::ContextEncoder(m, k).encode(q, l, out), vq::InvalidArgument);
  auto l3 = l;
  l3.bits = 3;
  EXPECT_THROW(vq::ContextEncoder(m).encode(q, l3, out), vq::InvalidArgument);  // the model is 4-bit
}

// The class count follows the data: iid codes have nothing to gain from contexts and end with one
// pooled table; slowly drifting codes keep several and code well below the pooled order-0 size.
TEST(ContextCoder, ClassesFollowTheData) {
  const auto l = layout(4, 2048, 32, 4, {2048}, 32);
  vq::ContextCodedSize iid, drift;
  const auto qi = walk_codes(l, 1.0, 7, /*iid=*/true);
  vq::context_encode(qi, l, &iid);
  EXPECT_EQ(iid.classes, 1u);
  // 16 equiprobable codes: 4 bits each; one table and the lane states on top.
  EXPECT_LT(static_cast<double>(iid.payload) * 8.0 / static_cast<double>(qi.size()), 4.01);
  const auto qd = walk_codes(l, 0.1, 8);
  vq::context_encode(qd, l, &drift);
  EXPECT_GE(drift.classes, 4u);
  // Pooled order-0 bound of the same codes (no tables counted): the contexts must beat it clearly.
  std::vector<double> h(16, 0.0);
  for (const auto v : qd) h[v] += 1.0;
  double order0 = 0.0;
  for (const double c : h)
    if (c > 0) order0 += c * std::log2(static_cast<double>(qd.size()) / c) / 8.0;
  EXPECT_LT(static_cast<double>(drift.model + drift.tables + drift.payload), 0.5 * order0);
}

TEST(ContextCoder, BadLayoutsAndCodesAreRefused) {
  const auto l = layout(1, 4, 2, 4, {4}, 2);
  const std::vector<std::uint8_t> q(8, 3);
  auto bad = l;
  bad.bits = 5;
  EXPECT_THROW(vq::context_encode(q, bad), vq::InvalidArgument);
  bad = l;
  bad.group_start.pop_back();
  EXPECT_THROW(vq::context_encode(q, bad), vq::InvalidArgument);
  bad = l;
  bad.group_start[0] = 0;
  EXPECT_THROW(vq::context_encode(q, bad), vq::InvalidArgument);
  EXPECT_THROW(vq::context_encode(std::vector<std::uint8_t>(7, 3), l), vq::InvalidArgument);
  auto big = q;
  big[5] = 16;
  EXPECT_THROW(vq::context_encode(big, l), vq::InvalidArgument);
  std::vector<std::uint8_t> out(7);
  EXPECT_THROW(vq::context_decode(vq::context_encode(q, l), l, out), vq::InvalidArgument);
}

// Every truncation and a trailing byte fail with FormatError; so do hand-broken headers. Every
// single-bit flip either fails with FormatError or decodes to some codes (there is no checksum at
// this level: the .vqkv container has them); it never crashes or reads out of bounds (ASan build).
TEST(ContextCoder, CorruptInputFailsClearly) {
  const auto l = layout(2, 70, 12, 4, {40, 30}, 16);
  const auto q = walk_codes(l, 0.3, 11);
  vq::ContextCodedSize size;
  const auto b = vq::context_encode(q, l, &size);
  ASSERT_GT(size.classes, 1u);
  for (std::size_t n = 0; n < b.size(); ++n)
    EXPECT_THROW(decode(std::span(b).first(n), l), vq::FormatError) << "cut at " << n;
  auto longer = b;
  longer.push_back(0);
  EXPECT_THROW(decode(longer, l), vq::FormatError);
  auto k0 = b;
  k0[0] = 0;
  EXPECT_THROW(decode(k0, l), vq::FormatError);
  auto k_big = b;
  k_big[0] = 18;
  EXPECT_THROW(decode(k_big, l), vq::FormatError);
  for (std::size_t i = 0; i < b.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      auto f = b;
      f[i] ^= static_cast<std::uint8_t>(1 << bit);
      try {
        (void)decode(f, l);
      } catch (const vq::FormatError&) {
      }
    }
  // A class map naming a class that does not exist (K = 3 needs 2 bits per context; 3 is invalid).
  const auto l2 = layout(1, 64, 4, 4, {64}, 64);
  const auto q2 = walk_codes(l2, 0.2, 12);
  vq::ContextCodedSize s2;
  auto b2 = vq::context_encode(q2, l2, &s2);
  if (s2.classes == 3) {
    b2[1] |= 0x03;
    EXPECT_THROW(decode(b2, l2), vq::FormatError);
  }
}

}  // namespace
