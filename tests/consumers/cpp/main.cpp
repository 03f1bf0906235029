// A C++ consumer of the installed library (tests/consumers/run.sh builds it with find_package):
// builds CacheGen caches for a 4-layer model, appends smooth K/V, attends, saves and reloads
// through .vqkv bytes and checks the reloaded cache fetches bit for bit what the live one did.
#include <cmath>
#include <cstdio>
#include <vector>

#include "veloxquant/cache/builder.hpp"
#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/format/vqkv.hpp"

int main() {
  try {
    vq::KVCacheConfig cfg;
    cfg.cachegen_bits = 4;
    auto caches = vq::KVCacheBuilder::for_model(vq::ModelDescription::uniform(4, 64), cfg);
    std::vector<float> kv(2 * 100 * 64);
    for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<float>(std::sin(0.01 * static_cast<double>(i)));
    const vq::Tensor k = vq::Tensor::from_f32({1, 2, 100, 64}, kv);
    for (auto& c : caches) c->update(k, k);
    const vq::Tensor out = caches[0]->attend(vq::Tensor::from_f32({1, 2, 1, 64}, std::vector<float>(128, 0.1f)), 0.125f);
    const auto bytes = vq::serialize_prompt_cache(caches);
    const vq::PromptCache back = vq::deserialize_prompt_cache(bytes);
    const bool same = back.caches[0]->state().keys.bit_equal(caches[0]->state().keys);
    std::printf("consumer: %zu bytes for 4 layers, attend %s, reload %s\n", bytes.size(),
                vq::shape_string(out.shape()).c_str(), same ? "bit-exact" : "DIFFERENT");
    return same ? 0 : 1;
  } catch (const vq::Error& e) {
    std::fprintf(stderr, "consumer: error: %s\n", e.what());
    return 1;
  }
}
