// Prefix chunks: chained keys, and chunks that decode to exactly what a live cache of their level
// held, on the real stories260K model.
#include "veloxquant/store/prefix_chunks.hpp"

#include <gtest/gtest.h>

#include <filesystem>

#include "store_context.hpp"
#include "../../fuzz/store_blob_fuzz_identity.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/file_store.hpp"
#include "veloxquant/store/prefix_loader.hpp"

namespace fs = std::filesystem;

namespace {

using Context = vqtest::StoreContext;

const Context& context() {
  static const Context c = vqtest::make_store_context(0);
  return c;
}

vq::ChunkKV slice_chunk(const std::vector<vq::KVState>& exact, int i, int C) {
  vq::ChunkKV out;
  for (const auto& s : exact) out.push_back({s.keys.slice(2, i * C, (i + 1) * C).contiguous(true), s.values.slice(2, i * C, (i + 1) * C).contiguous(true)});
  return out;
}

// A scheme of 12-token chunks for the context's model at `levels`.
vq::ChunkScheme scheme_of(const Context& c, const char* levels) {
  vq::ChunkScheme scheme;
  scheme.model_fingerprint = c.fp;
  scheme.chunk_tokens = 12;
  scheme.levels = vq::parse_levels(levels);
  return scheme;
}

// An empty directory for a test's file store (removed first if a previous run left it).
fs::path fresh_dir(const char* name) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("{}-{}", name, ::getpid());
  fs::remove_all(dir);
  return dir;
}

void expect_bit_equal(const vq::ChunkKV& a, const vq::ChunkKV& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t l = 0; l < a.size(); ++l) {
    EXPECT_TRUE(a[l].keys.bit_equal(b[l].keys)) << "layer " << l;
    EXPECT_TRUE(a[l].values.bit_equal(b[l].values)) << "layer " << l;
  }
}

TEST(PrefixChunks, KeysChainOverThePrefix) {
  const std::vector<int> t1{1, 2, 3}, t2{1, 2, 4};
  const auto h1 = vq::chain_hash(0, 7, "fp32", t1);
  EXPECT_EQ(h1, vq::chain_hash(0, 7, "fp32", t1));
  EXPECT_NE(h1, vq::chain_hash(0, 7, "fp32", t2));   // other tokens
  EXPECT_NE(h1, vq::chain_hash(0, 8, "fp32", t1));   // other model
  EXPECT_NE(h1, vq::chain_hash(0, 7, "fp16", t1));   // other method
  EXPECT_NE(h1, vq::chain_hash(5, 7, "fp32", t1));   // other prefix before it
  EXPECT_NE(vq::chunk_key("fp32", h1), vq::chunk_key("fp16", h1));
  EXPECT_NO_THROW(vq::check_store_key(vq::chunk_key("cachegen:bits=4", h1)));
  EXPECT_NO_THROW(vq::check_store_key(vq::directory_key(h1)));
}

TEST(PrefixChunks, LevelsParseToCanonicalSpecsWithFp32) {
  EXPECT_EQ(vq::parse_levels("fp16"), (std::vector<std::string>{"fp16", "fp32"}));
  EXPECT_EQ(vq::parse_levels("fp32; fp16;fp16"), (std::vector<std::string>{"fp32", "fp16"}));
  EXPECT_EQ(vq::parse_levels("cachegen:bits=2")[0], vq::MethodSpec::parse("cachegen:bits=2").to_string());
  EXPECT_THROW(vq::parse_levels("fp99"), vq::InvalidArgument);
}

TEST(PrefixChunks, ModelFingerprintSeesEveryWeight) {
  vq::Checkpoint ck = vq::Checkpoint::load(vqtest::model_path());
  const auto a = vq::model_fingerprint(vq::Transformer(ck));
  EXPECT_EQ(a, context().fp);
  ck.w2.back() = std::nextafter(ck.w2.back(), 1.0f);
  EXPECT_NE(vq::model_fingerprint(vq::Transformer(ck)), a);
}

