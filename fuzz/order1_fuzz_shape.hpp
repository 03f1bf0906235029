// The shape fuzz_order1_decode reads from its input's first 5 bytes (make_corpus.cpp writes them).
#pragma once
#include <cstdint>
#include <span>

#include "veloxquant/entropy/order1_coder.hpp"

namespace vqfuzz {

struct Order1Case {
  vq::Order1Codes shape;
  bool pooled = false;
};

// bits 1..6, 1..4 slices of 1..16 channels, 0..63 tokens: tables stay small (<= 4 x 16 x 64 x 64
// histogram counts).
inline Order1Case order1_case(std::span<const std::uint8_t, 5> h) {
  Order1Case c;
  c.shape.bits = 1 + h[0] % 6;
  c.shape.slices.resize(1u + h[1] % 4u);
  c.shape.channels = 1u + h[2] % 16u;
  c.shape.tokens = h[3] % 64u;
  c.pooled = (h[4] & 1u) != 0;
  return c;
}

}  // namespace vqfuzz
