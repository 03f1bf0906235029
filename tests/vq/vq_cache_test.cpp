// Our method's cache (vq/vq_cache.hpp) and transforms (vq/basis.hpp): error budgets on synthetic
// K/V, the billed bytes against the real coder, decode = fetch bit for bit, chunking, trim, and
// the resident storage (packed codes, escapes, refusals, sinks, nbytes).
#include "veloxquant/vq/vq_cache.hpp"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/eval/evaluator.hpp"
#include "../support/test_util.hpp"
#include "../support/vq_random_layer.hpp"

namespace {

// Random weights for a layer of dim 16, 4 query heads, 2 KV heads of dim 4.
struct Weights {
  std::vector<float> wq, wk, wv, wo, g;
  vq::VqLayerWeights view() const {
    vq::VqLayerWeights w;
    w.dim = 16, w.n_heads = 4, w.n_kv_heads = 2, w.head_dim = 4;
    w.wq = wq, w.wk = wk, w.wv = wv, w.wo = wo, w.rms_att = g;
    return w;
  }
};

Weights random_weights(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 0.3f);
  Weights w;
  for (auto* v : {&w.wq, &w.wo}) v->resize(16 * 16);
  for (auto* v : {&w.wk, &w.wv}) v->resize(8 * 16);
  w.g.resize(16);
  for (auto* v : {&w.wq, &w.wk, &w.wv, &w.wo, &w.g})
    for (auto& x : *v) x = n(rng);
  for (auto& x : w.g) x = 1.0f + std::fabs(x);
  return w;
}

std::shared_ptr<const vq::VqLayerModel> model_of(vq::VqBasis basis, bool rope = true, bool shape = true) {
  static const Weights w = random_weights(5);
  vq::VqBasisOptions o;
  o.basis = basis;
  o.rope = rope;
  o.shape = shape;
  return std::make_shared<const vq::VqLayerModel>(vq::make_vq_layer_model(w.view(), o));
}

vq::Tensor gaussian(const vq::Shape4& shape, std::uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, sigma);
  std::vector<float> v(static_cast<std::size_t>(shape[0] * shape[1] * shape[2] * shape[3]));
  for (auto& x : v) x = n(rng);
  return vq::Tensor::from_f32(shape, v);
}

// Feed K/V [B, H, S, D] in chunks of `chunk` tokens; returns the last fetch.
std::pair<vq::Tensor, vq::Tensor> feed(vq::VqKVCache& c, const vq::Tensor& k, const vq::Tensor& v, std::int64_t chunk) {
  std::pair<vq::Tensor, vq::Tensor> out;
  for (std::int64_t s = 0; s < k.dim(2); s += chunk) {
    const std::int64_t e = std::min(k.dim(2), s + chunk);
    out = c.update_and_fetch(k.slice(2, s, e), v.slice(2, s, e));
  }
  return out;
}

TEST(VqBasis, EigenDecompositionAndInverses) {
  std::vector<double> a = {4, 1, 0.5, 1, 3, 0.2, 0.5, 0.2, 1};
  std::vector<double> lambda;
  const auto u = vq::symmetric_eigen(a, 3, lambda);
  EXPECT_GE(lambda[0], lambda[1]);
  EXPECT_GE(lambda[1], lambda[2]);
  for (int k = 0; k < 3; ++k)
    for (int i = 0; i < 3; ++i) {
      double av = 0;
      for (int j = 0; j < 3; ++j) av += a[static_cast<std::size_t>(i * 3 + j)] * u[static_cast<std::size_t>(j * 3 + k)];
      EXPECT_NEAR(av, lambda[static_cast<std::size_t>(k)] * u[static_cast<std::size_t>(i * 3 + k)], 1e-12);
    }
  for (auto basis : {vq::VqBasis::Hadamard, vq::VqBasis::Weights}) {
    const auto m = model_of(basis);
    ASSERT_EQ(m->k.n, 8);
    ASSERT_EQ(m->rope_freq.size(), 2u);
    for (const auto* t : {&m->k, &m->v})
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j) {
          double p = 0;
          for (int k = 0; k < 8; ++k) p += static_cast<double>(t->inv[static_cast<std::size_t>(i * 8 + k)]) * t->fwd[static_cast<std::size_t>(k * 8 + j)];
          EXPECT_NEAR(p, i == j ? 1.0 : 0.0, 1e-4) << vq::vq_basis_name(basis);
        }
  }
  EXPECT_TRUE(model_of(vq::VqBasis::Identity)->k.identity());
  EXPECT_THROW(vq::vq_basis_from_name("pca"), vq::InvalidArgument);
}