// The definition: chunk i at level L is what a fresh cache of L held after one update with the
// chunk's exact K/V. fp32 is therefore the exact rows of the live prefill; every level round-trips
// bit for bit (vq levels given the model's layer models).
TEST(PrefixChunks, ChunksDecodeToWhatALiveCacheHeld) {
  const Context& c = context();
  const int C = 16;
  ASSERT_GE(static_cast<int>(c.tokens.size()), 2 * C);
  for (const std::string level : {"fp32", "fp16", "cachegen:bits=4,group=8", "cachegen:bits=2,schedule=off,group=4", "vq:bits=2", "vq:bits=2,calib=8", "vq:bits=2,calib=8,block=head"}) {
    SCOPED_TRACE(level);
    const std::string canon = vq::MethodSpec::parse(level).to_string();
    for (int i = 0; i < 2; ++i) {
      const auto toks = std::span<const int>(c.tokens).subspan(static_cast<std::size_t>(i * C), C);
      const vq::ChunkKV exact = slice_chunk(c.exact, i, C);
      const std::uint64_t chain = 1000 + static_cast<std::uint64_t>(i);
      const vq::Blob blob = vq::encode_chunk(*c.model, c.fp, canon, i, chain, toks, exact);
      const vq::ChunkKV live = vq::level_chunk_kv(*c.model, canon, exact);
      const vq::ChunkKV loaded = vq::decode_chunk(blob, c.fp, canon, i, chain, toks, vq::chunk_vq_models(*c.model));
      if (canon.rfind("vq", 0) == 0) {  // a vq chunk needs the model's layer models to load
        EXPECT_THROW(vq::decode_chunk(blob, c.fp, canon, i, chain, toks), vq::FormatError);
      }
      expect_bit_equal(loaded, live);
      if (canon == "fp32") expect_bit_equal(loaded, exact);
      if (canon == "fp16") {
        for (std::size_t l = 0; l < exact.size(); ++l)
          EXPECT_TRUE(loaded[l].keys.bit_equal(exact[l].keys.to(vq::DType::F16).to(vq::DType::F32)));
      }
      if (canon.find("block=head") != std::string::npos) {  // the blob names its per-head blocks: a whole-row model would decode otherwise
        const vq::ChunkKV whole = vq::level_chunk_kv(*c.model, vq::MethodSpec::parse("vq:bits=2,calib=8").to_string(), exact);
        EXPECT_FALSE(loaded[0].keys.bit_equal(whole[0].keys));
      }
      if (canon.rfind("cachegen", 0) == 0 || canon.find("calib=8") != std::string::npos) {
        EXPECT_FALSE(loaded[0].keys.bit_equal(exact[0].keys));  // lossy, yet exactly the live cache
      }
    }
  }
}

