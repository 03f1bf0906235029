#include "veloxquant/model/model_files.hpp"

#include <cstdlib>
#include <string>

#include <fmt/core.h>

#include "veloxquant/core/error.hpp"
#include "veloxquant/model/gguf.hpp"

namespace vq {

std::vector<std::filesystem::path> model_search_dirs() {
  std::vector<std::filesystem::path> dirs;
  if (const char* env = std::getenv("VELOXQUANT_MODEL_DIR"); env && *env) dirs.emplace_back(env);
  dirs.emplace_back("models");
  dirs.emplace_back(std::filesystem::path("..") / "shared" / "models");
  return dirs;
}

std::optional<std::filesystem::path> find_model_file(const std::string& filename) {
  for (const auto& dir : model_search_dirs()) {
    std::error_code ec;
    const auto p = dir / filename;
    if (std::filesystem::is_regular_file(p, ec)) return p;
  }
  return std::nullopt;
}

std::optional<std::filesystem::path> find_default_model() { return find_model_file(kDefaultModelFile); }
std::optional<std::filesystem::path> find_default_tokenizer() { return find_model_file(kDefaultTokenizerFile); }

ModelFiles resolve_model_files(const std::optional<std::filesystem::path>& model, const std::optional<std::filesystem::path>& tokenizer) {
  auto resolve = [](const std::optional<std::filesystem::path>& given, const char* file, const char* flag) {
    if (given) return *given;
    if (auto found = find_model_file(file)) return *found;
    std::string where;
    for (const auto& d : model_search_dirs()) where += (where.empty() ? "" : ", ") + d.string();
    throw IoError(fmt::format("{} not found (looked in {}): download stories260K.bin and tok512.bin from karpathy/tinyllamas "
                              "(Hugging Face, folder stories260K) and pass {} or set VELOXQUANT_MODEL_DIR",
                              file, where, flag));
  };
  const auto model_path = resolve(model, kDefaultModelFile, "--model");
  if (is_gguf_file(model_path.string())) return ModelFiles{model_path, {}};
  return ModelFiles{model_path, resolve(tokenizer, kDefaultTokenizerFile, "--tokenizer")};
}

LoadedModel load_model(const ModelFiles& files) {
  if (is_gguf_file(files.model.string())) {
    GgufModel m = load_gguf(files.model.string());
    return LoadedModel{std::move(m.checkpoint), std::move(m.tokenizer)};
  }
  Checkpoint ck = Checkpoint::load(files.model.string());
  const int vocab = ck.config.vocab_size;
  return LoadedModel{std::move(ck), Tokenizer::load(files.tokenizer.string(), vocab)};
}

}  // namespace vq