TEST(VqCache, ErrorWithinHalfAStepPerCoefficient) {
  // Identity transform: every quantized element is within step/2 of its input (plus float
  // rounding); the calibration tokens too once calibrated. Codes are never clamped here.
  const vq::Tensor K = gaussian({2, 3, 150, 8}, 1, 2.0f), V = gaussian({2, 3, 150, 8}, 2, 0.5f);
  for (double bits : {1.0, 3.0, 6.0}) {
    vq::VqConfig cfg;
    cfg.bits = bits;
    vq::VqKVCache c(cfg);
    auto [fk, fv] = feed(c, K, V, 50);
    ASSERT_EQ(c.quantized_tokens(), 150);
    const auto codes = c.codes();
    for (auto [in, out, step] : {std::tuple{&K, &fk, codes.k.step}, std::tuple{&V, &fv, codes.v.step}}) {
      const auto x = in->to_f32_vector(), y = out->to_f32_vector();
      double worst = 0;
      for (std::size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(x[i]) - y[i]));
      EXPECT_LE(worst, 0.5 * step * (1 + 1e-5)) << "bits " << bits;
    }
  }
}

TEST(VqCache, RelativeErrorBudgetOnSyntheticKV) {
  // Named budgets: relative MSE over K and V of random-walk K/V (which drifts away from its
  // calibration tokens), Weights basis with RoPE; measured 0.037, 0.0089, 5.5e-4, 2.2e-6: a
  // factor ~4 per bit, as a uniform quantizer's step^2 / 12 should.
  const vq::Tensor K = vqtest::random_walk({1, 2, 256, 4}, 3), V = vqtest::random_walk({1, 2, 256, 4}, 4);
  const std::pair<double, double> budgets[] = {{1.0, 0.05}, {2.0, 0.012}, {4.0, 8e-4}, {8.0, 4e-6}};
  for (auto [bits, budget] : budgets) {
    vq::VqConfig cfg;
    cfg.bits = bits;
    vq::VqKVCache c(cfg, model_of(vq::VqBasis::Weights));
    auto [fk, fv] = feed(c, K, V, 64);
    double err = 0, norm = 0;
    for (auto [a, b] : {std::pair{&K, &fk}, std::pair{&V, &fv}}) {
      const auto x = a->to_f32_vector(), y = b->to_f32_vector();
      for (std::size_t i = 0; i < x.size(); ++i) err += (static_cast<double>(y[i]) - x[i]) * (y[i] - x[i]), norm += x[i] * static_cast<double>(x[i]);
    }
    EXPECT_LT(err / norm, budget) << "bits " << bits;
  }
}

