// `veloxquant compress --method vq:... / decompress / inspect`: vq layers from .npy input (no model)
// and from the model (decompress needs the same model, and refuses another's fingerprint).
#include <algorithm>
#include <filesystem>
#include <string>

#include <fmt/format.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../model/model_support.hpp"
#include "../support/test_util.hpp"
#include "veloxquant/core/npy.hpp"
#include "veloxquant/format/safetensors.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/vq_layer_models.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace {

std::string p(const std::string& name) { return vqtest::temp_dir() + "/vqkv_vq_cli_" + name; }
vqtest::CliRun run(const std::string& args) { return vqtest::run_cli(args); }

TEST(VqkvVqCli, NpyRoundTripEqualsTheLiveCache) {
  const auto k = vqtest::random_walk({1, 4, 150, 16}, 1, vq::DType::F16), v = vqtest::random_walk({1, 4, 150, 16}, 2, vq::DType::F16);
  vq::write_npy(p("k.npy"), k);
  vq::write_npy(p("v.npy"), v);
  auto r = run("compress --keys " + p("k.npy") + " --values " + p("v.npy") + " --method vq:bits=2,calib=32,residual=5 --chunk 40 -o " +
               p("a.vqkv") + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out).at("bytes").get<std::uint64_t>(), std::filesystem::file_size(p("a.vqkv")));
  r = run("decompress " + p("a.vqkv") + " --keys-out " + p("k2.npy") + " --values-out " + p("v2.npy"));
  ASSERT_EQ(r.code, 0) << r.err;
  vq::VqConfig cfg;
  cfg.calib = 32;
  cfg.residual = 5;
  vq::VqKVCache live(cfg);
  for (std::int64_t s = 0; s < 150; s += 40) live.update_and_fetch(k.slice(2, s, std::min<std::int64_t>(150, s + 40)), v.slice(2, s, std::min<std::int64_t>(150, s + 40)));
  EXPECT_TRUE(vq::read_npy(p("k2.npy")).bit_equal(live.state().keys));
  EXPECT_TRUE(vq::read_npy(p("v2.npy")).bit_equal(live.state().values));
  r = run("inspect " + p("a.vqkv") + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("layers")[0].at("kind"), "VqKVCache");
  EXPECT_EQ(j.at("layers")[0].at("quantized_keys").get<int>(), 145);
  EXPECT_EQ(j.at("layers")[0].at("vq").at("residual").get<int>(), 5);
  EXPECT_TRUE(j.at("layers")[0].at("vq").at("model").is_null());
}

TEST(VqkvVqCli, ModelLayersNeedTheirModel) {
  const std::string model = vqtest::model_path();
  auto r = run("compress --model " + model + " --tokenizer " + vqtest::tokenizer_path() + " --text " + vqtest::models_dir() +
               "/tinystories_val.txt --ctx 100 --method vq:bits=2 -o " + p("m.vqkv"));
  ASSERT_EQ(r.code, 0) << r.err;
  r = run("decompress " + p("m.vqkv") + " --model " + model + " -o " + p("m.safetensors"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(vq::read_kv_safetensors(p("m.safetensors")).size(), 5u);
  r = run("inspect " + p("m.vqkv") + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string fp = nlohmann::json::parse(r.out).at("layers")[2].at("vq").at("model").at("fingerprint");
  EXPECT_EQ(fp, fmt::format("{:016x}", vq::vq_model_fingerprint(vq::Checkpoint::load(model))));
  // Another model (one weight of wq changed): one line naming both fingerprints, exit 1.
  std::string other = vqtest::slurp(model);
  other[28 + 512 * 64 * 4 + 5 * 64 * 4 + 100] ^= 1;  // legacy layout: header, embedding, rms_att, then wq
  vqtest::spit(p("other.bin"), other);
  r = run("decompress " + p("m.vqkv") + " --model " + p("other.bin") + " -o " + p("o.safetensors"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find(fp), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("fingerprint"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_FALSE(std::filesystem::exists(p("o.safetensors")));
}

}  // namespace
