// safetensors files (Hugging Face's tensor container) for K/V exchange: `compress --kv` reads one,
// `decompress -o` writes one.
//
// Format: u64 little-endian N, then N bytes of JSON {"name": {"dtype": "F32"|"F16"|"BF16",
// "shape": [...], "data_offsets": [begin, end]}, ..., "__metadata__": {"key": "value"}}, then the
// data; offsets count from the first byte after the JSON. We read and write the three float dtypes
// a KV cache holds and rank-4 tensors [B, H, S, D].
//
// KV naming (ours, documented in docs/format.md): layer i's keys and values are
// `layers.{i}.keys` and `layers.{i}.values`, for i = 0 .. n-1 with none missing.
#pragma once
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "veloxquant/core/tensor.hpp"

namespace vq {

struct KVPair {
  Tensor keys, values;
};

// Every tensor of the file by name, and its __metadata__. Throws IoError (unreadable) or
// FormatError (malformed header, unknown dtype, a rank other than 4, a shape or offset that is not a
// non-negative integer, dimensions above 2^32 or whose non-zero ones multiply past 2^63 bytes,
// offsets outside the data or overlapping, sizes that disagree with the shape).
std::map<std::string, Tensor> read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata = nullptr);
// Metadata bytes that are not UTF-8 are written as U+FFFD (the header is JSON).
void write_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// The layers of a KV file named as above; FormatError when a name is missing, unexpected, or K and V
// of a layer disagree (B, H, S or dtype).
std::vector<KVPair> read_kv_safetensors(const std::string& path, std::map<std::string, std::string>* metadata = nullptr);
void write_kv_safetensors(const std::string& path, const std::vector<KVPair>& layers,
                          const std::map<std::string, std::string>& metadata = {});

}  // namespace vq
