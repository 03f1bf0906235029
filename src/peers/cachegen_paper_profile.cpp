#include "veloxquant/peers/cachegen_paper_profile.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

#include <fmt/format.h>

#include "veloxquant/core/atomic_file.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/input_file.hpp"
#include "absmax_codes.hpp"
#include "chunk_io.hpp"
#include "peer_rows.hpp"

namespace vq {

namespace {

using peers_detail::ByteReader;
using peers_detail::put_varint;

constexpr char kMagic[8] = {'V', 'Q', 'C', 'G', 'P', 'A', 'P', '1'};
constexpr int kMaxLayers = 4096, kMaxGroup = 1024, kMaxChunk = 1 << 20;
constexpr std::int64_t kMaxChannels = 1 << 20;
// Inputs are bounded so that a delta (|x - a| <= |x| + |a|) still has a finite float16 scale.
constexpr float kMaxAbs = 32752.0f;
// Counts are scaled down (ratios kept) so that the largest is at most 2^20 before smoothing: then
// 16 c + 1 summed over 255 symbols stays far below 2^32.
constexpr std::uint64_t kMaxScaledCount = 1u << 20;

std::string bin_error(double bin) {
  if (!std::isfinite(bin) || bin < 0.01 || bin >= 2.0)
    return fmt::format("bin size {} must be in [0.01, 2) (in units of the delta's absmax: 2 or more would code every delta as 0)", bin);
  return {};
}

void check_tensor(const Tensor& t, const char* what) {
  const std::vector<float> v = t.to_f32_vector();
  for (float x : v)
    if (!(std::fabs(x) <= kMaxAbs))
      throw InvalidArgument(fmt::format("cachegen_paper: {} must be finite with |x| <= {} (delta scales are float16), got {}", what,
                                        kMaxAbs, x));
}

FrequencyTable smoothed_table(const std::vector<std::uint32_t>& counts) {
  const std::uint64_t mx = *std::max_element(counts.begin(), counts.end());
  std::vector<std::uint32_t> h(counts.size());
  for (std::size_t i = 0; i < counts.size(); ++i) {
    const std::uint64_t c = mx > kMaxScaledCount ? (counts[i] * kMaxScaledCount + mx / 2) / mx : counts[i];
    h[i] = static_cast<std::uint32_t>(c * 16 + 1);
  }
  return FrequencyTable::from_histogram(h, kCachegenProfileScaleBits);
}

}  // namespace

int cachegen_delta_max_q(double bin) {
  const std::string err = bin_error(bin);
  if (!err.empty()) throw InvalidArgument("cachegen_paper: " + err);
  return static_cast<int>(std::nearbyint(1.0 / bin));
}

void CachegenPaperConfig::validate() const {
  if (group < 1 || group > kMaxGroup) throw InvalidArgument(fmt::format("cachegen_paper: group={} must be in 1..{}", group, kMaxGroup));
  for (int i = 0; i < 3; ++i) {
    const std::string err = bin_error(bins[static_cast<std::size_t>(i)]);
    if (!err.empty()) throw InvalidArgument(fmt::format("cachegen_paper: bin{}: {}", i + 1, err));
  }
  if (chunk < group || chunk % group != 0 || chunk > kMaxChunk)
    throw InvalidArgument(fmt::format("cachegen_paper: chunk={} must be a multiple of group={} (a chunk starts with an anchor), at most {}",
                                      chunk, group, kMaxChunk));
  if (profile_tokens < 1 || profile_tokens > (1 << 24))
    throw InvalidArgument(fmt::format("cachegen_paper: profile_tokens={} must be in 1..{}", profile_tokens, 1 << 24));
}

double CachegenPaperConfig::bin_for_layer(int layer, int n_layers) const {
  require(n_layers >= 1 && layer >= 0 && layer < n_layers,
          "cachegen_paper: layer {} is not an attention layer of a {}-layer model", layer, n_layers);
  return bins[static_cast<std::size_t>(std::min(2, 3 * layer / n_layers))];
}

void CachegenPaperProfile::build_tables() {
  for (auto& layer : layers)
    for (auto& t : layer) {
      t.anchor.clear();
      t.delta.clear();
      for (const auto& c : t.anchor_counts) t.anchor.push_back(smoothed_table(c));
      for (const auto& c : t.delta_counts) t.delta.push_back(smoothed_table(c));
    }
}

std::vector<std::uint8_t> CachegenPaperProfile::serialize() const {
  std::vector<std::uint8_t> out(std::begin(kMagic), std::end(kMagic));
  put_varint(out, layers.size());
  put_varint(out, static_cast<std::uint64_t>(group));
  for (double b : bins) {
    std::uint64_t u = 0;
    std::memcpy(&u, &b, sizeof u);
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(u >> (8 * i)));
  }
  put_varint(out, tokens);
  for (const auto& layer : layers)
    for (const auto& t : layer) {
      put_varint(out, static_cast<std::uint64_t>(t.channels));
      put_varint(out, static_cast<std::uint64_t>(t.delta_max_q));
      for (std::int64_t c = 0; c < t.channels; ++c) {
        for (std::uint32_t n : t.anchor_counts[static_cast<std::size_t>(c)]) put_varint(out, n);
        for (std::uint32_t n : t.delta_counts[static_cast<std::size_t>(c)]) put_varint(out, n);
      }
    }
  return out;
}

