// Private to the format stage: the .vqkv constants, little-endian byte helpers, the file header as
// a struct, and the block plan that the writer follows and the reader checks, so the two agree on
// the order of blocks by construction. docs/format.md is the field-by-field specification.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "veloxquant/cache/config.hpp"
#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace vq::vqkv {

// 0x89 first (a byte with the high bit set catches 7-bit transfers), then the name, then CR LF and
// 0x1A (catch newline conversion and stop a DOS `type`), as PNG does.
inline constexpr std::array<std::uint8_t, 8> kMagic = {0x89, 'V', 'Q', 'K', 'V', 0x0D, 0x0A, 0x1A};
// Version 2 (this writer): a CacheGen side may be context-coded (transform 2). Version 1 files
// (transform 0 only) are still read.
inline constexpr std::uint16_t kVersion = 2;
inline constexpr std::uint16_t kOldestVersion = 1;
inline constexpr std::size_t kPrefixBytes = 16;       // magic, version, flags, header body size
inline constexpr std::size_t kBlockHeaderBytes = 32;  // type, side, reserved, layer, begin, count, body size
inline constexpr std::size_t kChecksumBytes = 8;
// Limits far above any real model, so that header counts can be multiplied without overflow and a
// corrupt header is refused before anything is allocated.
inline constexpr std::uint32_t kMaxLayers = 1u << 12;
inline constexpr std::uint32_t kMaxBatch = 1u << 12, kMaxHeads = 1u << 12, kMaxDim = 1u << 16;
inline constexpr std::uint64_t kMaxTokens = std::uint64_t{1} << 32;
inline constexpr std::uint32_t kMaxGroupSize = 4096;  // bounds codes per byte of scales (see the header comment)
inline constexpr std::uint32_t kMaxHeaderBody = 1u << 26;
inline constexpr std::uint32_t kMaxMetadataEntries = 1u << 16;

// Numbers written to files: never renumber.
enum class BlockType : std::uint8_t { Tables = 1, Codes = 2, Rows = 3, End = 4 };
enum class CacheClass : std::uint8_t { Plain = 0, CacheGen = 1, Vq = 2 };
// A vq layer's basis (vq/basis.hpp's VqBasis, numbered for files).
inline constexpr std::uint8_t kVqBasisIdentity = 0, kVqBasisHadamard = 1, kVqBasisWeights = 2, kVqBasisProfile = 3;
// A vq CODES block may claim at most this many codes per byte of its body (0.002 bits per code),
// so that a file of n bytes never makes a reader allocate more than 4096 n codes: the vq coder
// spends no bytes on a coefficient whose codes are all 0, so nothing else bounds a block's rows.
// Only near-constant K/V reaches it (the writer refuses such a block; smaller chunks fit).
inline constexpr std::uint64_t kVqMaxCodesPerByte = 4096;
// A CacheGen layer's symbol transform (stream_codec.hpp's SymbolTransform numbers): per-channel
// tables of the codes, or (version 2) the context coder.
inline constexpr std::uint8_t kTransformCodes = 0;
inline constexpr std::uint8_t kTransformContext = 2;

std::uint64_t xxh64(std::span<const std::uint8_t> bytes);

// ---- writing ----
class ByteWriter {
 public:
  explicit ByteWriter(std::vector<std::uint8_t>& out) : out_(out) {}
  void u8(std::uint8_t v) { out_.push_back(v); }
  void u16(std::uint16_t v) { le(v, 2); }
  void u32(std::uint32_t v) { le(v, 4); }
  void u64(std::uint64_t v) { le(v, 8); }
  void bytes(const void* p, std::size_t n) {
    const auto at = out_.size();
    out_.resize(at + n);
    if (n) std::memcpy(out_.data() + at, p, n);
  }
  void str(const std::string& s) {
    u32(static_cast<std::uint32_t>(s.size()));
    bytes(s.data(), s.size());
  }

 private:
  void le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  std::vector<std::uint8_t>& out_;
};

