// libFuzzer target: the order-1 context decoder (entropy/order1_coder.hpp) on arbitrary bytes, behind
// a 5-byte shape (order1_fuzz_shape.hpp). Checks: only vq::FormatError escapes, every decoded code
// fits the shape's bits, and what decodes re-encodes to bytes that decode to the same codes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "veloxquant/core/error.hpp"
#include "order1_fuzz_shape.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 5) return 0;
  const auto c = vqfuzz::order1_case(std::span<const std::uint8_t, 5>(data, 5));
  std::vector<std::uint8_t> codes;
  try {
    codes = vq::order1_decode(std::span<const std::uint8_t>(data + 5, size - 5), c.shape, c.pooled);
  } catch (const vq::FormatError&) {
    return 0;
  }
  const std::size_t chans = c.shape.channels * c.shape.slices.size();
  if (codes.size() != chans * c.shape.tokens) std::abort();
  for (const auto v : codes)
    if (v >= (1u << c.shape.bits)) std::abort();
  // Channel-major back to the coder's token-major slices, then around once more.
  std::vector<std::vector<std::uint8_t>> slices(c.shape.slices.size(), std::vector<std::uint8_t>(c.shape.tokens * c.shape.channels));
  for (std::size_t ch = 0; ch < chans; ++ch)
    for (std::size_t t = 0; t < c.shape.tokens; ++t)
      slices[ch / c.shape.channels][t * c.shape.channels + ch % c.shape.channels] = codes[ch * c.shape.tokens + t];
  vq::Order1Codes again = c.shape;
  for (std::size_t s = 0; s < slices.size(); ++s) again.slices[s] = slices[s];
  const auto bytes = vq::order1_encode(again, c.pooled);
  if (vq::order1_decode(bytes, c.shape, c.pooled) != codes) std::abort();
  return 0;
}
