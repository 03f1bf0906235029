#include "veloxquant/cache/config.hpp"

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

std::string_view flush_mode_name(FlushMode mode) {
  switch (mode) {
    case FlushMode::PerCall: return "per_call";
    case FlushMode::GroupAligned: return "group_aligned";
  }
  throw InvalidArgument("unknown flush mode");
}

FlushMode flush_mode_from_name(std::string_view name) {
  if (name == "per_call") return FlushMode::PerCall;
  if (name == "group_aligned") return FlushMode::GroupAligned;
  throw InvalidArgument("unknown flush mode '" + std::string(name) + "' (expected per_call or group_aligned)");
}

void KVCacheConfig::validate() const {
  require(cachegen_bits >= 1 && cachegen_bits <= 8, "cachegen_bits must be in 1..8, got {}", cachegen_bits);
  require(cachegen_group_size >= 1, "cachegen_group_size must be >= 1, got {}", cachegen_group_size);
  require(cachegen_layer_groups >= 1, "cachegen_layer_groups must be >= 1, got {}", cachegen_layer_groups);
  if (cachegen_resolved_bits)
    require(*cachegen_resolved_bits >= 1 && *cachegen_resolved_bits <= 8,
            "cachegen_resolved_bits must be in 1..8, got {}", *cachegen_resolved_bits);
  require(cachegen_flush == FlushMode::PerCall || cachegen_flush == FlushMode::GroupAligned,
          "cachegen_flush has unknown value {}", static_cast<int>(cachegen_flush));
}

std::string KVCacheConfig::to_string() const {
  return fmt::format("bits={},group={},delta={},per_channel={},layer_groups={},resolved_bits={},flush={}", cachegen_bits,
                     cachegen_group_size, cachegen_use_delta ? 1 : 0, cachegen_per_channel ? 1 : 0, cachegen_layer_groups,
                     cachegen_resolved_bits ? std::to_string(*cachegen_resolved_bits) : "none", flush_mode_name(cachegen_flush));
}

}  // namespace vq
