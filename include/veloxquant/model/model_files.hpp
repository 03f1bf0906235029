// Where to find the default model (stories260K.bin) and tokenizer (tok512.bin) when the user did
// not name them: $VELOXQUANT_MODEL_DIR, then ./models, then ../shared/models (relative to the
// current directory), first directory holding the file wins.
#pragma once
#include <filesystem>
#include <optional>
#include <vector>

namespace vq {

inline constexpr const char* kDefaultModelFile = "stories260K.bin";
inline constexpr const char* kDefaultTokenizerFile = "tok512.bin";

// The candidate directories in search order (VELOXQUANT_MODEL_DIR only when set and non-empty).
std::vector<std::filesystem::path> model_search_dirs();
// The first candidate directory holding a regular file `filename`, joined with it.
std::optional<std::filesystem::path> find_model_file(const std::string& filename);
std::optional<std::filesystem::path> find_default_model();      // stories260K.bin
std::optional<std::filesystem::path> find_default_tokenizer();   // tok512.bin

struct ModelFiles {
  std::filesystem::path model, tokenizer;
};
// Explicit paths win; a missing one is looked up as above. Throws IoError saying where it looked
// and how to get the files (karpathy/tinyllamas on Hugging Face) when the lookup fails.
ModelFiles resolve_model_files(const std::optional<std::filesystem::path>& model,
                               const std::optional<std::filesystem::path>& tokenizer);

}  // namespace vq
