// llama.cpp sequence state files (format/llama_state.hpp): our writer and reader are exact inverses
// for every layout llama.cpp writes (F32/F16/BF16, V per cell or transposed, several streams), the
// bytes are llama.cpp's layout field by field, and every kind of bad file is one FormatError.
#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include "../support/test_util.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/format/llama_state.hpp"

namespace {

constexpr vq::LlamaStateModel kModel{3, 2, 4, 4};  // 3 layers, 2 KV heads of 4

vq::LlamaState make_state(vq::DType dtype, bool v_trans, std::int64_t cells = 5, std::uint32_t n_stream = 1, std::uint32_t stream = 0) {
  vq::LlamaState st;
  st.tokens = {1, 301, 427, 309, 426};
  st.dtype = dtype;
  st.v_trans = v_trans;
  st.n_stream = n_stream;
  st.stream = stream;
  st.seq_id = static_cast<std::int32_t>(stream);
  for (int l = 0; l < kModel.layers; ++l)
    st.layers.push_back({vqtest::random_walk({1, kModel.kv_heads, cells, kModel.key_dim}, 10 + l, dtype),
                         vqtest::random_walk({1, kModel.kv_heads, cells, kModel.value_dim}, 20 + l, dtype)});
  return st;
}

void expect_same(const vq::LlamaState& a, const vq::LlamaState& b) {
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.server_tokens, b.server_tokens);
  EXPECT_EQ(a.n_stream, b.n_stream);
  EXPECT_EQ(a.stream, b.stream);
  EXPECT_EQ(a.seq_id, b.seq_id);
  EXPECT_EQ(a.v_trans, b.v_trans);
  EXPECT_EQ(a.dtype, b.dtype);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (std::size_t l = 0; l < a.layers.size(); ++l) {
    EXPECT_TRUE(a.layers[l].keys.bit_equal(b.layers[l].keys)) << "layer " << l;
    EXPECT_TRUE(a.layers[l].values.bit_equal(b.layers[l].values)) << "layer " << l;
  }
}

std::string error_of(const std::vector<std::uint8_t>& bytes, const vq::LlamaStateModel& model = kModel) {
  try {
    vq::read_llama_state(bytes, model, "s.bin");
  } catch (const vq::FormatError& e) {
    return e.what();
  }
  return "";
}

template <class T>
void poke(std::vector<std::uint8_t>& b, std::size_t at, T v) {
  std::memcpy(b.data() + at, &v, sizeof(T));
}

TEST(LlamaState, RoundTripIsExactForEveryTypeAndLayout) {
  for (const auto dtype : {vq::DType::F32, vq::DType::F16, vq::DType::BF16})
    for (const bool v_trans : {false, true})
      for (const std::int64_t cells : {1, 5, 33}) {
        SCOPED_TRACE(testing::Message() << vq::dtype_name(dtype) << " v_trans " << v_trans << " cells " << cells);
        const auto st = make_state(dtype, v_trans, cells);
        const auto bytes = vq::write_llama_state(st);
        expect_same(vq::read_llama_state(bytes, kModel), st);
        EXPECT_EQ(vq::write_llama_state(vq::read_llama_state(bytes, kModel)), bytes);
      }
}

TEST(LlamaState, NoTokenIdsIsAValidState) {
  auto st = make_state(vq::DType::F16, true, 2);
  st.tokens.clear();  // llama.cpp saves whatever prompt its caller passes, possibly none
  expect_same(vq::read_llama_state(vq::write_llama_state(st), kModel), st);
}

TEST(LlamaState, SeveralStreamsKeepTheOneThatHoldsTheCells) {
  const auto st = make_state(vq::DType::F16, true, 7, 4, 2);
  expect_same(vq::read_llama_state(vq::write_llama_state(st), kModel), st);
}

