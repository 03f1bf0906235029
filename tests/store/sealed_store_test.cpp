// The sealed store (store/sealed_store.hpp, issue 36): a MAC per blob under a store secret and a
// namespace per tenant, over a real file: backend, and the prefix loader through it (stories260K).
#include "veloxquant/store/sealed_store.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include <fmt/core.h>

#include "store_context.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/store/file_store.hpp"
#include "veloxquant/store/prefix_loader.hpp"

namespace fs = std::filesystem;

namespace {

struct Dir : vqtest::ScratchDir {
  Dir() : ScratchDir("sealed-test") {}
};

std::unique_ptr<vq::KVStore> sealed(const fs::path& dir, std::optional<std::string> secret, std::optional<std::string> ns = {}) {
  return std::make_unique<vq::SealedStore>(std::make_unique<vq::FileStore>(dir), vq::StoreGuards{std::move(secret), std::move(ns)});
}

vq::Blob bytes(const std::string& s) { return vq::Blob(s.begin(), s.end()); }

template <class F>
std::string format_error(F&& f) {
  try {
    f();
  } catch (const vq::FormatError& e) {
    return e.what();
  }
  return "(no FormatError)";
}

TEST(SealedStore, AMacRefusesForgedMovedCorruptAndUnsealedBlobs) {
  Dir d;
  auto s = sealed(d.path, "s3cret");
  vq::FileStore raw(d.path);
  s->put("vq-a", bytes("hello"));
  ASSERT_EQ(*s->get("vq-a"), bytes("hello"));
  const vq::Blob stored = *raw.get("vq-a");
  ASSERT_EQ(stored.size(), 5u + 40u);  // the blob, then nonce, tag and magic
  EXPECT_EQ(std::string(stored.begin(), stored.begin() + 5), "hello");
  EXPECT_EQ(std::string(stored.end() - 8, stored.end() - 3), "VQMAC");
  s->put("vq-a2", bytes("hello"));
  EXPECT_NE(*raw.get("vq-a2"), stored);  // a fresh nonce per write
  // Moved to another key: the MAC covers the key.
  raw.put("vq-b", stored);
  EXPECT_NE(format_error([&] { s->get("vq-b"); }).find("fails its MAC"), std::string::npos);
  // Forged without the secret (a plain blob) and flipped bytes.
  raw.put("vq-c", bytes("forged"));
  EXPECT_NE(format_error([&] { s->get("vq-c"); }).find("carries no MAC"), std::string::npos);
  for (const std::size_t at : {std::size_t{2}, std::size_t{10}, std::size_t{25}, stored.size() - 1}) {  // blob, nonce, tag, magic
    vq::Blob bad = stored;
    bad[at] ^= 1;
    raw.replace("vq-a", bad);
    EXPECT_NE(format_error([&] { s->get("vq-a"); }).find(at + 1 == stored.size() ? "carries no MAC" : "fails its MAC"), std::string::npos) << at;
  }
  raw.replace("vq-a", stored);
  // Another secret, and no secret: refused, never decoded.
  EXPECT_NE(format_error([&] { sealed(d.path, "other")->get("vq-a"); }).find("fails its MAC"), std::string::npos);
  EXPECT_NE(format_error([&] { vq::open_store("file:" + d.path.string())->get("vq-a"); }).find("the store has a secret"),
            std::string::npos);
  // get_many checks every blob too.
  const std::vector<std::string> keys{"vq-a", "vq-missing"};
  const auto many = s->get_many(keys);
  ASSERT_EQ(many.size(), 2u);
  EXPECT_EQ(*many[0], bytes("hello"));
  EXPECT_FALSE(many[1].has_value());
  EXPECT_THROW(s->get_many(std::vector<std::string>{"vq-a", "vq-b"}), vq::FormatError);
  EXPECT_THROW(sealed(d.path, ""), vq::InvalidArgument);
}

TEST(SealedStore, NamespacesNeverMeetAndListTheirOwnKeys) {
  Dir d;
  auto a = sealed(d.path, std::nullopt, "tenant-a");
  auto b = sealed(d.path, std::nullopt, "tenant-b");
  a->put("vq-key", bytes("a's"));
  b->put("vq-key", bytes("b's"));
  EXPECT_EQ(*a->get("vq-key"), bytes("a's"));
  EXPECT_EQ(*b->get("vq-key"), bytes("b's"));
  vq::FileStore raw(d.path);
  EXPECT_FALSE(raw.exists("vq-key"));  // the plain key is stored nowhere: it cannot be probed
  EXPECT_EQ(raw.list().size(), 2u);
  const auto listed = a->list();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0], static_cast<vq::SealedStore&>(*a).stored_key("vq-key"));
  EXPECT_EQ(listed[0].rfind("vq-ns", 0), 0u);
  EXPECT_EQ(*a->get(listed[0]), bytes("a's"));  // a listed name is taken as it is (store rm, ls)
  EXPECT_TRUE(a->remove(listed[0]));
  EXPECT_FALSE(a->get("vq-key").has_value());
  EXPECT_EQ(*b->get("vq-key"), bytes("b's"));
}

