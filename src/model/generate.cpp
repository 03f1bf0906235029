// run.c's generation loop and sampler.
#include "veloxquant/model/generate.hpp"

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cmath>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"

namespace vq {

Sampler::Sampler(int vocab_size, SamplerConfig config)
    : vocab_size_(vocab_size), config_(config), state_(config.seed), probindex_(static_cast<std::size_t>(vocab_size)) {
  require(vocab_size >= 1, "sampler needs a vocabulary of at least one token");
  require(std::isfinite(config.temperature) && config.temperature >= 0.0f,
          "temperature must be a finite number >= 0, got {}", config.temperature);
  require(config.temperature == 0.0f || config.seed != 0, "sampling needs a nonzero seed");
  // NaN fails every comparison, so it would neither disable top-p nor cut anything (only <unk>).
  require(std::isfinite(config.topp), "topp must be a finite number, got {}", config.topp);
}

// run.c's random_u32 (xorshift*) and random_f32.
float Sampler::random_f32() {
  state_ ^= state_ >> 12;
  state_ ^= state_ << 25;
  state_ ^= state_ >> 27;
  const auto u = static_cast<std::uint32_t>((state_ * 0x2545F4914F6CDD1Dull) >> 32);
  return static_cast<float>(u >> 8) / 16777216.0f;
}

int Sampler::sample(std::span<float> logits) {
  require(logits.size() == static_cast<std::size_t>(vocab_size_), "sampler got logits of the wrong size");
  const int n = vocab_size_;
  if (config_.temperature == 0.0f) {
    int best = 0;  // first maximum, as run.c's argmax
    for (int i = 1; i < n; ++i)
      if (logits[static_cast<std::size_t>(i)] > logits[static_cast<std::size_t>(best)]) best = i;
    return best;
  }
  for (float& l : logits) l /= config_.temperature;
  float max_val = logits[0];
  for (float l : logits) max_val = std::max(max_val, l);
  float sum = 0.0f;
  for (float& l : logits) {
    l = std::exp(l - max_val);
    sum += l;
  }
  for (float& l : logits) l /= sum;
  const float coin = random_f32();
  const float topp = config_.topp;
  if (topp <= 0.0f || topp >= 1.0f) {
    float cdf = 0.0f;
    for (int i = 0; i < n; ++i) {
      cdf += logits[static_cast<std::size_t>(i)];
      if (coin < cdf) return i;
    }
    return n - 1;
  }
  // Top-p: candidates with probability >= (1 - topp) / (n - 1), sorted descending, truncated where
  // the cumulative mass first exceeds topp.
  const float cutoff = (1.0f - topp) / static_cast<float>(std::max(n - 1, 1));
  std::size_t n0 = 0;
  for (int i = 0; i < n; ++i)
    if (logits[static_cast<std::size_t>(i)] >= cutoff) probindex_[n0++] = {logits[static_cast<std::size_t>(i)], i};
  std::sort(probindex_.begin(), probindex_.begin() + static_cast<std::ptrdiff_t>(n0),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  float cumulative = 0.0f;
  std::size_t last = n0 == 0 ? 0 : n0 - 1;
  for (std::size_t i = 0; i < n0; ++i) {
    cumulative += probindex_[i].first;
    if (cumulative > topp) {
      last = i;
      break;
    }
  }
  if (n0 == 0) return 0;
  const float r = coin * cumulative;
  float cdf = 0.0f;
  for (std::size_t i = 0; i <= last; ++i) {
    cdf += probindex_[i].first;
    if (r < cdf) return probindex_[i].second;
  }
  return probindex_[last].second;
}

bool printable_piece(std::string_view piece) {
  if (piece.empty()) return false;
  if (piece.size() == 1) {
    const auto b = static_cast<unsigned char>(piece[0]);
    if (b < 0x80 && !(std::isprint(b) || std::isspace(b))) return false;
  }
  return true;
}

GenerateResult generate(Transformer& model, const Tokenizer& tokenizer, std::vector<std::shared_ptr<KVCache>>& caches,
                        std::string_view prompt, const GenerateConfig& config, const std::function<void(std::string_view)>& on_piece) {
  const auto start = std::chrono::steady_clock::now();
  const ModelConfig& mc = model.config();
  require(config.steps >= 1, "steps must be >= 1, got {}", config.steps);
  require(tokenizer.vocab_size() == mc.vocab_size, "the tokenizer has {} tokens but the model's vocabulary has {}",
                                                               tokenizer.vocab_size(), mc.vocab_size);
  for (const auto& c : caches) require(c && c->offset() == 0, "generate needs empty caches");
  const int steps = std::min(config.steps, mc.seq_len);

  GenerateResult r;
  r.tokens = tokenizer.encode(prompt, /*bos=*/true, /*eos=*/false);
  require(static_cast<int>(r.tokens.size()) <= steps,
          "the prompt is {} tokens (with BOS) but only {} steps are allowed: raise --steps (at most seq_len {})",
                      r.tokens.size(), steps, mc.seq_len);
  r.prompt_tokens = static_cast<int>(r.tokens.size());
  Sampler sampler(mc.vocab_size, config.sampler);
  auto emit = [&](int prev, int next) {
    const std::string piece = tokenizer.decode(prev, next);
    if (!printable_piece(piece)) return;
    r.text += piece;
    if (on_piece) on_piece(piece);
  };
  // The prompt prints as run.c prints it: each forced token as it is "predicted".
  for (std::size_t i = 1; i < r.tokens.size(); ++i) emit(r.tokens[i - 1], r.tokens[i]);

  // After each forward call: the caches' resident bytes (peak) and fp16's for the same tokens.
  auto measure = [&] {
    std::size_t resident = 0, fp16 = 0;
    for (const auto& c : caches) {
      resident += c->nbytes();
      fp16 += static_cast<std::size_t>(c->batch() * c->kv_heads() * c->offset() * (c->key_dim() + c->value_dim())) * 2;
    }
    r.peak_resident_bytes = std::max(r.peak_resident_bytes, resident);
    if (!caches.empty() && caches[0]->offset() >= r.kv_tokens) {
      r.kv_tokens = caches[0]->offset();
      r.fp16_bytes = fp16;
    }
  };
  // A prefix may come from elsewhere (a prefix store); prefill the remaining prompt positions at
  // once; the last row of logits predicts the first new token.
  const std::size_t filled = config.fill_prefix ? static_cast<std::size_t>(config.fill_prefix(r.tokens, caches)) : 0;
  require(filled < r.tokens.size(), "fill_prefix filled {} of the prompt's {} tokens; it must leave at least one", filled, r.tokens.size());
  std::vector<float> logits = model.forward(std::span<const int>(r.tokens).subspan(filled), caches);
  measure();
  int pos = r.prompt_tokens;  // positions run so far (run.c's pos after this many forwards)
  const auto V = static_cast<std::size_t>(mc.vocab_size);
  std::span<float> last(logits.data() + (static_cast<std::size_t>(pos) - filled - 1) * V, V);
  bool first = true;
  while (true) {
    const int next = sampler.sample(last);
    if (first) r.ttft_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    first = false;
    if (next == Tokenizer::kBos || next == Tokenizer::kEos) break;
    emit(r.tokens.back(), next);
    r.tokens.push_back(next);
    if (pos >= steps) break;
    const int tok[1] = {next};
    logits = model.forward(tok, caches);
    measure();
    ++pos;
    last = std::span<float>(logits.data(), V);
  }
  return r;
}

}  // namespace vq