// The bytes are llama.cpp's layout (llama-context.cpp state_seq_save_file, llama-kv-cache.cpp
// state_write_meta / state_write_data), checked at fixed offsets for a small state.
TEST(LlamaState, BytesFollowLlamaCppsLayout) {
  for (const bool v_trans : {false, true}) {
    const auto st = make_state(vq::DType::F16, v_trans, 3);
    const auto b = vq::write_llama_state(st);
    auto u32 = [&](std::size_t at) { std::uint32_t v; std::memcpy(&v, b.data() + at, 4); return v; };
    auto u16 = [&](std::size_t at) { std::uint16_t v; std::memcpy(&v, b.data() + at, 2); return v; };
    auto bits = [](const vq::Tensor& t, int h, int s, int d) { std::uint16_t v; std::memcpy(&v, t.row(0, h, s) + 2 * d, 2); return v; };
    EXPECT_EQ(u32(0), 0x67677371u);  // 'ggsq'
    EXPECT_EQ(u32(4), 3u);
    EXPECT_EQ(u32(8), 5u);           // tokens
    EXPECT_EQ(u32(12 + 4), 301u);
    std::size_t o = 12 + 5 * 4;
    EXPECT_EQ(u32(o), 1u);           // streams
    EXPECT_EQ(u32(o + 4), 3u);       // cells
    o += 8;
    for (std::uint32_t i = 0; i < 3; ++i) {  // pos, n_seq_id, seq_id
      EXPECT_EQ(u32(o + 12 * i), i);
      EXPECT_EQ(u32(o + 12 * i + 4), 1u);
      EXPECT_EQ(u32(o + 12 * i + 8), 0u);
    }
    o += 36;
    EXPECT_EQ(u32(o), v_trans ? 1u : 0u);
    EXPECT_EQ(u32(o + 4), 3u);       // layers
    o += 8;
    const std::size_t k_layer = 12 + 3 * 16;  // type, row bytes, 3 rows of 2 heads x 4 x 2 bytes
    EXPECT_EQ(u32(o), 1u);           // GGML_TYPE_F16
    EXPECT_EQ(u32(o + 4), 16u);      // row bytes (u64)
    EXPECT_EQ(u32(o + 8), 0u);
    // Layer 0 key of cell 2, head 1, dim 3: row 2, element 1 * 4 + 3.
    EXPECT_EQ(u16(o + 12 + 2 * 16 + 2 * 7), bits(st.layers[0].keys, 1, 2, 3));
    o += 3 * k_layer;
    if (!v_trans) {
      EXPECT_EQ(u32(o + 4), 16u);
      EXPECT_EQ(u16(o + 12 + 2 * 16 + 2 * 7), bits(st.layers[0].values, 1, 2, 3));
    } else {
      EXPECT_EQ(u32(o + 4), 2u);     // element bytes
      EXPECT_EQ(u32(o + 8), 8u);     // channels
      // Channel j = 1 * 4 + 3 holds the 3 cells' values in order: cell 2 is at j * 3 + 2.
      EXPECT_EQ(u16(o + 12 + 2 * (7 * 3 + 2)), bits(st.layers[0].values, 1, 2, 3));
    }
    EXPECT_EQ(b.size(), o + 3 * (12 + 3 * 16));
  }
}

TEST(LlamaState, EveryTruncationIsOneClearError) {
  for (const bool v_trans : {false, true}) {
    const auto b = vq::write_llama_state(make_state(vq::DType::F16, v_trans, 4));
    for (std::size_t n = 0; n < b.size(); ++n) {
      const std::string e = error_of({b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n)});
      ASSERT_NE(e, "") << "cut at " << n;
      EXPECT_EQ(e.rfind("s.bin: llama.cpp state: ", 0), 0u) << e;
    }
  }
}

TEST(LlamaState, EverySingleByteChangeIsReadOrRefusedNeverACrash) {
  // Single-byte changes in the header and cell metadata (the K/V bytes are data: any value reads).
  const auto b = vq::write_llama_state(make_state(vq::DType::F32, true, 3));
  for (std::size_t i = 0; i < 12 + 20 + 8 + 36 + 8 + 12; ++i)
    for (const std::uint8_t x : {0x01, 0x80, 0xff}) {
      auto c = b;
      c[i] ^= x;
      try {
        vq::read_llama_state(c, kModel);
      } catch (const vq::FormatError&) {
      }
    }
}

