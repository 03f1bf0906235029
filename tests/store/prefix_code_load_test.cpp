// Code-domain loads (store/prefix_loader.hpp, VqKVCache::append_codes): a host whose caches are
// `vq` of a live-coded level's spec takes the stored codes as they are, and ends bit for bit where a
// live cache of that spec fed the same tokens is: codes, state(), attend() and what follows (a
// forward over more tokens). Levels that differ from the host's go through update() (re-quantized
// rows); faults still stop the load with a warning. Real stories260K model, file: backend.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <random>

#include <fmt/core.h>

#include "store_context.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/file_store.hpp"
#include "veloxquant/store/prefix_loader.hpp"
#include "veloxquant/vq/vq_cache.hpp"

namespace fs = std::filesystem;

namespace {

constexpr int kC = 12;  // tokens per chunk; the vq levels below calibrate on 8 (live-coded: calib <= C)
const char* const kVq2 = "vq:bits=2,calib=8";
const char* const kVq1 = "vq:bits=1,calib=8";

using Context = vqtest::StoreContext;

const Context& context() {
  static const Context c = vqtest::make_store_context(kC);
  return c;
}

std::string canon(const char* spec) { return vq::MethodSpec::parse(spec).to_string(); }

// A fresh file store holding the context's whole chunks at exactly `levels`.
struct Stored : vqtest::StoredContext {
  explicit Stored(const std::vector<std::string>& levels) : StoredContext(context(), kC, levels, "code-load-test") {}
};

int stored_tokens() { return static_cast<int>(context().tokens.size() - 1) / kC * kC; }

// A load of the context at one stored level that never recomputes (a fault leaves the rest unloaded).
vq::LoaderOptions options_for(const Stored& s, const std::string& level, int threads = 2) {
  vq::LoaderOptions o;
  o.scheme = s.scheme;
  o.level = canon(level.c_str());
  o.threads = threads;
  o.allow_recompute = false;
  return o;
}

vq::LoadReport load_into(const Stored& s, std::vector<std::shared_ptr<vq::KVCache>>& caches, const std::string& level,
                         int threads = 2) {
  return vq::load_prefix(*s.store, *context().model, caches, context().tokens, options_for(s, level, threads));
}

// Caches of `method` fed the context's exact K/V of the first n tokens, chunk by chunk.
std::vector<std::shared_ptr<vq::KVCache>> live_caches(const std::string& method, int n) {
  const Context& c = context();
  auto caches = vq::make_caches(method, *c.model);
  for (std::size_t l = 0; l < caches.size(); ++l)
    for (int t = 0; t < n; t += kC)
      caches[l]->update(c.exact[l].keys.slice(2, t, t + kC).contiguous(true), c.exact[l].values.slice(2, t, t + kC).contiguous(true));
  return caches;
}

void expect_same_codes(const vq::VqLayerCodes& a, const vq::VqLayerCodes& b) {
  EXPECT_EQ(a.batch, b.batch);
  EXPECT_EQ(a.tokens, b.tokens);
  for (const auto& [x, y] : {std::pair{&a.k, &b.k}, std::pair{&a.v, &b.v}}) {
    EXPECT_EQ(x->step, y->step);
    EXPECT_EQ(x->offset, y->offset);
    EXPECT_EQ(x->shift, y->shift);
    EXPECT_EQ(x->codes, y->codes);
  }
}

// state(), attend() on random queries and, per layer, the vq codes where both are vq caches.
void expect_same_caches(const std::vector<std::shared_ptr<vq::KVCache>>& a, const std::vector<std::shared_ptr<vq::KVCache>>& b) {
  ASSERT_EQ(a.size(), b.size());
  const auto& mc = context().model->config();
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  vq::Tensor q = vq::Tensor::zeros({1, mc.n_heads, 3, mc.head_size()}, vq::DType::F32);
  for (std::int64_t h = 0; h < q.dim(1); ++h)
    for (std::int64_t t = 0; t < q.dim(2); ++t) {
      auto* row = reinterpret_cast<float*>(q.row(0, h, t));
      for (std::int64_t d = 0; d < q.dim(3); ++d) row[d] = nd(rng);
    }
  for (std::size_t l = 0; l < a.size(); ++l) {
    ASSERT_EQ(a[l]->offset(), b[l]->offset()) << "layer " << l;
    const vq::KVState sa = a[l]->state(), sb = b[l]->state();
    EXPECT_TRUE(sa.keys.bit_equal(sb.keys)) << "layer " << l;
    EXPECT_TRUE(sa.values.bit_equal(sb.values)) << "layer " << l;
    EXPECT_TRUE(a[l]->attend(q, 0.125f).bit_equal(b[l]->attend(q, 0.125f))) << "layer " << l;
    const auto* va = dynamic_cast<const vq::VqKVCache*>(a[l].get());
    const auto* vb = dynamic_cast<const vq::VqKVCache*>(b[l].get());
    if (va && vb) expect_same_codes(va->codes(), vb->codes());
  }
}

}  // namespace

