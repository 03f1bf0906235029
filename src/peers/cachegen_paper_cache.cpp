#include "veloxquant/peers/cachegen_paper_cache.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/rans.hpp"
#include "absmax_codes.hpp"
#include "chunk_io.hpp"
#include "peer_rows.hpp"

namespace vq {

namespace {

using peers_detail::ByteReader;
using peers_detail::put_varint;

constexpr float kMaxAbs = 32752.0f;  // as the profiler: a delta's float16 scale stays finite

bool within_range(const Tensor& t) {
  const std::vector<float> v = t.to_f32_vector();
  return std::all_of(v.begin(), v.end(), [](float x) { return std::fabs(x) <= kMaxAbs; });  // false for NaN too
}

float layer_bin(const CachegenPaperProfile& p, int layer) {
  CachegenPaperConfig cfg;
  cfg.group = p.group;
  cfg.bins = p.bins;
  return static_cast<float>(cfg.bin_for_layer(layer, p.n_layers()));
}

// The stream's segments for one chunk of one K/V over `col` (C * T symbols laid out by
// column_index): per channel, its anchor symbols (anchor table), then its delta symbols (delta table).
template <class Seg, class Ptr>
std::vector<Seg> chunk_segments(const CachegenPaperProfile::Tables& tb, Ptr col, std::int64_t T, int group) {
  const std::int64_t anchors = (T + group - 1) / group;
  std::vector<Seg> segs;
  for (std::int64_t c = 0; c < tb.channels; ++c) {
    Ptr base = col + c * T;
    segs.push_back({{base, static_cast<std::size_t>(anchors)}, &tb.anchor[static_cast<std::size_t>(c)]});
    segs.push_back({{base + anchors, static_cast<std::size_t>(T - anchors)}, &tb.delta[static_cast<std::size_t>(c)]});
  }
  return segs;
}

// Index in `columns` (as chunk_segments lays it out) of token t's symbol of channel c.
std::size_t column_index(std::int64_t c, std::int64_t t, std::int64_t T, int group) {
  const std::int64_t anchors = (T + group - 1) / group;
  const std::int64_t i = t % group == 0 ? t / group : anchors + (t - t / group - 1);
  return static_cast<std::size_t>(c * T + i);
}

// One chunk's symbols (T * C token-major) and scales (T) of K and V, wherever they are held.
struct ChunkView {
  std::int64_t tokens;
  std::span<const std::uint16_t> codes[2], scales[2];
};

// The wire bytes of a chunk of attention layer `layer` (format in the header); the sizes match the profile.
std::vector<std::uint8_t> encode_view(const ChunkView& v, const CachegenPaperProfile& profile, int layer) {
  const std::int64_t T = v.tokens;
  const int G = profile.group;
  std::vector<std::uint8_t> out;
  put_varint(out, static_cast<std::uint64_t>(T));
  for (int kv = 0; kv < 2; ++kv) {
    const auto& tb = profile.layers[static_cast<std::size_t>(layer)][kv];
    const std::int64_t C = tb.channels;
    for (std::uint16_t s : v.scales[kv]) peers_detail::put_u16le(out, s);
    std::vector<std::uint16_t> col(static_cast<std::size_t>(C * T));
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t ch = 0; ch < C; ++ch) col[column_index(ch, t, T, G)] = v.codes[kv][static_cast<std::size_t>(t * C + ch)];
    const auto segments = chunk_segments<RansEncodeSegment>(tb, static_cast<const std::uint16_t*>(col.data()), T, G);
    peers_detail::put_stream(out, rans_encode(segments));
  }
  return out;
}

}  // namespace

CachegenPaperKVCache::CachegenPaperKVCache(CachegenPaperConfig config, int layer, int n_layers,
                                           std::shared_ptr<const CachegenPaperProfile> profile)
    : TokenCodeKVCache("cachegen_paper", config.chunk), config_(std::move(config)), layer_(layer), profile_(std::move(profile)) {
  config_.validate();
  require(profile_ != nullptr, "cachegen_paper: the cache needs a profile (veloxquant profile, or one made on the fly)");
  profile_->check_matches(config_, n_layers);
  bin_ = static_cast<float>(config_.bin_for_layer(layer, n_layers));
  max_q_ = cachegen_delta_max_q(config_.bin_for_layer(layer, n_layers));
}

