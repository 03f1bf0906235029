// Run-time CPU feature checks that both g++ and clang accept (clang 14's __builtin_cpu_supports
// does not know "f16c", so F16C is read from CPUID directly).
#pragma once
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace vq {

// F16C (float16 <-> float32 conversion instructions) and AVX, which its 256-bit forms need.
inline bool cpu_has_f16c_avx() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  return (c & bit_F16C) != 0 && __builtin_cpu_supports("avx");
#else
  return false;
#endif
}

}  // namespace vq
