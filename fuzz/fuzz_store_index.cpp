// libFuzzer target: the prefix store's index blobs (store/prefix_chunks.hpp), read from a store
// anyone may write: decode_directory and decode_chunk_sizes on arbitrary bytes. Checks: only
// vq::FormatError escapes; what decodes keeps its bounds and survives an encode/decode round trip.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "veloxquant/core/error.hpp"
#include "veloxquant/store/prefix_chunks.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> bytes(data, size);
  try {
    const vq::ChunkDirectory d = vq::decode_directory(bytes);
    if (d.chunk_tokens < 1 || d.entries.size() > vq::kMaxDirectoryEntries) std::abort();
    const vq::ChunkDirectory again = vq::decode_directory(vq::encode_directory(d));
    if (again.chunk_tokens != d.chunk_tokens || again.entries.size() != d.entries.size()) std::abort();
    for (std::size_t i = 0; i < d.entries.size(); ++i)
      if (again.entries[i].key != d.entries[i].key || again.entries[i].level != d.entries[i].level ||
          again.entries[i].model != d.entries[i].model || again.entries[i].bytes != d.entries[i].bytes ||
          again.entries[i].widths != d.entries[i].widths)
        std::abort();
  } catch (const vq::FormatError&) {
  }
  try {
    const auto sizes = vq::decode_chunk_sizes(bytes);
    if (sizes.size() > vq::kMaxChunkSizes) std::abort();
    for (const int c : sizes)
      if (c < 1) std::abort();
    if (vq::decode_chunk_sizes(vq::encode_chunk_sizes(sizes)) != sizes) std::abort();
  } catch (const vq::FormatError&) {
  }
  return 0;
}