void CachegenPaperKVCache::check_input(const Tensor& keys, const Tensor& values) const {
  const auto& tables = profile_->layers[static_cast<std::size_t>(layer_)];
  if (keys.dim(1) * keys.dim(3) != tables[0].channels || values.dim(1) * values.dim(3) != tables[1].channels)
    throw InvalidArgument(fmt::format("cachegen_paper: layer {} has {} key and {} value channels per token, the profile {} and {}", layer_,
                                      keys.dim(1) * keys.dim(3), values.dim(1) * values.dim(3), tables[0].channels, tables[1].channels));
  if (!within_range(keys) || !within_range(values))
    throw InvalidArgument(fmt::format("cachegen_paper: keys and values must be finite with |x| <= {} (delta scales are float16)", kMaxAbs));
}

void CachegenPaperKVCache::quantize_tokens(std::int64_t t0) {
  const std::int64_t B = keys_buf_.dim(0);
  const int G = config_.group;
  for (int kv = 0; kv < 2; ++kv) {
    Tensor& buf = kv == 0 ? keys_buf_ : values_buf_;
    const std::int64_t C = channels(kv);
    std::vector<float> x(static_cast<std::size_t>(C)), recon(static_cast<std::size_t>(C)), anchor(static_cast<std::size_t>(C));
    for (std::int64_t b = 0; b < B; ++b) {
      auto& codes = codes_[kv][static_cast<std::size_t>(b)];
      auto& scales = scales_[kv][static_cast<std::size_t>(b)];
      std::int64_t anchor_of = -1;  // the token whose reconstruction `anchor` holds
      for (std::int64_t s = t0; s < offset_; ++s) {
        peers_detail::gather_token(buf, b, s, x.data());
        std::uint16_t* sym = codes.data() + s * C;
        if (s % G == 0) {
          scales[static_cast<std::size_t>(s)] = peers_detail::absmax_quantize(x.data(), C, kCachegenAnchorMaxQ, sym, recon.data());
          anchor = recon;
          anchor_of = s;
        } else {
          const std::int64_t a = s - s % G;
          if (anchor_of != a) {  // the anchor came in an earlier call: rebuild it from its codes
            for (std::int64_t c = 0; c < C; ++c)
              anchor[static_cast<std::size_t>(c)] =
                  peers_detail::absmax_dequantize(codes[static_cast<std::size_t>(a * C + c)], kCachegenAnchorMaxQ, scales[static_cast<std::size_t>(a)]);
            anchor_of = a;
          }
          scales[static_cast<std::size_t>(s)] = peers_detail::delta_quantize(x.data(), anchor.data(), C, bin_, max_q_, sym, recon.data());
        }
        peers_detail::scatter_token(buf, b, s, recon.data());
      }
    }
  }
}

std::vector<std::uint8_t> CachegenPaperKVCache::encode_chunk(std::int64_t b, std::int64_t c) const {
  const auto [t0, T] = chunk_range(c);
  ChunkView v{T, {}, {}};
  for (int kv = 0; kv < 2; ++kv) {
    const std::int64_t C = profile_->layers[static_cast<std::size_t>(layer_)][kv].channels;
    v.codes[kv] = codes(b, kv).subspan(static_cast<std::size_t>(t0 * C), static_cast<std::size_t>(T * C));
    v.scales[kv] = scales(b, kv).subspan(static_cast<std::size_t>(t0), static_cast<std::size_t>(T));
  }
  return encode_view(v, *profile_, layer_);
}

std::vector<std::uint8_t> CachegenPaperKVCache::encode_chunk(const Chunk& chunk, const CachegenPaperProfile& profile, int layer) {
  require(layer >= 0 && layer < profile.n_layers(), "cachegen_paper encode: no layer {} in the profile", layer);
  require(chunk.tokens >= 1, "cachegen_paper encode: a chunk holds at least one token");
  const auto T = static_cast<std::size_t>(chunk.tokens);
  ChunkView v{chunk.tokens, {}, {}};
  for (int kv = 0; kv < 2; ++kv) {
    const auto C = static_cast<std::size_t>(profile.layers[static_cast<std::size_t>(layer)][kv].channels);
    require(chunk.scales[kv].size() == T && chunk.codes[kv].size() == C * T,
            "cachegen_paper encode: a chunk needs one scale and the profile's channels of symbols per token");
    v.codes[kv] = chunk.codes[kv];
    v.scales[kv] = chunk.scales[kv];
  }
  return encode_view(v, profile, layer);  // rans_encode rejects a symbol outside its table
}

