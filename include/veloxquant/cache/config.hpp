// KVCacheConfig: the reference's cachegen_* fields, with their reference defaults, plus the flush
// mode veloxquant adds.
#pragma once
#include <optional>
#include <string>
#include <string_view>

namespace vq {

// How a CacheGenKVCache groups tokens into quantization groups. Numbers are saved: never renumber.
enum class FlushMode : int {
  // Each update_and_fetch call's tokens are quantized as their own stream, the last group padded by
  // repeating the last row: the reference, exactly (including its decode flaw).
  PerCall = 0,
  // New tokens wait in an exact residual until group_size of them close a group (KIVI-style); the
  // result does not depend on how the host chunks its calls. The default.
  GroupAligned = 1,
};

std::string_view flush_mode_name(FlushMode mode);        // "per_call", "group_aligned"
FlushMode flush_mode_from_name(std::string_view name);   // throws InvalidArgument

struct KVCacheConfig {
  int cachegen_bits = 4;                      // base bit width, 1..8
  int cachegen_group_size = 32;               // tokens per quantization group, >= 1
  bool cachegen_use_delta = true;             // entropy of token deltas (true) or of raw codes
  bool cachegen_per_channel = true;           // entropy per channel (true) or pooled over channels
  int cachegen_layer_groups = 3;              // depth groups of the builder's schedule, >= 1
  std::optional<int> cachegen_resolved_bits;  // per-layer bits set by KVCacheBuilder; overrides cachegen_bits
  FlushMode cachegen_flush = FlushMode::GroupAligned;

  // Throws InvalidArgument naming the bad field.
  void validate() const;
  // The bit width a cache built from this config uses.
  int effective_bits() const { return cachegen_resolved_bits.value_or(cachegen_bits); }
  // "bits=4,group=32,delta=1,per_channel=1,layer_groups=3,resolved_bits=none,flush=group_aligned"
  std::string to_string() const;
  bool operator==(const KVCacheConfig&) const = default;
};

}  // namespace vq