// The store's contract for live-coded vq levels: chunk i holds the live cache's codes, so the code
// domain load and the dense one (fp32 host) both give what the live cache holds, bit for bit; the
// host then decodes on exactly as the live cache does.
TEST(PrefixCodeLoad, CodeDomainLoadIsTheLiveCacheBitForBit) {
  const Context& c = context();
  const int n = stored_tokens();
  ASSERT_GE(n, 3 * kC);  // several chunks after the calibrating one
  const Stored s({kVq2});
  for (const int threads : {1, 2}) {
    SCOPED_TRACE(threads);
    auto host = vq::make_caches(canon(kVq2), *c.model);
    const auto r = load_into(s, host, kVq2, threads);
    EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
    EXPECT_EQ(r.tokens_reused, n);
    auto live = live_caches(canon(kVq2), n);
    for (const auto& h : host) ASSERT_NE(dynamic_cast<const vq::VqKVCache*>(h.get()), nullptr);
    expect_same_caches(host, live);
    // Lossy, not a copy of the exact rows.
    EXPECT_FALSE(host[0]->state().keys.bit_equal(c.exact[0].keys.slice(2, 0, n).contiguous(true)));
    // Continue: the next token through the model on both, then the comparison again.
    const auto next = std::span<const int>(c.tokens).subspan(static_cast<std::size_t>(n), 1);
    const auto la = c.model->forward(next, host);
    const auto lb = c.model->forward(next, live);
    EXPECT_EQ(la, lb);
    expect_same_caches(host, live);
  }
  // The dense path (fp32 host) of the same chunks holds the live cache's rows.
  auto dense = vq::make_caches("fp32", *c.model);
  load_into(s, dense, kVq2);
  const auto live = live_caches(canon(kVq2), n);
  for (std::size_t l = 0; l < dense.size(); ++l) {
    EXPECT_TRUE(dense[l]->state().keys.bit_equal(live[l]->state().keys)) << l;
    EXPECT_TRUE(dense[l]->state().values.bit_equal(live[l]->state().values)) << l;
  }
}

// Levels other than the host's (another vq level, fp16): their rows go through the host's update(),
// re-quantized, so the host is a vq:bits=2 cache fed those rows (whatever the chunking).
TEST(PrefixCodeLoad, OtherLevelsAreRequantizedByTheHost) {
  const Context& c = context();
  const int n = stored_tokens();
  const Stored s({kVq1, "fp16", kVq2});
  for (const char* level : {kVq1, "fp16"}) {
    SCOPED_TRACE(level);
    auto host = vq::make_caches(canon(kVq2), *c.model);
    const auto r = load_into(s, host, level);
    EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
    EXPECT_EQ(r.tokens_reused, n);
    const auto rows = live_caches(canon(level), n);  // what the level's chunks decode to
    auto expect = vq::make_caches(canon(kVq2), *c.model);
    for (std::size_t l = 0; l < expect.size(); ++l) {
      const vq::KVState st = rows[l]->state();
      expect[l]->update(st.keys.to(vq::DType::F32), st.values.to(vq::DType::F32));
    }
    expect_same_caches(host, expect);
  }
}