CachegenPaperKVCache::Chunk CachegenPaperKVCache::decode_chunk(std::span<const std::uint8_t> bytes, const CachegenPaperProfile& profile,
                                                               int layer, std::int64_t max_tokens) {
  require(layer >= 0 && layer < profile.n_layers(), "cachegen_paper decode: no layer {} in the profile", layer);
  require(max_tokens >= 1, "cachegen_paper decode: max_tokens must be >= 1");
  ByteReader r(bytes, "cachegen_paper chunk");
  Chunk out;
  out.tokens = peers_detail::read_tokens(r, max_tokens);
  const std::int64_t T = out.tokens;
  for (int kv = 0; kv < 2; ++kv) {
    const auto& tb = profile.layers[static_cast<std::size_t>(layer)][kv];
    const std::int64_t C = tb.channels;
    peers_detail::read_u16le(r, static_cast<std::size_t>(T), out.scales[kv], "scales");
    const auto stream = peers_detail::read_stream(r);
    std::vector<std::uint16_t> col(static_cast<std::size_t>(C * T));
    const auto segments = chunk_segments<RansDecodeSegment>(tb, col.data(), T, profile.group);
    rans_decode(stream, segments);
    out.codes[kv].resize(static_cast<std::size_t>(C * T));
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t ch = 0; ch < C; ++ch) out.codes[kv][static_cast<std::size_t>(t * C + ch)] = col[column_index(ch, t, T, profile.group)];
  }
  if (r.remaining() != 0) r.fail("trailing bytes after the chunk");
  return out;
}

std::vector<float> CachegenPaperKVCache::dequantize_chunk(const Chunk& chunk, int kv, const CachegenPaperProfile& profile, int layer) {
  require(kv == 0 || kv == 1, "cachegen_paper: kv must be 0 (K) or 1 (V)");
  require(layer >= 0 && layer < profile.n_layers(), "cachegen_paper: no layer {} in the profile", layer);
  const auto& tb = profile.layers[static_cast<std::size_t>(layer)][kv];
  const std::int64_t C = tb.channels, T = chunk.tokens, G = profile.group;
  require(chunk.codes[kv].size() == static_cast<std::size_t>(C * T) && chunk.scales[kv].size() == static_cast<std::size_t>(T),
          "cachegen_paper: the chunk does not match the profile's channels");
  const float bin = layer_bin(profile, layer);
  std::vector<float> out(static_cast<std::size_t>(C * T));
  for (std::int64_t t = 0; t < T; ++t) {
    const std::uint16_t s16 = chunk.scales[kv][static_cast<std::size_t>(t)];
    for (std::int64_t c = 0; c < C; ++c) {
      const int sym = chunk.codes[kv][static_cast<std::size_t>(t * C + c)];
      float& y = out[static_cast<std::size_t>(t * C + c)];
      if (t % G == 0)
        y = peers_detail::absmax_dequantize(sym, kCachegenAnchorMaxQ, s16);
      else
        y = peers_detail::delta_dequantize(sym, out[static_cast<std::size_t>((t - t % G) * C + c)], bin, tb.delta_max_q, s16);
    }
  }
  return out;
}

CacheBytes CachegenPaperKVCache::stored_bytes() const {
  if (offset_ == 0) return {};
  const std::int64_t B = keys_buf_.dim(0), G = config_.group;
  // Anchors of a sequence: tokens 0, G, 2G, ... below offset.
  const double anchors = static_cast<double>((offset_ + G - 1) / G), deltas = static_cast<double>(offset_) - anchors;
  const int delta_bits = peers_detail::fixed_code_bits(2 * max_q_ + 1);
  CacheBytes out;
  for (int kv = 0; kv < 2; ++kv) {
    const double C = static_cast<double>(channels(kv));
    out.fixed_bytes += static_cast<double>(B) * (anchors * C + deltas * C * delta_bits / 8.0 + 2.0 * static_cast<double>(offset_));
  }
  out.estimated_bytes = encoded_bytes();
  return out;
}

}  // namespace vq
