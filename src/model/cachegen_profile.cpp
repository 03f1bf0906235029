#include "veloxquant/model/cachegen_profile.hpp"

#include <algorithm>
#include <bit>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>

#include <fmt/format.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/core/input_file.hpp"
#include "veloxquant/model/generate.hpp"
#include "veloxquant/model/transformer.hpp"

namespace vq {

namespace {

constexpr int kBos = 1;

// FNV-1a over the model's shape and the start of its K/V projections: enough to tell two models
// in one process apart without hashing every weight of a large model on each lookup.
std::uint64_t model_fingerprint(const Transformer& model) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  };
  const ModelConfig& c = model.config();
  for (int v : {c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.seq_len}) mix(static_cast<std::uint64_t>(v));
  for (const auto* w : {&model.checkpoint().wk, &model.checkpoint().wv})
    for (std::size_t i = 0; i < std::min<std::size_t>(w->size(), 1 << 16); ++i) mix(std::bit_cast<std::uint32_t>((*w)[i]));
  return h;
}

}  // namespace

CachegenPaperProfile profile_cachegen_paper(Transformer& model, const std::vector<std::vector<int>>& sequences,
                                            const CachegenPaperConfig& config) {
  require(!sequences.empty(), "cachegen_paper profile: no sequences to profile");
  const int n_layers = model.config().n_layers;
  CachegenPaperProfiler profiler(config, n_layers);
  for (const auto& seq : sequences) {
    require(!seq.empty() && static_cast<int>(seq.size()) <= model.config().seq_len,
            "cachegen_paper profile: a sequence of {} tokens does not fit the model's seq_len {}", seq.size(), model.config().seq_len);
    auto caches = make_fp32_caches(model);
    model.forward(seq, caches);
    for (int l = 0; l < n_layers; ++l) {
      const KVState s = caches[static_cast<std::size_t>(l)]->state();
      profiler.add(l, s.keys, s.values);
    }
  }
  return profiler.finish();
}

std::vector<std::vector<int>> profile_windows(const std::vector<int>& tokens, int window, std::int64_t skip, std::int64_t max_tokens) {
  require(window >= 2, "profile: the window must be >= 2 tokens, got {}", window);
  require(skip >= 0 && max_tokens >= 0, "profile: skip and max_tokens must be >= 0");
  std::vector<std::vector<int>> out;
  const auto n = static_cast<std::int64_t>(tokens.size());
  std::int64_t used = 0;
  for (std::int64_t start = skip; start < n && (max_tokens == 0 || used < max_tokens);) {
    std::int64_t len = std::min<std::int64_t>(window - 1, n - start);
    if (max_tokens > 0) len = std::min(len, max_tokens - used);
    std::vector<int> seq{kBos};
    seq.insert(seq.end(), tokens.begin() + start, tokens.begin() + start + len);
    out.push_back(std::move(seq));
    start += len;
    used += len;
  }
  return out;
}

std::vector<std::vector<int>> sample_sequences(Transformer& model, std::int64_t n_tokens, int window, std::uint64_t seed) {
  require(n_tokens >= 1, "sample_sequences: n_tokens must be >= 1");
  const int W = std::min(window, model.config().seq_len);
  require(W >= 1, "sample_sequences: the window must be >= 1");
  Sampler sampler(model.config().vocab_size, SamplerConfig{1.0f, 0.9f, seed});
  std::vector<std::vector<int>> out;
  for (std::int64_t total = 0; total < n_tokens;) {
    const auto len = static_cast<int>(std::min<std::int64_t>(W, n_tokens - total));
    auto caches = make_fp32_caches(model);
    std::vector<int> seq;
    int tok = kBos;
    for (int p = 0; p < len; ++p) {
      seq.push_back(tok);
      if (p + 1 == len) break;
      auto logits = model.forward(std::span<const int>(&tok, 1), caches);
      tok = sampler.sample(logits);
    }
    total += len;
    out.push_back(std::move(seq));
  }
  return out;
}

std::shared_ptr<const CachegenPaperProfile> cachegen_paper_profile_for(const CachegenPaperConfig& config, const Transformer* model,
                                                                       int n_layers) {
  config.validate();
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const CachegenPaperProfile>> memo;
  const std::lock_guard<std::mutex> lock(mu);
  std::string key;
  if (!config.profile.empty()) {
    const auto size = InputFile(config.profile, "cachegen_paper profile").size();  // a missing file, a FIFO, a directory: said so
    std::error_code ec;
    const auto mtime = std::filesystem::last_write_time(config.profile, ec).time_since_epoch().count();
    key = fmt::format("file\n{}\n{}\n{}", config.profile, size, mtime);
  } else {
    require(model != nullptr,
            "cachegen_paper: without a model to profile, give profile=PATH (a file written by `veloxquant profile`)");
    key = fmt::format("self\n{:x}\n{}\n{}/{}/{}\n{}", model_fingerprint(*model), config.group, config.bins[0], config.bins[1],
                      config.bins[2], config.profile_tokens);
  }
  auto it = memo.find(key);
  if (it == memo.end()) {
    std::shared_ptr<const CachegenPaperProfile> p;
    if (!config.profile.empty()) {
      p = std::make_shared<const CachegenPaperProfile>(CachegenPaperProfile::load(config.profile));
    } else {
      // forward() needs a mutable model; make_caches holds a const one, so profile a copy.
      Transformer copy(model->checkpoint());
      const int window = std::min(256, copy.config().seq_len);
      p = std::make_shared<const CachegenPaperProfile>(
          profile_cachegen_paper(copy, sample_sequences(copy, config.profile_tokens, window, 1), config));
    }
    it = memo.emplace(key, std::move(p)).first;
  }
  it->second->check_matches(config, n_layers);
  return it->second;
}

}  // namespace vq
