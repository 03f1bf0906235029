// `vq:...,predict=on` (vq/vq_chain.hpp): the fit recovers linear maps, the chained caches code
// residuals that the decoder turns back into the very same rows (bit for bit), a layer fed out of
// order or a damaged record is refused, and on the real model the predictors lower the residuals.
#include "veloxquant/vq/vq_chain.hpp"

#include <cstring>
#include <random>
#include <span>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/model/vq_chain_predictors.hpp"
#include "../model/model_support.hpp"

namespace {

using vq::KVState;
using vq::Tensor;

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

constexpr int kH = 2, kD = 4, kN = kH * kD;

// Three layers of synthetic K/V [1, kH, T, kD] tied the way a residual stream ties them: layer 0's K
// random with a mean, V = M K + b + noise; layer l's K and V linear maps of layer l-1's plus noise.
std::vector<KVState> synthetic_layers(int tokens, std::uint32_t seed, double noise) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd;
  std::mt19937 fixed(7);  // the maps: the same for every sample
  std::uniform_real_distribution<double> u(-0.5, 0.5);
  std::vector<double> maps(3 * 2 * kN * (2 * kN + 1));
  for (auto& m : maps) m = u(fixed);
  std::vector<KVState> out;
  std::vector<double> prev(2 * kN);
  for (int l = 0; l < 3; ++l) {
    std::vector<float> k(sz(kH) * sz(tokens) * kD), v(k.size());
    for (int t = 0; t < tokens; ++t) {
      std::vector<double> kr(kN), vr(kN);
      const double* mk = maps.data() + sz(l) * 2 * kN * (2 * kN + 1);
      const double* mv = mk + kN * (2 * kN + 1);
      for (int c = 0; c < kN; ++c) {
        double s = mk[c * (2 * kN + 1) + 2 * kN] + (l == 0 ? 3.0 * nd(rng) : noise * nd(rng));
        if (l > 0)
          for (int j = 0; j < 2 * kN; ++j) s += mk[c * (2 * kN + 1) + j] * prev[sz(j)];
        kr[sz(c)] = s;
      }
      for (int c = 0; c < kN; ++c) {
        double s = mv[c * (2 * kN + 1) + 2 * kN] + noise * nd(rng);
        for (int j = 0; j < kN; ++j) s += mv[c * (2 * kN + 1) + j] * kr[sz(j)];
        vr[sz(c)] = s;
      }
      for (int h = 0; h < kH; ++h)
        for (int i = 0; i < kD; ++i) {
          k[(sz(h) * sz(tokens) + sz(t)) * kD + sz(i)] = static_cast<float>(kr[sz(h * kD + i)]);
          v[(sz(h) * sz(tokens) + sz(t)) * kD + sz(i)] = static_cast<float>(vr[sz(h * kD + i)]);
        }
      std::copy(kr.begin(), kr.end(), prev.begin());
      std::copy(vr.begin(), vr.end(), prev.begin() + kN);
    }
    out.push_back({Tensor::from_f32({1, kH, tokens, kD}, k), Tensor::from_f32({1, kH, tokens, kD}, v)});
  }
  return out;
}

std::vector<std::shared_ptr<const vq::VqLayerModel>> identity_models(int layers) {
  std::vector<std::shared_ptr<const vq::VqLayerModel>> m;
  for (int l = 0; l < layers; ++l) m.push_back(std::make_shared<vq::VqLayerModel>(vq::make_vq_identity_layer(kH, kD)));
  return m;
}

// Residual energy of a predictor over one sample's layer l against the coefficients' own spread.
double residual_ratio(const std::vector<KVState>& s, const vq::VqChainPredictor& p, int l) {
  double res = 0, var = 0;
  const std::int64_t T = s[sz(l)].keys.dim(2);
  std::vector<double> mean(kN, 0.0);
  for (std::int64_t t = 0; t < T; ++t)
    for (int c = 0; c < kN; ++c) mean[sz(c)] += s[sz(l)].values.at(0, c / kD, t, c % kD) / static_cast<double>(T);
  const int ins = l > 0 ? 3 * kN : kN;
  const auto w = vq::vq_chain_weights(p.v_moments, p.v_cross, ins, kN, p.rows, std::vector<float>(sz(ins), 0.0f));
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<double> in;
    for (int c = 0; c < kN; ++c) in.push_back(s[sz(l)].keys.at(0, c / kD, t, c % kD));
    if (l > 0) {
      for (int c = 0; c < kN; ++c) in.push_back(s[sz(l - 1)].keys.at(0, c / kD, t, c % kD));
      for (int c = 0; c < kN; ++c) in.push_back(s[sz(l - 1)].values.at(0, c / kD, t, c % kD));
    }
    for (int c = 0; c < kN; ++c) {
      double pred = w[in.size() * kN + sz(c)];  // [ins + 1][outs], the bias row last
      for (std::size_t j = 0; j < in.size(); ++j) pred += w[j * kN + sz(c)] * in[j];
      const double y = s[sz(l)].values.at(0, c / kD, t, c % kD);
      res += (y - pred) * (y - pred), var += (y - mean[sz(c)]) * (y - mean[sz(c)]);
    }
  }
  return res / var;
}

