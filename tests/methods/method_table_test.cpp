// The method table (methods/method_table.hpp), row by row: a new row is checked without editing
// this file. Every row's specs round-trip through their canonical text, its keys' defaults are
// what the bare spec holds, bad keys name the row's keys, attend equals dense attention over what
// the cache returns, and the rows that save to .vqkv load back exactly.
#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "veloxquant/cache/attention.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/methods/method_table.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/model/vq_layer_models.hpp"
#include "veloxquant/store/prefix_chunks.hpp"
#include "../model/model_support.hpp"
#include "../support/test_util.hpp"

namespace {

using vq::MethodRow;
using vq::MethodSpec;
using vq::Tensor;

const vq::Transformer& model() {
  static const vq::Transformer m(vq::Checkpoint::load(vqtest::model_path()));
  return m;
}

// The bare spec and every setting a report runs by default.
std::vector<std::string> specs_of(const MethodRow& r) {
  std::vector<std::string> s{r.name};
  s.insert(s.end(), r.eval.begin(), r.eval.end());
  s.insert(s.end(), r.rd.begin(), r.rd.end());
  for (const auto& d : r.demo) s.push_back(d.spec);
  s.insert(s.end(), r.bench_attention.begin(), r.bench_attention.end());
  s.insert(s.end(), r.store.begin(), r.store.end());
  return s;
}

TEST(MethodTable, OneRowPerKindWithUniqueNames) {
  std::set<std::string> names;
  std::set<int> kinds;
  for (const auto& r : vq::method_table()) {
    EXPECT_TRUE(names.insert(r.name).second) << r.name;
    EXPECT_TRUE(kinds.insert(static_cast<int>(r.kind)).second) << r.name;
    EXPECT_EQ(vq::find_method(r.name), &r);
    EXPECT_EQ(&vq::method_row(r.kind), &r);
    EXPECT_NE(r.canonical, nullptr) << r.name;
    EXPECT_NE(r.make, nullptr) << r.name;
    EXPECT_EQ(r.set == nullptr, r.keys.empty()) << r.name;
    EXPECT_FALSE(std::string(r.summary).empty()) << r.name;
  }
  for (int k = 0; k <= static_cast<int>(MethodSpec::Kind::Vq); ++k) EXPECT_TRUE(kinds.count(k)) << "kind " << k << " has no row";
  EXPECT_EQ(vq::find_method("int8"), nullptr);
  // Ours is a row like the others.
  EXPECT_EQ(vq::method_row(MethodSpec::Kind::Vq).family, vq::MethodFamily::Ours);
}

TEST(MethodTable, EveryRowsSpecsRoundTripThroughTheirText) {
  for (const auto& r : vq::method_table())
    for (const auto& spec : specs_of(r)) {
      SCOPED_TRACE(spec);
      const MethodSpec m = MethodSpec::parse(spec);
      EXPECT_EQ(m.kind, r.kind);
      const std::string text = m.to_string();
      EXPECT_EQ(text.rfind(r.name, 0), 0u) << text;
      EXPECT_EQ(MethodSpec::parse(text).to_string(), text);
    }
}

TEST(MethodTable, KeyDefaultsAreWhatTheBareSpecHolds) {
  for (const auto& r : vq::method_table()) {
    const std::string text = MethodSpec::parse(r.name).to_string();
    for (const auto& k : r.keys) {
      SCOPED_TRACE(std::string(r.name) + ":" + k.name);
      // A key the canonical text writes must show its default there; the bare spec with the
      // default written out is the same spec.
      if (*k.fallback == '\0') continue;
      if (text.find(std::string(k.name) + "=") != std::string::npos) {
        EXPECT_NE(text.find(std::string(k.name) + "=" + k.fallback), std::string::npos) << text;
      }
      EXPECT_EQ(MethodSpec::parse(std::string(r.name) + ":" + k.name + "=" + k.fallback).to_string(), text);
    }
  }
}

TEST(MethodTable, BadKeysNameTheRowsKeys) {
  for (const auto& r : vq::method_table()) {
    const std::string err = vqtest::spec_error(std::string(r.name) + ":nonsense=1");
    SCOPED_TRACE(err);
    if (r.keys.empty()) {
      EXPECT_NE(err.find("takes no options"), std::string::npos);
      continue;
    }
    EXPECT_NE(err.find("unknown key 'nonsense' for " + std::string(r.name)), std::string::npos);
    for (const auto& k : r.keys) EXPECT_NE(err.find(k.name), std::string::npos) << k.name;
    // The usage names every key, and the list of valid methods names every row.
    for (const auto& k : r.keys) EXPECT_NE(vq::method_usage(r).find(std::string(k.name) + "="), std::string::npos);
    EXPECT_NE(vqtest::spec_error("int8").find(vq::method_usage(r)), std::string::npos);
  }
}

TEST(MethodTable, TheTextListsEveryRowAndKey) {
  const std::string text = vq::methods_text();
  for (const auto& r : vq::method_table()) {
    EXPECT_NE(text.find(vq::method_usage(r)), std::string::npos) << r.name;
    for (const auto& k : r.keys) EXPECT_NE(text.find(k.help), std::string::npos) << k.name;
  }
}

// Every row's bare spec on stories260K's first layer (4 KV heads of 8): attend over the cache
// equals dense attention over the K/V its last update_and_fetch returned, within float32 rounding.
TEST(MethodTable, AttendEqualsDenseAttentionOverWhatTheCacheReturns) {
  constexpr std::int64_t T = 300, D = 8, Hkv = 4, Hq = 8;  // past kivi's residual and vq's calibration
  for (const auto& r : vq::method_table()) {
    SCOPED_TRACE(r.name);
    auto caches = vq::make_caches(MethodSpec::parse(r.name), model());
    ASSERT_FALSE(caches.empty());
    auto& cache = *caches[0];
    const Tensor k = vqtest::random_walk({1, Hkv, T, D}, 31), v = vqtest::random_walk({1, Hkv, T, D}, 32);
    cache.update_and_fetch(k.slice(2, 0, T - 1), v.slice(2, 0, T - 1));
    auto [fk, fv] = cache.update_and_fetch(k.slice(2, T - 1, T), v.slice(2, T - 1, T));
    ASSERT_EQ(fk.dim(2), T);
    vq::KVCache dense;
    dense.update_and_fetch(fk.to(vq::DType::F32), fv.to(vq::DType::F32));
    const Tensor q = vqtest::random_uniform({1, Hq, 1, D}, 33);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const auto x = cache.attend(q, scale).to_f32_vector(), y = vq::attend_ref(dense, q, scale).to_f32_vector();
    ASSERT_EQ(x.size(), y.size());
    double diff = 0, mag = 0;
    for (std::size_t i = 0; i < x.size(); ++i) diff = std::max(diff, std::fabs(double(x[i]) - y[i])), mag = std::max(mag, std::fabs(double(y[i])));
    EXPECT_GT(mag, 0.1);
    EXPECT_LE(diff, 2e-6 * (1.0 + mag));
  }
}

// Huge finite K/V (issue 36: at |x| near 3e38 vq, cachegen and fp8 attention was inf/NaN; fp16
// stored inf above 65504): every row either refuses them at update with InvalidArgument, or its
// attention refuses, or its attention is finite. Never a non-finite success.
TEST(MethodTable, HugeFiniteKVGiveAFiniteResultOrAnError) {
  constexpr std::int64_t T = 300, D = 8, Hkv = 4, Hq = 8;
  for (const double magnitude : {7e4, 1e19, 3e38}) {
    for (const auto& r : vq::method_table()) {
      SCOPED_TRACE(std::string(r.name) + " at " + std::to_string(magnitude));
      auto caches = vq::make_caches(MethodSpec::parse(r.name), model());
      auto& cache = *caches[0];
      std::vector<float> kv(static_cast<std::size_t>(Hkv * T * D));
      for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<float>(magnitude * ((i * 37 % 101) / 50.0 - 1.0));
      const Tensor k = Tensor::from_f32({1, Hkv, T, D}, kv), v = Tensor::from_f32({1, Hkv, T, D}, kv);
      try {
        cache.update_and_fetch(k, v);
      } catch (const vq::InvalidArgument& e) {
        if (std::string(r.name) == "fp16") EXPECT_NE(std::string(e.what()).find("outside float16's range"), std::string::npos) << e.what();
        continue;
      }
      EXPECT_NE(std::string(r.name), "fp16") << "fp16 stored values beyond float16's range";
      const Tensor q = vqtest::random_uniform({1, Hq, 1, D}, 33);
      try {
        const Tensor o = cache.attend(q, 0.35f);
        EXPECT_TRUE(o.all_finite());
      } catch (const vq::InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("not finite"), std::string::npos) << e.what();
      }
    }
  }
}