CachegenPaperProfile CachegenPaperProfile::parse(std::span<const std::uint8_t> bytes) {
  ByteReader r(bytes, "cachegen_paper profile");
  for (char m : kMagic)
    if (r.u8() != static_cast<std::uint8_t>(m)) r.fail("bad magic (not a `veloxquant profile` file)");
  CachegenPaperProfile p;
  const int n_layers = static_cast<int>(r.varint(kMaxLayers, "n_layers"));
  if (n_layers < 1) r.fail("n_layers is 0");
  p.group = static_cast<int>(r.varint(kMaxGroup, "group"));
  if (p.group < 1) r.fail("group is 0");
  for (double& b : p.bins) {
    std::uint64_t u = 0;
    for (int i = 0; i < 8; ++i) u |= static_cast<std::uint64_t>(r.u8()) << (8 * i);
    std::memcpy(&b, &u, sizeof b);
    if (!bin_error(b).empty()) r.fail(bin_error(b));
  }
  p.tokens = r.varint(~std::uint64_t{0}, "tokens");
  CachegenPaperConfig cfg;
  cfg.group = p.group;
  cfg.bins = p.bins;
  p.layers.resize(static_cast<std::size_t>(n_layers));
  for (int l = 0; l < n_layers; ++l)
    for (auto& t : p.layers[static_cast<std::size_t>(l)]) {
      t.channels = static_cast<std::int64_t>(r.varint(kMaxChannels, "channels"));
      if (t.channels < 1) r.fail("channels is 0");
      const int want_q = cachegen_delta_max_q(cfg.bin_for_layer(l, n_layers));
      t.delta_max_q = static_cast<int>(r.varint(1024, "delta_max_q"));
      if (t.delta_max_q != want_q) r.fail(fmt::format("layer {}: delta_max_q {} does not match its bin (expected {})", l, t.delta_max_q, want_q));
      const std::size_t per_channel = static_cast<std::size_t>(kCachegenAnchorAlphabet + 2 * t.delta_max_q + 1);
      // Every count takes at least one byte: check before allocating.
      if (static_cast<std::size_t>(t.channels) * per_channel > r.remaining()) r.fail("truncated counts");
      t.anchor_counts.assign(static_cast<std::size_t>(t.channels), std::vector<std::uint32_t>(kCachegenAnchorAlphabet));
      t.delta_counts.assign(static_cast<std::size_t>(t.channels), std::vector<std::uint32_t>(static_cast<std::size_t>(2 * t.delta_max_q + 1)));
      for (std::int64_t c = 0; c < t.channels; ++c) {
        for (auto& n : t.anchor_counts[static_cast<std::size_t>(c)]) n = static_cast<std::uint32_t>(r.varint(0xffffffffu, "count"));
        for (auto& n : t.delta_counts[static_cast<std::size_t>(c)]) n = static_cast<std::uint32_t>(r.varint(0xffffffffu, "count"));
      }
    }
  if (r.remaining() != 0) r.fail("trailing bytes after the profile");
  p.build_tables();
  return p;
}

void CachegenPaperProfile::save(const std::string& path) const {
  const auto bytes = serialize();
  write_file_atomically(path, bytes);
}

CachegenPaperProfile CachegenPaperProfile::load(const std::string& path) {
  const std::vector<std::uint8_t> bytes = read_input_file(path, "cachegen_paper profile");
  try {
    return parse(bytes);
  } catch (const FormatError& e) {
    throw FormatError(fmt::format("{}: {}", path, e.what()));
  }
}

