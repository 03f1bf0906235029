#include "veloxquant/cache/stream_codec.hpp"

#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/context_coder.hpp"

namespace vq {

namespace {

// Format limits, far above any real cache, so that the header's counts bound every allocation
// before it happens.
constexpr std::uint64_t kMaxDim = 1u << 16;
constexpr std::uint64_t kMaxSlices = 1u << 24;
constexpr std::uint64_t kMaxTokens = std::uint64_t{1} << 40;

void put_varint(std::vector<std::uint8_t>& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<std::uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<std::uint8_t>(v));
}

void put_f32s(std::vector<std::uint8_t>& out, std::span<const float> v) {
  // Little-endian float32, bit for bit (x86-64 and every platform this builds on are little-endian).
  static_assert(sizeof(float) == 4);
  const std::size_t at = out.size();
  out.resize(at + v.size() * 4);
  if (!v.empty()) std::memcpy(out.data() + at, v.data(), v.size() * 4);
}

void put_scales_and_minima(std::vector<std::uint8_t>& out, const QuantizedStream& stream, std::uint64_t per_slice) {
  for (std::int64_t s = 0; s < stream.slices(); ++s) {
    const auto sc = stream.scales(s);
    require(sc.size() == per_slice, "stream codec: internal error: scale count disagrees with the stream");
    put_f32s(out, sc);
  }
  for (std::int64_t s = 0; s < stream.slices(); ++s) {
    const auto mn = stream.minima(s);
    require(mn.size() == per_slice, "stream codec: internal error: minimum count disagrees with the stream");
    put_f32s(out, mn);
  }
}

class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> b) : b_(b) {}
  std::size_t remaining() const { return b_.size() - pos_; }
  std::size_t pos() const { return pos_; }
  std::span<const std::uint8_t> rest() const { return b_.subspan(pos_); }
  void skip(std::size_t n) {
    need(n, "data");
    pos_ += n;
  }
  std::uint8_t u8(const char* what) {
    need(1, what);
    return b_[pos_++];
  }
  std::uint64_t varint(std::uint64_t max, const char* what) {
    std::uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (shift > 63) throw FormatError(fmt::format("stream codec: {}: varint too long", what));
      const std::uint8_t byte = u8(what);
      const std::uint64_t part = static_cast<std::uint64_t>(byte & 0x7f);
      if (shift == 63 && part > 1) throw FormatError(fmt::format("stream codec: {}: varint overflows 64 bits", what));
      v |= part << shift;
      if (!(byte & 0x80)) break;
    }
    if (v > max) throw FormatError(fmt::format("stream codec: {} {} is out of range (at most {})", what, v, max));
    return v;
  }
  void f32s(std::span<float> out, const char* what) {
    need(out.size() * 4, what);
    if (!out.empty()) std::memcpy(out.data(), b_.data() + pos_, out.size() * 4);
    pos_ += out.size() * 4;
    for (const float x : out)
      if (!std::isfinite(x)) throw FormatError(fmt::format("stream codec: a {} value is not finite", what));
  }

 private:
  void need(std::size_t n, const char* what) const {
    if (remaining() < n)
      throw FormatError(fmt::format("stream codec: truncated input ({} needs {} bytes, {} left)", what, n, remaining()));
  }
  std::span<const std::uint8_t> b_;
  std::size_t pos_ = 0;
};

void read_scales_and_minima(Reader& r, DecodedStream& ds, std::size_t count) {
  if (count > r.remaining() / 8) throw FormatError("stream codec: truncated input (scales and minima)");
  ds.scales.resize(count);
  r.f32s(ds.scales, "scale");
  ds.minima.resize(count);
  r.f32s(ds.minima, "minimum");
}

std::int64_t groups_of(std::span<const std::int64_t> pieces, std::int64_t group_size) {
  std::int64_t g = 0;
  for (const auto t : pieces) g += (t + group_size - 1) / group_size;
  return g;
}

}  // namespace