TEST(VqChain, FitRecoversTheLinearMaps) {
  std::vector<std::vector<KVState>> samples{synthetic_layers(200, 1, 0.01), synthetic_layers(200, 2, 0.01)};
  const auto pred = vq::fit_vq_chain(samples, identity_models(3));
  ASSERT_EQ(pred.size(), 3u);
  EXPECT_EQ(pred[0].n_prev, 0);
  EXPECT_TRUE(pred[0].k_moments.empty());
  EXPECT_EQ(pred[1].n_prev, 2 * kN);
  EXPECT_EQ(pred[1].k_cross.size(), sz(kN) * (2 * kN + 1));
  const auto held_out = synthetic_layers(200, 3, 0.01);
  for (int l = 0; l < 3; ++l) EXPECT_LT(residual_ratio(held_out, pred[sz(l)], l), 1e-3) << "layer " << l;
}

// stories260K's caches at `spec` (predict=on), fed `tokens` through the model in two chunks.
struct ChainRun {
  vq::Transformer model{vq::Checkpoint::load(vqtest::model_path())};
  std::vector<std::shared_ptr<vq::KVCache>> caches;
  std::vector<const vq::VqChainKVCache*> chain;
  ChainRun(const std::string& spec, int first, int second) {
    caches = vq::make_caches(spec, model);
    for (const auto& c : caches) chain.push_back(dynamic_cast<const vq::VqChainKVCache*>(c.get()));
    std::vector<int> toks;
    for (int i = 0; i < first + second; ++i) toks.push_back(i == 0 ? 1 : 3 + (i * 37) % 500);
    model.forward(std::span<const int>(toks).first(sz(first)), caches);
    model.forward(std::span<const int>(toks).subspan(sz(first)), caches);
  }
};

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  for (std::int64_t h = 0; h < a.dim(1); ++h)
    for (std::int64_t t = 0; t < a.dim(2); ++t)
      if (std::memcmp(a.row(0, h, t), b.row(0, h, t), sz(a.dim(3)) * sizeof(float)) != 0) return false;
  return true;
}

// Every layer's record decodes, given the layer before's decode, into the cache's own yhat and rows.
TEST(VqChain, DecodesBitForBitWhatTheCachesHeld) {
  for (const char* spec : {"vq:bits=0.5,predict=on", "vq:bits=2,predict=on", "vq:bits=6,predict=on,calib=32"}) {
    ChainRun run(spec, 100, 60);
    std::vector<vq::VqChainDecoded> decoded;
    double coded_bits = 0;
    for (std::size_t l = 0; l < run.chain.size(); ++l) {
      const vq::VqChainKVCache& c = *run.chain[l];
      ASSERT_NE(&c, nullptr) << spec;
      ASSERT_EQ(c.quantized_tokens(), 160) << spec;
      const auto bytes = c.encode();
      coded_bits += 8.0 * static_cast<double>(bytes.size());
      EXPECT_EQ(c.stored_bytes().estimated_bytes, static_cast<double>(bytes.size()));
      decoded.push_back(vq::vq_chain_decode(bytes, c.layer_model(), c.predictor(), l > 0 ? &decoded[l - 1] : nullptr, 1u << 20));
      const auto& d = decoded.back();
      ASSERT_EQ(d.yhat.size(), 1u);
      for (std::int64_t t = 0; t < 160; ++t)
        ASSERT_EQ(std::memcmp(d.yhat[0].data() + sz(t) * sz(c.coefficients()), c.yhat_row(0, t), sz(c.coefficients()) * sizeof(float)), 0)
            << spec << " layer " << l << " token " << t;
      const vq::KVState st = c.state();
      EXPECT_TRUE(same_bits(d.state.keys, st.keys)) << spec << " layer " << l;
      EXPECT_TRUE(same_bits(d.state.values, st.values)) << spec << " layer " << l;
    }
    // The rate the spec asks for, roughly (metadata and the coder's models on top of it).
    const double elements = 160.0 * static_cast<double>(run.chain.size()) * 2 * 4 * 8;
    EXPECT_LT(coded_bits / elements, std::string(spec).find("bits=6") != std::string::npos ? 7.5 : 3.5) << spec;
  }
}

