// The fixed cachegen_paper profile that fuzz_cachegen_paper_chunk decodes against and
// make_corpus encodes its seeds with: 3 layers, group 4, the paper's bins (delta max_q 2, 1, 1),
// a few channel counts, and made-up counts (some zero: smoothing keeps every symbol codable).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "veloxquant/peers/cachegen_paper_profile.hpp"

namespace vqfuzz {

inline constexpr int kCachegenFuzzGroup = 4;
inline constexpr std::int64_t kCachegenFuzzChannels[3][2] = {{8, 4}, {3, 5}, {1, 2}};  // [layer][K, V]

inline vq::CachegenPaperProfile cachegen_fuzz_profile() {
  vq::CachegenPaperProfile p;
  p.group = kCachegenFuzzGroup;
  p.tokens = 1000;
  p.layers.resize(3);
  for (int l = 0; l < 3; ++l)
    for (int kv = 0; kv < 2; ++kv) {
      auto& t = p.layers[static_cast<std::size_t>(l)][kv];
      t.channels = kCachegenFuzzChannels[l][kv];
      t.delta_max_q = vq::cachegen_delta_max_q(vq::CachegenPaperConfig{}.bin_for_layer(l, 3));
      const auto C = static_cast<std::size_t>(t.channels);
      t.anchor_counts.assign(C, std::vector<std::uint32_t>(vq::kCachegenAnchorAlphabet));
      t.delta_counts.assign(C, std::vector<std::uint32_t>(static_cast<std::size_t>(2 * t.delta_max_q + 1)));
      for (std::size_t c = 0; c < C; ++c) {
        for (int s = 0; s < vq::kCachegenAnchorAlphabet; ++s) {
          const int d = s > vq::kCachegenAnchorMaxQ ? s - vq::kCachegenAnchorMaxQ : vq::kCachegenAnchorMaxQ - s;
          t.anchor_counts[c][static_cast<std::size_t>(s)] = d > 60 ? 0u : static_cast<std::uint32_t>((61 - d) * (c + 1));
        }
        for (int s = 0; s <= 2 * t.delta_max_q; ++s)
          t.delta_counts[c][static_cast<std::size_t>(s)] = static_cast<std::uint32_t>(100 >> (2 * (s > t.delta_max_q ? s - t.delta_max_q : t.delta_max_q - s)));
      }
    }
  p.build_tables();
  return p;
}

}  // namespace vqfuzz
