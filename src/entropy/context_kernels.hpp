// Private: the context coder's rANS kernels (context_codec.cpp: scalar; context_avx2.cpp: AVX2)
// and the tables they share. See context_coder.hpp for the format.
//
// Units are bytes, row-major ([row][C], C = slices * dim): a pair row's unit is a | b << 4, a single
// row's a | a << 4, so that the next row's context is always unit >> 4. Unit i is in lane i % 32.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "rans_kernels.hpp"
#include "veloxquant/entropy/context_coder.hpp"

namespace vq::context_detail {

// Row kinds (one byte per row).
inline constexpr std::uint8_t kSingleRow = 1;  // one token (else a pair of tokens)
inline constexpr std::uint8_t kStartRow = 2;   // the row's first token starts a group
inline constexpr int kSingleScaleBits = kSmallAlphabetScaleBits;  // the class tables' precision (10)
inline constexpr int kTableShift[2] = {kPairScaleBits, kSingleScaleBits};  // by kind & kSingleRow

// 32 lanes (rans.hpp's kRansLanes): 4 AVX2 vectors. 64 (two independent chains) measured no faster
// here: the gathers, not the dependency chains, bound the kernel (docs/benchmarks.md).
inline constexpr std::size_t kLanes = kRansLanes;

// What both kernels of one direction read. Classes are looked up by raw context: cls[c] for the
// previous code c (0..15; codes above the alphabet never occur), start_class at a group start.
struct KernelTables {
  std::size_t C = 0;
  const std::uint8_t* kind = nullptr;  // per row
  std::uint8_t cls[16] = {};
  std::uint8_t start_class = 0;
};

// Decoder slot tables: class k's table of kind t starts at entry k << kTableShift[t]; entry =
// (freq - 1) | (slot - cum) << s | unit << 2s with s = kTableShift[t] (12 + 12 + 8 and 10 + 10 + 8
// bits).
struct DecodeKernelTables : KernelTables {
  const std::uint32_t* table[2] = {nullptr, nullptr};
};

// Encoder constants of a unit: rans_kernels.hpp's pack_enc (EncSym in 64 bits).
using rans_detail::pack_enc;
// Class k's pair entries at pair[k * 256 + unit], its single entries at single[k * 16 + code].
struct EncodeKernelTables : KernelTables {
  const std::uint64_t* pair = nullptr;
  const std::uint64_t* single = nullptr;
};

// Decodes units [i, n) in whole groups of 32 while >= 64 payload bytes remain (C % 32 == 0,
// i % 32 == 0); advances i, returns the new word pointer. Same units and words as the scalar loop.
const std::uint8_t* decode_avx2(std::uint32_t* x, std::uint8_t* units, std::size_t& i, std::size_t n, const DecodeKernelTables& t,
                                const std::uint8_t* p, const std::uint8_t* end);
// Encodes units [0, n) backwards (C % 32 == 0, n % 32 == 0), words below ptr; returns the new ptr,
// or nullptr when a unit has frequency 0.
std::uint16_t* encode_avx2(std::uint32_t* x, const std::uint8_t* units, std::size_t n, const EncodeKernelTables& t, std::uint16_t* ptr);

// A decoder slot table of 2^s entries: unit u (of `n` units, frequency freq[u], in order) gets
// entries (freq - 1) | k << s | code[u] << 2s, k < freq, at its cumulative position; 8 entries a
// store (writes up to 7 entries past the table: callers leave 8 of padding).
void fill_table_avx2(std::uint32_t* e, const std::uint32_t* freq, const std::uint32_t* code, std::size_t n, int s);

}  // namespace vq::context_detail
