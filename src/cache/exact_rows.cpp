#include "veloxquant/cache/exact_rows.hpp"

#include <algorithm>
#include <cstring>

#include "veloxquant/core/error.hpp"

namespace vq {

ExactRows::ExactRows(std::int64_t batch, std::int64_t heads, std::int64_t dim, DType dtype, std::int64_t max_rows)
    : batch_(batch), heads_(heads), dim_(dim), max_rows_(max_rows), dtype_(dtype),
      row_bytes_(static_cast<std::size_t>(dim) * dtype_size(dtype)) {}

void ExactRows::grow(std::int64_t need) {
  if (need <= cap_) return;
  const std::int64_t cap = std::max(need, std::min(2 * cap_, std::max(need, max_rows_)));
  UninitVector<std::byte> nb;
  nb.reserve(static_cast<std::size_t>(slices() * cap) * row_bytes_);  // exactly: resize below does not grow it
  nb.resize(static_cast<std::size_t>(slices() * cap) * row_bytes_);
  for (std::int64_t s = 0; s < slices(); ++s)
    for (std::int64_t i = 0; i < count_; ++i)
      std::memcpy(nb.data() + static_cast<std::size_t>(s * cap + i) * row_bytes_, row(s, i), row_bytes_);
  buf_ = std::move(nb);
  cap_ = cap;
  head_ = 0;
}

void ExactRows::push(const Tensor& input, std::int64_t s0, std::int64_t n) {
  if (n <= 0) return;
  grow(count_ + n);
  for (std::int64_t s = 0; s < slices(); ++s)
    for (std::int64_t i = 0; i < n; ++i) std::memcpy(slot(s, count_ + i), input.row(s / heads_, s % heads_, s0 + i), row_bytes_);
  count_ += n;
}

void ExactRows::push_rows(const std::byte* rows, std::int64_t n) {
  if (n <= 0) return;
  grow(count_ + n);
  for (std::int64_t s = 0; s < slices(); ++s)
    for (std::int64_t i = 0; i < n; ++i, rows += row_bytes_) std::memcpy(slot(s, count_ + i), rows, row_bytes_);
  count_ += n;
}

void ExactRows::pop_front(std::int64_t n) {
  require(n >= 0 && n <= count_, "ExactRows::pop_front: {} of {} rows", n, count_);
  if (n == count_) return clear();
  head_ = (head_ + n) % cap_;
  count_ -= n;
}

void ExactRows::truncate(std::int64_t n) {
  require(n >= 0 && n <= count_, "ExactRows::truncate: {} of {} rows", n, count_);
  if (n == 0) return clear();
  count_ = n;
}

void ExactRows::clear() {
  UninitVector<std::byte>().swap(buf_);
  cap_ = head_ = count_ = 0;
}

void ExactRows::read_f32(std::int64_t s, std::int64_t i0, std::int64_t n, float* out) const {
  while (n > 0) {  // at most two contiguous runs (the ring wraps once)
    const std::int64_t pos = (head_ + i0) % cap_, run = std::min(n, cap_ - pos);
    to_f32(buf_.data() + static_cast<std::size_t>(s * cap_ + pos) * row_bytes_, dtype_, out, static_cast<std::size_t>(run * dim_));
    out += run * dim_;
    i0 += run;
    n -= run;
  }
}

}  // namespace vq
