// veloxquant eval: score KV cache methods against the exact fp32 cache on a real model.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>

#include <unistd.h>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "json_out.hpp"
#include "model_options.hpp"
#include "numeric_options.hpp"
#include "progress.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/eval/evaluator.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/methods/method_table.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"
#ifdef VQ_HAVE_PROMPT_CACHE
#include "veloxquant/serve/llama_engine.hpp"
#endif

namespace vqcli {

namespace {

// The method table's eval settings: the exact cache, fp16 and the reference's CacheGen.
std::string default_methods() {
  std::string out;
  for (const auto& m : vq::default_eval_methods()) out += (out.empty() ? "" : ";") + m;
  return out;
}

struct EvalCliOptions {
  std::string model, tokenizer, text, methods = default_methods(), protocol;
  EngineOptions eng;
  vq::EvalOptions eval;
  bool json = false;
};

void print_results(const EvalCliOptions& o, const std::string& model_name, const std::string& text_path,
                   const std::vector<vq::MethodResult>& results) {
  const auto n_failed = std::count_if(results.begin(), results.end(), [](const vq::MethodResult& r) { return !r.error.empty(); });
  if (n_failed > 0)
    fmt::print(stderr, "eval: warning: {} of {} methods failed; their rows say why, the others are scored as usual\n", n_failed, results.size());
  if (o.json) {
    nlohmann::json j{{"model", model_name}, {"protocol", o.protocol}, {"engine", o.eng.engine}, {"results", nlohmann::json::array()}};
    for (const auto& r : results)
      if (r.error.empty())
        j["results"].push_back({{"method", r.method}, {"tokens", r.tokens}, {"ppl", r.ppl}, {"delta_ppl_pct", r.delta_ppl_pct},
                                {"kl", r.kl}, {"top1", r.top1}, {"bits_per_element_fixed", r.bits_per_element_fixed},
                                {"bits_per_element_estimated", r.bits_per_element_estimated},
                                {"bits_per_element_coded", r.bits_per_element_coded},
                                {"resident_bits_per_element", r.resident_bits_per_element}});
      else
        j["results"].push_back({{"method", r.method}, {"tokens", 0}, {"ppl", nullptr}, {"delta_ppl_pct", nullptr}, {"kl", nullptr},
                                {"top1", nullptr}, {"bits_per_element_fixed", nullptr}, {"bits_per_element_estimated", nullptr},
                                {"bits_per_element_coded", nullptr}, {"resident_bits_per_element", nullptr}, {"error", r.error}});
    fmt::print("{}\n", json_text(j));
    return;
  }
  fmt::print("model {}  engine {}  protocol {}  window {}  ctx {}  chunk {}  text {}\n", model_name,
             o.eng.engine == "llama" ? "llama.cpp (llama-server)" : "veloxquant", o.protocol, o.eval.window, o.eval.ctx, o.eval.chunk, text_path);
  fmt::print("{:<44} {:>7} {:>9} {:>8} {:>10} {:>7} {:>10} {:>10} {:>10}\n", "method", "tokens", "ppl", "dPPL %", "KL", "top-1",
             "bits fixed", "bits est.", "bits res.");
  for (const auto& r : results)
    if (r.error.empty())
      fmt::print("{:<44} {:>7} {:>9.4f} {:>8.3f} {:>10.3e} {:>7.4f} {:>10.3f} {:>10.3f} {:>10.3f}\n", r.method, r.tokens, r.ppl,
                 r.delta_ppl_pct, r.kl, r.top1, r.bits_per_element_fixed, r.bits_per_element_estimated, r.resident_bits_per_element);
    else
      fmt::print("{:<44} failed: {}\n", r.method, r.error);
  fmt::print(
      "(dPPL, KL and top-1 against the exact fp32 cache on the same tokens; bits per element of K and V, metadata included; "
      "bits res.: the memory the caches hold, nbytes)\n");
}

// --engine llama: llama.cpp computes every logit (serve/llama_engine.hpp).
int run_eval_llama(EvalCliOptions& o, const std::vector<std::string>& methods) {
#ifdef VQ_HAVE_PROMPT_CACHE
  vq::require(!o.model.empty(), "--engine llama: give the GGUF file llama-server runs (--model X.gguf)");
  vq::require(o.eval.protocol == vq::EvalProtocol::Reuse,
              "--engine llama scores the reuse protocol only (a context compressed, restored into llama-server, the rest scored): give "
              "--protocol reuse");
  if (!std::filesystem::is_regular_file(o.model)) throw vq::IoError(fmt::format("{}: cannot open model (no such file)", o.model));
  if (o.text.empty()) o.text = beside_model(o.model, "tinystories_val.txt");
  const std::string text_path = text_path_or_default(o.text);
  const std::string text = read_text(text_path, o.eval.max_tokens > 0 ? static_cast<std::size_t>(o.eval.max_tokens) * 16 +
                                                                             static_cast<std::size_t>(o.eval.window) * 64
                                                                       : 0);
  o.eval.validate(o.eval.window);
  vq::LlamaEngine engine({.server = o.eng.llama_server, .model = o.model, .context = o.eval.window, .threads = o.eng.server_threads, .log = {}});
  const std::vector<int> tokens = engine.tokenize(text);
  Progress progress("eval (llama.cpp):", 1.0, 5.0);
  o.eval.progress = [&](double f) { progress(f); };
  const auto results = engine.evaluate(tokens, methods, o.eval);
  print_results(o, std::filesystem::path(o.model).filename().string(), text_path, results);
  return 0;
#else
  (void)o;
  (void)methods;
  no_llama_engine();
#endif
}
int run_synthetic(const EvalCliOptions& o, const std::string& why) {
  fmt::print(stderr, "veloxquant: no model: {}\n", why);
  fmt::print(stderr, "veloxquant: running the caches on synthetic LLM-like K/V instead (no quality numbers without a model)\n");
  const auto results = vq::evaluate_synthetic(vq::split_method_list(o.methods), 1024);
  if (o.json) {
    nlohmann::json j{{"model", "synthetic"}, {"protocol", "synthetic"}, {"results", nlohmann::json::array()}};
    for (const auto& r : results)
      j["results"].push_back({{"method", r.method}, {"tokens", 0}, {"ppl", nullptr}, {"delta_ppl_pct", nullptr}, {"kl", nullptr},
                              {"top1", nullptr}, {"bits_per_element_fixed", r.bits_per_element_fixed},
                              {"bits_per_element_estimated", r.bits_per_element_estimated},
                              {"resident_bits_per_element", r.resident_bits_per_element}, {"relative_mse", r.relative_mse}});
    fmt::print("{}\n", json_text(j));
    return 0;
  }
  fmt::print("SYNTHETIC K/V (4 layers x 8 heads x 1024 tokens x D=128), not a model\n");
  fmt::print("{:<44} {:>10} {:>10} {:>10} {:>12}\n", "method", "bits fixed", "bits est.", "bits res.", "rel. MSE");
  for (const auto& r : results)
    fmt::print("{:<44} {:>10.3f} {:>10.3f} {:>10.3f} {:>12.3e}\n", r.method, r.bits_per_element_fixed, r.bits_per_element_estimated,
               r.resident_bits_per_element, r.relative_mse);
  return 0;
}

int run_eval(EvalCliOptions o) {
  if (o.protocol.empty()) o.protocol = o.eng.engine == "llama" ? "reuse" : "stream";
  o.eval.protocol = vq::eval_protocol_from_name(o.protocol);
  o.eval.exact_prefill = prefill_is_exact(o.eng.prefill, o.eng.engine, o.eval.protocol);
  const auto methods = vq::split_method_list(o.methods);
  for (const auto& m : methods) (void)vq::MethodSpec::parse(m);  // a bad spec fails before any loading
  if (o.eng.engine == "llama") return run_eval_llama(o, methods);
  if (!o.model.empty() && !std::filesystem::is_regular_file(o.model))
    throw vq::IoError(fmt::format("{}: cannot open model (no such file)", o.model));
  // A tokenizer or text not given explicitly is looked for beside an explicit model first.
  if (o.tokenizer.empty()) o.tokenizer = beside_model(o.model, "tok512.bin");
  if (o.text.empty()) o.text = beside_model(o.model, "tinystories_val.txt");
  vq::ModelFiles files;
  try {
    files = vq::resolve_model_files(optional_path(o.model), optional_path(o.tokenizer));
  } catch (const vq::IoError& e) {
    if (!o.model.empty() || !o.tokenizer.empty()) throw;  // an explicit path that is wrong is an error
    return run_synthetic(o, e.what());
  }
  vq::LoadedModel loaded = vq::load_model(files);
  vq::Transformer model(std::move(loaded.checkpoint));
  const vq::Tokenizer tok = std::move(loaded.tokenizer);
  o.eval.validate(model.config().seq_len);
  // A profile of another model is the user's to fix: one line now, not a failed row per method.
  (void)vq::check_method_profiles(methods, model.checkpoint().file_fingerprint, files.model.string());

  const std::string text_path = text_path_or_default(o.text);
  // Tokenize only as much text as the run can score (2x margin), so a short run stays short.
  const std::string text = read_text(text_path, o.eval.max_tokens > 0 ? static_cast<std::size_t>(o.eval.max_tokens) * 16 +
                                                                             static_cast<std::size_t>(o.eval.window) * 64
                                                                       : 0);
  const std::vector<int> tokens = tok.encode(text, /*bos=*/false);

  Progress progress("eval:", 1.0, 5.0);
  o.eval.progress = [&](double f) { progress(f); };
  const auto results = vq::evaluate(model, tokens, methods, o.eval);

  print_results(o, files.model.filename().string(), text_path, results);
  return 0;
}

}  // namespace

Runner add_eval(CLI::App& app) {
  auto o = std::make_shared<EvalCliOptions>();
  add_model_options(app, o->model, o->tokenizer);
  app.add_option("--text", o->text, "text to score (default: tinystories_val.txt beside the model)");
  app.add_option("--methods", o->methods, "methods to score, e.g. 'fp16,cachegen:bits=4,group=32;cachegen:flush=per_call'")
      ->capture_default_str();
  app.add_option("--protocol", o->protocol, "stream or reuse (default: stream; reuse with --engine llama)");
  add_engine_options(app, o->eng);
  app.add_option("--ctx", o->eval.ctx, "stream: tokens prefilled per window; reuse: context tokens")
      ->capture_default_str()
      ->transform(integer_in(0, std::numeric_limits<int>::max()));
  app.add_option("--window", o->eval.window, "tokens per window, BOS included")->capture_default_str()->transform(integer_in(2, std::numeric_limits<int>::max()));
  app.add_option("--chunk", o->eval.chunk, "prefill chunk size")->capture_default_str()->transform(integer_in(1, std::numeric_limits<int>::max()));
  app.add_option("--max-tokens", o->eval.max_tokens, "tokens scored per method (0: the whole text)")->capture_default_str()->transform(integer_in(0, kMaxCount));
  app.add_flag("--json", o->json, "print JSON");
  return [o] { return run_eval(*o); };
}

}  // namespace vqcli
