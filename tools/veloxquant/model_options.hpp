// The --model / --tokenizer options shared by every subcommand that runs the llama2.c model, and
// the text those subcommands read.
#pragma once
#include <filesystem>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/core/input_file.hpp"
#include "numeric_options.hpp"
#include "veloxquant/eval/evaluator.hpp"
#include "veloxquant/model/model_files.hpp"

namespace vqcli {

inline void add_model_options(CLI::App& app, std::string& model, std::string& tokenizer) {
  app.add_option("--model", model, "llama2.c checkpoint or llama GGUF file (default: stories260K.bin in $VELOXQUANT_MODEL_DIR, ./models, ../shared/models)");
  app.add_option("--tokenizer", tokenizer, "llama2.c tokenizer (default: tok512.bin, looked up like --model; not used with a GGUF model)");
}

// An option's path, or none when the option was not given ("").
inline std::optional<std::filesystem::path> optional_path(const std::string& s) {
  if (s.empty()) return std::nullopt;
  return std::filesystem::path(s);
}

// A file named `name` beside an explicit --model ("" when there is none or no such file).
inline std::string beside_model(const std::string& model, const char* name) {
  if (model.empty()) return {};
  const auto p = std::filesystem::path(model).parent_path() / name;
  return std::filesystem::is_regular_file(p) ? p.string() : std::string();
}

// `path`, or tinystories_val.txt where the model files are looked up; InvalidArgument when neither.
inline std::string text_path_or_default(const std::string& path) {
  if (!path.empty()) return path;
  const auto found = vq::find_model_file("tinystories_val.txt");
  vq::require(found.has_value(), "--text is required (no tinystories_val.txt beside the model files)");
  return found->string();
}

// The text of `path`, cut at the last paragraph break before max_bytes (0: all of it), so that a
// short run tokenizes only what it needs. IoError when the file cannot be read.
inline std::string read_text(const std::string& path, std::size_t max_bytes = 0) {
  std::string text = vq::read_input_text(path, "text");
  if (max_bytes > 0 && text.size() > max_bytes) {
    const auto cut = text.rfind("\n\n", max_bytes);
    text.resize(cut == std::string::npos ? max_bytes : cut);
  }
  return text;
}

// `eval`/`rd`: --engine, --prefill, --llama-server, --server-threads.
struct EngineOptions {
  std::string engine = "ours", prefill, llama_server;
  int server_threads = 2;
};
inline void add_engine_options(CLI::App& app, EngineOptions& o) {
  app.add_option("--engine", o.engine,
                 "who computes the logits: ours (veloxquant's engine) or llama (a llama-server started on 127.0.0.1 running --model X.gguf; "
                 "reuse protocol: the context's state taken from llama.cpp, compressed, restored, the rest scored)")
      ->capture_default_str();
  app.add_option("--prefill", o.prefill,
                 "reuse: method (the context prefilled through the method's cache; ours' default) or exact (prefilled exactly, then "
                 "compressed: what a prompt cache stores; --engine llama's only setting)");
  app.add_option("--llama-server", o.llama_server, "--engine llama: the llama-server binary (default .llama/bin/llama-server, else on PATH)");
  app.add_option("--server-threads", o.server_threads, "--engine llama: llama-server's -t")
      ->capture_default_str()
      ->transform(integer_in(1, 1024));
}

// `--engine llama` in a veloxquant built without cpp-httplib: one line.
[[noreturn]] inline void no_llama_engine() {
  throw vq::InvalidArgument("--engine llama: this veloxquant was built without cpp-httplib (libcpp-httplib-dev), which it needs to drive llama-server");
}

// `eval`/`rd --engine` checked, and `--prefill` (reuse): "" is the engine's own (method for ours;
// exact for llama, which computes the context itself and has no other).
inline bool prefill_is_exact(const std::string& prefill, const std::string& engine, vq::EvalProtocol protocol) {
  vq::require(engine == "ours" || engine == "llama", "--engine {}: give ours or llama", engine);
  vq::require(prefill.empty() || prefill == "exact" || prefill == "method", "--prefill {}: give exact or method", prefill);
  if (engine == "llama") {
    vq::require(prefill != "method", "--prefill method: --engine llama prefills the context exactly (llama.cpp computes it); give --prefill exact or leave it out");
    return protocol == vq::EvalProtocol::Reuse;
  }
  return prefill == "exact";
}

}  // namespace vqcli
