#include "veloxquant/peers/lmcache_cache.hpp"

#include <algorithm>
#include <bit>
#include <cmath>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/frequency_table.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "absmax_codes.hpp"
#include "chunk_io.hpp"
#include "peer_rows.hpp"

namespace vq {

namespace {

using peers_detail::ByteReader;
using peers_detail::put_varint;

constexpr float kF16Max = 65504.0f;
constexpr int kMaxChunk = 65536;

// Per-chunk table precision: a chunk's counts are multiples of 1/T, so 2^ceil(log2 T) slots hold
// them (nearly) exactly; more precision only lengthens the shipped table. 12 bits caps long chunks.
int table_scale_bits(std::int64_t tokens) {
  return std::clamp(static_cast<int>(std::bit_width(static_cast<std::uint64_t>(tokens - 1))), 1, 12);
}

bool within_f16(const Tensor& t) {
  const std::vector<float> v = t.to_f32_vector();
  return std::all_of(v.begin(), v.end(), [](float x) { return std::fabs(x) <= kF16Max; });  // false for NaN too
}

int max_q(int bins) { return bins / 2 - 1; }

// One chunk's codes (T * C token-major) and scales (T) of K and V, wherever they are held.
struct ChunkView {
  std::int64_t tokens;
  std::int64_t channels[2];
  std::span<const std::uint16_t> codes[2], scales[2];
};

// The wire bytes of a chunk (format in the header); the codes are within the bins' alphabets.
std::vector<std::uint8_t> encode_view(const ChunkView& v, const LmcacheBins& bins) {
  const std::int64_t T = v.tokens;
  std::vector<std::uint8_t> out;
  put_varint(out, static_cast<std::uint64_t>(T));
  const int scale_bits = table_scale_bits(T);
  for (int kv = 0; kv < 2; ++kv) {
    const auto codes = v.codes[kv];
    const std::int64_t C = v.channels[kv];
    const int alphabet = 2 * max_q(kv == 0 ? bins.key : bins.value) + 1;
    for (std::uint16_t s : v.scales[kv]) peers_detail::put_u16le(out, s);
    std::vector<std::vector<std::uint16_t>> columns(static_cast<std::size_t>(C), std::vector<std::uint16_t>(static_cast<std::size_t>(T)));
    std::vector<FrequencyTable> tables(static_cast<std::size_t>(C));
    std::vector<RansEncodeSegment> segments(static_cast<std::size_t>(C));
    std::vector<std::uint32_t> hist(static_cast<std::size_t>(alphabet));
    for (std::int64_t ch = 0; ch < C; ++ch) {
      auto& col = columns[static_cast<std::size_t>(ch)];
      std::fill(hist.begin(), hist.end(), 0u);
      for (std::int64_t t = 0; t < T; ++t) {
        col[static_cast<std::size_t>(t)] = codes[static_cast<std::size_t>(t * C + ch)];
        ++hist[col[static_cast<std::size_t>(t)]];
      }
      tables[static_cast<std::size_t>(ch)] = FrequencyTable::from_histogram(hist, scale_bits);
      tables[static_cast<std::size_t>(ch)].serialize_to(out);
      segments[static_cast<std::size_t>(ch)] = {col, &tables[static_cast<std::size_t>(ch)]};
    }
    peers_detail::put_stream(out, rans_encode(segments));
  }
  return out;
}

}  // namespace

void LmcacheConfig::validate() const {
  if (chunk < 1 || chunk > kMaxChunk) throw InvalidArgument(fmt::format("lmcache: chunk={} must be in 1..{}", chunk, kMaxChunk));
}

LmcacheBins lmcache_bins(int layer, int n_layers, bool scaled) {
  require(n_layers >= 1 && layer >= 0 && layer < n_layers,
          "lmcache: layer {} is not an attention layer of a {}-layer model", layer, n_layers);
  // LMCache's table is written for 32 layers: 32 bins below layer 10 (K) and layer 2 (V).
  if (scaled) return {32 * layer < 10 * n_layers ? 32 : 16, 32 * layer < 2 * n_layers ? 32 : 16};
  if (n_layers < 10) return {32, 32};
  return {layer < 10 ? 32 : 16, layer < 2 ? 32 : 16};
}

LmcacheKVCache::LmcacheKVCache(LmcacheConfig config, int layer, int n_layers)
    : TokenCodeKVCache("lmcache", config.chunk), config_(config), bins_(lmcache_bins(layer, n_layers, config.scaled)) {
  config_.validate();
}

void LmcacheKVCache::check_input(const Tensor& keys, const Tensor& values) const {
  if (!within_f16(keys) || !within_f16(values))
    throw InvalidArgument("lmcache: keys and values must be finite and within float16 range (|x| <= 65504): scales are float16");
}

void LmcacheKVCache::quantize_tokens(std::int64_t t0) {
  const std::int64_t B = keys_buf_.dim(0);
  for (int kv = 0; kv < 2; ++kv) {
    Tensor& buf = kv == 0 ? keys_buf_ : values_buf_;
    const std::int64_t C = channels(kv);
    const int mq = max_q(kv == 0 ? bins_.key : bins_.value);
    std::vector<float> x(static_cast<std::size_t>(C)), recon(static_cast<std::size_t>(C));
    for (std::int64_t b = 0; b < B; ++b) {
      auto& codes = codes_[kv][static_cast<std::size_t>(b)];
      auto& scales = scales_[kv][static_cast<std::size_t>(b)];
      for (std::int64_t s = t0; s < offset_; ++s) {
        peers_detail::gather_token(buf, b, s, x.data());
        scales[static_cast<std::size_t>(s)] = peers_detail::absmax_quantize(x.data(), C, mq, codes.data() + s * C, recon.data());
        peers_detail::scatter_token(buf, b, s, recon.data());
      }
    }
  }
}

std::vector<std::uint8_t> LmcacheKVCache::encode_chunk(std::int64_t b, std::int64_t c) const {
  const auto [t0, T] = chunk_range(c);
  ChunkView v{T, {}, {}, {}};
  for (int kv = 0; kv < 2; ++kv) {
    v.channels[kv] = channels(kv);
    v.codes[kv] = codes(b, kv).subspan(static_cast<std::size_t>(t0 * v.channels[kv]), static_cast<std::size_t>(T * v.channels[kv]));
    v.scales[kv] = scales(b, kv).subspan(static_cast<std::size_t>(t0), static_cast<std::size_t>(T));
  }
  return encode_view(v, bins_);
}

std::vector<std::uint8_t> LmcacheKVCache::encode_chunk(const Chunk& chunk, const LmcacheBins& bins) {
  require(chunk.tokens >= 1, "lmcache encode: a chunk holds at least one token");
  const auto T = static_cast<std::size_t>(chunk.tokens);
  ChunkView v{chunk.tokens, {}, {}, {}};
  for (int kv = 0; kv < 2; ++kv) {
    const auto& codes = chunk.codes[kv];
    const int alphabet = 2 * max_q(kv == 0 ? bins.key : bins.value) + 1;
    require(chunk.scales[kv].size() == T && !codes.empty() && codes.size() % T == 0,
            "lmcache encode: a chunk needs one scale and C >= 1 codes per token");
    require(std::all_of(codes.begin(), codes.end(), [&](std::uint16_t q) { return q < alphabet; }),
            "lmcache encode: a code is outside the alphabet of {} bins", kv == 0 ? bins.key : bins.value);
    v.channels[kv] = static_cast<std::int64_t>(codes.size() / T);
    v.codes[kv] = codes;
    v.scales[kv] = chunk.scales[kv];
  }
  return encode_view(v, bins);
}

LmcacheKVCache::Chunk LmcacheKVCache::decode_chunk(std::span<const std::uint8_t> bytes, std::int64_t key_channels,
                                                   std::int64_t value_channels, const LmcacheBins& bins, std::int64_t max_tokens) {
  require(key_channels >= 1 && value_channels >= 1 && max_tokens >= 1, "lmcache decode: channels and max_tokens must be >= 1");
  ByteReader r(bytes, "lmcache chunk");
  Chunk out;
  out.tokens = peers_detail::read_tokens(r, max_tokens);
  const auto T = static_cast<std::size_t>(out.tokens);
  for (int kv = 0; kv < 2; ++kv) {
    const auto C = static_cast<std::size_t>(kv == 0 ? key_channels : value_channels);
    const int alphabet = 2 * max_q(kv == 0 ? bins.key : bins.value) + 1;
    peers_detail::read_u16le(r, T, out.scales[kv], "scales");
    std::vector<FrequencyTable> tables(C);
    for (auto& table : tables) {
      std::size_t used = 0;
      table = FrequencyTable::deserialize(r.rest(), &used);
      if (table.alphabet_size() != alphabet)
        r.fail(fmt::format("a table has alphabet {}, expected {}", table.alphabet_size(), alphabet));
      r.skip(used);
    }
    const auto stream = peers_detail::read_stream(r);
    std::vector<std::uint16_t> columns(C * T);
    std::vector<RansDecodeSegment> segments(C);
    for (std::size_t ch = 0; ch < C; ++ch) segments[ch] = {std::span<std::uint16_t>(columns).subspan(ch * T, T), &tables[ch]};
    rans_decode(stream, segments);
    out.codes[kv].resize(C * T);
    for (std::size_t ch = 0; ch < C; ++ch)
      for (std::size_t t = 0; t < T; ++t) out.codes[kv][t * C + ch] = columns[ch * T + t];
  }
  if (r.remaining() != 0) r.fail("trailing bytes after the chunk");
  return out;
}

CacheBytes LmcacheKVCache::stored_bytes() const {
  if (offset_ == 0) return {};
  const std::int64_t B = keys_buf_.dim(0);
  CacheBytes out;
  for (int kv = 0; kv < 2; ++kv) {
    const double C = static_cast<double>(channels(kv));
    const int bits = peers_detail::fixed_code_bits(2 * max_q(kv == 0 ? bins_.key : bins_.value) + 1);
    out.fixed_bytes += static_cast<double>(B * offset_) * (C * bits / 8.0 + 2.0);
  }
  out.estimated_bytes = encoded_bytes();
  return out;
}

}  // namespace vq
