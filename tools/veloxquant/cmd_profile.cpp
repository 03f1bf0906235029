// veloxquant profile: run a model over text and write the CacheGen paper codec's profiled tables
// (peers/cachegen_paper_profile.hpp documents the file), for `cachegen_paper:profile=PATH`.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/core.h>

#include "commands.hpp"
#include "model_options.hpp"
#include "numeric_options.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/core/input_file.hpp"
#include "veloxquant/model/cachegen_profile.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/tokenizer.hpp"
#include "veloxquant/model/transformer.hpp"

namespace vqcli {

namespace {

struct ProfileCliOptions {
  std::string model, tokenizer, text, out = "cachegen_paper.prof", method = "cachegen_paper";
  std::int64_t tokens = 65536, skip = 0;
  int window = 256;
};

// Mean code length in bits per symbol that `counts` cost under `tables` (the profile's own data).
double mean_bits(const std::vector<std::vector<std::uint32_t>>& counts, const std::vector<vq::FrequencyTable>& tables) {
  double bits = 0, n = 0;
  for (std::size_t c = 0; c < counts.size(); ++c) {
    bits += tables[c].cost_bits(counts[c]);
    for (auto k : counts[c]) n += k;
  }
  return n > 0 ? bits / n : 0.0;
}

int run_profile(const ProfileCliOptions& o) {
  const vq::MethodSpec spec = vq::MethodSpec::parse(o.method);
  vq::require(spec.kind == vq::MethodSpec::Kind::CachegenPaper,
              "--method must be a cachegen_paper spec (it sets group and bins), got '{}'", o.method);
  if (!o.model.empty() && !std::filesystem::is_regular_file(o.model))
    throw vq::IoError(fmt::format("{}: cannot open model (no such file)", o.model));
  // A tokenizer not given explicitly is looked for beside an explicit model first (as eval does).
  std::string tokenizer = o.tokenizer;
  if (tokenizer.empty() && !o.model.empty()) {
    const auto beside = std::filesystem::path(o.model).parent_path() / vq::kDefaultTokenizerFile;
    if (std::filesystem::is_regular_file(beside)) tokenizer = beside.string();
  }
  const vq::ModelFiles files = vq::resolve_model_files(optional_path(o.model), optional_path(tokenizer));
  vq::LoadedModel loaded = vq::load_model(files);
  vq::Transformer model(std::move(loaded.checkpoint));
  const vq::Tokenizer tok = std::move(loaded.tokenizer);
  vq::require(o.window >= 2 && o.window <= model.config().seq_len,
              "--window must be in 2..{} (the model's seq_len), got {}", model.config().seq_len, o.window);

  std::string text_path = o.text;
  if (text_path.empty()) {
    const auto beside = files.model.parent_path() / "tinystories_val.txt";
    vq::require(std::filesystem::is_regular_file(beside), "--text is required (no tinystories_val.txt beside the model)");
    text_path = beside.string();
  }
  std::string text = vq::read_input_text(text_path, "text");
  // Tokenize only what the run uses (text runs about 4 bytes per token here; 8 is a margin), cut
  // at a paragraph break so no word is split.
  const std::size_t want = static_cast<std::size_t>(o.skip + o.tokens) * 8 + 4096;
  if (text.size() > want) {
    const auto cut = text.rfind("\n\n", want);
    text.resize(cut == std::string::npos ? want : cut);
  }
  const std::vector<int> tokens = tok.encode(text, /*bos=*/false);
  vq::require(static_cast<std::int64_t>(tokens.size()) > o.skip,
              "{} holds {} tokens, not more than --skip {}", text_path, tokens.size(), o.skip);
  const auto windows = vq::profile_windows(tokens, o.window, o.skip, o.tokens);
  const vq::CachegenPaperProfile profile = vq::profile_cachegen_paper(model, windows, spec.cachegen_paper);
  profile.save(o.out);

  const auto size = std::filesystem::file_size(o.out);
  fmt::print("profiled {} text tokens in {} windows of up to {} ({} positions with BOS), skipping {}, of {} through {}\n",
             profile.tokens - windows.size(), windows.size(), o.window, profile.tokens, o.skip, text_path, files.model.filename().string());
  fmt::print("wrote {} ({} bytes): {} layers, group {}, bins {}/{}/{}\n", o.out, size, profile.n_layers(), profile.group, profile.bins[0],
             profile.bins[1], profile.bins[2]);
  fmt::print("{:>5} {:>4} {:>9} {:>9} {:>14} {:>14}\n", "layer", "K/V", "channels", "delta q", "anchor bits", "delta bits");
  for (int l = 0; l < profile.n_layers(); ++l)
    for (int kv = 0; kv < 2; ++kv) {
      const auto& t = profile.layers[static_cast<std::size_t>(l)][kv];
      fmt::print("{:>5} {:>4} {:>9} {:>9} {:>14.3f} {:>14.3f}\n", l, kv == 0 ? "K" : "V", t.channels, fmt::format("+-{}", t.delta_max_q),
                 mean_bits(t.anchor_counts, t.anchor), mean_bits(t.delta_counts, t.delta));
    }
  fmt::print("(bits per symbol on the profiled tokens themselves; use it with --methods 'cachegen_paper:profile={}')\n", o.out);
  return 0;
}

}  // namespace

Runner add_profile(CLI::App& app) {
  auto o = std::make_shared<ProfileCliOptions>();
  add_model_options(app, o->model, o->tokenizer);
  app.add_option("--text", o->text, "text to profile (default: tinystories_val.txt beside the model)");
  app.add_option("-o,--out", o->out, "profile file to write")->capture_default_str();
  app.add_option("--tokens", o->tokens, "text tokens to profile")->capture_default_str()->transform(integer_in(1, kMaxCount));
  app.add_option("--skip", o->skip, "text tokens to skip first (keep evaluated text out of the profile)")
      ->capture_default_str()
      ->transform(integer_in(0, kMaxCount));
  app.add_option("--window", o->window, "tokens per forward pass, BOS included (as eval's windows)")
      ->capture_default_str()
      ->transform(integer_in(2, std::numeric_limits<int>::max()));
  app.add_option("--method", o->method, "cachegen_paper spec whose group and bins to profile for")->capture_default_str();
  return [o] { return run_profile(*o); };
}

}  // namespace vqcli
