// Rounding float32 values through a narrower dtype, in place: x = to_f32(from_f32(x)). What a cache
// whose input dtype is float16 or bfloat16 holds after reconstructing float32 values (its state()
// is in the input dtype), so the reconstruction paths of quantizing caches (cache/quantized_stream,
// peers/kivi_cache, vq/vq_cache) share one definition. Private to the library (src/), defined in
// dtype.cpp next to the conversions it is made of.
#pragma once
#include <cstddef>

#include "veloxquant/core/dtype.hpp"

namespace vq {

// Round n contiguous floats through `dtype` (F32: nothing changes). Bit-identical to converting
// them to `dtype` and back one by one.
void round_through(float* x, std::size_t n, DType dtype);

}  // namespace vq
