// `vq` layers in .vqkv files: loaded caches fetch bit for bit what the saved ones did (codes, exact
// residual tokens, calibration) and keep working identically; a layer built from a model needs that
// model and refuses another's fingerprint; broken vq layers are clear FormatErrors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>

#include <fmt/format.h>

#include "../model/model_support.hpp"
#include "../support/test_util.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/vq_layer_models.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/vq/vq_cache.hpp"
#include "vqkv_test_util.hpp"

namespace {

using Caches = std::vector<std::shared_ptr<vq::KVCache>>;

void feed(vq::KVCache& c, const vq::Tensor& k, const vq::Tensor& v, std::int64_t from, std::int64_t to, std::int64_t chunk) {
  const std::int64_t step = chunk > 0 ? chunk : std::max<std::int64_t>(to - from, 1);
  for (std::int64_t s = from; s < to; s += step) c.update_and_fetch(k.slice(2, s, std::min(to, s + step)), v.slice(2, s, std::min(to, s + step)));
}

// Same class, offset, fetched bits, codes, calibration and coded bytes.
void expect_same_vq(const vq::KVCache& a, const vq::KVCache& b, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(a.kind(), b.kind());
  ASSERT_EQ(a.offset(), b.offset());
  if (a.offset() > 0) {
    EXPECT_TRUE(a.state().keys.bit_equal(b.state().keys));
    EXPECT_TRUE(a.state().values.bit_equal(b.state().values));
  }
  const auto* va = dynamic_cast<const vq::VqKVCache*>(&a);
  const auto* vb = dynamic_cast<const vq::VqKVCache*>(&b);
  ASSERT_TRUE(va && vb);
  EXPECT_EQ(va->quantized_tokens(), vb->quantized_tokens());
  EXPECT_EQ(va->stored_bytes().fixed_bytes, vb->stored_bytes().fixed_bytes);
  if (va->quantized_tokens() > 0) {
    EXPECT_EQ(va->encode(), vb->encode());
  }
}

vq::VqConfig vq_cfg(double bits, int calib, int residual) {
  vq::VqConfig c;
  c.bits = bits;
  c.calib = calib;
  c.residual = residual;
  return c;
}

TEST(VqkvVq, RoundTripWithoutModelIsExactAndTheLoadedCacheKeepsWorking) {
  struct Case {
    vq::Shape4 shape;  // [B, H, tokens, D_k]
    int dv;
    vq::DType dtype;
    double bits;
    int calib, residual;
    std::int64_t chunk, chunk_tokens;
  };
  const std::vector<Case> cases = {
      {{1, 2, 100, 8}, 8, vq::DType::F32, 2.0, 16, 0, 0, 2048},
      {{1, 2, 100, 8}, 8, vq::DType::F32, 2.0, 16, 5, 7, 13},      // exact window, chunked calls, small file chunks
      {{2, 3, 61, 4}, 6, vq::DType::F16, 0.5, 20, 3, 9, 16},       // B > 1, D_v != D_k, float16
      {{1, 1, 70, 16}, 16, vq::DType::BF16, 9.5, 8, 0, 0, 64},     // high rate: split codes
      {{1, 2, 10, 8}, 8, vq::DType::F32, 2.0, 16, 0, 0, 2048},     // not calibrated yet: every token exact
      {{1, 2, 1, 8}, 8, vq::DType::F32, 2.0, 1, 0, 0, 2048},       // one token, quantized
  };
  for (const Case& c : cases) {
    const std::string what = fmt::format("{} dv={} {} bits={} calib={} residual={} chunk={} file_chunk={}", vq::shape_string(c.shape), c.dv,
                                         vq::dtype_name(c.dtype), c.bits, c.calib, c.residual, c.chunk, c.chunk_tokens);
    const std::int64_t T = c.shape[2], more = 23;
    vq::Shape4 ks = c.shape, vs = c.shape;
    ks[2] = vs[2] = T + more;
    vs[3] = c.dv;
    const auto k = vqtest::random_walk(ks, 11, c.dtype), v = vqtest::random_walk(vs, 12, c.dtype);
    auto saved = std::make_shared<vq::VqKVCache>(vq_cfg(c.bits, c.calib, c.residual));
    feed(*saved, k, v, 0, T, c.chunk);
    Caches caches = {saved, std::make_shared<vq::KVCache>()};
    caches[1]->update_and_fetch(k.slice(2, 0, T), v.slice(2, 0, T));
    const auto bytes = vq::serialize_prompt_cache(caches, {{"m", "x"}}, {.chunk_tokens = c.chunk_tokens});
    vq::PromptCache loaded = vq::deserialize_prompt_cache(bytes);
    ASSERT_EQ(loaded.caches.size(), 2u);
    expect_same_vq(*saved, *loaded.caches[0], what + " loaded");
    EXPECT_EQ(dynamic_cast<const vq::VqKVCache&>(*loaded.caches[0]).config().residual, c.residual);
    EXPECT_EQ(vq::serialize_prompt_cache(loaded.caches, loaded.metadata, {.chunk_tokens = c.chunk_tokens}), bytes) << what;
    // The inspect breakdown names the class and sums to the file size.
    const vq::VqkvInfo info = vq::inspect_prompt_cache(bytes);
    EXPECT_EQ(info.layers[0].kind, "VqKVCache");
    ASSERT_TRUE(info.layers[0].vq.has_value());
    EXPECT_FALSE(info.layers[0].vq_model.has_value());
    EXPECT_EQ(info.layers[0].quantized_keys, saved->quantized_tokens());
    vq::VqkvBytes sum = info.file;
    for (const auto& l : info.layers) sum.add(l.keys), sum.add(l.values);
    EXPECT_EQ(sum.total(), bytes.size());
    // More tokens, then a trim: both caches stay identical.
    auto& again = *loaded.caches[0];
    feed(*saved, k, v, T, T + more, 5);
    feed(again, k, v, T, T + more, 5);
    expect_same_vq(*saved, again, what + " after more tokens");
    saved->trim(9);
    again.trim(9);
    expect_same_vq(*saved, again, what + " after trim");
    // A prefix load is the saved cache trimmed (here, of the file saved before the extra tokens).
    for (const std::int64_t p : {std::int64_t{0}, std::int64_t{1}, T / 2, T - 1}) {
      if (p < 0 || p > T) continue;
      auto ref = std::make_shared<vq::VqKVCache>(vq_cfg(c.bits, c.calib, c.residual));
      feed(*ref, k, v, 0, T, c.chunk);
      ref->trim(T - p);
      const vq::PromptCache pre = vq::deserialize_prompt_cache(bytes, {.max_tokens = p});
      expect_same_vq(*ref, *pre.caches[0], what + fmt::format(" prefix {}", p));
    }
  }
}

TEST(VqkvVq, EmptyVqLayerRoundTrips) {
  Caches caches = {std::make_shared<vq::VqKVCache>(vq_cfg(2, 4, 1)), std::make_shared<vq::KVCache>()};
  caches[1]->update_and_fetch(vqtest::random_walk({1, 1, 5, 4}, 1), vqtest::random_walk({1, 1, 5, 4}, 2));
  const auto bytes = vq::serialize_prompt_cache(caches);
  const vq::PromptCache pc = vq::deserialize_prompt_cache(bytes);
  ASSERT_EQ(pc.caches[0]->kind(), "VqKVCache");
  EXPECT_EQ(pc.caches[0]->offset(), 0);
  EXPECT_EQ(dynamic_cast<const vq::VqKVCache&>(*pc.caches[0]).config().calib, 4);
}

// A small vq file whose bytes this build must write exactly and read back exactly (a change that
// alters them is a new format version). Regenerate only on a deliberate format change:
//   VQ_WRITE_GOLDEN=1 ./build/tests/vq_tests --gtest_filter='VqkvVq.GoldenFile*'
TEST(VqkvVq, GoldenFileIsWrittenAndReadExactly) {
  const std::string path = std::string(VQ_SOURCE_DIR) + "/tests/golden/valid_v2_vq.vqkv";
  const auto k = vqtest::random_walk({1, 2, 20, 4}, 101, vq::DType::F16), v = vqtest::random_walk({1, 2, 20, 4}, 102, vq::DType::F16);
  auto live = std::make_shared<vq::VqKVCache>(vq_cfg(3, 8, 3));
  for (int s = 0; s < 20; s += 5) live->update_and_fetch(k.slice(2, s, s + 5), v.slice(2, s, s + 5));
  const auto bytes = vq::serialize_prompt_cache({live}, {{"golden", "v2 vq"}}, {.chunk_tokens = 8});
  if (std::getenv("VQ_WRITE_GOLDEN")) vqtest::spit(path, std::string(bytes.begin(), bytes.end()));
  const std::string stored = vqtest::slurp(path);
  EXPECT_EQ(std::vector<std::uint8_t>(stored.begin(), stored.end()), bytes) << "the writer's bytes changed: a new format version?";
  const vq::PromptCache pc = vq::deserialize_prompt_cache(std::vector<std::uint8_t>(stored.begin(), stored.end()));
  expect_same_vq(*live, *pc.caches[0], "golden");
}

// The same file as written before vq layer version 3 (its layers are version 2 streams: 12-bit
// tables), before version 4 (version 3 streams: one table precision per side), before version 5
// (version 4 streams: no prediction across tokens) and before version 6 (version 5 streams: the
// same bytes but the version, as these streams are short), kept as written then: each still loads
// to the same cache.
TEST(VqkvVq, GoldenFileWithVersionTwoLayersStillLoads) {
  for (const char* file : {"valid_v2_vq_layer_v2.vqkv", "valid_v2_vq_layer_v3.vqkv", "valid_v2_vq_layer_v4.vqkv",
                           "valid_v2_vq_layer_v5.vqkv"}) {
  SCOPED_TRACE(file);
  const std::string path = std::string(VQ_SOURCE_DIR) + "/tests/golden/" + file;
  const auto k = vqtest::random_walk({1, 2, 20, 4}, 101, vq::DType::F16), v = vqtest::random_walk({1, 2, 20, 4}, 102, vq::DType::F16);
  auto live = std::make_shared<vq::VqKVCache>(vq_cfg(3, 8, 3));
  for (int s = 0; s < 20; s += 5) live->update_and_fetch(k.slice(2, s, s + 5), v.slice(2, s, s + 5));
  const std::string stored = vqtest::slurp(path);
  ASSERT_FALSE(stored.empty()) << path;
  const auto bytes = std::vector<std::uint8_t>(stored.begin(), stored.end());
  EXPECT_NE(vq::serialize_prompt_cache({live}, {{"golden", "v2 vq"}}, {.chunk_tokens = 8}), bytes);  // now written as version 6
  expect_same_vq(*live, *vq::deserialize_prompt_cache(bytes).caches[0], file);
  }
}

// ---- layers built from stories260K's weights ----

struct ModelFile {
  std::shared_ptr<const vq::Checkpoint> ck;
  std::vector<std::uint8_t> bytes;
  Caches caches;
};

// vq caches of stories260K after a prefill of `n` tokens (in chunks of 7), saved.
ModelFile model_file(const std::string& spec, int n, std::vector<int>& tokens) {
  ModelFile f;
  f.ck = std::make_shared<const vq::Checkpoint>(vq::Checkpoint::load(vqtest::model_path()));
  vq::Transformer model(*f.ck);
  f.caches = vq::make_caches(spec, model);
  std::mt19937 rng(3);
  tokens.clear();
  for (int i = 0; i < n + 20; ++i) tokens.push_back(1 + static_cast<int>(rng() % 500));
  for (int s = 0; s < n; s += 7) model.forward(std::span<const int>(tokens).subspan(s, std::min(7, n - s)), f.caches);
  f.bytes = vq::serialize_prompt_cache(f.caches, {}, {.chunk_tokens = 32});
  return f;
}

std::string load_error(const std::vector<std::uint8_t>& bytes, const vq::VqkvLoadOptions& o) {
  try {
    (void)vq::deserialize_prompt_cache(bytes, o);
  } catch (const vq::FormatError& e) {
    return e.what();
  }
  return "";
}

TEST(VqkvVq, ModelLayersLoadWithTheirModelAndContinueIdentically) {
  std::vector<int> tokens;
  ModelFile f = model_file("vq:bits=2,calib=16,residual=4", 70, tokens);
  const std::uint64_t fp = vq::vq_model_fingerprint(*f.ck);
  const vq::VqkvInfo info = vq::inspect_prompt_cache(f.bytes);  // inspect needs no model
  for (std::size_t l = 0; l < info.layers.size(); ++l) {
    ASSERT_TRUE(info.layers[l].vq_model.has_value());
    EXPECT_EQ(info.layers[l].vq_model->fingerprint, fp);
    EXPECT_EQ(info.layers[l].vq_model->layer, static_cast<int>(l));
  }
  // Without a model: refused, naming the fingerprint.
  const std::string none = load_error(f.bytes, {});
  EXPECT_NE(none.find(fmt::format("{:016x}", fp)), std::string::npos) << none;
  EXPECT_EQ(none.find('\n'), std::string::npos);
  // With it: the same caches, and the same after more tokens through the model.
  vq::PromptCache pc = vq::deserialize_prompt_cache(f.bytes, {.vq_models = vq::vq_layer_models(f.ck)});
  ASSERT_EQ(pc.caches.size(), f.caches.size());
  for (std::size_t l = 0; l < pc.caches.size(); ++l) expect_same_vq(*f.caches[l], *pc.caches[l], fmt::format("layer {}", l));
  vq::Transformer model(*f.ck);
  const auto more = std::span<const int>(tokens).subspan(70, 11);
  const auto logits_saved = model.forward(more, f.caches);
  const auto logits_loaded = model.forward(more, pc.caches);
  EXPECT_EQ(logits_saved, logits_loaded);
  for (std::size_t l = 0; l < pc.caches.size(); ++l) expect_same_vq(*f.caches[l], *pc.caches[l], fmt::format("layer {} after more", l));
  EXPECT_EQ(vq::serialize_prompt_cache(pc.caches, {}, {.chunk_tokens = 32}), vq::serialize_prompt_cache(f.caches, {}, {.chunk_tokens = 32}));
}

TEST(VqkvVq, AnotherModelsFingerprintIsRefused) {
  std::vector<int> tokens;
  ModelFile f = model_file("vq:bits=2,calib=16", 40, tokens);
  vq::Checkpoint other = *f.ck;
  other.wv[5] += 1e-3f;  // one weight the transforms read
  const auto other_ck = std::make_shared<const vq::Checkpoint>(std::move(other));
  ASSERT_NE(vq::vq_model_fingerprint(*other_ck), vq::vq_model_fingerprint(*f.ck));
  const std::string err = load_error(f.bytes, {.vq_models = vq::vq_layer_models(other_ck)});
  EXPECT_NE(err.find("fingerprint"), std::string::npos) << err;
  EXPECT_NE(err.find(fmt::format("{:016x}", vq::vq_model_fingerprint(*f.ck))), std::string::npos) << err;
  EXPECT_EQ(err.find('\n'), std::string::npos);
  // Weights the transforms do not read leave the fingerprint alone.
  vq::Checkpoint ffn = *f.ck;
  ffn.w1[0] += 1.0f;
  EXPECT_EQ(vq::vq_model_fingerprint(ffn), vq::vq_model_fingerprint(*f.ck));
  // A source that returns a model for another layer is refused too.
  const auto right = vq::vq_layer_models(f.ck);
  const vq::VqLayerModelSource wrong_layer = [&](const vq::VqModelSource& w) {
    vq::VqModelSource o = w;
    o.layer = (w.layer + 1) % f.ck->config.n_layers;
    return right(o);
  };
  EXPECT_NE(load_error(f.bytes, {.vq_models = wrong_layer}), "");
}

TEST(VqkvVq, TruncatedAndCorruptVqLayersFailCleanly) {
  const auto k = vqtest::random_walk({1, 2, 60, 8}, 21), v = vqtest::random_walk({1, 2, 60, 8}, 22);
  auto c = std::make_shared<vq::VqKVCache>(vq_cfg(2, 8, 3));
  c->update_and_fetch(k, v);
  const auto good = vq::serialize_prompt_cache({c}, {}, {.chunk_tokens = 25});
  for (std::size_t n = 0; n < good.size(); ++n) {
    const std::vector<std::uint8_t> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW((void)vq::deserialize_prompt_cache(cut), vq::FormatError) << "cut at " << n;
  }
  for (std::size_t i = 0; i < good.size(); ++i) {
    auto b = good;
    b[i] ^= static_cast<std::uint8_t>(1u << (i % 8));
    EXPECT_THROW((void)vq::deserialize_prompt_cache(b), vq::FormatError) << "flip at " << i;
  }
  // Behind valid checksums, in the vq CODES blocks: a FormatError or a loadable cache, never a crash.
  const auto blocks = vqtest::block_offsets(good);
  ASSERT_GE(blocks.size(), 4u);  // 3 CODES, 2 ROWS, END
  std::mt19937 rng(5);
  int errors = 0;
  for (int trial = 0; trial < 300; ++trial) {
    auto b = good;
    const std::size_t at = blocks[rng() % 3];
    const std::size_t body = static_cast<std::size_t>(vqtest::rd64(b, at + 24));
    b[at + 32 + rng() % body] ^= static_cast<std::uint8_t>(1 + rng() % 255);
    vqtest::fix_checksums(b);
    try {
      (void)vq::deserialize_prompt_cache(b);
    } catch (const vq::FormatError& e) {
      ++errors;
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
  }
  EXPECT_GT(errors, 100);
}

}  // namespace