TEST(VqChain, DamagedRecordsAndWrongPartsAreRefused) {
  ChainRun run("vq:bits=2,predict=on", 80, 0);
  const vq::VqChainKVCache& l0 = *run.chain[0];
  const vq::VqChainKVCache& l1 = *run.chain[1];
  auto bytes = l0.encode();
  const auto d0 = vq::vq_chain_decode(bytes, l0.layer_model(), l0.predictor(), nullptr, 1u << 20);
  auto wrong_tag = bytes;
  wrong_tag[0] = 6;
  EXPECT_THROW(vq::vq_chain_decode(wrong_tag, l0.layer_model(), l0.predictor(), nullptr, 1u << 20), vq::FormatError);
  for (std::size_t cut : {std::size_t{1}, bytes.size() / 2, bytes.size() - 1})
    EXPECT_THROW(vq::vq_chain_decode(std::span<const std::uint8_t>(bytes).first(cut), l0.layer_model(), l0.predictor(), nullptr, 1u << 20),
                 vq::FormatError)
        << cut;
  EXPECT_THROW(vq::vq_chain_decode(bytes, l0.layer_model(), l0.predictor(), nullptr, 100), vq::FormatError);  // over max_codes
  // Layer 1 without the layer before, or with the first layer given one.
  const auto b1 = l1.encode();
  EXPECT_THROW(vq::vq_chain_decode(b1, l1.layer_model(), l1.predictor(), nullptr, 1u << 20), vq::InvalidArgument);
  EXPECT_THROW(vq::vq_chain_decode(bytes, l0.layer_model(), l0.predictor(), &d0, 1u << 20), vq::InvalidArgument);
  EXPECT_NO_THROW(vq::vq_chain_decode(b1, l1.layer_model(), l1.predictor(), &d0, 1u << 20));
}

TEST(VqChain, ALayerFedBeforeTheOneBeforeIsRefusedUnchanged) {
  vq::Transformer model{vq::Checkpoint::load(vqtest::model_path())};
  auto caches = vq::make_caches("vq:bits=2,predict=on,calib=8", model);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> k(4 * 10 * 8), v(k.size());
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  const Tensor keys = Tensor::from_f32({1, 4, 10, 8}, k), values = Tensor::from_f32({1, 4, 10, 8}, v);
  EXPECT_THROW(caches[1]->update(keys, values), vq::InvalidArgument);
  EXPECT_EQ(caches[1]->offset(), 0);
  caches[0]->update(keys, values);
  EXPECT_NO_THROW(caches[1]->update(keys, values));
  EXPECT_EQ(caches[1]->offset(), 10);
  // Non-finite input and float16 are refused, the cache unchanged.
  k[5] = NAN;
  EXPECT_THROW(caches[0]->update(Tensor::from_f32({1, 4, 10, 8}, k), values), vq::InvalidArgument);
  EXPECT_EQ(caches[0]->offset(), 10);
  EXPECT_THROW(vq::make_caches("vq:bits=2,predict=on,residual=4", model), vq::InvalidArgument);
  // A spec value that is not on/off, and predict=on without a model our engine runs: one clear error each.
  EXPECT_THROW(vq::MethodSpec::parse("vq:bits=2,predict=maybe"), vq::InvalidArgument);
  try {
    (void)vq::make_caches(vq::MethodSpec::parse("vq:bits=2,predict=on"), model.description());
    ADD_FAILURE() << "predict=on without weights was accepted";
  } catch (const vq::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("needs a model our engine runs"), std::string::npos) << e.what();
  }
}

