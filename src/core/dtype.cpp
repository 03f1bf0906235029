#include "veloxquant/core/dtype.hpp"
#include "dtype_round.hpp"
#include "veloxquant/core/cpu_features.hpp"

#include <algorithm>
#include <bit>
#include <cstring>

#include "veloxquant/core/error.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define VQ_X86 1
#endif

namespace vq {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
  }
  throw InvalidArgument("unknown dtype");
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "float32";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
  }
  throw InvalidArgument("unknown dtype");
}

DType dtype_from_name(std::string_view name) {
  if (name == "float32" || name == "f32") return DType::F32;
  if (name == "float16" || name == "f16") return DType::F16;
  if (name == "bfloat16" || name == "bf16") return DType::BF16;
  throw InvalidArgument("unknown dtype '" + std::string(name) + "' (expected float32, float16 or bfloat16)");
}

float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        mant <<= 1;
        ++e;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<std::uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  return std::bit_cast<float>(bits);
}

std::uint16_t f32_to_f16(float value) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan (keep nan quiet)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u | ((absx >> 13) & 0x3ffu) : 0u));
  }
  if (absx >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (absx < 0x38800000u) {  // result is subnormal or zero
    // Value in units of 2^-24, rounded half to even.
    const float a = std::bit_cast<float>(absx);
    const float scaled = a * 16777216.0f;  // exact: power of two
    // scaled < 1024; round half to even by the magic-number trick (exact in float).
    const float r = (scaled + 8388608.0f) - 8388608.0f;
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(r));
  }
  // Normal: rebias exponent, round mantissa half to even.
  std::uint32_t m = absx + 0xc8000000u;  // exp - 112 << 23
  const std::uint32_t round_bit = 1u << 12;
  const std::uint32_t lsb = (m >> 13) & 1u;
  m += round_bit - 1 + lsb;
  return static_cast<std::uint16_t>(sign | (m >> 13));
}

float bf16_to_f32(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t f32_to_bf16(float value) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet nan
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

namespace {

#ifdef VQ_X86
__attribute__((target("f16c,avx"))) void f16_to_f32_f16c(const std::uint16_t* src, float* dst, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

__attribute__((target("f16c,avx"))) void f32_to_f16_f16c(const float* src, std::uint16_t* dst, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

bool cpu_has_f16c() {
  static const bool has = cpu_has_f16c_avx();
  return has;
}
#endif

}  // namespace

void to_f32(const void* src, DType src_dtype, float* dst, std::size_t n) {
  if (n == 0) return;  // empty tensors may have null buffers (memcpy must not see them)
  switch (src_dtype) {
    case DType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::F16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
#ifdef VQ_X86
      if (cpu_has_f16c()) return f16_to_f32_f16c(s, dst, n);
#endif
      for (std::size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    case DType::BF16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
  }
}

void from_f32(const float* src, void* dst, DType dst_dtype, std::size_t n) {
  if (n == 0) return;  // empty tensors may have null buffers (memcpy must not see them)
  switch (dst_dtype) {
    case DType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::F16: {
      auto* d = static_cast<std::uint16_t*>(dst);
#ifdef VQ_X86
      if (cpu_has_f16c()) return f32_to_f16_f16c(src, d, n);
#endif
      for (std::size_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      return;
    }
    case DType::BF16: {
      auto* d = static_cast<std::uint16_t*>(dst);
      for (std::size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
  }
}

void convert_elements(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t n) {
  if (n == 0) return;
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, n * dtype_size(src_dtype));
  } else if (src_dtype == DType::F32) {
    from_f32(static_cast<const float*>(src), dst, dst_dtype, n);
  } else if (dst_dtype == DType::F32) {
    to_f32(src, src_dtype, static_cast<float*>(dst), n);
  } else {  // F16 <-> BF16 through float32, 256 elements at a time
    float buf[256];
    const auto* s = static_cast<const std::byte*>(src);
    auto* d = static_cast<std::byte*>(dst);
    for (std::size_t i = 0; i < n; i += 256) {
      const std::size_t m = std::min<std::size_t>(256, n - i);
      to_f32(s + i * dtype_size(src_dtype), src_dtype, buf, m);
      from_f32(buf, d + i * dtype_size(dst_dtype), dst_dtype, m);
    }
  }
}

void round_through(float* x, std::size_t n, DType dtype) {
  if (dtype == DType::F32) return;
  std::uint16_t narrow[1024];
  for (std::size_t i = 0; i < n; i += 1024) {
    const std::size_t m = std::min<std::size_t>(1024, n - i);
    from_f32(x + i, narrow, dtype, m);
    to_f32(narrow, dtype, x + i, m);
  }
}

}  // namespace vq
