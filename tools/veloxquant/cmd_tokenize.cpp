// veloxquant tokenize: the token ids the model's own tokenizer (model/tokenizer.hpp) gives a text,
// the ones eval scores and generate prefills, so another implementation (llama.cpp, tests/llama)
// can be checked against them token for token. No BOS unless --bos (eval's windows add it).
#include <optional>
#include <string>

#include <fmt/core.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "json_out.hpp"
#include "model_options.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/model/model_files.hpp"
#include "veloxquant/model/tokenizer.hpp"

namespace vqcli {

Runner add_tokenize(CLI::App& app) {
  struct Options {
    std::string model, tokenizer, text, prompt;
    bool bos = false, json = false;
  };
  auto o = std::make_shared<Options>();
  add_model_options(app, o->model, o->tokenizer);
  auto* text = app.add_option("--text", o->text, "file whose whole content is tokenized");
  auto* prompt = app.add_option("--prompt", o->prompt, "text given on the command line");
  text->excludes(prompt);
  app.add_flag("--bos", o->bos, "prepend BOS (1), as generate does before a prompt");
  app.add_flag("--json", o->json, "print {\"tokens\": [...], \"count\": N} instead of the ids on one line");
  return [o, text, prompt] {
    vq::require(text->count() + prompt->count() == 1, "give the text to tokenize: --text FILE or --prompt TEXT");
    auto opt = [](const std::string& s) { return s.empty() ? std::nullopt : std::optional<std::filesystem::path>(s); };
    // A tokenizer not given explicitly is looked for beside an explicit model first (as eval does).
    const std::string tok_path = o->tokenizer.empty() ? beside_model(o->model, "tok512.bin") : o->tokenizer;
    const vq::LoadedModel loaded = vq::load_model(vq::resolve_model_files(opt(o->model), opt(tok_path)));
    const std::string input = text->count() ? read_text(o->text) : o->prompt;
    const std::vector<int> ids = loaded.tokenizer.encode(input, o->bos);
    if (o->json)
      fmt::print("{}\n", json_text({{"tokens", ids}, {"count", ids.size()}}, -1));  // one line: a whole text is long
    else
      fmt::print("{}\n", fmt::join(ids, " "));
    return 0;
  };
}

}  // namespace vqcli
