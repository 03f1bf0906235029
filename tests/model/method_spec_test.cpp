// Method specs and the caches they build; default model file lookup.
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/cache/fp16_cache.hpp"

#include <cstdlib>

#include <gtest/gtest.h>

#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/transformer.hpp"
#include "model_support.hpp"

namespace {

using vq::MethodSpec;


TEST(MethodSpec, ParsesAndPrintsCanonically) {
  EXPECT_EQ(MethodSpec::parse("fp32").kind, MethodSpec::Kind::Fp32);
  EXPECT_EQ(MethodSpec::parse("fp16").kind, MethodSpec::Kind::Fp16);
  EXPECT_EQ(MethodSpec::parse("cachegen").to_string(), "cachegen:bits=4,group=32,flush=group_aligned,delta=1,schedule=on");
  const auto m = MethodSpec::parse("cachegen:bits=2,group=16,flush=per_call,delta=0,schedule=off");
  EXPECT_EQ(m.cachegen.cachegen_bits, 2);
  EXPECT_EQ(m.cachegen.cachegen_group_size, 16);
  EXPECT_EQ(m.cachegen.cachegen_flush, vq::FlushMode::PerCall);
  EXPECT_FALSE(m.cachegen.cachegen_use_delta);
  EXPECT_FALSE(m.schedule);
  EXPECT_EQ(MethodSpec::parse(m.to_string()).to_string(), m.to_string());
}

TEST(MethodSpec, ErrorsNameTheProblem) {
  const std::string unknown_key = vqtest::spec_error("cachegen:bits=4,colour=blue");
  EXPECT_NE(unknown_key.find("unknown key 'colour'"), std::string::npos) << unknown_key;
  EXPECT_NE(unknown_key.find("bits, group, flush, delta, schedule"), std::string::npos) << unknown_key;
  EXPECT_NE(vqtest::spec_error("int8").find("valid methods are fp32, fp16, cachegen"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("fp32:bits=4").find("takes no options"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen:bits=four").find("bits=four is not an integer"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen:bits=9").find("cachegen:bits=9"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen:flush=sometimes").find("flush=per_call or flush=group_aligned"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen:delta=yes").find("delta=1 or delta=0"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen:schedule=1").find("schedule=on or schedule=off"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen:bits").find("key=value"), std::string::npos);
  EXPECT_NE(vqtest::spec_error("cachegen:").find("key=value"), std::string::npos);
}

TEST(MethodSpec, MakesOneCachePerLayer) {
  const vq::Transformer t(vq::Checkpoint::load(vqtest::model_path()));
  EXPECT_EQ(vq::make_caches("fp32", t)[0]->kind(), "KVCache");
  EXPECT_EQ(vq::make_caches("fp16", t)[4]->kind(), "Fp16KVCache");
  auto fixed = vq::make_caches("cachegen:bits=3,schedule=off", t);
  ASSERT_EQ(fixed.size(), 5u);
  for (auto& c : fixed) EXPECT_EQ(dynamic_cast<vq::CacheGenKVCache&>(*c).config().effective_bits(), 3);
  auto sched = vq::make_caches("cachegen:bits=4", t);
  ASSERT_EQ(sched.size(), 5u);
  EXPECT_EQ(dynamic_cast<vq::CacheGenKVCache&>(*sched.front()).config().effective_bits(), 4);
  EXPECT_LT(dynamic_cast<vq::CacheGenKVCache&>(*sched.back()).config().effective_bits(), 4);
}

TEST(MethodSpec, Fp16CacheRoundsToHalf) {
  vq::Fp16KVCache c;
  const std::vector<float> v{1.0f + 1.0f / 4096.0f, 3.14159265f};  // both lose bits in float16
  auto [k, vv] = c.update_and_fetch(vq::Tensor::from_f32({1, 1, 1, 2}, v), vq::Tensor::from_f32({1, 1, 1, 2}, v));
  EXPECT_EQ(k.dtype(), vq::DType::F32);
  EXPECT_EQ(k.at(0, 0, 0, 0), 1.0f);
  EXPECT_EQ(vv.at(0, 0, 0, 1), vq::f16_to_f32(vq::f32_to_f16(3.14159265f)));
}

TEST(ModelFiles, LooksInEnvironmentDirectoryAndExplainsFailure) {
  const char* old = std::getenv("VELOXQUANT_MODEL_DIR");
  const std::string saved = old ? old : "";
  setenv("VELOXQUANT_MODEL_DIR", vqtest::models_dir().c_str(), 1);
  const auto found = vq::find_default_model();
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->filename(), "stories260K.bin");
  EXPECT_EQ(vq::resolve_model_files(std::nullopt, std::nullopt).tokenizer.filename(), "tok512.bin");
  EXPECT_EQ(vq::resolve_model_files(std::filesystem::path("x.bin"), std::nullopt).model, "x.bin");
  setenv("VELOXQUANT_MODEL_DIR", "/nonexistent-dir", 1);
  if (!vq::find_default_model()) {  // ./models and ../shared/models (from the test's cwd) hold nothing
    try {
      vq::resolve_model_files(std::nullopt, std::nullopt);
      ADD_FAILURE();
    } catch (const vq::IoError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("karpathy/tinyllamas"), std::string::npos) << msg;
      EXPECT_NE(msg.find("VELOXQUANT_MODEL_DIR"), std::string::npos) << msg;
      EXPECT_NE(msg.find("/nonexistent-dir"), std::string::npos) << msg;
    }
  }
  if (old) setenv("VELOXQUANT_MODEL_DIR", saved.c_str(), 1); else unsetenv("VELOXQUANT_MODEL_DIR");
}

}  // namespace

// Issue 36's messages: a 100 KB spec is named by its start, not echoed whole.
TEST(MethodSpec, ARunawaySpecIsNotEchoedWhole) {
  const std::string spec = "vq:bits=2," + std::string(100000, 'x');
  try {
    vq::MethodSpec::parse(spec);
    ADD_FAILURE() << "parsed";
  } catch (const vq::InvalidArgument& e) {
    EXPECT_LT(std::string(e.what()).size(), 200u) << e.what();
    EXPECT_NE(std::string(e.what()).find("100010 bytes"), std::string::npos) << e.what();
  }
}