StreamCodeSlices context_slices(const QuantizedStream& stream, std::size_t t0, std::size_t count) {
  const auto d = static_cast<std::size_t>(stream.dim());
  if (count == 0) count = static_cast<std::size_t>(stream.quantized_tokens()) - t0;
  require(t0 + count <= static_cast<std::size_t>(stream.quantized_tokens()), "stream codec: internal error: code count disagrees with the stream");
  StreamCodeSlices out;
  out.codes.resize(static_cast<std::size_t>(stream.slices()));
  for (std::int64_t s = 0; s < stream.slices(); ++s) {
    auto& c = out.codes[static_cast<std::size_t>(s)];
    c.resize(count * d);
    stream.unpack_codes(s, static_cast<std::int64_t>(t0), static_cast<std::int64_t>(count), c.data());
    out.spans.emplace_back(c);
  }
  return out;
}

ContextLayout context_layout(const QuantizedStream& stream) {
  return {static_cast<std::size_t>(stream.slices()), static_cast<std::size_t>(stream.quantized_tokens()),
          static_cast<std::size_t>(stream.slices() > 0 ? stream.dim() : 0), stream.bits(),
          group_starts(stream.segment_tokens(), stream.group_size())};
}

SymbolTransform default_transform(int bits) { return bits <= kContextMaxBits ? SymbolTransform::Context : SymbolTransform::Codes; }

int symbol_alphabet(int bits, SymbolTransform transform) {
  return transform == SymbolTransform::TokenDelta ? (1 << (bits + 1)) - 1 : (1 << bits);
}

void channel_symbols(const std::uint8_t* codes, std::size_t stride, std::span<const std::int64_t> piece_tokens, int bits,
                     SymbolTransform transform, std::vector<std::uint16_t>& out) {
  const int levels = (1 << bits) - 1;
  std::size_t t = 0;
  for (const std::int64_t n : piece_tokens) {
    int prev = 0;
    for (std::int64_t i = 0; i < n; ++i, ++t) {
      const int code = codes[t * stride];
      if (transform == SymbolTransform::Codes) {
        out.push_back(static_cast<std::uint16_t>(code));
      } else {
        out.push_back(static_cast<std::uint16_t>(code - prev + levels));
        prev = code;
      }
    }
  }
}

std::vector<std::uint8_t> encode_stream(const QuantizedStream& stream, const StreamCodecOptions& options) {
  EncodedStreamSize size;
  return encode_stream(stream, options, size);
}

