#include "veloxquant/transform/bit_pack.hpp"

#include <algorithm>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"

namespace vq {

std::size_t packed_size(std::size_t n_codes, int bits) { return (n_codes * static_cast<std::size_t>(bits) + 7) / 8; }

std::vector<std::uint8_t> pack_bits(std::span<const std::uint8_t> codes, int bits) {
  require(bits >= 1 && bits <= 8, "pack_bits: bits must be in 1..8, got {}", bits);
  std::vector<std::uint8_t> out(packed_size(codes.size(), bits), 0);
  if (bits == 8) {
    std::copy(codes.begin(), codes.end(), out.begin());
    return out;
  }
  const unsigned limit = 1u << bits;
  std::uint64_t acc = 0;
  int fill = 0;
  std::size_t o = 0;
  std::size_t i = 0;
#if defined(__SSE2__)
  if (bits == 4) {  // 32 codes -> 16 bytes: even code | odd code << 4, checked 32 at a time
    __m128i any = _mm_setzero_si128();
    const __m128i lo8 = _mm_set1_epi16(0x00ff);
    for (; i + 32 <= codes.size(); i += 32, o += 16) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes.data() + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes.data() + i + 16));
      any = _mm_or_si128(any, _mm_or_si128(a, b));
      const __m128i pa = _mm_or_si128(_mm_and_si128(a, lo8), _mm_slli_epi16(_mm_srli_epi16(a, 8), 4));
      const __m128i pb = _mm_or_si128(_mm_and_si128(b, lo8), _mm_slli_epi16(_mm_srli_epi16(b, 8), 4));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.data() + o), _mm_packus_epi16(pa, pb));
    }
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(any, _mm_set1_epi8(static_cast<char>(0xf0))), _mm_setzero_si128())) != 0xffff)
      i = 0, o = 0;  // a code does not fit: the scalar loop below finds and names it
  }
#endif
  for (; i < codes.size(); ++i) {
    if (codes[i] >= limit) throw InvalidArgument(fmt::format("pack_bits: code {} at {} does not fit in {} bits", codes[i], i, bits));
    acc |= static_cast<std::uint64_t>(codes[i]) << fill;
    fill += bits;
    while (fill >= 8) {
      out[o++] = static_cast<std::uint8_t>(acc);
      acc >>= 8;
      fill -= 8;
    }
  }
  if (fill > 0) out[o] = static_cast<std::uint8_t>(acc);
  return out;
}

std::vector<std::uint8_t> unpack_bits(std::span<const std::uint8_t> packed, std::size_t n_codes, int bits) {
  require(bits >= 1 && bits <= 8, "unpack_bits: bits must be in 1..8, got {}", bits);
  if (packed.size() < packed_size(n_codes, bits))
    throw FormatError(fmt::format("unpack_bits: {} bytes hold fewer than {} codes of {} bits", packed.size(), n_codes, bits));
  std::vector<std::uint8_t> out(n_codes);
  if (bits == 8) {
    std::copy_n(packed.begin(), n_codes, out.begin());
    return out;
  }
  const std::uint64_t mask = (1u << bits) - 1;
  std::uint64_t acc = 0;
  int fill = 0;
  std::size_t in = 0;
  std::size_t i = 0;
#if defined(__SSE2__)
  if (bits == 4) {  // 16 bytes -> 32 codes: low nibble, then high nibble, of each byte
    const __m128i low = _mm_set1_epi8(15);
    for (; i + 32 <= n_codes; i += 32, in += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed.data() + in));
      const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.data() + i), _mm_unpacklo_epi8(lo, hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.data() + i + 16), _mm_unpackhi_epi8(lo, hi));
    }
  }
#endif
  for (; i < n_codes; ++i) {
    while (fill < bits) {
      acc |= static_cast<std::uint64_t>(packed[in++]) << fill;
      fill += 8;
    }
    out[i] = static_cast<std::uint8_t>(acc & mask);
    acc >>= bits;
    fill -= bits;
  }
  return out;
}

}  // namespace vq
