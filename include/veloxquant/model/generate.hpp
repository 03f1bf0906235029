// Text generation as llama2.c run.c does it: start from BOS (then the prompt), prefill the prompt
// in one chunk, decode one token at a time, stop at BOS or EOS or after `steps` positions.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"

namespace vq {

// run.c's sampler: argmax at temperature 0; otherwise softmax(logits / temperature) then top-p
// (nucleus) sampling when 0 < topp < 1, else plain multinomial; coins from run.c's xorshift RNG.
struct SamplerConfig {
  float temperature = 1.0f;   // 0 = greedy
  float topp = 0.9f;          // nucleus mass; <= 0 or >= 1 disables top-p; must be finite
  std::uint64_t seed = 1;     // run.c's rng_state; must be nonzero for sampling
};

class Sampler {
 public:
  Sampler(int vocab_size, SamplerConfig config);
  // The next token for one row of logits (modified in place when sampling).
  int sample(std::span<float> logits);

 private:
  float random_f32();
  int vocab_size_;
  SamplerConfig config_;
  std::uint64_t state_;
  std::vector<std::pair<float, int>> probindex_;
};

struct GenerateConfig {
  int steps = 256;            // positions including BOS, as run.c counts; clamped to seq_len; >= 1
  SamplerConfig sampler{0.0f, 0.9f, 1};
  // Optional: fills the (empty) caches with the K/V of a prefix of the prompt's tokens (BOS first),
  // e.g. from a prefix store (store/prefix_loader.hpp), and returns how many tokens it filled, fewer
  // than the prompt's; generation then prefills only the rest.
  std::function<int(std::span<const int>, std::vector<std::shared_ptr<KVCache>>&)> fill_prefix;
};

struct GenerateResult {
  std::vector<int> tokens;  // BOS, the prompt, then every generated token (without a final BOS/EOS)
  std::string text;         // the printed pieces, concatenated
  int prompt_tokens = 0;    // including BOS
  double ttft_ms = 0;       // from the start of generate to the first sampled token (fill_prefix included)
  // Memory of the KV caches: the most bytes they held together after any forward call (the sum of
  // KVCache::nbytes over layers), and what a float16 cache would hold for the most tokens they
  // held (B * H * tokens * (D_k + D_v) * 2 bytes per layer, no spare capacity).
  std::size_t peak_resident_bytes = 0;
  std::size_t fp16_bytes = 0;
  std::int64_t kv_tokens = 0;  // the most tokens the caches held
};

// Generate from `prompt` (may be empty). `on_piece` (optional) receives each decoded piece as it is
// produced, for streaming. The caches must be empty; one per layer.
GenerateResult generate(Transformer& model, const Tokenizer& tokenizer, std::vector<std::shared_ptr<KVCache>>& caches,
                        std::string_view prompt, const GenerateConfig& config,
                        const std::function<void(std::string_view)>& on_piece = {});

// run.c's safe_printf filter: drop a piece that is a single byte which is neither printable ASCII
// nor whitespace (a stray control byte), except that bytes >= 0x80 are kept so UTF-8 that the
// model spells out in byte-fallback tokens reassembles in the output.
bool printable_piece(std::string_view piece);

}  // namespace vq