// On the real model the fitted predictors take most of each later layer's spread (measured at
// fine steps, where the reconstructions are close to the exact coefficients): the ratio of
// predicted-residual to raw spread of every coded K coefficient, via the coded size at equal step.
TEST(VqChain, PredictionLowersTheCodedSizeOnTheRealModel) {
  ChainRun plain("vq:bits=2", 200, 0), chained("vq:bits=2,predict=on", 200, 0);
  double a = 0, b = 0;
  for (std::size_t l = 0; l < chained.caches.size(); ++l) {
    a += plain.caches[l]->stored_bytes().estimated_bytes;
    b += chained.caches[l]->stored_bytes().estimated_bytes;
  }
  // At equal bits the chained caches code about the same size, at a finer step (the residuals
  // are smaller): their rows are closer to the exact ones.
  EXPECT_LT(b, 1.1 * a);
  double err_plain = 0, err_chain = 0;
  vq::Transformer model{vq::Checkpoint::load(vqtest::model_path())};
  auto exact = vq::make_fp32_caches(model);
  std::vector<int> toks;
  for (int i = 0; i < 200; ++i) toks.push_back(i == 0 ? 1 : 3 + (i * 37) % 500);
  model.forward(toks, exact);
  for (std::size_t l = 0; l < exact.size(); ++l) {
    const auto e = exact[l]->state(), p = plain.caches[l]->state(), c = chained.caches[l]->state();
    for (std::int64_t h = 0; h < 4; ++h)
      for (std::int64_t t = 64; t < 200; ++t)
        for (std::int64_t i = 0; i < 8; ++i) {
          err_plain += std::pow(p.values.at(0, h, t, i) - e.values.at(0, h, t, i), 2);
          err_chain += std::pow(c.values.at(0, h, t, i) - e.values.at(0, h, t, i), 2);
        }
  }
  EXPECT_LT(err_chain, 0.7 * err_plain);
}

// Before calibration nothing is quantized: the record is empty and decodes to no rows, the exact
// tokens are billed at 4 bytes an element; two sequences chain and decode bit for bit; trimming into
// the calibration forgets it and the next tokens calibrate again.
TEST(VqChain, EmptyBatchedAndTrimmedCaches) {
  vq::Transformer model{vq::Checkpoint::load(vqtest::model_path())};
  auto caches = vq::make_caches("vq:bits=2,predict=on,calib=16", model);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  const auto chunk = [&](int tokens) {
    std::vector<float> v(2 * 4 * sz(tokens) * 8);
    for (auto& x : v) x = nd(rng);
    return Tensor::from_f32({2, 4, tokens, 8}, v);
  };
  std::vector<Tensor> ks, vs;
  for (std::size_t l = 0; l < caches.size(); ++l) ks.push_back(chunk(10)), vs.push_back(chunk(10));
  for (std::size_t l = 0; l < caches.size(); ++l) caches[l]->update(ks[l], vs[l]);
  const auto* c0 = dynamic_cast<const vq::VqChainKVCache*>(caches[0].get());
  ASSERT_NE(c0, nullptr);
  EXPECT_EQ(c0->quantized_tokens(), 0);
  const auto empty = c0->encode();
  EXPECT_EQ(c0->stored_bytes().estimated_bytes, static_cast<double>(empty.size()) + 10.0 * 2 * 4 * 16 * 4);
  const auto d = vq::vq_chain_decode(empty, c0->layer_model(), c0->predictor(), nullptr, 1u << 20);
  EXPECT_EQ(d.state.keys.dim(2), 0);
  for (std::size_t l = 0; l < caches.size(); ++l) caches[l]->update(chunk(20), chunk(20));
  std::vector<vq::VqChainDecoded> dec;
  for (std::size_t l = 0; l < caches.size(); ++l) {
    const auto& c = dynamic_cast<const vq::VqChainKVCache&>(*caches[l]);
    ASSERT_EQ(c.quantized_tokens(), 30);
    dec.push_back(vq::vq_chain_decode(c.encode(), c.layer_model(), c.predictor(), l > 0 ? &dec[l - 1] : nullptr, 1u << 20));
    const auto st = c.state();
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 4; ++h)
        for (std::int64_t t = 0; t < 30; ++t) {
          ASSERT_EQ(std::memcmp(dec.back().state.keys.row(b, h, t), st.keys.row(b, h, t), 8 * sizeof(float)), 0) << l << " " << b << " " << t;
          ASSERT_EQ(std::memcmp(dec.back().state.values.row(b, h, t), st.values.row(b, h, t), 8 * sizeof(float)), 0) << l << " " << b << " " << t;
        }
  }
  for (auto& c : caches) EXPECT_EQ(c->trim(20), 20);
  EXPECT_EQ(c0->quantized_tokens(), 0);
  EXPECT_EQ(caches[0]->offset(), 10);
  for (auto& c : caches) c->update(chunk(8), chunk(8));
  EXPECT_EQ(c0->quantized_tokens(), 18);
}

}  // namespace
