// A compressed, persistent prompt cache in front of an unmodified llama-server (issue 30).
//
// What a reader needs first:
// - The proxy listens on 127.0.0.1 and forwards every request to the llama-server at `upstream`,
//   unchanged (streaming included). Completion requests with a prompt (POST /completion,
//   /completions, /v1/completions, and chat: /chat/completions, /v1/chat/completions) also go through
//   the cache, each on a server slot of its own (`slots` of them, from `slot` on; the server's -np
//   must cover them): a request takes the free slot whose tokens share the longest prefix with its
//   prompt (waiting while every slot is busy) and holds it until its slot is stored, so requests run
//   side by side, one per slot; the store sees one load or put at a time:
//   1. the prompt's tokens (the server's own /tokenize; chat messages through its /apply-template);
//   2. the longest stored prefix of them, in whole chunks (store/prefix_loader.hpp: a hash chain
//      over token chunks, per chunk the best level stored; the loader never recomputes here: what
//      is not restored the server computes itself);
//   3. when that is longer than what the slot already holds, a llama.cpp slot file of those tokens
//      (format/llama_state.hpp) written into the server's --slot-save-path and restored into the slot;
//   4. the request, with id_slot and cache_prompt set, to the server;
//   5. afterwards the slot saved, read back, and its whole chunks not stored yet put at `levels`.
// - A fault anywhere in 1-3 or 5 (a store outage, a corrupt or foreign blob, a refused restore) is
//   one log line and the request is served as it would be without the cache (the slot erased
//   first when a restore failed): never from a wrong cache. Blobs are checked by the store's own
//   decoder (model fingerprint, level, chunk index, tokens).
// - The slot files' layout (K/V type, V transposed or not, streams) is the server's: read once at
//   start from a one-token prompt (nothing predicted) saved from the slot.
// Its design and measurements: docs/prompt_cache.md.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace vq {

struct PromptCacheOptions {
  std::string upstream;                   // the llama-server, http://127.0.0.1:PORT
  std::string listen_host = "127.0.0.1";  // where the proxy listens
  int listen_port = 8081;                 // 0: a free port (port() says which)
  std::string model;                      // the GGUF the server runs (its shape and fingerprint)
  std::string slot_dir;                   // the server's --slot-save-path
  std::string store = "file:./.vqkv-store";
  std::vector<std::string> levels;        // what a put stores (method specs); empty: prompt_cache_default_levels
  int chunk_tokens = 256;
  int slot = 0;                           // the first server slot the cache restores into
  int slots = 1;                          // slots it uses: slot .. slot + slots - 1 (one request each)
  std::function<void(const std::string&)> log;  // one line per request and per fault (stderr when unset)
};

// What the proxy did for one request (also logged): the prompt's tokens, those restored from the
// store, those stored afterwards, and whether the cache was bypassed (and why).
struct PromptCacheEvent {
  int prompt_tokens = 0, restored_tokens = 0, stored_tokens = 0;  // stored: tokens of chunks newly stored
  std::uint64_t stored_bytes = 0;                                  // blobs and index written for them
  double load_ms = 0, write_ms = 0, restore_ms = 0;  // the store's load, writing the slot file, the server's restore
  std::string note;
};

// The levels a proxy stores when none are given: `vq:bits=2` (within 1 % of the exact cache's
// perplexity), with per-head blocks (block=head) for heads of 64 or more: there one whole-row
// transform of 4 KV heads costs 4x the decode's multiply-adds, for a KL within 1.4x and the same
// perplexity (docs/prompt_cache.md, "Levels").
std::vector<std::string> prompt_cache_default_levels(int head_size);

class PromptCacheProxy {
 public:
  // Loads the model's shape, opens the store, probes the server's slot layout. Throws
  // InvalidArgument / IoError / FormatError with one clear line (no server, no --slot-save-path, a
  // GGUF that is not the server's, ...).
  explicit PromptCacheProxy(PromptCacheOptions options);
  ~PromptCacheProxy();
  PromptCacheProxy(const PromptCacheProxy&) = delete;
  PromptCacheProxy& operator=(const PromptCacheProxy&) = delete;

  // Binds the listening socket (IoError when it cannot); port() is then known.
  void bind();
  int port() const;
  // Serves until stop() (from another thread or a signal handler's thread).
  void serve();
  void stop();
  // Waits until no request is in the cache and nothing is being stored (a request's slot is stored
  // after its reply went out), on every slot: for benchmarks and tests that time the next request alone.
  void wait_idle();
  // The levels it stores, as the store names them (store/prefix_chunks.hpp's store_level: a
  // profile by its hash, not its path).
  const std::vector<std::string>& levels() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vq
