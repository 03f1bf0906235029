#include "veloxquant/transform/packed_rows.hpp"

#include <algorithm>
#include <cstring>

#include "veloxquant/core/error.hpp"
#include "veloxquant/core/kernel_clones.hpp"

namespace vq {

namespace {

// Codes [c0, c0 + n) of a row; c0 is a multiple of 8, so they start on a byte boundary.
inline void unpack_span(const std::uint8_t* __restrict row, int c0, int n, int bits, std::uint8_t* __restrict out) {
  const std::uint8_t* __restrict p = row + static_cast<std::size_t>(c0) / 8 * static_cast<std::size_t>(bits);
  switch (bits) {
    case 8:
      std::memcpy(out, p, static_cast<std::size_t>(n));
      return;
    case 4: {
      int i = 0;
      for (; i + 2 <= n; i += 2) {
        const std::uint8_t b = p[i / 2];
        out[i] = b & 0x0f;
        out[i + 1] = b >> 4;
      }
      if (i < n) out[i] = p[i / 2] & 0x0f;
      return;
    }
    case 2: {
      int i = 0;
      for (; i + 4 <= n; i += 4) {
        const std::uint8_t b = p[i / 4];
        out[i] = b & 3;
        out[i + 1] = (b >> 2) & 3;
        out[i + 2] = (b >> 4) & 3;
        out[i + 3] = b >> 6;
      }
      for (; i < n; ++i) out[i] = (p[i / 4] >> (2 * (i % 4))) & 3;
      return;
    }
    default: {
      const unsigned mask = (1u << bits) - 1u;
      std::uint32_t acc = 0;
      int fill = 0;
      std::size_t o = 0;
      for (int i = 0; i < n; ++i) {
        if (fill < bits) {
          acc |= static_cast<std::uint32_t>(p[o++]) << fill;
          fill += 8;
        }
        out[i] = static_cast<std::uint8_t>(acc & mask);
        acc >>= bits;
        fill -= bits;
      }
    }
  }
}

}  // namespace

PackedRows::PackedRows(int dim, int bits)
    : dim_(dim), bits_(bits), row_bytes_((static_cast<std::size_t>(dim) * static_cast<std::size_t>(bits) + 7) / 8) {
  require(dim >= 1 && bits >= 1 && bits <= 8, "PackedRows: dim {} and bits {} must be >= 1 and in 1..8", dim, bits);
}

void pack_row(const std::uint8_t* codes, int dim, int bits, std::uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, codes, static_cast<std::size_t>(dim));
    return;
  }
  if (bits == 4) {
    int i = 0;
    for (; i + 2 <= dim; i += 2) out[i / 2] = static_cast<std::uint8_t>(codes[i] | (codes[i + 1] << 4));
    if (i < dim) out[i / 2] = codes[i];
    return;
  }
  std::uint32_t acc = 0;
  int fill = 0;
  std::size_t o = 0;
  for (int i = 0; i < dim; ++i) {
    acc |= static_cast<std::uint32_t>(codes[i]) << fill;
    fill += bits;
    while (fill >= 8) {
      out[o++] = static_cast<std::uint8_t>(acc);
      acc >>= 8;
      fill -= 8;
    }
  }
  if (fill > 0) out[o] = static_cast<std::uint8_t>(acc);
}

void unpack_row(const std::uint8_t* row, int dim, int bits, std::uint8_t* out) { unpack_span(row, 0, dim, bits, out); }

void PackedRows::reserve(std::int64_t rows) {
  const std::size_t need = static_cast<std::size_t>(rows) * row_bytes_;
  if (need > data_.capacity()) data_.reserve(std::max(need, data_.capacity() * 2));
}

void PackedRows::append(const std::uint8_t* codes, std::int64_t n) {
  if (n <= 0) return;
  const std::size_t count = static_cast<std::size_t>(n) * static_cast<std::size_t>(dim_);
  const std::uint8_t limit = static_cast<std::uint8_t>(bits_ == 8 ? 0 : 1u << bits_);
  if (bits_ < 8) {
    std::uint8_t any = 0;
    for (std::size_t i = 0; i < count; ++i) any |= static_cast<std::uint8_t>(codes[i] >= limit);
    if (any)
      for (std::size_t i = 0; i < count; ++i)
        require(codes[i] < limit, "packed codes: code {} at {} does not fit in {} bits", codes[i], i, bits_);
  }
  reserve(rows_ + n);
  const std::size_t at = data_.size();
  data_.resize(at + static_cast<std::size_t>(n) * row_bytes_);
  for (std::int64_t r = 0; r < n; ++r)
    pack_row(codes + static_cast<std::size_t>(r) * static_cast<std::size_t>(dim_), dim_, bits_,
             data_.data() + at + static_cast<std::size_t>(r) * row_bytes_);
  rows_ += n;
}

void PackedRows::truncate(std::int64_t n) {
  require(n >= 0 && n <= rows_, "PackedRows::truncate: {} rows of {}", n, rows_);
  rows_ = n;
  data_.resize(static_cast<std::size_t>(n) * row_bytes_);
}

void PackedRows::unpack(std::int64_t r0, std::int64_t n, std::uint8_t* out) const {
  for (std::int64_t r = 0; r < n; ++r) unpack_span(row(r0 + r), 0, dim_, bits_, out + static_cast<std::size_t>(r) * static_cast<std::size_t>(dim_));
}

VQ_KERNEL void dequant_packed_rows(const std::uint8_t* rows, std::size_t row_bytes, std::int64_t n, int dim, int bits, const float* scale,
                                   const float* minv, float* out) {
  constexpr int kChunk = 256;  // codes unpacked at a time (a multiple of 8: chunks start on bytes)
  std::uint8_t q[kChunk];
  for (std::int64_t r = 0; r < n; ++r) {
    const std::uint8_t* row = rows + static_cast<std::size_t>(r) * row_bytes;
    float* __restrict o = out + r * dim;
    for (int c0 = 0; c0 < dim; c0 += kChunk) {
      const int m = std::min(kChunk, dim - c0);
      unpack_span(row, c0, m, bits, q);
      const float* __restrict s = scale + c0;
      const float* __restrict mn = minv + c0;
      float* __restrict oc = o + c0;
      for (int c = 0; c < m; ++c) oc[c] = static_cast<float>(q[c]) * s[c] + mn[c];
    }
  }
}

}  // namespace vq
