// The identity fuzz_store_blob decodes its input as (model, levels, chunk index, prefix hash,
// tokens), shared with the seed writer (make_corpus.cpp) so the valid seeds pass every check and
// the fuzzer starts inside the decoders.
#pragma once
#include <array>
#include <cstdint>
#include <string>

namespace vqfuzz {

inline constexpr std::uint64_t kBlobModel = 0x5eed5eed5eed5eedULL;
inline constexpr std::uint64_t kBlobChain = 0xc4a1c4a1c4a1c4a1ULL;
inline constexpr int kBlobIndex = 1;
inline constexpr std::array<int, 4> kBlobTokens{5, 6, 7, 8};
inline constexpr int kBlobLayers = 2, kBlobHeads = 4, kBlobDim = 8;  // q4_0 needs rows of 32
// Levels that decode without a model (vq from the data).
inline const std::array<std::string, 4> kBlobLevels{"fp16", "fp32", "cachegen:bits=4,group=4", "vq:bits=2"};

}  // namespace vqfuzz
