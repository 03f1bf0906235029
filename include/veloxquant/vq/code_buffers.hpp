// Code arrays reused across vq_decode calls (vq/codec.hpp): a load decodes many layers of one
// shape, chunk after chunk (store/prefix_loader.hpp), and a fresh array per layer and side (1 MiB at
// a 7B-shaped layer's 256-token chunk) cost page faults and zeroing on every call.
//
// A decode that takes an array writes its codes over the old ones: it neither allocates nor zeroes
// when the array is already the size it needs (the arrays of one load's layers all are). The codes
// come out the same either way.
#pragma once
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "veloxquant/vq/codec.hpp"

namespace vq {

// Thread-safe; holds what was given until it is taken again or destroyed.
class VqCodeBuffers {
 public:
  std::vector<std::int16_t> take();              // an array given before (size and contents as given), or an empty one
  void give(std::vector<std::int16_t>&& codes);  // kept when it has capacity
  void give(VqLayerCodes&& codes);               // both sides' arrays
  std::size_t held() const;                      // arrays held
 private:
  mutable std::mutex mu_;
  std::vector<std::vector<std::int16_t>> free_;
};

// vq_decode with each side's codes written into an array taken from `buffers` (null: fresh arrays).
// The same codes and the same errors as vq_decode.
VqLayerCodes vq_decode(std::span<const std::uint8_t> bytes, std::uint64_t max_codes, RansKernel kernel, VqCodeBuffers* buffers);

}  // namespace vq