TEST(VqCache, BilledBytesAreTheCodersAndDecodeEqualsFetch) {
  for (auto basis : {vq::VqBasis::Identity, vq::VqBasis::Hadamard, vq::VqBasis::Weights})
    for (auto dtype : {vq::DType::F32, vq::DType::F16}) {
      const vq::Tensor K = vqtest::random_walk({2, 2, 100, 4}, 7, dtype), V = vqtest::random_walk({2, 2, 100, 4}, 8, dtype);
      vq::VqConfig cfg;
      cfg.bits = 2.5;
      cfg.calib = 16;
      cfg.residual = 5;
      vq::VqKVCache c(cfg, model_of(basis));
      EXPECT_EQ(c.stored_bytes().fixed_bytes, 0.0);
      c.update_and_fetch(K.slice(2, 0, 20), V.slice(2, 0, 20));  // 15 due < calib 16: all exact
      EXPECT_EQ(c.quantized_tokens(), 0);
      const double es = static_cast<double>(vq::dtype_size(dtype));  // exact tokens are billed at what they hold
      EXPECT_DOUBLE_EQ(c.stored_bytes().estimated_bytes, 20.0 * 2 * 2 * (4 + 4) * es);
      auto [fk, fv] = feed(c, K.slice(2, 20, 100), V.slice(2, 20, 100), 13);
      ASSERT_EQ(c.quantized_tokens(), 95);
      const auto bytes = c.encode();
      const double residual = 5.0 * 2 * 2 * (4 + 4) * es;  // 5 tokens x B x H x (Dk + Dv) x the input dtype
      EXPECT_DOUBLE_EQ(c.stored_bytes().fixed_bytes, static_cast<double>(bytes.size()) + residual);
      EXPECT_DOUBLE_EQ(c.stored_bytes().estimated_bytes, c.stored_bytes().fixed_bytes);
      // The decoder: bytes -> codes -> dense K/V, bit-identical to what the cache returned.
      const auto decoded = vq::vq_decode(bytes, 2 * 95 * 16);
      const vq::KVState back = vq::vq_reconstruct(decoded, *c.layer_model(), dtype);
      EXPECT_TRUE(back.keys.bit_equal(fk.slice(2, 0, 95).contiguous(true))) << vq::vq_basis_name(basis);
      EXPECT_TRUE(back.values.bit_equal(fv.slice(2, 0, 95).contiguous(true))) << vq::vq_basis_name(basis);
      // The exact window is exact.
      EXPECT_TRUE(fk.slice(2, 95, 100).contiguous(true).bit_equal(K.slice(2, 95, 100).contiguous(true)));
    }
}

TEST(VqCache, EvaluatorBillsTheCodedSize) {
  auto c = std::make_shared<vq::VqKVCache>(vq::VqConfig{}, model_of(vq::VqBasis::Weights));
  c->update_and_fetch(vqtest::random_walk({1, 2, 80, 4}, 1), vqtest::random_walk({1, 2, 80, 4}, 2));
  const vq::CacheBits b = vq::cache_bits({c});
  EXPECT_DOUBLE_EQ(b.coded_bytes, static_cast<double>(c->encode().size()));
  EXPECT_DOUBLE_EQ(b.elements, 80.0 * 2 * 8);
}

TEST(VqCache, ChunkingDoesNotMatter) {
  const vq::Tensor K = vqtest::random_walk({1, 2, 130, 4}, 21), V = vqtest::random_walk({1, 2, 130, 4}, 22);
  for (int residual : {0, 9}) {
    vq::VqConfig cfg;
    cfg.calib = 32;
    cfg.residual = residual;
    vq::VqKVCache whole(cfg, model_of(vq::VqBasis::Weights));
    auto [wk, wv] = feed(whole, K, V, 130);
    for (std::int64_t chunk : {1, 7, 32, 64}) {
      vq::VqKVCache c(cfg, model_of(vq::VqBasis::Weights));
      auto [ck, cv] = feed(c, K, V, chunk);
      EXPECT_TRUE(ck.contiguous(true).bit_equal(wk.contiguous(true))) << chunk;
      EXPECT_TRUE(cv.contiguous(true).bit_equal(wv.contiguous(true))) << chunk;
      EXPECT_EQ(c.encode(), whole.encode()) << chunk;
    }
  }
}

TEST(VqCache, TrimEqualsFeedingThePrefix) {
  const vq::Tensor K = vqtest::random_walk({1, 2, 100, 4}, 31), V = vqtest::random_walk({1, 2, 100, 4}, 32);
  vq::VqKVCache full(vq::VqConfig{}, model_of(vq::VqBasis::Weights));
  feed(full, K, V, 100);
  EXPECT_EQ(full.trim(30), 30);
  vq::VqKVCache prefix(vq::VqConfig{}, model_of(vq::VqBasis::Weights));
  feed(prefix, K.slice(2, 0, 70), V.slice(2, 0, 70), 70);
  EXPECT_EQ(full.encode(), prefix.encode());
  EXPECT_TRUE(full.state().keys.contiguous(true).bit_equal(prefix.state().keys.contiguous(true)));
  EXPECT_EQ(full.stored_bytes().fixed_bytes, prefix.stored_bytes().fixed_bytes);
  EXPECT_EQ(full.trim(1000), 70);
  EXPECT_EQ(full.stored_bytes().fixed_bytes, 0.0);
  // After a trim to 0 the cache calibrates afresh.
  feed(full, K.slice(2, 0, 70), V.slice(2, 0, 70), 70);
  EXPECT_EQ(full.encode(), prefix.encode());
}

