// veloxquant calibrate: fit a vq profile (vq/profile.hpp) on a model's own K/V over calibration
// text, through llama.cpp (a GGUF: llama-server computes the K/V) or our engine (a model we load),
// for `vq:...,profile=PATH`.
#include <cstdio>
#include <filesystem>

#include <fmt/core.h>

#include "commands.hpp"
#include "model_options.hpp"
#include "numeric_options.hpp"
#include "progress.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/gguf.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"
#include "veloxquant/vq/profile.hpp"
#ifdef VQ_HAVE_PROMPT_CACHE
#include "veloxquant/serve/llama_engine.hpp"
#endif

namespace vqcli {

namespace {

struct CalibrateOptions {
  std::string model, tokenizer, text, out, engine, llama_server;
  std::int64_t tokens = 8192, skip = 0;
  int window = 256, server_threads = 2;
};

// Windows of `window` tokens (BOS first, then window - 1 text tokens) from tokens[skip..], covering
// at least `want` tokens when the text holds them.
std::vector<std::vector<int>> windows_of(const std::vector<int>& tokens, int bos, int window, std::int64_t skip, std::int64_t want,
                                         const std::string& text_path) {
  const std::size_t per = static_cast<std::size_t>(window - 1);
  std::vector<std::vector<int>> out;
  for (std::size_t at = static_cast<std::size_t>(skip); at + per <= tokens.size() && static_cast<std::int64_t>(out.size() * per) < want; at += per) {
    std::vector<int> w{bos};
    w.insert(w.end(), tokens.begin() + static_cast<std::ptrdiff_t>(at), tokens.begin() + static_cast<std::ptrdiff_t>(at + per));
    out.push_back(std::move(w));
  }
  vq::require(!out.empty(), "{} holds {} tokens: none left for a window of {} after --skip {}", text_path, tokens.size(), window, skip);
  if (static_cast<std::int64_t>(out.size() * per) < want)
    fmt::print(stderr, "calibrate: warning: the text holds only {} windows of {} tokens after --skip {}; fitting on {} tokens instead of {}\n",
               out.size(), window, skip, out.size() * per, want);
  return out;
}

int run_calibrate(CalibrateOptions o) {
  if (!o.model.empty() && !std::filesystem::is_regular_file(o.model))
    throw vq::IoError(fmt::format("{}: cannot open model (no such file)", o.model));
  const bool gguf = !o.model.empty() && vq::is_gguf_file(o.model);
  if (o.engine.empty()) o.engine = gguf ? "llama" : "ours";
  vq::require(o.engine == "ours" || o.engine == "llama", "--engine {}: give ours or llama", o.engine);
  vq::require(o.engine == "ours" || gguf, "--engine llama: give the GGUF file llama-server runs (--model X.gguf)");
  vq::require(o.window >= 2, "--window must be >= 2, got {}", o.window);
  if (o.tokenizer.empty()) o.tokenizer = beside_model(o.model, "tok512.bin");
  if (o.text.empty()) o.text = beside_model(o.model, "tinystories_val.txt");
  const std::string text_path = text_path_or_default(o.text);
  // Text enough for skip + tokens (about 4 bytes per token here; 16 is a wide margin).
  const std::string text = read_text(text_path, static_cast<std::size_t>(o.skip + o.tokens) * 16 + static_cast<std::size_t>(o.window) * 64);

  std::unique_ptr<vq::VqProfileBuilder> builder;
  std::uint64_t fingerprint = 0;
  std::string model_path;
  std::size_t n_windows = 0;
  Progress progress("calibrate:", 1.0, 5.0);
  if (o.engine == "llama") {
#ifdef VQ_HAVE_PROMPT_CACHE
    model_path = o.model;
    // A prompt must be shorter than the server's context: one position more than a window.
    vq::LlamaEngine engine({.server = o.llama_server, .model = o.model, .context = o.window + 1, .threads = o.server_threads, .log = {}});
    const vq::GgufShape& g = engine.gguf_shape();
    // llama.cpp's llama architecture rotates adjacent pairs, as vq undoes them; other
    // architectures (NeoX-style halves) are profiled on their keys as held.
    const bool rope = g.architecture == "llama" && g.key_length % 2 == 0;
    if (!rope)
      fmt::print(stderr, "calibrate: {} is a '{}' model: its keys are profiled as llama.cpp holds them (RoPE not undone)\n", o.model,
                 g.architecture);
    fingerprint = g.fingerprint;
    const auto windows = windows_of(engine.tokenize(text), engine.bos(), o.window, o.skip, o.tokens, text_path);
    builder = std::make_unique<vq::VqProfileBuilder>(g.n_layers, g.n_kv_heads, g.key_length, rope, g.rope_freq_base);
    for (const auto& w : windows) {
      const vq::LlamaState st = engine.context_state(w);
      for (std::size_t l = 0; l < st.layers.size(); ++l) builder->add(static_cast<int>(l), st.layers[l].keys, st.layers[l].values);
      progress(static_cast<double>(++n_windows) / static_cast<double>(windows.size()));
    }
#else
    no_llama_engine();
#endif
  } else {
    const vq::ModelFiles files = vq::resolve_model_files(optional_path(o.model), optional_path(o.tokenizer));
    model_path = files.model.string();
    vq::LoadedModel loaded = vq::load_model(files);
    vq::Transformer model(std::move(loaded.checkpoint));
    const vq::ModelConfig& c = model.config();
    vq::require(o.window <= c.seq_len, "--window must be in 2..{} (the model's seq_len), got {}", c.seq_len, o.window);
    fingerprint = vq::model_file_fingerprint(model_path);
    const auto windows = windows_of(loaded.tokenizer.encode(text, /*bos=*/false), 1, o.window, o.skip, o.tokens, text_path);
    builder = std::make_unique<vq::VqProfileBuilder>(c.n_layers, c.n_kv_heads, c.head_size(), c.head_size() % 2 == 0, 10000.0);
    for (const auto& w : windows) {
      auto caches = vq::make_caches("fp32", model);
      (void)model.forward(w, caches, static_cast<int>(w.size()));  // no logits kept
      for (std::size_t l = 0; l < caches.size(); ++l) {
        const vq::KVState kv = caches[l]->state();
        builder->add(static_cast<int>(l), kv.keys, kv.values);
      }
      progress(static_cast<double>(++n_windows) / static_cast<double>(windows.size()));
    }
  }
  vq::VqProfile profile = builder->finish(fingerprint);
  if (o.out.empty()) o.out = std::filesystem::path(model_path).stem().string() + ".vqprof";
  vq::save_vq_profile(o.out, profile);
  fmt::print("wrote {}: {} layers x {} KV heads x {}, keys {}, fitted on {} tokens per layer ({} windows of {}, engine {}) of {}; model "
             "fingerprint {:016x} ({}); use it as vq:bits=2,profile={}\n",
             o.out, profile.layers, profile.kv_heads, profile.head_dim,
             profile.rope ? fmt::format("with RoPE undone (theta {})", profile.rope_theta) : std::string("as held"), profile.tokens, n_windows,
             o.window, o.engine == "llama" ? "llama.cpp" : "ours", text_path, profile.model_fingerprint,
             std::filesystem::path(model_path).filename().string(), o.out);
  return 0;
}

}  // namespace

Runner add_calibrate(CLI::App& app) {
  auto o = std::make_shared<CalibrateOptions>();
  add_model_options(app, o->model, o->tokenizer);
  app.add_option("--text", o->text, "calibration text (default: tinystories_val.txt beside the model)");
  app.add_option("-o,--out", o->out, "the profile file to write (default: the model's name with .vqprof, here)");
  app.add_option("--engine", o->engine,
                 "who computes the K/V: llama (a llama-server started on 127.0.0.1 running --model X.gguf; the default for a GGUF) or "
                 "ours (a model our engine loads; the default otherwise)");
  app.add_option("--tokens", o->tokens, "calibration tokens (whole windows; fewer when the text holds fewer)")
      ->capture_default_str()
      ->transform(integer_in(2, kMaxCount));
  app.add_option("--skip", o->skip, "text tokens skipped first (so the text you evaluate on stays unseen)")
      ->capture_default_str()
      ->transform(integer_in(0, kMaxCount));
  app.add_option("--window", o->window, "tokens per window, BOS included")->capture_default_str()->transform(integer_in(2, 1 << 20));
  app.add_option("--llama-server", o->llama_server, "--engine llama: the llama-server binary (default .llama/bin/llama-server, else on PATH)");
  app.add_option("--server-threads", o->server_threads, "--engine llama: llama-server's -t")->capture_default_str()->transform(integer_in(1, 1024));
  return [o] { return run_calibrate(*o); };
}

}  // namespace vqcli