std::vector<std::uint8_t> encode_stream(const QuantizedStream& stream, const StreamCodecOptions& options, EncodedStreamSize& size) {
  const int bits = stream.bits();
  const SymbolTransform transform = options.transform.value_or(default_transform(bits));
  require(transform == SymbolTransform::Codes || transform == SymbolTransform::TokenDelta || transform == SymbolTransform::Context,
          "stream codec: unknown symbol transform");
  require(transform != SymbolTransform::Context || bits <= kContextMaxBits, "stream codec: the Context transform codes at most 4-bit codes");
  const auto dim = static_cast<std::uint64_t>(stream.slices() > 0 ? stream.dim() : 0);
  const auto slices = static_cast<std::uint64_t>(stream.slices());
  const auto tokens = static_cast<std::uint64_t>(stream.quantized_tokens());
  const std::vector<std::int64_t> pieces = stream.segment_tokens();
  const auto groups = static_cast<std::uint64_t>(stream.n_groups());
  require(dim <= kMaxDim && slices <= kMaxSlices && tokens <= kMaxTokens, "stream codec: stream too large for the format");
  require(static_cast<std::uint64_t>(groups_of(pieces, stream.group_size())) == groups,
          "stream codec: internal error: group count disagrees with the pieces");

  std::vector<std::uint8_t> out;
  out.push_back(kStreamCodecVersion);
  out.push_back(static_cast<std::uint8_t>(bits));
  out.push_back(static_cast<std::uint8_t>(transform));
  put_varint(out, dim);
  put_varint(out, slices);
  put_varint(out, static_cast<std::uint64_t>(stream.group_size()));
  put_varint(out, tokens);
  put_varint(out, groups);
  put_varint(out, pieces.size());
  for (const auto t : pieces) put_varint(out, static_cast<std::uint64_t>(t));
  size = {};
  size.header = out.size();
  if (tokens * dim * slices == 0) {
    size.total = out.size();
    return out;
  }

  if (transform == SymbolTransform::Context) {
    put_scales_and_minima(out, stream, groups * dim);
    size.metadata = out.size() - size.header;
    const auto codes = context_slices(stream);
    ContextCodedSize cs;
    const auto block = context_encode(ContextSlices(codes), context_layout(stream), &cs, options.kernel);
    out.insert(out.end(), block.begin(), block.end());
    size.tables = cs.model + cs.tables;
    size.payload = cs.payload;
    size.total = out.size();
    return out;
  }
  const int alphabet = symbol_alphabet(bits, transform);
  const int scale_bits = options.scale_bits != 0 ? options.scale_bits : table_scale_bits(alphabet);
  const std::size_t n = tokens, d = dim;
  std::vector<std::uint16_t> symbols;
  symbols.reserve(n * d * slices);
  std::vector<FrequencyTable> tables;
  tables.reserve(d * slices);
  for (std::uint64_t s = 0; s < slices; ++s) {
    const auto codes = stream.codes(static_cast<std::int64_t>(s));
    require(codes.size() == n * d, "stream codec: internal error: code count disagrees with the stream");
    for (std::size_t c = 0; c < d; ++c) {
      const std::size_t at = symbols.size();
      channel_symbols(codes.data() + c, d, pieces, bits, transform, symbols);
      tables.push_back(FrequencyTable::from_symbols(std::span(symbols).subspan(at, n), alphabet, scale_bits));
      tables.back().serialize_to(out);
    }
  }
  size.tables = out.size() - size.header;
  put_scales_and_minima(out, stream, groups * d);
  size.metadata = out.size() - size.header - size.tables;
  std::vector<RansEncodeSegment> segs(tables.size());
  for (std::size_t i = 0; i < tables.size(); ++i) segs[i] = {std::span<const std::uint16_t>(symbols).subspan(i * n, n), &tables[i]};
  rans_encode_append(out, segs, options.kernel);
  size.total = out.size();
  size.payload = size.total - size.header - size.tables - size.metadata;
  return out;
}