void CachegenPaperProfile::check_matches(const CachegenPaperConfig& config, int n_layers) const {
  if (this->n_layers() != n_layers || group != config.group || bins != config.bins)
    throw InvalidArgument(fmt::format(
        "cachegen_paper: the profile was made for {} layers, group={}, bins {}/{}/{}, but the method has {} layers, group={}, bins "
        "{}/{}/{}; run `veloxquant profile` with the same settings",
        this->n_layers(), group, bins[0], bins[1], bins[2], n_layers, config.group, config.bins[0], config.bins[1], config.bins[2]));
}

CachegenPaperProfiler::CachegenPaperProfiler(CachegenPaperConfig config, int n_layers) : config_(std::move(config)) {
  config_.validate();
  require(n_layers >= 1 && n_layers <= kMaxLayers, "cachegen_paper profiler: n_layers must be in 1..{}, got {}", kMaxLayers, n_layers);
  profile_.group = config_.group;
  profile_.bins = config_.bins;
  profile_.layers.resize(static_cast<std::size_t>(n_layers));
}

void CachegenPaperProfiler::add(int layer, const Tensor& keys, const Tensor& values) {
  require(layer >= 0 && layer < profile_.n_layers(), "cachegen_paper profiler: no layer {}", layer);
  require(keys.dim(0) == values.dim(0) && keys.dim(1) == values.dim(1) && keys.dim(2) == values.dim(2),
          "cachegen_paper profiler: keys and values must agree in batch, heads and tokens");
  check_tensor(keys, "keys");
  check_tensor(values, "values");
  const float bin = static_cast<float>(config_.bin_for_layer(layer, profile_.n_layers()));
  const int mq = cachegen_delta_max_q(config_.bin_for_layer(layer, profile_.n_layers()));
  for (int kv = 0; kv < 2; ++kv) {
    const Tensor& t = kv == 0 ? keys : values;
    const std::int64_t C = t.dim(1) * t.dim(3);
    auto& tb = profile_.layers[static_cast<std::size_t>(layer)][kv];
    if (tb.channels == 0) {
      require(C >= 1 && C <= kMaxChannels, "cachegen_paper profiler: {} channels per token is out of range", C);
      tb.channels = C;
      tb.delta_max_q = mq;
      tb.anchor_counts.assign(static_cast<std::size_t>(C), std::vector<std::uint32_t>(kCachegenAnchorAlphabet));
      tb.delta_counts.assign(static_cast<std::size_t>(C), std::vector<std::uint32_t>(static_cast<std::size_t>(2 * mq + 1)));
    }
    require(tb.channels == C, "cachegen_paper profiler: layer {} has {} channels, earlier {}", layer, C, tb.channels);
    std::vector<float> x(static_cast<std::size_t>(C)), recon(static_cast<std::size_t>(C)), anchor(static_cast<std::size_t>(C));
    std::vector<std::uint16_t> sym(static_cast<std::size_t>(C));
    for (std::int64_t b = 0; b < t.dim(0); ++b)
      for (std::int64_t s = 0; s < t.dim(2); ++s) {
        peers_detail::gather_token(t, b, s, x.data());
        peers_detail::absmax_quantize(x.data(), C, kCachegenAnchorMaxQ, sym.data(), recon.data());
        for (std::int64_t c = 0; c < C; ++c) ++tb.anchor_counts[static_cast<std::size_t>(c)][sym[static_cast<std::size_t>(c)]];
        if (s % config_.group == 0) {
          anchor = recon;
          continue;
        }
        peers_detail::delta_quantize(x.data(), anchor.data(), C, bin, mq, sym.data(), recon.data());
        for (std::int64_t c = 0; c < C; ++c) ++tb.delta_counts[static_cast<std::size_t>(c)][sym[static_cast<std::size_t>(c)]];
      }
  }
  if (layer == 0) profile_.tokens += static_cast<std::uint64_t>(keys.dim(0) * keys.dim(2));
}

CachegenPaperProfile CachegenPaperProfiler::finish() const {
  for (int l = 0; l < profile_.n_layers(); ++l)
    require(profile_.layers[static_cast<std::size_t>(l)][0].channels > 0,
            "cachegen_paper profiler: layer {} was never fed", l);
  CachegenPaperProfile p = profile_;
  p.build_tables();
  return p;
}

}  // namespace vq
