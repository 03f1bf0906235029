// vq profiles (vq/profile.hpp): fitting recovers the axes of the data (with RoPE undone), the file
// round-trips bit for bit and refuses every kind of damage, and a profile is refused for another
// model or shape, and needed to decode what it coded.
#include "veloxquant/vq/profile.hpp"

#include <cmath>
#include <filesystem>
#include <random>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/random_checkpoint.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/prefix_chunks.hpp"
#include "veloxquant/vq/vq_cache.hpp"
#include "../support/test_util.hpp"

namespace {

using vq::Tensor;

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

// A random orthonormal D x D matrix (Gram-Schmidt of Gaussian rows), row i = axis i.
std::vector<double> random_axes(int d, std::mt19937& rng) {
  std::normal_distribution<double> nd;
  std::vector<double> a(sz(d) * sz(d));
  for (int i = 0; i < d; ++i) {
    double* r = a.data() + sz(i) * sz(d);
    for (int c = 0; c < d; ++c) r[c] = nd(rng);
    for (int j = 0; j < i; ++j) {
      const double* q = a.data() + sz(j) * sz(d);
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += r[c] * q[c];
      for (int c = 0; c < d; ++c) r[c] -= dot * q[c];
    }
    double norm = 0;
    for (int c = 0; c < d; ++c) norm += r[c] * r[c];
    for (int c = 0; c < d; ++c) r[c] /= std::sqrt(norm);
  }
  return a;
}

// Tokens x = sum_i sigma_i z_i axis_i (+ mean), per head, then (rope) rotated at positions pos0 + t
// as llama rotates adjacent pairs: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), angle pos * theta^(-2p/D).
Tensor make_tokens(const std::vector<double>& axes, int heads, int d, int tokens, bool rope, std::int64_t pos0, std::mt19937& rng) {
  std::normal_distribution<double> nd;
  std::vector<float> out(sz(heads) * sz(tokens) * sz(d));
  for (int h = 0; h < heads; ++h)
    for (int t = 0; t < tokens; ++t) {
      std::vector<double> x(sz(d), 0.5);  // a mean the fit must remove
      for (int i = 0; i < d; ++i) {
        const double c = nd(rng) * std::pow(0.6, i);  // distinct variances, decreasing
        for (int j = 0; j < d; ++j) x[sz(j)] += c * axes[sz(i) * sz(d) + sz(j)];
      }
      if (rope)
        for (int p = 0; p < d / 2; ++p) {
          const double a = static_cast<double>(pos0 + t) * std::pow(10000.0, -2.0 * p / d);
          const double x0 = x[sz(2 * p)], x1 = x[sz(2 * p + 1)];
          x[sz(2 * p)] = x0 * std::cos(a) - x1 * std::sin(a);
          x[sz(2 * p + 1)] = x0 * std::sin(a) + x1 * std::cos(a);
        }
      for (int j = 0; j < d; ++j) out[(sz(h) * sz(tokens) + sz(t)) * sz(d) + sz(j)] = static_cast<float>(x[sz(j)]);
    }
  return Tensor::from_f32({1, heads, tokens, d}, out);
}

// |axis i of the profile . true axis i|, worst over the first `n` axes of head 0's K block.
double worst_alignment(const vq::VqProfile& p, const std::vector<double>& truth, int n) {
  const int d = p.head_dim, B = p.block;
  double worst = 1;
  for (int i = 0; i < n; ++i) {
    double dot = 0;
    for (int c = 0; c < d; ++c) dot += p.k_axes[0][sz(i) * sz(B) + sz(c)] * truth[sz(i) * sz(d) + sz(c)];
    worst = std::min(worst, std::fabs(dot));
  }
  return worst;
}

vq::VqProfile fitted(int layers, int heads, int d, bool rope, std::uint32_t seed, std::vector<double>* truth = nullptr) {
  std::mt19937 rng(seed);
  const std::vector<double> axes = random_axes(d, rng);
  if (truth) *truth = axes;
  vq::VqProfileBuilder b(layers, heads, d, rope, 10000.0);
  for (int l = 0; l < layers; ++l)
    for (int w = 0; w < 4; ++w)
      b.add(l, make_tokens(axes, heads, d, 512, rope, 7 + w * 512, rng), make_tokens(axes, heads, d, 512, false, 0, rng), 7 + w * 512);
  return b.finish(0xabcdefu);
}

TEST(VqProfile, FittingRecoversTheAxesWithRopeUndone) {
  for (const bool rope : {false, true}) {
    std::vector<double> truth;
    // One head of 8: a whole-row block, so the recovered axes are head 0's own.
    const vq::VqProfile p = fitted(1, 1, 8, rope, 3, &truth);
    EXPECT_EQ(p.block, 8);
    EXPECT_EQ(p.tokens, 2048u);
    EXPECT_GT(worst_alignment(p, truth, 4), 0.99) << "rope " << rope;
  }
  // Without undoing RoPE the rotated keys' axes are smeared: the fit must undo it to find them.
  std::mt19937 rng(3);
  const std::vector<double> axes = random_axes(8, rng);
  vq::VqProfileBuilder wrong(1, 1, 8, /*rope=*/false, 10000.0);
  for (int w = 0; w < 4; ++w) wrong.add(0, make_tokens(axes, 1, 8, 512, true, 7 + w * 512, rng), make_tokens(axes, 1, 8, 512, false, 0, rng));
  EXPECT_LT(worst_alignment(wrong.finish(1), axes, 4), 0.9);
}

TEST(VqProfile, RowsUpTo256ValuesAreOneBlockWiderRowsOnePerHead) {
  EXPECT_EQ(fitted(1, 4, 64, false, 5).block, 256);
  EXPECT_EQ(fitted(1, 3, 128, false, 5).block, 128);
}

TEST(VqProfile, TheFileRoundTripsBitForBit) {
  vq::VqProfile p = fitted(2, 2, 8, true, 9);
  const std::vector<std::uint8_t> bytes = vq::write_vq_profile(p);
  const vq::VqProfile q = vq::read_vq_profile(bytes);
  EXPECT_EQ(q.hash, p.hash);
  EXPECT_EQ(q.model_fingerprint, 0xabcdefu);
  EXPECT_EQ(q.layers, 2);
  EXPECT_EQ(q.kv_heads, 2);
  EXPECT_EQ(q.head_dim, 8);
  EXPECT_TRUE(q.rope);
  EXPECT_EQ(q.k_axes, p.k_axes);
  EXPECT_EQ(q.v_axes, p.v_axes);
  vq::VqProfile again = q;
  EXPECT_EQ(vq::write_vq_profile(again), bytes);
}

TEST(VqProfile, DamageIsOneFormatErrorNamingTheFile) {
  vq::VqProfile p = fitted(1, 2, 8, false, 11);
  const std::vector<std::uint8_t> good = vq::write_vq_profile(p);
  const auto refused = [](std::vector<std::uint8_t> b, const char* says) {
    try {
      (void)vq::read_vq_profile(b, "x.vqprof");
      ADD_FAILURE() << "accepted: " << says;
    } catch (const vq::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("x.vqprof: vq profile: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused({}, "too short");
  refused(std::vector<std::uint8_t>(good.begin(), good.end() - 1), "truncated");
  auto longer = good;
  longer.push_back(0);
  refused(longer, "trailing");
  auto flipped = good;
  flipped[100] ^= 0x10;
  refused(flipped, "checksum");
  auto magic = good;
  magic[0] = 'X';
  refused(magic, "magic");
  auto version = good;
  version[8] = 9;
  refused(version, "version 9");
  auto huge = good;
  huge[24] = huge[25] = 0xff;  // layers 65535: out of range before anything is allocated
  refused(huge, "out of range");
  // Axes that are not orthonormal (a checksum that matches: written by a buggy writer).
  vq::VqProfile bad = p;
  bad.k_axes[0][0] *= 2;
  refused(vq::write_vq_profile(bad), "not orthonormal");
}

TEST(VqProfile, TheCommittedFuzzSeedsAreValid) {
  int valid = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(VQ_SOURCE_DIR) / "fuzz/corpus/fuzz_vq_profile"))
    if (e.path().filename().string().rfind("valid_", 0) == 0) {
      const auto bytes = vq::read_file_bytes(e.path().string());
      EXPECT_NO_THROW((void)vq::read_vq_profile(bytes, e.path().string()));
      ++valid;
    }
  EXPECT_EQ(valid, 3);
}

TEST(VqProfile, AnotherModelOrShapeIsRefused) {
  vq::VqProfile p = fitted(2, 2, 8, true, 13);
  const std::filesystem::path dir = vqtest::temp_dir();
  const std::string path = (dir / "p.vqprof").string();
  vq::save_vq_profile(path, p);
  EXPECT_NO_THROW(vq::check_vq_profile_model(p, path, 0xabcdefu, "m.gguf"));
  EXPECT_THROW(vq::check_vq_profile_model(p, path, 0xabcdeeu, "m.gguf"), vq::InvalidArgument);
  // Through a spec: layers and head size are checked against the model; with a Transformer read
  // from a file, its file fingerprint too.
  const std::string spec = "vq:bits=2,profile=" + path;
  EXPECT_NO_THROW((void)vq::make_caches(vq::MethodSpec::parse(spec), vq::ModelDescription::uniform(2, 8)));
  EXPECT_THROW((void)vq::make_caches(vq::MethodSpec::parse(spec), vq::ModelDescription::uniform(3, 8)), vq::InvalidArgument);
  EXPECT_THROW((void)vq::make_caches(vq::MethodSpec::parse(spec), vq::ModelDescription::uniform(2, 16)), vq::InvalidArgument);
  vq::ModelConfig c{.dim = 32, .hidden_dim = 64, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .vocab_size = 32, .seq_len = 64};
  vq::Checkpoint ck = vq::random_checkpoint(c, 1);
  ck.file_fingerprint = 0xabcdefu;
  EXPECT_NO_THROW((void)vq::make_caches(spec, vq::Transformer(ck)));
  ck.file_fingerprint = 0x1111u;
  try {
    (void)vq::make_caches(spec, vq::Transformer(ck));
    ADD_FAILURE() << "a profile of another model file was used";
  } catch (const vq::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("calibrated on another model"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)vq::MethodSpec::parse("vq:profile="), vq::InvalidArgument);
}

// A store names a profile level by the profile's hash: two hosts holding the same profile at
// different paths name the same level (and share its chunks), and no path reaches the store.
TEST(VqProfile, AStoreLevelNamesItsProfileByHashNotPath) {
  vq::VqProfile p = fitted(2, 2, 8, true, 23);
  const std::filesystem::path dir = vqtest::temp_dir();
  const std::string a = (dir / "a.vqprof").string(), b = (dir / "copy-b.vqprof").string();
  vq::save_vq_profile(a, p);
  vq::save_vq_profile(b, p);
  const std::string la = vq::store_level("vq:bits=2,profile=" + a), lb = vq::store_level("vq:bits=2,profile=" + b);
  EXPECT_EQ(la, lb);
  EXPECT_EQ(la.find(dir.string()), std::string::npos) << la;
  EXPECT_NE(la.find(fmt::format("profile=xxh64:{:016x}", p.hash)), std::string::npos) << la;
  EXPECT_EQ(vq::parse_levels("vq:bits=2,profile=" + a), (std::vector<std::string>{la, "fp32"}));
  EXPECT_EQ(vq::store_level(la), la);  // a store level is its own store level
  // The name makes the same caches as the path (what a put of that level stores).
  auto by_path = vq::make_caches(vq::MethodSpec::parse("vq:bits=2,calib=16,profile=" + a), vq::ModelDescription::uniform(2, 8));
  std::mt19937 rng(3);
  const std::vector<double> axes = random_axes(8, rng);
  const vq::Tensor k = make_tokens(axes, 2, 8, 40, true, 0, rng), v = make_tokens(axes, 2, 8, 40, false, 0, rng);
  (void)by_path[0]->update_and_fetch(k, v);
  auto named = vq::make_caches(vq::MethodSpec::parse(vq::store_level("vq:bits=2,calib=16,profile=" + a)), vq::ModelDescription::uniform(2, 8));
  (void)named[0]->update_and_fetch(k, v);
  EXPECT_TRUE(by_path[0]->state().keys.bit_equal(named[0]->state().keys));
  EXPECT_TRUE(by_path[0]->state().values.bit_equal(named[0]->state().values));
  // A name this process never gave is refused in one line, not read as a file.
  try {
    (void)vq::load_vq_profile("xxh64:0123456789abcdef");
    ADD_FAILURE() << "an unknown profile name was accepted";
  } catch (const vq::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("give profile=PATH"), std::string::npos) << e.what();
  }
}

TEST(VqProfile, ASavedCacheNeedsItsProfileToLoad) {
  vq::VqProfile p = fitted(2, 2, 8, true, 17);
  const std::filesystem::path dir = vqtest::temp_dir();
  const std::string path = (dir / "p.vqprof").string();
  vq::save_vq_profile(path, p);
  auto caches = vq::make_caches(vq::MethodSpec::parse("vq:bits=2,calib=16,profile=" + path), vq::ModelDescription::uniform(2, 8));
  std::mt19937 rng(2);
  std::vector<double> axes = random_axes(8, rng);
  for (auto& c : caches) (void)c->update_and_fetch(make_tokens(axes, 2, 8, 40, true, 0, rng), make_tokens(axes, 2, 8, 40, false, 0, rng));
  const auto bytes = vq::serialize_prompt_cache(caches);
  vq::VqkvLoadOptions with;
  with.vq_models = vq::vq_profile_models({vq::load_vq_profile(path)});
  const vq::PromptCache back = vq::deserialize_prompt_cache(bytes, with);
  for (std::size_t l = 0; l < caches.size(); ++l) {
    const vq::KVState a = caches[l]->state(), b = back.caches[l]->state();
    EXPECT_EQ(a.keys.to_f32_vector(), b.keys.to_f32_vector());
    EXPECT_EQ(a.values.to_f32_vector(), b.values.to_f32_vector());
  }
  EXPECT_THROW((void)vq::deserialize_prompt_cache(bytes), vq::FormatError);  // no profile: refused, never decoded with another basis
  vq::VqProfile other = fitted(2, 2, 8, true, 19);
  vq::VqkvLoadOptions wrong;
  wrong.vq_models = vq::vq_profile_models({std::make_shared<const vq::VqProfile>(vq::read_vq_profile(vq::write_vq_profile(other)))});
  EXPECT_THROW((void)vq::deserialize_prompt_cache(bytes, wrong), vq::FormatError);
}

}  // namespace
