// The --model / --tokenizer options shared by every subcommand that runs the llama2.c model.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

namespace vqcli {

inline void add_model_options(CLI::App& app, std::string& model, std::string& tokenizer) {
  app.add_option("--model", model, "llama2.c checkpoint (default: stories260K.bin in $VELOXQUANT_MODEL_DIR, ./models, ../shared/models)");
  app.add_option("--tokenizer", tokenizer, "llama2.c tokenizer (default: tok512.bin, looked up like --model)");
}

}  // namespace vqcli