TEST(LlamaState, ForeignAndBadFilesAreRefusedWithTheirReason) {
  auto b = vq::write_llama_state(make_state(vq::DType::F16, false, 3));
  const std::size_t streams = 12 + 5 * 4, cells = streams + 8, v_trans = cells + 36, layer0 = v_trans + 8;
  auto with = [&](auto edit) { auto c = b; edit(c); return error_of(c); };
  EXPECT_NE(with([](auto& c) { poke<std::uint32_t>(c, 0, 0x6767736e); }).find("not a sequence state"), std::string::npos);
  EXPECT_NE(with([](auto& c) { poke<std::uint32_t>(c, 4, 2); }).find("version 2"), std::string::npos);
  EXPECT_NE(with([](auto& c) { poke<std::uint32_t>(c, 8, 0xfffffff0u); }).find("token ids"), std::string::npos);
  EXPECT_NE(with([](auto& c) { poke<std::int32_t>(c, 16, -1); }).find("token 1 is -1"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::uint32_t>(c, streams, 0); }).find("stream count is 0"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::uint32_t>(c, streams, 0x40000000u); }).find("cell counts"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::uint32_t>(c, streams + 4, 0); }).find("the state is empty"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::uint32_t>(c, streams + 4, 0xffffffffu); }).find("claims 4294967295 cells"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::int32_t>(c, cells + 12, 7); }).find("cell 1 is at position 7"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::uint32_t>(c, cells + 4, 2); }).find("belongs to 2 sequences"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::int32_t>(c, cells + 20, 1); }).find("cell 1 is of sequence 1"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::int32_t>(c, cells + 8, -1); }).find("sequence id -1"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::uint32_t>(c, v_trans, 2); }).find("v_trans is 2"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::uint32_t>(c, v_trans + 4, 4); }).find("4 layers"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::int32_t>(c, layer0, 8); }).find("layer 0 keys are q8_0"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::int32_t>(c, layer0, 0); }).find("key rows have 16 bytes"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::uint64_t>(c, layer0 + 4, 32); }).find("key rows have 32 bytes"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::int32_t>(c, layer0 + 60, 0); }).find("mixed cache types"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { poke<std::uint16_t>(c, layer0 + 12, 0x7c00); }).find("NaN or infinity"), std::string::npos);
  EXPECT_NE(with([&](auto& c) { c.push_back(0); }).find("1 bytes follow the state"), std::string::npos);
  EXPECT_NE(error_of({1, 2, 3}).find("fewer than its 8-byte magic"), std::string::npos);
  // Another model: a different head count or head size makes every row size differ.
  EXPECT_NE(error_of(b, {3, 4, 4, 4}).find("saved from another model"), std::string::npos);
  EXPECT_NE(error_of(b, {3, 2, 8, 8}).find("saved from another model"), std::string::npos);
  EXPECT_NE(error_of(b, {5, 2, 4, 4}).find("3 layers"), std::string::npos);
  // Two streams holding cells: not one sequence's state.
  auto two = vq::write_llama_state(make_state(vq::DType::F16, false, 2, 2, 1));
  auto one = vq::write_llama_state(make_state(vq::DType::F16, false, 2, 1, 0));
  std::vector<std::uint8_t> both(two.begin(), two.begin() + 12 + 20 + 4);  // up to the stream count (2)
  both.insert(both.end(), one.begin() + 12 + 20 + 4, one.end());        // stream 0: cells
  both.insert(both.end(), one.begin() + 12 + 20 + 4, one.end());        // stream 1: cells again
  EXPECT_NE(error_of(both).find("stream 1 holds cells too"), std::string::npos);
  // A state of no cells.
  auto empty = std::vector<std::uint8_t>(b.begin(), b.begin() + streams + 4);
  poke<std::uint32_t>(empty, streams + 4 - 4, 1);
  empty.insert(empty.end(), {0, 0, 0, 0});
  EXPECT_NE(error_of(empty).find("the state is empty"), std::string::npos);
}