// Faults on the code path: a corrupt chunk stops the load there with one warning naming it (the
// rest is recomputed by the host), and the chunks before it are the live cache's.
TEST(PrefixCodeLoad, CorruptChunkStopsTheCodeDomainLoadWithAWarning) {
  const Context& c = context();
  const Stored s({kVq2});
  // The blob of chunk 1: flip a byte in the middle.
  std::uint64_t h = 0;
  for (int k = 0; k <= 1; ++k)
    h = vq::chain_hash(h, c.fp, s.scheme.levels[0], std::span<const int>(c.tokens).subspan(static_cast<std::size_t>(k * kC), kC));
  const std::string key = vq::chunk_key(s.scheme.levels[0], h);
  auto blob = *s.store->get(key);
  blob[blob.size() / 2] ^= 0x20;
  s.store->remove(key);  // put keeps an existing blob (idempotent)
  s.store->put(key, blob);
  auto host = vq::make_caches(canon(kVq2), *c.model);
  const vq::LoaderOptions o = options_for(s, kVq2);
  const auto r = vq::load_prefix(*s.store, *c.model, host, c.tokens, o);
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("chunk 1"), std::string::npos) << r.warnings[0];
  EXPECT_EQ(r.tokens_reused, kC);
  expect_same_caches(host, live_caches(canon(kVq2), kC));
  // A blob of another model (fingerprint) is refused the same way: nothing found under its keys.
  vq::LoaderOptions other = o;
  other.scheme.model_fingerprint ^= 1;
  auto host2 = vq::make_caches(canon(kVq2), *c.model);
  const auto r2 = vq::load_prefix(*s.store, *c.model, host2, c.tokens, other);
  EXPECT_EQ(r2.tokens_reused, 0);
}

// A live-coded chunk names its first position (the keys' RoPE positions): a blob whose metadata
// names another one, or no number, is refused as a FormatError on both decode paths, although its
// checksums hold (re-serialised), so a host never re-rotates keys at the wrong place.
TEST(PrefixCodeLoad, ChunkOfAnotherFirstPositionIsRefused) {
  const Context& c = context();
  const Stored s({kVq2});
  std::uint64_t h = 0;
  for (int k = 0; k <= 1; ++k)
    h = vq::chain_hash(h, c.fp, s.scheme.levels[0], std::span<const int>(c.tokens).subspan(static_cast<std::size_t>(k * kC), kC));
  const auto blob = *s.store->get(vq::chunk_key(s.scheme.levels[0], h));
  const auto toks = std::span<const int>(c.tokens).subspan(kC, kC);
  const vq::VqLayerModelSource models = vq::chunk_vq_models(*c.model);
  const auto good = vq::decode_chunk_codes(blob, c.fp, s.scheme.levels[0], 1, h, toks, models);
  EXPECT_EQ(good.first_position, kC);
  vq::VqkvLoadOptions lo;
  lo.vq_models = models;
  vq::PromptCache pc = vq::deserialize_prompt_cache(blob, lo);
  ASSERT_EQ(pc.metadata.at("vqkv.store.first_position"), std::to_string(kC));
  vq::VqkvSaveOptions so;
  so.chunk_tokens = kC;
  for (const char* bad : {"13", "0", "12x", ""}) {
    SCOPED_TRACE(bad);
    pc.metadata["vqkv.store.first_position"] = bad;
    const auto tampered = vq::serialize_prompt_cache(pc.caches, pc.metadata, so);
    EXPECT_THROW(vq::decode_chunk_codes(tampered, c.fp, s.scheme.levels[0], 1, h, toks, models), vq::FormatError);
    EXPECT_THROW(vq::decode_chunk(tampered, c.fp, s.scheme.levels[0], 1, h, toks, models), vq::FormatError);
  }
}

