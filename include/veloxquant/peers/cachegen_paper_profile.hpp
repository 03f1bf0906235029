// The CacheGen paper's codec (Liu et al., SIGCOMM 2024, arXiv 2310.07240): its settings, and the
// offline profile of its symbol distributions (tables per layer and channel, for anchors and
// deltas, K and V) that every cache of a model shares and none stores.
//
// Codec (our reading of the paper, which publishes no code for it; see docs/methods.md):
// - Tokens are split into groups of `group` (10) by position: token t is its group's anchor when
//   t % group == 0. The anchor is quantized at 8 bits: LMCache's absmax quantizer with MAX = 127
//   over the token's C = H * D channels (s stored as float16; symbols 0 .. 254).
// - Every other token stores its delta to the group's RECONSTRUCTED anchor a (the paper says "delta
//   to the anchor"; using the reconstruction keeps anchor error out of the delta), "vector-wise":
//   s = max |x - a| over the C channels (float16), step = bin * s, q = round(d / step) clamped to
//   +-max_q with max_q = round(1 / bin); symbol q + max_q. The bin is in units of the vector's own
//   delta range: bin 0.5 gives 5 levels (0, +-s/2, +-s), 1 and 1.5 give 3 (0, +-step).
// - Bins per layer: the attention layers are split into three depth groups, layer l of L in group
//   min(2, 3 l / L); the paper's bin sizes are 0.5, 1, 1.5 (coarser with depth).
// - Streams restart every `chunk` tokens (a multiple of group; the paper's ~1.5K-token chunks).
//
// Profile file ("veloxquant profile" writes it; little-endian, varint = unsigned LEB128; parse()
// validates every field and never reads past the end):
//   u8[8]   magic "VQCGPAP1"
//   varint  n_layers                   attention layers of the model, 1 .. 4096
//   varint  group                      1 .. 1024
//   f64     bin[3]                     delta bin sizes of the three layer groups
//   varint  tokens                     positions profiled, BOS included (information only)
//   per layer l, for K then V:
//     varint  channels                 C = H * D of that layer, 1 .. 2^20
//     varint  delta_max_q              must equal round(1 / bin of layer l)
//     per channel: varint anchor_count[255], varint delta_count[2 delta_max_q + 1]
// Counts are raw. Tables are built from them when loaded: every symbol gets count * 16 + 1 (a
// pseudo-count of 1/16, so a symbol never seen can still be coded), normalised to 2^12 (the
// tables travel with no cache, so precision costs nothing; 12 bits holds all 255 anchor symbols
// and caps an unseen one at 12 bits).
// Anchor tables count EVERY token's 8-bit anchor code, not only the anchors': an anchor is an
// ordinary token, so the distribution is the same and the profile sees ten times the samples.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/core/tensor.hpp"
#include "veloxquant/entropy/frequency_table.hpp"

namespace vq {

inline constexpr int kCachegenAnchorMaxQ = 127;  // 8 bits: 255 levels (LMCache's quantizer at 256 bins)
inline constexpr int kCachegenAnchorAlphabet = 2 * kCachegenAnchorMaxQ + 1;
inline constexpr int kCachegenProfileScaleBits = 12;

struct CachegenPaperConfig {
  int group = 10;                               // tokens per group: one anchor, group - 1 deltas
  std::array<double, 3> bins{0.5, 1.0, 1.5};    // delta bin size of the first, middle, last third of layers
  int chunk = 1500;                             // tokens per independently decodable chunk; a multiple of group
  std::string profile;                          // a `veloxquant profile` file; empty: profiled on the fly
  int profile_tokens = 4096;                    // tokens the on-the-fly profile samples from the model
  void validate() const;                        // throws InvalidArgument
  // The bin size of attention layer `layer` of `n_layers`.
  double bin_for_layer(int layer, int n_layers) const;
};

// round(1 / bin): the largest |q| a delta can take.
int cachegen_delta_max_q(double bin);

struct CachegenPaperProfile {
  struct Tables {  // one (layer, K or V)
    std::int64_t channels = 0;
    int delta_max_q = 0;
    std::vector<std::vector<std::uint32_t>> anchor_counts, delta_counts;  // [channel][symbol]
    std::vector<FrequencyTable> anchor, delta;                            // [channel], from the counts
  };
  int group = 10;
  std::array<double, 3> bins{0.5, 1.0, 1.5};
  std::uint64_t tokens = 0;  // positions profiled, BOS included
  std::vector<std::array<Tables, 2>> layers;  // [layer][0 = K, 1 = V]

  int n_layers() const { return static_cast<int>(layers.size()); }
  // (Re)build every table from the counts (smoothing above).
  void build_tables();
  std::vector<std::uint8_t> serialize() const;
  // Throws FormatError on anything malformed, truncated or trailing.
  static CachegenPaperProfile parse(std::span<const std::uint8_t> bytes);
  void save(const std::string& path) const;                 // throws IoError
  static CachegenPaperProfile load(const std::string& path);  // throws IoError, FormatError
  // Throws InvalidArgument unless the profile was made for `n_layers` layers with config's group and bins.
  void check_matches(const CachegenPaperConfig& config, int n_layers) const;
};

// Counts symbols of sequences fed layer by layer; finish() gives the profile.
class CachegenPaperProfiler {
 public:
  CachegenPaperProfiler(CachegenPaperConfig config, int n_layers);  // throws InvalidArgument
  // The exact K/V of attention layer `layer` for whole sequences from position 0: [B, H, S, D].
  // Layer 0's calls count the profiled tokens. Throws InvalidArgument on NaN/Inf, |x| > 32752, or
  // a channel count that differs from earlier calls for the layer.
  void add(int layer, const Tensor& keys, const Tensor& values);
  CachegenPaperProfile finish() const;  // throws InvalidArgument when a layer was never fed

 private:
  CachegenPaperConfig config_;
  CachegenPaperProfile profile_;
};

}  // namespace vq
