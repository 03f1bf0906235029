// lmcache and cachegen_paper as the model, the harness and the CLI see them: spec strings, caches
// per layer (depth handed to each cache), the profile made on the fly or by `veloxquant profile`,
// and a smoke evaluation on stories260K.
#include <cmath>
#include <filesystem>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/eval/evaluator.hpp"
#include "veloxquant/model/cachegen_profile.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/peers/cachegen_paper_cache.hpp"
#include "veloxquant/peers/lmcache_cache.hpp"
#include "../model/model_support.hpp"
#include "../support/test_util.hpp"

namespace {

using vq::MethodSpec;

TEST(CachegenFamilySpecs, ParseAndPrint) {
  const auto l = MethodSpec::parse("lmcache");
  EXPECT_EQ(l.kind, MethodSpec::Kind::Lmcache);
  EXPECT_EQ(l.to_string(), "lmcache:chunk=256,schedule=scaled");
  EXPECT_EQ(MethodSpec::parse("lmcache:chunk=64,schedule=native").to_string(), "lmcache:chunk=64,schedule=native");
  const auto p = MethodSpec::parse("cachegen_paper");
  EXPECT_EQ(p.kind, MethodSpec::Kind::CachegenPaper);
  EXPECT_EQ(p.to_string(), "cachegen_paper:bin1=0.5,bin2=1,bin3=1.5,group=10,chunk=1500,profile_tokens=4096");
  const auto q = MethodSpec::parse("cachegen_paper:bin1=0.125,bin2=0.25,bin3=0.375,group=5,chunk=20,profile=/tmp/x.prof");
  EXPECT_EQ(q.cachegen_paper.bins[0], 0.125);
  EXPECT_EQ(q.cachegen_paper.group, 5);
  EXPECT_EQ(q.cachegen_paper.profile, "/tmp/x.prof");
  EXPECT_EQ(MethodSpec::parse(q.to_string()).to_string(), q.to_string());
  EXPECT_EQ(vq::split_method_list("lmcache:chunk=64,schedule=native;cachegen_paper:bin1=0.25,bin2=0.5").size(), 2u);
}

TEST(CachegenFamilySpecs, ErrorsNameTheProblem) {
  EXPECT_NE(vqtest::spec_error("lmcache:bins=8").find("unknown key 'bins' for lmcache; valid keys are chunk, schedule"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("lmcache:chunk=0").find("chunk=0 must be in 1..65536"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("lmcache:schedule=linear").find("use schedule=scaled or schedule=native"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen_paper:bin2=x").find("bin2=x is not a number"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen_paper:bin3=2").find("bin3: bin size 2 must be in [0.01, 2)"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen_paper:chunk=25").find("multiple of group=10"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen_paper:profile=").find("profile= needs a path"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen_paper:anchor=4").find("valid keys are bin1, bin2, bin3, group, chunk, profile, profile_tokens"),
            std::string::npos);
  EXPECT_NE(vqtest::spec_error("lmcash").find("lmcache[:chunk=N,schedule=scaled|native]"), std::string::npos);
}

TEST(CachegenFamilyMethods, CachesKnowTheirDepth) {
  const vq::Transformer t(vq::Checkpoint::load(vqtest::model_path()));
  const auto l = vq::make_caches("lmcache", t);
  ASSERT_EQ(l.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(dynamic_cast<vq::LmcacheKVCache&>(*l[static_cast<std::size_t>(i)]).bins().key, i < 2 ? 32 : 16);
  EXPECT_EQ(dynamic_cast<vq::LmcacheKVCache&>(*l[1]).bins().value, 16);
  // Without profile=, the profile is made on the fly from the model's own samples, once per process.
  const auto p = vq::make_caches("cachegen_paper:profile_tokens=600", t);
  ASSERT_EQ(p.size(), 5u);
  const float want[] = {0.5f, 0.5f, 1.0f, 1.0f, 1.5f};
  for (int i = 0; i < 5; ++i) {
    auto& c = dynamic_cast<vq::CachegenPaperKVCache&>(*p[static_cast<std::size_t>(i)]);
    EXPECT_EQ(c.bin(), want[i]);
    EXPECT_EQ(c.layer(), i);
  }
  // Without a model there is nothing to profile: a profile file is required.
  EXPECT_THROW(vq::make_caches(MethodSpec::parse("cachegen_paper"), vq::ModelDescription::uniform(5, 8)), vq::InvalidArgument);
  EXPECT_EQ(vq::make_caches(MethodSpec::parse("lmcache"), vq::ModelDescription::uniform(3, 8)).size(), 3u);
  // Layers without attention do not count towards the depth.
  vq::ModelDescription mixed;
  mixed.layer_head_dims = {8, std::nullopt, 8};
  const auto m = vq::make_caches(MethodSpec::parse("lmcache:schedule=scaled"), mixed);
  EXPECT_EQ(m[1]->kind(), "KVCache");
  EXPECT_EQ(dynamic_cast<vq::LmcacheKVCache&>(*m[0]).bins().key, 32);
  EXPECT_EQ(dynamic_cast<vq::LmcacheKVCache&>(*m[2]).bins().key, 16);  // attention layer 1 of 2: 32 * 1 >= 10 * 2
}

TEST(CachegenFamilyMethods, ProfileCliFileIsUsedBySpecs) {
  const std::string out = vqtest::temp_dir() + "/cli.prof";
  const auto r = vqtest::run_cli("profile --model " + vqtest::model_path() + " --tokens 1000 --skip 100 -o " + out);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("profiled 1000 text tokens in 4 windows"), std::string::npos) << r.out;
  const auto prof = vq::CachegenPaperProfile::load(out);
  EXPECT_EQ(prof.n_layers(), 5);
  EXPECT_EQ(prof.tokens, 1004u);  // positions, a BOS per window included
  EXPECT_EQ(prof.layers[0][0].channels, 32);
  const vq::Transformer t(vq::Checkpoint::load(vqtest::model_path()));
  const auto caches = vq::make_caches("cachegen_paper:profile=" + out, t);
  EXPECT_EQ(caches[4]->kind(), "CachegenPaperKVCache");
  // A profile made for other bins is refused with the reason; a bad file is one line, nonzero.
  EXPECT_THROW(vq::make_caches("cachegen_paper:bin1=0.25,profile=" + out, t), vq::InvalidArgument);
  EXPECT_THROW(vq::make_caches("cachegen_paper:profile=" + out + ".missing", t), vq::IoError);
  const auto bad = vqtest::run_cli("profile --model " + vqtest::model_path() + " --method lmcache -o " + out);
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("--method must be a cachegen_paper spec"), std::string::npos) << bad.err;
}

TEST(CachegenFamilyMethods, EvalSmokeOnStories260K) {
  vq::Transformer model(vq::Checkpoint::load(vqtest::model_path()));
  const auto tok = vq::Tokenizer::load(vqtest::tokenizer_path(), 512);
  std::string text = vqtest::read_file(vqtest::models_dir() + "/tinystories_val.txt");
  text.resize(20000);
  const auto tokens = tok.encode(text, false);
  vq::EvalOptions o;
  o.protocol = vq::EvalProtocol::Reuse;
  o.window = 384;
  o.ctx = 256;
  o.max_tokens = 256;
  const std::vector<std::string> methods{"fp32", "lmcache", "lmcache:schedule=native", "cachegen_paper:profile_tokens=600",
                                         "cachegen_paper:bin1=0.0625,bin2=0.125,bin3=0.1875,profile_tokens=600"};
  const auto r = vq::evaluate(model, tokens, methods, o);
  ASSERT_EQ(r.size(), methods.size());
  for (const auto& m : r) {
    EXPECT_TRUE(std::isfinite(m.ppl) && std::isfinite(m.kl)) << m.method;
    EXPECT_GE(m.ppl, r[0].ppl * 0.99) << m.method;
  }
  // native (32 bins everywhere below 10 layers) spends more and loses less than scaled.
  EXPECT_GT(r[2].bits_per_element_estimated, r[1].bits_per_element_estimated);
  EXPECT_LT(r[2].kl, r[1].kl);
  // Finer delta bins: more bits, less damage. Coded sizes are below the fixed widths.
  EXPECT_GT(r[4].bits_per_element_estimated, r[3].bits_per_element_estimated);
  EXPECT_LT(r[4].kl, r[3].kl);
  for (std::size_t i = 1; i < r.size(); ++i) EXPECT_LT(r[i].bits_per_element_estimated, r[i].bits_per_element_fixed) << r[i].method;
}

}  // namespace