DecodedStream decode_stream(std::span<const std::uint8_t> bytes, std::uint64_t max_codes, RansKernel kernel) {
  Reader r(bytes);
  DecodedStream ds;
  const std::uint8_t version = r.u8("version");
  if (version != kStreamCodecVersion)
    throw FormatError(fmt::format("stream codec: unsupported version {} (this build reads {})", version, kStreamCodecVersion));
  ds.bits = r.u8("bits");
  if (ds.bits < 1 || ds.bits > 8) throw FormatError(fmt::format("stream codec: bits {} is out of range 1..8", ds.bits));
  const std::uint8_t tr = r.u8("transform");
  if (tr > 2) throw FormatError(fmt::format("stream codec: unknown symbol transform {}", tr));
  ds.transform = static_cast<SymbolTransform>(tr);
  const std::uint64_t dim = r.varint(kMaxDim, "dim");
  const std::uint64_t slices = r.varint(kMaxSlices, "slices");
  const std::uint64_t group_size = r.varint(std::numeric_limits<std::int32_t>::max(), "group size");
  if (group_size == 0) throw FormatError("stream codec: group size 0");
  const std::uint64_t tokens = r.varint(kMaxTokens, "tokens");
  const std::uint64_t groups = r.varint(tokens, "groups");
  const std::uint64_t n_pieces = r.varint(tokens, "pieces");
  if (n_pieces > r.remaining()) throw FormatError("stream codec: truncated input (piece list)");
  ds.piece_tokens.reserve(n_pieces);
  std::uint64_t sum = 0;
  for (std::uint64_t i = 0; i < n_pieces; ++i) {
    const std::uint64_t t = r.varint(tokens - sum, "piece tokens");
    if (t == 0) throw FormatError("stream codec: empty piece");
    sum += t;
    ds.piece_tokens.push_back(static_cast<std::int64_t>(t));
  }
  if (sum != tokens) throw FormatError(fmt::format("stream codec: pieces hold {} tokens, header says {}", sum, tokens));
  if (static_cast<std::uint64_t>(groups_of(ds.piece_tokens, static_cast<std::int64_t>(group_size))) != groups)
    throw FormatError("stream codec: group count disagrees with the pieces and the group size");
  ds.dim = static_cast<int>(dim);
  ds.slices = static_cast<std::int64_t>(slices);
  ds.group_size = static_cast<int>(group_size);
  ds.tokens = static_cast<std::int64_t>(tokens);
  ds.groups = static_cast<std::int64_t>(groups);

  // slices <= 2^24, dim <= 2^16, tokens <= 2^40: compare without overflow.
  const unsigned __int128 total128 = static_cast<unsigned __int128>(tokens) * dim * slices;
  if (total128 > max_codes)
    throw FormatError(fmt::format("stream codec: input holds more codes than expected (at most {})", max_codes));
  const auto total = static_cast<std::size_t>(total128);
  if (total == 0) {
    if (r.remaining() != 0) throw FormatError("stream codec: trailing bytes after an empty stream");
    return ds;
  }

  const auto d = static_cast<std::size_t>(dim), n = static_cast<std::size_t>(tokens);
  const std::size_t meta = static_cast<std::size_t>(groups) * d;
  if (ds.transform == SymbolTransform::Context) {
    if (ds.bits > kContextMaxBits) throw FormatError(fmt::format("stream codec: the Context transform holds at most 4-bit codes, not {}", ds.bits));
    read_scales_and_minima(r, ds, meta * slices);
    ds.codes.resize(total);
    const ContextLayout layout{static_cast<std::size_t>(slices), n, d, ds.bits, group_starts(ds.piece_tokens, ds.group_size)};
    context_decode(r.rest(), layout, ds.codes, kernel);
    return ds;
  }
  const int alphabet = symbol_alphabet(ds.bits, ds.transform);
  const std::size_t n_tables = d * slices;
  if (n_tables * 3 > r.remaining()) throw FormatError("stream codec: truncated input (tables)");  // a table takes >= 3 bytes
  std::vector<FrequencyTable> tables;
  tables.reserve(n_tables);
  for (std::size_t i = 0; i < n_tables; ++i) {
    std::size_t used = 0;
    tables.push_back(FrequencyTable::deserialize(r.rest(), &used));
    r.skip(used);
    if (tables.back().alphabet_size() != alphabet)
      throw FormatError(fmt::format("stream codec: table {} has alphabet {}, expected {}", i, tables.back().alphabet_size(), alphabet));
  }
  read_scales_and_minima(r, ds, meta * slices);

  std::vector<std::uint16_t> symbols(total);
  std::vector<RansDecodeSegment> segs(n_tables);
  for (std::size_t i = 0; i < n_tables; ++i) segs[i] = {std::span<std::uint16_t>(symbols).subspan(i * n, n), &tables[i]};
  rans_decode(r.rest(), segs, kernel);

  const int levels = (1 << ds.bits) - 1;
  ds.codes.resize(total);
  for (std::size_t s = 0; s < slices; ++s) {
    std::uint8_t* codes = ds.codes.data() + s * n * d;
    for (std::size_t c = 0; c < d; ++c) {
      const std::uint16_t* sym = symbols.data() + (s * d + c) * n;
      if (ds.transform == SymbolTransform::Codes) {
        for (std::size_t t = 0; t < n; ++t) codes[t * d + c] = static_cast<std::uint8_t>(sym[t]);
        continue;
      }
      std::size_t t = 0;
      for (const std::int64_t len : ds.piece_tokens) {
        int prev = 0;
        for (std::int64_t i = 0; i < len; ++i, ++t) {
          const int code = prev + static_cast<int>(sym[t]) - levels;
          if (code < 0 || code > levels)
            throw FormatError(fmt::format("stream codec: token delta leaves the code range 0..{} (corrupt input)", levels));
          codes[t * d + c] = static_cast<std::uint8_t>(code);
          prev = code;
        }
      }
    }
  }
  return ds;
}

}  // namespace vq
