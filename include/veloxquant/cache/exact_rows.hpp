// ExactRows: a resident cache's exact window, the newest tokens of every (batch, head) slice kept
// as they came, in the input dtype (CacheGen's residual, KIVI's full-precision windows).
//
// All slices hold the same tokens. Storage is one buffer [slice][capacity][D] used as a ring per
// slice, so dropping the oldest tokens (KIVI's value window slides one token per step) moves
// nothing. Capacity grows geometrically, never past max(needed, max_rows) rows, and the buffer is
// freed whenever the window becomes empty: an empty window holds no memory. Not thread-safe.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>

#include "veloxquant/core/tensor.hpp"
#include "veloxquant/core/uninit_vector.hpp"

namespace vq {

class ExactRows {
 public:
  ExactRows() = default;
  // `heads` maps a slice s to (b, h) = (s / heads, s % heads) of the input tensors.
  ExactRows(std::int64_t batch, std::int64_t heads, std::int64_t dim, DType dtype, std::int64_t max_rows);
  ExactRows(const ExactRows&) = default;
  ExactRows& operator=(const ExactRows&) = default;
  // A moved-from window is empty (and holds no memory).
  ExactRows(ExactRows&& o) noexcept { *this = std::move(o); }
  ExactRows& operator=(ExactRows&& o) noexcept {
    if (this != &o) {
      batch_ = o.batch_, heads_ = o.heads_, dim_ = o.dim_, max_rows_ = o.max_rows_, dtype_ = o.dtype_, row_bytes_ = o.row_bytes_;
      cap_ = std::exchange(o.cap_, 0), head_ = std::exchange(o.head_, 0), count_ = std::exchange(o.count_, 0);
      buf_ = std::move(o.buf_);
      o.buf_ = {};
    }
    return *this;
  }

  std::int64_t size() const { return count_; }
  std::int64_t slices() const { return batch_ * heads_; }
  std::int64_t dim() const { return dim_; }
  DType dtype() const { return dtype_; }
  std::size_t row_bytes() const { return row_bytes_; }
  // Append tokens [s0, s0 + n) of `input` ([B, H, S, D], this dtype) to every slice.
  void push(const Tensor& input, std::int64_t s0, std::int64_t n);
  // Append n rows of slice-major bytes [slice][n][D] (as rows_block / state() lay them out).
  void push_rows(const std::byte* rows, std::int64_t n);
  // Drop the oldest n / newest n tokens.
  void pop_front(std::int64_t n);
  void truncate(std::int64_t n);  // keep the oldest n
  void clear();                   // frees the buffer
  // Row i (0 = oldest) of slice s.
  const std::byte* row(std::int64_t s, std::int64_t i) const {
    return buf_.data() + (static_cast<std::size_t>(s * cap_ + (head_ + i) % cap_)) * row_bytes_;
  }
  // Rows [i0, i0 + n) of slice s as float32 (exact), into out [n, D].
  void read_f32(std::int64_t s, std::int64_t i0, std::int64_t n, float* out) const;
  // Bytes allocated.
  std::size_t memory_bytes() const { return buf_.capacity(); }

 private:
  void grow(std::int64_t need);
  std::byte* slot(std::int64_t s, std::int64_t i) {
    return buf_.data() + (static_cast<std::size_t>(s * cap_ + (head_ + i) % cap_)) * row_bytes_;
  }

  std::int64_t batch_ = 0, heads_ = 0, dim_ = 0, max_rows_ = 0;
  DType dtype_ = DType::F32;
  std::size_t row_bytes_ = 0;
  std::int64_t cap_ = 0, head_ = 0, count_ = 0;
  UninitVector<std::byte> buf_;
};

}  // namespace vq
