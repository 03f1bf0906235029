// Forward pass and generation on stories260K: the published greedy sample, chunking invariance,
// lossy caches, argument errors.
#include "veloxquant/model/transformer.hpp"

#include <cmath>
#include <cstring>
#include <limits>

#include <gtest/gtest.h>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/generate.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "model_support.hpp"

namespace {

struct Model {
  vq::Transformer transformer{vq::Checkpoint::load(vqtest::model_path())};
  vq::Tokenizer tokenizer = vq::Tokenizer::load(vqtest::tokenizer_path(), 512);
};

Model& model() {
  static Model m;
  return m;
}

// BOS + the first tokens of the validation text.
std::vector<int> validation_tokens(std::size_t n) {
  const std::string text = vqtest::read_file(vqtest::models_dir() + "/tinystories_val.txt").substr(0, 8 * n + 64);
  auto ids = model().tokenizer.encode(text, true, false);
  ids.resize(n);
  return ids;
}

// Perplexity of tokens[1..] given tokens, fed in chunks of `chunk` (0 = all at once).
double perplexity(const std::vector<int>& tokens, std::vector<std::shared_ptr<vq::KVCache>> caches, std::size_t chunk) {
  auto& t = model().transformer;
  const std::size_t V = 512;
  double nll = 0.0;
  std::size_t count = 0;
  if (chunk == 0) chunk = tokens.size();
  for (std::size_t s = 0; s < tokens.size(); s += chunk) {
    const std::size_t e = std::min(tokens.size(), s + chunk);
    const auto logits = t.forward(std::span<const int>(tokens.data() + s, e - s), caches);
    for (std::size_t i = s; i < e && i + 1 < tokens.size(); ++i) {
      const float* row = logits.data() + (i - s) * V;
      double mx = row[0];
      for (std::size_t j = 1; j < V; ++j) mx = std::max(mx, static_cast<double>(row[j]));
      double z = 0.0;
      for (std::size_t j = 0; j < V; ++j) z += std::exp(static_cast<double>(row[j]) - mx);
      nll += std::log(z) + mx - row[static_cast<std::size_t>(tokens[i + 1])];
      ++count;
    }
  }
  return std::exp(nll / static_cast<double>(count));
}

TEST(Transformer, DescriptionAndConfig) {
  const auto& t = model().transformer;
  EXPECT_EQ(t.config().n_layers, 5);
  const auto d = t.description();
  ASSERT_EQ(d.layer_head_dims.size(), 5u);
  for (const auto& h : d.layer_head_dims) EXPECT_EQ(h, 8);
  EXPECT_EQ(vq::make_fp32_caches(t).size(), 5u);
}

// run.c with its default 256 steps (BOS + 255 forwards... i.e. 256 positions) prints exactly the
// sample in stories260K.md; the text stops mid-story because of the step limit.
// topp = NaN fails every comparison: it neither disabled top-p nor cut anything, and generation
// printed only <unk>. Non-finite settings are refused when the sampler is made.
TEST(Sampler, RefusesNonFiniteSettings) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const float topp : {nan, inf, -inf}) {
    vq::SamplerConfig c;
    c.seed = 1;
    c.topp = topp;
    EXPECT_THROW(vq::Sampler(16, c), vq::InvalidArgument) << topp;
  }
  vq::SamplerConfig c;
  c.seed = 1;
  c.temperature = nan;
  EXPECT_THROW(vq::Sampler(16, c), vq::InvalidArgument);
  for (const float topp : {-2.0f, 0.0f, 0.5f, 1.0f, 7.0f}) {  // finite: every value has a meaning
    c.temperature = 1.0f;
    c.topp = topp;
    EXPECT_NO_THROW(vq::Sampler(16, c)) << topp;
  }
}

TEST(Transformer, GreedySampleMatchesLlama2c) {
  const std::string want = vqtest::expected_greedy_sample();
  ASSERT_GT(want.size(), 500u);
  ASSERT_EQ(want.substr(0, 53), "Once upon a time, there was a little girl named Lily.");
  auto caches = vq::make_fp32_caches(model().transformer);
  vq::GenerateConfig cfg;  // steps 256, temperature 0
  std::string streamed;
  const auto r = vq::generate(model().transformer, model().tokenizer, caches, "", cfg, [&](std::string_view p) { streamed += p; });
  EXPECT_EQ(r.text + "\n", want);
  EXPECT_EQ(streamed, r.text);
  EXPECT_EQ(r.tokens.size(), 257u);  // BOS + 256 generated
  EXPECT_EQ(caches[0]->offset(), 256);
  // One step fewer drops the last token.
  auto caches2 = vq::make_fp32_caches(model().transformer);
  cfg.steps = 255;
  const auto r2 = vq::generate(model().transformer, model().tokenizer, caches2, "", cfg);
  EXPECT_EQ(r2.tokens.size(), 256u);
  EXPECT_NE(r2.text + "\n", want);
  EXPECT_EQ(r.text.substr(0, r2.text.size()), r2.text);
}

