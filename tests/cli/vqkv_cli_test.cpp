// `veloxquant compress / decompress / inspect` as a user runs them, and the safetensors K/V files.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../model/model_support.hpp"
#include "../support/test_util.hpp"
#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/npy.hpp"
#include "veloxquant/format/safetensors.hpp"
#include "veloxquant/format/vqkv.hpp"

namespace {

std::string p(const std::string& name) { return vqtest::temp_dir() + "/vqkv_cli_" + name; }
vqtest::CliRun run(const std::string& args) { return vqtest::run_cli(args); }

// What a live cache fed the same input returns.
vq::KVState live_state(const vq::Tensor& k, const vq::Tensor& v, const vq::KVCacheConfig& cfg, std::int64_t chunk = 0) {
  static std::vector<std::shared_ptr<vq::CacheGenKVCache>> keep;  // fetch returns views: keep the caches alive
  keep.push_back(std::make_shared<vq::CacheGenKVCache>(cfg));
  const std::int64_t step = chunk > 0 ? chunk : k.dim(2);
  for (std::int64_t s = 0; s < k.dim(2); s += step)
    keep.back()->update_and_fetch(k.slice(2, s, std::min(k.dim(2), s + step)), v.slice(2, s, std::min(k.dim(2), s + step)));
  return keep.back()->state();
}

class VqkvCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    vq::write_npy(p("k.npy"), vqtest::random_walk({1, 4, 150, 16}, 1, vq::DType::F16));
    vq::write_npy(p("v.npy"), vqtest::random_walk({1, 4, 150, 16}, 2, vq::DType::F16));
  }
};

TEST_F(VqkvCli, NpyRoundTripEqualsTheLiveCache) {
  for (const std::string flags : {"", " --bits 3 --group-size 16 --flush per_call --chunk 7"}) {
    SCOPED_TRACE(flags);
    auto r = run("compress --keys " + p("k.npy") + " --values " + p("v.npy") + flags + " -o " + p("a.vqkv") + " --json");
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j.at("bytes").get<std::uint64_t>(), std::filesystem::file_size(p("a.vqkv")));
    EXPECT_EQ(j.at("tokens").get<int>(), 150);
    r = run("decompress " + p("a.vqkv") + " --keys-out " + p("k2.npy") + " --values-out " + p("v2.npy"));
    ASSERT_EQ(r.code, 0) << r.err;
    vq::KVCacheConfig cfg;
    cfg.cachegen_resolved_bits = 4;  // a one-layer model's schedule gives the base bits
    std::int64_t chunk = 0;
    if (!flags.empty()) {
      cfg.cachegen_bits = 3;
      cfg.cachegen_resolved_bits = 3;
      cfg.cachegen_group_size = 16;
      cfg.cachegen_flush = vq::FlushMode::PerCall;
      chunk = 7;
    }
    const auto want = live_state(vq::read_npy(p("k.npy")), vq::read_npy(p("v.npy")), cfg, chunk);
    EXPECT_TRUE(vq::read_npy(p("k2.npy")).bit_equal(want.keys));
    EXPECT_TRUE(vq::read_npy(p("v2.npy")).bit_equal(want.values));
  }
}

