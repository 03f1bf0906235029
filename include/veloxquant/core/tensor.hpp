// Tensor: KV data shaped [B, H, S, D] (batch, KV heads, tokens, head dim) in f32, f16 or bf16.
//
// A Tensor is a view: it shares reference-counted storage with every tensor it was sliced from,
// so slicing along any axis is O(1) and never copies. The last axis (D) is always contiguous,
// which lets every kernel work on whole rows of D elements. Strides are in elements.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/core/dtype.hpp"

namespace vq {

using Shape4 = std::array<std::int64_t, 4>;

// The most elements a tensor may have; tensors are refused (InvalidArgument) when the product of
// their NONZERO dimensions exceeds it, so no product of dimensions of a valid shape overflows.
inline constexpr std::int64_t kMaxElements = std::int64_t{1} << 40;

std::string shape_string(const Shape4& shape);  // "[1, 8, 32, 128]"

// The element count of `shape`, computed without overflow. Throws InvalidArgument on a negative
// dimension or when the nonzero dimensions multiply to more than kMaxElements. Check a shape
// with this before sizing anything by it.
std::int64_t checked_numel(const Shape4& shape);

class Tensor {
 public:
  Tensor() = default;  // an empty tensor: shape [0, 0, 0, 0], no storage

  // A new contiguous tensor filled with zeros. Throws InvalidArgument on a negative dimension or a
  // shape whose nonzero dimensions multiply to more than kMaxElements (wrap() checks the same).
  static Tensor zeros(const Shape4& shape, DType dtype);
  // A new contiguous tensor whose contents are unspecified (for buffers about to be overwritten).
  static Tensor uninitialized(const Shape4& shape, DType dtype);
  // A new contiguous tensor holding `values` (row-major) converted to `dtype`.
  static Tensor from_f32(const Shape4& shape, std::span<const float> values, DType dtype = DType::F32);
  // Wrap caller-owned contiguous memory without copying; `owner` keeps it alive (may be null when
  // the caller guarantees the lifetime).
  static Tensor wrap(void* data, const Shape4& shape, DType dtype, std::shared_ptr<void> owner = nullptr);

  const Shape4& shape() const { return shape_; }
  std::int64_t dim(int axis) const { return shape_.at(static_cast<std::size_t>(axis)); }
  const Shape4& strides() const { return strides_; }
  DType dtype() const { return dtype_; }
  std::int64_t numel() const { return shape_[0] * shape_[1] * shape_[2] * shape_[3]; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  bool empty() const { return numel() == 0; }
  bool is_contiguous() const;
  // Whether two tensors view the same storage (used to prove "no copy").
  bool shares_storage_with(const Tensor& other) const { return storage_ && storage_ == other.storage_; }

  // View of [start, stop) along `axis`; O(1), shares storage.
  Tensor slice(int axis, std::int64_t start, std::int64_t stop) const;
  // A contiguous copy (or *this when already contiguous and `force` is false).
  Tensor contiguous(bool force = false) const;
  // A contiguous copy converted to `dtype`.
  Tensor to(DType dtype) const;
  // All elements as float32, row-major.
  std::vector<float> to_f32_vector() const;

  // Pointer to row (b, h, s): D contiguous elements of dtype().
  const std::byte* row(std::int64_t b, std::int64_t h, std::int64_t s) const;
  std::byte* row(std::int64_t b, std::int64_t h, std::int64_t s);
  float at(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) const;
  void set(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, float value);

  // True when no element is NaN or +-Inf.
  bool all_finite() const;

  // Bit-exact equality of shape, dtype and every element's bits.
  bool bit_equal(const Tensor& other) const;

 private:
  std::shared_ptr<void> storage_;
  std::byte* base_ = nullptr;  // element (0,0,0,0) of this view
  Shape4 shape_{0, 0, 0, 0};
  Shape4 strides_{0, 0, 0, 1};
  DType dtype_ = DType::F32;
};

}  // namespace vq
