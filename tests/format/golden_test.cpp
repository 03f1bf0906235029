// Golden .vqkv files under tests/golden/: a small valid file whose bytes this build must write
// exactly and read back exactly (a format change that alters them must bump the version), files of
// earlier writers that must still load, and broken ones that must fail with a clear message. Regenerate (only on a deliberate change of the
// format or of what the writer chooses, e.g. the table precision; keep a file of the old writer):
//   VQ_WRITE_GOLDEN=1 ./build/tests/vq_tests --gtest_filter='VqkvGolden.*'
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "../support/test_util.hpp"
#include "veloxquant/cache/cachegen_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "vqkv_test_util.hpp"

namespace {

std::string golden(const std::string& name) { return std::string(VQ_SOURCE_DIR) + "/tests/golden/" + name; }
bool writing() { return std::getenv("VQ_WRITE_GOLDEN") != nullptr; }

void put(const std::string& name, const std::vector<std::uint8_t>& b) {
  std::ofstream(golden(name), std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Three layers of 20 float16 tokens, 2 heads, D = 4: CacheGen group_aligned (4 residual tokens),
// CacheGen per_call fed 5 tokens per call, and a plain KVCache.
std::vector<std::shared_ptr<vq::KVCache>> golden_caches() {
  const auto k = vqtest::random_walk({1, 2, 20, 4}, 101, vq::DType::F16);
  const auto v = vqtest::random_walk({1, 2, 20, 4}, 102, vq::DType::F16);
  vq::KVCacheConfig a;
  a.cachegen_group_size = 8;
  vq::KVCacheConfig b = a;
  b.cachegen_bits = 3;
  b.cachegen_flush = vq::FlushMode::PerCall;
  std::vector<std::shared_ptr<vq::KVCache>> caches = {std::make_shared<vq::CacheGenKVCache>(a), std::make_shared<vq::CacheGenKVCache>(b),
                                                      std::make_shared<vq::KVCache>()};
  caches[0]->update_and_fetch(k, v);
  for (int s = 0; s < 20; s += 5) caches[1]->update_and_fetch(k.slice(2, s, s + 5), v.slice(2, s, s + 5));
  caches[2]->update_and_fetch(k, v);
  return caches;
}

std::vector<std::uint8_t> golden_bytes() { return vq::serialize_prompt_cache(golden_caches(), {{"golden", "v2"}}, {.chunk_tokens = 8}); }

void expect_golden_caches(const vq::PromptCache& loaded) {
  const auto live = golden_caches();
  ASSERT_EQ(loaded.caches.size(), live.size());
  for (std::size_t l = 0; l < live.size(); ++l) {
    EXPECT_EQ(loaded.caches[l]->kind(), live[l]->kind());
    EXPECT_EQ(loaded.caches[l]->offset(), 20);
    EXPECT_TRUE(loaded.caches[l]->state().keys.bit_equal(live[l]->state().keys)) << l;
    EXPECT_TRUE(loaded.caches[l]->state().values.bit_equal(live[l]->state().values)) << l;
  }
}

TEST(VqkvGolden, ValidFileIsWrittenAndReadExactly) {
  const auto bytes = golden_bytes();
  if (writing()) {
    put("valid_v2.vqkv", bytes);
    auto cut = bytes;
    cut.resize(bytes.size() / 2);
    put("truncated_v2.vqkv", cut);
    auto flip = bytes;
    flip[vqtest::block_offsets(bytes)[2] + 45] ^= 0x04;
    put("bad_checksum_v2.vqkv", flip);
    auto magic = bytes;
    magic[1] = 'W';
    put("bad_magic.vqkv", magic);
    auto future = bytes;
    future[8] = 3;
    vqtest::fix_checksums(future);
    put("future_version.vqkv", future);
    auto order = bytes;  // the END block claims one block more than there are
    vqtest::wr(order, vqtest::block_offsets(bytes).back() + 16, vqtest::rd64(bytes, vqtest::block_offsets(bytes).back() + 16) + 1, 8);
    vqtest::fix_checksums(order);
    put("bad_end_count_v2.vqkv", order);
    // ~100-byte headers claiming 2^32 tokens in chunks of 1 (issue 13): readers once walked every
    // (chunk, layer, side) position of them; the Python and CLI tests load these too.
    put("huge_tokens_empty_layers.vqkv", vqtest::crafted_file({.tokens = std::uint64_t{1} << 32, .chunk = 1, .layers = 4}));
    put("huge_tokens_no_closed_tokens.vqkv",
        vqtest::crafted_file({.tokens = std::uint64_t{1} << 32, .chunk = 1, .layers = 1, .cls = 1, .offset = std::uint64_t{1} << 32}));
  }
  const auto file = vq::read_file_bytes(golden("valid_v2.vqkv"));
  EXPECT_EQ(file, bytes) << "this build writes different bytes than tests/golden/valid_v2.vqkv: a format change needs a new version";
  const auto loaded = vq::load_prompt_cache(golden("valid_v2.vqkv"));
  EXPECT_EQ(loaded.metadata.at("golden"), "v2");
  expect_golden_caches(loaded);
  EXPECT_EQ(vq::inspect_prompt_cache(file).version, 2);
}

// Files of earlier writers load into the same caches: version 1 (per-channel tables of the codes,
// 10-bit for 3- and 4-bit codes), and version 1 with 11-bit tables (the format lets every file
// choose its precision).
TEST(VqkvGolden, VersionOneFilesStillLoad) {
  for (const char* name : {"valid_v1.vqkv", "valid_v1_tables11.vqkv"}) {
    SCOPED_TRACE(name);
    const auto file = vq::read_file_bytes(golden(name));
    EXPECT_NE(file, golden_bytes());
    EXPECT_EQ(vq::inspect_prompt_cache(file).version, 1);
    const auto loaded = vq::load_prompt_cache(golden(name));
    EXPECT_EQ(loaded.metadata.at("golden"), "v1");
    expect_golden_caches(loaded);
  }
}

TEST(VqkvGolden, BrokenFilesFailClearly) {
  for (const auto& [name, fragment] : std::vector<std::pair<std::string, std::string>>{
           {"truncated_v2.vqkv", "truncated"},
           {"bad_checksum_v2.vqkv", "checksum mismatch"},
           {"bad_magic.vqkv", "not a .vqkv file"},
           {"future_version.vqkv", "unsupported format version 3"},
           {"bad_end_count_v2.vqkv", "the END block counts 21 blocks before it, the file has 20"},
           {"huge_tokens_empty_layers.vqkv", "token count 4294967296 but every layer is empty"},
           {"huge_tokens_no_closed_tokens.vqkv", "need at least"}}) {
    SCOPED_TRACE(name);
    try {
      (void)vq::load_prompt_cache(golden(name));
      ADD_FAILURE() << "no error";
    } catch (const vq::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << "names the file: " << e.what();
    }
  }
}

}  // namespace