// ---- reading: every read is bounds-checked and names the field it failed on ----
class ByteReader {
 public:
  ByteReader(std::span<const std::uint8_t> b, std::string where) : b_(b), where_(std::move(where)) {}
  std::size_t remaining() const { return b_.size() - pos_; }
  std::size_t pos() const { return pos_; }
  [[noreturn]] void fail(const std::string& why) const { throw FormatError(fmt::format("vqkv: {}: {}", where_, why)); }
  std::span<const std::uint8_t> take(std::size_t n, const char* what) {
    if (remaining() < n) fail(fmt::format("truncated ({} needs {} bytes, {} left)", what, n, remaining()));
    auto s = b_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  std::uint8_t u8(const char* what) { return take(1, what)[0]; }
  std::uint16_t u16(const char* what) { return static_cast<std::uint16_t>(le(take(2, what))); }
  std::uint32_t u32(const char* what) { return static_cast<std::uint32_t>(le(take(4, what))); }
  std::uint64_t u64(const char* what) { return le(take(8, what)); }
  // An integer field that must lie in [lo, hi].
  std::uint64_t ranged(std::uint64_t v, std::uint64_t lo, std::uint64_t hi, const char* what) const {
    if (v < lo || v > hi) fail(fmt::format("{} {} is out of range {}..{}", what, v, lo, hi));
    return v;
  }
  std::string str(std::size_t max, const char* what) {
    const std::uint32_t n = u32(what);
    if (n > max) fail(fmt::format("{} length {} is out of range (at most {})", what, n, max));
    const auto s = take(n, what);
    return std::string(reinterpret_cast<const char*>(s.data()), s.size());
  }

 private:
  static std::uint64_t le(std::span<const std::uint8_t> s) {
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < s.size(); ++i) v |= static_cast<std::uint64_t>(s[i]) << (8 * i);
    return v;
  }
  std::span<const std::uint8_t> b_;
  std::string where_;
  std::size_t pos_ = 0;
};

// ---- the file header ----
struct LayerEntry {
  CacheClass cls = CacheClass::Plain;
  std::uint64_t offset = 0;  // 0 or Header::tokens
  KVCacheConfig config;      // CacheGen
  std::uint8_t transform = kTransformCodes;  // CacheGen
  int scale_bits = 0;        // CacheGen: precision of its frequency tables
  VqConfig vq;                               // Vq
  std::optional<VqModelSource> vq_source;    // Vq: the model it was built from (none: identity sized from the data)
  std::uint64_t vq_quantized = 0;            // Vq: tokens held as codes, [0, Q) (Q <= offset)
};

struct Header {
  std::uint16_t version = kVersion;
  DType dtype = DType::F32;
  std::uint64_t tokens = 0;
  std::uint32_t batch = 0, heads = 0, key_dim = 0, value_dim = 0;  // all 0 when tokens == 0
  std::uint32_t chunk_tokens = 1;
  PromptMetadata metadata;
  std::vector<LayerEntry> layers;

  std::uint64_t slices() const { return std::uint64_t{batch} * heads; }
  std::uint32_t dim(int side) const { return side == 0 ? key_dim : value_dim; }
};

// The whole header section: prefix, body, checksum.
std::vector<std::uint8_t> write_header(const Header& h);
// Parse and verify the header section at the start of `file`; `consumed` receives its size.
Header read_header(std::span<const std::uint8_t> file, std::size_t& consumed);

// ---- blocks ----
struct BlockHeader {
  BlockType type = BlockType::End;
  std::uint8_t side = 0;  // 0 keys, 1 values
  std::uint32_t layer = 0;
  std::uint64_t token_begin = 0, token_count = 0;
  std::uint64_t body_size = 0;
};
inline const char* side_name(int side) { return side == 0 ? "keys" : "values"; }
std::string describe(const BlockHeader& b);

// Append a block (header, body, checksum) to `out`.
void write_block(std::vector<std::uint8_t>& out, const BlockHeader& b, std::span<const std::uint8_t> body);
// Parse and verify the block at file[pos]; advances pos past it. `body` receives its body.
BlockHeader read_block(std::span<const std::uint8_t> file, std::size_t& pos, std::span<const std::uint8_t>& body);

// One group of a CacheGen side: rows [start, start + n) quantized with one scale/minimum per channel.
struct Group {
  std::uint64_t start = 0, n = 0;
};
// The groups of a side from its pieces (each piece restarts the grouping, as per_call does), those
// starting before `limit`; count_groups counts them without building the list.
std::vector<Group> groups_of(std::span<const std::uint64_t> pieces, std::uint64_t group_size,
                             std::uint64_t limit = std::numeric_limits<std::uint64_t>::max());