TEST(Transformer, PromptIsPrefilledAndPrinted) {
  auto caches = vq::make_fp32_caches(model().transformer);
  vq::GenerateConfig cfg;
  cfg.steps = 40;
  const auto r = vq::generate(model().transformer, model().tokenizer, caches, "Once upon a time, there was a little girl", cfg);
  EXPECT_EQ(r.text.rfind("Once upon a time, there was a little girl named Lily.", 0), 0u) << r.text;
  EXPECT_EQ(static_cast<int>(r.tokens.size()), 41);
}

TEST(Transformer, ChunkingDoesNotChangePerplexity) {
  const auto toks = validation_tokens(256);
  const double one = perplexity(toks, vq::make_fp32_caches(model().transformer), 0);
  const double seven = perplexity(toks, vq::make_fp32_caches(model().transformer), 7);
  const double single = perplexity(toks, vq::make_fp32_caches(model().transformer), 1);
  EXPECT_NEAR(seven / one, 1.0, 1e-4);
  EXPECT_NEAR(single / one, 1.0, 1e-4);
  // The model card's validation loss is 1.2968 (perplexity ~3.66) over full 512-token windows.
  EXPECT_GT(one, 2.0);
  EXPECT_LT(one, 6.0);
}

TEST(Transformer, LossyCachesCostPerplexity) {
  const auto toks = validation_tokens(256);
  auto& t = model().transformer;
  const double fp32 = perplexity(toks, vq::make_fp32_caches(t), 0);
  const double fp16 = perplexity(toks, vq::make_caches("fp16", t), 0);
  EXPECT_NEAR(fp16 / fp32, 1.0, 2e-3);
  for (const char* spec : {"cachegen:bits=2,schedule=off", "cachegen:bits=2,flush=per_call,schedule=off", "cachegen:bits=4"}) {
    SCOPED_TRACE(spec);
    auto caches = vq::make_caches(spec, t);
    ASSERT_NE(dynamic_cast<vq::CacheGenKVCache*>(caches[0].get()), nullptr);
    const double q = perplexity(toks, caches, 16);
    EXPECT_TRUE(std::isfinite(q));
    EXPECT_GE(q, fp32 * (1.0 - 1e-3));
  }
}

// The forward pass attends through cache.attend for every method: each kind runs a prompt prefill
// and greedy decode, with finite logits, and a near-lossless cache keeps the fp32 text.
TEST(Transformer, EveryMethodDecodesThroughAttend) {
  auto& t = model().transformer;
  vq::GenerateConfig cfg;
  cfg.steps = 48;
  auto fp32 = vq::make_fp32_caches(t);
  const auto want = vq::generate(t, model().tokenizer, fp32, "Once upon a time", cfg);
  for (const char* spec : {"fp16", "fp8", "q8_0", "q4_0", "q4_1", "q4_0:rotate=1", "kivi:bits=2", "kivi:bits=4", "cachegen:bits=4",
                           "cachegen:bits=2,flush=per_call", "lmcache", "cachegen_paper", "vq:bits=2", "vq:bits=8"}) {
    SCOPED_TRACE(spec);
    auto caches = vq::make_caches(spec, t);
    const auto r = vq::generate(t, model().tokenizer, caches, "Once upon a time", cfg);
    EXPECT_EQ(r.text.rfind("Once upon a time", 0), 0u) << r.text;
    EXPECT_EQ(caches[0]->offset(), static_cast<std::int64_t>(r.tokens.size()) - (static_cast<int>(r.tokens.size()) > cfg.steps ? 1 : 0));
    const std::vector<int> next{r.tokens.back()};
    if (caches[0]->offset() < 512) {
      const auto logits = t.forward(next, caches);
      for (float x : logits) ASSERT_TRUE(std::isfinite(x));
    }
  }
  for (const char* spec : {"fp16", "q8_0", "vq:bits=8"}) {  // near-lossless: the same greedy text
    SCOPED_TRACE(spec);
    auto caches = vq::make_caches(spec, t);
    EXPECT_EQ(vq::generate(t, model().tokenizer, caches, "Once upon a time", cfg).text, want.text);
  }
}

