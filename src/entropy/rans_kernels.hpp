// Private: the rANS kernels behind rans.hpp. Scalar ones live in rans.cpp, AVX2 ones in
// rans_avx2.cpp (compiled per function with __attribute__((target("avx2")))).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "veloxquant/entropy/frequency_table.hpp"
#include "veloxquant/entropy/rans.hpp"

namespace vq::rans_detail {

inline constexpr std::uint32_t kL = kRansStateLow;
inline constexpr unsigned kLaneMask = kRansLanes - 1;
// Words the encoder may write below its pointer (an AVX2 store of 8 words lands up to 8 below).
inline constexpr std::size_t kEncodeSlackWords = 16;

// Per-symbol encoder constants (ryg_rans' RansEncSymbol, for x < 2^31).
struct EncSym {
  std::uint32_t x_max;      // renormalise while x >= x_max = freq << (31 - scale_bits)
  std::uint32_t rcp_freq;   // ceil(2^(shift+31) / freq), shift = ceil(log2 freq)
  std::uint32_t bias;       // cum, or cum + M - 1 when freq == 1
  std::uint16_t cmpl_freq;  // M - freq
  std::uint16_t rcp_shift;  // shift - 1
};
// Encoder constants of a symbol, EncSym in 64 bits (one 4-lane gather for 4 lanes'
// constants): the reciprocal in the low word; bias (13 bits: c, or c + M - 1 when f = 1),
// M - f (13 bits) and the reciprocal's shift (6 bits) in the high word. 0 for a symbol of frequency
// 0 (every codable unit has a nonzero reciprocal).
inline std::uint64_t pack_enc(const EncSym& e) {
  return e.rcp_freq | static_cast<std::uint64_t>(e.bias | static_cast<std::uint32_t>(e.cmpl_freq) << 13 |
                                                 static_cast<std::uint32_t>(e.rcp_shift) << 26)
                          << 32;
}
// The constants of a symbol of frequency f >= 1 and cumulative frequency c in a table of
// 2^scale_bits; frequencies up to 2^12 take their reciprocal from a table built once.
EncSym make_enc_sym(std::uint32_t f, std::uint32_t c, int scale_bits);
std::vector<EncSym> make_enc_syms(const FrequencyTable& t);

// Decoder slot tables: entry[slot] = freq << 16 | (slot - cum), sym[slot] = symbol; sym has two
// padding entries so a 32-bit gather at the last slot stays inside.
// When 2 * scale_bits + bit_width(alphabet - 1) <= 32 (e.g. scale 11 for any alphabet, scale 12
// for up to 256 symbols), `packed` holds everything in one word so the AVX2 decoder needs one
// gather per 8 symbols instead of two: packed[slot] = (freq - 1) | (slot - cum) << s | sym << 2s.
// need_sym (the scalar kernel): build sym only. Otherwise (AVX2): packed where it fits, else
// entry and sym.
struct DecTables {
  std::vector<std::uint32_t> entry;   // filled only when packed does not fit
  std::vector<std::uint16_t> sym;
  std::vector<std::uint32_t> packed;  // empty when it does not fit
  void build(const FrequencyTable& t, bool need_sym);
};

// x: the 32 lane states. Symbols sym[0..n) have stream indices base..base+n.
// Encoders walk backwards and write words below `ptr`, returning the new pointer.
std::uint16_t* encode_scalar(std::uint32_t* x, const std::uint16_t* sym, std::size_t n, std::size_t base,
                             const FrequencyTable& t, std::uint16_t* ptr);
std::uint16_t* encode_fast(std::uint32_t* x, const std::uint16_t* sym, std::size_t n, std::size_t base,
                           const EncSym* es, std::uint16_t* ptr);
// es has t.alphabet_size() entries; alphabets <= kRansSmallAlphabet look them up from registers
// (vpermd) instead of gathering.
std::uint16_t* encode_avx2(std::uint32_t* x, const std::uint16_t* sym, std::size_t n, std::size_t base,
                           const FrequencyTable& t, const EncSym* es, std::uint16_t* ptr);
// Decoders read words from [p, end) and return the new p; FormatError when words run out.
const std::uint8_t* decode_scalar_packed(std::uint32_t* x, std::uint16_t* out, std::size_t n, std::size_t base,
                                         const FrequencyTable& t, const std::uint32_t* packed, const std::uint8_t* p,
                                         const std::uint8_t* end);
const std::uint8_t* decode_scalar(std::uint32_t* x, std::uint16_t* out, std::size_t n, std::size_t base,
                                  const FrequencyTable& t, const std::uint16_t* slot_sym, const std::uint8_t* p,
                                  const std::uint8_t* end);
const std::uint8_t* decode_avx2(std::uint32_t* x, std::uint16_t* out, std::size_t n, std::size_t base,
                                const FrequencyTable& t, const DecTables& d, const std::uint8_t* p,
                                const std::uint8_t* end);

// Alphabets up to 16 (raw 4-bit codes) decode without a slot table: the symbol is the number of
// cumulative frequencies cum(1..15) <= slot (16-bit compares, 16 lanes at once), freq and cum come
// from 16-byte pshufb tables. Same symbols and words as the reference.
inline constexpr int kRansSmallAlphabet = 16;
// Scalar decoder for those alphabets without a slot table (heads and tails of segments).
const std::uint8_t* decode_scalar_search(std::uint32_t* x, std::uint16_t* out, std::size_t n, std::size_t base,
                                         const FrequencyTable& t, const std::uint8_t* p, const std::uint8_t* end);
const std::uint8_t* decode_small_avx2(std::uint32_t* x, std::uint16_t* out, std::size_t n, std::size_t base,
                                      const FrequencyTable& t, const std::uint8_t* p, const std::uint8_t* end);

[[noreturn]] void throw_truncated();

}  // namespace vq::rans_detail
