// libFuzzer target: context_decode (entropy/context_coder.hpp) on arbitrary bytes, with the layout
// taken from the first 4 bytes (context_fuzz_layout.hpp). Checks: only vq::FormatError escapes,
// both rANS kernels give the same result, and a decoded stream re-encodes and decodes to itself.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>
#include <vector>

#include "context_fuzz_layout.hpp"
#include "veloxquant/core/error.hpp"

namespace {

std::optional<std::vector<std::uint8_t>> try_decode(std::span<const std::uint8_t> in, const vq::ContextLayout& l, vq::RansKernel k) {
  std::vector<std::uint8_t> out(l.size());
  try {
    vq::context_decode(in, l, out, k);
  } catch (const vq::FormatError&) {
    return std::nullopt;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < vqfuzz::kContextHeader) return 0;
  const std::span<const std::uint8_t> all(data, size);
  const vq::ContextLayout l = vqfuzz::context_layout(all.first<vqfuzz::kContextHeader>());
  const auto in = all.subspan(vqfuzz::kContextHeader);
  const auto ref = try_decode(in, l, vq::RansKernel::Scalar);
  if (vq::rans_avx2_available()) {
    const auto fast = try_decode(in, l, vq::RansKernel::Avx2);
    if (ref.has_value() != fast.has_value() || (ref && *ref != *fast)) std::abort();
  }
  if (!ref) return 0;
  const auto again = vq::context_encode(*ref, l);
  std::vector<std::uint8_t> back(l.size());
  vq::context_decode(again, l, back);
  if (back != *ref) std::abort();
  return 0;
}
