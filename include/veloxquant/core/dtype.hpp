// Element types of KV data and their conversions to and from float32.
//
// Conversions round to nearest, ties to even (IEEE 754 default), as numpy and MLX do, so a value
// that went f32 -> f16 here is bit-identical to numpy's astype(float16).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace vq {

// Numbers are part of saved states and files: never renumber.
enum class DType : std::uint8_t { F32 = 0, F16 = 1, BF16 = 2 };

std::size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // "float32", "float16", "bfloat16"
DType dtype_from_name(std::string_view name);  // throws InvalidArgument on an unknown name

float f16_to_f32(std::uint16_t bits);
std::uint16_t f32_to_f16(float value);
float bf16_to_f32(std::uint16_t bits);
std::uint16_t f32_to_bf16(float value);

// Bulk conversions of n contiguous elements. Use F16C instructions when the CPU has them
// (chosen at run time); results are identical to the scalar functions above.
void to_f32(const void* src, DType src_dtype, float* dst, std::size_t n);
void from_f32(const float* src, void* dst, DType dst_dtype, std::size_t n);
// n elements from any type to any type (a copy when they are the same; F16 <-> BF16 through float32,
// which holds both exactly).
void convert_elements(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t n);

}  // namespace vq
