// The peer methods as the model and the harness see them: spec strings, caches per layer, and a
// smoke evaluation on stories260K.
#include <cmath>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/eval/evaluator.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/peers/fp8_cache.hpp"
#include "veloxquant/peers/ggml_block_cache.hpp"
#include "veloxquant/peers/kivi_cache.hpp"
#include "../model/model_support.hpp"

namespace {

using vq::MethodSpec;


TEST(PeerMethodSpecs, Parse) {
  EXPECT_EQ(MethodSpec::parse("q8_0").kind, MethodSpec::Kind::Q8_0);
  EXPECT_EQ(MethodSpec::parse("q4_0").kind, MethodSpec::Kind::Q4_0);
  EXPECT_EQ(MethodSpec::parse("q4_1").kind, MethodSpec::Kind::Q4_1);
  EXPECT_EQ(MethodSpec::parse("fp8").kind, MethodSpec::Kind::Fp8);
  EXPECT_EQ(MethodSpec::parse("kivi").to_string(), "kivi:bits=2,group=32,residual=128");
  const auto m = MethodSpec::parse("kivi:bits=4,group=16,residual=32");
  EXPECT_EQ(m.kind, MethodSpec::Kind::Kivi);
  EXPECT_EQ(m.kivi.bits, 4);
  EXPECT_EQ(m.kivi.group, 16);
  EXPECT_EQ(m.kivi.residual, 32);
  EXPECT_EQ(MethodSpec::parse(m.to_string()).to_string(), m.to_string());
  for (const char* s : {"q8_0", "q4_0", "q4_1", "fp8", "q8_0:rotate=1", "q4_0:rotate=1", "q4_1:rotate=1"})
    EXPECT_EQ(MethodSpec::parse(s).to_string(), s);
  EXPECT_TRUE(MethodSpec::parse("q4_0:rotate=1").rotate);
  EXPECT_EQ(MethodSpec::parse("q4_0:rotate=0").to_string(), "q4_0");
}

TEST(PeerMethodSpecs, ErrorsNameTheProblem) {
  const std::string unknown = vqtest::spec_error("kivi:bits=2,colour=blue");
  EXPECT_NE(unknown.find("unknown key 'colour' for kivi; valid keys are bits, group, residual"), std::string::npos) << unknown;
  EXPECT_NE(vqtest::spec_error("kivi:bits=3").find("bits=2 or bits=4"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("kivi:residual=100").find("multiple of group=32"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("kivi:group=x").find("group=x is not an integer"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("kivi:bits").find("key=value"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("q4_0:bits=4").find("unknown key 'bits' for q4_0; valid keys are rotate"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("q8_0:rotate=2").find("rotate=2 is not valid; use rotate=1 or rotate=0"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("fp8:scale=token").find("takes no options"), std::string::npos);
  const std::string unknown_method = vqtest::spec_error("q5_0");
  EXPECT_NE(unknown_method.find("kivi[:bits=2|4,group=G,residual=R], q8_0[:rotate=0|1], q4_0[:rotate=0|1], q4_1[:rotate=0|1], fp8"), std::string::npos) << unknown_method;
}

TEST(PeerMethodSpecs, MakeCachesPerLayer) {
  const vq::Transformer t(vq::Checkpoint::load(vqtest::model_path()));
  EXPECT_EQ(vq::make_caches("q8_0", t)[0]->kind(), "GgmlBlockCache<q8_0>");
  EXPECT_EQ(vq::make_caches("q4_0", t)[1]->kind(), "GgmlBlockCache<q4_0>");
  EXPECT_EQ(vq::make_caches("q4_1", t)[2]->kind(), "GgmlBlockCache<q4_1>");
  EXPECT_EQ(vq::make_caches("fp8", t)[3]->kind(), "Fp8KVCache");
  EXPECT_EQ(vq::make_caches("q4_0:rotate=1", t)[1]->kind(), "GgmlBlockCache<q4_0:rotate=1>");
  for (const char* spec : {"q8_0", "q4_0", "q4_1", "q4_0:rotate=1", "fp8", "kivi"}) {  // an empty state empties the cache
    auto c = vq::make_caches(spec, t)[0];
    c->update_and_fetch(vq::Tensor::zeros({1, 4, 3, 8}, vq::DType::F32), vq::Tensor::zeros({1, 4, 3, 8}, vq::DType::F32));
    c->from_state(vq::KVState{});
    EXPECT_EQ(c->offset(), 0) << spec;
    EXPECT_EQ(c->stored_bytes().fixed_bytes, 0.0) << spec;
  }
  auto kivi = vq::make_caches("kivi:bits=4,residual=64", t);
  ASSERT_EQ(kivi.size(), 5u);
  EXPECT_EQ(dynamic_cast<vq::KiviKVCache&>(*kivi[4]).config().residual, 64);
}

TEST(PeerMethodSpecs, CacheBitsUseStoredBytes) {
  const vq::Transformer t(vq::Checkpoint::load(vqtest::model_path()));
  const vq::Tensor x = vq::Tensor::zeros({1, 4, 32, 8}, vq::DType::F32);  // stories260K's layout
  auto bits_of = [&](const std::string& spec) {
    auto caches = vq::make_caches(spec, t);
    for (auto& c : caches) c->update_and_fetch(x, x);
    return vq::cache_bits(caches).fixed_bits();
  };
  EXPECT_DOUBLE_EQ(bits_of("fp32"), 32.0);
  EXPECT_DOUBLE_EQ(bits_of("fp16"), 16.0);
  EXPECT_DOUBLE_EQ(bits_of("q8_0"), 34.0 * 8 / 32);
  EXPECT_DOUBLE_EQ(bits_of("q4_1"), 20.0 * 8 / 32);
  EXPECT_DOUBLE_EQ(bits_of("q4_0"), 18.0 * 8 / 32);
  EXPECT_DOUBLE_EQ(bits_of("fp8"), 8.0 + 4.0 * 8 * 4 / (4 * 32 * 8));  // 4 heads' scales over 4*32*8 elements
  // kivi, residual 32: keys all quantized (2 bits + 32 bits of scale/zero per 32 tokens); values all residual (16)
  EXPECT_DOUBLE_EQ(bits_of("kivi:bits=2,group=32,residual=32"), ((2.0 + 1.0) + 16.0) / 2);
}

std::vector<int> validation_tokens(std::size_t bytes) {
  const auto tok = vq::Tokenizer::load(vqtest::tokenizer_path(), 512);
  std::string text = vqtest::read_file(vqtest::models_dir() + "/tinystories_val.txt");
  text.resize(bytes);
  return tok.encode(text, false);
}

TEST(PeerMethods, EvalSmokeOnStories260K) {
  vq::Transformer model(vq::Checkpoint::load(vqtest::model_path()));
  const auto tokens = validation_tokens(20000);
  vq::EvalOptions o;
  o.protocol = vq::EvalProtocol::Reuse;
  o.window = 384;
  o.ctx = 256;
  o.chunk = 64;
  o.max_tokens = 512;
  const std::vector<std::string> methods{"fp32", "q8_0", "q4_1", "q4_0", "kivi:bits=4", "kivi:bits=2", "fp8"};
  const auto r = vq::evaluate(model, tokens, methods, o);
  ASSERT_EQ(r.size(), methods.size());
  const double ppl32 = r[0].ppl;
  for (const auto& m : r) {
    EXPECT_TRUE(std::isfinite(m.ppl)) << m.method;
    EXPECT_GE(m.ppl, ppl32 * 0.995) << m.method;  // no method beats exact by more than noise
    EXPECT_LT(m.ppl, ppl32 * 3.0) << m.method;
    EXPECT_TRUE(std::isfinite(m.kl) && m.kl >= 0) << m.method;
  }
  auto bits = [&](std::size_t i) { return r[i].bits_per_element_fixed; };
  EXPECT_DOUBLE_EQ(bits(1), 8.5);
  EXPECT_DOUBLE_EQ(bits(2), 5.0);
  EXPECT_DOUBLE_EQ(bits(3), 4.5);
  EXPECT_GT(bits(4), bits(5));
  EXPECT_LT(bits(6), 8.1);
  // more bits, less damage (KL), within each family
  EXPECT_LT(r[1].kl, r[2].kl);
  EXPECT_LT(r[4].kl, r[5].kl);
}

}  // namespace
