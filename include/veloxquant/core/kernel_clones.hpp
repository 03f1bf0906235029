// VQ_KERNEL: compile a hot loop twice, for AVX2 and for baseline x86-64, and let the loader pick
// one at run time (GCC target_clones, an ifunc). The arithmetic is the same IEEE float32 in both
// (no FMA: the project builds with -ffp-contract=off), so results are identical; only the vector
// width changes. Kernels marked so must not throw. Disabled under the sanitizers, whose runtime
// does not support ifuncs everywhere.
#pragma once

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define VQ_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define VQ_KERNEL
#endif