TEST_F(VqkvCli, SafetensorsInAndOutKeepEveryLayer) {
  std::vector<vq::KVPair> layers;
  for (int l = 0; l < 3; ++l)
    layers.push_back({vqtest::random_walk({1, 2, 70, 8}, 10 + l), vqtest::random_walk({1, 2, 70, 8}, 20 + l)});
  vq::write_kv_safetensors(p("in.safetensors"), layers, {{"note", "test"}});
  auto r = run("compress --kv " + p("in.safetensors") + " --method fp32 -o " + p("b.vqkv"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("3 layers x 70 tokens"), std::string::npos) << r.out;
  r = run("decompress " + p("b.vqkv") + " -o " + p("out.safetensors"));
  ASSERT_EQ(r.code, 0) << r.err;
  std::map<std::string, std::string> meta;
  const auto back = vq::read_kv_safetensors(p("out.safetensors"), &meta);
  ASSERT_EQ(back.size(), 3u);
  for (int l = 0; l < 3; ++l) {  // fp32: exact
    EXPECT_TRUE(back[static_cast<std::size_t>(l)].keys.bit_equal(layers[static_cast<std::size_t>(l)].keys));
    EXPECT_TRUE(back[static_cast<std::size_t>(l)].values.bit_equal(layers[static_cast<std::size_t>(l)].values));
  }
  EXPECT_EQ(meta.at("method"), "fp32");
  // Several layers as .npy need --layer.
  r = run("decompress " + p("b.vqkv") + " --keys-out " + p("k3.npy") + " --values-out " + p("v3.npy"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--layer"), std::string::npos) << r.err;
  r = run("decompress " + p("b.vqkv") + " --layer 2 --keys-out " + p("k3.npy") + " --values-out " + p("v3.npy"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(vq::read_npy(p("v3.npy")).bit_equal(layers[2].values));
}

TEST_F(VqkvCli, InspectSumsToTheFileSize) {
  ASSERT_EQ(run("compress --keys " + p("k.npy") + " --values " + p("v.npy") + " -o " + p("c.vqkv")).code, 0);
  const auto r = run("inspect " + p("c.vqkv") + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  const auto size = std::filesystem::file_size(p("c.vqkv"));
  EXPECT_EQ(j.at("file_bytes").get<std::uint64_t>(), size);
  std::uint64_t sum = j.at("file").at("total").get<std::uint64_t>();
  for (const auto& l : j.at("layers"))
    for (const char* side : {"keys", "values"}) {
      const auto& b = l.at(side);
      std::uint64_t parts = 0;
      for (const char* k : {"payload", "tables", "scales_zeros", "residual", "headers", "checksums"}) parts += b.at(k).get<std::uint64_t>();
      EXPECT_EQ(parts, b.at("total").get<std::uint64_t>());
      sum += parts;
    }
  EXPECT_EQ(sum, size);
  EXPECT_EQ(j.at("tokens").get<int>(), 150);
  EXPECT_EQ(j.at("layers")[0].at("kind").get<std::string>(), "CacheGenKVCache");
  EXPECT_GT(j.at("total").at("ratio_to_fp16").get<double>(), 0.1);
  EXPECT_LT(j.at("total").at("ratio_to_fp16").get<double>(), 0.6);
  const auto text = run("inspect " + p("c.vqkv"));
  ASSERT_EQ(text.code, 0);
  EXPECT_NE(text.out.find("sum to the file size"), std::string::npos);
}

// Metadata is whatever bytes a file holds: text output escapes control characters and invalid
// UTF-8 (a raw ESC would drive the terminal), JSON output replaces invalid UTF-8 (it used to exit 3,
// "internal error", on nlohmann's exception).
TEST_F(VqkvCli, InspectEscapesMetadataItCannotPrintAsIs) {
  auto cache = std::make_shared<vq::KVCache>();
  cache->update_and_fetch(vqtest::random_walk({1, 1, 2, 4}, 3), vqtest::random_walk({1, 1, 2, 4}, 4));
  vq::save_prompt_cache(p("meta.vqkv"), {cache}, {{"title\x1b]0;pwned\x07", "red \x1b[31m bytes \xff\xfe c1 \xc2\x9b tab\t nl\n back\\ \xc3\xa9"}});
  const auto text = run("inspect " + p("meta.vqkv"));
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_EQ(text.out.find('\x1b'), std::string::npos);
  EXPECT_EQ(text.out.find('\x07'), std::string::npos);
  EXPECT_EQ(text.out.find('\xff'), std::string::npos);
  EXPECT_NE(text.out.find(R"(metadata: title\x1b]0;pwned\x07 = red \x1b[31m bytes \xff\xfe c1 \u009b tab\t nl\n back\\ )"
                          "\xc3\xa9\n"),
            std::string::npos)
      << text.out;
  const auto json = run("inspect " + p("meta.vqkv") + " --json");
  ASSERT_EQ(json.code, 0) << json.err;
  EXPECT_TRUE(std::all_of(json.out.begin(), json.out.end(), [](char c) { return c == '\n' || (c >= 0x20 && c < 0x7f); })) << json.out;
  const auto j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j.at("metadata").at("title\x1b]0;pwned\x07").get<std::string>(),
            "red \x1b[31m bytes \xef\xbf\xbd\xef\xbf\xbd c1 \xc2\x9b tab\t nl\n back\\ \xc3\xa9");
}

TEST_F(VqkvCli, CompressesARealModelRun) {
  if (!std::filesystem::exists(vqtest::model_path())) GTEST_SKIP() << "no model in " << vqtest::models_dir();
  auto r = run("compress --model " + vqtest::model_path() + " --tokenizer " + vqtest::tokenizer_path() + " --text " + vqtest::models_dir() +
               "/tinystories_val.txt --ctx 200 --chunk 64 -o " + p("m.vqkv") + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto loaded = vq::load_prompt_cache(p("m.vqkv"));
  EXPECT_EQ(loaded.caches.size(), 5u);  // stories260K
  EXPECT_EQ(loaded.caches[0]->offset(), 200);
  EXPECT_EQ(loaded.metadata.at("model"), "stories260K.bin");
}

TEST_F(VqkvCli, BadInputIsOneClearLineAndANonzeroExit) {
  vq::write_npy(p("k_bad.npy"), vqtest::random_walk({1, 4, 149, 16}, 1));
  std::ofstream(p("junk.vqkv")) << "not a cache";
  ASSERT_EQ(run("compress --keys " + p("k.npy") + " --values " + p("v.npy") + " -o " + p("src.vqkv")).code, 0);
  const auto good = vq::read_file_bytes(p("src.vqkv"));
  {
    auto cut = good;
    cut.resize(cut.size() / 2);
    std::ofstream(p("cut.vqkv"), std::ios::binary).write(reinterpret_cast<const char*>(cut.data()), static_cast<std::streamsize>(cut.size()));
  }
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"compress -o " + p("x.vqkv"), "exactly one input"},
      {"compress --keys " + p("k.npy") + " --values " + p("v.npy") + " --kv " + p("k.npy") + " -o " + p("x.vqkv"), "exactly one input"},
      {"compress --keys " + p("k_bad.npy") + " --values " + p("v.npy") + " -o " + p("x.vqkv"), "B, H and S must agree"},
      {"compress --keys " + p("k.npy") + " --values " + p("v.npy") + " --method kivi -o " + p("x.vqkv"), "cachegen, vq or fp32"},
      {"compress --keys " + p("k.npy") + " --values " + p("v.npy") + " --method fp32 --bits 3 -o " + p("x.vqkv"), "cachegen only"},
      {"compress --keys " + p("k.npy") + " --values " + p("v.npy") + " --flush sometimes -o " + p("x.vqkv"), "flush"},
      {"compress --kv " + p("k.npy") + " -o " + p("x.vqkv"), "not a valid safetensors file"},
      {"compress --keys " + p("k.npy") + " --values " + p("v.npy") + " -o /nonexistent_dir/x.vqkv", "cannot write"},
      {"decompress " + p("junk.vqkv") + " -o " + p("x.safetensors"), "wrong magic"},
      {"decompress " + p("cut.vqkv") + " -o " + p("x.safetensors"), "truncated"},
      {"inspect " + p("cut.vqkv"), "truncated"},
      {"inspect " + p("missing.vqkv"), "does not exist"},
      {"decompress " + p("src.vqkv"), "either -o"},
  };
  for (const auto& [args, fragment] : cases) {
    SCOPED_TRACE(args);
    const auto r = run(args);
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  EXPECT_FALSE(std::filesystem::exists(p("x.vqkv")));
  EXPECT_FALSE(std::filesystem::exists(p("x.safetensors")));
}

TEST(Safetensors, RoundTripAndBrokenFiles) {
  const std::string path = p("s.safetensors");
  std::map<std::string, vq::Tensor> t = {{"a", vqtest::random_walk({1, 2, 3, 4}, 1, vq::DType::BF16)},
                                         {"b", vqtest::random_walk({2, 1, 5, 3}, 2, vq::DType::F16)},
                                         {"c", vqtest::random_walk({1, 1, 0, 4}, 3)}};
  vq::write_safetensors(path, t, {{"k", "v"}});
  std::map<std::string, std::string> meta;
  const auto back = vq::read_safetensors(path, &meta);
  ASSERT_EQ(back.size(), 3u);
  for (const auto& [name, x] : t) EXPECT_TRUE(back.at(name).bit_equal(x)) << name;
  EXPECT_EQ(meta.at("k"), "v");
  const auto good = vq::read_file_bytes(path);
  const std::uint64_t hlen = good[0] | static_cast<std::uint64_t>(good[1]) << 8;
  std::string header(good.begin() + 8, good.begin() + 8 + static_cast<std::ptrdiff_t>(hlen));
  auto write_with_header = [&](const std::string& h, std::size_t data_bytes) {
    std::vector<std::uint8_t> b(8);
    for (int i = 0; i < 8; ++i) b[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(h.size() >> (8 * i));
    b.insert(b.end(), h.begin(), h.end());
    b.insert(b.end(), good.end() - static_cast<std::ptrdiff_t>(std::min(data_bytes, good.size())), good.end());
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  };
  const std::size_t data = good.size() - 8 - hlen;
  auto expect_error = [&](const std::string& what, const std::string& fragment) {
    SCOPED_TRACE(what);
    try {
      vq::read_safetensors(path);
      ADD_FAILURE() << "no error";
    } catch (const vq::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  write_with_header("{not json", data);
  expect_error("not json", "not JSON");
  write_with_header(R"({"a":{"dtype":"I8","shape":[1,1,1,1],"data_offsets":[0,1]}})", data);
  expect_error("dtype", "dtype I8");
  write_with_header(R"({"a":{"dtype":"F32","shape":[1,1,4],"data_offsets":[0,16]}})", data);
  expect_error("rank", "rank 3");
  write_with_header(R"({"a":{"dtype":"F32","shape":[1,1,1,4],"data_offsets":[0,99999]}})", data);
  expect_error("offsets", "outside");
  write_with_header(R"({"a":{"dtype":"F32","shape":[1,1,1,4],"data_offsets":[0,12]}})", data);
  expect_error("size", "shape needs 16");
  write_with_header(R"({"a":{"dtype":"F32","shape":[1,1,1,2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1,1,1,2],"data_offsets":[4,12]}})", data);
  expect_error("overlap", "overlap");
  // Shapes and offsets are non-negative integers as written (40.5 was read as 40, -1 as 2^64 - 1),
  // and a zero dimension beside huge ones cannot make the strides overflow.
  for (const auto& [shape, offsets, fragment] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"[1,1,40.5,4]", "[0,640]", "shape [1,1,40.5,4] (entries must be non-negative integers)"},
           {"[1,1,40.0,4]", "[0,640]", "entries must be non-negative integers"},
           {"[1,1,4e1,4]", "[0,640]", "entries must be non-negative integers"},
           {"[1,-1,40,4]", "[0,640]", "entries must be non-negative integers"},
           {"[1,1,\"40\",4]", "[0,640]", "entries must be non-negative integers"},
           {"[1,1,40,4]", "[0,640.0]", "data_offsets [0,640.0] (entries must be"},
           {"[1,1,40,4]", "[-1,639]", "data_offsets [-1,639] (entries must be"},
           {"[0,4294967296,4294967296,4294967296]", "[0,0]", "multiply past 2^63 bytes"},
           {"[4294967296,4294967296,0,1]", "[0,0]", "multiply past 2^63 bytes"}}) {
    write_with_header(R"({"a":{"dtype":"F32","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}", data);
    expect_error(shape + " " + offsets, fragment);
  }
  write_with_header(R"({"a":{"dtype":"F32","shape":[1,1,0,4294967296],"data_offsets":[0,0]}})", data);
  EXPECT_EQ(vq::read_safetensors(path).at("a").shape(), (vq::Shape4{1, 1, 0, std::int64_t{1} << 32}));
  // Metadata that is not UTF-8 (a .vqkv holds bytes) is written with U+FFFD, not an exception.
  vq::write_safetensors(path, {{"a", t.at("a")}}, {{"k", "ok \xff"}});
  meta.clear();
  (void)vq::read_safetensors(path, &meta);
  EXPECT_EQ(meta.at("k"), "ok \xef\xbf\xbd");
  std::ofstream(path, std::ios::binary) << "abc";
  expect_error("short", "shorter");
  // KV naming.
  vq::write_safetensors(path, {{"layers.0.keys", t.at("a")}, {"layers.1.keys", t.at("a")}, {"layers.1.values", t.at("a")}});
  EXPECT_THROW(vq::read_kv_safetensors(path), vq::FormatError);
  vq::write_safetensors(path, {{"weird", t.at("a")}});
  EXPECT_THROW(vq::read_kv_safetensors(path), vq::FormatError);
  EXPECT_THROW(vq::read_safetensors(p("missing.safetensors")), vq::IoError);
}

}  // namespace