TEST(SealedStore, UrlOptionsAndEnvironmentChooseTheGuards) {
  auto [base, g] = vq::split_store_guards("redis://127.0.0.1:1?prefix=x&secret=pw&namespace=t&timeout_ms=5");
  EXPECT_EQ(base, "redis://127.0.0.1:1?prefix=x&timeout_ms=5");
  EXPECT_EQ(g.secret.value_or(""), "pw");
  EXPECT_EQ(g.name_space.value_or(""), "t");
  ::setenv("VQ_STORE_SECRET", "from-env", 1);
  auto [base2, g2] = vq::split_store_guards("file:/tmp/x?secret=url");
  EXPECT_EQ(base2, "file:/tmp/x");
  EXPECT_EQ(g2.secret.value_or(""), "url");  // the URL's wins
  auto [base3, g3] = vq::split_store_guards("file:/tmp/x");
  EXPECT_EQ(g3.secret.value_or(""), "from-env");
  EXPECT_FALSE(g3.name_space.has_value());
  ::unsetenv("VQ_STORE_SECRET");
  Dir d;
  const auto s = vq::open_store(fmt::format("file:{}?secret=hunter2&namespace=n1", d.path.string()));
  EXPECT_EQ(s->describe().find("hunter2"), std::string::npos) << s->describe();
  EXPECT_NE(s->describe().find("sealed"), std::string::npos) << s->describe();
}

// The loader through a sealed store: the same caches as a plain store's load; a reader without the
// secret, or a writer without it, gets nothing used (one warning, recompute), never a wrong chunk.
TEST(SealedStore, ThePrefixLoaderReadsOnlyWhatTheSecretSealed) {
  const auto c = vqtest::make_store_context(4);
  const std::span<const int> prefill = std::span<const int>(c.tokens).first(c.tokens.size() - 1);
  vq::ChunkScheme scheme{c.fp, 4, {"fp16"}};
  Dir d;
  auto s = sealed(d.path, "k");
  vq::put_context(*s, *c.model, scheme, prefill, c.exact);
  const auto load = [&](vq::KVStore& st) {
    vq::LoaderOptions o;
    o.scheme = scheme;
    o.allow_recompute = false;
    o.repair = false;
    auto caches = vq::make_caches("fp32", *c.model);
    const auto rep = vq::load_prefix(st, *c.model, caches, c.tokens, o);
    return std::make_pair(rep, caches);
  };
  const int whole = static_cast<int>(prefill.size());
  const auto [good, gc] = load(*s);
  EXPECT_TRUE(good.warnings.empty()) << good.warnings.front();
  EXPECT_EQ(good.tokens_reused, whole);
  Dir plain_dir;
  vq::FileStore plain(plain_dir.path);
  vq::put_context(plain, *c.model, scheme, prefill, c.exact);
  const auto [ref, rc] = load(plain);
  ASSERT_EQ(ref.tokens_reused, whole);
  for (std::size_t l = 0; l < gc.size(); ++l) EXPECT_TRUE(gc[l]->state().keys.bit_equal(rc[l]->state().keys)) << l;
  // No secret, another secret: nothing used, one warning naming the MAC.
  vq::FileStore raw(d.path);
  for (const auto& st : {vq::open_store("file:" + d.path.string()), sealed(d.path, "wrong")}) {
    const auto [r, caches] = load(*st);
    EXPECT_EQ(r.tokens_reused, 0);
    ASSERT_EQ(r.warnings.size(), 1u);
    EXPECT_NE(r.warnings[0].find("MAC"), std::string::npos) << r.warnings[0];
  }
  // A writer with another secret, or none, cannot overwrite the index the others share: its put
  // stops with an IoError and the sealed prefix still loads whole.
  for (const auto& st : {vq::open_store("file:" + d.path.string()), sealed(d.path, "wrong")}) {
    try {
      vq::put_context(*st, *c.model, scheme, prefill, c.exact);
      ADD_FAILURE() << "a put with the wrong secret went through";
    } catch (const vq::IoError& e) {
      EXPECT_NE(std::string(e.what()).find("not stored"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(load(*s).first.tokens_reused, whole);
  // A writer without the secret replaces chunk 1's blob with a well-formed plain one (the same
  // bytes a plain store holds): refused, only chunk 0 is used.
  std::uint64_t h = 0;
  for (int k = 0; k <= 1; ++k) h = vq::chain_hash(h, c.fp, "fp16", prefill.subspan(static_cast<std::size_t>(k) * 4, 4));
  const std::string key = vq::chunk_key("fp16", h);
  raw.replace(key, *plain.get(key));
  const auto [p, pcaches] = load(*s);
  EXPECT_EQ(p.tokens_reused, 4);
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_NE(p.warnings[0].find("carries no MAC"), std::string::npos) << p.warnings[0];
}

}  // namespace
