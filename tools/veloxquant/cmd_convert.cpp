// veloxquant convert: a llama2.c checkpoint and its tokenizer as one llama-architecture GGUF file
// (model/gguf.hpp, docs/gguf.md), optionally with every head padded to --pad-head dims.
#include <fmt/core.h>

#include "commands.hpp"
#include "numeric_options.hpp"
#include "output_paths.hpp"
#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/gguf.hpp"
#include "veloxquant/model/tokenizer.hpp"

namespace vqcli {

Runner add_convert(CLI::App& app) {
  struct Options {
    std::string model, tokenizer, out;
    int pad_head = 0;
  };
  auto o = std::make_shared<Options>();
  app.add_option("model", o->model, "llama2.c checkpoint (.bin)")->required();
  app.add_option("--tokenizer", o->tokenizer, "llama2.c tokenizer (.bin) of the model")->required();
  app.add_option("-o,--output", o->out, "output GGUF file")->required();
  app.add_option("--pad-head", o->pad_head, "widen every head to P dims (a multiple of the head size; same function, docs/gguf.md)")
      ->transform(integer_in(1, 65536));
  return [o] {
    vq::require(!same_file(o->model, o->out), "-o {} names the input model: give another path", o->out);
    vq::require(!same_file(o->tokenizer, o->out), "-o {} names the tokenizer: give another path", o->out);
    const vq::Checkpoint ck = vq::Checkpoint::load(o->model);
    const vq::Tokenizer tok = vq::Tokenizer::load(o->tokenizer, ck.config.vocab_size);
    vq::write_gguf(o->out, ck, tok, vq::GgufWriteOptions{o->pad_head});
    const auto& c = ck.config;
    fmt::print("wrote {}: llama GGUF v3, float32, {} layers, dim {}, {} heads of {}{}, vocabulary {}\n", o->out, c.n_layers, c.dim,
               c.n_heads, o->pad_head ? o->pad_head : c.head_size(), o->pad_head ? fmt::format(" (padded from {})", c.head_size()) : "",
               c.vocab_size);
    return 0;
  };
}

}  // namespace vqcli
