#include "veloxquant/core/tensor.hpp"

#include <cstring>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/core/kernel_clones.hpp"

namespace vq {

std::string shape_string(const Shape4& s) { return fmt::format("[{}, {}, {}, {}]", s[0], s[1], s[2], s[3]); }

namespace {
Shape4 contiguous_strides(const Shape4& s) { return {s[1] * s[2] * s[3], s[2] * s[3], s[3], 1}; }

void check_shape(const Shape4& shape) { (void)checked_numel(shape); }
}  // namespace

std::int64_t checked_numel(const Shape4& shape) {
  // Called for every new tensor (every decode step): messages are formatted only on failure.
  for (auto d : shape)
    if (d < 0) throw InvalidArgument("tensor shape " + shape_string(shape) + " has a negative dimension");
  // Bound the product of the nonzero dimensions by 2^40 (far beyond any KV cache): then every
  // partial product (strides, numel()) fits in int64 even when another dimension is 0, and no
  // dimension is absurd beside an empty one ([1, 2^40, 2^40, 0] is refused, not 0 elements).
  std::int64_t nonzero = 1;
  bool empty = false;
  for (auto d : shape) {
    if (d == 0) {
      empty = true;
      continue;
    }
    if (nonzero > kMaxElements / d)
      throw InvalidArgument("tensor shape " + shape_string(shape) + " is too large (its nonzero dimensions multiply to more than 2^40)");
    nonzero *= d;
  }
  return empty ? 0 : nonzero;
}

Tensor Tensor::zeros(const Shape4& shape, DType dtype) {
  Tensor t = uninitialized(shape, dtype);
  std::memset(t.base_, 0, t.nbytes());
  return t;
}

Tensor Tensor::uninitialized(const Shape4& shape, DType dtype) {
  check_shape(shape);
  Tensor t;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  const std::size_t bytes = std::max<std::size_t>(t.nbytes(), 1);
  auto* mem = new std::byte[bytes];
  t.storage_ = std::shared_ptr<void>(mem, [](void* p) { delete[] static_cast<std::byte*>(p); });
  t.base_ = mem;
  return t;
}

Tensor Tensor::from_f32(const Shape4& shape, std::span<const float> values, DType dtype) {
  Tensor t = zeros(shape, dtype);
  require(static_cast<std::int64_t>(values.size()) == t.numel(),
          "from_f32: {} values given for shape {} ({} elements)", values.size(), shape_string(shape), t.numel());
  vq::from_f32(values.data(), t.base_, dtype, values.size());
  return t;
}

Tensor Tensor::wrap(void* data, const Shape4& shape, DType dtype, std::shared_ptr<void> owner) {
  check_shape(shape);
  Tensor t;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  t.storage_ = owner ? std::move(owner) : std::shared_ptr<void>(data, [](void*) {});
  t.base_ = static_cast<std::byte*>(data);
  return t;
}

bool Tensor::is_contiguous() const {
  if (empty()) return true;
  const Shape4 c = contiguous_strides(shape_);
  for (int i = 0; i < 4; ++i)
    if (shape_[i] > 1 && strides_[i] != c[i]) return false;
  return true;
}

Tensor Tensor::slice(int axis, std::int64_t start, std::int64_t stop) const {
  // Hot path (every fetch): format the message only on failure.
  if (axis < 0 || axis >= 4) throw InvalidArgument(fmt::format("slice: axis {} out of range [0, 4)", axis));
  if (start < 0 || start > stop || stop > shape_[axis])
    throw InvalidArgument(fmt::format("slice: [{}, {}) out of range for axis {} of shape {}", start, stop, axis, shape_string(shape_)));
  Tensor t = *this;
  t.shape_[axis] = stop - start;
  if (base_) t.base_ = base_ + start * strides_[axis] * static_cast<std::int64_t>(dtype_size(dtype_));
  return t;
}

Tensor Tensor::contiguous(bool force) const {
  if (is_contiguous() && !force) return *this;
  Tensor t = uninitialized(shape_, dtype_);  // every row is written below
  const std::size_t row_bytes = static_cast<std::size_t>(shape_[3]) * dtype_size(dtype_);
  for (std::int64_t b = 0; b < shape_[0]; ++b)
    for (std::int64_t h = 0; h < shape_[1]; ++h)
      for (std::int64_t s = 0; s < shape_[2]; ++s) std::memcpy(t.row(b, h, s), row(b, h, s), row_bytes);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return contiguous(true);
  Tensor t = uninitialized(shape_, dtype);  // every row is written below, in one pass
  for (std::int64_t b = 0; b < shape_[0]; ++b)
    for (std::int64_t h = 0; h < shape_[1]; ++h)
      for (std::int64_t s = 0; s < shape_[2]; ++s) vq::convert_elements(row(b, h, s), dtype_, t.row(b, h, s), dtype, static_cast<std::size_t>(shape_[3]));
  return t;
}

std::vector<float> Tensor::to_f32_vector() const {
  std::vector<float> out(static_cast<std::size_t>(numel()));
  const std::size_t d = static_cast<std::size_t>(shape_[3]);
  std::size_t i = 0;
  for (std::int64_t b = 0; b < shape_[0]; ++b)
    for (std::int64_t h = 0; h < shape_[1]; ++h)
      for (std::int64_t s = 0; s < shape_[2]; ++s, i += d) vq::to_f32(row(b, h, s), dtype_, out.data() + i, d);
  return out;
}

const std::byte* Tensor::row(std::int64_t b, std::int64_t h, std::int64_t s) const {
  return base_ + (b * strides_[0] + h * strides_[1] + s * strides_[2]) * static_cast<std::int64_t>(dtype_size(dtype_));
}

std::byte* Tensor::row(std::int64_t b, std::int64_t h, std::int64_t s) {
  return base_ + (b * strides_[0] + h * strides_[1] + s * strides_[2]) * static_cast<std::int64_t>(dtype_size(dtype_));
}

float Tensor::at(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) const {
  require(b >= 0 && b < shape_[0] && h >= 0 && h < shape_[1] && s >= 0 && s < shape_[2] && d >= 0 && d < shape_[3],
          "at({}, {}, {}, {}) out of range for shape {}", b, h, s, d, shape_string(shape_));
  float v;
  vq::to_f32(row(b, h, s) + d * static_cast<std::int64_t>(dtype_size(dtype_)), dtype_, &v, 1);
  return v;
}

void Tensor::set(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, float value) {
  require(b >= 0 && b < shape_[0] && h >= 0 && h < shape_[1] && s >= 0 && s < shape_[2] && d >= 0 && d < shape_[3],
          "set({}, {}, {}, {}) out of range for shape {}", b, h, s, d, shape_string(shape_));
  vq::from_f32(&value, row(b, h, s) + d * static_cast<std::int64_t>(dtype_size(dtype_)), dtype_, 1);
}

namespace {
// Count of elements whose exponent field reaches `lim` (vectorised; see kernel_clones.hpp).
VQ_KERNEL std::uint32_t count_exp32(const std::uint32_t* u, std::size_t n, std::uint32_t lim) {
  std::uint32_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += static_cast<std::uint32_t>((u[i] & 0x7f800000u) >= lim);
  return bad;
}
VQ_KERNEL std::uint32_t count_exp16(const std::uint16_t* u, std::size_t n, std::uint16_t mask, std::uint16_t lim) {
  std::uint16_t bad = 0;  // per-row counts stay small; 16-bit lanes vectorise twice as wide
  for (std::size_t i = 0; i < n; ++i) bad |= static_cast<std::uint16_t>((u[i] & mask) >= lim);
  return bad;
}
}  // namespace

bool Tensor::all_finite() const {
  // Test the exponent field (all ones: Inf or NaN) directly in the stored dtype: no conversion pass.
  const auto n = static_cast<std::size_t>(shape_[3]);
  const std::uint32_t lim32 = 0x7f800000u;
  const std::uint16_t mask = dtype_ == DType::F16 ? 0x7c00u : 0x7f80u;
  const std::uint16_t lim16 = mask;
  // Rows of one (b, h) are adjacent when the token stride equals D: check them in one call.
  const bool rows_adjacent = strides_[2] == shape_[3];
  const std::int64_t rows = rows_adjacent ? 1 : shape_[2];
  const std::size_t len = rows_adjacent ? n * static_cast<std::size_t>(shape_[2]) : n;
  for (std::int64_t b = 0; b < shape_[0]; ++b)
    for (std::int64_t h = 0; h < shape_[1]; ++h)
      for (std::int64_t s = 0; s < rows && shape_[2] > 0; ++s) {
        const std::byte* p = row(b, h, s);
        const bool bad = dtype_ == DType::F32 ? count_exp32(reinterpret_cast<const std::uint32_t*>(p), len, lim32) != 0
                                              : count_exp16(reinterpret_cast<const std::uint16_t*>(p), len, mask, lim16) != 0;
        if (bad) return false;
      }
  return true;
}

bool Tensor::bit_equal(const Tensor& other) const {
  if (shape_ != other.shape_ || dtype_ != other.dtype_) return false;
  const std::size_t row_bytes = static_cast<std::size_t>(shape_[3]) * dtype_size(dtype_);
  for (std::int64_t b = 0; b < shape_[0]; ++b)
    for (std::int64_t h = 0; h < shape_[1]; ++h)
      for (std::int64_t s = 0; s < shape_[2]; ++s)
        if (std::memcmp(row(b, h, s), other.row(b, h, s), row_bytes) != 0) return false;
  return true;
}

}  // namespace vq
