// veloxquant demo: the main job (README's first command ends with it). Compresses the real model's
// context with our method, the reference's CacheGen (as the reference runs it, and at its best
// setting) and the strongest peers, on the same windows, and prints one compact table and one
// sentence saying what the best row buys, plus where the rate-distortion picture was written.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "commands.hpp"
#include "model_options.hpp"
#include "numeric_options.hpp"
#include "rd_report.hpp"
#include "veloxquant/core/atomic_file.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/eval/evaluator.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_table.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"

namespace vqcli {

namespace {

// The rows and what each stands for: the method table's demo settings (methods/method_table.hpp),
// baseline first, then ours, the reference's and the peers' (docs/quality.md, "Rate-distortion").
const std::vector<vq::MethodSetting>& demo_methods() {
  static const std::vector<vq::MethodSetting> rows = vq::default_demo_methods();
  return rows;
}

// The quality budget "the best row" is chosen under: the fewest coded bits with at most this
// perplexity cost.
constexpr double kBudgetDeltaPplPct = 1.0;

struct DemoOptions {
  std::string model, tokenizer, text, plot = "veloxquant_demo_rd.svg";
  int windows = 16;
};

// Resident bits per element: the memory the method's caches hold (KVCache::nbytes, buffers as
// allocated) after prefilling one context, per element of K and V. (When the evaluator reports
// resident_bits_per_element itself, this is the place to switch to it.)
double resident_bits(vq::Transformer& model, const std::string& method, std::span<const int> context, int chunk) {
  auto caches = vq::make_caches(method, model);
  for (std::size_t s = 0; s < context.size(); s += static_cast<std::size_t>(chunk))
    (void)model.forward(context.subspan(s, std::min(context.size() - s, static_cast<std::size_t>(chunk))), caches);
  double bytes = 0, elements = 0;
  for (const auto& c : caches) {
    if (c->offset() == 0) continue;
    bytes += static_cast<double>(c->nbytes());
    elements += static_cast<double>(c->batch() * c->kv_heads() * c->offset() * (c->key_dim() + c->value_dim()));
  }
  return elements > 0 ? 8.0 * bytes / elements : 0.0;
}

// Without a model (none found where `eval` looks): say where to get one, and show what each method
// stores and how far it moves synthetic LLM-like K/V, as `eval` does.
int run_synthetic(const std::vector<std::string>& methods, const std::string& why) {
  fmt::print(stderr, "veloxquant: no model: {}\n", why);
  fmt::print(stderr, "veloxquant: running the caches on synthetic LLM-like K/V instead (no quality numbers without a model)\n");
  const auto results = vq::evaluate_synthetic(methods, 1024);
  fmt::print("SYNTHETIC K/V (4 layers x 8 heads x 1024 tokens x D=128), not a model\n");
  fmt::print("{:<44} {:>10} {:>7} {:>12}  {}\n", "method", "bits fixed", "x fp16", "rel. MSE", "what");
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    fmt::print("{:<44} {:>10.3f} {:>7.2f} {:>12.3e}  {}\n", r.method, r.bits_per_element_fixed, 16.0 / r.bits_per_element_fixed,
               r.relative_mse, demo_methods()[i].note);
  }
  return 0;
}

int run_demo(const DemoOptions& o) {
  vq::EvalOptions eval;
  eval.protocol = vq::EvalProtocol::Reuse;  // CacheGen's setting: a context is compressed, then reused
  eval.ctx = 256;
  eval.window = 512;
  eval.chunk = 64;
  std::vector<std::string> methods;
  for (const auto& m : demo_methods()) methods.push_back(m.spec);
  if (!o.plot.empty()) {
    const auto dir = std::filesystem::path(o.plot).parent_path();
    if (!dir.empty() && !std::filesystem::is_directory(dir))
      throw vq::IoError(fmt::format("{}: cannot write the plot (no such directory {})", o.plot, dir.string()));
  }
  if (!o.model.empty() && !std::filesystem::is_regular_file(o.model))
    throw vq::IoError(fmt::format("{}: cannot open model (no such file)", o.model));
  std::string tokenizer = o.tokenizer.empty() ? beside_model(o.model, "tok512.bin") : o.tokenizer;
  std::string text_arg = o.text.empty() ? beside_model(o.model, "tinystories_val.txt") : o.text;
  vq::ModelFiles files;
  try {
    files = vq::resolve_model_files(optional_path(o.model), optional_path(tokenizer));
  } catch (const vq::IoError& e) {
    if (!o.model.empty() || !o.tokenizer.empty()) throw;  // an explicit path that is wrong is an error
    return run_synthetic(methods, e.what());
  }
  vq::Transformer model(vq::Checkpoint::load(files.model.string()));
  const vq::Tokenizer tok = vq::Tokenizer::load(files.tokenizer.string(), model.config().vocab_size);
  eval.window = std::min(eval.window, model.config().seq_len);
  eval.ctx = std::min(eval.ctx, eval.window / 2);
  eval.validate(model.config().seq_len);
  eval.max_tokens = static_cast<std::int64_t>(eval.window - eval.ctx) * o.windows;
  const std::string text_path = text_path_or_default(text_arg);
  const std::string text = read_text(text_path, static_cast<std::size_t>(o.windows) * static_cast<std::size_t>(eval.window) * 16);
  const std::vector<int> tokens = tok.encode(text, /*bos=*/false);

  const auto start = std::chrono::steady_clock::now();
  const auto results = vq::evaluate(model, tokens, methods, eval);
  // Resident size after one context (BOS + the first ctx - 1 tokens, as the first window's).
  std::vector<int> context{1};
  context.insert(context.end(), tokens.begin(), tokens.begin() + std::min<std::ptrdiff_t>(eval.ctx - 1, std::ssize(tokens)));
  std::vector<double> resident;
  for (const auto& m : methods) resident.push_back(resident_bits(model, m, context, eval.chunk));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::int64_t n_windows = results.empty() ? 0 : results[0].tokens / (eval.window - eval.ctx);

  const vq::ModelConfig& mc = model.config();
  fmt::print("veloxquant demo: {} ({} layers, {} KV heads of {}), {} windows of {}: a {}-token context is compressed,\n"
             "the next {} tokens are scored with it against the exact fp32 cache ({:.0f} s)\n\n",
             files.model.filename().string(), mc.n_layers, mc.n_kv_heads, mc.head_size(), n_windows,
             std::filesystem::path(text_path).filename().string(), eval.ctx, eval.window - eval.ctx, seconds);
  fmt::print("{:<44} {:>7} {:>9} {:>7} {:>8} {:>10} {:>7}  {}\n", "method", "coded", "resident", "x fp16", "dPPL %", "KL", "top-1",
             "what");
  std::vector<rd::Point> points;
  std::optional<std::size_t> best, reference;
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const double bits = r.bits_per_element_coded;
    const double dppl = std::abs(r.delta_ppl_pct) < 5e-4 ? 0.0 : r.delta_ppl_pct;  // no "-0.000"
    fmt::print("{:<44} {:>7.3f} {:>9.3f} {:>7.2f} {:>8.3f} {:>10.3e} {:>7.4f}  {}\n", r.method, bits, resident[i], 16.0 / bits, dppl,
               r.kl, r.top1, demo_methods()[i].note);
    // Named fields: a positional list put dPPL in resident_bits and top-1 in kl once resident_bits
    // was added to Point (the picture's frontier and tooltips then read the wrong columns).
    points.push_back({.method = r.method, .bits = bits, .resident_bits = resident[i], .delta_ppl_pct = r.delta_ppl_pct, .kl = r.kl,
                      .top1 = r.top1});
    if (r.method == "cachegen:flush=per_call") reference = i;
    if (r.method != "fp16" && r.delta_ppl_pct <= kBudgetDeltaPplPct &&
        (!best || bits < results[*best].bits_per_element_coded))
      best = i;
  }
  fmt::print("(coded: bits per element of K and V as stored, metadata included; resident: bits per element the caches hold in memory;\n"
             " x fp16: 16 / coded; dPPL, KL and top-1 against the exact fp32 cache on the same tokens)\n\n");
  if (best) {
    const auto& b = results[*best];
    std::string vs;
    if (reference) {
      const auto& r = results[*reference];
      vs = fmt::format("; the reference's CacheGen as it runs stores {:.2f} bits for {:.2f} %", r.bits_per_element_coded, r.delta_ppl_pct);
    }
    fmt::print("Best row: {} keeps the context in {:.2f} bits per element, {:.1f}x smaller than fp16, for {:.2f} % perplexity "
               "(the fewest bits within {:.0f} %){}.\n",
               b.method, b.bits_per_element_coded, 16.0 / b.bits_per_element_coded, b.delta_ppl_pct, kBudgetDeltaPplPct, vs);
  } else {
    fmt::print("No method stays within {:.0f} % perplexity on this text.\n", kBudgetDeltaPplPct);
  }
  if (!o.plot.empty()) {
    rd::mark_pareto(points);
    const std::string title = fmt::format("{}: KL vs bits per element (reuse, ctx {}, window {}, {} windows)",
                                          files.model.filename().string(), eval.ctx, eval.window, n_windows);
    vq::write_file_atomically(o.plot, rd::plot_svg(points, title));
    fmt::print("Rate-distortion picture (KL against bits, every row): {}\n", o.plot);
  }
  return 0;
}

}  // namespace

Runner add_demo(CLI::App& app) {
  auto o = std::make_shared<DemoOptions>();
  add_model_options(app, o->model, o->tokenizer);
  app.add_option("--text", o->text, "text to score (default: tinystories_val.txt beside the model)");
  app.add_option("--windows", o->windows, "windows scored (each: 256 context tokens compressed, the next 256 scored)")
      ->capture_default_str()
      ->transform(integer_in(1, 1 << 20));
  app.add_option("--plot", o->plot, "where to write the rate-distortion picture (SVG); '' for none")->capture_default_str();
  return [o] { return run_demo(*o); };
}

}  // namespace vqcli
