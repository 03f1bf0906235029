// KV cache methods scored with llama.cpp's own logits (`eval`/`rd --engine llama`; issue 30).
//
// What a reader needs first:
// - The engine is a real llama-server this object starts on 127.0.0.1 (a free port, its own slot
//   folder, stopped by pid when the object goes), running the GGUF file the user gives: any model
//   llama.cpp runs, whatever our own engine can load.
// - Only the reuse protocol (eval/evaluator.hpp), per window of `window` tokens (BOS first):
//   1. the server evaluates the context (`ctx` tokens) into its slot, with an F32 cache (so the
//      state is exact), and saves the slot (a llama.cpp state file, format/llama_state.hpp);
//   2. the reference: the next `window - ctx` tokens are scored one request each (teacher forcing:
//      the prompt is the window up to the token before, n_predict 1, the full distribution over
//      the vocabulary as `n_probs`, taken before sampling), the server reusing its slot;
//   3. per method: the saved K/V of every layer go through fresh caches of the method (fed in
//      chunks of `chunk`, as a prefill feeds them), their contents are written back as a state
//      file, restored into the slot, and step 2 is repeated on that slot.
// - llama-server evaluates at least one token of every prompt: the first scored prediction
//   recomputes the context's last token from the restored cache, so that one token's K/V are
//   exact here while our engine's reuse protocol keeps it compressed (1 of `ctx`; docs/quality.md,
//   "The two engines").
// - Bits are those of the method's caches holding the context (eval's CacheBits), as in `eval`.
#pragma once
#include <functional>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/eval/evaluator.hpp"
#include "veloxquant/format/llama_state.hpp"
#include "veloxquant/model/gguf.hpp"

namespace vq {

struct LlamaEngineOptions {
  std::string server;  // the llama-server binary ("" : .llama/bin/llama-server when present, else on PATH)
  std::string model;   // the GGUF file it runs
  int context = 512;   // the server's context (-c): at least the window
  int threads = 2;     // the server's -t
  std::function<void(const std::string&)> log;  // progress lines (stderr when unset)
};

class LlamaEngine {
 public:
  // Starts the server and waits until it answers (IoError with its log's last line when it cannot
  // start or load the model).
  explicit LlamaEngine(LlamaEngineOptions options);
  ~LlamaEngine();
  LlamaEngine(const LlamaEngine&) = delete;
  LlamaEngine& operator=(const LlamaEngine&) = delete;

  // The text's tokens as llama.cpp cuts them (no BOS), and its BOS id.
  std::vector<int> tokenize(const std::string& text) const;
  int bos() const;
  // The GGUF's shape (model/gguf.hpp), read once at start; its fingerprint (xxHash64 of the file)
  // is what vq profiles name.
  const GgufShape& gguf_shape() const;
  // The exact K/V llama.cpp computes for `context` (BOS first): the slot's saved state (F32).
  LlamaState context_state(std::span<const int> context);
  // eval::evaluate's contract in the reuse protocol, with llama.cpp computing every logit; the
  // windows are cut as evaluate cuts them (BOS, then window - 1 text tokens). `threads` is ignored
  // (one slot, one request at a time). Throws InvalidArgument for the stream protocol, and without
  // exact_prefill (llama.cpp computes the context exactly; EvalOptions::exact_prefill is the same
  // protocol in our engine).
  std::vector<MethodResult> evaluate(const std::vector<int>& tokens, const std::vector<std::string>& methods, const EvalOptions& options);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vq