// append_codes refuses (false, cache unchanged) what update() would not have left quantized under
// this calibration, and takes a live cache's codes in any chunking.
TEST(PrefixCodeLoad, AppendCodesTakesOnlyCodesOfItsOwnCalibration) {
  const Context& c = context();
  const int n = stored_tokens();
  const auto live = live_caches(canon(kVq2), n);
  const auto& v0 = dynamic_cast<const vq::VqKVCache&>(*live[0]);
  auto fresh = [&] { return std::dynamic_pointer_cast<vq::VqKVCache>(vq::make_caches(canon(kVq2), *c.model)[0]); };
  // In pieces of 12 then the rest: the same cache as the live one.
  auto a = fresh();
  ASSERT_TRUE(a->append_codes(v0.codes(0, kC)));
  ASSERT_TRUE(a->append_codes(v0.codes(kC, n)));
  expect_same_codes(a->codes(), v0.codes());
  EXPECT_TRUE(a->state().keys.bit_equal(v0.state().keys));
  // Fewer than calib tokens into an empty cache: refused.
  EXPECT_FALSE(fresh()->append_codes(v0.codes(0, 4)));
  // Another calibration (a vq:bits=1 cache's codes): refused, the cache unchanged.
  const auto other = live_caches(canon(kVq1), n);
  const auto& o0 = dynamic_cast<const vq::VqKVCache&>(*other[0]);
  auto b = fresh();
  ASSERT_TRUE(b->append_codes(v0.codes(0, kC)));
  EXPECT_FALSE(b->append_codes(o0.codes(kC, 2 * kC)));
  EXPECT_EQ(b->offset(), kC);
  // Malformed codes: InvalidArgument.
  vq::VqLayerCodes bad = v0.codes(kC, 2 * kC);
  bad.k.codes.pop_back();
  EXPECT_THROW(b->append_codes(bad), vq::InvalidArgument);
  EXPECT_EQ(b->offset(), kC);
  // An exact window (residual > 0): the codes are not what update() would hold.
  auto r = std::make_shared<vq::VqKVCache>(vq::VqConfig{2.0, 8, 4, 0}, std::shared_ptr<const vq::VqLayerModel>(live[0], v0.layer_model()));
  EXPECT_FALSE(r->append_codes(v0.codes(0, kC)));
  EXPECT_EQ(r->offset(), 0);
  EXPECT_THROW(v0.codes(0, n + 1), vq::InvalidArgument);
}

namespace {
// The directory of the last whole chunk of the context at `s`'s scheme.
std::string last_directory_key(const Stored& s) {
  std::uint64_t h = 0;
  for (int k = 0; k < stored_tokens() / kC; ++k)
    h = vq::directory_hash(h, s.scheme.chunk_tokens, std::span<const int>(context().tokens).subspan(static_cast<std::size_t>(k * kC), kC));
  return vq::directory_key(h);
}
std::shared_ptr<vq::VqKVCache> as_vq(const std::shared_ptr<vq::KVCache>& c) { return std::dynamic_pointer_cast<vq::VqKVCache>(c); }
}  // namespace

// put_context writes, per live-coded level, the live caches' field widths after each chunk into the
// chunk's directory; a code-domain load packs at the last chunk's widths from chunk 0 on (in its
// decoder threads), so the host ends with the live cache's widths too, not only its values.
TEST(PrefixCodeLoad, WidthHintsGiveTheLiveCachesWidths) {
  const Context& c = context();
  const int n = stored_tokens();
  const Stored s({kVq2, "fp16"});
  const auto live = live_caches(canon(kVq2), n);
  const vq::ChunkDirectory d = vq::decode_directory(*s.store->get(last_directory_key(s)));
  ASSERT_EQ(d.entries.size(), 2u);
  EXPECT_TRUE(d.entries[1].widths.empty());  // fp16: no hint
  std::vector<std::uint8_t> want;
  for (const auto& l : live) {
    const auto v = as_vq(l);
    want.insert(want.end(), v->key_widths().begin(), v->key_widths().end());
    want.insert(want.end(), v->value_widths().begin(), v->value_widths().end());
  }
  EXPECT_EQ(d.entries[0].widths, want);
  EXPECT_EQ(vq::decode_directory(vq::encode_directory(d)).entries[0].widths, want);  // round trip
  for (const int threads : {1, 2}) {
    SCOPED_TRACE(threads);
    auto host = vq::make_caches(canon(kVq2), *c.model);
    const auto r = load_into(s, host, kVq2, threads);
    EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
    expect_same_caches(host, live);
    for (std::size_t l = 0; l < host.size(); ++l) {
      EXPECT_EQ(as_vq(host[l])->key_widths(), as_vq(live[l])->key_widths()) << l;
      EXPECT_EQ(as_vq(host[l])->value_widths(), as_vq(live[l])->value_widths()) << l;
    }
  }
}

