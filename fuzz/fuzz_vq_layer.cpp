// libFuzzer target: vq_decode (vq/codec.hpp), our method's coded layer, on arbitrary bytes.
// Checks: only vq::FormatError escapes; decoding into junk-filled buffers agrees; every kernel the CPU has (Auto, AVX2, AVX-512) agrees with
// the scalar reference (all throw, or all decode the same layer; all re-encode it to the same bytes); a decoded layer has consistent
// sizes, shifts <= 7 and codes whose hi part is within +-255; it re-encodes without an error to
// bytes that decode to the same codes and re-encode to themselves. (The input itself need not come back: the encoder picks its
// own model parameters and shift layout.)
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <utility>
#include <vector>

#include "veloxquant/core/error.hpp"
#include "veloxquant/vq/codec.hpp"
#include "veloxquant/vq/codec_decode_into.hpp"

namespace {

// Bounds what a hostile header may make the decoder allocate (2^19: room for version 6's 64-lane
// streams, >= 2^18 symbols).
constexpr std::uint64_t kMaxCodes = 1 << 19;

bool same(const vq::VqLayerCodes& a, const vq::VqLayerCodes& b) {
  auto side = [](const vq::VqSideCodes& x, const vq::VqSideCodes& y) {
    return x.n == y.n && x.step == y.step && x.offset == y.offset && x.shift == y.shift && x.codes == y.codes;
  };
  return a.batch == b.batch && a.tokens == b.tokens && side(a.k, b.k) && side(a.v, b.v);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> bytes(data, size);
  vq::VqLayerCodes lc, ref;
  bool failed = false, ref_failed = false;
  try {
    lc = vq::vq_decode(bytes, kMaxCodes);
  } catch (const vq::FormatError&) {
    failed = true;
  }
  try {
    ref = vq::vq_decode(bytes, kMaxCodes, vq::RansKernel::Scalar);
  } catch (const vq::FormatError&) {
    ref_failed = true;
  }
  if (failed != ref_failed) std::abort();
  if (!failed && !same(lc, ref)) std::abort();
  // Auto is the best kernel the CPU has; the others it has must agree too.
  for (const auto& [kernel, present] : {std::pair{vq::RansKernel::Avx2, vq::rans_avx2_available()},
                                       std::pair{vq::RansKernel::Avx512, vq::rans_avx512_available()}}) {
    if (!present) continue;
    try {
      if (!same(vq::vq_decode(bytes, kMaxCodes, kernel), ref) || ref_failed) std::abort();
    } catch (const vq::FormatError&) {
      if (!ref_failed) std::abort();
    }
  }
  // Decoding into a caller's junk-filled buffers (one of the right size, one not) gives the same
  // layer, or the same failure.
  {
    vq::VqLayerCodes into;
    into.k.codes.assign(ref.k.codes.size(), 0x2bad);
    into.v.codes.assign(7, -1);
    try {
      vq::vq_decode(bytes, kMaxCodes, into);
      if (ref_failed || !same(into, ref)) std::abort();
    } catch (const vq::FormatError&) {
      if (!ref_failed) std::abort();
    }
  }
  if (failed) return 0;
  for (const vq::VqSideCodes* s : {&lc.k, &lc.v}) {
    const auto n = static_cast<std::size_t>(s->n);
    if (s->offset.size() != n || s->shift.size() != n || s->codes.size() != static_cast<std::size_t>(lc.rows()) * n) std::abort();
    for (std::size_t i = 0; i < s->codes.size(); ++i) {
      const int shift = s->shift[i % n], q = s->codes[i];
      if (shift > vq::kVqMaxShift || q < -(vq::kVqMaxCode << shift) || q > ((vq::kVqMaxCode + 1) << shift) - 1) std::abort();
    }
  }
  const std::vector<std::uint8_t> again = vq::vq_encode(lc);  // must not throw
  if (vq::vq_encode(lc, vq::RansKernel::Scalar) != again) std::abort();
  if (vq::rans_avx2_available() && vq::vq_encode(lc, vq::RansKernel::Avx2) != again) std::abort();
  if (vq::rans_avx512_available() && vq::vq_encode(lc, vq::RansKernel::Avx512) != again) std::abort();
  const auto back = vq::vq_decode(again, kMaxCodes);
  if (!same(back, lc)) std::abort();
  if (vq::vq_encode(back) != again) std::abort();
  return 0;
}
