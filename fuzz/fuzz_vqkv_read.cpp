// libFuzzer target: the .vqkv reader (format/vqkv.hpp) on arbitrary bytes.
// Checks: only vq::FormatError escapes (never a crash, an out-of-bounds read under ASan, or an
// allocation beyond what the input justifies); inspect accepts whatever load accepts; a file that
// loads re-serialises to a file that loads to the same caches and re-serialises to itself (the
// first round may differ: a reader accepts any valid frequency table, the writer builds its own). Each input is tried
// twice: as given, and with every checksum recomputed, so mutations reach the block decoders
// behind the checksums instead of stopping at them. Every input is also loaded as a prefix. Run with
// -timeout=1: reading costs O(input size + output size) (docs/format.md, "Cost"), so a slow input
// is a bug. Inputs with vq layers built from a model load without it (a FormatError naming its
// fingerprint), but inspect still decodes their CODES blocks.
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
    const vq::VqkvSaveOptions opt{.chunk_tokens = info.chunk_tokens};
    std::vector<std::uint8_t> once;
    try {
      once = vq::serialize_prompt_cache(pc.caches, pc.metadata, opt);
    } catch (const vq::InvalidArgument&) {
      // The writer refuses a vq block that would code to fewer bytes than a reader accepts for its
      // codes (kVqMaxCodesPerByte); a reader accepts the same codes coded less tightly.
      return;
    }
    const vq::PromptCache again = vq::deserialize_prompt_cache(once);
    if (again.caches.size() != pc.caches.size() || again.metadata != pc.metadata) std::abort();
    for (std::size_t l = 0; l < pc.caches.size(); ++l) {
      const auto a = pc.caches[l]->state(), b = again.caches[l]->state();
      if (pc.caches[l]->offset() != again.caches[l]->offset() || !a.keys.bit_equal(b.keys) || !a.values.bit_equal(b.values)) std::abort();
    }
    if (vq::serialize_prompt_cache(again.caches, again.metadata, opt) != once) std::abort();
  } catch (const vq::FormatError&) {
    // inspect does not decode the rANS payloads, so it may accept a file whose payload is corrupt.
  }
  // A prefix load, which accepts a file cut at a block boundary and bounds the header by what the
  // prefix needs (the last byte picks the prefix: usually part of a checksum, so arbitrary).
  try {
    (void)vq::deserialize_prompt_cache(in, {.max_tokens = in.empty() ? 0 : in.back() % 40});
  } catch (const vq::FormatError&) {
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
