// libFuzzer target: a prefix store's level blob (store/prefix_chunks.hpp) as a reader takes it from a
// store anyone may write, with no MAC in front (the sealed store's check is not what is fuzzed):
// decode_chunk_codes at each level of store_blob_fuzz_identity.hpp. Checks: only vq::FormatError
// escapes; what decodes holds kBlobTokens.size() tokens per layer (rows or codes; the layer count is the
// loader's to check against its model).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "store_blob_fuzz_identity.hpp"
#include "veloxquant/core/error.hpp"
#include "veloxquant/methods/method_spec.hpp"
#include "veloxquant/store/prefix_chunks.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> bytes(data, size);
  for (const auto& level : vqfuzz::kBlobLevels) {
    const std::string canon = vq::MethodSpec::parse(level).to_string();
    try {
      const vq::ChunkCodes c = vq::decode_chunk_codes(bytes, vqfuzz::kBlobModel, canon, vqfuzz::kBlobIndex, vqfuzz::kBlobChain,
                                                      vqfuzz::kBlobTokens);
      for (std::size_t l = 0; l < c.kv.size(); ++l) {
        if (l < c.vq.size() && c.vq[l]) {
          if (c.vq[l]->codes.tokens != static_cast<std::int64_t>(vqfuzz::kBlobTokens.size())) std::abort();
          continue;
        }
        if (c.kv[l].keys.dim(2) != static_cast<std::int64_t>(vqfuzz::kBlobTokens.size())) std::abort();
      }
    } catch (const vq::FormatError&) {
    }
  }
  return 0;
}
