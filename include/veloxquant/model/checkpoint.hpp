// Checkpoint: the weights of a llama2.c model (Llama 2 architecture, float32), read from a file.
//
// Two on-disk layouts are accepted; both are little-endian and hold float32 weights row-major,
// every matrix stored as PyTorch's nn.Linear weight, i.e. [out_features, in_features].
//
// Legacy layout (llama2.c export.py "legacy_export", what run.c reads):
//   int32 dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len     (28 bytes)
//   token_embedding [vocab, dim]
//   rms_att [L, dim], wq [L, dim, dim], wk [L, kv_dim, dim], wv [L, kv_dim, dim], wo [L, dim, dim]
//   rms_ffn [L, dim], w1 [L, hidden, dim], w2 [L, dim, hidden], w3 [L, hidden, dim]
//   rms_final [dim]
//   freq_cis_real [seq_len, head_size/2], freq_cis_imag [seq_len, head_size/2]   (skipped: RoPE is
//                                                                                 recomputed)
//   wcls [vocab, dim]  only when the header's vocab_size is negative; a positive vocab_size means
//                      the classifier is the token embedding (shared weights).
//
// Version-1 layout (export.py "version1_export"):
//   uint32 magic 0x616b3432 ("ak42" read as a little-endian uint32), int32 version = 1,
//   int32 dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len, uint8 shared_classifier,
//   zero padding up to byte 256; then
//   rms_att (per layer), rms_ffn (per layer), rms_final, token_embedding,
//   wq, wk, wv, wo (each for all layers), w1, w2, w3 (each for all layers),
//   wcls [vocab, dim] only when shared_classifier == 0.
//   (Version 2, int8 Q8_0 weights, is rejected with a FormatError.)
//
// kv_dim = dim * n_kv_heads / n_heads; head_size = dim / n_heads. The file size must equal exactly
// what the header implies; anything else (truncation, trailing bytes, absurd or inconsistent
// dimensions) throws FormatError before any weight is read.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace vq {

enum class CheckpointLayout { Legacy, Version1 };

struct ModelConfig {
  int dim = 0;             // residual stream width
  int hidden_dim = 0;      // FFN width
  int n_layers = 0;
  int n_heads = 0;         // query heads
  int n_kv_heads = 0;      // key/value heads (grouped-query attention when < n_heads)
  int vocab_size = 0;      // always positive here
  int seq_len = 0;         // maximum context the model was trained for
  bool shared_classifier = true;  // classifier weights == token embedding
  // Per-head width of q, k and v when it is not dim / n_heads (a GGUF file's attention.key_length,
  // e.g. a model whose heads were padded, docs/gguf.md); 0 (every llama2.c file): dim / n_heads.
  // wq is then [L, q_dim, dim] and wo [L, dim, q_dim].
  int head_dim = 0;

  int head_size() const { return head_dim ? head_dim : dim / n_heads; }
  int q_dim() const { return n_heads * head_size(); }
  int kv_dim() const { return head_size() * n_kv_heads; }
  bool operator==(const ModelConfig&) const = default;
};

struct Checkpoint {
  ModelConfig config;
  CheckpointLayout layout = CheckpointLayout::Legacy;
  std::vector<float> token_embedding;  // [vocab, dim]
  std::vector<float> rms_att;          // [L, dim]
  std::vector<float> wq;               // [L, q_dim, dim]
  std::vector<float> wk;               // [L, kv_dim, dim]
  std::vector<float> wv;               // [L, kv_dim, dim]
  std::vector<float> wo;               // [L, dim, q_dim]
  std::vector<float> rms_ffn;          // [L, dim]
  std::vector<float> w1;               // [L, hidden, dim]
  std::vector<float> w2;               // [L, dim, hidden]
  std::vector<float> w3;               // [L, hidden, dim]
  std::vector<float> rms_final;        // [dim]
  std::vector<float> wcls;             // [vocab, dim]; empty when shared_classifier
  // xxHash64 of the file it was read from (model/gguf.hpp's model_file_fingerprint); 0 when it was
  // not read from a file. What a vq profile names (vq/profile.hpp): make_caches checks it.
  std::uint64_t file_fingerprint = 0;

  // The classifier matrix [vocab, dim] (the embedding when shared).
  const float* classifier() const { return config.shared_classifier ? token_embedding.data() : wcls.data(); }

  // Read a checkpoint file in either layout (detected from the magic). Throws IoError when the file
  // cannot be read, FormatError when its contents are malformed.
  static Checkpoint load(const std::string& path);
  // Parse checkpoint bytes; `name` only labels error messages.
  static Checkpoint parse(std::span<const std::byte> bytes, const std::string& name = "checkpoint");
};

// Throws FormatError (prefixed with `name`) unless the dimensions are sane and consistent:
// all positive, dim divisible by n_heads into an even head size, n_kv_heads dividing n_heads,
// and each below a generous cap (so sizes cannot overflow).
void validate_model_config(const ModelConfig& config, const std::string& name);

}  // namespace vq
