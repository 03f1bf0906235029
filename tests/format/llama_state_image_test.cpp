// The llama.cpp state image (format/llama_state_image.hpp): rows fed chunk by chunk, in any type,
// give the bytes write_llama_state gives for the whole rows, in every type and V layout; reused
// buffers hold nothing of an earlier image; write() leaves exactly those bytes in the file, over a
// longer one too; every misuse is one clear error.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "../support/test_util.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/format/llama_state.hpp"
#include "veloxquant/format/llama_state_image.hpp"

namespace {

constexpr vq::LlamaStateModel kModel{2, 3, 8, 4};  // 2 layers, 3 KV heads, keys of 8, values of 4

vq::LlamaState layout_of(vq::DType dtype, bool v_trans, bool server_tokens) {
  vq::LlamaState st;
  st.dtype = dtype;
  st.v_trans = v_trans;
  st.server_tokens = server_tokens;
  return st;
}

// The whole rows of `cells` cells, float32, per layer.
std::vector<vq::KVPair> rows(std::int64_t cells, std::uint64_t seed) {
  std::vector<vq::KVPair> out;
  for (int l = 0; l < kModel.layers; ++l)
    out.push_back({vqtest::random_walk({1, kModel.kv_heads, cells, kModel.key_dim}, seed + l, vq::DType::F32, 0.7f),
                   vqtest::random_walk({1, kModel.kv_heads, cells, kModel.value_dim}, seed + 10 + l, vq::DType::F32, 0.7f)});
  return out;
}

std::vector<std::int32_t> tokens_for(std::int64_t cells) {
  std::vector<std::int32_t> t;
  for (std::int64_t i = 0; i < cells; ++i) t.push_back(static_cast<std::int32_t>(3 + 7 * i));
  return t;
}

std::vector<std::uint8_t> file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST(LlamaStateImage, ChunksInAnyTypeGiveTheWritersBytesInEveryTypeAndLayout) {
  const std::int64_t cells = 37;
  const auto whole = rows(cells, 5);
  for (const vq::DType dtype : {vq::DType::F16, vq::DType::F32, vq::DType::BF16})
    for (const bool v_trans : {false, true})
      for (const bool server_tokens : {false, true}) {
        SCOPED_TRACE(::testing::Message() << vq::dtype_name(dtype) << " v_trans " << v_trans << " server tokens " << server_tokens);
        vq::LlamaState st = layout_of(dtype, v_trans, server_tokens);
        st.tokens = tokens_for(cells);
        st.layers = whole;
        const auto expected = vq::write_llama_state(st);
        vq::LlamaStateImage image(st, kModel);
        auto& caches = image.begin(50);  // room for more cells than fed: transposed rows have gaps
        // Chunks of 5, 16 and 16 cells; the second already in a 16-bit type (converted on its way
        // in): the state's own (rounded once, as the writer rounds), or float16 for a float32 state.
        for (const auto& [t0, t1] : {std::pair{0, 5}, std::pair{5, 21}, std::pair{21, 37}})
          for (int l = 0; l < kModel.layers; ++l) {
            vq::Tensor k = whole[static_cast<std::size_t>(l)].keys.slice(2, t0, t1);
            vq::Tensor v = whole[static_cast<std::size_t>(l)].values.slice(2, t0, t1);
            const vq::DType in = dtype == vq::DType::F32 ? vq::DType::F16 : dtype;
            if (t0 == 5) k = k.to(in), v = v.to(in);
            caches[static_cast<std::size_t>(l)]->update(k, v);
          }
        ASSERT_EQ(image.cells(), cells);
        if (dtype == vq::DType::F32) {
          // float16 in, float32 out: the middle chunk holds what float16 held; the rest is exact.
          const auto got = vq::read_llama_state(image.bytes(st.tokens), kModel);
          for (int l = 0; l < kModel.layers; ++l) {
            EXPECT_TRUE(got.layers[static_cast<std::size_t>(l)].keys.slice(2, 0, 5).bit_equal(whole[static_cast<std::size_t>(l)].keys.slice(2, 0, 5)));
            EXPECT_TRUE(got.layers[static_cast<std::size_t>(l)].values.slice(2, 5, 21).bit_equal(
                whole[static_cast<std::size_t>(l)].values.slice(2, 5, 21).to(vq::DType::F16).to(vq::DType::F32)));
          }
        } else {
          EXPECT_EQ(image.bytes(st.tokens), expected);
        }
      }
}

TEST(LlamaStateImage, ReusedBuffersHoldNothingOfAnEarlierImage) {
  for (const bool v_trans : {false, true}) {
    vq::LlamaStateImage image(layout_of(vq::DType::F16, v_trans, true), kModel);
    const auto first = rows(40, 1), second = rows(12, 2);
    auto& a = image.begin(40);
    for (int l = 0; l < kModel.layers; ++l) a[static_cast<std::size_t>(l)]->update(first[static_cast<std::size_t>(l)].keys, first[static_cast<std::size_t>(l)].values);
    const std::size_t held = image.nbytes();
    EXPECT_GT(held, 0u);
    auto& b = image.begin(12);
    EXPECT_EQ(image.cells(), 0);
    for (int l = 0; l < kModel.layers; ++l) b[static_cast<std::size_t>(l)]->update(second[static_cast<std::size_t>(l)].keys, second[static_cast<std::size_t>(l)].values);
    vq::LlamaState st = layout_of(vq::DType::F16, v_trans, true);
    st.tokens = tokens_for(12);
    st.layers = second;
    EXPECT_EQ(image.bytes(st.tokens), vq::write_llama_state(st)) << "v_trans " << v_trans;
    EXPECT_EQ(image.nbytes(), held);  // no new buffers for a shorter prefix
    image.release();
    EXPECT_EQ(image.nbytes(), 0u);
  }
}

TEST(LlamaStateImage, WriteLeavesExactlyTheBytesOverALongerFile) {
  const std::string path = (std::filesystem::temp_directory_path() / ("vq-image-test-" + std::to_string(::getpid()) + ".bin")).string();
  {
    std::ofstream f(path, std::ios::binary);
    const std::string junk(100000, 'x');
    f << junk;
  }
  vq::LlamaStateImage image(layout_of(vq::DType::F16, true, true), kModel);
  const auto r = rows(9, 3);
  auto& c = image.begin(9);
  for (int l = 0; l < kModel.layers; ++l) c[static_cast<std::size_t>(l)]->update(r[static_cast<std::size_t>(l)].keys, r[static_cast<std::size_t>(l)].values);
  const auto tokens = tokens_for(9);
  image.write(path, tokens);
  EXPECT_EQ(file_bytes(path), image.bytes(tokens));
  std::filesystem::remove(path);
  image.write(path, tokens);  // and a new file
  EXPECT_EQ(file_bytes(path), image.bytes(tokens));
  std::filesystem::remove(path);
  EXPECT_THROW(image.write("/nonexistent-dir-vq/slot.bin", tokens), vq::IoError);
}

TEST(LlamaStateImage, MisuseIsOneClearError) {
  const vq::LlamaState layout = layout_of(vq::DType::F16, false, true);
  EXPECT_THROW(vq::LlamaStateImage(layout, vq::LlamaStateModel{0, 3, 8, 4}), vq::InvalidArgument);
  vq::LlamaState bad_stream = layout;
  bad_stream.stream = 1;
  EXPECT_THROW(vq::LlamaStateImage(bad_stream, kModel), vq::InvalidArgument);
  vq::LlamaStateImage image(layout, kModel);
  EXPECT_THROW(image.begin(0), vq::InvalidArgument);
  auto& c = image.begin(4);
  EXPECT_THROW((void)image.bytes({}), vq::InvalidArgument);  // nothing fed
  const auto r = rows(5, 4);
  // More cells than begun for, another head count, another key width: refused, nothing written.
  EXPECT_THROW(c[0]->update(r[0].keys, r[0].values), vq::InvalidArgument);
  EXPECT_THROW(c[0]->update(vqtest::random_walk({1, 2, 2, 8}, 1), vqtest::random_walk({1, 2, 2, 4}, 2)), vq::InvalidArgument);
  EXPECT_THROW(c[0]->update(vqtest::random_walk({1, 3, 2, 4}, 1), vqtest::random_walk({1, 3, 2, 4}, 2)), vq::InvalidArgument);
  EXPECT_EQ(c[0]->offset(), 0);
  c[0]->update(r[0].keys.slice(2, 0, 2), r[0].values.slice(2, 0, 2));
  try {
    (void)image.cells();  // layer 1 holds none
    ADD_FAILURE() << "layers fed unequally were accepted";
  } catch (const vq::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("every layer must be fed the same"), std::string::npos) << e.what();
  }
  EXPECT_THROW(c[0]->update_and_fetch(r[0].keys, r[0].values), vq::InvalidArgument);
  EXPECT_THROW((void)c[0]->state(), vq::InvalidArgument);
  EXPECT_THROW(c[0]->trim(1), vq::InvalidArgument);
}

