// CacheGen's layer-wise bit schedule (paper section 5.1.2): deeper layers get fewer bits.
#pragma once
#include <vector>

namespace vq {

// Bits per layer for `n_layers` layers split into `n_groups` depth groups (default 3).
//   empty for n_layers <= 0; n_groups = min(n_groups, n_layers);
//   bound b_g = round_half_even(n_layers * g / n_groups) for g = 0..n_groups, the last forced to n_layers;
//   layer i with b_g <= i < b_{g+1} gets max(2, base_bits - g).
// Throws InvalidArgument when n_groups < 1 or base_bits is outside 1..8.
std::vector<int> layer_group_bits(int n_layers, int base_bits, int n_groups = 3);

}  // namespace vq