std::uint64_t count_groups(std::span<const std::uint64_t> pieces, std::uint64_t group_size,
                           std::uint64_t limit = std::numeric_limits<std::uint64_t>::max());
// Per token of [t0, t0 + count) (the tokens of groups [g0, g0 + ng), which start at t0): 1 where one
// of those groups starts. A CODES block's group starts, as the context coder needs them.
std::vector<std::uint8_t> block_group_starts(const std::vector<Group>& groups, std::uint64_t g0, std::uint64_t ng, std::uint64_t t0,
                                             std::uint64_t count);

// A block the plan expects after the TABLES blocks.
struct PlannedBlock {
  BlockHeader header;  // body_size unknown (0) for Codes blocks
  std::uint64_t group_begin = 0, n_groups = 0;  // Codes
};

// The fewest bytes the blocks after the header section can take if the header is true, for a load
// of the first `prefix` tokens (prefix = h.tokens: the whole file, END included): the TABLES block
// of every non-empty CacheGen side; a plain side's rows (dtype bytes per slice and channel) and 40
// bytes per chunk; and for a CacheGen side at least dtype bytes per (slice, channel) for every
// group_size tokens, since each token lies in a group (8 bytes of scale and minimum per slice and
// channel) or in the residual (dtype bytes). A reader refuses a header whose bound exceeds the bytes
// it has before it reads on: the header's token count, shape and chunk size are then bounded by the
// file's size, and so is all the work that follows (docs/format.md, "Cost").
unsigned __int128 min_block_bytes(const Header& h, std::uint64_t prefix);

// The order of the blocks after the TABLES blocks, computed from the header and the groups of
// every CacheGen side (groups[layer][side], empty for plain layers). Lazy: next() yields one block
// at a time, so an absurd header costs nothing until its blocks fail to appear. It visits only
// positions that hold a block (a CacheGen side has one only in the chunks where one of its groups
// starts): a call costs O(log sides) whatever the chunk count, and the residual phase O(layers).
class BlockPlan {
 public:
  BlockPlan(const Header& h, const std::vector<std::array<std::vector<Group>, 2>>& groups);
  std::optional<PlannedBlock> next();
  std::uint64_t emitted() const { return emitted_; }
  // Positions looked at so far (chunk blocks, residual candidates, END): what the plan has cost.
  std::uint64_t steps() const { return steps_; }

 private:
  // (chunk, layer, side) of the next block of each side that has one more, smallest first.
  using Position = std::tuple<std::uint64_t, std::size_t, int>;
  const Header& h_;
  const std::vector<std::array<std::vector<Group>, 2>>& groups_;
  std::vector<std::array<std::size_t, 2>> cursor_;  // next group per (layer, side)
  std::priority_queue<Position, std::vector<Position>, std::greater<>> due_;
  std::uint64_t n_chunks_ = 0;
  std::size_t layer_ = 0;
  int side_ = 0;
  int phase_ = 0;  // 0 chunks, 1 residuals, 2 end, 3 done
  std::uint64_t emitted_ = 0, steps_ = 0;
  PlannedBlock chunk_block(std::uint64_t chunk, std::size_t layer, int side);
  std::optional<PlannedBlock> residual_block();
  // The chunk of the side's next block after `chunk` (its next group's), if it has one.
  std::optional<std::uint64_t> next_chunk(std::uint64_t chunk, std::size_t layer, int side) const;
};

// Codes [tokens][D] (uint8) <-> channel-major symbols [D][tokens] (uint16), both ways. Callers pad
// the channel-major side's leading dimension (kSymbolPad): rows of 2048 uint16 lie 4 KiB apart, and
// such strides alias in the L1 cache. 16x16 byte blocks are transposed in SSE2 registers (four
// rounds of byte unpacks transpose a 16x16 byte matrix); edges fall back to scalar loops. The naive
// loop was several times slower than the rANS coder itself.
inline constexpr std::size_t kSymbolPad = 32;
void codes_to_symbols(const std::uint8_t* codes, std::size_t tokens, std::size_t dim, std::uint16_t* symbols, std::size_t ld);
void symbols_to_codes(const std::uint16_t* symbols, std::size_t ld, std::size_t tokens, std::size_t dim, std::uint8_t* codes);

// Tokens of a CacheGen side in closed groups.
inline std::uint64_t quantized_tokens(const std::vector<Group>& g) { return g.empty() ? 0 : g.back().start + g.back().n; }

}  // namespace vq::vqkv
