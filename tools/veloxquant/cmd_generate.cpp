// veloxquant generate: sample text from a llama2.c model through a chosen KV cache method, as run.c.
#include <chrono>
#include <cstdio>
#include <ctime>
#include <optional>
#include <string>

#include <fmt/core.h>

#include "commands.hpp"
#include "model_options.hpp"
#include "numeric_options.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/generate.hpp"
#include "veloxquant/model/method_spec.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"

namespace vqcli {

namespace {
struct GenerateOptions {
  std::string model, tokenizer, prompt, method = "fp32";
  int steps = 256;
  float temperature = 1.0f, topp = 0.9f;
  std::uint64_t seed = 0;
  bool stats = false;
};

int run_generate(const GenerateOptions& o) {
  auto opt = [](const std::string& s) { return s.empty() ? std::nullopt : std::optional<std::filesystem::path>(s); };
  const vq::ModelFiles files = vq::resolve_model_files(opt(o.model), opt(o.tokenizer));
  vq::Transformer model(vq::Checkpoint::load(files.model.string()));
  const vq::Tokenizer tok = vq::Tokenizer::load(files.tokenizer.string(), model.config().vocab_size);
  auto caches = vq::make_caches(o.method, model);

  vq::GenerateConfig cfg;
  cfg.steps = o.steps;
  cfg.sampler.temperature = o.temperature;
  cfg.sampler.topp = o.topp;
  // As run.c: seed 0 means "seed from the clock".
  cfg.sampler.seed = o.seed != 0 ? o.seed : static_cast<std::uint64_t>(std::time(nullptr));
  const auto t0 = std::chrono::steady_clock::now();
  const vq::GenerateResult r = vq::generate(model, tok, caches, o.prompt, cfg, [](std::string_view piece) {
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  });
  std::fputc('\n', stdout);
  std::fflush(stdout);
  fmt::print(stderr, "kv cache: peak resident {} bytes ({}); fp16 would hold {} bytes for the same {} tokens ({:.2f}x of fp16)\n",
             r.peak_resident_bytes, vq::MethodSpec::parse(o.method).to_string(), r.fp16_bytes, r.kv_tokens,
             r.fp16_bytes > 0 ? static_cast<double>(r.peak_resident_bytes) / static_cast<double>(r.fp16_bytes) : 0.0);
  if (o.stats) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print(stderr, "{} tokens ({} prompt incl. BOS) in {:.3f} s: {:.0f} tokens/s, method {}\n", r.tokens.size(), r.prompt_tokens, s,
               s > 0 ? static_cast<double>(r.tokens.size()) / s : 0.0, vq::MethodSpec::parse(o.method).to_string());
  }
  return 0;
}
}  // namespace

Runner add_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  add_model_options(app, o->model, o->tokenizer);
  app.add_option("--prompt", o->prompt, "text to start from (after BOS)");
  app.add_option("--steps", o->steps, "positions to run including BOS, as run.c (clamped to seq_len)")
      ->capture_default_str()
      ->transform(integer_in(1, std::numeric_limits<int>::max()));
  app.add_option("--temperature", o->temperature, "0 = greedy argmax")->capture_default_str()->transform(finite_at_least(0.0));
  app.add_option("--topp", o->topp, "nucleus sampling mass; <= 0 or >= 1 samples the full distribution")
      ->capture_default_str()
      ->transform(any_finite());
  app.add_option("--seed", o->seed, "random seed for sampling (0 = from the clock, as run.c)")->capture_default_str()->transform(any_uint64());
  app.add_option("--method", o->method,
                 "KV cache: fp32, fp16, cachegen[:bits=N,group=G,flush=per_call|group_aligned,delta=0|1,schedule=on|off]")
      ->capture_default_str();
  app.add_flag("--stats", o->stats, "print tokens/s to stderr");
  return [o] { return run_generate(*o); };
}

}  // namespace vqcli
