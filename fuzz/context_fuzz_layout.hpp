// The layout the context-coder fuzz target decodes with: read from the input's first 4 bytes (the
// caller of context_decode knows the shape; a fuzzer must vary it too). Shared with make_corpus.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "veloxquant/entropy/context_coder.hpp"

namespace vqfuzz {

inline constexpr std::size_t kContextHeader = 4;

// b0: slices 1..3; b1: tokens 0..63; b2: dim 1..40; b3: bits 1..4 (low 2 bits), group size 1..33
// (the rest); pieces: two when tokens > 8 (the second starts a new group run), else one.
inline vq::ContextLayout context_layout(std::span<const std::uint8_t, kContextHeader> h) {
  vq::ContextLayout l;
  l.slices = 1 + h[0] % 3u;
  l.tokens = h[1] % 64u;
  l.dim = 1 + h[2] % 40u;
  l.bits = 1 + (h[3] & 3);
  const int group = 1 + (h[3] >> 2) % 33;
  std::vector<std::int64_t> pieces;
  if (l.tokens > 8) pieces = {static_cast<std::int64_t>(l.tokens / 2), static_cast<std::int64_t>(l.tokens - l.tokens / 2)};
  else pieces = {static_cast<std::int64_t>(l.tokens)};
  l.group_start = vq::group_starts(pieces, group);
  return l;
}

}  // namespace vqfuzz
