// Where to find the default model (stories260K.bin) and tokenizer (tok512.bin) when the user did
// not name them: $VELOXQUANT_MODEL_DIR, then ./models, then ../shared/models (relative to the
// current directory), first directory holding the file wins. A GGUF model (gguf.hpp) carries its
// own vocabulary: no tokenizer file is looked up or read for it.
#pragma once
#include <filesystem>
#include <optional>
#include <vector>

#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/tokenizer.hpp"

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
  std::filesystem::path model, tokenizer;  // tokenizer empty for a GGUF model
};
// Explicit paths win; a missing one is looked up as above. Throws IoError saying where it looked
// and how to get the files (karpathy/tinyllamas on Hugging Face) when the lookup fails. When the
// model is a GGUF file the tokenizer is neither looked up nor kept (its vocabulary is in the file).
ModelFiles resolve_model_files(const std::optional<std::filesystem::path>& model,
                               const std::optional<std::filesystem::path>& tokenizer);

struct LoadedModel {
  Checkpoint checkpoint;
  Tokenizer tokenizer;
};
// The weights and vocabulary of resolved files: a GGUF model from its one file, a llama2.c
// checkpoint with its tokenizer file (sized by the checkpoint's vocab_size).
LoadedModel load_model(const ModelFiles& files);

}  // namespace vq
