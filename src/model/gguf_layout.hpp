// What the GGUF writer and reader agree on: the format's numbers (value types, ggml tensor types,
// magic, alignment) and llama.cpp's tensor names for a llama-architecture model. docs/gguf.md.
#pragma once
#include <cstdint>
#include <string>

namespace vq::gguf {

inline constexpr char kMagic[4] = {'G', 'G', 'U', 'F'};
inline constexpr std::uint32_t kVersion = 3;
inline constexpr std::uint64_t kDefaultAlignment = 32;

// Metadata value types (gguf_type).
enum ValueType : std::uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

// Tensor element types (ggml_type) this code knows.
enum TensorType : std::uint32_t { kTensorF32 = 0, kTensorF16 = 1, kTensorQ8_0 = 8 };
inline constexpr std::uint64_t kQ8BlockValues = 32, kQ8BlockBytes = 34;  // f16 scale + 32 int8

// llama.cpp's vocabulary token types.
enum TokenType : std::int32_t { kTokNormal = 1, kTokUnknown = 2, kTokControl = 3, kTokByte = 6 };

// SentencePiece's visible space, U+2581 "▁", in UTF-8.
inline constexpr const char* kSpaceMark = "\xE2\x96\x81";

inline std::string block_tensor(int layer, const char* what) { return "blk." + std::to_string(layer) + "." + what + ".weight"; }

}  // namespace vq::gguf
