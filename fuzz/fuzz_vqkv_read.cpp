// libFuzzer target: the .vqkv reader (format/vqkv.hpp) on arbitrary bytes.
// Checks: only vq::FormatError escapes (never a crash, an out-of-bounds read under ASan, or an
// allocation beyond what the input justifies); inspect and load agree on what they accept; a file
// that loads re-serialises to exactly its own bytes (the writer is deterministic and the reader
// accepts only what the writer would produce, block order, tables and all). Each input is tried
// twice: as given, and with every checksum recomputed, so mutations reach the block decoders
// behind the checksums instead of stopping at them.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <span>
#include <vector>

#include "veloxquant/core/error.hpp"
#include "veloxquant/format/vqkv.hpp"
#include "../tests/format/vqkv_test_util.hpp"

namespace {

void check(std::span<const std::uint8_t> in) {
  const std::size_t size = in.size();
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
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  check({data, size});
  if (size >= 16) {
    std::vector<std::uint8_t> fixed(data, data + size);
    vqtest::fix_checksums(fixed);
    check(fixed);
  }
  return 0;
}