// llama-server's slot files (POST /slots/N?action=save) pack the token list: -1, version 1, the
// count, the ids, the media chunk count. Read and written back byte for byte; another version,
// media chunks or a count that does not fill the list are refused with the reason.
TEST(LlamaState, LlamaServerSlotFilesKeepTheirTokenPacking) {
  vq::LlamaState st = make_state(vq::DType::F16, true);
  st.server_tokens = true;
  const auto bytes = vq::write_llama_state(st);
  // magic, version, n_token = 5 ids + 4, then -1, 1, 5, the ids, 0.
  std::uint32_t w[4];
  std::memcpy(w, bytes.data() + 8, sizeof(w));
  EXPECT_EQ(w[0], 9u);
  EXPECT_EQ(static_cast<std::int32_t>(w[1]), -1);
  EXPECT_EQ(w[2], 1u);
  EXPECT_EQ(w[3], 5u);
  std::int32_t first_id = 0, media = -7;
  std::memcpy(&first_id, bytes.data() + 24, 4);
  std::memcpy(&media, bytes.data() + 24 + 5 * 4, 4);
  EXPECT_EQ(first_id, 1);
  EXPECT_EQ(media, 0);
  const vq::LlamaState back = vq::read_llama_state(bytes, kModel, "slot.bin");
  expect_same(back, st);
  EXPECT_EQ(vq::write_llama_state(back), bytes);
  // The plain list of the same ids is 4 words shorter and reads as plain.
  vq::LlamaState plain = st;
  plain.server_tokens = false;
  EXPECT_EQ(vq::write_llama_state(plain).size() + 16, bytes.size());
  EXPECT_FALSE(vq::read_llama_state(vq::write_llama_state(plain), kModel).server_tokens);

  auto with = [&](std::size_t at, std::uint32_t v) {
    auto b = bytes;
    poke(b, at, v);
    return error_of(b);
  };
  EXPECT_NE(with(16, 2).find("llama-server token list version 2"), std::string::npos) << with(16, 2);
  EXPECT_NE(with(44, 1).find("1 media chunks: a multimodal slot is not read"), std::string::npos) << with(44, 1);
  EXPECT_NE(with(20, 6).find("6 ids claimed in 9 words"), std::string::npos) << with(20, 6);
  {  // a count of 4 whose "media count" (the 5th id's word) is 0: one word left over
    auto b = bytes;
    poke(b, 20, std::uint32_t{4});
    poke(b, 40, std::uint32_t{0});
    EXPECT_NE(error_of(b).find("1 words after its 4 ids and media count"), std::string::npos) << error_of(b);
  }
  EXPECT_NE(with(24, 0xfffffff0u).find("token 0 is -16 (byte 24)"), std::string::npos) << with(24, 0xfffffff0u);
  // A marker in a list too short to hold the packing.
  vq::LlamaState shortlist = make_state(vq::DType::F16, true);
  shortlist.tokens = {-1, 1, 0};
  EXPECT_NE(error_of(vq::write_llama_state(shortlist)).find("a llama-server token list of 3 words"), std::string::npos);
}

TEST(LlamaState, WriterConvertsToTheStatesTypeAndRefusesRaggedLayers) {
  auto st = make_state(vq::DType::F16, true, 4);
  auto f32 = st;
  for (auto& l : f32.layers) l = {l.keys.to(vq::DType::F32), l.values.to(vq::DType::F32)};
  EXPECT_EQ(vq::write_llama_state(f32), vq::write_llama_state(st));  // F16 values survive F32 and back
  auto ragged = st;
  ragged.layers[1].keys = ragged.layers[1].keys.slice(2, 0, 3);
  EXPECT_THROW(vq::write_llama_state(ragged), vq::InvalidArgument);
  auto bad_stream = st;
  bad_stream.stream = 1;
  EXPECT_THROW(vq::write_llama_state(bad_stream), vq::InvalidArgument);
  EXPECT_THROW(vq::write_llama_state(vq::LlamaState{}), vq::InvalidArgument);
}

}  // namespace
