// Packing a VqKVCache side's codes into its packed rows, and reading them back (vq_cache.hpp,
// "Packed layout").
//
// What a reader must know first:
// - A row is the heads' segments in order; head h's field position p holds coefficient
//   order[h*d + p]; positions 8g .. 8g+7 form group g (head-major), all its fields of one width w
//   (1..8 or 16) at bits i*w of the group, the group at byte group_byte[g] of the row. A field holds
//   f = q + 2^(w-1) for |q| < 2^(w-1), and 0 for an ESCAPE (the code goes to the escape list).
// - pack_rows writes every byte of every row it packs (groups tile the row), so the rows need not be
//   zeroed first; a group may store up to 8 bytes (zeros past its own), so the buffer needs the
//   cache's 8 bytes of slack after the last row. Escapes come out row by row, each row's sorted by
//   coefficient: the order the cache's escape lists keep.
// - pack_rows_ref / unpack_rows_ref are the definition (one field at a time); the fast forms give the
//   same bytes and codes (tests/vq/code_pack_test.cpp: every width, odd head sizes, escapes),
//   chosen at run time (__builtin_cpu_supports): heads of 64 or 128 fields with AVX-512 VBMI
//   (biased, range-checked and narrowed 32 codes at a time in coefficient order, each head's field
//   bytes permuted into field order with vpermi2b, each group packed with one BMI2 pext); other
//   heads with BMI2 (a group's 8 codes gathered, biased and checked with SSE2, one pext); unpack
//   with BMI2 (one pdep per group). 16-bit groups always take the reference's path.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace vq::code_pack {

// A side's layout, as views of the cache's arrays (VqKVCache::SideQuant).
struct Layout {
  int n = 0, heads = 0;                        // coefficients, heads (d = n / heads per head)
  const std::int32_t* order = nullptr;         // [n]
  const std::uint32_t* bit_at = nullptr;       // [n + 1]: first bit of coefficient c in a row; [n] = row bits
  const std::uint8_t* width = nullptr;         // [n]: field width of coefficient c (its group's)
  const std::uint32_t* group_byte = nullptr;   // [heads * ceil(d / 8)]
  const std::uint8_t* group_width = nullptr;   // same
  std::uint32_t row_bytes() const { return bit_at[n] / 8; }
};

// The packed layout (vq_cache.hpp, "Packed layout") from per-coefficient preferred widths in
// sq.width (raised to their groups' here): order, bit_at, group_byte/width, and field_mean from
// sq.mean where SideQuantT has one. A template over the cache's private side type and
// VqFieldLayout (vq/packed_codes.hpp), which share these members: one definition for both.
template <class SideQuantT>
void lay_out(SideQuantT& sq, int n, int heads) {
  const auto z = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  const int d = n / heads;
  sq.order.resize(z(n));
  sq.bit_at.assign(z(n) + 1, 0);
  sq.group_byte.clear();
  sq.group_width.clear();
  constexpr bool kMeans = requires { sq.field_mean; };
  if constexpr (kMeans) sq.field_mean.resize(z(n));
  std::uint32_t byte = 0;
  for (int h = 0; h < heads; ++h) {
    std::int32_t* o = sq.order.data() + z(h) * z(d);
    for (int p = 0; p < d; ++p) o[p] = h * d + p;
    std::stable_sort(o, o + d, [&](std::int32_t a, std::int32_t b) { return sq.width[z(a)] < sq.width[z(b)]; });
    for (int p = 0; p < d; p += 8) {
      const int m = std::min(8, d - p);
      unsigned w = 1;
      for (int i = 0; i < m; ++i) w = std::max<unsigned>(w, sq.width[z(o[p + i])]);
      if (w > 8) w = 16;
      sq.group_byte.push_back(byte);
      sq.group_width.push_back(static_cast<std::uint8_t>(w));
      for (int i = 0; i < m; ++i) {
        sq.width[z(o[p + i])] = static_cast<std::uint8_t>(w);
        sq.bit_at[z(o[p + i])] = byte * 8 + static_cast<std::uint32_t>(i) * w;
      }
      byte += (static_cast<std::uint32_t>(m) * w + 7) / 8;
    }
    if constexpr (kMeans)
      for (int p = 0; p < d; ++p) sq.field_mean[z(h) * z(d) + z(p)] = sq.mean[z(o[p])];
  }
  sq.bit_at[z(n)] = byte * 8;
}
// A side's layout as the packer takes it (views of sq's arrays: valid while sq is unchanged).
template <class SideQuantT>
Layout pack_layout(const SideQuantT& sq, int n, int heads) {
  return {n, heads, sq.order.data(), sq.bit_at.data(), sq.width.data(), sq.group_byte.data(), sq.group_width.data()};
}

struct Escape {
  std::int32_t t, c, q;  // token (row), coefficient, code
};

// Rows r = 0 .. rows-1 of `codes` ([rows][n], coefficient order) into buf's rows t_first + r;
// escapes appended to `esc` ({t_first + r, c, q}, row by row, each row's by c).
void pack_rows(const Layout& lay, const std::int16_t* codes, std::int64_t rows, std::int64_t t_first, std::uint8_t* buf,
               std::vector<Escape>& esc);
void pack_rows_ref(const Layout& lay, const std::int16_t* codes, std::int64_t rows, std::int64_t t_first, std::uint8_t* buf,
                   std::vector<Escape>& esc);

// Rows [0, rows) of buf as codes ([rows][n], coefficient order); an escaped field reads as
// -2^(w-1) (its field 0): the caller puts the escape list's codes in their places.
void unpack_rows(const Layout& lay, const std::uint8_t* buf, std::int64_t rows, std::int16_t* codes);
void unpack_rows_ref(const Layout& lay, const std::uint8_t* buf, std::int64_t rows, std::int16_t* codes);

// The forms, for tests and benchmarks: pack_rows_as runs one (has(form) must be true).
enum class Form { Reference, Bmi2, Vbmi, Vbmi2 };  // Vbmi2: heads of 64 or 128 fields without 16-bit groups
bool has(Form form);
void pack_rows_as(Form form, const Layout& lay, const std::int16_t* codes, std::int64_t rows, std::int64_t t_first, std::uint8_t* buf,
                  std::vector<Escape>& esc);

// Whether pack_rows / unpack_rows run their fast forms on this CPU (x86-64 with BMI2); set_fast(false)
// makes them run the reference (tests and benchmarks compare both). Returns the previous setting.
bool fast();
bool set_fast(bool on);

}  // namespace vq::code_pack