TEST(PrefixChunks, DecodeRefusesOtherModelMethodChunkTokensAndCorruption) {
  const Context& c = context();
  const int C = 8;
  const auto toks = std::span<const int>(c.tokens).subspan(0, C);
  const std::uint64_t chain = vq::chain_hash(0, c.fp, "fp16", toks);
  const vq::Blob blob = vq::encode_chunk(*c.model, c.fp, "fp16", 0, chain, toks, slice_chunk(c.exact, 0, C));
  EXPECT_NO_THROW(vq::decode_chunk(blob, c.fp, "fp16", 0, chain, toks));
  const auto expect_format_error = [&](const vq::Blob& b, std::uint64_t fp, const std::string& level, int index,
                                       std::span<const int> t, const char* words, std::uint64_t ch = 0) {
    try {
      vq::decode_chunk(b, fp, level, index, ch ? ch : chain, t);
      ADD_FAILURE() << "expected FormatError: " << words;
    } catch (const vq::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expect_format_error(blob, c.fp + 1, "fp16", 0, toks, "another model");
  expect_format_error(blob, c.fp, "fp32", 0, toks, "another method");
  expect_format_error(blob, c.fp, "fp16", 1, toks, "another chunk");
  const auto other = std::span<const int>(c.tokens).subspan(1, C);
  expect_format_error(blob, c.fp, "fp16", 0, other, "another token");
  // The same tokens after another prefix (issue 36: chunks of prompt B served for prompt A).
  expect_format_error(blob, c.fp, "fp16", 0, toks, "another prefix", chain + 1);
  {  // a blob that carries no prefix hash (as written before blobs carried one) is refused too
    vq::PromptCache pc = vq::deserialize_prompt_cache(blob);
    ASSERT_EQ(pc.metadata.erase("vqkv.store.chain"), 1u);
    vq::VqkvSaveOptions so;
    so.chunk_tokens = C;
    expect_format_error(vq::serialize_prompt_cache(pc.caches, pc.metadata, so), c.fp, "fp16", 0, toks, "without the hash of its prefix");
  }
  for (const std::size_t at : {std::size_t{5}, blob.size() / 2, blob.size() - 3}) {
    vq::Blob bad = blob;
    bad[at] ^= 0x40;
    EXPECT_THROW(vq::decode_chunk(bad, c.fp, "fp16", 0, chain, toks), vq::FormatError) << at;
  }
  vq::Blob cut(blob.begin(), blob.begin() + static_cast<std::ptrdiff_t>(blob.size() / 3));
  EXPECT_THROW(vq::decode_chunk(cut, c.fp, "fp16", 0, chain, toks), vq::FormatError);
  EXPECT_THROW(vq::decode_directory(cut), vq::FormatError);
}

TEST(PrefixChunks, PutContextStoresEveryWholeChunkOnceAtEveryLevel) {
  const Context& c = context();
  const fs::path dir = fresh_dir("vq-prefix-test");
  vq::FileStore store(dir);
  const vq::ChunkScheme scheme = scheme_of(c, "fp16;cachegen:bits=4,group=4;vq:bits=2");  // vq: layer models reused over chunks
  const std::size_t n = c.tokens.size() / 12 * 12;
  std::vector<vq::KVState> exact;
  for (const auto& s : c.exact) exact.push_back({s.keys.slice(2, 0, static_cast<std::int64_t>(n)), s.values.slice(2, 0, static_cast<std::int64_t>(n))});
  const auto rep = vq::put_context(store, *c.model, scheme, std::span<const int>(c.tokens).first(n), exact);
  EXPECT_EQ(rep.chunks, static_cast<int>(n / 12));
  EXPECT_EQ(rep.chunks_written, rep.chunks);
  EXPECT_EQ(store.list().size(), static_cast<std::size_t>(rep.chunks) * 5 + 1);  // 4 levels + a directory each, the chunk-sizes list
  // Walk the chain as a loader does and decode every chunk at every level.
  std::vector<std::uint64_t> prev(4, 0);
  std::uint64_t dprev = 0;
  for (int i = 0; i < rep.chunks; ++i) {
    const auto toks = std::span<const int>(c.tokens).subspan(static_cast<std::size_t>(i * 12), 12);
    dprev = vq::directory_hash(dprev, scheme.chunk_tokens, toks);
    const auto d = vq::decode_directory(*store.get(vq::directory_key(dprev)));
    ASSERT_EQ(d.entries.size(), 4u);
    for (std::size_t l = 0; l < 4; ++l) {
      prev[l] = vq::chain_hash(prev[l], c.fp, scheme.levels[l], toks);
      EXPECT_EQ(d.entries[l].key, vq::chunk_key(scheme.levels[l], prev[l]));
      const auto blob = store.get(d.entries[l].key);
      ASSERT_TRUE(blob.has_value());
      EXPECT_EQ(blob->size(), d.entries[l].bytes);
      expect_bit_equal(vq::decode_chunk(*blob, c.fp, scheme.levels[l], i, prev[l], toks, vq::chunk_vq_models(*c.model)),
                       vq::level_chunk_kv(*c.model, scheme.levels[l], slice_chunk(c.exact, i, 12)));
    }
  }
  // Idempotent: a second put writes nothing.
  const auto again = vq::put_context(store, *c.model, scheme, std::span<const int>(c.tokens).first(n), exact);
  EXPECT_EQ(again.chunks_written, 0);
  EXPECT_EQ(again.bytes_written, 0u);
  fs::remove_all(dir);
}

// LoaderOptions::level loads every chunk at that level (no recompute), with the model and without
// one (the C API's overload): both give each chunk's level K/V bit for bit.
TEST(PrefixChunks, ForcedLevelLoadsThatLevelWithAndWithoutAModel) {
  const Context& c = context();
  const fs::path dir = fresh_dir("vq-prefix-level-test");
  vq::FileStore store(dir);
  vq::LoaderOptions o;
  o.scheme = scheme_of(c, "cachegen:bits=4,group=4");
  const std::size_t n = c.tokens.size() / 12 * 12;
  const auto rep = vq::put_context(store, *c.model, o.scheme, std::span<const int>(c.tokens).first(n), c.exact);
  const int loadable = std::min(rep.chunks, static_cast<int>((c.tokens.size() - 1) / 12));
  ASSERT_GE(loadable, 2);
  o.level = o.scheme.levels[0];
  const auto& mc = c.model->config();
  for (const bool with_model : {true, false}) {
    auto caches = vq::make_caches("fp32", *c.model);
    const auto r = with_model ? vq::load_prefix(store, *c.model, caches, c.tokens, o)
                              : vq::load_prefix(store, vq::ChunkShape{mc.n_kv_heads, mc.head_size()}, caches, c.tokens, o);
    EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
    EXPECT_EQ(r.tokens_reused, loadable * 12) << "with_model " << with_model;
    EXPECT_EQ(r.tokens_filled, r.tokens_reused);
    for (int i = 0; i < loadable; ++i) {
      vq::ChunkKV got;
      for (const auto& k : caches) {
        const vq::KVState st = k->state();
        got.push_back({st.keys.slice(2, i * 12, (i + 1) * 12).contiguous(true), st.values.slice(2, i * 12, (i + 1) * 12).contiguous(true)});
      }
      expect_bit_equal(got, vq::level_chunk_kv(*c.model, o.scheme.levels[0], slice_chunk(c.exact, i, 12)));
    }
  }
  auto caches = vq::make_caches("fp32", *c.model);
  vq::LoaderOptions bad = o;
  bad.level = "fp16";  // not one of the scheme's levels
  EXPECT_THROW(vq::load_prefix(store, *c.model, caches, c.tokens, bad), vq::InvalidArgument);
  EXPECT_THROW(vq::load_prefix(store, vq::ChunkShape{}, caches, c.tokens, o), vq::InvalidArgument);
  fs::remove_all(dir);
}

}  // namespace

// The fuzz_store_blob seeds (fuzz/corpus, written by vq_fuzz_make_corpus) are what the fuzzer needs
// to start inside the decoders: each valid_i decodes at level i of the target's identity, and at
// no other level; its cut and flipped copies do not decode.
TEST(PrefixChunks, TheBlobFuzzSeedsDecodeOnlyAsTheirOwnChunk) {
  const std::string dir = std::string(VQ_SOURCE_DIR) + "/fuzz/corpus/fuzz_store_blob/";
  for (std::size_t i = 0; i < vqfuzz::kBlobLevels.size(); ++i) {
    const std::string valid = vqtest::read_file(dir + "valid_" + std::to_string(i));
    const vq::Blob b(valid.begin(), valid.end());
    for (std::size_t j = 0; j < vqfuzz::kBlobLevels.size(); ++j) {
      const std::string level = vq::MethodSpec::parse(vqfuzz::kBlobLevels[j]).to_string();
      const auto decode = [&](const vq::Blob& x, std::uint64_t chain) {
        return vq::decode_chunk_codes(x, vqfuzz::kBlobModel, level, vqfuzz::kBlobIndex, chain, vqfuzz::kBlobTokens);
      };
      if (i == j) {
        EXPECT_NO_THROW(decode(b, vqfuzz::kBlobChain)) << level;
        EXPECT_THROW(decode(b, vqfuzz::kBlobChain ^ 1), vq::FormatError) << level;
      } else {
        EXPECT_THROW(decode(b, vqfuzz::kBlobChain), vq::FormatError) << level;
      }
    }
    for (const char* broken : {"truncated_", "flipped_"}) {
      const std::string t = vqtest::read_file(dir + broken + std::to_string(i));
      EXPECT_THROW(vq::decode_chunk_codes(vq::Blob(t.begin(), t.end()), vqfuzz::kBlobModel,
                                          vq::MethodSpec::parse(vqfuzz::kBlobLevels[i]).to_string(), vqfuzz::kBlobIndex,
                                          vqfuzz::kBlobChain, vqfuzz::kBlobTokens),
                   vq::FormatError)
          << broken << i;
    }
  }
}

