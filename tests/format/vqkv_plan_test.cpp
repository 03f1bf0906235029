// The block plan (src/format/vqkv_layout.hpp) that the writer follows and the reader checks: its
// cost follows the blocks that exist, not the chunk count a header claims.
#include <gtest/gtest.h>

#include "../../src/format/vqkv_layout.hpp"

namespace {

using vq::vqkv::BlockType;
using vq::vqkv::Group;

// 2^32 tokens in chunks of 1 and 4096 layers, only the last one holding tokens: a CacheGen layer
// with two closed groups (tokens 0..4 and 4..8) and the rest in its residual. The plan used to step
// through every (chunk, layer, side) position, 2^32 x 4096 x 2 of them, to find its seven blocks.
TEST(VqkvPlan, VisitsOnlyPositionsThatHoldBlocks) {
  vq::vqkv::Header h;
  h.tokens = std::uint64_t{1} << 32;
  h.batch = h.heads = h.key_dim = h.value_dim = 1;
  h.chunk_tokens = 1;
  h.layers.resize(4096);
  auto& last = h.layers.back();
  last.cls = vq::vqkv::CacheClass::CacheGen;
  last.offset = h.tokens;
  last.config.cachegen_group_size = 4;
  std::vector<std::array<std::vector<Group>, 2>> groups(h.layers.size());
  groups.back()[0] = groups.back()[1] = {{0, 4}, {4, 4}};

  vq::vqkv::BlockPlan plan(h, groups);
  std::vector<vq::vqkv::PlannedBlock> got;
  while (auto p = plan.next()) got.push_back(*p);
  ASSERT_EQ(got.size(), 7u);
  const struct {
    BlockType type;
    int side;
    std::uint64_t begin, count, group;
  } want[] = {{BlockType::Codes, 0, 0, 4, 0},
              {BlockType::Codes, 1, 0, 4, 0},
              {BlockType::Codes, 0, 4, 4, 1},
              {BlockType::Codes, 1, 4, 4, 1},
              {BlockType::Rows, 0, 8, h.tokens - 8, 0},
              {BlockType::Rows, 1, 8, h.tokens - 8, 0},
              {BlockType::End, 0, 0, 0, 0}};
  for (std::size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i].header.type, want[i].type);
    EXPECT_EQ(got[i].header.side, want[i].side);
    EXPECT_EQ(got[i].header.token_begin, want[i].begin);
    EXPECT_EQ(got[i].header.token_count, want[i].count);
    if (want[i].type != BlockType::End) {
      EXPECT_EQ(got[i].header.layer, 4095u);
    }
    if (want[i].type == BlockType::Codes) {
      EXPECT_EQ(got[i].group_begin, want[i].group);
      EXPECT_EQ(got[i].n_groups, 1u);
    }
  }
  // Four chunk blocks, one residual candidate per (layer, side), END.
  EXPECT_EQ(plan.steps(), 4u + 2 * 4096 + 1);
}

// Plain layers hold a ROWS block in every chunk, interleaved with the CacheGen layers' CODES blocks
// in (chunk, layer, side) order.
TEST(VqkvPlan, InterleavesPlainRowsAndCodesInChunkOrder) {
  vq::vqkv::Header h;
  h.tokens = 10;
  h.batch = h.heads = h.key_dim = h.value_dim = 1;
  h.chunk_tokens = 4;
  h.layers.resize(3);
  h.layers[0].cls = vq::vqkv::CacheClass::CacheGen;
  h.layers[0].offset = 10;
  h.layers[0].config.cachegen_group_size = 8;
  h.layers[1].offset = 0;  // empty
  h.layers[2].offset = 10;  // plain
  std::vector<std::array<std::vector<Group>, 2>> groups(3);
  groups[0][0] = groups[0][1] = {{0, 8}};
  vq::vqkv::BlockPlan plan(h, groups);
  std::vector<std::tuple<BlockType, std::uint32_t, int, std::uint64_t, std::uint64_t>> got;
  while (auto p = plan.next()) got.emplace_back(p->header.type, p->header.layer, p->header.side, p->header.token_begin, p->header.token_count);
  const decltype(got) want = {{BlockType::Codes, 0, 0, 0, 8}, {BlockType::Codes, 0, 1, 0, 8}, {BlockType::Rows, 2, 0, 0, 4},
                              {BlockType::Rows, 2, 1, 0, 4},  {BlockType::Rows, 2, 0, 4, 4},  {BlockType::Rows, 2, 1, 4, 4},
                              {BlockType::Rows, 2, 0, 8, 2},  {BlockType::Rows, 2, 1, 8, 2},  {BlockType::Rows, 0, 0, 8, 2},
                              {BlockType::Rows, 0, 1, 8, 2},  {BlockType::End, 0, 0, 0, 0}};
  EXPECT_EQ(got, want);
}

// The bound a reader checks a header against: what the blocks of a whole load or of a prefix take
// at the least.
TEST(VqkvPlan, MinBlockBytesCountsWhatEveryNonEmptySideNeeds) {
  vq::vqkv::Header h;
  h.dtype = vq::DType::F16;
  h.tokens = 10;
  h.batch = 1;
  h.heads = 2;
  h.key_dim = 4;
  h.value_dim = 8;
  h.chunk_tokens = 4;
  h.layers.resize(2);
  h.layers[0].offset = 10;  // plain: rows of every token, 40 bytes per chunk
  EXPECT_EQ(vq::vqkv::min_block_bytes(h, 10), 40 + 3 * 40 * 2 + 10 * 2 * (4 + 8) * 2);
  EXPECT_EQ(vq::vqkv::min_block_bytes(h, 5), 2 * 40 * 2 + 8 * 2 * (4 + 8) * 2);  // two whole chunks, no END
  h.layers[0].cls = vq::vqkv::CacheClass::CacheGen;
  h.layers[0].config.cachegen_group_size = 4;  // TABLES, then >= one token's rows per group of 4
  EXPECT_EQ(vq::vqkv::min_block_bytes(h, 10), 40 + 2 * 44 + 3 * 2 * (4 + 8) * 2);
  EXPECT_EQ(vq::vqkv::min_block_bytes(h, 0), 2 * 44);
  h.tokens = std::uint64_t{1} << 32;
  h.layers[0].offset = h.tokens;
  h.layers[0].config.cachegen_group_size = 1;
  EXPECT_GT(vq::vqkv::min_block_bytes(h, h.tokens), static_cast<unsigned __int128>(std::uint64_t{1} << 32) * 24);
}

}  // namespace