TEST(LlamaStateImage, MemoryFollowsTheCellsALoaderExpects) {
  // A long prompt whose stored prefix is short: the loader says how many cells it will feed, and
  // only those are held (begun for 100,000 cells, told 12: 12 cells' buffers).
  vq::LlamaStateImage image(layout_of(vq::DType::F16, true, true), kModel);
  auto& c = image.begin(100000);
  for (auto& layer : c) layer->expect_tokens(12);
  const std::size_t per_cell = 2 * static_cast<std::size_t>(kModel.kv_heads * (kModel.key_dim + kModel.value_dim));
  EXPECT_LE(image.nbytes(), kModel.layers * (12 * per_cell + 4096));
  const auto r = rows(12, 6);
  for (int l = 0; l < kModel.layers; ++l) c[static_cast<std::size_t>(l)]->update(r[static_cast<std::size_t>(l)].keys, r[static_cast<std::size_t>(l)].values);
  vq::LlamaState st = layout_of(vq::DType::F16, true, true);
  st.tokens = tokens_for(12);
  st.layers = r;
  EXPECT_EQ(image.bytes(st.tokens), vq::write_llama_state(st));
  try {  // a 13th cell is past what the layer was told to expect
    c[0]->update(r[0].keys.slice(2, 0, 1), r[0].values.slice(2, 0, 1));
    ADD_FAILURE() << "a cell past the expected count was taken";
  } catch (const vq::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("told to expect"), std::string::npos) << e.what();
  }
}
