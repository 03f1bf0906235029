// GGUF: llama-architecture model files as llama.cpp reads them, written from a llama2.c checkpoint
// and read back into one (weights + vocabulary). Field-by-field layout, the metadata keys, the
// tensor names and the head padding: docs/gguf.md.
//
// Writer: GGUF v3, little-endian, float32 tensors (matrices F16 or Q8_0 on request), alignment 32. Matrices keep llama2.c's
// [out, in] row-major layout, which GGUF describes as ne = {in, out}. llama2.c's RoPE rotates
// adjacent pairs, which is llama.cpp's "normal" RoPE for the llama architecture, so q/k are
// written unpermuted. A shared classifier writes no output.weight (llama.cpp then reuses
// token_embd.weight). Vocabulary spaces become U+2581, as SentencePiece stores them.
//
// Head padding (pad_head = P > head_size, P a multiple of head_size): each head's q/k/v rows are
// spread over P rows so that RoPE pair j of the original head becomes pair j * P / head_size of
// the padded one (same frequency theta^(-2j/head_size)); the other rows are zero; wq is scaled by
// sqrt(P / head_size) so q.k / sqrt(P) equals the original q.k / sqrt(head_size); wo's columns are
// spread the same way. The padded model computes the same function (up to float rounding).
//
// Reader: a decoder of untrusted bytes. Every count and size is bounded by the file's size before
// anything is allocated; an unknown architecture, an unsupported tensor type (F32, F16 and Q8_0
// are read; Q8_0 and F16 are converted to float32), a missing or misshapen tensor, inconsistent
// metadata, truncation or trailing garbage throw FormatError with one line saying what is wrong.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "veloxquant/model/checkpoint.hpp"
#include "veloxquant/model/tokenizer.hpp"

namespace vq {

// How the 2-D tensors (embedding, projections, classifier) are stored; norms are always F32, as
// llama.cpp's converter keeps them. F16 rounds to nearest even; Q8_0 is ggml's block format (per 32
// values of a row: an F16 scale d = max|x| / 127, then 32 int8 round(x / d)).
enum class GgufMatrixType { F32, F16, Q8_0 };

struct GgufWriteOptions {
  int pad_head = 0;  // 0 (or head_size): heads as they are; else widen each head to this many dims
  GgufMatrixType matrices = GgufMatrixType::F32;
};

// `ck` with every head widened to P dims as described above (config.head_dim = P); P == head_size
// returns it unchanged. InvalidArgument unless P is a multiple of the head size.
Checkpoint pad_heads(const Checkpoint& ck, int P);

// The GGUF bytes of `ck` with `tok`'s vocabulary (tok.vocab_size() must equal the model's).
// Throws InvalidArgument on a bad pad_head or a vocabulary of the wrong size.
std::vector<std::byte> gguf_bytes(const Checkpoint& ck, const Tokenizer& tok, const GgufWriteOptions& options = {});
// Write them to `path` atomically.
void write_gguf(const std::string& path, const Checkpoint& ck, const Tokenizer& tok, const GgufWriteOptions& options = {});

struct GgufModel {
  Checkpoint checkpoint;  // layout Legacy; config.head_dim set when the heads are not dim / n_heads
  Tokenizer tokenizer;
};

// Whether the file at `path` starts with the GGUF magic (false when it cannot be read).
bool is_gguf_file(const std::string& path);
// Parse GGUF bytes; `name` labels error messages.
GgufModel parse_gguf(std::span<const std::byte> bytes, const std::string& name = "gguf");
// Read a GGUF file: IoError when unreadable, FormatError when malformed.
GgufModel load_gguf(const std::string& path);

// What a KV cache of a model needs without its weights (the prompt cache on any GGUF llama.cpp
// runs: K-quant weights, other architectures, RoPE bases and tokenizers this reader does not
// load): the attention shape from `<arch>.block_count`, `.attention.head_count[_kv]`,
// `.embedding_length` and `.attention.key_length` / `.value_length`, and a fingerprint of the whole
// file (xxHash64), which names it in a store. The tensor infos are checked (names, dims, offsets),
// not their data.
struct GgufShape {
  std::string architecture;
  int n_layers = 0, n_kv_heads = 0, key_length = 0, value_length = 0;
  double rope_freq_base = 10000.0;  // <arch>.rope.freq_base (llama.cpp's default when absent)
  std::set<std::uint32_t> tensor_types;  // ggml type ids present
  std::uint64_t fingerprint = 0;
};
GgufShape parse_gguf_shape(std::span<const std::byte> bytes, const std::string& name = "gguf");
GgufShape load_gguf_shape(const std::string& path);  // the file mapped, not read into memory
// xxHash64 (seed 0) of any model file's bytes, GGUF or llama2.c (for GGUF, GgufShape::fingerprint):
// the model a vq profile names (vq/profile.hpp).
std::uint64_t model_file_fingerprint(const std::string& path);
// The model of a GGUF whose weights our reader takes, or nullopt with the reason in `why` (the
// reader's FormatError). A file with tensor types other than F32, F16 and Q8_0 (K-quants) is
// refused from its shape alone, never read into memory only to be refused. `shape`: the file's
// load_gguf_shape.
std::optional<GgufModel> load_gguf_if_ours(const std::string& path, const GgufShape& shape, std::string& why);

}  // namespace vq