// The rows that save to .vqkv: every layer's K/V after a save and a load are the same bits.
TEST(MethodTable, SavedRowsLoadBackExactly) {
  const auto ck = std::make_shared<const vq::Checkpoint>(vq::Checkpoint::load(vqtest::model_path()));
  const vq::Transformer m(*ck);
  const int L = m.config().n_layers, Hkv = m.config().n_kv_heads, D = m.config().head_size();
  int saved_rows = 0;
  for (const auto& r : vq::method_table()) {
    if (!r.saves_vqkv) continue;
    SCOPED_TRACE(r.name);
    ++saved_rows;
    auto caches = vq::make_caches(MethodSpec::parse(r.name), m);
    for (int l = 0; l < L; ++l)
      caches[static_cast<std::size_t>(l)]->update_and_fetch(vqtest::random_walk({1, Hkv, 200, D}, 40 + static_cast<std::uint64_t>(l)),
                                                            vqtest::random_walk({1, Hkv, 200, D}, 80 + static_cast<std::uint64_t>(l)));
    const std::string path = vqtest::temp_dir() + "/" + r.name + ".vqkv";
    vq::save_prompt_cache(path, caches, {});
    vq::VqkvLoadOptions o;
    o.vq_models = vq::vq_layer_models(ck);
    const vq::PromptCache loaded = vq::load_prompt_cache(path, o);
    ASSERT_EQ(loaded.caches.size(), caches.size());
    for (std::size_t l = 0; l < caches.size(); ++l) {
      const vq::KVState a = caches[l]->state(), b = loaded.caches[l]->state();
      EXPECT_EQ(a.keys.to_f32_vector(), b.keys.to_f32_vector()) << "layer " << l;
      EXPECT_EQ(a.values.to_f32_vector(), b.values.to_f32_vector()) << "layer " << l;
    }
  }
  EXPECT_GE(saved_rows, 3);  // fp32, cachegen, vq
}

TEST(MethodTable, ReportsTakeTheirListsFromTheTable) {
  // The demo: baseline first, ours before the reference and the peers.
  const auto demo = vq::default_demo_methods();
  ASSERT_FALSE(demo.empty());
  EXPECT_EQ(MethodSpec::parse(demo.front().spec).kind, MethodSpec::Kind::Fp16);
  int last_family = -1;
  for (const auto& d : demo) {
    const int f = static_cast<int>(vq::method_row(MethodSpec::parse(d.spec).kind).family);
    EXPECT_GE(f, last_family) << d.spec;
    last_family = f;
  }
  const auto eval = vq::default_eval_methods();
  EXPECT_EQ(eval.front(), "fp32");
  for (const auto& s : vq::default_bench_attention_methods()) EXPECT_NO_THROW(MethodSpec::parse(s)) << s;
  // The store's default levels: the table's, and the header constant kept for older code says the same.
  EXPECT_EQ(vq::default_store_levels(), std::string(vq::kDefaultLevels));
}

}  // namespace
