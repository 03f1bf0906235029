// Checkpoint loader: the real stories260K, corrupted copies, and the version-1 layout.
#include "veloxquant/model/checkpoint.hpp"

#include <cstdint>
#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/model/transformer.hpp"
#include "../support/test_util.hpp"
#include "model_support.hpp"

namespace {

using vq::Checkpoint;
using vq::FormatError;

template <typename T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}
void put_floats(std::string& s, const std::vector<float>& v) {
  s.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// Writers following llama2.c export.py, independent of the loader.
std::string write_legacy(const Checkpoint& ck) {
  const auto& c = ck.config;
  std::string s;
  for (int v : {c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.shared_classifier ? c.vocab_size : -c.vocab_size, c.seq_len})
    put<std::int32_t>(s, v);
  for (const auto* w : {&ck.token_embedding, &ck.rms_att, &ck.wq, &ck.wk, &ck.wv, &ck.wo, &ck.rms_ffn, &ck.w1, &ck.w2, &ck.w3, &ck.rms_final})
    put_floats(s, *w);
  // freq_cis_real and _imag: any values, the loader recomputes RoPE.
  put_floats(s, std::vector<float>(static_cast<std::size_t>(c.seq_len * c.head_size() / 2) * 2, 0.5f));
  if (!c.shared_classifier) put_floats(s, ck.wcls);
  return s;
}

std::string write_version1(const Checkpoint& ck) {
  const auto& c = ck.config;
  std::string s;
  put<std::uint32_t>(s, 0x616b3432u);
  put<std::int32_t>(s, 1);
  for (int v : {c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.seq_len}) put<std::int32_t>(s, v);
  put<std::uint8_t>(s, c.shared_classifier ? 1 : 0);
  s.resize(256, '\0');
  for (const auto* w : {&ck.rms_att, &ck.rms_ffn, &ck.rms_final, &ck.token_embedding, &ck.wq, &ck.wk, &ck.wv, &ck.wo, &ck.w1, &ck.w2, &ck.w3})
    put_floats(s, *w);
  if (!c.shared_classifier) put_floats(s, ck.wcls);
  return s;
}

Checkpoint random_model(bool shared, std::uint64_t seed) {
  Checkpoint ck;
  ck.config = vq::ModelConfig{16, 24, 2, 4, 2, 40, 32, shared};
  const auto& c = ck.config;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  auto rnd = [&](std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = nd(rng);
    return v;
  };
  const std::size_t L = 2, d = 16, kv = static_cast<std::size_t>(c.kv_dim()), h = 24, V = 40;
  ck.token_embedding = rnd(V * d);
  ck.rms_att = rnd(L * d);
  ck.wq = rnd(L * d * d);
  ck.wk = rnd(L * kv * d);
  ck.wv = rnd(L * kv * d);
  ck.wo = rnd(L * d * d);
  ck.rms_ffn = rnd(L * d);
  ck.w1 = rnd(L * h * d);
  ck.w2 = rnd(L * d * h);
  ck.w3 = rnd(L * h * d);
  ck.rms_final = rnd(d);
  if (!shared) ck.wcls = rnd(V * d);
  return ck;
}

void expect_same_weights(const Checkpoint& a, const Checkpoint& b) {
  EXPECT_EQ(a.config, b.config);
  EXPECT_EQ(a.token_embedding, b.token_embedding);
  EXPECT_EQ(a.rms_att, b.rms_att);
  EXPECT_EQ(a.wq, b.wq);
  EXPECT_EQ(a.wk, b.wk);
  EXPECT_EQ(a.wv, b.wv);
  EXPECT_EQ(a.wo, b.wo);
  EXPECT_EQ(a.rms_ffn, b.rms_ffn);
  EXPECT_EQ(a.w1, b.w1);
  EXPECT_EQ(a.w2, b.w2);
  EXPECT_EQ(a.w3, b.w3);
  EXPECT_EQ(a.rms_final, b.rms_final);
  EXPECT_EQ(a.wcls, b.wcls);
}

std::vector<float> logits_of(const Checkpoint& ck) {
  vq::Transformer t(ck);
  auto caches = vq::make_fp32_caches(t);
  const std::vector<int> toks{1, 5, 17, 39, 0, 22, 3};
  return t.forward(toks, caches);
}

// The message of the FormatError that parsing `bytes` throws ("" when none).
std::string format_error(const std::string& bytes) {
  try {
    Checkpoint::parse(std::as_bytes(std::span(bytes.data(), bytes.size())), "model.bin");
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

TEST(Checkpoint, LoadsStories260K) {
  const Checkpoint ck = Checkpoint::load(vqtest::model_path());
  EXPECT_EQ(ck.config, (vq::ModelConfig{64, 172, 5, 8, 4, 512, 512, true}));
  EXPECT_EQ(ck.layout, vq::CheckpointLayout::Legacy);
  EXPECT_EQ(ck.config.head_size(), 8);
  EXPECT_EQ(ck.config.kv_dim(), 32);
  EXPECT_EQ(ck.token_embedding.size(), 512u * 64u);
  EXPECT_EQ(ck.wk.size(), 5u * 32u * 64u);
  EXPECT_EQ(ck.w2.size(), 5u * 64u * 172u);
  EXPECT_TRUE(ck.wcls.empty());
  EXPECT_EQ(ck.classifier(), ck.token_embedding.data());
  // RMSNorm weights of a trained model are O(1) and positive-ish; a misaligned read would not be.
  for (float w : ck.rms_final) EXPECT_TRUE(std::isfinite(w) && std::fabs(w) < 20.0f);
}

TEST(Checkpoint, MissingFileIsIoError) { EXPECT_THROW(Checkpoint::load(vqtest::temp_dir() + "/nope.bin"), vq::IoError); }

TEST(Checkpoint, TruncatedCopiesAreFormatErrors) {
  const std::string full = vqtest::read_file(vqtest::model_path());
  ASSERT_EQ(full.size(), 1056540u);
  for (std::size_t n : {std::size_t{0}, std::size_t{3}, std::size_t{27}, std::size_t{28}, std::size_t{1000}, full.size() / 2, full.size() - 1}) {
    const std::string path = vqtest::temp_dir() + "/trunc.bin";
    vqtest::write_file(path, full.substr(0, n));
    try {
      Checkpoint::load(path);
      ADD_FAILURE() << "no error for " << n << " bytes";
    } catch (const FormatError& e) {
      const std::string msg = e.what();
      EXPECT_TRUE(msg.find("truncated") != std::string::npos || msg.find("too short") != std::string::npos) << msg;
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
    }
  }
  EXPECT_NE(format_error(full + "xyzw").find("longer than expected"), std::string::npos);
}

TEST(Checkpoint, InconsistentHeadersAreFormatErrors) {
  const std::string full = vqtest::read_file(vqtest::model_path());
  auto with = [&](int field, std::int32_t value) {
    std::string s = full;
    std::memcpy(s.data() + 4 * field, &value, 4);
    return format_error(s);
  };
  EXPECT_NE(with(4, 3).find("n_kv_heads must divide n_heads"), std::string::npos);
  EXPECT_NE(with(4, 16).find("n_kv_heads must be in 1..n_heads"), std::string::npos);
  EXPECT_NE(with(0, -64).find("dim must be"), std::string::npos);
  EXPECT_NE(with(0, 1 << 30).find("dim must be"), std::string::npos);
  EXPECT_NE(with(2, 1 << 30).find("n_layers must be"), std::string::npos);
  EXPECT_NE(with(3, 5).find("multiple of n_heads"), std::string::npos);
  EXPECT_NE(with(3, 64).find("even"), std::string::npos);
  EXPECT_NE(with(5, 0).find("vocab_size"), std::string::npos);
  EXPECT_NE(with(5, INT32_MIN).find("vocab_size"), std::string::npos);
  EXPECT_NE(with(6, 0).find("seq_len"), std::string::npos);
  // Consistent but different dims: the size check catches it.
  EXPECT_NE(with(1, 173).find("implies"), std::string::npos);
  // A negative vocab_size claims a separate classifier the file does not hold.
  EXPECT_NE(with(5, -512).find("truncated"), std::string::npos);
}

TEST(Checkpoint, Version1AndLegacyLoadIdentically) {
  for (bool shared : {true, false}) {
    SCOPED_TRACE(shared ? "shared classifier" : "separate classifier");
    const Checkpoint ref = random_model(shared, shared ? 7 : 8);
    const std::string leg = vqtest::temp_dir() + "/leg.bin", v1 = vqtest::temp_dir() + "/v1.bin";
    vqtest::write_file(leg, write_legacy(ref));
    vqtest::write_file(v1, write_version1(ref));
    const Checkpoint a = Checkpoint::load(leg), b = Checkpoint::load(v1);
    EXPECT_EQ(a.layout, vq::CheckpointLayout::Legacy);
    EXPECT_EQ(b.layout, vq::CheckpointLayout::Version1);
    expect_same_weights(a, ref);
    expect_same_weights(b, ref);
    const auto la = logits_of(a), lb = logits_of(b);
    ASSERT_EQ(la.size(), 7u * 40u);
    EXPECT_EQ(la, lb);
    for (float x : la) ASSERT_TRUE(std::isfinite(x));
  }
}

TEST(Checkpoint, Version1Errors) {
  const std::string good = write_version1(random_model(false, 3));
  EXPECT_EQ(format_error(good), "");
  EXPECT_NE(format_error(good.substr(0, good.size() - 4)).find("truncated"), std::string::npos);
  EXPECT_NE(format_error(good.substr(0, 100)).find("too short"), std::string::npos);
  std::string v2 = good;
  v2[4] = 2;
  EXPECT_NE(format_error(v2).find("version 2 is not supported"), std::string::npos);
  std::string flag = good;
  flag[36] = 7;
  EXPECT_NE(format_error(flag).find("shared_classifier"), std::string::npos);
  std::string shared = good;  // claims shared: the file is then longer than expected
  shared[36] = 1;
  EXPECT_NE(format_error(shared).find("longer than expected"), std::string::npos);
}

}  // namespace