TEST(VqCache, RejectsBadInputUnchanged) {
  vq::VqKVCache c(vq::VqConfig{}, model_of(vq::VqBasis::Weights));
  const vq::Tensor K = vqtest::random_walk({1, 2, 70, 4}, 1), V = vqtest::random_walk({1, 2, 70, 4}, 2);
  feed(c, K, V, 70);
  const auto before = c.encode();
  vq::Tensor bad = K.slice(2, 0, 3).contiguous(true);
  bad.set(0, 1, 2, 3, NAN);
  EXPECT_THROW(c.update_and_fetch(bad, V.slice(2, 0, 3)), vq::InvalidArgument);
  EXPECT_THROW(c.update_and_fetch(vqtest::random_walk({1, 3, 2, 4}, 1), vqtest::random_walk({1, 3, 2, 4}, 1)), vq::InvalidArgument);
  EXPECT_EQ(c.offset(), 70);
  EXPECT_EQ(c.encode(), before);
  // Without a model an emptied cache takes any new shape.
  vq::VqKVCache plain;
  plain.update_and_fetch(vqtest::random_walk({1, 2, 3, 4}, 1), vqtest::random_walk({1, 2, 3, 4}, 2));
  plain.from_state({vqtest::random_walk({1, 3, 70, 8}, 1), vqtest::random_walk({1, 3, 70, 2}, 2)});
  EXPECT_EQ(plain.quantized_tokens(), 70);
  EXPECT_EQ(plain.codes().v.n, 6);
  vq::VqKVCache fresh(vq::VqConfig{}, model_of(vq::VqBasis::Weights));  // the model says 2 heads of 4
  EXPECT_THROW(fresh.update_and_fetch(vqtest::random_walk({1, 2, 2, 8}, 1), vqtest::random_walk({1, 2, 2, 8}, 1)), vq::InvalidArgument);
  vq::VqConfig bad_cfg;
  bad_cfg.bits = 0;
  EXPECT_THROW(vq::VqKVCache{bad_cfg}, vq::InvalidArgument);
  bad_cfg.bits = 10.5;
  EXPECT_THROW(vq::VqKVCache{bad_cfg}, vq::InvalidArgument);
  bad_cfg = {};
  bad_cfg.calib = 0;
  EXPECT_THROW(vq::VqKVCache{bad_cfg}, vq::InvalidArgument);
}

TEST(VqCache, ConstantAndWideInputs) {
  // Constant K/V: every code 0, reconstruction within a quarter step of the constant.
  vq::VqKVCache c;
  const vq::Tensor K = vq::Tensor::from_f32({1, 1, 70, 2}, std::vector<float>(140, 3.25f));
  auto [fk, fv] = c.update_and_fetch(K, K);
  for (float x : fk.to_f32_vector()) EXPECT_NEAR(x, 3.25f, 1e-6);
  // A coefficient that needs codes beyond +-255 is split by the coder, not clamped: one channel
  // 1000x wider than the other, at 8 bits.
  std::vector<float> v(2 * 200);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = n(rng) * (i % 2 ? 1000.0f : 1.0f);
  const vq::Tensor W = vq::Tensor::from_f32({1, 1, 200, 2}, v);
  vq::VqConfig cfg;
  cfg.bits = 8;
  vq::VqKVCache wide(cfg);
  auto [wk, wv] = wide.update_and_fetch(W, W);
  const auto codes = wide.codes();
  EXPECT_GT(codes.k.shift[1], 0);
  const auto y = wk.to_f32_vector();
  for (std::size_t i = 0; i < v.size(); ++i) EXPECT_LE(std::fabs(y[i] - v[i]), 0.5 * codes.k.step * 1.0001 + 1e-3) << i;
  EXPECT_EQ(vq::vq_decode(wide.encode(), 800).k.codes, codes.k.codes);
}

