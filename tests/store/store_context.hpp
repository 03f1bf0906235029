// The prefix-store tests' shared context: the real stories260K model, one prompt's tokens, the fp32
// caches' state after a prefill, and the model's fingerprint.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <memory>
#include <span>
#include <vector>

#include "../model/model_support.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/store/file_store.hpp"
#include "veloxquant/store/prefix_chunks.hpp"

namespace vqtest {

struct StoreContext {
  std::unique_ptr<vq::Transformer> model;
  std::vector<int> tokens;
  std::vector<vq::KVState> exact;  // the fp32 caches' state after one prefill of the prefilled tokens
  std::uint64_t fp = 0;
};

// chunk == 0: all the prompt's tokens, all prefilled. chunk > 0: the tokens cut to whole chunks plus
// one (the token a host prefills itself), all but that last one prefilled.
inline StoreContext make_store_context(int chunk) {
  StoreContext c;
  c.model = std::make_unique<vq::Transformer>(vq::Checkpoint::load(model_path()));
  const auto tok = vq::Tokenizer::load(tokenizer_path(), c.model->config().vocab_size);
  c.tokens = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
                        "friends. One day, she saw a big red ball under a tree and ran to get it.",
                        true);
  std::span<const int> prefill(c.tokens);
  if (chunk > 0) {
    c.tokens.resize(c.tokens.size() / static_cast<std::size_t>(chunk) * static_cast<std::size_t>(chunk) + 1);
    prefill = std::span<const int>(c.tokens).first(c.tokens.size() - 1);
  }
  auto caches = vq::make_caches("fp32", *c.model);
  c.model->forward(prefill, caches);
  for (const auto& k : caches) c.exact.push_back(k->state());
  c.fp = vq::model_fingerprint(*c.model);
  return c;
}

// A fresh temporary folder (missing until used), removed at the end.
struct ScratchDir {
  std::filesystem::path path;
  explicit ScratchDir(const char* tag = "scratch") {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() / ("vq-" + std::string(tag) + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  ~ScratchDir() { std::filesystem::remove_all(path); }
};

// A fresh file store (a temporary folder, removed at the end) holding c's prefilled tokens in chunks
// of chunk_tokens at exactly `levels` (no fp32 added: a loader then has one choice per chunk).
struct StoredContext {
  std::filesystem::path dir;
  std::unique_ptr<vq::FileStore> store;
  vq::ChunkScheme scheme;
  StoredContext(const StoreContext& c, int chunk_tokens, const std::vector<std::string>& levels, const char* tag) {
    static int counter = 0;
    dir = std::filesystem::temp_directory_path() / ("vq-" + std::string(tag) + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(dir);
    store = std::make_unique<vq::FileStore>(dir);
    scheme.model_fingerprint = c.fp;
    scheme.chunk_tokens = chunk_tokens;
    for (const auto& l : levels) scheme.levels.push_back(vq::MethodSpec::parse(l).to_string());
    vq::put_context(*store, *c.model, scheme, std::span<const int>(c.tokens).first(c.tokens.size() - 1), c.exact);
  }
  StoredContext(const StoredContext&) = delete;
  StoredContext& operator=(const StoredContext&) = delete;
  ~StoredContext() { std::filesystem::remove_all(dir); }
};

}  // namespace vqtest
