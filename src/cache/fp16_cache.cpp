#include "veloxquant/cache/fp16_cache.hpp"

#include <cmath>

#include <fmt/core.h>

#include "veloxquant/core/dtype.hpp"
#include "veloxquant/core/error.hpp"

namespace vq {

std::pair<Tensor, Tensor> Fp16KVCache::update_and_fetch(const Tensor& keys, const Tensor& values) {
  require(keys.dtype() == DType::F32 && values.dtype() == DType::F32,
          "Fp16KVCache takes float32 keys and values, got {} and {}", dtype_name(keys.dtype()), dtype_name(values.dtype()));
  // f32 -> f16 -> f32 rounds each element to float16 precision (half to even) exactly once. A
  // finite element that rounds to infinity (|x| >= 65520) is refused, never stored as inf.
  auto round_trip = [](const Tensor& t) {
    Tensor r = t.to(DType::F16).to(DType::F32);
    if (!r.all_finite() && t.all_finite()) {
      float worst = 0;
      for (const float x : t.to_f32_vector()) worst = std::abs(x) > std::abs(worst) ? x : worst;
      throw InvalidArgument(fmt::format("fp16 cache: {} is outside float16's range (|x| <= 65504); use fp32, or scale the K/V", worst));
    }
    return r;
  };
  return KVCache::update_and_fetch(round_trip(keys), round_trip(values));
}

CacheBytes Fp16KVCache::stored_bytes() const {
  const KVState s = state();
  const double bytes = 2.0 * static_cast<double>(s.keys.numel() + s.values.numel());
  return {bytes, bytes};
}

}  // namespace vq