// Resident: the cache holds packed codes, not a dense copy. 2 heads x 16 x 600 float32 tokens at
// bits=2 hold a few bits per element (dense float32: 32): the packed rows and a few escapes.
TEST(VqResident, HoldsPackedCodesNotADenseCopy) {
  const vq::Tensor K = vqtest::random_walk({1, 2, 600, 16}, 41), V = vqtest::random_walk({1, 2, 600, 16}, 42);
  vq::VqConfig cfg;
  cfg.calib = 32;
  vq::VqKVCache c(cfg);
  c.update(K, V);
  ASSERT_EQ(c.quantized_tokens(), 600);
  const double elements = 2.0 * 600 * 2 * 16;
  EXPECT_LT(8.0 * static_cast<double>(c.nbytes()) / elements, 7.0);  // a random walk drifts: fields widen (dense: 32)
  double bits = 0;
  for (auto w : c.key_widths()) bits += w;
  for (auto w : c.value_widths()) bits += w;
  // Packed rows, the escapes' list, calibration and a few vectors' headers: nothing dense.
  EXPECT_LE(static_cast<double>(c.nbytes()), bits * 600 / 8 + 16.0 * static_cast<double>(c.escapes()) + 2048);
}

// Codes beyond a coefficient's packed width are held exactly (escapes), and codes beyond the
// calibration's split widen it: never clamped. A jump of 300 sigma after calibration at 4 bits
// (fields of ~6 bits; at 8 bits the packed groups' widths above 8 are 16, which hold it unescaped).
TEST(VqResident, WideCodesAreEscapedNotClamped) {
  std::vector<float> v(2 * 120);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = nd(rng) + (i / 2 == 100 ? 300.0f : 0.0f);
  const vq::Tensor W = vq::Tensor::from_f32({1, 1, 120, 2}, v);
  vq::VqConfig cfg;
  cfg.bits = 4;
  vq::VqKVCache c(cfg);
  auto [k, vv] = c.update_and_fetch(W.slice(2, 0, 64), W.slice(2, 0, 64));
  const std::uint8_t shift_before = c.codes().k.shift[0];
  std::tie(k, vv) = c.update_and_fetch(W.slice(2, 64, 120), W.slice(2, 64, 120));
  EXPECT_GT(c.escapes(), 0u);
  const auto codes = c.codes();
  EXPECT_GT(codes.k.shift[0], shift_before);  // 300 sigma: beyond 32 sigma, the split widened
  const auto y = k.to_f32_vector();
  for (std::size_t i = 0; i < v.size(); ++i) EXPECT_LE(std::fabs(y[i] - v[i]), 0.5 * codes.k.step * 1.0001 + 1e-4) << i;
  const auto decoded = vq::vq_decode(c.encode(), 2 * 120 * 2);
  EXPECT_EQ(decoded.k.codes, codes.k.codes);
  EXPECT_TRUE(vq::vq_reconstruct(decoded, *c.layer_model(), vq::DType::F32).keys.bit_equal(k.contiguous(true)));
}

// A code beyond the coder's reach (+-255 * 2^7 steps) is refused, the cache unchanged.
TEST(VqResident, CodesBeyondTheCodersReachAreRefused) {
  const vq::Tensor W = gaussian({1, 1, 64, 2}, 5);
  vq::VqConfig cfg;
  cfg.bits = 10;
  vq::VqKVCache c(cfg);
  c.update(W, W);
  ASSERT_EQ(c.quantized_tokens(), 64);
  const auto before = c.encode();
  const std::size_t bytes = c.nbytes();
  const std::vector<float> far_v{1e6f, 0.0f};
  const vq::Tensor far = vq::Tensor::from_f32({1, 1, 1, 2}, far_v);
  try {
    c.update(far, far);
    ADD_FAILURE() << "no error";
  } catch (const vq::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("reach"), std::string::npos) << e.what();
  }
  EXPECT_EQ(c.offset(), 64);
  EXPECT_EQ(c.encode(), before);
  EXPECT_EQ(c.nbytes(), bytes);
}

