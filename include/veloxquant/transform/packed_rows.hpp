// PackedRows: rows of `dim` fixed-width codes (1..8 bits each), packed as a resident cache holds
// them. Each row starts on a byte boundary and takes row_bytes() = ceil(dim * bits / 8) bytes; inside
// a row, code c occupies bits [c*bits, (c+1)*bits) least significant bit first (bit_pack.hpp's
// order). At 4 bits two codes share a byte (code 2i in the low nibble); at 8 bits a row is the
// codes themselves. Rows are appended and cut at the end only; the buffer grows geometrically.
//
// dequant_packed_rows turns packed rows straight into float32 x_hat = code * scale + min (two
// roundings, no fused multiply-add: the quantizers' formula), one tight loop per row with fast
// paths for 2, 4 and 8 bits: what a resident cache's attention tiles are read with.
#pragma once
#include <cstddef>
#include <cstdint>

#include "veloxquant/core/uninit_vector.hpp"

namespace vq {

class PackedRows {
 public:
  PackedRows() = default;
  PackedRows(int dim, int bits);  // throws InvalidArgument unless dim >= 1 and 1 <= bits <= 8

  std::int64_t rows() const { return rows_; }
  std::size_t row_bytes() const { return row_bytes_; }
  int dim() const { return dim_; }
  int bits() const { return bits_; }
  // Append n rows of dim codes each (row-major [n, dim]); codes must be < 2^bits (checked: throws
  // InvalidArgument naming the first that is not, nothing appended). Grows capacity geometrically.
  void append(const std::uint8_t* codes, std::int64_t n);
  // Keep the first n rows (n <= rows()); capacity stays.
  void truncate(std::int64_t n);
  // Make room for `rows` rows in total without appending.
  void reserve(std::int64_t rows);
  // Rows [r0, r0 + n) as codes, row-major [n, dim], into out.
  void unpack(std::int64_t r0, std::int64_t n, std::uint8_t* out) const;
  const std::uint8_t* row(std::int64_t r) const { return data_.data() + static_cast<std::size_t>(r) * row_bytes_; }
  // Bytes allocated (the capacity).
  std::size_t memory_bytes() const { return data_.capacity(); }

 private:
  int dim_ = 0, bits_ = 8;
  std::size_t row_bytes_ = 0;
  std::int64_t rows_ = 0;
  UninitVector<std::uint8_t> data_;
};

// Pack one row of dim codes (each < 2^bits) into row bytes (ceil(dim * bits / 8), zero pad bits).
void pack_row(const std::uint8_t* codes, int dim, int bits, std::uint8_t* out);
// Unpack one packed row into dim codes.
void unpack_row(const std::uint8_t* row, int dim, int bits, std::uint8_t* out);

// n packed rows (row_bytes apart) of one group: out[r * dim + c] = float(code) * scale[c] + minv[c].
void dequant_packed_rows(const std::uint8_t* rows, std::size_t row_bytes, std::int64_t n, int dim, int bits, const float* scale,
                         const float* minv, float* out);

}  // namespace vq
