#include "veloxquant/quant/layer_schedule.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

std::vector<int> layer_group_bits(int n_layers, int base_bits, int n_groups) {
  require(n_groups >= 1, "layer_group_bits: n_groups must be >= 1, got {}", n_groups);
  require(base_bits >= 1 && base_bits <= 8, "layer_group_bits: base_bits must be in 1..8, got {}", base_bits);
  if (n_layers <= 0) return {};
  n_groups = std::min(n_groups, n_layers);
  std::vector<int> bounds(static_cast<std::size_t>(n_groups) + 1);
  for (int g = 0; g <= n_groups; ++g) {
    // n_layers * g / n_groups is a ratio of small integers: exact in double up to the .5 case,
    // and nearbyint rounds half to even under the default rounding mode (as Python's round).
    bounds[static_cast<std::size_t>(g)] =
        static_cast<int>(std::nearbyint(static_cast<double>(n_layers) * g / n_groups));
  }
  bounds.back() = n_layers;
  std::vector<int> bits(static_cast<std::size_t>(n_layers));
  for (int g = 0; g < n_groups; ++g)
    for (int i = bounds[static_cast<std::size_t>(g)]; i < bounds[static_cast<std::size_t>(g) + 1]; ++i)
      bits[static_cast<std::size_t>(i)] = std::max(2, base_bits - g);
  return bits;
}

}  // namespace vq