// Sinks: the first tokens are served exact while their codes stay in codes(); billed twice.
TEST(VqResident, SinksStayExact) {
  const vq::Tensor K = vqtest::random_walk({2, 2, 50, 4}, 51), V = vqtest::random_walk({2, 2, 50, 4}, 52);
  vq::VqConfig cfg;
  cfg.calib = 8;
  cfg.sinks = 3;
  cfg.residual = 2;
  vq::VqKVCache c(cfg, model_of(vq::VqBasis::Weights));
  auto [fk, fv] = feed(c, K, V, 1);
  ASSERT_EQ(c.quantized_tokens(), 48);
  EXPECT_TRUE(fk.slice(2, 0, 3).contiguous(true).bit_equal(K.slice(2, 0, 3).contiguous(true)));
  EXPECT_TRUE(fv.slice(2, 0, 3).contiguous(true).bit_equal(V.slice(2, 0, 3).contiguous(true)));
  EXPECT_TRUE(fk.slice(2, 48, 50).contiguous(true).bit_equal(K.slice(2, 48, 50).contiguous(true)));
  const vq::KVState back = vq::vq_reconstruct(c.codes(), *c.layer_model(), vq::DType::F32);
  EXPECT_FALSE(back.keys.slice(2, 0, 3).contiguous(true).bit_equal(K.slice(2, 0, 3).contiguous(true)));  // codes are lossy
  EXPECT_TRUE(back.keys.slice(2, 3, 48).contiguous(true).bit_equal(fk.slice(2, 3, 48).contiguous(true)));
  const double exact = (2 + 3) * 2.0 * 2 * (4 + 4) * 4;
  EXPECT_DOUBLE_EQ(c.stored_bytes().fixed_bytes, static_cast<double>(c.encode().size()) + exact);
  // Trim into the sinks, then regrow: the same as feeding the prefix.
  c.trim(48);
  vq::VqKVCache p(cfg, model_of(vq::VqBasis::Weights));
  feed(p, K.slice(2, 0, 2), V.slice(2, 0, 2), 1);
  EXPECT_TRUE(c.state().keys.bit_equal(p.state().keys));
}

}  // namespace


// The fast transforms (VqSideTransform::inv_cols / col_span: per-head column blocks read
// contiguously, exact zeros of block-diagonal transforms skipped, four forward rows at once) give
// the bits of the plain full-matrix walks: the same cache with a model whose index is cleared
// encodes the same bytes and fetches the same K/V. Both a cross-head transform (n <= 256: one block)
// and a per-head one (3 heads x 96 = 288 > 256).
TEST(VqBasis, ColumnIndexGivesTheFullProductsBits) {
  for (const int kv_heads : {2, 3}) {
    const int hd = kv_heads == 2 ? 8 : 96, n = kv_heads * hd;
    auto fast = std::make_shared<vq::VqLayerModel>(vqtest::random_weights_layer_model(kv_heads, hd, 32, 11 + kv_heads));
    ASSERT_EQ(fast->k.col_span, n > vq::kVqMaxCrossHead ? hd : n);
    ASSERT_EQ(fast->v.col_span, fast->k.col_span);
    auto plain = std::make_shared<vq::VqLayerModel>(*fast);
    for (auto* s : {&plain->k, &plain->v}) {
      s->inv_cols.clear();
      s->col_span = 0;
    }
    vq::VqConfig cfg;
    cfg.bits = 2;
    cfg.calib = 16;
    cfg.residual = 3;
    vq::VqKVCache a(cfg, fast), b(cfg, plain);
    const vq::Tensor K = vqtest::random_walk({1, kv_heads, 40, hd}, 21, vq::DType::F32);
    const vq::Tensor V = vqtest::random_walk({1, kv_heads, 40, hd}, 22, vq::DType::F32);
    const auto [ka, va] = feed(a, K, V, 9);
    const auto [kb, vb] = feed(b, K, V, 9);
    ASSERT_GT(a.quantized_tokens(), 0);
    EXPECT_EQ(a.encode(), b.encode()) << n;
    EXPECT_TRUE(ka.bit_equal(kb)) << n;
    EXPECT_TRUE(va.bit_equal(vb)) << n;
    const auto decoded = vq::vq_decode(a.encode(), 2 * a.quantized_tokens() * n);
    EXPECT_TRUE(vq::vq_reconstruct(decoded, *fast, vq::DType::F32).keys.bit_equal(vq::vq_reconstruct(decoded, *plain, vq::DType::F32).keys));
  }
}
