// libFuzzer target: the .vqkv reader (format/vqkv.hpp) on arbitrary bytes.
// Checks: only vq::FormatError escapes (never a crash, an out-of-bounds read under ASan, or an
// allocation beyond what the input justifies); inspect and load agree on what they accept; a file
// that loads re-serialises to exactly its own bytes (the writer is deterministic and the reader
// accepts only what the writer would produce, block order, tables and all).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "veloxquant/core/error.hpp"
#include "veloxquant/format/vqkv.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> in(data, size);
  bool inspected = false;
  vq::VqkvInfo info;
  try {
    info = vq::inspect_prompt_cache(in);
    inspected = true;
  } catch (const vq::FormatError&) {
  }
  try {
    const vq::PromptCache pc = vq::deserialize_prompt_cache(in);
    if (!inspected) std::abort();  // load accepted what inspect refused
    const auto again = vq::serialize_prompt_cache(pc.caches, pc.metadata, {.chunk_tokens = info.chunk_tokens});
    if (again.size() != size || !std::equal(again.begin(), again.end(), in.begin())) std::abort();
  } catch (const vq::FormatError&) {
    // inspect does not decode the rANS payloads, so it may accept a file whose payload is corrupt.
  }
  return 0;
}
