// Context-modelled rANS for a stream of quantization codes, decoded two codes per rANS step: each
// code's table is chosen by its context, the tables are pooled over the stream's channels (a short
// stream pays for a few tables, not one per channel), and the decoder looks up a PAIR of codes of
// one channel per slot lookup.
//
// What a reader must know first:
// - Input: codes of `slices` x `tokens` x `dim` (token-major within a slice, the cache's layout),
//   each 0 .. A - 1 with A = 2^bits, bits 1..4. The raw context of code (s, t, c) is A where a
//   quantization group starts at token t (the grid changes there, so the previous code says
//   little), else the previous code (s, t - 1, c). A + 1 raw contexts in all.
// - The MODEL (ContextModel) merges raw contexts into classes greedily (the pair whose merge lowers
//   the estimated payload + table bytes most, until no merge lowers it) and holds one table per
//   class (table_scale_bits(A) = 10 bits). iid codes end with one class (a pooled order-0 model);
//   codes that drift slowly keep many. It is built once per stream (or per .vqkv side, for all of
//   its chunks) and serialised once.
// - ROWS: tokens are taken in pairs (t, t + 1) unless t + 1 starts a group (or t is the last
//   token); then token t is a row of its own. A pair row codes, per (slice, channel), the unit
//   (a, b) = (code at t, code at t + 1) in one rANS step with a 12-bit PAIR table derived from the
//   model (no bytes travel for it): P(a, b) = P(a | class of t's context) * P(b | class of a),
//   quantised to 2^12 row by row (each a keeps exactly 4 x its 10-bit frequency; see
//   pair_frequency_table). A single row codes the code at t alone with its class table. Both are
//   the same model; the pair tables cost < 0.3 % over its entropy on the synthetic K/V (< 0.01 %
//   on stories260K's near-uniform codes), and halve the decoder's lookups, multiplies and refills.
// - The rANS stream (rans.hpp's lanes: 32-bit states in [2^15, 2^31), 16-bit words, 32 lanes,
//   unit i in lane i % 32) holds the units row by row, all channels of a row together ((slice,
//   channel) index s * dim + c; C = slices * dim units per row). A unit's context is the last code
//   of the previous row, C units back: with C >= 32 never inside its own group of 32, so the AVX2
//   decoder decodes 32 units (64 codes) at once with one gather per 8 lanes (C a multiple of 32;
//   else the scalar loop, same result).
// - Block format (what context_encode writes; the .vqkv container stores the model once per side
//   and a payload per chunk):
//     model:   u8 K (classes, 1 .. A + 1); class[A + 1], each raw context's class in ceil(log2 K)
//              bits, LSB first, padded to a byte (absent when K = 1); K FrequencyTables
//              (frequency_table.hpp: alphabet A, 10 bits).
//     payload: varint n' (units rANS-coded: all but the tail below); u32 state[min(n', 32)] (final
//              encoder states); u16 words, to the end.
//   The last 32 * floor(16 / (2 bits)) units ride in the lanes' start states ("bits back"; only
//   when there are 32 units more than that): unit n' + 32 q + j at the next bit of lane j's state
//   - 2^15, a pair as a | b << bits, a single code as a; they cost ~1.6 bits per lane instead of
//   16. The shape and the group starts are the caller's (like a rANS stream's segments).
// - Decoding validates everything and throws vq::FormatError (class count and map, tables, unit
//   count, states, words missing or left over, a final state that holds no tail).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "veloxquant/entropy/frequency_table.hpp"
#include "veloxquant/entropy/rans.hpp"

namespace vq {

inline constexpr int kContextMaxBits = 4;
inline constexpr int kContextMaxContexts = (1 << kContextMaxBits) + 1;  // raw contexts: 16 codes + group start
inline constexpr int kPairScaleBits = 12;                                // precision of the derived pair tables

struct ContextLayout {
  std::size_t slices = 0, tokens = 0, dim = 0;
  int bits = 4;
  std::vector<std::uint8_t> group_start;  // per token: 1 where a quantization group starts (token 0 must)
  std::size_t size() const { return slices * tokens * dim; }
};

// Group starts of consecutive pieces (each piece's groups start at its first token) of
// group_size-token groups: what a cache stream's segment list describes.
std::vector<std::uint8_t> group_starts(std::span<const std::int64_t> piece_tokens, int group_size);

// Codes of one stream, one span per slice (tokens * dim codes each): the cache's streams keep a
// buffer per slice, and a .vqkv chunk is a token range of each.
using ContextSlices = std::span<const std::span<const std::uint8_t>>;
using ContextSlicesOut = std::span<const std::span<std::uint8_t>>;

class ContextModel {
 public:
  // Histogram of the raw contexts over the codes (throws InvalidArgument on an inconsistent layout
  // or a code >= 2^bits), then the greedy class merge and the class tables.
  static ContextModel build(ContextSlices codes, const ContextLayout& layout);
  static ContextModel build(std::span<const std::uint8_t> codes, const ContextLayout& layout);
  // Parse a serialised model of `bits`-bit codes at the start of `bytes`; `consumed` receives its
  // size. Throws FormatError.
  static ContextModel deserialize(std::span<const std::uint8_t> bytes, int bits, std::size_t* consumed = nullptr);
  void serialize_to(std::vector<std::uint8_t>& out) const;
  std::size_t serialized_size() const;

