// llama.cpp's sequence state (format/llama_state.hpp) built while its rows arrive.
//
// What a reader must know first:
// - One KVCache per layer (begin()): its update() converts each chunk's rows into place in the
//   file's own layout (the state's type; cell i's K row holds every head's D values; V transposed
//   when the state's cache is: one row per V element, one value per cell). Nothing dense is kept
//   beside it: a prefix loaded into these caches is the file's body already.
// - The buffers are kept from one begin() to the next (grown when a longer prefix comes), so a host
//   that restores again and again (the prompt cache) touches no new memory per restore: no page
//   faults, no float32 copy of the prefix, no assembly pass. release() hands them back.
// - bytes() and write() give exactly what write_llama_state gives for the same rows (it is built on
//   this class); write() writes over the file already at the path (its pages rewritten in place, not
//   freed by a truncation first) and then cuts it to size.
// - The layer caches only take rows: update_and_fetch and state() of them are refused.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/cache/kv_cache.hpp"
#include "veloxquant/format/llama_state.hpp"

namespace vq {

class LlamaStateImage {
 public:
  // `layout`: the state's type, V layout, streams, sequence id and token packing (its tokens and
  // layers are not used); `model`: layers, KV heads, key and value dims. Throws InvalidArgument on a
  // layout write_llama_state refuses or a model with a zero or negative count.
  LlamaStateImage(const LlamaState& layout, const LlamaStateModel& model);
  ~LlamaStateImage();
  LlamaStateImage(const LlamaStateImage&) = delete;
  LlamaStateImage& operator=(const LlamaStateImage&) = delete;

  // Empty layer caches (offset 0) for up to `cells` cells (1 .. 2^31-1). The vector is the image's
  // own (a loader may hold it by reference); valid until the next begin(). Memory is taken for the
  // cells a layer is told to expect (KVCache::expect_tokens, which a prefix loader calls with the
  // stored prefix's length before feeding it), else for `cells` at the first update.
  std::vector<std::shared_ptr<KVCache>>& begin(std::int64_t cells);
  // Cells every layer holds. Throws InvalidArgument when the layers hold different counts.
  std::int64_t cells() const;
  // The state's bytes: `tokens` (saved with it, as write_llama_state saves LlamaState::tokens), then
  // cells() cells. Throws InvalidArgument when no cell was fed.
  std::vector<std::uint8_t> bytes(std::span<const std::int32_t> tokens) const;
  // The same bytes into the file at `path` (created when absent). Throws IoError.
  void write(const std::string& path, std::span<const std::int32_t> tokens) const;
  // Bytes of memory the buffers hold.
  std::size_t nbytes() const;
  // Frees the buffers (the next begin() allocates again).
  void release();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vq
