// veloxquant rd: the rate-distortion table. Every method at its usual settings, scored on the same
// windows against the exact fp32 cache; bits per element are the actual coded sizes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
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
#include "rd_report.hpp"
#include "veloxquant/core/atomic_file.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/eval/evaluator.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"
#ifdef VQ_HAVE_PROMPT_CACHE
#include "veloxquant/serve/llama_engine.hpp"
#endif

namespace vqcli {

namespace {

struct RdOptions {
  std::string model, tokenizer, text, methods, protocol = "reuse", plot;
  int ctx = 256, window = 512, chunk = 64, windows = 40, threads = 0;
  EngineOptions eng;
  bool json = false;
};

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

int run_rd(RdOptions o) {
  vq::EvalOptions eval;
  eval.protocol = vq::eval_protocol_from_name(o.protocol);
  eval.exact_prefill = prefill_is_exact(o.eng.prefill, o.eng.engine, eval.protocol);
  eval.ctx = o.ctx;
  eval.window = o.window;
  eval.chunk = o.chunk;
  eval.threads = o.threads;
  const std::vector<std::string> items =
      o.methods.empty() ? rd::default_families() : vq::split_method_list(o.methods);
  const std::vector<std::string> methods = rd::expand_methods(items, eval.protocol == vq::EvalProtocol::Stream);
  for (const auto& m : methods) {
    try {
      (void)vq::MethodSpec::parse(m);  // a bad spec fails before any loading
    } catch (const vq::InvalidArgument& e) {
      if (m.find(':') != std::string::npos) throw;
      throw vq::InvalidArgument(fmt::format("{} (or a family: {})", e.what(), join(rd::default_families(), ", ")));
    }
  }
  if (!o.plot.empty()) {
    const auto dir = std::filesystem::path(o.plot).parent_path();
    if (!dir.empty() && !std::filesystem::is_directory(dir))
      throw vq::IoError(fmt::format("{}: cannot write the plot (no such directory {})", o.plot, dir.string()));
  }
  if (!o.model.empty() && !std::filesystem::is_regular_file(o.model))
    throw vq::IoError(fmt::format("{}: cannot open model (no such file)", o.model));
  vq::require(o.eng.engine == "ours" || !o.model.empty(), "--engine llama: give the GGUF file llama-server runs (--model X.gguf)");
  // As `eval`: a tokenizer or text not given is looked for beside an explicit model first.
  if (o.tokenizer.empty()) o.tokenizer = beside_model(o.model, "tok512.bin");
  if (o.text.empty()) o.text = beside_model(o.model, "tinystories_val.txt");
  const std::string text_path = text_path_or_default(o.text);
  // Tokenize only what the windows need (with a wide margin, at a paragraph boundary).
  const std::string text = read_text(text_path, static_cast<std::size_t>(o.windows) * static_cast<std::size_t>(eval.window) * 16);
  // The options checked against the engine's context, then the tokens the windows score.
  const auto settle = [&](int seq_len) {
    eval.validate(seq_len);
    const std::int64_t scored = eval.protocol == vq::EvalProtocol::Stream ? eval.window - 1 : eval.window - eval.ctx;
    eval.max_tokens = scored * o.windows;
  };
  // The windows the text holds (a warning when fewer than asked).
  const auto windows_of = [&](std::size_t n_tokens) {
    const std::int64_t available = static_cast<std::int64_t>(n_tokens) / (eval.window - 1);
    vq::require(available >= 1, "{}: the text holds {} tokens, fewer than one window of {}", text_path, n_tokens, eval.window);
    const std::int64_t n = std::min<std::int64_t>(available, o.windows);
    if (n < o.windows)
      fmt::print(stderr, "rd: warning: the text holds only {} windows of {} tokens; scoring {} instead of {}\n", available, eval.window, n,
                 o.windows);
    return n;
  };

  std::vector<rd::Point> points;
  std::vector<vq::MethodResult> results;
  std::string model_name;
  std::int64_t n_windows = 0;
  double seconds = 0;
  if (o.eng.engine == "llama") {
#ifdef VQ_HAVE_PROMPT_CACHE
    settle(eval.window);
    vq::LlamaEngine engine({.server = o.eng.llama_server, .model = o.model, .context = eval.window, .threads = o.eng.server_threads, .log = {}});
    const std::vector<int> tokens = engine.tokenize(text);
    n_windows = windows_of(tokens.size());
    Progress progress(fmt::format("rd (llama.cpp): {} settings x {} windows", methods.size(), n_windows), 2.0, 10.0);
    eval.progress = [&](double f) { progress(f); };
    results = engine.evaluate(tokens, methods, eval);
    seconds = progress.elapsed();
    model_name = std::filesystem::path(o.model).filename().string() + " (llama.cpp)";
#else
    no_llama_engine();
#endif
  } else {
    const vq::ModelFiles files = vq::resolve_model_files(optional_path(o.model), optional_path(o.tokenizer));
    vq::LoadedModel loaded = vq::load_model(files);
    vq::Transformer model(std::move(loaded.checkpoint));
    const vq::Tokenizer tok = std::move(loaded.tokenizer);
    settle(model.config().seq_len);
    (void)vq::check_method_profiles(methods, model.checkpoint().file_fingerprint, files.model.string());  // one line now, not failed rows
    const std::vector<int> tokens = tok.encode(text, /*bos=*/false);
    n_windows = windows_of(tokens.size());
    Progress progress(fmt::format("rd: {} settings x {} windows", methods.size(), n_windows), 2.0, 10.0);
    eval.progress = [&](double f) { progress(f); };
    results = vq::evaluate(model, tokens, methods, eval);
    seconds = progress.elapsed();
    model_name = files.model.filename().string();
  }
  for (const auto& r : results)
    points.push_back({.method = r.method, .bits = r.bits_per_element_coded, .resident_bits = r.resident_bits_per_element,
                      .delta_ppl_pct = r.delta_ppl_pct, .kl = r.kl, .top1 = r.top1, .pareto = false, .error = r.error});
  // reuse measures what a context costs to store or send (coded bits); stream what a live cache
  // holds while it decodes (resident bits).
  const rd::Rate rate = eval.protocol == vq::EvalProtocol::Stream ? rd::Rate::Resident : rd::Rate::Coded;
  rd::mark_pareto(points, rate);
  std::stable_sort(points.begin(), points.end(), [rate](const rd::Point& a, const rd::Point& b) {
    if (a.error.empty() != b.error.empty()) return a.error.empty();  // failed settings last
    const double ra = rd::rate_of(a, rate), rb = rd::rate_of(b, rate);
    return ra != rb ? ra < rb : a.kl < b.kl;
  });
  fmt::print(stderr, "rd: {} settings scored on {} windows in {:.0f}s\n", methods.size(), n_windows, seconds);
  const auto n_failed = std::count_if(points.begin(), points.end(), [](const rd::Point& p) { return !p.error.empty(); });
  if (n_failed > 0)
    fmt::print(stderr, "rd: warning: {} of {} settings failed; their rows say why, the others are scored as usual\n", n_failed, points.size());

  if (!o.plot.empty()) {
    const std::string title = fmt::format("{}: KL vs {} per element ({}, ctx {}, window {}, {} windows)", model_name,
                                          rate == rd::Rate::Coded ? "bits" : "resident bits", o.protocol, eval.ctx, eval.window, n_windows);
    vq::write_file_atomically(o.plot, rd::plot_svg(points, title, rate));
  }
  if (o.json) {
    nlohmann::json j{{"model", model_name}, {"protocol", o.protocol}, {"results", nlohmann::json::array()}};
    for (const auto& p : points)
      j["results"].push_back(p.error.empty() ? nlohmann::json{{"method", p.method}, {"bits_per_element", p.bits}, {"resident_bits_per_element", p.resident_bits},
                                                              {"delta_ppl_pct", p.delta_ppl_pct}, {"kl", p.kl}, {"top1", p.top1}, {"pareto", p.pareto}}
                                             : nlohmann::json{{"method", p.method}, {"bits_per_element", nullptr}, {"resident_bits_per_element", nullptr},
                                                              {"delta_ppl_pct", nullptr}, {"kl", nullptr}, {"top1", nullptr}, {"pareto", false},
                                                              {"error", p.error}});
    fmt::print("{}\n", json_text(j));
    return 0;
  }
  fmt::print("model {}  protocol {}  ctx {}  window {}  windows {}  text {}\n", model_name, o.protocol, eval.ctx, eval.window, n_windows,
             text_path);
  fmt::print("{:<50} {:>9} {:>9} {:>8} {:>10} {:>7}  {}\n", "method", "bits/elem", "res. bits", "dPPL %", "KL", "top-1", "pareto");
  for (const auto& p : points)
    if (p.error.empty())
      fmt::print("{:<50} {:>9.3f} {:>9.3f} {:>8.3f} {:>10.3e} {:>7.4f}  {}\n", p.method, p.bits, p.resident_bits, p.delta_ppl_pct, p.kl,
                 p.top1, p.pareto ? "*" : "");
    else
      fmt::print("{:<50} failed: {}\n", p.method, p.error);
  if (rate == rd::Rate::Coded)
    fmt::print(
        "(sorted by bits per element: the actual coded size of K and V, metadata included; res. bits: the memory the caches hold "
        "(nbytes); dPPL, KL and top-1 against the exact fp32 cache on the same tokens; * = Pareto frontier on (bits, KL): no other "
        "row has fewer or equal bits and lower or equal KL)\n");
  else
    fmt::print(
        "(sorted by res. bits: the memory the caches hold (nbytes) per element of K and V; bits/elem: the actual coded size; dPPL, "
        "KL and top-1 against the exact fp32 cache on the same tokens; * = Pareto frontier on (res. bits, KL): no other row has "
        "fewer or equal resident bits and lower or equal KL)\n");
  return 0;
}

}  // namespace

Runner add_rd(CLI::App& app) {
  auto o = std::make_shared<RdOptions>();
  add_model_options(app, o->model, o->tokenizer);
  app.add_option("--text", o->text, "text to score (default: tinystories_val.txt beside the model)");
  app.add_option("--methods", o->methods,
                 "families (expanded to their usual settings: " + join(rd::default_families(), ", ") +
                     ") and/or full specs run as given, e.g. 'kivi,vq:bits=2;cachegen:bits=4,schedule=off' (default: every family)");
  app.add_option("--protocol", o->protocol, "reuse or stream (see `eval`)")->capture_default_str();
  add_engine_options(app, o->eng);
  app.add_option("--ctx", o->ctx, "reuse: context tokens; stream: tokens prefilled per window")
      ->capture_default_str()
      ->transform(integer_in(0, std::numeric_limits<int>::max()));
  app.add_option("--window", o->window, "tokens per window, BOS included")->capture_default_str()->transform(integer_in(2, std::numeric_limits<int>::max()));
  app.add_option("--chunk", o->chunk, "prefill chunk size")->capture_default_str()->transform(integer_in(1, std::numeric_limits<int>::max()));
  app.add_option("--windows", o->windows, "windows scored (fewer if the text is shorter)")->capture_default_str()->transform(integer_in(1, 1 << 20));
  app.add_option("--threads", o->threads,
                 "threads that run a window's settings side by side, each with a copy of the model (0 = every core); the table does "
                 "not depend on it")
      ->capture_default_str()
      ->transform(integer_in(0, 1024));
  app.add_flag("--json", o->json,
               "print JSON: {model, protocol, results: [{method, bits_per_element, resident_bits_per_element, delta_ppl_pct, kl, top1, "
               "pareto}]}");
  app.add_option("--plot", o->plot, "write the rate-distortion curves (KL against bits) as an SVG file");
  return [o] { return run_rd(*o); };
}

}  // namespace vqcli