// A hint is only a hint: directories whose widths are too narrow, too wide, of another shape or
// missing still load the live cache's values bit for bit (a narrow layout escapes and widens, a
// shape that does not fit is ignored); a malformed one is a corrupt directory (warning, recompute).
TEST(PrefixCodeLoad, WrongWidthHintsStillGiveExactCaches) {
  const Context& c = context();
  const int n = stored_tokens();
  const auto live = live_caches(canon(kVq2), n);
  const std::string dkey = [&] {
    const Stored s({kVq2});
    return last_directory_key(s);
  }();
  const auto rewrite = [&](const Stored& s, const std::function<void(std::vector<std::uint8_t>&)>& edit) {
    vq::ChunkDirectory d = vq::decode_directory(*s.store->get(dkey));
    edit(d.entries[0].widths);
    s.store->remove(dkey);
    s.store->put(dkey, vq::encode_directory(d));
  };
  const std::vector<std::pair<const char*, std::function<void(std::vector<std::uint8_t>&)>>> edits = {
      {"all 1 bit", [](std::vector<std::uint8_t>& w) { std::fill(w.begin(), w.end(), std::uint8_t{1}); }},
      {"all 16 bits", [](std::vector<std::uint8_t>& w) { std::fill(w.begin(), w.end(), std::uint8_t{16}); }},
      {"mixed", [](std::vector<std::uint8_t>& w) { for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<std::uint8_t>(1 + i * 7 % 16); }},
      {"short", [](std::vector<std::uint8_t>& w) { w.resize(w.size() - 1); }},
      {"a width of 0", [](std::vector<std::uint8_t>& w) { w[3] = 0; }},
      {"none", [](std::vector<std::uint8_t>& w) { w.clear(); }},
  };
  for (const auto& [what, edit] : edits) {
    SCOPED_TRACE(what);
    const Stored s({kVq2});
    rewrite(s, edit);
    for (const int threads : {1, 2}) {
      auto host = vq::make_caches(canon(kVq2), *c.model);
      const auto r = load_into(s, host, kVq2, threads);
      EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
      EXPECT_EQ(r.tokens_reused, n);
      expect_same_caches(host, live);
    }
  }
  // Not base64 / not zstd: the directory is corrupt, the load stops before that chunk with a warning.
  const Stored s({kVq2});
  const auto blob = *s.store->get(dkey);
  std::string text(blob.begin(), blob.end());
  const auto at = text.find("zstd_base64\":\"");
  ASSERT_NE(at, std::string::npos);
  ASSERT_NE(text[at + 14], 'A');
  text[at + 14] = '#';
  EXPECT_THROW(vq::decode_directory(vq::Blob(text.begin(), text.end())), vq::FormatError);
  text[at + 14] = 'A';  // the zstd frame's magic number is now wrong
  EXPECT_THROW(vq::decode_directory(vq::Blob(text.begin(), text.end())), vq::FormatError);
  s.store->remove(dkey);
  s.store->put(dkey, vq::Blob(text.begin(), text.end()));
  auto host = vq::make_caches(canon(kVq2), *c.model);
  const auto r = load_into(s, host, kVq2);
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("corrupt directory"), std::string::npos) << r.warnings[0];
  EXPECT_EQ(r.tokens_reused, n - kC);
  expect_same_caches(host, live_caches(canon(kVq2), n - kC));
}