  int bits() const { return bits_; }
  int classes() const { return static_cast<int>(tables_.size()); }
  int class_of(int raw_context) const { return cls_[static_cast<std::size_t>(raw_context)]; }
  const FrequencyTable& table(int k) const { return tables_[static_cast<std::size_t>(k)]; }
  friend bool operator==(const ContextModel& a, const ContextModel& b) {
    return a.bits_ == b.bits_ && a.cls_ == b.cls_ && a.tables_ == b.tables_;
  }

 private:
  int bits_ = 4;
  std::array<std::uint8_t, kContextMaxContexts> cls_{};
  std::vector<FrequencyTable> tables_;
};

// The 12-bit table of the units (a | b << 4) of a pair row whose first code has class k: the
// product of table k and, for each a, the table of a's class, quantised row by row. Exposed for
// tests and for the size analysis in docs/benchmarks.md.
FrequencyTable pair_frequency_table(const ContextModel& model, int k);

struct ContextCodedSize {
  std::size_t model = 0;    // K and the class map
  std::size_t tables = 0;   // the class tables
  std::size_t payload = 0;  // the rANS stream
  std::size_t classes = 0;
};

namespace context_detail {
struct EncoderTables;
struct DecoderTables;
}  // namespace context_detail

// Codes payloads with one model: builds the encoder's constants once (two divisions' worth per
// pair), for any number of payloads. Not thread-safe while encoding (it keeps a scratch buffer).
class ContextEncoder {
 public:
  explicit ContextEncoder(const ContextModel& model, RansKernel kernel = RansKernel::Auto);
  ~ContextEncoder();
  ContextEncoder(ContextEncoder&&) noexcept;
  ContextEncoder& operator=(ContextEncoder&&) noexcept;
  // Appends the payload of `codes` to `out`. Throws InvalidArgument on an inconsistent layout, codes
  // the model cannot code (a code >= 2^bits, or one its table gives frequency 0: build the model
  // from the same codes, or from codes that include them).
  void encode(ContextSlices codes, const ContextLayout& layout, std::vector<std::uint8_t>& out) const;
  void encode(std::span<const std::uint8_t> codes, const ContextLayout& layout, std::vector<std::uint8_t>& out) const;

 private:
  std::unique_ptr<context_detail::EncoderTables> t_;
};

// Decodes payloads with one model; builds the pair (and, when a layout has single rows, the
// single) slot tables on first use and keeps them. Not thread-safe.
class ContextDecoder {
 public:
  explicit ContextDecoder(const ContextModel& model, RansKernel kernel = RansKernel::Auto);
  ~ContextDecoder();
  ContextDecoder(ContextDecoder&&) noexcept;
  ContextDecoder& operator=(ContextDecoder&&) noexcept;
  // Decodes exactly `payload` into `codes`. Throws FormatError on malformed, truncated or trailing
  // input, InvalidArgument on an inconsistent layout or output size.
  void decode(std::span<const std::uint8_t> payload, const ContextLayout& layout, ContextSlicesOut codes) const;
  void decode(std::span<const std::uint8_t> payload, const ContextLayout& layout, std::span<std::uint8_t> codes) const;

 private:
  std::unique_ptr<context_detail::DecoderTables> t_;
};

// The unit count a payload's header states (FormatError when malformed), and the count a layout
// needs: what a container checks without decoding.
std::uint64_t context_payload_units(std::span<const std::uint8_t> payload);
std::uint64_t context_coded_units(const ContextLayout& layout);

// Model and payload in one block: ContextModel::build, then the model's bytes, then the payload.
// `kernel`: Scalar is the reference (division in the encoder); the AVX2 kernels give the same bytes.
std::vector<std::uint8_t> context_encode(std::span<const std::uint8_t> codes, const ContextLayout& layout,
                                         ContextCodedSize* size = nullptr, RansKernel kernel = RansKernel::Auto);
std::vector<std::uint8_t> context_encode(ContextSlices codes, const ContextLayout& layout, ContextCodedSize* size = nullptr,
                                         RansKernel kernel = RansKernel::Auto);

// Decodes exactly `bytes` (a model and a payload) into `codes` (layout.size() codes). Throws
// FormatError on malformed, truncated or trailing input, InvalidArgument on an inconsistent layout.
void context_decode(std::span<const std::uint8_t> bytes, const ContextLayout& layout, std::span<std::uint8_t> codes,
                    RansKernel kernel = RansKernel::Auto);
void context_decode(std::span<const std::uint8_t> bytes, const ContextLayout& layout, ContextSlicesOut codes,
                    RansKernel kernel = RansKernel::Auto);

}  // namespace vq
