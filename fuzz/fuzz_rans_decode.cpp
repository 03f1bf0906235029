// libFuzzer target: decode_block on arbitrary bytes (table + stream), with both kernels.
// Checks: only vq::FormatError escapes; both kernels agree; a stream that decodes re-encodes to
// exactly its own bytes (rANS is a bijection between accepted streams and symbol sequences).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>
#include <vector>

#include "veloxquant/core/error.hpp"
#include "veloxquant/entropy/rans.hpp"

namespace {

// Bounds the allocation: a single-symbol table codes any count in zero bytes.
constexpr std::size_t kMaxSymbols = 1 << 20;

std::optional<std::vector<std::uint16_t>> try_decode(std::span<const std::uint8_t> in, vq::RansKernel k) {
  try {
    return vq::decode_block(in, kMaxSymbols, k);
  } catch (const vq::FormatError&) {
    return std::nullopt;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> in(data, size);
  const auto ref = try_decode(in, vq::RansKernel::Scalar);
  if (vq::rans_avx2_available()) {
    const auto fast = try_decode(in, vq::RansKernel::Avx2);
    if (ref.has_value() != fast.has_value() || (ref && *ref != *fast)) std::abort();
  }
  if (!ref) return 0;
  std::size_t used = 0;
  const auto table = vq::FrequencyTable::deserialize(in, &used);
  const auto stream = in.subspan(used);
  std::size_t varint_len = 0;
  while (stream[varint_len] & 0x80) ++varint_len;
  ++varint_len;
  const auto again = vq::rans_encode(*ref, table, vq::RansKernel::Scalar);
  std::size_t again_len = 0;
  while (again[again_len] & 0x80) ++again_len;
  ++again_len;
  if (again.size() - again_len != stream.size() - varint_len) std::abort();
  for (std::size_t i = 0; i < stream.size() - varint_len; ++i)
    if (again[again_len + i] != stream[varint_len + i]) std::abort();
  return 0;
}
