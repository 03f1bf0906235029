// libFuzzer target: vq_chain_decode (vq/vq_chain.hpp), a chained layer of `vq:...,predict=on`, on
// arbitrary bytes: as a first layer, and as a second layer after a fixed first one. The layer model
// (identity, 2 KV heads of 4) and the predictors (fitted on fixed synthetic K/V) are built once.
// Checks: only vq::FormatError escapes; a decoded layer has yhat and rows for exactly the tokens it
// names, finite wherever the codes are (the weights are); decoding twice gives the same bits.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "veloxquant/core/error.hpp"
#include "veloxquant/vq/vq_chain.hpp"

namespace {

constexpr int kH = 2, kD = 4, kN = kH * kD;
constexpr std::uint64_t kMaxCodes = 1 << 16;

struct Fixed {
  std::shared_ptr<vq::VqLayerModel> layer = std::make_shared<vq::VqLayerModel>(vq::make_vq_identity_layer(kH, kD));
  std::vector<vq::VqChainPredictor> pred;
  vq::VqChainDecoded first;  // a first layer of 1 sequence x 40 tokens
  Fixed() {
    std::mt19937 rng(11);
    std::normal_distribution<float> nd;
    std::vector<std::vector<vq::KVState>> samples;
    std::vector<std::vector<float>> k0, v0;
    for (int s = 0; s < 2; ++s) {
      std::vector<vq::KVState> layers;
      std::vector<float> prev(2 * kN * 40);
      for (int l = 0; l < 2; ++l) {
        std::vector<float> k(kN * 40), v(kN * 40);
        for (std::size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) + (l > 0 ? 0.5f * prev[i] : 0.0f), v[i] = 0.7f * k[i] + 0.3f * nd(rng);
        std::copy(k.begin(), k.end(), prev.begin());
        layers.push_back({vq::Tensor::from_f32({1, kH, 40, kD}, k), vq::Tensor::from_f32({1, kH, 40, kD}, v)});
      }
      samples.push_back(std::move(layers));
    }
    pred = vq::fit_vq_chain(samples, {layer, layer});
    vq::VqConfig cfg;
    cfg.calib = 8;
    auto c0 = std::make_shared<vq::VqChainKVCache>(cfg, layer, std::make_shared<vq::VqChainPredictor>(pred[0]), nullptr);
    c0->update(samples[0][0].keys, samples[0][0].values);
    first = vq::vq_chain_decode(c0->encode(), *layer, pred[0], nullptr, kMaxCodes);
  }
};

const Fixed& fixed() {
  static const Fixed f;
  return f;
}

void check(const vq::VqChainDecoded& d, int n) {
  const std::int64_t T = d.state.keys.dim(2);
  if (d.state.values.dim(2) != T) std::abort();
  for (const auto& rows : d.yhat)
    if (rows.size() != static_cast<std::size_t>(T) * static_cast<std::size_t>(n)) std::abort();
}

bool same(const vq::VqChainDecoded& a, const vq::VqChainDecoded& b) {
  if (a.yhat.size() != b.yhat.size()) return false;
  for (std::size_t i = 0; i < a.yhat.size(); ++i)
    if (a.yhat[i].size() != b.yhat[i].size() ||
        (!a.yhat[i].empty() && std::memcmp(a.yhat[i].data(), b.yhat[i].data(), a.yhat[i].size() * sizeof(float)) != 0))
      return false;
  return true;
}

void one(std::span<const std::uint8_t> bytes, const vq::VqChainPredictor& p, const vq::VqChainDecoded* prev) {
  const Fixed& f = fixed();
  try {
    const auto d = vq::vq_chain_decode(bytes, *f.layer, p, prev, kMaxCodes);
    check(d, 2 * kN);
    if (!same(d, vq::vq_chain_decode(bytes, *f.layer, p, prev, kMaxCodes))) std::abort();
  } catch (const vq::FormatError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const Fixed& f = fixed();
  const std::span<const std::uint8_t> bytes(data, size);
  one(bytes, f.pred[0], nullptr);
  one(bytes, f.pred[1], &f.first);
  return 0;
}