// append_packed (codes packed off the cache, at any layout) is append_codes: the same cache after
// it, in any chunking; rows are copied where the layout is the cache's, else the codes unpacked.
TEST(PrefixCodeLoad, AppendPackedIsAppendCodes) {
  const Context& c = context();
  const int n = stored_tokens();
  const auto live = live_caches(canon(kVq2), n);
  const auto v0 = as_vq(live[0]);
  const int heads = v0->layer_model()->kv_heads;
  auto fresh = [&] { return as_vq(vq::make_caches(canon(kVq2), *c.model)[0]); };
  const auto layout = [&](std::vector<std::uint8_t> w) { return std::make_shared<const vq::VqFieldLayout>(vq::VqFieldLayout::from_widths(std::move(w), heads)); };
  const std::size_t kn = v0->key_widths().size(), vn = v0->value_widths().size();
  // Packing and unpacking is the identity, at any layout.
  for (const std::uint8_t w : {1, 2, 3, 8, 16}) {
    const vq::VqLayerCodes codes = v0->codes(kC, n);
    const auto p = vq::vq_pack_codes(codes, layout(std::vector<std::uint8_t>(kn, w)), layout(std::vector<std::uint8_t>(vn, w)));
    expect_same_codes(vq::vq_unpack_codes(p), codes);
  }
  // Chunk 0 at the live cache's layouts, the rest in two pieces at: the same layouts (rows copied),
  // all-2 (another layout: unpacked), the live widths' own layout made again (from_widths).
  const auto lk = std::make_shared<const vq::VqFieldLayout>(v0->field_layout(0));
  const auto lv = std::make_shared<const vq::VqFieldLayout>(v0->field_layout(1));
  const std::vector<std::pair<std::shared_ptr<const vq::VqFieldLayout>, std::shared_ptr<const vq::VqFieldLayout>>> later = {
      {lk, lv}, {layout(std::vector<std::uint8_t>(kn, 2)), layout(std::vector<std::uint8_t>(vn, 2))},
      {layout(v0->key_widths()), layout(v0->value_widths())}};
  for (const auto& [k, v] : later) {
    auto a = fresh();
    ASSERT_TRUE(a->append_packed(vq::vq_pack_codes(v0->codes(0, kC), lk, lv)));
    EXPECT_EQ(a->key_widths(), v0->key_widths());
    ASSERT_TRUE(a->append_packed(vq::vq_pack_codes(v0->codes(kC, 2 * kC), k, v)));
    ASSERT_TRUE(a->append_packed(vq::vq_pack_codes(v0->codes(2 * kC, n), k, v)));
    expect_same_codes(a->codes(), v0->codes());
    EXPECT_TRUE(a->state().keys.bit_equal(v0->state().keys));
    EXPECT_TRUE(a->state().values.bit_equal(v0->state().values));
    EXPECT_EQ(a->escapes(), v0->escapes());
  }
  // The same refusals as append_codes, the cache unchanged.
  EXPECT_FALSE(fresh()->append_packed(vq::vq_pack_codes(v0->codes(0, 4), lk, lv)));  // fewer than calib tokens
  const auto o0 = as_vq(live_caches(canon(kVq1), n)[0]);
  auto b = fresh();
  ASSERT_TRUE(b->append_packed(vq::vq_pack_codes(v0->codes(0, kC), lk, lv)));
  EXPECT_FALSE(b->append_packed(vq::vq_pack_codes(o0->codes(kC, 2 * kC), lk, lv)));  // another calibration
  EXPECT_EQ(b->offset(), kC);
  // Codes beyond the coder's reach are refused when packed; a packed chunk whose arrays disagree, when appended.
  vq::VqLayerCodes far = v0->codes(kC, 2 * kC);
  far.k.codes[5] = static_cast<std::int16_t>(vq::vq_max_code(vq::kVqMaxShift) + 1);
  EXPECT_THROW(vq::vq_pack_codes(far, lk, lv), vq::InvalidArgument);
  EXPECT_THROW(vq::vq_pack_codes(far, layout(std::vector<std::uint8_t>(kn, 16)), lv), vq::InvalidArgument);
  auto bad = vq::vq_pack_codes(v0->codes(kC, 2 * kC), lk, lv);
  bad.k.rows.pop_back();
  EXPECT_THROW(b->append_packed(bad), vq::InvalidArgument);
  bad = vq::vq_pack_codes(v0->codes(kC, 2 * kC), lk, lv);
  bad.v.escapes.push_back({static_cast<std::int32_t>(kC), 0, 1});
  EXPECT_THROW(b->append_packed(bad), vq::InvalidArgument);
  EXPECT_EQ(b->offset(), kC);
}