TEST(Transformer, ForwardArgumentErrors) {
  auto& t = model().transformer;
  auto caches = vq::make_fp32_caches(t);
  const std::vector<int> bad{1, 512};
  EXPECT_THROW(t.forward(bad, caches), vq::InvalidArgument);
  EXPECT_EQ(caches[0]->offset(), 0);
  std::vector<std::shared_ptr<vq::KVCache>> four(caches.begin(), caches.begin() + 4);
  EXPECT_THROW(t.forward(std::vector<int>{1}, four), vq::InvalidArgument);
  const std::vector<int> too_long(513, 5);
  EXPECT_THROW(t.forward(too_long, caches), vq::InvalidArgument);
  caches[2]->update_and_fetch(vq::Tensor::zeros({1, 4, 1, 8}, vq::DType::F32), vq::Tensor::zeros({1, 4, 1, 8}, vq::DType::F32));
  EXPECT_THROW(t.forward(std::vector<int>{1}, caches), vq::InvalidArgument);  // offsets disagree
  EXPECT_TRUE(t.forward(std::vector<int>{}, four = vq::make_fp32_caches(t)).empty());
}

// forward(tokens, caches, logits_from) returns forward()'s rows from logits_from on, bit for bit,
// and leaves the caches as forward() does (rd's prefill asks for none or the last row only).
TEST(Transformer, LogitsFromReturnsTheSameRows) {
  auto& t = model().transformer;
  const std::vector<int> tokens = validation_tokens(40);
  const std::span<const int> first(tokens.data(), 24), rest(tokens.data() + 24, 16);
  auto all = vq::make_fp32_caches(t);
  const auto a1 = t.forward(first, all), a2 = t.forward(rest, all);
  for (const int from : {0, 23, 24}) {
    SCOPED_TRACE(from);
    auto caches = vq::make_fp32_caches(t);
    const auto b1 = t.forward(first, caches, from);
    ASSERT_EQ(b1.size(), static_cast<std::size_t>(24 - from) * 512);
    if (!b1.empty())  // from = 24 asks for no rows: memcmp must not see the empty vector's null data()
      EXPECT_EQ(std::memcmp(b1.data(), a1.data() + static_cast<std::size_t>(from) * 512, b1.size() * sizeof(float)), 0);
    const auto b2 = t.forward(rest, caches);  // the cache went on as before
    ASSERT_EQ(b2.size(), a2.size());
    EXPECT_EQ(std::memcmp(b2.data(), a2.data(), a2.size() * sizeof(float)), 0);
  }
  auto caches = vq::make_fp32_caches(t);
  EXPECT_THROW(t.forward(first, caches, 25), vq::InvalidArgument);
  EXPECT_THROW(t.forward(first, caches, -1), vq::InvalidArgument);
  EXPECT_EQ(caches[0]->offset(), 0);
}

// The vq layer models are built once per model and shared by every vq cache set made from it (and
// from its copies); what they hold is what a fresh build gives.
TEST(Transformer, VqLayerModelsAreBuiltOnce) {
  auto& t = model().transformer;
  const vq::VqBasisOptions basis;
  const auto a = t.vq_layer_model(2, basis);
  EXPECT_EQ(t.vq_layer_model(2, basis), a);
  EXPECT_EQ(vq::Transformer(t).vq_layer_model(2, basis), a);
  vq::VqBasisOptions hadamard;
  hadamard.basis = vq::VqBasis::Hadamard;
  EXPECT_NE(t.vq_layer_model(2, hadamard), a);
  EXPECT_NE(t.vq_layer_model(3, basis), a);
  const vq::Transformer fresh(vq::Checkpoint::load(vqtest::model_path()));
  const auto b = fresh.vq_layer_model(2, basis);
  ASSERT_NE(b, a);
  EXPECT_EQ(b->k.fwd, a->k.fwd);
  EXPECT_EQ(b->v.inv, a->v.inv);
  EXPECT_EQ(b->source, a->source);
  EXPECT_THROW((void)t.vq_layer_model(5, basis), vq::InvalidArgument);
}

}  // namespace
